"""What every fused op shares: the backend choice (``auto`` takes Triton for CUDA tensors, PyTorch
otherwise) and the input dtype policy.

Dtype policy: every op takes float32 or float64 tensors, all of one dtype, and computes in that dtype
(float32 accumulation at least for float32, float64 end to end for float64). Anything else is refused by
:func:`check_float_inputs` before any work, with a :class:`KernelInputError` naming the op, the argument,
the dtype given and the allowed dtypes. Half precision is refused rather than upcast because the
feature-learning signals these ops carry are ~1e-2 relative and would drown in fp16/bf16 rounding.
"""
import importlib.util
import os

import torch

from featlearn.errors import ConfigError

BACKENDS = ("auto", "torch", "triton")
FLOAT_DTYPES = (torch.float32, torch.float64)
_SUPPORTED = "supported: " + ", ".join(str(d) for d in FLOAT_DTYPES) + " (all inputs the same dtype)"


class KernelInputError(ConfigError):
    """A tensor argument an op refuses up front: ``"{op}: {field} {problem}; {requirement}"``.

    ``field`` is the argument's name and ``allowed`` the requirement, so code that handles
    ``ConfigError`` by field keeps working.

    Example:
        >>> raise KernelInputError("op", "x", "has 0 rows", "needs N >= 1", 0)
        Traceback (most recent call last):
        featlearn.kernels.backend.KernelInputError: op: x has 0 rows; needs N >= 1
    """

    def __init__(self, op: str, field: str, problem: str, requirement: str, got: object):
        super().__init__(field, requirement, got)
        self.op, self.problem = op, problem
        self.args = (f"{op}: {field} {problem}; {requirement}",)

    def __reduce__(self):  # the message is derived, so rebuild from the parts (spawned workers pickle errors)
        return type(self), (self.op, self.field, self.problem, self.allowed, self.got)


def check_float_inputs(op: str, **tensors: torch.Tensor | None) -> torch.dtype:
    """Enforce the dtype policy on an op's tensor arguments (``None`` = argument not given); return the dtype.

    The first tensor given sets the dtype the others must share.

    Example:
        >>> check_float_inputs("op", x=torch.zeros(2), bias=None)
        torch.float32
        >>> try:
        ...     check_float_inputs("op", x=torch.zeros(2), w=torch.zeros(2, dtype=torch.float64))
        ... except KernelInputError as e:
        ...     print(e.field, e.got)
        w torch.float64
    """
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(op, name, f"is a {type(t).__name__}", "must be a torch.Tensor",
                                   type(t).__name__)
        if t.dtype not in FLOAT_DTYPES:
            raise KernelInputError(op, name, f"has dtype {t.dtype}", _SUPPORTED, t.dtype)
        if first is None:
            first = (name, t.dtype)
        elif t.dtype != first[1]:
            raise KernelInputError(op, name, f"has dtype {t.dtype} but {first[0]} has {first[1]}", _SUPPORTED,
                                   t.dtype)
    if first is None:
        raise ValueError(f"check_float_inputs({op!r}): no tensor given")
    return first[1]


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
