"""The two-layer conv encoder of seed 000 and the feature-capture metrics of its theory (spec 2.2, 4.1).

``h_r(X) = sum_p f(<w_r, x_p>)`` with ``km`` kernels and the smoothed ReLU ``f`` (power ``q``,
threshold ``rho``), computed by :func:`featlearn.kernels.patch_activation_sum`. Every module of the
method (teacher-student, MAE, fine-tuning, supervised baseline) derives from
:class:`MultiViewEncoder`, so they all log the same theory metrics:

* ``lambda/{min,median,max}``: ``Lambda_f = max_r [<w_r, v_f>]_+`` over the 2k features;
* ``frac_captured``: share of features with ``Lambda_f >= capture_threshold`` (default ``rho``);
* ``classes_both`` / ``classes_one``: share of classes with both / exactly one feature captured
  (Lemma 1: supervised learning captures about one feature per class);
* ``kernels/{pure,sameclass,crossclass}``: capturing kernels holding one feature, both features of
  one class, or features of several classes;
* ``winner_in_M0_frac``: share of captured features won by a kernel of their initial lottery set
  ``M0_f = {r : <w_r(0), v_f> >= Lambda_f(0) (1 - 1/ln k)}``;
* ``first_capture_step``: buffer with the first step each feature was captured (-1: not yet),
  logged as ``first_capture/{max,mean}`` and, at the end of fit, the histogram ``first_capture_step``.
"""
import math
from typing import Literal

import torch

from featlearn.kernels import Activation, patch_activation_sum
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.validation import PositiveFloat, PositiveInt, check_args, check_memory, int_at_least

Backend = Literal["auto", "torch", "triton"]


def capture_stats(C: torch.Tensor, C0: torch.Tensor, feature_class: torch.Tensor, threshold: float,
                  lottery_factor: float) -> dict[str, torch.Tensor]:
    """Theory metrics of spec 4.1 from correlations ``C = W V^T`` ``[R, F]`` and their initial values ``C0``.

    Example:
        >>> C = torch.tensor([[0.9, 0.0], [0.0, 0.1]])
        >>> capture_stats(C, C, torch.tensor([0, 1]), 0.25, 0.5)["frac_captured"].item()
        0.5
    """
    lam = C.clamp_min(0).max(0).values
    captured = lam >= threshold
    holds = C >= threshold                                                  # [R, F]
    n_held = holds.sum(1)
    classes_held = torch.zeros(C.shape[0], int(feature_class.max()) + 1, device=C.device)
    classes_held.index_add_(1, feature_class.to(C.device), holds.float())
    n_classes = (classes_held > 0).sum(1)
    lottery = C0 >= C0.clamp_min(0).max(0).values * lottery_factor         # [R, F]
    winner = C.argmax(0)
    in_lottery = lottery.gather(0, winner[None]).squeeze(0)
    n_captured = captured.sum().clamp_min(1)
    per_class = torch.zeros(classes_held.shape[1], device=C.device).index_add_(
        0, feature_class.to(C.device), captured.float())
    return {
        "lambda/min": lam.min(), "lambda/median": lam.median(), "lambda/max": lam.max(),
        "frac_captured": captured.float().mean(),
        "classes_both": (per_class == 2).float().mean(), "classes_one": (per_class == 1).float().mean(),
        "kernels/pure": (n_held == 1).sum().float(),
        "kernels/sameclass": ((n_held > 1) & (n_classes == 1)).sum().float(),
        "kernels/crossclass": (n_classes > 1).sum().float(),
        "winner_in_M0_frac": (in_lottery & captured).sum() / n_captured,
        "M0_size/mean": lottery.sum(0).float().mean(), "M0_size/max": lottery.sum(0).float().max(),
    }


class MultiViewEncoder(FeatureLearningModule):
    """``km`` kernels ``W [k m, d]`` with ``W(0) ~ N(0, sigma0^2)`` and the smoothed-ReLU patch sum.

    Args:
        m: kernels per class (width ``k m``; no kernel is tied to a class except by the SL fixed head).
        q: smoothed-ReLU power (>= 2). rho: its threshold (> 0).
        sigma0: initial weight std. lr: gradient-descent step size.
        capture_threshold: correlation that counts as captured (default: ``rho``).
        backend: kernel backend (``auto``, ``torch``, ``triton``).
    """

    # normal runs grow the weight norm by at most 1.35x over 20 steps (teacher-student, MAE at the tiny size)
    blowup_factors = {"loss": None, "weight_norm": 10.0}

    def __init__(self, m: PositiveInt = 3, q: int_at_least(2) = 3, rho: PositiveFloat = 0.25,
                 sigma0: PositiveFloat = 0.02, lr: PositiveFloat = 1.0, capture_threshold: PositiveFloat | None = None,
                 backend: Backend = "auto"):
        check_args("model", MultiViewEncoder.__init__, locals())
        super().__init__()
        self.activation = Activation("srelu", q=q, rho=rho)
        self.m, self.q, self.rho, self.sigma0, self.lr = m, q, rho, sigma0, lr
        self.capture_threshold = rho if capture_threshold is None else capture_threshold
        self.backend = backend

    def build(self, dm) -> None:
        R = dm.k * self.m
        # weight, initial copy and gradient; per step about four [batch, P, R] activations and their grads
        batch = dm.batch_size or dm.sizes["train"]
        check_memory("model", MultiViewEncoder.__init__, {"m": self.m}, 4 * (3 * R * dm.d + 4 * batch * dm.P * R),
                     f"{R} kernels of dimension {dm.d} and their activations on {batch} samples")
        self.k = dm.k
        self.weight = torch.nn.Parameter(torch.randn(R, dm.d) * self.sigma0)
        self.register_buffer("initial_weight", self.weight.detach().clone())
        self.register_buffer("first_capture_step", torch.full((2 * dm.k,), -1, dtype=torch.long))

    def encode(self, x: torch.Tensor, **kwargs):
        """Patch sums of the smoothed ReLU (see :func:`featlearn.kernels.patch_activation_sum`)."""
        return patch_activation_sum(x, self.weight, self.activation, backend=self.backend, **kwargs)

    def correlations(self) -> torch.Tensor:
        return self.weight.detach() @ self.dm.features.to(self.weight).T

    def log_capture(self, prefix: str, step: int) -> dict[str, torch.Tensor]:
        """Record features first captured at ``step`` and log the theory metrics under ``prefix/``."""
        C, C0 = self.correlations(), self.initial_weight @ self.dm.features.to(self.weight).T
        stats = capture_stats(C, C0, self.dm.feature_class(), self.capture_threshold,
                              1.0 - 1.0 / math.log(max(self.k, 3)))
        lam = C.clamp_min(0).max(0).values
        new = (lam >= self.capture_threshold) & (self.first_capture_step < 0)
        self.first_capture_step[new] = step
        seen = self.first_capture_step[self.first_capture_step >= 0].float()
        if len(seen):
            stats["first_capture/max"], stats["first_capture/mean"] = seen.max(), seen.mean()
        stats["weight_norm/max"] = self.weight.detach().norm(dim=1).max()
        self.log_dict({f"{prefix}/{k}": v for k, v in stats.items()})
        self.log("captured", stats["frac_captured"], prog_bar=True, logger=False)
        return stats

    def on_fit_end(self) -> None:
        """Histogram of the per-feature first-capture steps (TensorBoard ``first_capture_step``)."""
        steps = self.first_capture_step[self.first_capture_step >= 0]
        experiment = getattr(self.logger, "experiment", None)
        if len(steps) and hasattr(experiment, "add_histogram"):
            experiment.add_histogram("first_capture_step", steps, self.global_step)
