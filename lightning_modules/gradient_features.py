"""A two-layer ReLU network learning gradient features, against fixed features (Shi 2024, Ch. 3 = Shi, Wei, Liang,
NeurIPS 2023, arXiv:2310.20582): Algorithm 1 on the XOR mixture of Gaussians (:class:`GradientFeatureNetwork`) and on
structured parity (:class:`BlockParityGradientFeatures`, the same network on
:class:`~featlearn.datamodules.block_parity.BlockParityDataModule`).

``g(x) = sum_{i <= 4m} a_i ReLU(<w_i, x> - b_i)`` with the symmetric initialisation of Eq. 3.9: for ``i <= m``, ``a_i ~
N(0, sigma_a^2)``, ``w_i ~ N(0, sigma_w^2 I)``, ``b_i = b~``; neurons ``m+1..2m`` are ``(-a, -w, -b)`` of the
first m and ``2m+1..4m`` ``(-a, w, b)`` of the first 2m, so ``g = 0`` at the start; b stays fixed, a and W train
on the hinge loss, a fresh batch every step (Algorithm 1). ``features`` picks what is trained:

* ``learned`` (the chapter's network): step 1 with weight decay ``1 / eta^(1)`` sets ``a, W <- -eta^(1) grad``, so
  ``w_i^(1) = eta^(1) a_i^(0) G(w_i, b_i)`` carries the simplified gradient; then plain steps of ``lr`` on a and W.
  The chapter fixes ``eta^(1)`` and ``sigma_a`` by its constants (Theorem B.23); here ``eta^(1) = step1_scale b~ /
  (s median_i |a_i^(0)| ||G(w_i, b_i)||)`` (the median first gradient ``||grad_{w_i}||``, estimated on 20000
  samples at the start; ``s`` is the data's ``signal_norm``, a centre's ``sqrt(d)`` for the XOR mixture, a block's
  ``sqrt(k)`` for parity), so that a typical first-step neuron reads a signal ``s`` away along its feature at
  ``step1_scale`` times the bias: the same scale, without the unknown constants.
* ``random``: random features, W fixed at its initial value, a trained with ``lr`` from the first step.
* ``ntk``: the network linearised at its initialisation (the neural tangent kernel's model), ``g(x) = sum_i (a_i^(0)
  + da_i) ReLU(u_i) + a_i^(0) 1[u_i > 0] <dw_i, x>`` with ``u_i = <w_i^(0), x> - b_i``, trained with ``lr``.

Logged: ``train/loss``, ``val/error``, ``val/loss``; ``theory/cos_max`` (the worst of the two feature directions'
best ``|cos(w_i, D_j)|``); for ``learned``, after step 1, per bias sign (``pos``: ``b = +b~``, ``neg``: ``-b~``)
``theory/nice_fraction_*`` (Lemma 3.13: the fewest nice neurons over the four signed directions, over m) beside
``theory/p_quarter_*``, a quarter of the least gradient-feature probability p estimated at the start (:func:`~featlearn.theory.gradient_features.
feature_probability` over 2048 fresh initial neurons, with ``gamma`` and ``B_G`` = their median ``||G||``).

Example:
    >>> from featlearn.datamodules.xor_mixture import XORMixtureDataModule
    >>> dm = XORMixtureDataModule(d=16, seed=0)
    >>> model = GradientFeatureNetwork(width=8).attach(dm)
    >>> round(float(model(dm.batch(torch.arange(5), "train")["x"]).abs().max()), 5)  # symmetric start: g = 0
    0.0
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from featlearn.datamodules.block_parity import BlockParityDataModule
from featlearn.datamodules.xor_mixture import XORMixtureDataModule
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.lightning_modules.two_layer_parts import ScheduledGD
from featlearn.theory.gradient_features import feature_probability, nice_counts, simplified_gradients
from featlearn.validation import PositiveFloat, PositiveInt, check_args

_CANDIDATES, _SAMPLES = 2048, 20000  # the start's p estimate: initial neurons, data samples


class GradientFeatureNetwork(FeatureLearningModule):
    """The two-layer network of the gradient feature framework and its fixed-feature baselines (module docstring).

    Args:
        width: m; the network has 4m neurons.
        features: ``learned`` (Algorithm 1), ``random`` (random features) or ``ntk`` (the linearised network).
        sigma_w: the initial weights' standard deviation (default ``1 / sqrt(d)``).
        sigma_a: the initial output weights' standard deviation.
        bias_mult: ``b~`` as a multiple of the data's bias scale (``bias_scale(sigma_w)``; for the XOR mixture App.
            B.5.3's ``sqrt(d log log d) sigma_w sigma``).
        step1_scale: the first step's size (``learned``; module docstring).
        lr: the step size of every later step (and of every step of ``random`` and ``ntk``).
        gamma: the cones' width in the feature metrics (``cos > 1 - gamma``).
        init_seed: the initialisation's seed (default: the data seed).
    """

    datamodule_class = XORMixtureDataModule
    heatmap_axes = ("neuron", "feature direction")

    def __init__(self, width: PositiveInt = 64, features: Literal["learned", "random", "ntk"] = "learned",
                 sigma_w: PositiveFloat | None = None, sigma_a: PositiveFloat = 1.0, bias_mult: PositiveFloat = 1.0,
                 step1_scale: PositiveFloat = 1.0, lr: PositiveFloat = 0.1, gamma: PositiveFloat = 0.1,
                 init_seed: int | None = None):
        check_args("model", GradientFeatureNetwork.__init__, locals())
        super().__init__()
        self.save_hyperparameters()

    def build(self, dm: XORMixtureDataModule | BlockParityDataModule) -> None:
        hp, d, m = self.hparams, dm.d, self.hparams.width
        self.d = d
        sigma_w = 1 / math.sqrt(d) if hp.sigma_w is None else hp.sigma_w
        self.b_tilde = hp.bias_mult * dm.bias_scale(sigma_w)
        gen = torch.Generator().manual_seed(dm.seed if hp.init_seed is None else hp.init_seed)
        w0, a0 = sigma_w * torch.randn(m, d, generator=gen), hp.sigma_a * torch.randn(m, generator=gen)
        W, a = torch.cat([w0, -w0, w0, -w0]), torch.cat([a0, -a0, -a0, a0])
        self.register_buffer("b", torch.cat([torch.full((m,), self.b_tilde), torch.full((m,), -self.b_tilde)]).repeat(2))
        if hp.features == "ntk":
            self.register_buffer("W0", W)
            self.register_buffer("a0", a)
            self.dW, self.da = torch.nn.Parameter(torch.zeros_like(W)), torch.nn.Parameter(torch.zeros_like(a))
        elif hp.features == "random":
            self.register_buffer("W", W)
            self.a = torch.nn.Parameter(a)
        else:
            self.W, self.a = torch.nn.Parameter(W), torch.nn.Parameter(a)
            self.register_buffer("a_start", a.abs())  # |a^(0)|, the nice sets' norm scale after step 1
        self.register_ground_truth("directions", dm.features)
        # the gradient-feature probability p at this initialisation (Definition 3.7), per bias sign
        data = dm.sample(torch.arange(_SAMPLES), "test")  # (seed, index) draws: the split's size does not bound them
        candidates = sigma_w * torch.randn(_CANDIDATES, d, generator=gen)
        grads = [simplified_gradients(candidates, torch.tensor(s * self.b_tilde), data["x"], data["y"]) for s in (1, -1)]
        self.B_G = float(torch.cat(grads).norm(dim=1).median())
        self.p = torch.stack([feature_probability(G, self.directions, hp.gamma, self.B_G) for G in grads])  # [sign, D]
        # the first gradient of neuron i is -a_i G(w_i, b_i) (hinge at g = 0): its median norm sets eta^(1)
        first = simplified_gradients(W[:2 * m], self.b[:2 * m], data["x"], data["y"]).norm(dim=1) * a[:2 * m].abs()
        self.eta1 = hp.step1_scale * self.b_tilde / (dm.signal_norm * max(float(first.median()), 1e-30))
        self.nice_fraction: list[float] | None = None  # per bias sign, after step 1
        self.W_first: torch.Tensor | None = None  # the first layer after step 1

    # --- the network -------------------------------------------------------------------------------
    def weights(self) -> torch.Tensor:
        """The first layer ``[4m, d]`` (for ``ntk``, ``W^(0) + dW``)."""
        return (self.W0 + self.dW if self.hparams.features == "ntk" else self.W).detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hparams.features == "ntk":
            u = x @ self.W0.T - self.b
            return torch.relu(u) @ (self.a0 + self.da) + ((u > 0).to(x.dtype) * self.a0 * (x @ self.dW.T)).sum(1)
        return torch.relu(x @ self.W.T - self.b) @ self.a

    def batch_loss(self, batch: dict) -> torch.Tensor:
        return torch.relu(1 - batch["y"] * self(batch["x"])).mean()

    def training_step(self, batch, batch_idx):
        loss = self.batch_loss(batch)
        if self.theory_due():
            self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return ScheduledGD([{"params": [p for p in self.parameters() if p.requires_grad], "name": "all"}])

    def first_step(self, step: int) -> bool:
        return step == 1 and self.hparams.features == "learned"

    def prepare_step(self, optimizer) -> None:
        first = self.first_step(self.global_step + 1)
        for group in optimizer.param_groups:  # step 1: weight decay 1/eta^(1), i.e. theta <- -eta^(1) grad
            group["lr"], group["decay"] = (self.eta1, 0.0) if first else (self.hparams.lr, 1.0)

    def finish_step(self, step: int) -> None:
        if self.first_step(step):  # Lemma 3.13 after step 1: nice neurons per signed direction and bias sign
            m, signed = self.hparams.width, torch.cat([self.directions, -self.directions])
            self.W_first = self.W.detach().clone()  # for the lottery ticket (Lemma 3.14), read by the experiment
            scale = self.eta1 * self.a_start  # |eta^(1) l'(0) a_i^(0)|, l'(0) = -1 (hinge)
            self.nice_fraction = [float(nice_counts(self.W.detach()[part], scale[part], signed, self.hparams.gamma,
                                                    self.B_G).min()) / m
                                  for part in (slice(0, m), slice(m, 2 * m))]  # b = +b~, then b = -b~

    # --- evaluation --------------------------------------------------------------------------------
    def validation_step(self, batch, batch_idx):
        with torch.no_grad():
            g = self(batch["x"])
        n = len(batch["y"])
        self.log("val/error", (g * batch["y"] <= 0).float().mean(), sync_dist=True, batch_size=n)
        self.log("val/loss", torch.relu(1 - batch["y"] * g).mean(), sync_dist=True, batch_size=n)

    def correlations(self) -> torch.Tensor:
        """``cos(w_i, D_j)`` of the first 2m neurons (the others repeat their weights) ``[2m, directions]``."""
        w = self.weights()[:2 * self.hparams.width]
        return w @ self.directions.T / w.norm(dim=1, keepdim=True).clamp_min(1e-30)

    def theory(self) -> dict[str, float]:
        """``cos_max``; per bias sign (``pos``: ``b = +b~``, ``neg``: ``-b~``) a quarter of the least gradient-feature
        probability, ``p_quarter_*``, and after step 1 of ``learned`` the least nice share, ``nice_fraction_*``."""
        out = {"cos_max": float(self.correlations().abs().max(0).values.min())}
        for k, sign in enumerate(("pos", "neg")):
            out[f"p_quarter_{sign}"] = float(self.p[k].min()) / 4
            if self.nice_fraction is not None:
                out[f"nice_fraction_{sign}"] = self.nice_fraction[k]
        return out

    def on_validation_epoch_end(self) -> None:
        for name, value in self.theory().items():
            self.log(f"theory/{name}", value)

    def final_metrics(self) -> dict[str, float]:
        out = self.theory()
        for name in ("val/error", "val/loss"):
            value = self.logged(name)
            if value is not None:
                out[name.removeprefix("val/")] = float(value)
        return out


class BlockParityGradientFeatures(GradientFeatureNetwork):
    """:class:`GradientFeatureNetwork` on structured parity (Sec. 3.4.2): the gradient features are the block
    directions ``D_j`` and ``bias_mult`` multiplies ``sqrt(r k) sigma_w``
    (:meth:`~featlearn.datamodules.block_parity.BlockParityDataModule.bias_scale`). Arguments as the parent's.

    Example:
        >>> dm = BlockParityDataModule(d=24, r=1, k=3, seed=0)
        >>> model = BlockParityGradientFeatures(width=8).attach(dm)
        >>> tuple(model.correlations().shape)
        (16, 1)
    """

    datamodule_class = BlockParityDataModule
