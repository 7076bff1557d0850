"""Backend choice shared by every fused op: ``auto`` takes Triton for CUDA tensors, PyTorch otherwise."""
import importlib.util
import os

import torch

from featlearn.errors import ConfigError

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (tests on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_backend(backend: str, field: str = "backend") -> str:
    if backend not in BACKENDS:
        raise ConfigError(field, f"one of {BACKENDS}", backend)
    return backend


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Return ``"torch"`` or ``"triton"`` for these tensors.

    ``triton`` on CPU tensors is allowed only under ``TRITON_INTERPRET=1``.

    Example:
        >>> resolve_backend("auto", torch.zeros(2))
        'torch'
    """
    check_backend(backend)
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ConfigError("backend", "'torch' or 'auto' (triton is not installed)", backend)
        if not on_cuda and not interpreting():
            raise ConfigError("backend", "'torch' or 'auto' for CPU tensors unless TRITON_INTERPRET=1", backend)
    return backend
