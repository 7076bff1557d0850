"""Early stopping chosen on validation data: keep the weights of the best validation score seen during a fit and
put them back when the fit ends (the stopping step as a hyperparameter, selected on held-out data)."""
from __future__ import annotations

import math

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info


class KeepBestOnValidation(L.Callback):
    """After every validation run, keep a copy of the module's state when ``monitor`` beats every earlier
    score (strictly: of equal scores the earliest step is kept, the shorter run); at the end of the fit load the
    kept state back, so what the caller evaluates next is the model stopped at ``best_step``.

    ``last.ckpt`` (:class:`~featlearn.callbacks.FinalCheckpoint`) stays the final state, so a resumed run
    continues from where training ended; only the module in memory changes, after every checkpoint is written (and
    after the module's ``hp/*`` results of the final state are logged), and the restored step is printed. So it
    serves code that evaluates the module after ``trainer.fit`` (the experiments); a ``lightning fit`` run that
    should keep its best state on disk adds Lightning's ``ModelCheckpoint(monitor=..., mode=...)`` instead.
    A non-finite score is never kept. Under DDP every rank must see the same score: log it with
    ``sync_dist=True`` or a torchmetrics metric (the two-layer modules do), else the ranks may keep different
    steps. When no validation ran, nothing changes (``best_step`` stays None). The kept state is not part of
    checkpoints: a fit resumed from one chooses among the steps validated after the resume.

    Where validation runs is the trainer's choice: ``val_check_interval: 50`` with
    ``check_val_every_n_epoch: null`` scores every 50 global steps.

    Example:
        >>> keep = KeepBestOnValidation(monitor="val/acc", mode="max")
        >>> trainer = L.Trainer(callbacks=[keep], val_check_interval=50, check_val_every_n_epoch=None)  # doctest: +SKIP
        >>> trainer.fit(model, datamodule)  # doctest: +SKIP
        >>> keep.best_step, keep.best_score  # doctest: +SKIP
        (600, 0.953)
    """

    def __init__(self, monitor: str = "val/acc", mode: str = "max"):
        if mode not in ("max", "min"):
            raise ValueError(f"mode: 'max' or 'min', got {mode!r}")
        self.monitor, self.mode = monitor, mode
        self.best_step: int | None = None
        self.best_score: float | None = None
        self.scores: dict[int, float] = {}  # global step -> score, every validation run of the fit
        self._state: dict[str, torch.Tensor] | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self.best_step = self.best_score = self._state = None
        self.scores = {}

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        score = float(trainer.callback_metrics[self.monitor])
        self.scores[trainer.global_step] = score
        if not math.isfinite(score):
            return
        if self.best_score is None or (score > self.best_score if self.mode == "max" else score < self.best_score):
            self.best_step, self.best_score = trainer.global_step, score
            # on the host: a GPU run does not hold a second copy of the model in device memory
            self._state = {k: v.detach().to("cpu", copy=True) for k, v in pl_module.state_dict().items()}

    def on_fit_end(self, trainer, pl_module) -> None:
        if self._state is not None:
            pl_module.load_state_dict(self._state)
            self._state = None
            rank_zero_info(f"featlearn: kept the state of global step {self.best_step} "
                           f"({self.monitor} {self.best_score:.6g}, the best of {len(self.scores)} validations)")
