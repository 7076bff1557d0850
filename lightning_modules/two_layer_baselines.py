"""The fixed-feature baselines of the two-layer network (Shi 2024, App. A.7.1), one class per method over
:class:`~featlearn.lightning_modules.two_layer.TwoLayerBase`: every one trains for the same T steps on the
same batches as :class:`~featlearn.lightning_modules.two_layer.TwoLayerNetwork`, with the stage-3 step size
tuned on the same grid by the experiment.

* :class:`TwoLayerNTK`: the network linearised at its initialisation,
  ``f(x) = sum_i da_i sigma(z_i) + sum_i a_i^(0) sigma'(z_i) (<dw_i, x> + db_i)`` with
  ``z_i = <w_i^(0), x> + b_i^(0)``: two GEMMs per batch, never the kernel matrix. Its parameters are the
  displacements ``dw``, ``db``, ``da`` from the init ``w0``, ``b0``, ``a0``;
* :class:`TwoLayerRF`: the second layer only, first layer frozen at init (random features);
* :class:`TwoLayerOneStep` / :class:`TwoLayerTwoStep`: steps 1 (and 2) of the schedule, then the first
  layer frozen and "the best classifier" on the hidden layer (``readout: best``): at the next step, a
  full-batch one, the readout is set to :func:`~featlearn.theory.two_layer.best_linear_classifier` of the
  whole training split's hidden layer, standardised (float64, per neuron, with an intercept), and the
  remaining steps change nothing. Standardised because the step-1 features vary by ~1e-8 around their
  mean (eta^(1) ~ 1e-8): on the raw float32 layer a tiny ridge is already the constant predictor. ``readout: schedule`` trains it
  with the stage-3 steps instead, which at the theory's step size stops at the threshold rule (README,
  chapter 2).

Example:
    >>> from featlearn.datamodules.structured_parity import StructuredParityDataModule
    >>> dm = StructuredParityDataModule(dim=30, num_patterns=12, k=3, num_train=64, batch_size=16)
    >>> ntk = TwoLayerNTK(width=8, steps=10).attach(dm)
    >>> sorted(name for name, _ in ntk.named_parameters()), float(ntk.dw.abs().max())
    (['da', 'db', 'dw'], 0.0)
    >>> groups = TwoLayerTwoStep(width=8, steps=10).attach(dm).schedule_at(3)["groups"]
    >>> groups.get("w")   # the first layer's step size and decay: frozen after step 2
    (0.0, 1.0)
"""
from __future__ import annotations

from typing import Literal

import torch

from featlearn.errors import ConfigError
from featlearn.kernels.smoothed_clamp import gaussian_smoothed_clamp, gaussian_smoothed_clamp_derivative
from featlearn.lightning_modules.two_layer import TwoLayerBase
from featlearn.theory.two_layer import best_linear_classifier, hinge
from featlearn.validation import PositiveFloat, check_args


class TwoLayerNTK(TwoLayerBase):
    """The network linearised at its initialisation (module docstring): every step a stage-3 step on
    ``dw``, ``db``, ``da``; CosSim is of ``w0 + dw``, and no MDS picture (its features are the init's)."""

    feature_learning = False

    def init_parameters(self, w: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> None:
        self.register_buffer("w0", w)
        self.register_buffer("b0", b)
        self.register_buffer("a0", a)
        self.dw = torch.nn.Parameter(torch.zeros_like(w))  # the linearisation's parameters: displacements
        self.db = torch.nn.Parameter(torch.zeros_like(b))
        self.da = torch.nn.Parameter(torch.zeros_like(a))

    def trained(self) -> dict[str, torch.nn.Parameter]:
        return {"a": self.da, "w": self.dw, "b": self.db}

    def first_layer(self) -> torch.Tensor:
        """``w^(0) + dw`` ``[2m, d]``."""
        return (self.w0 + self.dw).detach()

    def keeps_snapshot(self, step: int) -> bool:
        return False

    def forward(self, x: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
        """``f(x) = sigma(z0) da + (sigma'(z0) * (x dW^T + db)) a0``, ``z0 = x W0^T + b0``."""
        with torch.no_grad():
            z0 = torch.addmm(self.b0, x, self.w0.T)
            act0 = gaussian_smoothed_clamp(z0, smoothing)
            slope0 = gaussian_smoothed_clamp_derivative(z0, smoothing) * self.a0
        return act0 @ self.da + (slope0 * torch.addmm(self.db, x, self.dw.T)).sum(1)


class TwoLayerFrozen(TwoLayerBase):
    """A method whose first layer freezes after ``frozen_after`` steps of the schedule (its pictures are
    those up to then)."""

    frozen_after = 0

    def keeps_snapshot(self, step: int) -> bool:
        return self.frozen_after >= step

    def on_fit_start(self) -> None:
        super().on_fit_start()
        trainer = self.trainer
        strategy = trainer.strategy
        if (trainer.world_size > 1 and hasattr(strategy, "_ddp_kwargs")
                and not strategy._ddp_kwargs.get("find_unused_parameters", False)):
            # DDP waits for a gradient of every parameter it was built with; a layer frozen mid-run sends none
            raise ConfigError("trainer.strategy", f"ddp_find_unused_parameters_true for {type(self).__name__} on "
                                                  f"several processes (its first layer freezes after step "
                                                  f"{self.frozen_after}, and plain DDP then waits for "
                                                  f"its gradients)", strategy.__class__.__name__)


class TwoLayerRF(TwoLayerFrozen):
    """Random features: the first layer frozen at init, the second trained with the stage-3 steps."""

    frozen_after = 0


class TwoLayerProbe(TwoLayerFrozen):
    """Steps 1..``frozen_after`` of the schedule, then the first layer frozen and the second solved exactly
    (module docstring).

    Args:
        readout: ``best`` (the second layer solved exactly, default) or ``schedule`` (stage-3 steps).
        readout_ridge: the ridge of the exact readout (a tiny one: the near-max-margin separator).
        The others: :class:`~featlearn.lightning_modules.two_layer.TwoLayerBase`.
    """

    def __init__(self, schedule: Literal["A20", "A17", "A28"] = "A20", readout: Literal["best", "schedule"] = "best",
                 readout_ridge: PositiveFloat = 1e-8, **base):
        # its features are those of steps 1-2: the plain schedule (no stages) is not one of its choices
        check_args("model", TwoLayerProbe.__init__, locals())
        super().__init__(schedule=schedule, **base)
        self.readout, self.readout_ridge = readout, float(readout_ridge)

    def init_parameters(self, w: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> None:
        super().init_parameters(w, b, a)
        # the readout on standardised features: mean, scale, coefficients + intercept (float64, checkpointed)
        for name, size in (("readout_mean", len(a)), ("readout_scale", len(a)), ("readout_coef", len(a) + 1)):
            self.register_buffer(name, torch.zeros(size, dtype=torch.float64, device=a.device))

    def readout_features(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen hidden layer in float64 (no smoothing: stage 3's), standardised once the readout is set;
        float64 because ``<w_i, x>`` is ~1e-7 of ``b_i`` after step 1 and float32 rounds it away."""
        h = torch.clamp(torch.addmm(self.b.detach().double(), x.double(), self.w.detach().double().T), 0, 1)
        return (h - self.readout_mean) / self.readout_scale

    def forward(self, x: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
        if self.readout != "best" or not bool(self.readout_scale.any()):
            return super().forward(x, smoothing)
        return (self.readout_features(x) @ self.readout_coef[:-1] + self.readout_coef[-1]).to(x.dtype)

    def readout_step(self) -> int | None:
        """The step after the first layer freezes (``readout: best``), None with ``readout: schedule``."""
        return self.frozen_after + 1 if self.readout == "best" else None

    def training_step(self, batch, batch_idx):
        step = self.global_step + 1
        readout = self.readout_step()
        if readout is None or step < readout:
            return super().training_step(batch, batch_idx)
        # from the readout on: the solve at the readout step (a full batch), then nothing to do; the loss
        # returned is a zero that keeps Lightning's step count (and DDP) going
        if step == readout:
            self.fit_readout(batch["x"], batch["y"])
        if step == readout or self.theory_due():
            with torch.no_grad():
                loss = hinge(batch["y"] * self(batch["x"]))
            self.log_step(loss, 3)
        self.a.requires_grad_(True)
        return self.a.sum() * 0.0

    @torch.no_grad()
    def fit_readout(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Set the readout to the best linear classifier (with intercept) of the standardised hidden layer on
        ``(x, y)`` (every rank's share gathered first, so all ranks solve the same problem); ``a`` gets its
        coefficients on the raw layer, the intercept stays in ``readout_coef``."""
        self.readout_mean.zero_()
        self.readout_scale.fill_(1.0)
        h = self.readout_features(x)
        trainer = self._trainer
        if trainer is not None and trainer.world_size > 1:
            h, y = self.all_gather(h).flatten(0, 1), self.all_gather(y).flatten(0, 1)
        mean, std = h.mean(0), h.std(0)
        # a neuron constant on the training split carries nothing: scale 1 keeps its standardised value at 0
        scale = torch.where(std > 0, std, torch.ones_like(std))
        h = (h - mean) / scale
        coef = best_linear_classifier(torch.cat([h, torch.ones_like(h[:, :1])], 1), y.double(), self.readout_ridge)
        self.readout_mean.copy_(mean)
        self.readout_scale.copy_(scale)
        self.readout_coef.copy_(coef)
        self.a.copy_((coef[:-1] / scale).to(self.a.dtype))


class TwoLayerOneStep(TwoLayerProbe):
    """One Step: the features of step 1, then the best classifier on them."""

    frozen_after = 1


class TwoLayerTwoStep(TwoLayerProbe):
    """Two Step: the features of steps 1-2, then the best classifier on them."""

    frozen_after = 2
