"""Two-layer multi-head reduced linear attention learning sparse parities in context (Shi 2024, Ch. 5 = Shi, Wei,
Xu, Liang, ICML 2024, arXiv:2405.19592, Section 5.5).

The model (after Wu et al. 2024) is ``g = sum_h a_h ReLU((y^T X / n) W_h x_q)`` with ``m`` heads ``W_h`` ``d x d``
and ``a`` in ``[-1, 1]^m``; the loss is the hinge ``max(0, 1 - y_q g)`` plus ``weight_decay sum_h ||W_h||_F^2``.
The model's scale is its head count. Theorem 5.5.1 gives the optimum (``N -> infinity``, weight decay ``-> 0+``)
for ``m = 2(nu + 1)`` heads, :func:`~featlearn.theory.icl_scale.parity_heads`: with ``2(nu1 + 1)`` heads it
classifies the pairs of the ``k = 2^nu1`` important features; with ``2(nu2 + 1)`` heads every pair of the ``d =
2^nu2`` features, its extra heads reading the other features, and so (Theorem 5.5.2) ``(nu2 + 1) / (nu1 + 1)``
times as much of the in-context noise. ``init: construction`` starts at that optimum (``construction_nu``: nu1 or
nu2; the ``m`` it needs); ``random`` starts from ``N(0, init_scale^2)`` heads and ``a`` uniform in ``[-1, 1]``
(our addition: the chapter trains nothing). Logged:

* ``train/loss``; ``val/accuracy`` and ``val/hinge`` on the validation prompts (their task set, examples and
  flipped labels are the DataModule's ``eval_*``).
* ``theory/diagonal_share``: the share of the heads' energy on the diagonals of ``G^T W_h G`` (1 for the
  construction: each head reads each feature by itself); ``theory/diagonal_rank``: the rank of the heads'
  diagonals (singular values at least 10% of the largest), the dimension of the in-context noise the model reads
  (Theorem 5.5.2: ``nu + 1`` for the construction; both constructions touch every feature, the small one through
  fewer independent patterns).
* Heat maps: ``diag(G^T W_h G)`` per head (``heatmap/correlation``, head x feature).

Example:
    >>> from featlearn.datamodules.parity_prompts import SparseParityPromptDataModule
    >>> dm = SparseParityPromptDataModule(d=8, k=2, N=64, batch_size=16)
    >>> model = MultiHeadParityAttention(heads=8, init="construction", construction_nu=3).attach(dm)
    >>> b = dm.batch(torch.arange(16), "train")
    >>> tuple(model(b).shape), round(model.diagonal_share(), 6)
    ((16,), 1.0)
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from featlearn.datamodules.parity_prompts import SparseParityPromptDataModule
from featlearn.errors import ConfigError
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.theory.icl_scale import parity_heads
from featlearn.validation import PositiveFloat, PositiveInt, check_args


class MultiHeadParityAttention(FeatureLearningModule):
    """The two-layer multi-head reduced linear attention (module docstring).

    Args:
        heads: ``m``; with ``init: construction``, ``2 (construction_nu + 1)``.
        init: ``random`` or ``construction`` (Theorem 5.5.1's heads for ``construction_nu``).
        construction_nu: ``nu`` of the constructed start (``log2`` of the features it classifies; at most
            ``log2 d``).
        init_scale: the random start's head entries' standard deviation.
        weight_decay: ``lambda`` of the loss's ``lambda sum_h ||W_h||_F^2`` (the theorem's ``0+``; > 0 here).
        lr: Adam's step size; ``schedule: cosine`` anneals it to 0 over the run's steps (``constant``: kept).
        seed: the random start's seed.
    """

    datamodule_class = SparseParityPromptDataModule
    heatmap_axes = ("head", "feature")
    seeds_vmap = True  # the loss is a pure function of the weights and the batch: several seeds, one vmap
    finishes_seeds = True  # a in [-1, 1]: a clamp on every seed at once

    def __init__(self, heads: PositiveInt = 8, init: Literal["random", "construction"] = "random",
                 construction_nu: PositiveInt = 3, init_scale: PositiveFloat = 0.1, weight_decay: float = 1e-4,
                 lr: PositiveFloat = 1e-2, schedule: Literal["cosine", "constant"] = "cosine", seed: int = 0):
        check_args("model", MultiHeadParityAttention.__init__, locals())
        if not weight_decay >= 0:
            raise ConfigError("model.weight_decay", "lambda >= 0", weight_decay)
        if init == "construction" and heads != 2 * (construction_nu + 1):
            raise ConfigError("model.heads", f"2 (construction_nu + 1) = {2 * (construction_nu + 1)} for the "
                                             "constructed start", heads)
        super().__init__()
        self.save_hyperparameters()

    def build(self, dm: SparseParityPromptDataModule) -> None:
        hp, d = self.hparams, dm.d
        self.d, self.gamma = d, dm.gamma
        G = dm.dictionary
        if hp.init == "construction":
            if 2 ** hp.construction_nu > d:
                raise ConfigError("model.construction_nu", f"at most log2 d = {int(math.log2(d))}", hp.construction_nu)
            a, V = parity_heads(hp.construction_nu, dm.gamma, d)
            W = torch.einsum("ij,hj,kj->hik", G, V, G)
        else:
            gen = torch.Generator().manual_seed(hp.seed)
            W = hp.init_scale * torch.randn(hp.heads, d, d, generator=gen, dtype=torch.float64)
            a = 2 * torch.rand(hp.heads, generator=gen, dtype=torch.float64) - 1
        self.W, self.a = torch.nn.Parameter(W.float()), torch.nn.Parameter(a.float())
        self.register_ground_truth("dictionary", G.float())
        self.heatmap_scale = 1.0 / dm.gamma

    # --- the network -------------------------------------------------------------------------------
    def forward(self, batch: dict) -> torch.Tensor:
        """``g [B] = sum_h a_h ReLU((y^T X / n) W_h x_q)``."""
        h = torch.einsum("bn,bnd->bd", batch["y"], batch["X"]) / batch["X"].shape[1]
        return (self.a * torch.relu(torch.einsum("bd,hde,be->bh", h, self.W, batch["x_q"]))).sum(-1)

    def hinge(self, batch: dict) -> torch.Tensor:
        return torch.relu(1 - batch["y_q"] * self(batch)).mean()

    def seed_loss(self, batch) -> torch.Tensor:
        return self.hinge(batch) + self.hparams.weight_decay * self.W.square().sum()

    def training_step(self, batch, batch_idx):
        return self.record_step(self.seed_loss(batch), batch)

    def record_step(self, loss: torch.Tensor, batch) -> torch.Tensor:
        if self._trainer is not None and self.theory_due():
            self.log("train/loss", loss, sync_dist=True)
        return loss

    def finish_step(self, step: int) -> None:
        if self.seed_stack() is None:  # else the stack has clamped every seed's a
            self.finish_seeds({"a": self.a.detach()}, step)

    def finish_seeds(self, weights: dict[str, torch.Tensor], step: int) -> None:
        weights["a"].clamp_(-1.0, 1.0)  # a in [-1, 1]^m, the chapter's constraint

    def configure_optimizers(self):
        return self.adam_cosine(self.hparams.lr, self.hparams.schedule)

    # --- evaluation --------------------------------------------------------------------------------
    def evaluate(self, batch: dict) -> dict[str, torch.Tensor]:
        """Accuracy (``sign g = y_q``; ``g = 0`` counts as wrong) and hinge loss on a batch."""
        with torch.no_grad():
            g = self(batch)
        return {"accuracy": (g * batch["y_q"] > 0).float().mean(), "hinge": torch.relu(1 - batch["y_q"] * g).mean()}

    def validation_step(self, batch, batch_idx):
        for name, value in self.evaluate(batch).items():
            self.log(f"val/{name}", value, sync_dist=True, batch_size=len(batch["y_q"]))

    def head_matrices(self) -> torch.Tensor:
        """``V_h = G^T W_h G`` ``[m, d, d]``: the heads in the feature basis (diagonal for the construction)."""
        return self.dictionary.T @ self.W.detach() @ self.dictionary

    def head_diagonals(self) -> torch.Tensor:
        """``diag(V_h)`` per head ``[m, d]``: how strongly each head reads each feature by itself."""
        return torch.diagonal(self.head_matrices(), dim1=1, dim2=2)

    def diagonal_share(self) -> float:
        V = self.head_matrices()
        return float(torch.diagonal(V, dim1=1, dim2=2).square().sum() / V.square().sum().clamp_min(1e-30))

    def diagonal_rank(self) -> int:
        """The rank of the heads' diagonals ``[m, d]``, counting singular values at least 10% of the largest."""
        s = torch.linalg.svdvals(self.head_diagonals().double())
        return int((s >= 0.1 * s.max()).sum())

    def on_validation_epoch_end(self) -> None:
        self.log("theory/diagonal_share", self.diagonal_share())
        self.log("theory/diagonal_rank", float(self.diagonal_rank()))

    def correlations(self) -> torch.Tensor:
        return self.head_diagonals()

    def final_metrics(self) -> dict[str, float]:
        out = {"diagonal_share": self.diagonal_share(), "diagonal_rank": float(self.diagonal_rank())}
        for name in ("val/accuracy", "val/hinge"):
            value = self.logged(name)
            if value is not None:
                out[name.removeprefix("val/")] = float(value)
        return out
