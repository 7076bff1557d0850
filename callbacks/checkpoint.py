"""A ModelCheckpoint whose ``last.ckpt`` is the final state of a run (also of one stopped by Ctrl-C), and never
a state mid-blow-up."""
import signal
import sys
import threading
import weakref

from lightning.fabric.strategies.launchers import subprocess_script
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

    **Ctrl-C** (SIGINT) on one process lets the step in progress finish, saves it as ``last.ckpt`` and then
    stops as Lightning does on an interrupt (exit code 1); a second Ctrl-C stops at once, keeping
    ``last.ckpt`` at the last finished save. Lightning alone would stop mid-step and leave ``last.ckpt`` at
    the last periodic save. On several processes a deferred stop would need the ranks to agree on the step
    (a sync per step), so there the interrupt only says which step ``last.ckpt`` holds.

    Example:
        >>> trainer = L.Trainer(callbacks=[DivergenceGuard(), FinalCheckpoint(save_last=True,
        ...     every_n_train_steps=100, save_top_k=0)])  # doctest: +SKIP
    """

    _postponed = False  # a periodic save fell due while the run was suspect (keeps ModelCheckpoint's signature)
    _interrupted = False  # Ctrl-C came: stop once the step in progress is finished
    _interrupt_saved = False
    _in_step = False
    _old_handler = None

    def on_train_start(self, trainer, pl_module) -> None:
        global _RUNNING
        _RUNNING = (weakref.ref(self), weakref.ref(trainer))
        if trainer.world_size == 1 and threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGINT, self._on_sigint)

    def lost_line(self, trainer, other: str) -> str:
        """The one line a run that lost ``other`` (a rank) ends with: where, and which step ``last.ckpt`` holds."""
        held = (f"{self.last_model_path} holds step {self._last_global_step_saved}" if self.last_model_path
                else "no checkpoint was saved")
        return (f"rank {trainer.global_rank}: lost {other} of {trainer.world_size} during step "
                f"{trainer.global_step + 1}; {held}")

    def _on_sigint(self, signum, frame) -> None:
        if self._interrupted:  # the second Ctrl-C: the user does not want to wait for the step
            self._restore_handler()
            raise KeyboardInterrupt
        self._interrupted = True
        print("\nfeatlearn: interrupted: saving the step in progress once it finishes (Ctrl-C again to stop now)",
              file=sys.stderr, flush=True)

    def _restore_handler(self) -> None:
        if self._old_handler is not None:
            signal.signal(signal.SIGINT, self._old_handler)
            self._old_handler = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._in_step = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._periodic(trainer, pl_module, outputs, batch, batch_idx)
        self._in_step = False
        if self._interrupted:
            self._save_interrupted(trainer)
            raise KeyboardInterrupt  # Lightning's own shutdown from here: on_exception hooks, exit code 1

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore_handler()
        if trainer.world_size > 1 and lost_peer(exception):
            # the CLI prints this line instead of the traceback (featlearn.cli.main)
            other = f"rank {1 - trainer.global_rank}" if trainer.world_size == 2 else "another rank"
            exception.featlearn_message = self.lost_line(trainer, other)
            return
        if not isinstance(exception, KeyboardInterrupt) or self._interrupt_saved:
            return  # a divergence keeps the checkpoint before it; a deferred interrupt has saved already
        if not self._in_step and trainer.world_size == 1:
            self._save_interrupted(trainer)  # between steps (validation, data loading): a finished state
        elif trainer.is_global_zero:  # a half-done step is no state to resume from: last.ckpt stays as it was
            held = (f"{self.last_model_path} holds step {self._last_global_step_saved}" if self.last_model_path
                    else "no checkpoint was saved")
            print(f"featlearn: interrupted during step {trainer.global_step + 1}: {held}", file=sys.stderr,
                  flush=True)

    def _save_interrupted(self, trainer) -> None:
        self._interrupt_saved = True
        if self.save_last and not _suspect(trainer) and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        if self.last_model_path:
            where = (f"{self.last_model_path} holds step {self._last_global_step_saved} (resume with --ckpt_path "
                     f"{self.last_model_path})")
        else:
            where = "no checkpoint was saved (checkpoint.save_last is false)"
        print(f"featlearn: interrupted after step {trainer.global_step}: {where}", file=sys.stderr, flush=True)

    def _periodic(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
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
        self._restore_handler()
        # a run that ends without diverging ends in a state worth keeping, even while it looked suspect
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        check_guards(trainer)  # every path to a file (epoch end, validation end, train end) goes through here
        super()._save_checkpoint(trainer, filepath)


def _suspect(trainer) -> bool:
    return any(getattr(cb, "suspect", False) for cb in trainer.callbacks if isinstance(cb, DivergenceGuard))


_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed",
         "Connection refused")


def lost_peer(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that failed because another process went away (gloo's words)."""
    seen = exception
    while seen is not None:
        if isinstance(seen, RuntimeError) and any(words in str(seen) for words in _LOST):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


_RUNNING = None  # (checkpoint callback, trainer) of this process's run, as weak references: the observer's line


class _LostRankObserver(subprocess_script._ChildProcessObserver):
    """Lightning's watcher of the ranks it launched (a thread of rank 0's process) kills every process, rank 0
    included, when one dies; when it wins the race against gloo's error in rank 0 (a poll every 5 s), the run
    would end without a word. It says the lost-rank line first (:meth:`FinalCheckpoint.lost_line`)."""

    def _terminate_all(self) -> None:
        callback, trainer = (ref() for ref in _RUNNING) if _RUNNING else (None, None)
        dead = [i + 1 for i, p in enumerate(self._child_processes) if p.returncode]
        if callback is not None and trainer is not None and dead:
            print(f"error: {callback.lost_line(trainer, f'rank {dead[0]}')}", file=sys.stderr, flush=True)
        super()._terminate_all()


subprocess_script._ChildProcessObserver = _LostRankObserver  # read by name when the launcher starts the watcher

