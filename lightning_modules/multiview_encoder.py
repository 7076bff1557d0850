"""The two-layer conv encoder of Pan et al. 2023 (Sec. 3.2) and the feature-capture metrics of its Thm 1.

``h_r(X) = sum_p f(<w_r, x_p>)`` with ``km`` kernels and the smoothed ReLU ``f`` (power ``q``,
threshold ``rho``), computed by :func:`featlearn.kernels.patch_activation_sum`. Every module of the
method (teacher-student, MAE, fine-tuning, supervised baseline) derives from
:class:`MultiViewEncoder`, so they all log the same theory metrics under ``theory/`` (lower-case: ``M0`` is
``m0`` there): the capture
statistics of :func:`featlearn.theory.mrp.capture_stats` (captured features, classes with both features,
pure / same-class / cross-class kernels, lottery winners) every ``trainer.log_every_n_steps`` steps, and
the buffer ``first_capture_step`` (first step each feature was captured, -1: not yet), updated every step
on the device and drawn at the end of fit as the histogram ``first_capture_step``.

Example:
    >>> from featlearn.datamodules.multiview import MultiViewDataModule
    >>> model = MultiViewEncoder(m=2).attach(MultiViewDataModule(k=4, d=16, P=10, s=1, num_pretrain=8))
    >>> model.correlations().shape, model.final_metrics()["frac_captured"]
    (torch.Size([8, 8]), 0.0)
"""
from typing import Literal

import torch

from featlearn.datamodules.multiview import MultiViewDataModule
from featlearn.kernels import Activation, patch_activation_sum
from featlearn.kernels.backend import Backend
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.theory.mrp import capture_stats, lottery_factor
from featlearn.validation import PositiveFloat, PositiveInt, check_args, check_memory, int_at_least


class MultiViewEncoder(FeatureLearningModule):
    """``km`` kernels ``W [k m, d]`` with ``W(0) ~ N(0, sigma0^2)`` and the smoothed-ReLU patch sum.

    Subclasses take these arguments as ``**encoder`` and restate only those whose default or allowed range
    differs (``q``, ``lr``), so the encoder's arguments are declared here once.

    Args:
        m: kernels per class (width ``k m``; no kernel is tied to a class except by the SL fixed head).
        q: smoothed-ReLU power (>= 2). rho: its threshold (> 0).
        sigma0: initial weight std. lr: gradient-descent step size.
        capture_threshold: correlation that counts as captured (default: ``rho``).
        backend: kernel backend (``auto``, ``torch``, ``triton``).
        compile: run the loss under ``torch.compile`` (``null``: when the run is long enough to repay it).
    """

    datamodule_class = MultiViewDataModule
    train_set: Literal["pretrain", "downstream"] = "pretrain"
    """The DataModule's training set this method learns from (unlabelled pretraining or labelled downstream)."""
    # normal runs grow the weight norm by at most 1.35x over 20 steps (teacher-student, MAE at the tiny size)
    blowup_factors = {"loss": None, "weight_norm": 10.0}

    def __init__(self, m: PositiveInt = 3, q: int_at_least(2) = 3, rho: PositiveFloat = 0.25,
                 sigma0: PositiveFloat = 0.02, lr: PositiveFloat = 1.0, capture_threshold: PositiveFloat | None = None,
                 backend: Backend = "auto", compile: bool | None = None):
        check_args("model", MultiViewEncoder.__init__, locals())
        super().__init__()
        # Lightning collects the arguments of every __init__ up the call chain, so subclasses' are saved too
        self.save_hyperparameters()
        self.activation = Activation("srelu", q=q, rho=rho)
        self.m, self.q, self.rho, self.sigma0, self.lr = m, q, rho, sigma0, lr
        self.capture_threshold = rho if capture_threshold is None else capture_threshold
        self.backend = backend

    def build(self, dm: MultiViewDataModule) -> None:
        dm.use_train_set(self.train_set)
        R = dm.k * self.m
        # weight, initial copy and gradient; per step about four [batch, P, R] activations and their grads
        batch = dm.batch_size or dm.sizes["train"]
        check_memory("model", MultiViewEncoder.__init__, {"m": self.m}, 4 * (3 * R * dm.d + 4 * batch * dm.P * R),
                     f"{R} kernels of dimension {dm.d} and their activations on {batch} samples")
        self.k, self.lottery_factor = dm.k, lottery_factor(dm.k)
        self.weight = torch.nn.Parameter(torch.randn(R, dm.d) * self.sigma0)
        self.register_buffer("initial_weight", self.weight.detach().clone())
        self.register_buffer("first_capture_step", torch.full((2 * dm.k,), -1, dtype=torch.long))
        self.register_ground_truth("features", dm.features)
        self.register_ground_truth("feature_class", dm.feature_class())

    def encode(self, x: torch.Tensor, **kwargs):
        """Patch sums of the smoothed ReLU (see :func:`featlearn.kernels.patch_activation_sum`)."""
        # IEEE dots: the signals the theory tracks are ~1e-2 relative at initialisation (docs/performance.md)
        return patch_activation_sum(x, self.weight, self.activation, backend=self.backend, input_precision="ieee",
                                    **kwargs)

    def representation(self, batch: dict) -> torch.Tensor:
        """The patch sums of the batch's inputs (:class:`~featlearn.callbacks.RepresentationSpectrum` logs their rank)."""
        return self.encode(batch["x"]).student

    def correlations(self) -> torch.Tensor:
        return self.weight.detach() @ self.features.T

    def record_capture(self, step: int) -> None:
        """Stamp ``step`` on the features first captured now (every step, on the device: it is cheap)."""
        lam = self.correlations().clamp_min(0).max(0).values
        self.first_capture_step.masked_fill_((lam >= self.capture_threshold) & (self.first_capture_step < 0), step)

    def theory_metrics(self) -> dict[str, torch.Tensor]:
        """The capture statistics of :func:`featlearn.theory.mrp.capture_stats`, the first-capture steps
        ``first_capture/{max,mean}`` (once a feature is captured) and ``weight_norm/max``."""
        stats = capture_stats(self.correlations(), self.initial_weight @ self.features.T, self.feature_class,
                              self.capture_threshold, self.lottery_factor)
        seen = self.first_capture_step[self.first_capture_step >= 0].float()
        if len(seen):
            stats["first_capture/max"], stats["first_capture/mean"] = seen.max(), seen.mean()
        stats["weight_norm/max"] = self.weight.detach().norm(dim=1).max()
        return stats

    def log_theory(self) -> None:
        """Log :meth:`theory_metrics` as ``theory/<name>`` (lower-case) on the steps where they are due; they
        are computed from the weights, the same on every rank, so they need no sync."""
        if self.theory_due():
            stats = self.theory_metrics()
            self.log_dict({f"theory/{k}": v for k, v in stats.items()})
            self.log("captured", stats["frac_captured"], prog_bar=True, logger=False)

    def final_metrics(self) -> dict[str, float]:
        return {name: float(value) for name, value in self.theory_metrics().items()}

    def on_fit_end(self) -> None:
        """Histogram of the per-feature first-capture steps (TensorBoard ``first_capture_step``)."""
        steps = self.first_capture_step[self.first_capture_step >= 0]
        writer = self.summary_writer()
        if len(steps) and writer is not None:
            writer.add_histogram("first_capture_step", steps, self.global_step)
        super().on_fit_end()
