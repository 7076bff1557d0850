"""Contrastive learning with and without RandomMask (Wen & Li 2021; spec 001 sections 3-5).

Network: one hidden layer of ``m`` symmetrized-ReLU (soft-threshold) units
``h_i(x) = ReLU(<w_i,x> - b_i) - ReLU(-<w_i,x> - b_i)`` computed by
:func:`featlearn.kernels.soft_threshold.soft_threshold_layer` (fused Triton kernel on CUDA).

Objective (spec 4.1, corrected gradient 4.2): per anchor
``L = -<f(x_a), sg f(x_q)> + tau * logsumexp_{x in {x_q} u Negatives} <f(x_a), sg f(x)> / tau``,
only the anchor receives gradient; SGD with ``lr = eta`` and ``weight_decay = lambda`` (penalty
``lambda/2 ||W||^2``, default ``lambda = d^-1.75``: the paper's range stalls stage III at small d).

Bias (spec 3.3): ``bias_mode="schedule"`` (default) keeps ``b = 0`` until T1 (first step with
``min_i rho_i >= 1/2``; or a fixed ``bias_reset_step``, the same for every run), resets
``b_i = beta0 sqrt(2 log d / d) ||w_i||`` and then grows it by ``max(c_b eta/d, ||w_i^{t+1}||/||w_i^t|| - 1)``
per step, capped at ``kappa_b ||w_i||``;
``"zero"`` keeps ``b = 0`` (linear network: the linear control); ``"learned"`` trains ``b`` by
SGD (ablation of footnote 4; ``clamp_bias_nonneg`` optional). The bias update is part of
each optimisation step (``finish_step``), so checkpoints never hold a half-finished step.

Losses are plain functions in this file: :func:`infonce_stopgrad` (streams the negatives in chunks with
an online logsumexp, so at most one ``B x chunk`` similarity block exists; its backward returns the
closed-form gradient), :func:`infonce_naive` (autograd reference) and
:func:`infonce_grad_closed_form` (``g = -(1 - l_p) f(q) + sum_s l_s f(n_s)``). Probes:
:func:`ridge_probe`, :func:`logistic_probe`.

Example:
    >>> from featlearn.datamodules.sparse_coding import SparseCodingDataModule
    >>> dm = SparseCodingDataModule(d=16, d1=64, batch_size=32, num_negatives=32)
    >>> model = ContrastiveModule().attach(dm)
    >>> loss = model.training_step(dm.batch(torch.arange(32), "train"), 0)
    >>> bool(torch.isfinite(loss))
    True
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist

from featlearn.datamodules.sparse_coding import pool_negatives
from featlearn.errors import ConfigError
from featlearn.validation import NonNegativeFloat, PositiveFloat, PositiveInt, check_args, check_memory, int_at_least
from featlearn.kernels.soft_threshold import soft_threshold_layer
from featlearn.lightning_modules.base import FeatureLearningModule

__all__ = [
    "ContrastiveModule",
    "infonce_stopgrad",
    "infonce_naive",
    "infonce_grad_closed_form",
    "feature_metrics",
    "active_threshold",
    "ridge_probe",
    "logistic_probe",
]


# ==============================================================================================
# losses
# ==============================================================================================
def _similarities(h_anchor: torch.Tensor, h_neg: torch.Tensor) -> torch.Tensor:
    """``[K, n]`` dot products with a shared pool ``[n, m]`` or per-anchor negatives ``[K, n, m]``."""
    if h_neg.dim() == 2:
        return h_anchor @ h_neg.t()
    return torch.einsum("km,knm->kn", h_anchor, h_neg)


def _aggregate(p: torch.Tensor, h_neg: torch.Tensor) -> torch.Tensor:
    if h_neg.dim() == 2:
        return p @ h_neg
    return torch.einsum("kn,knm->km", p, h_neg)


def _infonce_forward(ha, hq, hn, tau, chunk):
    """Streaming InfoNCE: per-anchor loss, l_p and the closed-form gradient g (no grad tracking)."""
    s_pos = (ha * hq).sum(-1)
    run_max = s_pos / tau
    run_sum = torch.ones_like(s_pos)
    out = hq.clone()  # sum_x exp(s_x/tau - run_max) f(x), positive first
    n = hn.shape[-2]
    for start in range(0, n, chunk):
        block = hn[start:start + chunk] if hn.dim() == 2 else hn[:, start:start + chunk]
        logits = _similarities(ha, block) / tau  # the only K x chunk matrix alive
        new_max = torch.maximum(run_max, logits.amax(-1))
        scale = torch.exp(run_max - new_max)
        probs = logits.sub_(new_max.unsqueeze(-1)).exp_()  # in place: still the one K x chunk matrix
        run_sum = run_sum * scale + probs.sum(-1)
        out = out * scale.unsqueeze(-1) + _aggregate(probs, block)
        run_max = new_max
        del logits, probs
    lse = run_max + torch.log(run_sum)
    loss = -s_pos + tau * lse
    p_pos = torch.exp(s_pos / tau - lse)
    grad = out / run_sum.unsqueeze(-1) - hq
    return loss, p_pos, grad


class _InfoNCEStopGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ha, hq, hn, tau, chunk):
        loss, p_pos, grad = _infonce_forward(ha, hq.detach(), hn.detach(), tau, chunk)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(p_pos)
        return loss, p_pos

    @staticmethod
    def backward(ctx, grad_loss, grad_p):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.unsqueeze(-1), None, None, None, None


def infonce_stopgrad(h_anchor: torch.Tensor, h_pos: torch.Tensor, h_neg: torch.Tensor, temperature: float,
                     chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-anchor stop-gradient InfoNCE (spec eq. 2.2) and the positive's softmax weight.

    ``loss_k = -<a_k, q_k> + tau * logsumexp([<a_k,q_k>, <a_k,n_s>]_s / tau)`` with ``q`` and the
    negatives treated as constants. Negatives are a shared pool ``[N, m]`` or per anchor ``[K, N, m]``;
    they are streamed in blocks of ``chunk_size`` (default: all at once), so memory is
    ``O(K * chunk)``. The backward pass is the closed form ``g = O - f(q)`` (no K x N matrix saved).

    Returns ``(loss [K], p_pos [K])``; ``p_pos`` carries no gradient.

    Example:
        >>> a = torch.randn(4, 8, requires_grad=True)
        >>> loss, p = infonce_stopgrad(a, torch.randn(4, 8), torch.randn(16, 8), 2.0, chunk_size=5)
        >>> loss.mean().backward(); a.grad.shape
        torch.Size([4, 8])
    """
    if temperature <= 0:
        raise ConfigError("temperature", "> 0", temperature)
    if h_neg.dim() not in (2, 3):
        raise ConfigError("h_neg", "[N, m] or [K, N, m]", tuple(h_neg.shape))
    n = h_neg.shape[-2]
    chunk = n if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ConfigError("chunk_size", "a positive integer or None", chunk_size)
    return _InfoNCEStopGrad.apply(h_anchor, h_pos, h_neg, float(temperature), chunk)


def infonce_naive(h_anchor: torch.Tensor, h_pos: torch.Tensor, h_neg: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """Autograd reference: ``tau * cross_entropy`` over ``[s_pos, S]`` with detached keys. Returns ``[K]``."""
    q, n = h_pos.detach(), h_neg.detach()
    logits = torch.cat([(h_anchor * q).sum(-1, keepdim=True), _similarities(h_anchor, n)], dim=-1) / temperature
    target = torch.zeros(h_anchor.shape[0], dtype=torch.long, device=h_anchor.device)
    return temperature * torch.nn.functional.cross_entropy(logits, target, reduction="none")


def infonce_grad_closed_form(h_anchor: torch.Tensor, h_pos: torch.Tensor, h_neg: torch.Tensor,
                             temperature: float) -> torch.Tensor:
    """Corrected spec 4.2 gradient ``dL/df(a) = -(1 - l_p) f(q) + sum_s l_s f(n_s)`` per anchor ``[K, m]``.

    (The paper prints ``+(1 - l_p)``, a sign error.)
    """
    s = torch.cat([(h_anchor * h_pos).sum(-1, keepdim=True), _similarities(h_anchor, h_neg)], -1) / temperature
    soft = torch.softmax(s, dim=-1)
    l_p, l_s = soft[:, 0], soft[:, 1:]
    return -(1 - l_p).unsqueeze(-1) * h_pos + _aggregate(l_s, h_neg)


# ==============================================================================================
# probes (closed-form ridge, LBFGS logistic) and feature metrics
# ==============================================================================================
def _design(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    train, test = train.double(), test.double()
    mean = train.mean(0)
    std = train.std(0).clamp_min(1e-12)
    return (train - mean) / std, (test - mean) / std


def ridge_probe(f_train: torch.Tensor, y_train: torch.Tensor, f_test: torch.Tensor, y_test: torch.Tensor,
                ridge: float = 1e-4) -> float:
    """Test nMSE ``MSE / Var(y)`` of closed-form ridge regression (intercept, standardized features).

    ``ridge`` is relative to the mean eigenvalue of the (standardized) Gram matrix per sample.

    Example:
        >>> x = torch.randn(200, 3); y = x @ torch.tensor([1.0, -2.0, 0.5])
        >>> ridge_probe(x[:100], y[:100], x[100:], y[100:]) < 1e-6
        True
    """
    xtr, xte = _design(f_train, f_test)
    ytr, yte = y_train.double(), y_test.double()
    ymean = ytr.mean()
    gram = xtr.t() @ xtr
    lam = ridge * len(xtr)
    beta = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), xtr.t() @ (ytr - ymean))
    pred = xte @ beta + ymean
    return float(((yte - pred) ** 2).mean() / yte.var().clamp_min(1e-24))


def logistic_probe(f_train: torch.Tensor, y_train: torch.Tensor, f_test: torch.Tensor, y_test: torch.Tensor,
                   l2: float = 1e-4, max_iter: int = 100) -> float:
    """Test accuracy of L2-regularised logistic regression (LBFGS) on labels in {-1, +1}; 0-labels dropped."""
    keep_tr, keep_te = y_train != 0, y_test != 0
    xtr, xte = _design(f_train[keep_tr], f_test[keep_te])
    ytr, yte = (y_train[keep_tr] > 0).double(), y_test[keep_te] > 0
    w = torch.zeros(xtr.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xtr @ w + b, ytr) + 0.5 * l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        return float(((xte @ w + b > 0) == yte).double().mean())


def active_threshold(bias: torch.Tensor, norm: torch.Tensor, d: int) -> torch.Tensor:
    """Per-neuron threshold of the active sets ``N_i = {j : |alpha_ij| >= max(b_i, sqrt(2 log d/d) ||w_i||)}``.

    One definition for every bias mode, so singleton counts compare across settings: an atom must both
    pass the bias (the neuron fires on it alone, spec 5.1) and stand out of the ``sqrt(2 log d / d)``
    level that the largest of ``d`` random coefficients reaches. The schedule's reset puts ``b`` exactly
    at that level (beta0 = 1), so after T1 the bias decides; for ``b <= 0`` (linear control, a learned
    bias gone negative) the norm level does, which is the spec's ``b = 0`` rule.

    Example:
        >>> active_threshold(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 2.0]), 32).tolist()  # doctest: +ELLIPSIS
        [0.93..., 1.0]
    """
    return torch.maximum(bias.float(), math.sqrt(2 * math.log(d) / d) * norm.float())


@torch.no_grad()
def feature_metrics(w: torch.Tensor, bias: torch.Tensor, M: torch.Tensor, temperature: float) -> dict:
    """Spec 5.1 quantities from weights ``[m, d1]``, biases ``[m]`` and dictionary ``[d1, d]``.

    Returns a dict of tensors/floats: ``alpha [m, d]``, ``sparse_frac [m]`` (rho_i), ``top_align``,
    ``active [m, d]`` (the sets N_i), ``singleton [m]``, ``singletons``, ``coverage``,
    ``max_multiplicity``, ``F_over_taulogd [d]`` (NaN for atoms in no N_i), ``bias_ratio [m]``.
    """
    d = M.shape[1]
    alpha = w.float() @ M.float()
    norm2 = (w.float() ** 2).sum(1).clamp_min(1e-30)
    sparse_frac = (alpha ** 2).sum(1) / norm2
    top_align = alpha.abs().amax(1) / norm2.sqrt()
    active = alpha.abs() >= active_threshold(bias, norm2.sqrt(), d).unsqueeze(1)
    sizes = active.sum(1)
    singleton = sizes == 1
    covered = torch.zeros(d, dtype=torch.bool, device=w.device)
    if singleton.any():
        covered[active[singleton].nonzero()[:, 1]] = True
    multiplicity = active.sum(0)
    energy = ((alpha ** 2) * active).sum(0)
    feat = torch.where(multiplicity > 0, energy / (temperature * math.log(d)), torch.nan)
    return {
        "alpha": alpha, "sparse_frac": sparse_frac, "top_align": top_align, "active": active,
        "N_size": sizes, "singleton": singleton, "singletons": int(singleton.sum()),
        "coverage": float(covered.float().mean()), "max_multiplicity": int(multiplicity.max()),
        "F_over_taulogd": feat, "bias_ratio": bias / norm2.sqrt(), "norm": norm2.sqrt(),
    }


# ==============================================================================================
# the LightningModule
# ==============================================================================================
class ContrastiveModule(FeatureLearningModule):
    """Soft-threshold network trained by stop-gradient InfoNCE on sparse-coding data.

    Args:
        width: number of neurons ``m`` (``None``: ``width_mult * d``).
        width_mult: ``m / d`` when ``width`` is None (spec default 4).
        lr: SGD step ``eta`` (spec default 2 at d=32, 1 above).
        weight_decay: ``lambda`` (``None``: ``d^-1.75``).
        temperature: ``tau`` (``None``: ``log d``).
        init_scale: ``sigma0`` (``None``: ``1/(d sqrt(d1))``).
        bias_mode: ``"schedule"`` (paper), ``"zero"`` (linear network) or ``"learned"`` (ablation).
        bias_reset_mult: ``beta0`` of the reset at T1. bias_cap_ratio: ``kappa_b`` (``None``: ``log d/sqrt d``).
        bias_min_rate_mult: ``c_b`` in the minimum growth rate ``c_b eta / d``.
        bias_reset_step: reset the scheduled bias at this step instead of at T1. T1 (``min_i rho_i >= 1/2``)
            depends on the run: without augmentation and with large ``d1/d`` it never comes, so the bias
            stays 0; a fixed step puts runs with and without augmentation on the same bias clock.
        clamp_bias_nonneg: clamp a learned bias at 0 after each step.
        loss_chunk_size: negatives per block in the streamed loss (``None``: all at once).
        backend: soft-threshold layer backend (``auto``/``torch``/``triton``). allow_tf32: TF32 GEMMs in Triton.
        metrics_every_n_steps: log the spec 5.5 weight/feature metrics every this many steps.
        probe_ridge: relative ridge of the regression probes. probe_max_samples: cap on probe samples.
        seed: seed of the weight initialisation (independent of the data seed).
    """

    # normal runs: weight norm up to 17x over 20 steps (stage II from a tiny init), |loss| up to 1.9x
    blowup_factors = {"loss": 100.0, "weight_norm": 1000.0}

    def __init__(
        self,
        width: PositiveInt | None = None,
        width_mult: PositiveFloat = 4.0,
        lr: PositiveFloat = 2.0,
        weight_decay: NonNegativeFloat | None = None,
        temperature: PositiveFloat | None = None,
        init_scale: PositiveFloat | None = None,
        bias_mode: Literal["schedule", "zero", "learned"] = "schedule",
        bias_reset_mult: NonNegativeFloat = 1.0,
        bias_cap_ratio: PositiveFloat | None = None,
        bias_min_rate_mult: NonNegativeFloat = 1.0,
        bias_reset_step: PositiveInt | None = None,
        clamp_bias_nonneg: bool = False,
        loss_chunk_size: PositiveInt | None = None,
        backend: Literal["auto", "torch", "triton"] = "auto",
        allow_tf32: bool = False,
        metrics_every_n_steps: PositiveInt = 25,
        probe_ridge: NonNegativeFloat = 1e-4,
        probe_max_samples: int_at_least(2) = 8000,  # the probes standardise features over their samples
        seed: int = 0,
    ):
        check_args("model", ContrastiveModule.__init__, locals())
        super().__init__()
        self.save_hyperparameters()
        self.hp = self.hparams
        self.T1: int | None = None
        self.T2: int | None = None

    # ------------------------------------------------------------------------------------------
    def build(self, dm) -> None:
        hp = self.hp
        self.d, self.d1 = dm.d, dm.d1
        self.m = hp.width if hp.width is not None else max(1, int(round(hp.width_mult * dm.d)))
        # weights, gradient and initial copy; per step the anchors', positives' and negatives' activations
        # (pre-activation, output, gradient)
        anchors = dm.batch_size or dm.sizes["train"]
        keys = 2 * anchors + (anchors * dm.num_negatives if dm.negatives == "per_anchor" else dm.num_negatives)
        check_memory("model", ContrastiveModule.__init__,
                     {"width": hp.width} if hp.width is not None else {"width_mult": hp.width_mult},
                     4 * self.m * (3 * self.d1 + 3 * keys),
                     f"{self.m} neurons of dimension {self.d1} and their activations on {keys} inputs")
        self.lam = hp.weight_decay if hp.weight_decay is not None else dm.d ** -1.75
        self.tau = hp.temperature if hp.temperature is not None else math.log(dm.d)
        sigma0 = hp.init_scale if hp.init_scale is not None else 1.0 / (dm.d * math.sqrt(dm.d1))
        self.kappa_b = hp.bias_cap_ratio if hp.bias_cap_ratio is not None else math.log(dm.d) / math.sqrt(dm.d)
        gen = torch.Generator().manual_seed(hp.seed)
        self.w = torch.nn.Parameter(sigma0 * torch.randn(self.m, self.d1, generator=gen))
        zeros = torch.zeros(self.m)
        if hp.bias_mode == "learned":
            self.bias = torch.nn.Parameter(zeros)
        else:
            self.register_buffer("bias", zeros)
        self.register_buffer("M", dm.M.clone(), persistent=False)
        self.register_buffer("w_init", self.w.detach().clone(), persistent=False)
        self.register_buffer("norm_T1", torch.zeros(self.m))
        self._prev_norm = None
        self._rho_peak = 0.0

    def configure_optimizers(self):
        groups = [{"params": [self.w], "weight_decay": self.lam}]
        if self.hp.bias_mode == "learned":
            groups.append({"params": [self.bias], "weight_decay": 0.0})
        return torch.optim.SGD(groups, lr=self.hp.lr, momentum=0.0)

    # ------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Representation ``f(x) [.., m]`` of inputs ``[.., d1]``."""
        shape = x.shape[:-1]
        h = soft_threshold_layer(x.reshape(-1, self.d1), self.w, self.bias, backend=self.hp.backend,
                                 allow_tf32=self.hp.allow_tf32)
        return h.reshape(*shape, self.m)

    def contrastive_loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        xa, xq, xn = batch["x_a"], batch["x_q"], batch["x_neg"]
        ha = self(xa)
        with torch.no_grad():
            hq = ha.detach() if xq is xa or xq.data_ptr() == xa.data_ptr() else self(xq)
            hn = self(xn)
            if "neg_pool_size" in batch:
                hn = self._global_pool(hn, batch["index"], int(batch["neg_pool_size"]))
        loss, p_pos = infonce_stopgrad(ha, hq, hn, self.tau, self.hp.loss_chunk_size)
        n_b = hn.shape[-2] + 1
        stats = {
            "p_pos": p_pos.mean(), "uniform_dev": (p_pos - 1.0 / n_b).abs().mean(),
            "fire_anchor": (ha != 0).float().mean(), "fire_pos": (hq != 0).float().mean(),
            "fire_neg": (hn != 0).float().mean(), "active_per_sample": (ha != 0).float().sum(-1).mean(),
            "uniform": self.tau * math.log(n_b),
        }
        return loss.mean(), stats

    def _global_pool(self, h_owned: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
        """The shared pool of the global batch ``[size, m]`` from every device's own negatives ``[B, r, m]``.

        Representations (``m`` wide) are gathered rather than inputs (``d1`` wide), so each device
        encodes only its own ``B r ~ N / W`` negatives. They are gathered without gradient: the
        stop-gradient loss differentiates the anchor only. DDP then averages the per-device means over
        ``B`` anchors, which is the global mean because every device holds the same ``B``.
        """
        return pool_negatives(_all_gather_cat(h_owned), _all_gather_cat(index), size)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self._prev_norm = self.w.detach().norm(dim=1)
        loss, st = self.contrastive_loss(batch)
        if self._trainer is not None:
            self.log("loss/contrastive", loss, prog_bar=True)
            self.log("loss/normalized", loss / st["uniform"], prog_bar=True)
            self.log("loss/objective", loss.detach() + 0.5 * self.lam * (self.w.detach() ** 2).sum())
            if self.global_step % self.hp.metrics_every_n_steps == 0:
                self.log_dict({"logits/p_pos_mean": st["p_pos"], "logits/uniform_dev": st["uniform_dev"],
                               "act/fire_rate_anchor": st["fire_anchor"], "act/fire_rate_pos": st["fire_pos"],
                               "act/fire_rate_neg": st["fire_neg"], "act/active_per_sample": st["active_per_sample"]})
        return loss

    # ------------------------------------------------------------------------------------------
    def finish_step(self, step: int) -> None:
        """Stage detection and bias update: part of each optimisation step."""
        hp = self.hp
        w = self.w.detach()
        norm = w.norm(dim=1)
        alpha = w @ self.M
        rho = (alpha ** 2).sum(1) / (norm ** 2).clamp_min(1e-30)
        self._rho_peak = max(self._rho_peak, float(rho.mean()))
        if self.T1 is None and float(rho.min()) >= 0.5:
            self.T1 = step
            self.norm_T1.copy_(norm)
            self._log_scalar("stage/T1", step)
        reset = step == (hp.bias_reset_step if hp.bias_reset_step is not None else self.T1)
        if hp.bias_mode == "schedule" and reset:
            self.bias.copy_(hp.bias_reset_mult * math.sqrt(2 * math.log(self.d) / self.d) * norm)
        elif hp.bias_mode == "schedule" and self._prev_norm is not None:
            # multiplicative growth: a no-op while b = 0, i.e. before the reset
            rate = torch.clamp_min(norm / self._prev_norm.clamp_min(1e-30) - 1.0,
                                   hp.bias_min_rate_mult * hp.lr / self.d)
            cap = self.kappa_b * norm
            grown = torch.minimum(self.bias * (1 + rate), cap)
            self.bias.copy_(torch.where(self.bias < cap, grown, cap))
        if hp.bias_mode == "learned" and hp.clamp_bias_nonneg:
            self.bias.clamp_(min=0.0)
        if self.T1 is not None and self.T2 is None:
            if float((norm ** 2 / self.norm_T1.clamp_min(1e-30) ** 2).max()) >= self.d:
                self.T2 = step
                self._log_scalar("stage/T2", step)
        if self._trainer is not None and step % hp.metrics_every_n_steps == 0:
            self.log_dict(self._weight_metrics(), on_step=True, on_epoch=False)
            if step % (4 * hp.metrics_every_n_steps) == 0:
                self._log_histograms(step)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["contrastive_stages"] = {"T1": self.T1, "T2": self.T2, "rho_peak": self._rho_peak}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        st = checkpoint.get("contrastive_stages", {})
        self.T1, self.T2, self._rho_peak = st.get("T1"), st.get("T2"), st.get("rho_peak", 0.0)

    def stage(self) -> int:
        return 1 if self.T1 is None else (2 if self.T2 is None else 3)

    def _log_histograms(self, step: int) -> None:
        """TensorBoard histograms of rho_i, |alpha_ij| and |N_i| (spec 5.5), when a TensorBoard logger is attached."""
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers = [lg for lg in self.trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers or self.trainer.global_rank != 0:
            return
        fm = feature_metrics(self.w.detach(), self.bias.detach(), self.M, self.tau)
        exp = loggers[0].experiment
        exp.add_histogram("weights/sparse_frac", fm["sparse_frac"].cpu(), step)
        exp.add_histogram("weights/alpha_abs", (fm["alpha"].abs() / fm["norm"].unsqueeze(1)).cpu(), step)
        exp.add_histogram("features/N_i_size_hist", fm["N_size"].float().cpu(), step)

    def _log_scalar(self, name: str, value: float) -> None:
        if self._trainer is not None:
            for logger in self.trainer.loggers:
                logger.log_metrics({name: float(value)}, step=self.global_step)

    def _weight_metrics(self) -> dict[str, float]:
        fm = feature_metrics(self.w.detach(), self.bias.detach(), self.M, self.tau)
        f = fm["F_over_taulogd"]
        f = f[~torch.isnan(f)]
        return {
            "weights/norm_mean": float(fm["norm"].mean()), "weights/norm_max": float(fm["norm"].max()),
            "weights/sparse_frac_mean": float(fm["sparse_frac"].mean()),
            "weights/sparse_frac_min": float(fm["sparse_frac"].min()),
            "weights/sparse_frac_max": float(fm["sparse_frac"].max()),
            "weights/top_align_mean": float(fm["top_align"].mean()),
            "features/singletons": float(fm["singletons"]), "features/coverage": fm["coverage"],
            "features/max_multiplicity": float(fm["max_multiplicity"]),
            "features/F_over_taulogd_mean": float(f.mean()) if len(f) else 0.0,
            "bias/mean": float(self.bias.detach().mean()), "bias/ratio_mean": float(fm["bias_ratio"].mean()),
            "stage/id": float(self.stage()),
        }

    # ------------------------------------------------------------------------------------------
    # evaluation: probes and representation geometry on the fixed val/test splits
    # ------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        return None  # everything happens once per epoch in on_validation_epoch_end

    def test_step(self, batch: dict, batch_idx: int) -> None:
        return None

    @torch.no_grad()
    def evaluate(self, train: dict, test: dict) -> dict[str, float]:
        """Probes fitted on ``train`` and scored on ``test`` (dicts of a split), plus geometry metrics."""
        cap = self.hp.probe_max_samples
        train = {k: v[:cap] for k, v in train.items()}
        test = {k: v[:cap] for k, v in test.items()}
        ftr, fte = self(train["x"]), self(test["x"])
        out = {
            "probe/reg_nmse": ridge_probe(ftr, train["y_reg"], fte, test["y_reg"], self.hp.probe_ridge),
            "probe/reg_nmse_raw": ridge_probe(train["x"], train["y_reg"], test["x"], test["y_reg"],
                                              self.hp.probe_ridge),
            "probe/cls_acc": logistic_probe(ftr, train["y_cls"], fte, test["y_cls"]),
            "probe/cls_acc_raw": logistic_probe(train["x"], train["y_cls"], test["x"], test["y_cls"]),
        }
        signal = test["x"] - test["xi"]
        f_sig, f_xi = self(signal), self(test["xi"])
        out.update(_cosines(fte, f_sig, f_xi))
        out["act/fire_rate_raw"] = float((fte != 0).float().mean())
        return out

    def on_validation_epoch_end(self) -> None:
        val = self.dm.full("val", self.device)
        half = len(val["x"]) // 2
        first = {k: v[:half] for k, v in val.items()}
        second = {k: v[half:] for k, v in val.items()}
        self.log_dict(self.evaluate(first, second))

    def on_test_epoch_end(self) -> None:
        metrics = self.evaluate(self.dm.full("val", self.device), self.dm.full("test", self.device))
        metrics.update(self._weight_metrics())
        self.log_dict(metrics)

    def summary(self) -> dict[str, float]:
        """Final metrics for tables: feature metrics, stages, probes (fit on val, scored on test)."""
        out = self._weight_metrics()
        out.update(self.evaluate(self.dm.full("val", self.device), self.dm.full("test", self.device)))
        out["stage/T1"] = float("nan") if self.T1 is None else float(self.T1)
        out["stage/T2"] = float("nan") if self.T2 is None else float(self.T2)
        out["weights/sparse_frac_peak"] = self._rho_peak
        out["m"] = float(self.m)
        return out

    # ------------------------------------------------------------------------------------------
    def correlations(self) -> torch.Tensor:
        """Neuron x atom cosines ``<w_i, M_j> / ||w_i||`` ``[m, d]``."""
        w = self.w.detach()
        return (w @ self.M) / w.norm(dim=1, keepdim=True).clamp_min(1e-30)

    def heatmaps(self) -> dict[str, torch.Tensor]:
        """``|correlation|`` with rows sorted by their argmax atom (the paper's feature picture)."""
        c = self.correlations()
        order = torch.argsort(c.abs().argmax(1) * 2.0 - c.abs().amax(1), stable=True)
        return {"correlation": c[order]}


def _all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` concatenated along dim 0 in rank order, without autograd.

    Plain ``torch.distributed.all_gather`` (gloo and NCCL alike): Lightning's ``all_gather`` goes through
    the deprecated differentiable collective even when no gradient is wanted.
    """
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _cosines(f_x, f_sig, f_xi) -> dict[str, float]:
    def cos(a, b):
        na, nb = a.norm(dim=-1), b.norm(dim=-1)
        keep = (na > 0) & (nb > 0)
        if not keep.any():
            return 0.0
        return float(((a * b).sum(-1)[keep] / (na[keep] * nb[keep])).mean())

    return {"repr/cos_fx_fMz": cos(f_x, f_sig), "repr/cos_fx_fxi": cos(f_x, f_xi),
            "repr/dist_fx_fMz": float((f_x - f_sig).norm(dim=-1).mean()),
            "repr/norm_fMz": float(f_sig.norm(dim=-1).mean())}
