"""Find the host syncs of a training step on the CPU: the calls that, on a GPU, would make the host wait for the
device (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, a boolean-mask index, ``nonzero``). On the CPU
they cost nothing, so only their presence can be checked here; this is what keeps the steps free of them
(docs/gpu.md: no host sync per training step) until a GPU can show it with ``torch.cuda.set_sync_debug_mode``.
A copy to the CPU (``.cpu()``, ``.to("cpu")``) cannot be told from a no-op on a CPU run and is not looked for.

:func:`record_syncs` patches :class:`~featlearn.lightning_modules.base.FeatureLearningModule`'s batch hooks, so
that the work between a step's ``on_train_batch_start`` and ``on_train_batch_end`` (training step, backward,
optimizer step, ``finish_step``, the divergence guard's per-step push) runs under the two modes below on the
steps that log nothing (``theory_due()`` false: Lightning reads its logged values on the others anyway) after
the first (a run's first step may read once what it then keeps, e.g. a resumed run's state). Each
sync is recorded as ``"<what> at <featlearn file>:<line>"`` of the innermost featlearn frame.
"""
from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
HOST_READS = {"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"}
"""Tensor methods that hand a value to Python: a device-to-host copy and a wait on CUDA."""
DEVICE_SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive",
                "unique_dim", "repeat_interleave", "equal", "is_nonzero"}
"""Aten ops whose output size or value the host needs (a boolean-mask index dispatches ``nonzero``)."""
_MACHINERY = ("torch/overrides.py", "torch/utils/_python_dispatch.py", "torch/_ops.py", "torch/_tensor.py",
              "torch/_compile.py", "torch/_dynamo/")
"""torch's own frames between a call and the modes (its Tensor methods' Python wrappers included)."""
MASK_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}
"""Indexing ops, which sync when an index is a boolean mask (the kernel turns it into positions)."""
CPU_ONLY_CHECKS = {"one_hot"}
"""Functions whose argument checks read the host on the CPU only (CUDA leaves them to device asserts)."""


def _site() -> str | None:
    """``file:line`` of the call when featlearn's own code made it; None when torch or Lightning did (their
    reads are of host tensors, e.g. Adam's step counts, or their own logging)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path == Path(__file__).resolve() or any(part in frame.filename for part in _MACHINERY):
            continue
        inside = ROOT in path.parents and ".venv" not in path.parts and path.parent.name != "tests"
        return f"{path.relative_to(ROOT).as_posix()}:{frame.lineno}" if inside else None
    return None


class _Functions(TorchFunctionMode):
    def __init__(self, hits: Counter):
        super().__init__()
        self.hits, self.quiet = hits, 0  # > 0 inside a call already counted or a CPU-only check

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        site = _site() if name in HOST_READS else None
        if site:
            self.hits[f"{name} at {site}"] += 1
        quiet = name in CPU_ONLY_CHECKS or name in HOST_READS
        self.quiet += quiet
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.quiet -= quiet


def _has_mask(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class _Dispatch(TorchDispatchMode):
    def __init__(self, hits: Counter, functions: _Functions):
        super().__init__()
        self.hits, self.functions = hits, functions

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        syncs = name in DEVICE_SYNCS or (name in MASK_INDEXING and _has_mask(args))
        site = _site() if syncs and not self.functions.quiet else None
        if site:
            self.hits[f"{name} at {site}"] += 1
        return func(*args, **(kwargs or {}))


def record_syncs(monkeypatch) -> dict:
    """Patch the module base's batch hooks; returns ``{id(module): {"steps": steps watched, "syncs": Counter of
    sync sites}}``, filled as runs go."""
    from featlearn.lightning_modules.base import FeatureLearningModule

    found: dict = {}

    def start(module, batch, batch_idx):
        if module._trainer is not None and module.global_step > 0 and not module.theory_due():
            record = found.setdefault(id(module), {"steps": 0, "syncs": Counter()})
            record["steps"] += 1
            hits = record["syncs"]
            functions = _Functions(hits)
            module._sync_modes = (functions, _Dispatch(hits, functions))
            for mode in module._sync_modes:
                mode.__enter__()

    def end(module, outputs, batch, batch_idx):
        for mode in reversed(module.__dict__.pop("_sync_modes", ())):
            mode.__exit__(None, None, None)

    monkeypatch.setattr(FeatureLearningModule, "on_train_batch_start", start, raising=False)
    monkeypatch.setattr(FeatureLearningModule, "on_train_batch_end", end, raising=False)
    return found
