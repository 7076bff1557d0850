"""Non-contrastive learning with an identity-initialised prediction head (Wen & Li 2022; spec 004).

Online branch: cubic patch encoder ``f_j(X) = sum_p <w_j, X_p>^3`` on view 1 (through
``featlearn.kernels.patch_activation_sum`` with ``Activation("pow", q=3)``), prediction head
``F = E f`` (E initialised to I_m; ``head="offdiag"``: diagonal frozen at 1, off-diagonal trained;
``"none"``: E = I; ``"full"``: every entry trained), then batch-norm with batch statistics. Target
branch: the same encoder on view 2 (``target="shared_sg"``: same W, stop-grad; ``"ema"``: an EMA copy),
batch-normed. Loss: ``L = 1/(mN) sum_i ||BN(F)_i - BN(G)_i||^2 = 2 - (2/m) sum_j rho_j`` through the fused
``featlearn.kernels.bn_cosine_loss``. Optimiser: plain SGD (Algorithm 1), encoder lr ``lr``, head lr
``head_lr``; W and E are updated from the same point; the diagonal of E is re-asserted as part of each step.

``gradient="population"`` replaces the sampled batch by the exact N = infinity loss of spec 5.6 (Gaussian
noise, closed form in B = W V^T and the noise Gram a = s^2 U U^T), so autograd gives the population
gradient on W directly: the oracle of the theory's proofs, and the only mode in which the demo-A
dynamics (~2e5 steps) run on a CPU.

Plain functions beside the module: :func:`encode`, :func:`noncontrastive_loss`,
:func:`population_loss`, :func:`representation_correlation`, :func:`feature_outcome`,
:class:`PhaseTracker` (the four phases of section 5.2).

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

from featlearn.datamodules import rng
from featlearn.datamodules.two_feature_patches import hypergeometric_moments
from featlearn.errors import ConfigError
from featlearn.kernels.activations import Activation
from featlearn.kernels.bn_cosine_loss import bn_column_stats, bn_cosine_loss
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.validation import (NonNegativeFloat, PositiveFloat, PositiveInt, RightOpenUnitInterval, check_args,
                                  check_memory)

from featlearn.kernels.patch_activation_sum import patch_activation_sum

CUBIC = Activation("pow", q=3)
HEADS = ("offdiag", "none", "full")
TARGETS = ("shared_sg", "ema")
GRADIENTS = ("sample", "population")
_INIT_STREAM = 404


# ----------------------------------------------------------------------------------------------
# losses and encoder as plain functions
# ----------------------------------------------------------------------------------------------
def encode(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor | None = None,
           backend: str = "auto") -> torch.Tensor:
    """Cubic patch encoder ``f[b, j] = sum_p mask[b, p] <w_j, x[b, p]>^3``; x [B, P, d], w [m, d].

    Example:
        >>> encode(torch.ones(1, 2, 3), torch.ones(1, 3)).tolist()
        [[54.0]]
    """
    return patch_activation_sum(x, w, CUBIC, mask=mask, backend=backend).student


def noncontrastive_loss(f_online: torch.Tensor, g_target: torch.Tensor, head: torch.Tensor,
                        out_norm: str = "bn", eps: float = 0.0, backend: str = "auto") -> torch.Tensor:
    """``L = mean ||norm(f E^T) - norm(g)||^2`` (spec 4.1); ``g_target`` is used as given (detach it
    for stop-grad).

    Example:
        >>> f = torch.randn(32, 2, dtype=torch.float64)
        >>> float(noncontrastive_loss(f, f, torch.eye(2, dtype=torch.float64))) < 1e-12
        True
    """
    return bn_cosine_loss(f_online @ head.T, g_target, out_norm=out_norm, eps=eps, backend=backend)


def _moments_M(a: torch.Tensor) -> torch.Tensor:
    """M_rq = E[x_r^3 x_q^3] for x ~ N(0, a) (Isserlis): 9 a_rr a_qq a_rq + 6 a_rq^3."""
    d = torch.diagonal(a, dim1=-2, dim2=-1)
    return 9 * d[..., :, None] * d[..., None, :] * a + 6 * a ** 3


def population_terms(w: torch.Tensor, head: torch.Tensor, features: torch.Tensor, alphas, probs,
                     num_patches: int, num_feature_patches: int, noise_std: float,
                     w_target: torch.Tensor | None = None, stop_grad: bool = True) -> dict:
    """Closed-form population moments (spec 5.6, Gaussian noise, C2' = (P - P0)/2).

    ``w [..., m, d]``, ``head [..., m, m]``, ``features [K, d]``. Returns ``EFG, U = E F^2, EG2`` (each
    ``[..., m]``), and ``B [..., m, K]``, ``a [..., m, m]`` (noise Gram of the online weights).
    """
    c = hypergeometric_moments(num_patches, num_feature_patches)
    feats = features.to(w)
    coef = torch.tensor(alphas, dtype=w.dtype, device=w.device) ** 6 * torch.tensor(probs, dtype=w.dtype,
                                                                                     device=w.device)
    wt = w if w_target is None else w_target
    if stop_grad:
        wt = wt.detach()

    def gram(v):
        b = v @ feats.T
        u = v - b @ feats
        return b, noise_std ** 2 * (u @ u.transpose(-1, -2))

    b, a = gram(w)
    bt, at = (b, a) if (w_target is None and not stop_grad) else gram(wt)
    eb3 = head @ b ** 3                                                  # (E B^3)_{j l}
    efg = c["C0"] * (coef * eb3 * bt ** 3).sum(-1)
    m_on = _moments_M(a)
    u = c["C1"] * (coef * eb3 ** 2).sum(-1) + c["C2"] * torch.diagonal(head @ m_on @ head.transpose(-1, -2),
                                                                       dim1=-2, dim2=-1)
    eg2 = c["C1"] * (coef * bt ** 6).sum(-1) + c["C2"] * 15 * torch.diagonal(at, dim1=-2, dim2=-1) ** 3
    return {"EFG": efg, "U": u, "EG2": eg2, "B": b, "a": a}


def population_loss(w, head, features, alphas, probs, num_patches, num_feature_patches, noise_std,
                    w_target=None, stop_grad: bool = True) -> torch.Tensor:
    """Population loss ``2 - (2/m) sum_j E[F_j G_j] / sqrt(E F_j^2 sg(E G_j^2))`` (spec 5.6), batched
    over leading dims of ``w [..., m, d]``; autograd gives the exact population gradient.

    Example:
        >>> w = torch.eye(2, 6, dtype=torch.float64)                    # w_j = v_j: the optimum
        >>> float(population_loss(w, torch.eye(2, dtype=torch.float64), torch.eye(2, 6, dtype=torch.float64),
        ...                       [4.0, 2.7], [0.5, 0.5], 32, 8, 1.0))  # doctest: +ELLIPSIS
        0.3529...
    """
    t = population_terms(w, head, features, alphas, probs, num_patches, num_feature_patches, noise_std,
                         w_target, stop_grad)
    eg2 = t["EG2"].detach() if stop_grad else t["EG2"]
    return 2 - 2 * (t["EFG"] / torch.sqrt(t["U"] * eg2)).mean(-1)


def representation_correlation(w: torch.Tensor, features: torch.Tensor, alphas, probs, num_patches: int,
                               num_feature_patches: int, noise_std: float) -> torch.Tensor:
    """Corr(f_i(X), f_j(X)) over un-augmented X (all P patches), closed form of spec 5.1:
    Cov = P0^2 sum_l pi_l alpha_l^6 B_il^3 B_jl^3 + (P - P0) M_ij. Returns ``[..., m, m]``."""
    feats = features.to(w)
    b = w @ feats.T
    u = w - b @ feats
    a = noise_std ** 2 * (u @ u.transpose(-1, -2))
    coef = torch.tensor(alphas, dtype=w.dtype, device=w.device) ** 6 * torch.tensor(probs, dtype=w.dtype,
                                                                                     device=w.device)
    b3 = b ** 3
    cov = num_feature_patches ** 2 * (b3 * coef) @ b3.transpose(-1, -2) + (num_patches - num_feature_patches) \
        * _moments_M(a)
    sd = torch.sqrt(torch.diagonal(cov, dim1=-2, dim2=-1))
    return cov / (sd[..., :, None] * sd[..., None, :])


def feature_outcome(cos: torch.Tensor, threshold: float = 0.5) -> tuple[str, list[int]]:
    """Which feature each neuron ends on (``argmax_l |cos_jl|`` if it is >= threshold, else -1) and the
    run's class: ``DIV`` (the neurons cover features 0 and 1), ``COL`` (all learned, one feature) or
    ``PAR`` (some neuron still unlearned, or any other pattern).

    Example:
        >>> feature_outcome(torch.tensor([[0.9, 0.1], [0.05, -0.8]]))
        ('DIV', [0, 1])
    """
    cos = cos.detach().abs().cpu()
    best = cos.max(1)
    learned = [int(i) if float(v) >= threshold else -1 for v, i in zip(best.values, best.indices)]
    covered = set(learned) - {-1}
    if {0, 1} <= covered:
        return "DIV", learned
    if -1 not in learned and len(covered) == 1:
        return "COL", learned
    return "PAR", learned


class PhaseTracker:
    """Boundaries of the four phases of spec 5.2 for m = 2 (lead = the lucky neuron at t = 0).

    * T1: first t with |cos(w_lead, v1)| >= ``t1_cos`` (0.5, [proposal]; appendix: B11 >= 0.01).
    * T2 (end of substitution): first t >= T1 with substitution ratio >= log d, i.e. on v1-samples
      rms(E_lag,lead f_lead) >= log(d) rms(f_lag) (Lemma 5.2's "|E21 f1| >> |f2|" with the paper's log d
      margin) [proposal: the paper's R_lag < |E_lag,lead| / log d (with the E21 typo fixed) is also
      recorded as ``T2_paper``; at demo-A R2 stays ~0.39 at the E21 peak and it never fires].
    * T3 (end of acceleration): first t > T2 with |B_lag,2| >= 1/2 min(|B_lead,1|, sqrt(eta/eta_E) |E_lag,lead|).
    * T4 (end phase reached): first t > T3 with ||offdiag E||_F <= ``fall`` * its running peak.

    ``phase(t)``: 1 before T1, 2 in [T1, T2), 3 in [T2, T3), 4 from T3 on.
    """

    def __init__(self, lead: int, dim: int, lr_ratio: float = 1.0, t1_cos: float = 0.5, fall: float = 0.1):
        self.lead, self.lag = lead, 1 - lead
        self.log_d, self.lr_ratio, self.t1_cos, self.fall = math.log(dim), lr_ratio, t1_cos, fall
        self.bounds: dict[str, int | None] = {"T1": None, "T2": None, "T2_paper": None, "T3": None, "T4": None}
        self.peak = 0.0

    def update(self, step: int, cos: torch.Tensor, b: torch.Tensor, r: torch.Tensor, head: torch.Tensor,
               subst_ratio: float) -> int:
        lead, lag, t = self.lead, self.lag, self.bounds
        e21 = abs(float(head[lag, lead]))
        off = float((head - torch.diag(torch.diagonal(head))).norm())
        self.peak = max(self.peak, off)
        if t["T1"] is None and abs(float(cos[lead, 0])) >= self.t1_cos:
            t["T1"] = step
        if t["T1"] is not None:
            if t["T2_paper"] is None and float(r[lag]) < e21 / self.log_d:
                t["T2_paper"] = step
            if t["T2"] is None and subst_ratio >= self.log_d:
                t["T2"] = step
        if t["T2"] is not None and t["T3"] is None and step > t["T2"]:
            if abs(float(b[lag, 1])) >= 0.5 * min(abs(float(b[lead, 0])), math.sqrt(self.lr_ratio) * e21):
                t["T3"] = step
        if t["T3"] is not None and t["T4"] is None and step > t["T3"] and off <= self.fall * self.peak:
            t["T4"] = step
        return self.phase(step)

    def phase(self, step: int) -> int:
        t = self.bounds
        if t["T1"] is None or step < t["T1"]:
            return 1
        if t["T2"] is None or step < t["T2"]:
            return 2
        if t["T3"] is None or step < t["T3"]:
            return 3
        return 4


def substitution_ratio(w: torch.Tensor, head: torch.Tensor, features: torch.Tensor, alpha1: float,
                       num_patches: int, num_feature_patches: int, noise_std: float, lead: int) -> float:
    """Population version of Lemma 5.2's ratio on v1-samples: rms(E_lag,lead f_lead) / rms(f_lag) over view 1."""
    lag = 1 - lead
    c = hypergeometric_moments(num_patches, num_feature_patches)
    feats = features.to(w)
    b = w @ feats.T
    u = w - b @ feats
    a = noise_std ** 2 * (u @ u.T)
    m = _moments_M(a)

    def ms(j):
        return c["C1"] * alpha1 ** 6 * float(b[j, 0]) ** 6 + c["C2"] * float(m[j, j])
    return abs(float(head[lag, lead])) * math.sqrt(ms(lead) / ms(lag))


# ----------------------------------------------------------------------------------------------
# LightningModule
# ----------------------------------------------------------------------------------------------
class NonContrastiveModule(FeatureLearningModule):
    """BYOL/SimSiam-style non-contrastive learner of spec 004 (module docstring).

    Args:
        width: m, number of neurons (theory: 2).
        head: ``"offdiag"`` (identity init, diagonal frozen; default), ``"none"`` (E = I), ``"full"``.
        target: ``"shared_sg"`` (same W, stop-grad; theory) or ``"ema"`` (EMA copy of W, ``ema_decay``).
        lr: encoder SGD learning rate eta.  head_lr: eta_E (None = lr).
        out_norm: ``"bn"`` (batch statistics, theory) or ``"l2"`` (per-row ablation).
        eps: normaliser epsilon (0 = theory).
        stop_grad: False = no-stop-grad ablation (shared target only).
        symmetrize: average the loss with the views swapped (off = paper).
        gradient: ``"sample"`` (SGD on the sampled batch) or ``"population"`` (exact N = inf gradient).
        init_seed: seed of W^(0) ~ N(0, init_std^2) (None: the DataModule's seed).
        init_std: None = 1/sqrt(d).
        lucky_first: permute the neurons at init so neuron 0 has the largest |<w_j, v1>| (spec 3.5).
        log_every_n_steps: metric period (training steps).
        backend: kernel backend for encoder and loss.
    """

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
        log_every_n_steps: PositiveInt = 100,
        backend: Literal["auto", "torch", "triton"] = "auto",
    ):
        check_args("model", NonContrastiveModule.__init__, locals())
        super().__init__()
        if gradient == "population" and (out_norm != "bn" or eps != 0 or symmetrize):
            raise ConfigError("model.gradient", "'sample' unless out_norm='bn', eps=0, symmetrize=False",
                              gradient)
        if not stop_grad and target == "ema":
            raise ConfigError("model.stop_grad", "True with an EMA target", stop_grad)
        self.save_hyperparameters()
        self.width, self.head_kind, self.target_kind, self.ema_decay = width, head, target, float(ema_decay)
        self.lr = float(lr)
        self.head_lr = float(lr if head_lr is None else head_lr)
        self.out_norm, self.eps, self.stop_grad, self.symmetrize = out_norm, float(eps), stop_grad, symmetrize
        self.gradient, self.init_seed, self.init_std, self.lucky_first = gradient, init_seed, init_std, lucky_first
        self.log_every, self.backend = log_every_n_steps, backend
        self.history: list[dict] = []
        self.tracker: PhaseTracker | None = None

    # --- parameters ---------------------------------------------------------------------------
    def build(self, dm) -> None:
        if gradient_needs_gaussian(self.gradient, dm):
            raise ConfigError("model.gradient", "'sample' for co-occurring features", self.gradient)
        m, d, dtype = self.width, dm.dim, dm.dtype
        # encoder and head with their gradients and copies (EMA target, initial head), built on the CPU
        check_memory("model", NonContrastiveModule.__init__, {"width": m}, 4 * dtype.itemsize * m * (d + m),
                     f"{m} neurons of dimension {d} and an {m} x {m} head", device="cpu")
        seed = dm.seed if self.init_seed is None else self.init_seed
        std = self.init_std if self.init_std is not None else 1.0 / math.sqrt(d)
        w = rng.global_normal(seed, _INIT_STREAM, (m, d), dtype=torch.float64) * std
        if self.lucky_first:
            order = torch.argsort((w @ dm.features.to(torch.float64)[0]).abs(), descending=True)
            w = w[order]
        self.w = torch.nn.Parameter(w.to(dtype))
        eye = torch.eye(m, dtype=dtype)
        if self.head_kind == "none":
            self.register_buffer("head", eye)
        else:
            self.head = torch.nn.Parameter(eye.clone())
            if self.head_kind == "offdiag":
                self.register_buffer("head_grad_mask", 1.0 - eye)
                self.head.register_hook(lambda g: g * self.head_grad_mask)
        if self.target_kind == "ema":
            self.register_buffer("w_target", w.to(dtype).clone())
        self.lead = 0 if self.lucky_first else int(torch.argmax((w @ dm.features.to(torch.float64)[0]).abs()))
        self.tracker = PhaseTracker(self.lead, d, self.lr / max(self.head_lr, 1e-300)) if m == 2 else None

    def target_weights(self) -> torch.Tensor:
        return self.w_target if self.target_kind == "ema" else self.w

    # --- loss -----------------------------------------------------------------------------------
    def batch_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The sampled loss of spec 4.1 on one batch (online: view 1, target: view 2)."""
        x, m1 = batch["x"], batch["view1"].to(batch["x"].dtype)
        m2 = 1.0 - m1

        def one(mo, mt):
            f = encode(x, self.w, mo, self.backend)
            if self.stop_grad:
                with torch.no_grad():
                    g = encode(x, self.target_weights().detach(), mt, self.backend)
            else:
                g = encode(x, self.w, mt, self.backend)
            return noncontrastive_loss(f, g, self.head, self.out_norm, self.eps, self.backend)

        loss = one(m1, m2)
        if self.symmetrize:
            loss = 0.5 * (loss + one(m2, m1))
        return loss

    def population_loss(self) -> torch.Tensor:
        dm = self.dm
        w_t = self.w_target if self.target_kind == "ema" else None
        return population_loss(self.w, self.head, dm.features, dm.alphas, dm.probs, dm.num_patches,
                               dm.num_feature_patches, dm.noise_std, w_target=w_t, stop_grad=self.stop_grad)

    def opt(self) -> float:
        return hypergeometric_moments(self.dm.num_patches, self.dm.num_feature_patches)["OPT"]

    # --- metrics --------------------------------------------------------------------------------
    def correlations(self) -> torch.Tensor:
        """cos(w_j, v_l): neuron x feature ``[m, K]`` (the heat map)."""
        w = self.w.detach()
        return (w @ self.dm.features.to(w).T) / w.norm(dim=1, keepdim=True)

    def heatmaps(self) -> dict[str, torch.Tensor]:
        return {"correlation": self.correlations(), "head": self.head.detach().clone()}

    def outcome(self) -> tuple[str, list[int]]:
        """('DIV' | 'COL' | 'PAR', feature index per neuron or -1)."""
        return feature_outcome(self.correlations())

    @torch.no_grad()
    def metrics(self, loss: float | None = None, rho: torch.Tensor | None = None) -> dict[str, float]:
        dm, w, e = self.dm, self.w.detach(), self.head.detach()
        feats = dm.features.to(w)
        b = w @ feats.T
        cos = b / w.norm(dim=1, keepdim=True)
        u = w - b @ feats
        r = (u * u).sum(1)
        m, k = b.shape
        out: dict[str, float] = {}
        for j in range(m if m <= 8 else 0):
            for ell in range(k):
                out[f"feat/cos_{j}_{ell}"] = float(cos[j, ell])
                out[f"feat/B_{j}_{ell}"] = float(b[j, ell])
            out[f"noise/R_{j}"] = float(r[j])
            out[f"norm/w_{j}"] = float(w[j].norm())
            for q in range(m):
                if q != j:
                    out[f"head/E_{j}_{q}"] = float(e[j, q])
        off = e - torch.diag(torch.diagonal(e))
        out["head/offdiag_fro"] = float(off.norm())
        out["head/asym_fro"] = float((e - e.T).norm())
        out["head/asym_ratio"] = out["head/asym_fro"] / max(out["head/offdiag_fro"], 1e-300)
        corr = representation_correlation(w, feats, dm.alphas, dm.probs, dm.num_patches,
                                          dm.num_feature_patches, dm.noise_std)
        offc = corr[~torch.eye(m, dtype=torch.bool, device=corr.device)]
        out["repr/abs_corr_offdiag_mean"] = float(offc.abs().mean()) if m > 1 else 0.0
        if loss is not None:
            out["loss/train"] = float(loss)
            out["loss/gap_to_opt"] = float(loss) - self.opt()
        if rho is not None:
            for j in range(min(m, 8)):
                out[f"loss/rho_{j}"] = float(rho[j])
        if self.tracker is not None:
            sr = substitution_ratio(w, e, feats, dm.alphas[0], dm.num_patches, dm.num_feature_patches,
                                    dm.noise_std, self.lead)
            out["mech/subst_ratio"] = sr
            out["phase/id"] = float(self.tracker.update(int(self.global_step_safe()), cos, b, r, e, sr))
            out["phase/lead_neuron"] = float(self.lead)
        return out

    def global_step_safe(self) -> int:
        return self.trainer.global_step if self._trainer is not None else len(self.history)

    # --- Lightning hooks ------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        rho = None
        if self.gradient == "population":
            loss = self.population_loss()
            backprop = loss
        else:
            loss = self.batch_loss(batch)
            backprop = loss
            ws = self.trainer.world_size if self._trainer is not None else 1
            if ws > 1:  # the loss is global (synced statistics); DDP averages gradients over ranks
                backprop = loss * ws
        step = self.global_step_safe()
        if step % self.log_every == 0:
            if self.gradient == "sample" and self.out_norm == "bn":
                with torch.no_grad():
                    x, m1 = batch["x"], batch["view1"].to(batch["x"].dtype)
                    f = encode(x, self.w.detach(), m1, self.backend) @ self.head.detach().T
                    g = encode(x, self.target_weights().detach(), 1 - m1, self.backend)
                    rho = bn_column_stats(f, g, backend=self.backend)["rho"]
            met = self.metrics(float(loss.detach()), rho)
            met["step"] = step
            self.history.append(met)
            self.log_dict({k: v for k, v in met.items() if k != "step"}, on_step=True, on_epoch=False)
            if self.tracker is not None:
                for name, t in self.tracker.bounds.items():
                    if t is not None:
                        self.log(f"phase/{name}", float(t), on_step=True, on_epoch=False)
        return backprop

    def validation_step(self, batch, batch_idx):
        with torch.no_grad():
            loss = self.population_loss() if self.gradient == "population" else self.batch_loss(batch)
        self.log("loss/val", loss, on_epoch=True, batch_size=batch["x"].shape[0])

    def configure_optimizers(self):
        groups = [{"params": [self.w], "lr": self.lr}]
        if self.head_kind != "none":
            groups.append({"params": [self.head], "lr": self.head_lr})
        return torch.optim.SGD(groups, lr=self.lr, momentum=0.0, weight_decay=0.0)

    def finish_step(self, step: int) -> None:
        """Algorithm 1 line 6 (diag(E) = 1) and the EMA target update: part of every SGD step."""
        if self.head_kind == "offdiag":
            self.head.diagonal().fill_(1.0)
        if self.target_kind == "ema":
            self.w_target.mul_(self.ema_decay).add_(self.w.detach(), alpha=1 - self.ema_decay)


def gradient_needs_gaussian(gradient: str, dm) -> bool:
    """Population mode needs the default distribution (Gaussian noise, one feature per sample)."""
    return gradient == "population" and getattr(dm, "co_occur", False)



def _population_chunk_fn(features, alphas, probs, num_patches, num_feature_patches, noise_std, lr, chunk):
    """``k`` population-GD steps on (w [S, m, d], e [S, m, m]); ``head_step [S, m, m]`` = eta_E * mask;
    ``peak`` carries max |E| over every step, since E21 can rise and fall between two records."""
    from torch.func import grad_and_value

    def total(w, e):
        return population_loss(w, e, features, alphas, probs, num_patches, num_feature_patches,
                               noise_std).sum()  # runs are independent: grad of the sum = per-run grads

    gv = grad_and_value(total, argnums=(0, 1))

    def run(w, e, head_step, peak):
        for _ in range(chunk):
            (gw, ge), _ = gv(w, e)
            w = w - lr * gw
            e = e - head_step * ge
            peak = torch.maximum(peak, e.abs())
        return w, e, peak

    return run


def simulate_population(w0: torch.Tensor, features: torch.Tensor, alphas, probs, num_patches: int,
                        num_feature_patches: int, noise_std: float, steps: int, lr: float = 0.05,
                        head_lr: float | None = None, head="offdiag", record_every: int = 100,
                        compile: bool = False, chunk: int = 10) -> dict:
    """Population gradient descent (spec 5.6) on a batch of independent runs ``w0 [S, m, d]`` at once
    (Algorithm 1 with N = infinity: W and E updated from the same point, diag(E) fixed at 1).

    ``head`` is one of ``HEADS`` or a list with one entry per run (e.g. with and without head in one
    batch). ``compile=True`` runs ``chunk`` steps per ``torch.compile``d call (about 25x faster on CPU
    after a one-off compile of a minute or two); ``record_every`` must then be a multiple of ``chunk``.

    Returns ``steps [T]``, ``cos [T, S, m, K]``, ``B [T, S, m, K]``, ``R [T, S, m]``, ``E [T, S, m, m]``,
    ``loss [T, S]`` recorded every ``record_every`` steps (and at the end), the final ``w``, ``head``, and
    ``E_peak [S, m, m]``, max |E| over every step (not only the recorded ones).

    Example:
        >>> w0 = torch.randn(3, 2, 10, dtype=torch.float64) / 10 ** 0.5
        >>> out = simulate_population(w0, torch.eye(2, 10, dtype=torch.float64), [4.0, 2.7], [0.5, 0.5],
        ...                           32, 8, 1.0, steps=20, record_every=10)
        >>> out["E"].shape
        torch.Size([3, 3, 2, 2])
    """
    s, m, _ = w0.shape
    heads = [head] * s if isinstance(head, str) else list(head)
    if len(heads) != s or any(h not in HEADS for h in heads):
        raise ConfigError("head", f"one of {HEADS} or a list of them, one per run", head)
    if compile and record_every % chunk:
        raise ConfigError("record_every", f"a multiple of chunk={chunk} when compiling", record_every)
    head_lr = lr if head_lr is None else head_lr
    feats = features.to(w0)
    eye = torch.eye(m, dtype=w0.dtype, device=w0.device)
    masks = {"offdiag": 1 - eye, "full": torch.ones_like(eye), "none": torch.zeros_like(eye)}
    head_step = torch.stack([head_lr * masks[h] for h in heads])
    w = w0.clone()
    e = eye.expand(s, m, m).clone()
    peak = e.abs()
    k = chunk if compile else 1
    run = _population_chunk_fn(feats, list(alphas), list(probs), num_patches, num_feature_patches,
                               float(noise_std), float(lr), k)
    if compile:
        run = torch.compile(run, dynamic=False)
    rec = {key: [] for key in ("steps", "cos", "B", "R", "E", "loss")}

    def record(t):
        with torch.no_grad():
            loss = population_loss(w, e, feats, alphas, probs, num_patches, num_feature_patches, noise_std)
            b = w @ feats.T
            u = w - b @ feats
            rec["steps"].append(t)
            rec["B"].append(b.clone())
            rec["cos"].append(b / w.norm(dim=-1, keepdim=True))
            rec["R"].append((u * u).sum(-1))
            rec["E"].append(e.clone())
            rec["loss"].append(loss.clone())

    t = 0
    record(0)
    while t < steps:
        if t + k > steps:  # tail shorter than a chunk: eager single steps
            run, k = _population_chunk_fn(feats, list(alphas), list(probs), num_patches,
                                          num_feature_patches, float(noise_std), float(lr), 1), 1
        w, e, peak = run(w, e, head_step, peak)
        t += k
        if t % record_every == 0 or t == steps:
            record(t)
    out = {key: torch.stack(v) if key != "steps" else torch.tensor(v) for key, v in rec.items()}
    out["w"], out["head"], out["E_peak"] = w, e, peak
    return out
