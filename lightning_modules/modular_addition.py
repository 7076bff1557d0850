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
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.theory.modular_addition import frequency_coverage, gamma_star, margins, neuron_spectra, norm_2_kplus1
from featlearn.validation import (NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check_args,
                                  check_memory)


def theorem_width(k: int, p: int) -> int:
    """``m = 2^(2k-2) (p - 1)``: the chapter's width, Theorem 4.9's lower bound ``2^(2k-1)(p-1)/2`` exactly.

    Example:
        >>> theorem_width(4, 47), theorem_width(3, 97), theorem_width(5, 23)
        (2944, 1536, 5632)
    """
    return 2 ** (2 * k - 2) * (p - 1)


class FourierMLP(FeatureLearningModule):
    """The chapter's MLP (module docstring).

    Args:
        width: neurons m (null: ``2^(2k-2)(p-1)``, the chapter's). power: the activation's power (null: k).
        init_scale: std of every weight at initialisation (null: ``1/sqrt(p)``).
        lr: AdamW step size. betas: AdamW's. warmup_steps: linear warm-up of the step size.
        regularizer: ``weight_decay`` (AdamW decay ``lam``) or ``norm`` (``lam ||theta||_{2,k+1}`` added to the
            loss). lam: the chapter's lambda.
        backend: the fused op's (``auto``: Triton on CUDA). input_precision: its GEMMs' on a GPU.
        compile: run the loss under ``torch.compile`` (``null``: never for this method; compiling it was not
            measured). seed: seed of the initialisation.
    """

    datamodule_class = ModularAdditionDataModule
    heatmap_axes = ("neuron", "Fourier mode")
    compiled_loss = "batch_loss"
    # the weights grow under cross-entropy until the decay balances it; a 100x jump in 20 steps is a blow-up
    blowup_factors = {"loss": None, "weight_norm": 100.0}

    def __init__(self, width: PositiveInt | None = None, power: PositiveInt | None = None,
                 init_scale: PositiveFloat | None = None, lr: PositiveFloat = 5e-3,
                 betas: tuple[float, float] = (0.9, 0.98), warmup_steps: NonNegativeInt = 10,
                 regularizer: Literal["weight_decay", "norm"] = "weight_decay", lam: NonNegativeFloat = 0.005,
                 backend: Backend = "auto", input_precision: Precision = "ieee", compile: bool | None = None,
                 seed: int = 0):
        check_args("model", FourierMLP.__init__, locals())
        super().__init__()
        self.save_hyperparameters()
        self._eval: dict[str, list] = {}

    def build(self, dm: ModularAdditionDataModule) -> None:
        hp = self.hparams
        self.k, self.p = dm.k, dm.p
        self.m = hp.width or theorem_width(dm.k, dm.p)
        self.power = hp.power or dm.k
        self.split_sizes = {"val": dm.sizes["val"], "train": dm.sizes["train"]}  # what a whole-split pass sees
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

    def training_step(self, batch, batch_idx):
        loss, logits = self.batch_loss(batch)
        if self.theory_due():
            self.log("train/loss", loss, sync_dist=True)
            self.log("train/acc", (logits.argmax(1) == batch["y"]).float().mean(), sync_dist=True)
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        decay = hp.lam if hp.regularizer == "weight_decay" else 0.0
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=tuple(hp.betas), weight_decay=decay)
        warm = max(1, hp.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def finish_step(self, step: int) -> None:
        if self.theory_due():
            for name, value in self.spectral_metrics().items():
                self.log(f"theory/{name}", value)

    # --- evaluation: the held-out split (dataloader 0) and the whole training split (1) ---------
    def validation_step(self, batch, batch_idx, dataloader_idx: int = 0):
        with torch.no_grad():
            logits = self(batch["a"])
        split = "val" if dataloader_idx == 0 else "train"
        sums = self._eval.setdefault(split, [0.0, 0, 0, math.inf])
        sums[0] += float(F.cross_entropy(logits, batch["y"], reduction="sum"))
        sums[1] += int((logits.argmax(1) == batch["y"]).sum())
        sums[2] += len(batch["y"])
        sums[3] = min(sums[3], float(margins(logits.double(), batch["y"]).min()))

    def on_validation_epoch_end(self) -> None:
        # host sums over each split; several processes each hold a share, summed here with the same collectives
        # on every rank (a rank that saw no batch of a split adds zeros). Under DDP Lightning's sampler pads a
        # split to a multiple of the ranks, so up to ranks - 1 tuples count twice in the sums
        evals, self._eval = self._eval, {}
        if self._trainer is not None and self.trainer.sanity_checking:
            return
        empty = [0.0, 0, 0, math.inf]
        totals = {split: self._all_reduce(torch.tensor(evals.get(split, empty)[:3], dtype=torch.float64))
                  for split in ("val", "train")}
        smallest = self._all_reduce(torch.tensor([min(v[3] for v in [empty, *evals.values()])],
                                                 dtype=torch.float64), "min")
        for split, name in (("val", "val/acc"), ("train", "val/train_acc")):
            if totals[split][2] > 0:
                self.log(name, float(totals[split][1] / totals[split][2]), prog_bar=split == "val")
        if totals["val"][2] > 0:
            self.log("val/loss", float(totals["val"][0] / totals["val"][2]))
        whole = all(totals[s][2] >= n for s, n in self.split_sizes.items())
        if whole and self.power == self.k:  # every tuple seen (not limit_val_batches), the chapter's network
            scale = float(norm_2_kplus1(self.U.detach().double(), self.W.detach().double())) ** (self.k + 1)
            self.log("theory/margin", float(smallest[0]) / scale)
            self.log("theory/gamma_star", gamma_star(self.k, self.p))

    def _all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self._trainer is None or self.trainer.world_size == 1:
            return t
        return self.trainer.strategy.reduce(t.to(self.device), reduce_op=op).cpu()

    # --- theory ---------------------------------------------------------------------------------
    @torch.no_grad()
    def spectral_metrics(self) -> dict[str, float]:
        """The per-neuron Fourier quantities of Theorem 4.9 (module docstring), each neuron weighted by its
        share ``||theta_i||^{k+1} / ||theta||_{2,k+1}^{k+1}`` of the network's scale: under weight decay most
        neurons of the theorem's width shrink to nothing, and their leftover noise says nothing about the
        function the network computes. ``frequencies_used`` counts the neurons above a tenth of an equal share."""
        U, W = self.U.detach().double(), self.W.detach().double()
        s = neuron_spectra(U, W)
        share = (U.square().sum((0, 1)) + W.square().sum(1)).pow((self.power + 1) / 2)  # (q+1)-homogeneous
        share = share / share.sum().clamp_min(1e-300)
        live = share >= 0.1 / len(share)
        used = frequency_coverage(s["frequency"][s["shared"] & live], self.p) > 0
        return {"max_power": float((share * s["power"]).sum()),
                "single_frequency": float((share * s["shared"].double()).sum()),
                "phase_residual": float((share * s["phase_residual"].abs()).sum()),
                "frequencies_used": float(used.double().mean()), "live_neurons": float(live.double().mean())}

    def correlations(self) -> torch.Tensor:
        w = self.W.detach().float()
        return (w / w.norm(dim=1, keepdim=True).clamp_min(1e-30)) @ self.features.T

    def final_metrics(self) -> dict[str, float]:
        out = self.spectral_metrics()
        if self._trainer is not None:  # the last validation's results, where one ran
            for key, name in (("test_acc", "val/acc"), ("train_acc", "val/train_acc"), ("margin", "theory/margin")):
                value = self.logged(name)
                if value is not None:
                    out[key] = float(value)
            if "margin" in out:  # the margin is ~1e-4 at these sizes: its ratio to gamma* is what tables show
                out["margin_ratio"] = out["margin"] / gamma_star(self.k, self.p)
        return out
