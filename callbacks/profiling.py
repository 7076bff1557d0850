"""Profile training steps with ``torch.profiler`` into a trace that TensorBoard's profiler view opens.

Each step is split into ranges named ``featlearn.<phase>``: ``data`` (sample generation, from the
DataModule), ``forward+loss`` (``training_step``), ``backward``, ``update`` (the optimizer, with
``metrics`` inside it: ``finish_step``'s constraints, theory metrics and logging); every fused op adds ``featlearn.kernels.<op>``
inside them. The first ``skip`` steps (compilation, autotuning, first allocations) are run under the
profiler but not recorded.

Example:
    >>> profiler = StepProfiler(steps=5, skip=2, out="lightning_logs/profile")
    >>> profiler.total_steps
    7
"""
from pathlib import Path

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler


class StepProfiler(L.Callback):
    """Record ``steps`` training steps after ``skip`` warm-up steps into ``out`` (``*.pt.trace.json``).

    Args:
        steps: training steps recorded.
        skip: steps run first and not recorded (they absorb one-off costs).
        out: folder of the trace (``tensorboard --logdir`` on it or a parent; also opens in Perfetto).
        record_shapes, profile_memory, with_stack: passed to :func:`torch.profiler.profile`.
    """

    def __init__(self, steps: int = 10, skip: int = 3, out: str | Path = "lightning_logs/profile",
                 record_shapes: bool = True, profile_memory: bool = True, with_stack: bool = False):
        self.steps, self.skip, self.out = steps, skip, Path(out)
        self.options = dict(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack)
        self.profiler = None
        self.finished = None  # the profiler once training has ended, for summary()
        self.phase = None

    @property
    def total_steps(self) -> int:
        return self.skip + self.steps

    def on_train_start(self, trainer, pl_module) -> None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.out.mkdir(parents=True, exist_ok=True)
        self.profiler = profile(activities=activities,
                                schedule=schedule(wait=0, warmup=self.skip, active=self.steps, repeat=1),
                                on_trace_ready=tensorboard_trace_handler(str(self.out), worker_name=f"rank{trainer.global_rank}"),
                                **self.options)
        self.profiler.__enter__()

    def _enter(self, name: str | None) -> None:
        if self.phase is not None:
            self.phase.__exit__(None, None, None)
        self.phase = None if name is None else record_function(f"featlearn.{name}")
        if self.phase is not None:
            self.phase.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._enter("forward+loss")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._enter("backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._enter("update")  # finish_step's range (featlearn.metrics) opens inside it

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._enter(None)
        if self.profiler is not None:
            self.profiler.step()

    def on_train_end(self, trainer, pl_module) -> None:
        self._enter(None)
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.finished, self.profiler = self.profiler, None

    def summary(self, rows: int = 15) -> str:
        """The recorded steps' ops and ranges by total CPU time (after training)."""
        if self.finished is None:
            return ""
        return self.finished.key_averages().table(sort_by="cpu_time_total", row_limit=rows)
