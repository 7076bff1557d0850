"""A ModelCheckpoint whose ``last.ckpt`` is the final state of a run, and never a state mid-blow-up."""
from lightning.pytorch.callbacks import ModelCheckpoint

from featlearn.callbacks.divergence import DivergenceGuard, save_may_fall_due, check_guards


class FinalCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also saves ``last.ckpt`` when training ends (without diverging), and
    postpones periodic saves while a :class:`~featlearn.callbacks.DivergenceGuard` marks the run suspect
    (a watched quantity grew past the square root of its factor), so the checkpoint a blow-up leaves
    behind predates it.

    A guard reads its checks every ``divergence.check_every_n_steps`` steps; every save here first has
    it read the steps it kept (a no-op when the guard has just read them), so a checkpoint never holds a
    diverged step and the suspect flag it consults is the current step's.

    Lightning's own ``on_train_end`` saves ``last`` only if no periodic save happened, so a run
    stopped by ``max_steps`` between periodic saves would otherwise end with a stale ``last.ckpt``.

    Example:
        >>> trainer = L.Trainer(callbacks=[DivergenceGuard(), FinalCheckpoint(save_last=True,
        ...     every_n_train_steps=100, save_top_k=0)])  # doctest: +SKIP
    """

    _postponed = False  # a periodic save fell due while the run was suspect (keeps ModelCheckpoint's signature)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if save_may_fall_due(self, trainer.global_step):
            check_guards(trainer)  # raises if a kept step diverged; brings the suspect flag up to date
        if _suspect(trainer):
            due = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
            self._postponed |= due
            return
        if self._postponed and not self._should_skip_saving_checkpoint(trainer):
            self._postponed = False
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer, pl_module) -> None:
        # a run that ends without diverging ends in a state worth keeping, even while it looked suspect
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        check_guards(trainer)  # every path to a file (epoch end, validation end, train end) goes through here
        super()._save_checkpoint(trainer, filepath)


def _suspect(trainer) -> bool:
    return any(getattr(cb, "suspect", False) for cb in trainer.callbacks if isinstance(cb, DivergenceGuard))
