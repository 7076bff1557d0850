"""Mask-reconstruction pretraining (Pan et al. 2023): teacher-student MRP and the tied-weight MAE variant.

Teacher-student (Pan et al. 2023, Sec. 3.2, ``tau`` of Assumption C.2): the student sees the masked input
``eps X`` (patch kept with probability ``theta``), decodes ``h_r / theta`` and regresses the teacher's pooled features
``h^_r(X)`` computed with ``w^_r = tau w_r`` (stop-gradient copy, not an EMA),
``tau = 1 + (1 - theta) / (C_p theta) + c_tau / (t^(1/q) + 1)``. ``loss="expected"`` uses the closed
form over masks ``1/2 sum_r (H^_r - H_r)^2 + 1/2 (1/theta - 1) sum_{r,p} f(<w_r, x_p>)^2``;
``loss="mc"`` trains on one keep-mask per sample and step, drawn by the DataModule (``batch["mask"]``).

Stabilisation (our finding, not the paper's): with ``tau > 1`` the literal dynamics are not the gradient of
a bounded function and blow up once a kernel is active on two co-occurring features. ``norm_cap`` (default 1)
projects every kernel back onto ``||w_r|| <= norm_cap`` as part of each step (projected GD, a labelled
deviation from the paper); ``norm_cap: null`` runs the literal dynamics (they diverge; the
DivergenceGuard stops them). ``stop_after_capture`` ends pretraining that many steps after every
feature is captured: the theorems hold at a time horizon the paper leaves open, and the kernels keep
growing after it.

Example:
    >>> from featlearn.datamodules.multiview import MultiViewDataModule
    >>> dm = MultiViewDataModule(k=4, d=16, P=10, s=1, num_pretrain=32)
    >>> model = TeacherStudentMRP(m=2).attach(dm)
    >>> model.loss(dm.full("train")).shape
    torch.Size([])
"""
from typing import Literal

import torch

from featlearn.lightning_modules.multiview_encoder import MultiViewEncoder
from featlearn.theory.mrp import teacher_scale
from featlearn.validation import NonNegativeFloat, NonNegativeInt, PositiveFloat, check_args, int_at_least, number_type

KeepProbability = number_type("KeepProbability", float, 0, 1, True, True, "a keep probability in (0, 1)")


def teacher_student_expected_loss(student: torch.Tensor, teacher: torch.Tensor, squares: torch.Tensor,
                                  theta: float) -> torch.Tensor:
    """Mask-expected teacher-student loss from patch sums ``[B, R]``, averaged over samples."""
    return 0.5 * ((teacher - student) ** 2).sum(1).mean() + 0.5 * (1 / theta - 1) * squares.sum(1).mean()


def teacher_student_masked_loss(masked_student: torch.Tensor, teacher: torch.Tensor, theta: float) -> torch.Tensor:
    """Teacher-student loss for one sampled mask: ``1/2 sum_r (H^_r - H_r(eps X) / theta)^2``, mean over samples."""
    return 0.5 * ((teacher - masked_student / theta) ** 2).sum(1).mean()


class _MaskedPretraining(MultiViewEncoder):
    """Keep probability, sampled masks, norm cap and stop rule shared by both pretraining variants.

    Args:
        theta: keep probability of a patch (mask ratio ``1 - theta``), in (0, 1).
        loss: ``expected`` (closed form over masks, the theory's objective) or ``mc`` (sampled masks).
        norm_cap: projected-GD radius per kernel (``null``: no projection).
        stop_after_capture: stop this many steps after all features are captured (``null``: never).
        mask_seed: seed of the sampled masks (``loss=mc``).
        lr: gradient-descent step size. ``**encoder``: see :class:`MultiViewEncoder`.
    """
    compiled_loss = "loss"

    def __init__(self, theta: KeepProbability = 0.5, loss: Literal["expected", "mc"] = "expected",
                 norm_cap: PositiveFloat | None = None, stop_after_capture: NonNegativeInt | None = 200,
                 mask_seed: int = 0, lr: PositiveFloat = 5.0, **encoder):
        check_args("model", _MaskedPretraining.__init__, locals())
        super().__init__(lr=lr, **encoder)
        self.theta, self.norm_cap = theta, norm_cap
        self.stop_after_capture, self.mask_seed = stop_after_capture, mask_seed
        self._stop_step: int | None = None  # the step the run ends at, once every feature is captured
        self._capture_read_at: int | None = None  # the step at which the capture steps were last read

    def build(self, dm) -> None:
        super().build(dm)
        if self.hparams.loss == "mc":
            dm.use_masks(self.theta, self.mask_seed)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.theory_due():  # each self.log costs ~0.5 ms; Lightning writes only these steps anyway
            self.log("train/loss", loss, sync_dist=True)  # the global batch's
        return loss

    def finish_step(self, step: int) -> None:
        if self.norm_cap is not None:
            norms = self.weight.norm(dim=1, keepdim=True)
            self.weight.mul_((self.norm_cap / norms).clamp(max=1.0))
        self.record_capture(step)
        self.log_theory()
        if self.stop_after_capture is not None and self._trainer is not None and self.capture_stop_due(step):
            self.trainer.should_stop = True

    def on_train_start(self) -> None:
        super().on_train_start()
        self._stop_step = self._capture_read_at = None  # a new fit of this module reads the captures afresh

    def capture_stop_due(self, step: int) -> bool:
        """Whether pretraining ends at ``step``: ``stop_after_capture`` steps after the step at which the last
        feature was first captured. The capture steps are read on the host at the first step of a (resumed)
        run and then at the multiples of ``min(log_every_n_steps, stop_after_capture + 1)`` (by default the
        steps Lightning logs, which read the host anyway), not every step, and the stop is still exact: a
        capture after one read ends the run no sooner than ``stop_after_capture`` steps later, by which time
        the next read has seen it. Derived from the checkpointed buffer, so a resumed run stops at the same step."""
        if self._stop_step is None:
            every = max(1, min(self.trainer.log_every_n_steps, self.stop_after_capture + 1))
            if self._capture_read_at is None or step % every == 0:
                self._capture_read_at, first = step, self.first_capture_step.tolist()
                if min(first) >= 0:
                    self._stop_step = max(first) + self.stop_after_capture
        return self._stop_step is not None and step >= self._stop_step

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TeacherStudentMRP(_MaskedPretraining):
    """Teacher-student mask-reconstruction pretraining (the paper's main framework).

    Args:
        c_tau: constant of the decaying part of ``tau``, which the paper leaves open (0, the default: constant
            ``tau``; ``c_tau > 0`` only hastens the blow-up of the literal dynamics).
        q: smoothed-ReLU power, >= 3 (Assumption C.2).
        norm_cap: projected-GD radius per kernel (``null``: literal, unstable dynamics).
        ``**pretraining``: theta, loss, stop_after_capture, mask_seed, lr (see ``_MaskedPretraining``) and
        m, rho, sigma0, capture_threshold, backend (see :class:`MultiViewEncoder`).
    """

    def __init__(self, c_tau: NonNegativeFloat = 0.0, q: int_at_least(3) = 3, norm_cap: PositiveFloat | None = 1.0,
                 **pretraining):
        check_args("model", TeacherStudentMRP.__init__, locals())
        super().__init__(q=q, norm_cap=norm_cap, **pretraining)
        self.c_tau = c_tau

    def build(self, dm) -> None:
        super().build(dm)
        self.C_p = dm.C_p

    def tau(self) -> float:
        """Teacher scale at the current step."""
        return teacher_scale(self.theta, self.C_p, self.c_tau, self.global_step, self.q)

    compiled_loss = "scaled_loss"

    @property
    def compile_pays_after(self) -> int | None:
        # 2x the measured break-even (docs/performance.md); a run that stops at capture ends long before its
        # max_steps (hundreds of steps at the tiny size), so it is not counted as long
        return 3000 if self.stop_after_capture is None else None

    def training_step(self, batch, batch_idx):
        if self.theory_due():
            self.log("train/tau", self.tau())  # the same on every rank: no sync
        return super().training_step(batch, batch_idx)

    def loss(self, batch) -> torch.Tensor:
        return self.scaled_loss(batch, self.tau())

    def scaled_loss(self, batch, tau: float) -> torch.Tensor:
        """The loss at teacher scale ``tau`` (:attr:`compiled_loss`, which must not read the step)."""
        x = batch["x"]
        if self.hparams.loss == "expected":
            sums = self.encode(x, teacher_scale=tau, squares=True)
            return teacher_student_expected_loss(sums.student, sums.teacher, sums.squares, self.theta)
        sums = self.encode(x, teacher_scale=tau, mask=batch["mask"])
        return teacher_student_masked_loss(sums.student, sums.teacher, self.theta)


def mae_expected_loss(x: torch.Tensor, w: torch.Tensor, act, theta: float) -> torch.Tensor:
    """Mask-expected tied-weight MAE loss ``1/2 ||X - G||^2 + 1/2 (1/theta - 1) ||G||^2``, ``G = f(X W^T) W``."""
    g = act(x @ w.T) @ w
    return 0.5 * ((x - g) ** 2).sum((1, 2)).mean() + 0.5 * (1 / theta - 1) * (g ** 2).sum((1, 2)).mean()


def mae_masked_loss(x: torch.Tensor, w: torch.Tensor, act, theta: float, mask: torch.Tensor) -> torch.Tensor:
    """Tied-weight MAE loss for one mask: patch ``p`` decoded from ``eps_p x_p`` only, scaled by ``1/theta``."""
    g = (act(x @ w.T) * mask[..., None]) @ w / theta  # f(<w, eps x>) = eps f(<w, x>) for eps in {0, 1}
    return 0.5 * ((x - g) ** 2).sum((1, 2)).mean()


class MaskedAutoencoderMRP(_MaskedPretraining):
    """Tied-weight MAE variant (Pan et al. 2023, App. H, Fig. 6): reconstruct every patch's pixels.

    Kernels compete through the shared residual, so no norm cap is needed by default.
    Args as :class:`TeacherStudentMRP` (no teacher), with ``q >= 4`` (Assumption H.1).
    """

    def __init__(self, q: int_at_least(4) = 4, **pretraining):
        check_args("model", MaskedAutoencoderMRP.__init__, locals())
        super().__init__(q=q, **pretraining)

    def loss(self, batch) -> torch.Tensor:
        x = batch["x"]
        if self.hparams.loss == "expected":
            return mae_expected_loss(x, self.weight, self.activation, self.theta)
        return mae_masked_loss(x, self.weight, self.activation, self.theta, batch["mask"])
