"""A progress bar that counts optimisation steps against ``max_steps``, with the time left.

Lightning's bar counts batches within an epoch; in full-batch mode every step is an epoch, so it reads
"Epoch 19: 1/1" and never says how far the run is. This bar shows ``step t/max_steps`` over the whole
fit, the rate and the estimated time left, the training loss (what ``training_step`` returns, for every
method alike, read at the first and last steps and every ``log_every_n_steps`` steps, when the step's
metrics are read anyway: no extra device sync) and the metrics logged with ``prog_bar=True``.
"""
import time

from lightning.pytorch.callbacks import TQDMProgressBar

REDRAW_SECONDS = 0.2
"""The bar redraws at most this often (and at the last step)."""


class StepProgressBar(TQDMProgressBar):
    """Training progress in optimisation steps (``max_steps``, or the steps of ``max_epochs`` epochs).

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[StepProgressBar()], max_steps=10)  # doctest: +SKIP
    """

    @property
    def total_train_batches(self):
        trainer = self.trainer
        if trainer.max_steps and trainer.max_steps > 0:
            return trainer.max_steps
        per_epoch = trainer.num_training_batches
        if trainer.max_epochs and trainer.max_epochs > 0 and per_epoch != float("inf"):
            return per_epoch * trainer.max_epochs
        return None

    def on_train_start(self, *_) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        self.train_progress_bar.reset(total=self.total_train_batches)
        self.train_progress_bar.initial = 0
        self.train_progress_bar.n = self.trainer.global_step  # a resumed run starts where it stopped
        self.train_progress_bar.set_description("step")

    def on_train_epoch_start(self, trainer, *_) -> None:
        pass  # one bar for the whole fit, not one per epoch

    _loss: float | None = None
    _drawn: float = -float("inf")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        step = trainer.global_step
        if loss is not None and (step % max(1, trainer.log_every_n_steps) == 0 or step in (1, trainer.max_steps)):
            # several seeds in one run return the sum of their losses: the bar shows their mean
            seeds = len(pl_module.live) if getattr(pl_module, "judges_seeds", False) else 1
            self._loss = float(loss) / max(1, seeds)
        now = time.monotonic()
        total = self.total_train_batches or 0
        # at most a few redraws a second: a redraw per step (tqdm's text, the logged metrics' host copies)
        # cost ~5% of a 40 ms step
        if self._should_update(step, total) and (now - self._drawn >= REDRAW_SECONDS or step == total):
            self._drawn = now
            self.train_progress_bar.n = step
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))  # redraws once

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        return metrics if self._loss is None else {"loss": f"{self._loss:.4g}", **metrics}

    def on_train_end(self, trainer, pl_module) -> None:
        # the last redraw may be up to REDRAW_SECONDS old (a run stopped by max_epochs, early stopping, ...)
        if not self.train_progress_bar.disable:
            self.train_progress_bar.n = trainer.global_step
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
        super().on_train_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # in full-batch mode every step ends an epoch: the same throttle as the steps'
        now = time.monotonic()
        if not self.train_progress_bar.disable and now - self._drawn >= REDRAW_SECONDS:
            self._drawn = now
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
