"""Linear contrastive representation of the universality / label-efficiency trade-off (Shi 2024, Ch. 7,
Sec. 7.2.2; Shi et al. 2023).

``phi(x) = W x`` with ``W [k, d]`` in ``{||W||_2 <= 1, ||W||_F <= sqrt(r)}``, trained by projected SGD (or Adam):
after each optimiser step ``W`` is projected exactly onto that set
(:func:`~featlearn.theory.universality.project_spectral_frobenius`: one SVD, the multiplier found on the
singular values).

Losses (``loss``), on a batch of pairs ``(x, x^+)`` whose other samples are the negatives:

* ``theory`` (default, Eq. 7.1 multi-negative form): ``l(phi(x)^T (phi(x^+) - mean_batch phi(x^-)))`` with
  ``l(t) = log(1 + e^-t)``;
* ``triplet``: one negative per anchor (the next sample of the batch), ``l(phi(x)^T (phi(x^+) - phi(x^-)))``;
* ``pca``: ``l(t) = -t`` (Thm 7.1: contrastive learning as PCA of ``E[x | z_R]``);
* ``infonce``: cross-entropy of ``phi(x)^T phi(x^+_j) / tau`` over the batch (``tau = temperature``).

Modes (``mode``): ``universal`` pretrains on every task, ``specific`` on the data's target task only, and
``cr`` is contrastive regularisation (Prop F.9): start from a universal representation ``W*`` (``reference``:
a universal run's checkpoint, or ``None`` for the closed-form optimum), train on the target task, and keep
``||W - W*||_F <= gamma`` and ``||W||_2 <= 1`` with **no Frobenius cap** (with the cap the target cannot gain
without the other tasks losing; the proof of Prop F.9 has no such cap). The trust region's reference is kept by
:class:`~featlearn.lightning_modules.contrastive_regularization.ContrastiveRegularization`; each step projects
exactly onto the intersection of the spectral ball and the trust region
(:func:`~featlearn.theory.universality.project_trust_region`, Dykstra's algorithm: clipping and then scaling
into the ball would give a feasible point, not the nearest one).

Metrics (every ``trainer.log_every_n_steps`` steps): the per-group squared column norms
``c_j = ||(W M)_{:, j}||^2`` (``theory/c_s``, ``theory/c_p_target``, ``theory/c_p_other``, ``theory/c_u``) against
the closed forms of :func:`~featlearn.theory.universality.predicted_column_norms` (``theory/c_s_closed_form``, ...,
and ``theory/c_max_abs_error``), and the constraints (``train/weight_spectral_norm``, ``train/weight_frobenius2``,
in ``cr`` mode ``train/cr_distance`` = ``||W - W*||_F``). :meth:`LinearContrastive.final_metrics` (``hp/<name>``)
adds the contrastive loss on fresh samples against its closed form and the downstream ridge errors on the target
task and on another task.

Example:
    >>> from featlearn.datamodules.hidden_representation import HiddenRepresentationDataModule
    >>> dm = HiddenRepresentationDataModule(T=2, s=2, r=4, u=2, batch_size=64)
    >>> model = LinearContrastive().attach(dm)
    >>> loss = model.training_step(dm.sample(torch.arange(64), "train"), 0)
    >>> loss.backward(); model.w.grad.shape
    torch.Size([6, 8])
"""
from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F

from featlearn.checkpoints import read_checkpoint
from featlearn.datamodules.hidden_representation import HiddenRepresentationDataModule
from featlearn.errors import ConfigError
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.lightning_modules.contrastive_regularization import ContrastiveRegularization
from featlearn.metrics.probes import all_gather_cat_with_grad
from featlearn.theory.universality import (closed_form_representation, column_norms, contrastive_loss_closed_form,
                                           group_means, predicted_column_norms, project_spectral_frobenius,
                                           project_trust_region)
from featlearn.theory.universality_downstream import downstream_errors
from featlearn.validation import PositiveFloat, PositiveInt, check_args

__all__ = ["LinearContrastive", "contrastive_loss"]


def contrastive_loss(f: torch.Tensor, f_pos: torch.Tensor, loss: str = "theory", temperature: float = 0.1) -> torch.Tensor:
    """The mean contrastive loss of representations ``f``, ``f_pos`` ``[B, k]`` of paired views (module docstring).

    Example:
        >>> f = torch.zeros(4, 3)
        >>> round(float(contrastive_loss(f, f)), 4)           # l(0) = log 2
        0.6931
    """
    if loss == "theory":
        return F.softplus(-(f * (f_pos - f.mean(0, keepdim=True))).sum(1)).mean()
    if loss == "triplet":
        return F.softplus(-(f * (f_pos - f.roll(1, 0))).sum(1)).mean()
    if loss == "pca":
        return -(f * f_pos).sum(1).mean()
    if loss == "infonce":
        logits = f @ f_pos.t() / temperature
        return F.cross_entropy(logits, torch.arange(len(f), device=f.device))
    raise ConfigError("model.loss", "'theory', 'triplet', 'pca' or 'infonce'", loss)


MIN_JUDGED_STEPS = 50  # runs shorter than this are not judged by learning_note


class LinearContrastive(FeatureLearningModule):
    """The linear representation ``W [k, d]`` of Shi 2024, Sec. 7.2.2; see the module docstring.

    Args:
        mode: ``"universal"`` (every task), ``"specific"`` (the data's ``target_task``) or ``"cr"``
            (contrastive regularisation of a universal ``W*`` on the target task).
        loss: ``"theory"``, ``"triplet"``, ``"pca"`` or ``"infonce"``. temperature: ``tau`` of InfoNCE.
        lr: step size. optimizer: ``"sgd"`` (projected gradient descent) or ``"adam"``.
        init_scale: ``W(0) ~ init_scale N(0, 1)`` (small: columns of features absent from the data are not
            identifiable and keep what the initialisation put there); in ``cr`` mode ``W(0) = W*``.
        gamma: the trust-region radius of ``cr`` mode.
        reference: ``cr`` mode: a checkpoint of a universal ``LinearContrastive`` run whose ``W`` is ``W*``
            (``None``: the closed-form universal optimum ``[diag(sqrt c), 0] M^T``).
        cr_frobenius_cap: keep ``||W||_F <= sqrt(r)`` in ``cr`` mode too (an ablation; off in Prop F.9).
        probe_repeats: labelled sets (of ``num_val`` samples each) averaged in the final downstream errors.
        seed: seed of the initialisation.
        compile: run the loss under ``torch.compile`` (``null``: when the run is long enough to repay it).
    """

    datamodule_class = HiddenRepresentationDataModule
    representation_input = "x"  # phi(x): the representation whose rank RepresentationSpectrum logs
    compiled_loss = "seed_loss"
    # the projection bounds ||W||_F by sqrt(r) (sqrt(r) + gamma in cr mode): nothing can blow up
    blowup_factors = {"loss": None, "weight_norm": None}
    heatmap_axes = ("representation unit", "latent feature (S, P_1..P_T, U)")

    def __init__(
        self,
        mode: Literal["universal", "specific", "cr"] = "universal",
        loss: Literal["theory", "triplet", "pca", "infonce"] = "theory",
        temperature: PositiveFloat = 0.1,
        lr: PositiveFloat = 0.5,
        optimizer: Literal["sgd", "adam"] = "sgd",
        init_scale: PositiveFloat = 0.01,
        gamma: PositiveFloat = 1.0,
        reference: str | None = None,
        cr_frobenius_cap: bool = False,
        probe_repeats: PositiveInt = 10,
        seed: int = 0,
        compile: bool | None = None,
    ):
        check_args("model", LinearContrastive.__init__, locals())
        super().__init__()
        if reference is not None and mode != "cr":
            raise ConfigError("model.reference", f"null unless mode is 'cr' (mode is {mode!r})", reference)
        self._reference_w = None
        if reference is not None:
            state = read_checkpoint("model.reference", reference)
            hp = state.get("hyper_parameters") or {}
            if "w" not in state["state_dict"] or hp.get("mode", "universal") != "universal":
                raise ConfigError("model.reference", "a checkpoint of a universal LinearContrastive run", reference)
            self._reference_w = state["state_dict"]["w"]
        self.save_hyperparameters()
        self.cr = ContrastiveRegularization(lam=1.0, gamma=gamma if mode == "cr" else None)

    # ------------------------------------------------------------------------------------------
    def build(self, dm: HiddenRepresentationDataModule) -> None:
        hp = self.hparams
        self.T, self.s, self.r, self.u, self.k, self.d = dm.T, dm.s, dm.r, dm.u, dm.k, dm.d
        self.groups, self.target = dm.groups, dm.target_task
        self.other = (dm.target_task + 1) % dm.T
        self.task_weights, self.sigmas = list(dm.task_weights), (dm.sigma_S, dm.sigma_R, dm.sigma_U)
        self.label_kind = dm.label
        dm.use_tasks(None if hp.mode == "universal" else [dm.target_task])
        self.register_ground_truth("M", dm.M.float())
        if hp.mode == "cr":
            if self._reference_w is not None:
                if tuple(self._reference_w.shape) != (self.k, self.d):
                    raise ConfigError("model.reference", f"a checkpoint with W of shape {(self.k, self.d)} (the data's k, d)",
                                      f"{hp.reference} with {tuple(self._reference_w.shape)}")
                w0 = self._reference_w.float()
            else:
                w0 = closed_form_representation(self.groups, dm.M, predicted_column_norms("universal", dm.T, dm.s, dm.r)).float()
            self._reference_w = None
        else:
            gen = torch.Generator().manual_seed(hp.seed)
            w0 = hp.init_scale * torch.randn(self.k, self.d, generator=gen)
        self.w = torch.nn.Parameter(w0.clone())
        if hp.mode == "cr":
            self.cr.anchor({"w": self.w})
        self.start_norms = group_means(column_norms(w0, dm.M), self.groups)
        # downstream sets, kept for final_metrics: probe_repeats labelled sets of m = num_val, and a test set
        m, n_test = dm.sizes["val"], dm.sizes["test"]
        for name, task in (("target", self.target), ("other", self.other)):
            train = dm.labeled(task, torch.arange(hp.probe_repeats * m), "val")
            test = dm.labeled(task, torch.arange(n_test), "test")
            for part, data in (("train", train), ("test", test)):
                self.register_ground_truth(f"{name}_{part}_x", data["x"])
                self.register_ground_truth(f"{name}_{part}_y", data["y"])
        self.m = m

    def configure_optimizers(self):
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam([self.w], lr=self.hparams.lr)
        return torch.optim.SGD([self.w], lr=self.hparams.lr)

    # ------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``phi(x) = W x`` for inputs ``[.., d]``."""
        return x @ self.w.t()

    @property
    def seeds_vmap(self) -> bool:
        """On one process the loss is plain torch ops (several processes gather the batch, which vmap cannot)."""
        return not (self._trainer is not None and self.trainer.world_size > 1)

    def seed_loss(self, batch: dict) -> torch.Tensor:
        """The step's contrastive loss, a pure function of W and the batch (vmapped over seeds in a stack)."""
        f, f_pos = self(batch["x"]), self(batch["x_pos"])
        if self.hparams.loss == "pca":  # per-pair: no other sample enters
            return contrastive_loss(f, f_pos, "pca")
        # the other samples of the GLOBAL batch are the negatives (rank-major = one process's order)
        return contrastive_loss(all_gather_cat_with_grad(f), all_gather_cat_with_grad(f_pos), self.hparams.loss,
                                self.hparams.temperature)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.record_step(self.seed_loss(batch), batch)

    def record_step(self, loss: torch.Tensor, batch: dict) -> torch.Tensor:
        """The step's logs and the running loss means of :meth:`learning_note`; returns ``loss``."""
        if self._trainer is not None and self.theory_due():
            self.log("train/loss", loss, sync_dist=True)
        # a running mean on the device (no host sync) for the end-of-run check of on_train_end; a copy, not a view:
        # a compiled loss's CUDA graph reuses its output's memory at the next replay
        now = loss.detach().to(torch.float32, copy=True)
        self._loss_start = now if getattr(self, "_loss_start", None) is None else self._loss_start
        recent = getattr(self, "_loss_recent", None)
        self._loss_recent = now if recent is None else 0.9 * recent + 0.1 * now
        return loss

    @property
    def finishes_seeds(self) -> bool:
        """The projection onto the balls is the same for every seed; ``cr`` mode's trust region is each seed's own."""
        return self.hparams.mode != "cr"

    def finish_seeds(self, weights: dict[str, torch.Tensor], step: int) -> None:
        """The projection of :meth:`finish_step` on ``weights["w"]``, one seed's ``[k, d]`` or, outside ``cr``
        mode, every seed's ``[S, k, d]`` at once (one batched SVD)."""
        w = weights["w"]
        if self.hparams.mode == "cr":
            w.copy_(project_trust_region(w, self.cr.reference()["w"], self.hparams.gamma, 1.0,
                                         radius2=float(self.r) if self.hparams.cr_frobenius_cap else None))
        else:
            w.copy_(project_spectral_frobenius(w, float(self.r), 1.0))

    def finish_step(self, step: int) -> None:
        """The projection, part of every step: onto ``{||W||_2 <= 1, ||W||_F <= sqrt(r)}``, or in ``cr`` mode onto
        the spectral ball intersected with the trust region around ``W*`` (exactly, by Dykstra's algorithm)."""
        if self.seed_stack() is None or not self.finishes_seeds:  # else the stack has projected every seed's W
            self.finish_seeds({"w": self.w}, step)
        if self._trainer is not None and self.theory_due():
            self.log_dict({f"{'theory' if k.startswith('c_') else 'train'}/{k}": v
                           for k, v in self.theory_metrics().items()}, on_step=True, on_epoch=False)

    # ------------------------------------------------------------------------------------------
    def column_norms(self) -> dict[str, float]:
        """Measured ``c`` per group (``S``, ``P0`` .. ``P{T-1}``, ``U``)."""
        return group_means(column_norms(self.w.detach(), self.M), self.groups)

    def predicted(self) -> dict[str, float]:
        """The closed-form ``c`` per group for this mode (cr: from the universal start's measured target value)."""
        hp = self.hparams
        start = self.start_norms[f"P{self.target}"] if hp.mode == "cr" else None
        return predicted_column_norms(hp.mode, self.T, self.s, self.r, gamma=hp.gamma if hp.mode == "cr" else None,
                                      target=self.target, start=start)

    def theory_metrics(self) -> dict[str, float]:
        """Column norms against the closed form and the constraints, by name; :meth:`finish_step` logs them as
        ``theory/<name>`` (``c_*``) and ``train/<name>`` (the rest)."""
        c, p = self.column_norms(), self.predicted()
        others = [t for t in range(self.T) if t != self.target]
        groups = {"s": "S", "p_target": f"P{self.target}", "u": "U"}
        out = {f"c_{g}": c[key] for g, key in groups.items()}
        out.update({f"c_{g}_closed_form": p[key] for g, key in groups.items()})
        out["c_max_abs_error"] = max(abs(c[g] - p[g]) for g in c)
        out["weight_spectral_norm"] = float(torch.linalg.matrix_norm(self.w.detach().double(), 2))
        out["weight_frobenius2"] = float((self.w.detach().double() ** 2).sum())
        if others:
            out["c_p_other"] = sum(c[f"P{t}"] for t in others) / len(others)
            out["c_p_other_closed_form"] = sum(p[f"P{t}"] for t in others) / len(others)
        if self.hparams.mode == "cr":
            out["cr_distance"] = float(self.cr.distance({"w": self.w}))
        return out

    def downstream(self, ms: list[int] | None = None) -> dict[str, dict]:
        """Ridge test errors on the target task and on another task, ``lambda`` by leave-one-out per set
        (:func:`~featlearn.theory.universality_downstream.downstream_errors`), for each ``m`` in ``ms``
        (default: ``num_val``)."""
        ms = ms or [self.m]
        out = {}
        with torch.no_grad():
            for name in ("target", "other"):
                f = lambda part: self(getattr(self, f"{name}_{part}_x"))  # noqa: E731
                out[name] = downstream_errors(f("train"), getattr(self, f"{name}_train_y"), f("test"),
                                              getattr(self, f"{name}_test_y"), ms, self.hparams.probe_repeats,
                                              sign=self.label_kind == "sign")
        return out

    def final_metrics(self) -> dict[str, float]:
        """Column norms against theory, the contrastive loss against its closed form, downstream errors."""
        out = self.theory_metrics()
        c = self.column_norms()
        if self.hparams.loss in ("theory", "pca"):
            tasks = list(range(self.T)) if self.hparams.mode == "universal" else [self.target]
            weights = [self.task_weights[t] for t in tasks]
            s_sig, r_sig, _ = self.sigmas
            out["loss_closed_form_at_measured_c"] = contrastive_loss_closed_form(
                c["S"], [c[f"P{t}"] for t in tasks], self.s, self.r, weights, s_sig, r_sig, self.hparams.loss,
                samples=100_000)
        down = self.downstream()
        for name, rows in down.items():
            out[f"downstream_{name}_mse"] = rows[self.m]["mse"]
        return out

    def on_train_end(self) -> None:
        super().on_train_end()
        note = self.learning_note()
        if note is not None:
            warnings.warn(note, stacklevel=1)

    def learning_note(self, margin: float = 0.05) -> str | None:
        """A warning when the run failed to learn: the projection bounds ``||W||``, so a step size too large
        cannot blow up (the guard stays silent), it only stalls. The recent training loss is compared with the
        closed-form optimum (``theory``, ``pca``): it must close all but ``margin`` of the gap from its start;
        losses without a closed form must at least end below their start."""
        if getattr(self, "_loss_recent", None) is None or self.global_step < MIN_JUDGED_STEPS:
            return None  # a few steps (a smoke run) are not expected to close the gap
        start, end = float(self._loss_start), float(self._loss_recent)
        hp, field = self.hparams, f"--model.init_args.lr (now {self.hparams.lr:g})"
        if hp.loss in ("theory", "pca") and hp.mode != "cr":
            p = self.predicted()
            tasks = list(range(self.T)) if hp.mode == "universal" else [self.target]
            best = contrastive_loss_closed_form(p["S"], [p[f"P{t}"] for t in tasks], self.s, self.r,
                                                [self.task_weights[t] for t in tasks], *self.sigmas[:2], hp.loss,
                                                samples=100_000)
            if start - best > 0 and (end - best) > margin * (start - best):
                return (f"model did not learn: the training loss ended at {end:.4g}, against {best:.4g} at the "
                        f"closed-form optimum (it started at {start:.4g}); the projection keeps ||W|| bounded, so "
                        f"a step size too large stalls instead of blowing up: try a smaller {field}")
        elif end >= start:
            return (f"model did not learn: the training loss ended at {end:.4g}, not below its start {start:.4g}; "
                    f"try a smaller {field}")
        return None

    def correlations(self) -> torch.Tensor:
        """``W M`` ``[k, d]``: how each representation unit reads each latent feature."""
        return self.w.detach() @ self.M
