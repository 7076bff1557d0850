"""The k-input modular-addition MLP of Shi 2024, Ch. 4 (Li, Liang, Shi, Song, Zhou 2024, arXiv:2402.09469, Eq. 4.2):
``f(theta, a) = sum_i (sum_j u_{i,j}[a_j])^k w_i`` over ``p`` classes, no bias, every weight trained, through the
fused op :func:`~featlearn.kernels.modular_power_mlp.modular_power_mlp`.

Training (the chapter's C.10.1 configuration): cross-entropy, AdamW with betas (0.9, 0.98), lr 5e-3, a linear
warm-up over 10 steps, batch 1024. The chapter's "regularisation strength lambda = 0.005" has two readings,
both offered (``regularizer``): ``weight_decay`` (AdamW's decoupled decay, the chapter's code base and its
Fig. 4.4 caption; the default) and ``norm`` (the explicit ``lambda ||theta||_{2,k+1}`` of Def. 4.1, AdamW
without decay).

Metrics. Every ``log_every_n_steps`` steps: ``train/loss``, ``train/acc`` of the batch. Every validation (the
whole held-out split and the whole training split, in batches): ``val/loss``, ``val/acc``,
``val/train_acc``, and the normalised margin over all ``p^k`` tuples, ``theory/margin`` (the smallest margin
divided by ``||theta||_{2,k+1}^{k+1}``) beside ``theory/gamma_star`` (Lemma 4.10). With the theory metrics:
``theory/max_power`` (the smallest max-normalised power of a neuron's k + 1 vectors; Theorem 4.9 predicts 1),
``theory/single_frequency`` (whether its vectors share one dominant frequency), ``theory/phase_residual``
(``|theta_{u_1} + ... + theta_{u_k} - theta_w|``, predicted 0), each averaged over neurons weighted by their
share of ``||theta||_{2,k+1}^{k+1}`` (weight decay shrinks most neurons of the theorem's width to nothing);
``theory/frequencies_used`` (the share of the ``(p-1)/2`` frequencies some live neuron uses, predicted 1) and
``theory/live_neurons`` (the share of neurons above a tenth of an equal share).
With ``ablation: true``, every whole validation also logs grokking's progress measures (Nanda et al. 2023) for
k inputs, :meth:`FourierMLP.fourier_ablation`: ``theory/restricted_loss`` (all tuples, only the key
frequencies' part of the logits) and ``theory/excluded_loss`` (the training split, that part removed), the key
frequencies being those of the live single-frequency neurons (``theory/key_frequencies`` counts them). It costs
one more pass over every tuple and one over the training split, on every process.
The heat map is each neuron's output weights ``w_i`` against the Fourier modes of ``Z_p``.

Example:
    >>> from featlearn.datamodules.modular_addition import ModularAdditionDataModule
    >>> dm = ModularAdditionDataModule(k=3, p=5, batch_size=16)
    >>> model = FourierMLP(width=12).attach(dm)
    >>> batch = dm.batch(torch.arange(16), "train")
    >>> model(batch["a"]).shape
    torch.Size([16, 5])
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from featlearn.datamodules.modular_addition import ModularAdditionDataModule
from featlearn.kernels.backend import Backend, Precision
from featlearn.kernels.modular_power_mlp import modular_power_mlp
from featlearn.lightning_modules.modular_base import ModularAdditionMethod
from featlearn.theory.modular_addition import (ablation_losses, frequency_coverage, gamma_star,
                                               key_frequency_part, neuron_spectra, norm_2_kplus1)
from featlearn.validation import (NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check_args,
                                  check_memory)


def theorem_width(k: int, p: int) -> int:
    """``m = 2^(2k-2) (p - 1)``: the chapter's width, Theorem 4.9's lower bound ``2^(2k-1)(p-1)/2`` exactly.

    Example:
        >>> theorem_width(4, 47), theorem_width(3, 97), theorem_width(5, 23)
        (2944, 1536, 5632)
    """
    return 2 ** (2 * k - 2) * (p - 1)


class FourierMLP(ModularAdditionMethod):
    """The chapter's MLP (module docstring).

    Args:
        width: neurons m (null: ``2^(2k-2)(p-1)``, the chapter's). power: the activation's power (null: k).
        init_scale: std of every weight at initialisation (null: ``1/sqrt(p)``).
        lr: AdamW step size. betas: AdamW's. warmup_steps: linear warm-up of the step size.
        regularizer: ``weight_decay`` (AdamW decay ``lam``) or ``norm`` (``lam ||theta||_{2,k+1}`` added to the
            loss). lam: the chapter's lambda.
        backend: the fused op's (``auto``: Triton on CUDA). input_precision: its GEMMs' on a GPU.
        compile: run the loss under ``torch.compile`` (``null``: never for this method; compiling it was not
            measured). ablation: log the restricted and excluded losses at every whole validation.
        seed: seed of the initialisation.
    """

    heatmap_axes = ("neuron", "Fourier mode")
    # the weights grow under cross-entropy until the decay balances it; a 100x jump in 20 steps is a blow-up
    blowup_factors = {"loss": None, "weight_norm": 100.0}

    def __init__(self, width: PositiveInt | None = None, power: PositiveInt | None = None,
                 init_scale: PositiveFloat | None = None, lr: PositiveFloat = 5e-3,
                 betas: tuple[float, float] = (0.9, 0.98), warmup_steps: NonNegativeInt = 10,
                 regularizer: Literal["weight_decay", "norm"] = "weight_decay", lam: NonNegativeFloat = 0.005,
                 backend: Backend = "auto", input_precision: Precision = "ieee", compile: bool | None = None,
                 ablation: bool = False, seed: int = 0):
        check_args("model", FourierMLP.__init__, locals())
        super().__init__()
        self.save_hyperparameters()

    def build(self, dm: ModularAdditionDataModule) -> None:
        hp = self.hparams
        self.k, self.p = dm.k, dm.p
        self.m = hp.width or theorem_width(dm.k, dm.p)
        self.power = hp.power or dm.k
        self.remember_splits(dm)
        # ablation evaluates every tuple itself: its own DataModule's split (under --seeds the trainer's is the
        # stack's), kept only then
        self.ablation_data = dm if hp.ablation else None
        # the weights, their gradients and AdamW's two moments, and a step's [B, m] temporaries (the torch path's)
        rows = dm.batch_size or dm.sizes["train"]
        check_memory("model", FourierMLP, {"width": self.m}, 4 * 4 * (dm.k + 1) * dm.p * self.m + 3 * 4 * rows * self.m,
                     f"the MLP at k = {dm.k}, p = {dm.p}, width {self.m} (weights, gradients, AdamW state, a batch)")
        scale = hp.init_scale or 1 / math.sqrt(dm.p)
        gen = torch.Generator().manual_seed(hp.seed)
        self.U = torch.nn.Parameter(torch.randn(dm.k, dm.p, self.m, generator=gen) * scale)
        self.W = torch.nn.Parameter(torch.randn(self.m, dm.p, generator=gen) * scale)
        self.register_ground_truth("features", dm.features.float())

    # --- the model ------------------------------------------------------------------------------
    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return modular_power_mlp(a, self.U, self.W, self.power, backend=self.hparams.backend,
                                 input_precision=self.hparams.input_precision)

    def batch_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the training objective, the batch's logits): cross-entropy, plus ``lam ||theta||_{2,k+1}`` with
        ``regularizer: norm``."""
        logits = self(batch["a"])
        loss = F.cross_entropy(logits, batch["y"])
        if self.hparams.regularizer == "norm":
            loss = loss + self.hparams.lam * norm_2_kplus1(self.U, self.W)
        return loss, logits

    def weight_decay(self) -> float:
        return self.hparams.lam if self.hparams.regularizer == "weight_decay" else 0.0

    def finish_step(self, step: int) -> None:
        if self.theory_due():
            for name, value in self.spectral_metrics().items():
                self.log(f"theory/{name}", value)

    def after_validation(self, whole: bool, smallest_margin: float) -> None:
        if whole and self.power == self.k:  # every tuple seen, the chapter's network
            scale = float(norm_2_kplus1(self.U.detach().double(), self.W.detach().double())) ** (self.k + 1)
            self.log("theory/margin", smallest_margin / scale)
            self.log("theory/gamma_star", gamma_star(self.k, self.p))
        if whole and self.ablation_data is not None:
            for name, value in self.fourier_ablation(self.ablation_data).items():
                self.log(f"theory/{name}", value)

    # --- theory ---------------------------------------------------------------------------------
    @torch.no_grad()
    def neurons(self) -> dict[str, torch.Tensor]:
        """Per neuron: :func:`~featlearn.theory.modular_addition.neuron_spectra`'s quantities, its ``share``
        ``||theta_i||^{q+1} / ||theta||_{2,q+1}^{q+1}`` of the network's scale (the network is (q+1)-homogeneous in
        each neuron, q the power) and whether it is ``live`` (above a tenth of an equal share): under weight decay
        most neurons of the theorem's width shrink to nothing, and their leftover noise says nothing about the
        function the network computes."""
        U, W = self.U.detach().double(), self.W.detach().double()
        out = neuron_spectra(U, W)
        share = (U.square().sum((0, 1)) + W.square().sum(1)).pow((self.power + 1) / 2)
        out["share"] = share / share.sum().clamp_min(1e-300)
        out["live"] = out["share"] >= 0.1 / len(share)
        return out

    def key_frequencies(self) -> torch.Tensor:
        """The distinct frequencies of the live neurons whose k + 1 vectors share one."""
        s = self.neurons()
        return s["frequency"][s["shared"] & s["live"]].unique()

    def spectral_metrics(self) -> dict[str, float]:
        """The per-neuron Fourier quantities of Theorem 4.9 (module docstring), each neuron weighted by its share
        of the network's scale (:meth:`neurons`); ``frequencies_used`` counts the live neurons."""
        s = self.neurons()
        share = s["share"]
        used = frequency_coverage(s["frequency"][s["shared"] & s["live"]], self.p) > 0
        return {"max_power": float((share * s["power"]).sum()),
                "single_frequency": float((share * s["shared"].double()).sum()),
                "phase_residual": float((share * s["phase_residual"].abs()).sum()),
                "frequencies_used": float(used.double().mean()), "live_neurons": float(s["live"].double().mean())}

    @torch.no_grad()
    def fourier_ablation(self, dm: ModularAdditionDataModule) -> dict[str, float]:
        """The restricted loss (over every tuple) and the excluded loss (over ``dm``'s training split) at the
        current key frequencies (:func:`~featlearn.theory.modular_addition.ablation_losses`), in chunks of a batch
        (the size the memory check allows for): one pass over every tuple for the per-residue mean logits, one over
        the training split."""
        frequencies, chunk = self.key_frequencies(), dm.batch_size or dm.sizes["train"]
        sums = torch.zeros(self.p, self.p, dtype=torch.float64, device=self.device)
        for split in ("train", "val"):
            for a, y in _chunks(dm, split, chunk, self.device):
                sums.index_add_(0, y, self(a).double())
        means = sums / self.p ** (self.k - 1)  # every residue holds p^(k-1) tuples
        part = key_frequency_part(means, frequencies)
        excluded, restricted = 0.0, math.nan
        for a, y in _chunks(dm, "train", chunk, self.device):
            out = ablation_losses(means, frequencies, self(a), y, part)
            excluded, restricted = excluded + float(out["excluded"]) * len(y), float(out["restricted"])
        return {"restricted_loss": restricted, "excluded_loss": excluded / dm.sizes["train"],
                "key_frequencies": float(len(frequencies))}

    def correlations(self) -> torch.Tensor:
        w = self.W.detach().float()
        return (w / w.norm(dim=1, keepdim=True).clamp_min(1e-30)) @ self.features.T

    def final_metrics(self) -> dict[str, float]:
        out = {**self.spectral_metrics(), **self.accuracy_results()}
        margin = self.logged("theory/margin") if self._trainer is not None else None
        if margin is not None:  # the margin is ~1e-4 at these sizes: its ratio to gamma* is what tables show
            out["margin"] = float(margin)
            out["margin_ratio"] = out["margin"] / gamma_star(self.k, self.p)
        return out

def _chunks(dm: ModularAdditionDataModule, split: str, chunk: int, device):
    """A split's tuples and labels in order, ``chunk`` at a time, on ``device``."""
    n = dm.sizes[split]
    for start in range(0, n, chunk):
        sample = dm.sample(torch.arange(start, min(n, start + chunk)), split)
        yield sample["a"].to(device), sample["y"].to(device)
