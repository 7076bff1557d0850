"""Early stopping chosen on validation data: keep the weights of the best validation score seen during a fit and
put them back when the fit ends (the stopping step as a hyperparameter, selected on held-out data)."""
from __future__ import annotations

import math

import lightning as L
import torch


class KeepBestOnValidation(L.Callback):
    """After every validation run, keep a copy of the module's state when ``monitor`` beats every earlier
    score (strictly: of equal scores the earliest step is kept, the shorter run); at the end of the fit load the
    kept state back, so what the caller evaluates next is the model stopped at ``best_step``.

    ``last.ckpt`` (:class:`~featlearn.callbacks.FinalCheckpoint`) stays the final state, so a resumed run
    continues from where training ended; only the module in memory changes, after every checkpoint is written.
    A non-finite score is never kept. Under DDP the score is the one Lightning reduced over ranks, so every rank
    keeps the same step. When no validation ran, nothing changes (``best_step`` stays None).

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
            self._state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_fit_end(self, trainer, pl_module) -> None:
        if self._state is not None:
            pl_module.load_state_dict(self._state)
