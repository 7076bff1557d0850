"""What the seeds of a :class:`~featlearn.lightning_modules.seeds.SeedStack` log, written to one TensorBoard run per
seed (``<log_dir>/seed_<s>``) as Lightning would write it for that seed alone.

A member's ``self.log(name, value, ...)`` lands in :meth:`SeedLogs.log` with Lightning's arguments and keeps
their meaning: ``on_step`` values are written on the steps Lightning writes (``log_every_n_steps``);
``on_epoch`` values (the default in validation and test) are averaged over the epoch's batches, weighted by
``batch_size``, and a torchmetrics ``Metric`` is computed once at the epoch's end, then reset; ``sync_dist``
averages over processes; ``logger=False`` keeps the value (for :meth:`FeatureLearningModule.logged`) without
writing it; nothing is written during Lightning's sanity check. Results (``hp/*``) and the hyperparameters go
to the seed's HPARAMS session.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torchmetrics import Metric

from featlearn.metrics.figures import close_seed_writers, seed_writer, write_hparams


class SeedLogs:
    """The per-seed logs of one stack (module docstring)."""

    def __init__(self, stack, size: int):
        self._stack = weakref.ref(stack)
        self.last: list[dict[str, float]] = [{} for _ in range(size)]   # each seed's latest value of each name
        self._epoch: list[dict[str, list]] = [{} for _ in range(size)]  # name -> [sum or Metric, weight, logger]

    def writer(self, row: int):
        stack = self._stack()
        return seed_writer(stack._trainer, stack.seeds[row])

    def log(self, row: int, name: str, value, on_step: bool | None = None, on_epoch: bool | None = None,
            logger: bool | None = None, sync_dist: bool = False, batch_size: int | None = None, **_) -> None:
        trainer = self._stack()._trainer
        if trainer is not None and trainer.sanity_checking:
            return
        training = trainer is None or trainer.training
        on_step = training if on_step is None else on_step
        on_epoch = (not training) if on_epoch is None else on_epoch
        if isinstance(value, Metric):
            self._epoch[row][name] = [value, None, logger]
            return
        value = torch.as_tensor(value).detach().to(torch.float64).reshape(())
        if sync_dist and trainer is not None and trainer.world_size > 1:
            value = trainer.strategy.reduce(value.to(trainer.strategy.root_device), reduce_op="mean")
        number = float(value)
        if on_step:
            self.last[row][name] = number
            written = trainer is not None and (not training or
                                               (trainer.global_step + 1) % max(1, trainer.log_every_n_steps) == 0)
            if written and logger is not False:
                self._write(row, name, number)
        if on_epoch:
            kept = self._epoch[row].setdefault(name, [0.0, 0.0, logger])
            weight = float(batch_size or 1)
            kept[0] += number * weight
            kept[1] += weight

    def end_epoch(self) -> None:
        """Write the epoch's values (means over its batches, computed metrics); on every process (metrics sync)."""
        for row, kept in enumerate(self._epoch):
            for name, (total, weight, logger) in kept.items():
                if isinstance(total, Metric):
                    number = float(total.compute())
                    total.reset()
                else:
                    number = total / weight
                self.last[row][name] = number
                if logger is not False:
                    self._write(row, name, number)
            kept.clear()

    def _write(self, row: int, name: str, number: float) -> None:
        writer = self.writer(row)
        if writer is not None:
            writer.add_scalar(name, number, self._stack().global_step)

    def results(self, row: int, params: dict, results: dict) -> None:
        """A seed's results (``hp/*``) and hyperparameters, with its seed, in its HPARAMS session."""
        stack, writer = self._stack(), self.writer(row)
        if writer is not None:
            for name, value in results.items():
                writer.add_scalar(name, value, stack.global_step)
            write_hparams(writer, {**params, "seed": stack.seeds[row]}, results, stack.global_step)

    @contextlib.contextmanager
    def fresh(self):
        """Within, :attr:`last` holds only what is logged meanwhile (the yielded per-seed dicts: a test's
        values, as ``trainer.test`` returns them for one run); afterwards the earlier values are back, alone (a
        caller hands each seed its loop's values when that seed asks for them)."""
        kept, self.last = self.last, [{} for _ in self.last]
        try:
            yield self.last
        finally:
            self.last = kept

    def close(self) -> None:
        trainer = self._stack()._trainer
        if trainer is not None:
            close_seed_writers(trainer)
