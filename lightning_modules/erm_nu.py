"""ERM with a nuclear-norm penalty on the batch's features, and its baselines (Shi 2024, Ch. 6 = Shi, Ming, Fan, Sala,
Liang, "Domain Generalization via Nuclear Norm Regularization", CPAL 2024, arXiv:2303.07527), on
:class:`~featlearn.datamodules.domain_shift.DomainShiftDataModule`.

The network follows the data's ``model``:

* ``toy``: a linear feature extractor ``Phi(x) = A x`` (``A`` 2 x 2) and a linear head ``W`` (2 -> 1, no bias),
  both trained, initialised uniform in ``+-1/sqrt(2)`` (``torch.nn.Linear``'s range), drawn from (data seed,
  ``init``);
* ``theory``: ``f_w(x) = sum_j w_j x_j``, i.e. features ``Phi(X) = X diag(w)`` under a head fixed to all ones, with
  ``w`` trained from 0 (Sec. 6.4).

The loss is the logistic ``log(1 + exp(-y f(x)))``, trained by SGD at ``lr``, plus ``regularizer``:

* ``erm``: nothing;
* ``l2``: ``lam/2`` times the squared norm of every trained parameter (weight decay; Eq. 6.4);
* ``nuclear``: ``lam ||Phi(X)||_*`` of the batch's features, unnormalised as in the chapter (Eq. 6.3), through
  :func:`featlearn.metrics.spectrum.nuclear_norm` (under DDP, of the global batch's features, gathered through
  autograd, so the step is one process's);
* ``rank``: the constraint ``rank(Phi(X)) <= b_rank`` (Eq. 6.2 / 6.5), enforced by a projection after every step from
  step ``support_step`` on (plain ERM before it). Toy: ``A`` is replaced by its best rank-``b_rank``
  approximation. Theory: ``rank(X diag(w)) = ||w||_0``, so at step ``support_step`` the ``b_rank`` largest
  ``|w_j|`` are kept as the support and every later step zeroes the rest (support chosen once, then a refit on it).

Logged: ``train/loss`` (risk plus penalty), ``train/risk`` (the global batch's under DDP); ``val/accuracy`` and
``val/loss`` on the in-distribution validation split (the one model selection reads); ``test/accuracy`` and
``test/ood_accuracy`` (and ``test/ood_stable_rank``, the stable rank of the whole OOD split's features, gathered
from every rank, Fig. 6.5) from the test loop; ``theory/*`` (:meth:`ERMNU.theory`). The RepresentationSpectrum
callback logs ``val/stable_rank`` of ``Phi``.

Example:
    >>> from featlearn.datamodules.domain_shift import DomainShiftDataModule
    >>> dm = DomainShiftDataModule(model="theory", r=4, d=12, gamma=0.4, seed=0)
    >>> model = ERMNU(regularizer="nuclear", lam=0.01).attach(dm)
    >>> batch = dm.batch(torch.arange(16), "train")
    >>> tuple(round(float(v.detach()), 4) for v in model.batch_loss(batch))  # w = 0: risk log 2, no penalty
    (0.6931, 0.0)
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from featlearn.datamodules.domain_shift import DomainShiftDataModule
from featlearn.errors import ConfigError
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.metrics.probes import all_gather_cat_with_grad
from featlearn.metrics.spectrum import nuclear_norm, stable_rank
from featlearn.theory.erm_nu import (accuracy_normal, l2_ood_bound, l2_optimum, toy_accuracy, weight_structure)
from featlearn.validation import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check_args


def accuracy(f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The share of samples with a positive margin ``y f`` (a tie counts as an error)."""
    return (f * y > 0).float().mean()


class ERMNU(FeatureLearningModule):
    """ERM, ERM-l2, ERM-NU and ERM-rank on the chapter's toy or theory model (module docstring).

    Args:
        regularizer: ``erm``, ``l2``, ``nuclear`` or ``rank``.
        lam: the penalty's weight (``l2`` and ``nuclear``; ignored otherwise).
        b_rank: the rank bound (``rank``), at most the features' dimension (2 for the toy, d for the theory model).
        support_step: the step from which ``rank`` projects (and, for the theory model, chooses its support).
        lr: SGD's step size.
        init: which initialisation of the toy (restarts of one seed differ in it; the draw is a function of the
            data seed and ``init``); the theory model starts at w = 0.
    """

    datamodule_class = DomainShiftDataModule
    heatmap_axes = ("feature (row of A; the theory model's w)", "input coordinate")

    def __init__(self, regularizer: Literal["erm", "l2", "nuclear", "rank"] = "nuclear", lam: NonNegativeFloat = 0.01,
                 b_rank: PositiveInt = 1, support_step: NonNegativeInt = 50, lr: PositiveFloat = 0.1,
                 init: NonNegativeInt = 0):
        check_args("model", ERMNU.__init__, locals())
        super().__init__()
        self.save_hyperparameters()

    def build(self, dm: DomainShiftDataModule) -> None:
        hp = self.hparams
        self.kind, self.r, self.dim = dm.model, dm.r, dm.d
        self.gamma, self.p_align, self.x1_noise = dm.gamma, dm.p_align, dm.x1_noise
        width = 2 if self.kind == "toy" else self.dim  # the features' dimension
        if hp.regularizer == "rank" and hp.b_rank > width:
            raise ConfigError("model.b_rank", f"at most the features' dimension {width} (data.model {self.kind})",
                              hp.b_rank)
        if self.kind == "toy":
            gen = torch.Generator().manual_seed(1_000_003 * dm.seed + hp.init)
            bound = 1 / math.sqrt(2)
            self.A = torch.nn.Parameter((2 * torch.rand(2, 2, generator=gen) - 1) * bound)
            self.W = torch.nn.Parameter((2 * torch.rand(2, generator=gen) - 1) * bound)
        else:
            self.w = torch.nn.Parameter(torch.zeros(self.dim))
            self.register_buffer("support", torch.ones(self.dim, dtype=torch.bool))  # rank's support, once chosen
        self.register_ground_truth("features", dm.features)
        self.optimum = None  # Lemma 6.1's (alpha, beta) for ERM-l2 on the theory model
        if self.kind == "theory" and hp.regularizer == "l2" and hp.lam > 0:
            self.optimum = l2_optimum(self.r, self.dim, self.gamma, hp.lam)

    # --- the network -------------------------------------------------------------------------------
    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """``Phi(x)`` ``[n, 2]`` (toy: ``x A^T``) or ``[n, d]`` (theory: ``x diag(w)``)."""
        return x @ self.A.T if self.kind == "toy" else x * self.w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.feature_map(x) @ self.W if self.kind == "toy" else x @ self.w

    def representation(self, batch: dict) -> torch.Tensor:
        return self.feature_map(batch["x"])

    def trained(self) -> list[torch.Tensor]:
        """The trained tensors, by name (several seeds in one run hold them as rows of stacked leaves, which
        ``self.parameters()`` does not list)."""
        return [self.A, self.W] if self.kind == "toy" else [self.w]

    def effective_weights(self) -> torch.Tensor:
        """The linear classifier the network computes: ``A^T W`` (toy) or ``w`` (theory)."""
        return (self.A.T @ self.W if self.kind == "toy" else self.w).detach()

    def batch_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(risk, penalty)`` of a batch: the mean logistic loss and the regularizer's term."""
        x, y, hp = batch["x"], batch["y"], self.hparams
        risk = torch.nn.functional.softplus(-y * self(x)).mean()
        if hp.regularizer == "l2":
            penalty = hp.lam / 2 * sum(p.square().sum() for p in self.trained())
        elif hp.regularizer == "nuclear":
            # the global batch's features (through autograd): under DDP the penalty is one process's
            penalty = hp.lam * nuclear_norm(all_gather_cat_with_grad(self.feature_map(x)))
        else:
            penalty = risk.new_zeros(())
        return risk, penalty

    def training_step(self, batch, batch_idx):
        risk, penalty = self.batch_loss(batch)
        loss = risk + penalty
        if self.theory_due():  # the global batch's (each rank's mean over its half, averaged over the ranks)
            self.log_dict({"train/loss": loss, "train/risk": risk}, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def finish_step(self, step: int) -> None:
        hp = self.hparams
        if hp.regularizer != "rank" or step < max(hp.support_step, 1):
            return
        if self.kind == "toy":  # the best rank-B approximation of A (Eckart-Young)
            U, s, Vh = torch.linalg.svd(self.A)
            self.A.copy_((U[:, :hp.b_rank] * s[:hp.b_rank]) @ Vh[:hp.b_rank])
            return
        if step == max(hp.support_step, 1):  # the support: the B largest |w_j| now, kept from here on
            self.support.zero_()
            self.support[self.w.abs().topk(hp.b_rank).indices] = True
        self.w.mul_(self.support)

    # --- evaluation --------------------------------------------------------------------------------
    def validation_step(self, batch, batch_idx):
        with torch.no_grad():
            f = self(batch["x"])
        n = len(batch["y"])
        self.log("val/accuracy", accuracy(f, batch["y"]), batch_size=n, sync_dist=True)
        self.log("val/loss", torch.nn.functional.softplus(-batch["y"] * f).mean(), batch_size=n, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        for name, value in self.theory().items():
            self.log(f"theory/{name}", value)

    def test_step(self, batch, batch_idx, dataloader_idx: int = 0):
        """Dataloader 0: the in-distribution test split; 1: the OOD split (the DataModule's ``test_dataloader``)."""
        with torch.no_grad():
            f = self(batch["x"])
            logs = {"accuracy": accuracy(f, batch["y"]), "loss": torch.nn.functional.softplus(-batch["y"] * f).mean()}
            if dataloader_idx == 1:  # of the whole OOD split: every rank's rows gathered, the same value on each
                features = all_gather_cat_with_grad(self.feature_map(batch["x"]))
                logs["stable_rank"] = f.new_tensor(stable_rank(features))
        prefix = "test/" if dataloader_idx == 0 else "test/ood_"
        self.log_dict({prefix + k: v for k, v in logs.items()}, add_dataloader_idx=False, batch_size=len(batch["y"]),
                      sync_dist=True)

    def correlations(self) -> torch.Tensor:
        """The feature map's weights on each input coordinate, scaled to a largest entry of 1: ``A`` ``[2, 2]``
        (toy) or ``w`` ``[1, d]`` (theory; the first r coordinates are the invariant ones)."""
        weights = self.A.detach() if self.kind == "toy" else self.w.detach().unsqueeze(0)
        return weights / weights.abs().max().clamp_min(1e-30)

    def theory(self) -> dict[str, float]:
        """Toy: ``spurious_ratio`` (``w2 / w1`` of the classifier ``A^T W``), ``singular_ratio`` (``s2 / s1`` of A)
        and, without x1 noise, the exact ``id_accuracy_exact`` / ``ood_accuracy_exact``. Theory model: ``alpha``,
        ``beta``, ``invariant_share``, ``support_invariant`` (:func:`~featlearn.theory.erm_nu.weight_structure`),
        ``alpha_beta_ratio``, the normal approximation's ``id_accuracy_normal`` / ``ood_accuracy_normal`` and, for
        ERM-l2, Lemma 6.1's optimum ``alpha_optimum`` / ``beta_optimum``."""
        w = self.effective_weights()
        if self.kind == "toy":
            s = torch.linalg.svdvals(self.A.detach())
            out = {"spurious_ratio": float(w[1] / w[0]) if w[0] != 0 else math.inf,
                   "singular_ratio": float(s[1] / s[0]) if s[0] > 0 else 0.0}
            if not self.x1_noise:
                out["id_accuracy_exact"] = toy_accuracy(float(w[0]), float(w[1]), self.p_align)
                out["ood_accuracy_exact"] = toy_accuracy(float(w[0]), float(w[1]), 1 - self.p_align)
            return {k: v for k, v in out.items() if math.isfinite(v)}
        out = weight_structure(w, self.r)
        if out["beta"] != 0:
            out["alpha_beta_ratio"] = out["alpha"] / out["beta"]
        out["id_accuracy_normal"] = accuracy_normal(w, self.r, self.gamma)
        out["ood_accuracy_normal"] = accuracy_normal(w, self.r, -self.gamma)
        if self.optimum is not None:
            out["alpha_optimum"], out["beta_optimum"] = self.optimum
        return out

    def final_metrics(self) -> dict[str, float]:
        """:meth:`theory`, the validation accuracy and, once the test loop ran, ``test_accuracy`` and
        ``ood_accuracy``; for the theory model, Prop. 6.3's ERM-l2 ceiling ``ood_bound = exp(-r/10)``."""
        out = self.theory()
        if self.kind == "theory":
            out["ood_bound"] = l2_ood_bound(self.r)
        for name, key in (("val/accuracy", "accuracy"),
                          ("test/accuracy", "test_accuracy"), ("test/ood_accuracy", "ood_accuracy"),
                          ("test/ood_stable_rank", "ood_stable_rank")):
            value = self.logged(name)
            if value is not None:
                out[key] = float(value)
        return out
