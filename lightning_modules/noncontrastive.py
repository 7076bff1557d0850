"""Non-contrastive learning with an identity-initialised prediction head (Wen & Li 2022).

Online branch: cubic patch encoder ``f_j(X) = sum_p <w_j, X_p>^3`` on view 1 (through
``featlearn.kernels.patch_activation_sum`` with ``Activation("pow", q=3)``), prediction head
``F = E f`` (E initialised to I_m; ``head="offdiag"``: diagonal frozen at 1, off-diagonal trained;
``"none"``: E = I; ``"full"``: every entry trained), then batch-norm with batch statistics. Target
branch: the same encoder on view 2 (``target="shared_sg"``: same W, stop-grad; ``"ema"``: an EMA copy),
batch-normed. Loss: ``L = 1/(mN) sum_i ||BN(F)_i - BN(G)_i||^2 = 2 - (2/m) sum_j rho_j`` through the fused
``featlearn.kernels.bn_cosine_loss``. Optimiser: plain SGD (Algorithm 1), encoder lr ``lr``, head lr
``head_lr``; W and E are updated from the same point; the diagonal of E is re-asserted as part of each step.

``gradient="population"`` replaces the sampled batch by the exact N = infinity loss (Wen & Li 2022, App. A.1,
in closed form for Gaussian noise: :func:`featlearn.theory.noncontrastive.population_loss`), so
autograd gives the population gradient on W: the oracle of the proofs, and the mode in which the demo-A
dynamics (~2e5 steps) run on a CPU. That closed form, the phase tracker and the batched simulator of the
headline table live in :mod:`featlearn.theory.noncontrastive`.

Example:
    >>> from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
    >>> dm = TwoFeaturePatchDataModule(dim=12, num_patches=8, num_feature_patches=2, batch_size=64)
    >>> model = NonContrastiveModule(width=2).attach(dm)
    >>> loss = model.batch_loss(dm.sample(torch.arange(64), "train"))
    >>> loss.backward(); float(model.head.grad.diagonal().abs().sum())
    0.0
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
from featlearn.errors import ConfigError
from featlearn.kernels.activations import Activation
from featlearn.kernels.backend import Backend
from featlearn.kernels.bn_cosine_loss import bn_column_stats, bn_cosine_loss
from featlearn.kernels.patch_activation_sum import patch_activation_sum
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.metrics import to_host
from featlearn.theory.noncontrastive import (OUTCOME_CODES, PhaseTracker, feature_outcome, population_loss,
                                             representation_correlation, split_weights, substitution_ratio)
from featlearn.validation import (NonNegativeFloat, PositiveFloat, PositiveInt, RightOpenUnitInterval, check_args,
                                  check_memory)

CUBIC = Activation("pow", q=3)


def encode(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor | None = None,
           backend: str = "auto") -> torch.Tensor:
    """Cubic patch encoder ``f[b, j] = sum_p mask[b, p] <w_j, x[b, p]>^3``; x [B, P, d], w [m, d].

    Example:
        >>> encode(torch.ones(1, 2, 3), torch.ones(1, 3)).tolist()
        [[54.0]]
    """
    # IEEE dots: feature correlations start at ~1/sqrt(d) (docs/performance.md)
    return patch_activation_sum(x, w, CUBIC, mask=mask, backend=backend, input_precision="ieee").student


def noncontrastive_loss(f_online: torch.Tensor, g_target: torch.Tensor, head: torch.Tensor,
                        out_norm: str = "bn", eps: float = 0.0, backend: str = "auto") -> torch.Tensor:
    """``L = mean ||norm(f E^T) - norm(g)||^2`` (Wen & Li 2022, eq. 3.3 and A.1); ``g_target`` is used
    as given (detach it for stop-grad).

    Example:
        >>> f = torch.randn(32, 2, dtype=torch.float64)
        >>> float(noncontrastive_loss(f, f, torch.eye(2, dtype=torch.float64))) < 1e-12
        True
    """
    return bn_cosine_loss(f_online @ head.T, g_target, out_norm=out_norm, eps=eps, backend=backend)


class NonContrastiveModule(FeatureLearningModule):
    """BYOL/SimSiam-style non-contrastive learner of Wen & Li 2022 (module docstring).

    Theory metrics are logged every ``trainer.log_every_n_steps`` steps and kept in ``history``: ``train/loss``,
    ``train/gap_to_opt``, ``theory/cos/<j>_<l>`` (cos(w_j, v_l)), ``theory/e/<j>_<q>`` (E[j, q]), ``theory/phase``, ...

    Args:
        width: m, number of neurons (theory: 2).
        head: ``"offdiag"`` (identity init, diagonal frozen; default), ``"none"`` (E = I), ``"full"``.
        target: ``"shared_sg"`` (same W, stop-grad; theory) or ``"ema"`` (EMA copy of W, ``ema_decay``).
        lr: encoder SGD learning rate eta.  head_lr: eta_E (None = lr).
        out_norm: ``"bn"`` (batch statistics, theory) or ``"l2"`` (per-row ablation).  eps: normaliser epsilon.
        stop_grad: False = no-stop-grad ablation (shared target only).
        symmetrize: average the loss with the views swapped (off = paper).
        gradient: ``"sample"`` (SGD on the sampled batch) or ``"population"`` (exact N = inf gradient).
        init_seed: seed of W^(0) ~ N(0, init_std^2) (None: the DataModule's seed).  init_std: None = 1/sqrt(d).
        lucky_first: permute the neurons at init so neuron 0 has the largest |<w_j, v1>| (the lucky
            neuron of Wen & Li 2022, Lemma B.1).
        backend: kernel backend for encoder and loss.
        compile: run the loss under ``torch.compile`` (``null``: when the run is long enough to repay it).
    """

    datamodule_class = TwoFeaturePatchDataModule
    compiled_loss = "seed_loss"
    # the loss is bounded (in [0, 4]); normal runs change the weight norm by < 1% over 20 steps
    blowup_factors = {"loss": None, "weight_norm": 10.0}

    def __init__(
        self,
        width: PositiveInt = 2,
        head: Literal["offdiag", "none", "full"] = "offdiag",
        target: Literal["shared_sg", "ema"] = "shared_sg",
        ema_decay: RightOpenUnitInterval = 0.99,
        lr: PositiveFloat = 0.05,
        head_lr: NonNegativeFloat | None = None,
        out_norm: Literal["bn", "l2"] = "bn",
        eps: NonNegativeFloat = 0.0,
        stop_grad: bool = True,
        symmetrize: bool = False,
        gradient: Literal["sample", "population"] = "sample",
        init_seed: int | None = None,
        init_std: PositiveFloat | None = None,
        lucky_first: bool = True,
        backend: Backend = "auto",
        compile: bool | None = None,
    ):
        check_args("model", NonContrastiveModule.__init__, locals())
        super().__init__()
        if gradient == "population" and (out_norm != "bn" or eps != 0 or symmetrize):
            raise ConfigError("model.gradient", "'sample' unless out_norm='bn', eps=0, symmetrize=False",
                              gradient)
        if not stop_grad and target == "ema":
            raise ConfigError("model.stop_grad", "True with an EMA target", stop_grad)
        self.save_hyperparameters()
        self.width, self.ema_decay = width, float(ema_decay)
        self.lr = float(lr)
        self.head_lr = float(lr if head_lr is None else head_lr)
        self.out_norm, self.eps, self.stop_grad, self.symmetrize = out_norm, float(eps), stop_grad, symmetrize
        self.gradient, self.init_seed, self.init_std, self.lucky_first = gradient, init_seed, init_std, lucky_first
        self.backend = backend
        self.history: list[dict] = []
        self.tracker: PhaseTracker | None = None
        self.last_loss: torch.Tensor | None = None

    # --- parameters ---------------------------------------------------------------------------
    def build(self, dm: TwoFeaturePatchDataModule) -> None:
        if self.gradient == "population" and dm.co_occur:  # the closed form assumes one feature per sample
            raise ConfigError("model.gradient", "'sample' for co-occurring features", self.gradient)
        m, d, dtype = self.width, dm.dim, dm.dtype
        # encoder and head with their gradients and copies (EMA target, initial head), built on the CPU
        check_memory("model", NonContrastiveModule.__init__, {"width": m}, 4 * dtype.itemsize * m * (d + m),
                     f"{m} neurons of dimension {d} and an {m} x {m} head", device="cpu")
        self.dim, self.num_patches, self.num_feature_patches = d, dm.num_patches, dm.num_feature_patches
        self.alphas, self.probs, self.noise_std = list(dm.alphas), list(dm.probs), dm.noise_std
        self.opt_loss = dm.constants()["OPT"]
        self.register_ground_truth("features", dm.features)
        std = self.init_std if self.init_std is not None else 1.0 / math.sqrt(d)
        w = dm.initial_weights(m, self.init_seed) * std
        lucky = (w @ dm.features.to(torch.float64)[0]).abs()
        if self.lucky_first:
            w = w[torch.argsort(lucky, descending=True)]
        self.w = torch.nn.Parameter(w.to(dtype))
        eye = torch.eye(m, dtype=dtype)
        if self.hparams.head == "none":
            self.register_buffer("head", eye)
        else:
            self.head = torch.nn.Parameter(eye.clone())
            if self.hparams.head == "offdiag":
                self.register_buffer("head_grad_mask", 1.0 - eye)
                self.head.register_hook(lambda g: g * self.head_grad_mask)
        # max |E| over every step, as the simulator's E_peak: E21 can rise and fall between two logs
        self.register_buffer("head_peak", eye.clone())
        if self.hparams.target == "ema":
            self.register_buffer("w_target", w.to(dtype).clone())
        self.lead = 0 if self.lucky_first else int(torch.argmax(lucky))
        self.tracker = PhaseTracker(self.lead, d, self.lr / max(self.head_lr, 1e-300)) if m == 2 else None

    @property
    def seeds_vmap(self) -> bool:
        """Population mode's loss is plain torch ops; the sampled loss's fused kernels have no vmap rule."""
        return self.gradient == "population"

    @property
    def samples_needed(self) -> bool:
        return self.gradient != "population"

    def target_weights(self) -> torch.Tensor:
        return self.w_target if self.hparams.target == "ema" else self.w

    # --- loss -----------------------------------------------------------------------------------
    def batch_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The sampled loss (Wen & Li 2022, eq. 3.3) on one batch (online: view 1, target: view 2)."""
        x = batch["x"]
        m1, m2 = self.datamodule_class.views(batch)

        def one(mo, mt):
            if self.stop_grad and self.hparams.target == "shared_sg":
                # One pass over x for both views: the op's no-grad "teacher" is the sum over every patch,
                # so the target view's sum is the total less the online view's.
                sums = patch_activation_sum(x, self.w, CUBIC, mask=mo, teacher_scale=1.0, backend=self.backend,
                                            input_precision="ieee")
                f, g = sums.student, sums.teacher - sums.student.detach()
            elif self.stop_grad:
                f = encode(x, self.w, mo, self.backend)
                with torch.no_grad():
                    g = encode(x, self.target_weights().detach(), mt, self.backend)
            else:
                f, g = encode(x, self.w, mo, self.backend), encode(x, self.w, mt, self.backend)
            return noncontrastive_loss(f, g, self.head, self.out_norm, self.eps, self.backend)

        loss = one(m1, m2)
        if self.symmetrize:
            loss = 0.5 * (loss + one(m2, m1))
        return loss

    def population_loss(self) -> torch.Tensor:
        w_t = self.w_target if self.hparams.target == "ema" else None
        return population_loss(self.w, self.head, self.features, self.alphas, self.probs, self.num_patches,
                               self.num_feature_patches, self.noise_std, w_target=w_t, stop_grad=self.stop_grad)

    # --- metrics --------------------------------------------------------------------------------
    def correlations(self) -> torch.Tensor:
        """cos(w_j, v_l): neuron x feature ``[m, K]`` (the heat map)."""
        w = self.w.detach()
        return split_weights(w, self.features)[0] / w.norm(dim=1, keepdim=True)

    def heatmaps(self) -> dict[str, torch.Tensor]:
        return {"correlation": self.correlations(), "head": self.head.detach().clone()}

    @torch.no_grad()
    def metrics(self, loss: torch.Tensor | None = None, rho: torch.Tensor | None = None) -> dict[str, float]:
        """The theory's quantities now; advances the phase tracker."""
        w, e = self.w.detach(), self.head.detach()
        b, u = split_weights(w, self.features)
        m, k = b.shape
        corr = representation_correlation(w, self.features, self.alphas, self.probs, self.num_patches,
                                          self.num_feature_patches, self.noise_std)
        dev = {"cos": b / w.norm(dim=1, keepdim=True), "B": b, "R": (u * u).sum(1), "norm": w.norm(dim=1),
               "E": e, "off": (e - torch.diag(torch.diagonal(e))).norm(), "asym": (e - e.T).norm(),
               "corr": corr[~torch.eye(m, dtype=torch.bool, device=corr.device)].abs().mean()}
        if loss is not None:
            dev["loss"] = loss.detach()
        if rho is not None:
            dev["rho"] = rho[:8]
        h = to_host(dev)
        # neuron j, feature l and head entry E[j, q] (0-based) as qualifiers: theory/cos/0_1 = cos(w_0, v_1)
        out: dict[str, float] = {}
        for j in range(m if m <= 8 else 0):
            out.update({f"theory/{key.lower()}/{j}_{ell}": float(h[key][j, ell]) for key in ("cos", "B")
                        for ell in range(k)})
            out.update({f"theory/r/{j}": float(h["R"][j]), f"theory/w_norm/{j}": float(h["norm"][j])})
            out.update({f"theory/e/{j}_{q}": float(h["E"][j, q]) for q in range(m) if q != j})
        out["theory/e_offdiag_fro"] = float(h["off"])
        out["theory/e_asym_fro"] = float(h["asym"])
        out["theory/e_asym_ratio"] = out["theory/e_asym_fro"] / max(out["theory/e_offdiag_fro"], 1e-300)
        out["theory/abs_corr_offdiag_mean"] = float(h["corr"]) if m > 1 else 0.0
        if loss is not None:
            out["train/loss"] = float(h["loss"])
            out["train/gap_to_opt"] = out["train/loss"] - self.opt_loss
        if rho is not None:
            out.update({f"train/rho/{j}": float(v) for j, v in enumerate(h["rho"])})
        if self.tracker is not None:
            sr = substitution_ratio(h["B"], h["R"], h["E"], self.alphas[0], self.num_patches,
                                    self.num_feature_patches, self.noise_std, self.lead)
            out["theory/subst_ratio"] = sr
            out["theory/phase"] = float(self.tracker.update(self.global_step_safe(), h["cos"], h["B"], h["R"], h["E"],
                                                            sr))
            out["theory/lead_neuron"] = float(self.lead)
        return out

    def global_step_safe(self) -> int:
        return self.trainer.global_step if self._trainer is not None else len(self.history)

    def final_metrics(self) -> dict[str, float]:
        """Outcome (0 DIV, 1 COL, 2 PAR), final training loss, its gap to OPT and the peak |E21| over every step."""
        if self.last_loss is None:
            return {}
        loss = float(self.last_loss)
        out = {"outcome": OUTCOME_CODES[feature_outcome(self.correlations())[0]], "final_loss": loss,
               "gap_to_opt": loss - self.opt_loss}
        if self.width >= 2:
            out["peak_abs_e21"] = float(self.head_peak[1 if self.lead == 0 else 0, self.lead])
        return out

    # --- Lightning hooks ------------------------------------------------------------------------
    def representation(self, batch: dict) -> torch.Tensor:
        """The encoder's output on the batch's whole inputs (:class:`~featlearn.callbacks.RepresentationSpectrum`)."""
        return encode(batch["x"], self.w.detach(), None, self.backend)

    def seed_loss(self, batch) -> torch.Tensor:
        """The step's training loss, a pure function of the weights and the batch (what
        :class:`~featlearn.lightning_modules.seeds.SeedStack` runs once for all seeds through ``vmap``)."""
        return self.population_loss() if self.gradient == "population" else self.batch_loss(batch)

    def training_step(self, batch, batch_idx):
        return self.record_step(self.seed_loss(batch), batch)

    def record_step(self, loss: torch.Tensor, batch) -> torch.Tensor:
        """The step's metrics and logs from its loss; returns what to backpropagate."""
        backprop = loss
        ws = self.trainer.world_size if self._trainer is not None else 1
        if self.gradient == "sample" and ws > 1:  # the loss is global (synced statistics); DDP averages gradients
            backprop = loss * ws
        self.last_loss = loss.detach().clone()  # read after later steps: a copy (a CUDA graph reuses its output)
        if self.theory_due():
            rho = None
            if self.gradient == "sample" and self.out_norm == "bn":
                with torch.no_grad():
                    x, (m1, m2) = batch["x"], self.datamodule_class.views(batch)
                    f = encode(x, self.w.detach(), m1, self.backend) @ self.head.detach().T
                    g = encode(x, self.target_weights().detach(), m2, self.backend)
                    rho = bn_column_stats(f, g, backend=self.backend)["rho"]
            met = self.metrics(self.last_loss, rho)
            self.history.append({**met, "step": self.global_step_safe()})
            if self.tracker is not None:  # the steps at which phases began: theory/t1, theory/t2_paper, ...
                met.update({f"theory/{name.lower()}": float(t) for name, t in self.tracker.bounds.items()
                            if t is not None})
            # no sync_dist: the loss and rho come from statistics synced over ranks, the rest from the weights
            self.log_dict(met, on_step=True, on_epoch=False)
        return backprop

    def validation_step(self, batch, batch_idx):
        with torch.no_grad():
            loss = self.seed_loss(batch)
        self.log("val/loss", loss, on_epoch=True, batch_size=batch["x"].shape[0], sync_dist=True)

    def configure_optimizers(self):
        groups = [{"params": [self.w], "lr": self.lr}]
        if self.hparams.head != "none":
            groups.append({"params": [self.head], "lr": self.head_lr})
        return torch.optim.SGD(groups, lr=self.lr, momentum=0.0, weight_decay=0.0)

    def finish_step(self, step: int) -> None:
        """Algorithm 1 line 6 (diag(E) = 1), the EMA target update and the running peak of |E|: part of
        every SGD step."""
        if self.hparams.head == "offdiag":
            self.head.diagonal().fill_(1.0)
        if self.hparams.target == "ema":
            self.w_target.mul_(self.ema_decay).add_(self.w.detach(), alpha=1 - self.ema_decay)
        torch.maximum(self.head_peak, self.head.detach().abs(), out=self.head_peak)
