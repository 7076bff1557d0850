"""What every fused op shares: the backend choice (``auto`` takes Triton for CUDA tensors, PyTorch
otherwise), the input dtype policy, the GEMM input precision, output allocation, and the Triton launch
helpers (autotune configs, grouped launch order, grids, accumulator dtype, row-major inputs).
``docs/adding_an_op.md`` shows how an op uses them.

Dtype policy: every op takes float32 or float64 tensors, all of one dtype, and computes in that dtype
(float32 accumulation at least for float32, float64 end to end for float64). Anything else is refused by
:func:`check_float_inputs` before any work, with a :class:`KernelInputError` naming the op, the argument,
the dtype given and the allowed dtypes. Half precision is refused rather than upcast because the
feature-learning signals these ops carry are ~1e-2 relative and would drown in fp16/bf16 rounding.
"""
import contextlib
import functools
import math
import os
from typing import Literal, get_args

import torch
import triton
import triton.language as tl

from featlearn.errors import ConfigError

# the ``backend=`` and ``input_precision=`` choices of every op and every module that runs one (LightningCLI
# reads the Literal, so ``--model.init_args.backend torch`` is checked when the config is parsed)
Backend = Literal["auto", "torch", "triton"]
Precision = Literal["auto", "tf32", "ieee"]
BACKENDS: tuple[str, ...] = get_args(Backend)
PRECISIONS: tuple[str, ...] = get_args(Precision)
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


def profiled(op):
    """Give every call of the public function ``op`` a ``featlearn.kernels.<name>`` range in profiler
    traces (``featlearn profile``); its backward shows as the autograd Function's node."""
    name = f"featlearn.kernels.{op.__name__}"

    @functools.wraps(op)
    def call(*args, **kwargs):
        with torch.profiler.record_function(name):
            return op(*args, **kwargs)
    return call


def refuse_shape(op: str, field: str, t: torch.Tensor, requirement: str):
    """Raise the :class:`KernelInputError` of a tensor argument of the wrong shape (every op's shape refusal).

    Example:
        >>> refuse_shape("op", "x", torch.zeros(2, 3, 4), "must be a 2-D tensor [B, d]")
        Traceback (most recent call last):
        featlearn.kernels.backend.KernelInputError: op: x has shape [2, 3, 4]; must be a 2-D tensor [B, d]
    """
    raise KernelInputError(op, field, f"has shape {list(t.shape)}", requirement, tuple(t.shape))


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


def new_output(shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Uninitialised buffer on ``like``'s device for a kernel to overwrite completely.

    Every op allocates its outputs here (called as ``backend.new_output``) so that tests can replace it
    with a NaN-filled buffer and catch cells a kernel never writes.
    """
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def contiguous(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The tensors in row-major layout (``None`` passes through): the kernels index with row-major offsets."""
    return tuple(t if t is None else t.contiguous() for t in tensors)


def acc_dtype(t: torch.Tensor):
    """Triton accumulator dtype for inputs like ``t``: float64 stays float64 (a float32 accumulator would
    cap float64 runs at ~1e-7 relative), float32 accumulates in float32."""
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def resolve_precision(input_precision: str, dtype: torch.dtype) -> str:
    """The ``input_precision`` of the Triton ``tl.dot`` calls for inputs of ``dtype``: ``"tf32"`` or ``"ieee"``.

    ``"auto"`` is TF32 (tensor cores; operands rounded to 10 mantissa bits, ~5e-4 relative each) for
    float32 and IEEE for float64; float64 is IEEE whatever is asked, since there is no float64 TF32. GEMMs an op's
    Triton path hands to cuBLAS follow it too (:func:`cublas_precision`); the PyTorch fallback ignores it
    (its GEMMs follow ``torch.backends.cuda.matmul.allow_tf32``).

    Example:
        >>> resolve_precision("auto", torch.float32), resolve_precision("tf32", torch.float64)
        ('tf32', 'ieee')
    """
    if input_precision not in PRECISIONS:
        raise ConfigError("input_precision", f"one of {PRECISIONS}", input_precision)
    if dtype == torch.float64:
        return "ieee"
    return "tf32" if input_precision == "auto" else input_precision


@contextlib.contextmanager
def cublas_precision(precision: str):
    """PyTorch CUDA matmuls inside the block use TF32 iff ``precision == "tf32"`` (the flag is restored
    after): an op that hands GEMMs to cuBLAS keeps them at its ``input_precision``. No effect on CPU.

    Example:
        >>> with cublas_precision("ieee"):
        ...     torch.backends.cuda.matmul.allow_tf32
        False
    """
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


# GEMM-like kernels: (output tile rows, cols, reduction tile, GROUP_M, num_warps, num_stages). GROUP_M
# row tiles sweep the column tiles together (grouped_tile), so each column tile of the second operand is
# read from HBM once per group and reused from L2 by the group's other programs.
# MMA_TILES serve TF32 dots (tensor cores, accumulators spread over the warps' MMA fragments); the
# 16-column tiles are for very narrow outputs (the non-contrastive encoder has R = 2 kernels): a 64-wide tile
# would spend 32x the needed MMA work there, and 64-row blocks give enough programs to fill the SMs.
MMA_TILES = ((128, 128, 32, 8, 8, 3), (128, 128, 64, 8, 8, 3), (128, 64, 32, 8, 4, 4), (64, 128, 32, 8, 4, 4),
             (64, 64, 32, 8, 4, 4), (128, 128, 32, 1, 8, 3), (64, 16, 64, 8, 4, 3), (128, 16, 64, 8, 4, 3))
# IEEE float32 and float64 dots run on the FMA units: each thread keeps its operand slices of the
# reduction tile in registers, so these tiles are smaller with short reductions (16). Every MMA tile
# spills there (sm_90 builds of `featlearn gpu compile --all-configs`: 24-9600 bytes of stack a thread).
FMA_TILES = ((64, 64, 16, 8, 8, 3), (64, 32, 16, 8, 4, 3), (32, 64, 16, 8, 4, 3), (64, 16, 16, 8, 4, 3),
             (32, 32, 16, 8, 4, 3))
# eight warps on a 32 x 32 tile: the patch-sum forward in float64 (three accumulators) builds without a
# stack frame under triton 3.6 and 3.9 only so (triton 3.6 refuses reduction tiles under 16); GROUP_M 4
# tells it apart from the four-warp 32 x 32 tile above
FMA_8_WARP_TILES = ((32, 32, 16, 4, 8, 2),)
GEMM_TILES = MMA_TILES + FMA_TILES + FMA_8_WARP_TILES


def tiles_by_precision(tf32, ieee, fp64, tf32_unaligned=None, sizes=()):
    """The ``fits`` rule (see :func:`autotune`) of a kernel: the tiles, as block-size tuples (rows of its tile
    list without warps and stages), a call may use with TF32 dots, IEEE float32 dots (or no dots) and
    float64; ``tf32_unaligned``: with TF32 dots when one of the ``sizes`` arguments is not a multiple of 16
    (unaligned rows load element by element and hold more registers). Each list is what the sm_90
    compile report found spill-free for that kernel at the sizes of
    :mod:`featlearn.gpu.cases`.

    Example:
        >>> fits = tiles_by_precision(tf32=[(64, 64, 32, 8)], ieee=[(32, 32, 16, 8)], fp64=[(32, 32, 16, 8)])
        >>> fits({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, {"ACC": tl.float32, "PRECISION": "tf32"})
        True
        >>> fits({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, {"ACC": tl.float64, "PRECISION": "ieee"})
        False
    """
    allowed = {"tf32": set(tf32), "ieee": set(ieee), "fp64": set(fp64),
               "tf32_unaligned": set(tf32 if tf32_unaligned is None else tf32_unaligned)}

    def fits(config: dict, args: dict) -> bool:
        kind = "fp64" if args["ACC"] == tl.float64 else args.get("PRECISION", "ieee")  # no dots: ieee
        if kind == "tf32" and any(args[name] % 16 for name in sizes):
            kind = "tf32_unaligned"
        return tuple(config.values()) in allowed[kind]
    return fits


def blocks(tiles) -> list[tuple]:
    """Block sizes of tile rows (warps and stages dropped), for :func:`tiles_by_precision`."""
    return [t[:-2] for t in tiles]


# the interpreter's tiles: 16-wide blocks so that the tests' odd sizes span several tiles and a partial
# last group of 2 row tiles
INTERPRETER_GEMM_TILE = (16, 16, 16, 2)


@triton.jit
def grouped_tile(pid, n_rows, n_cols, GROUP: tl.constexpr):
    """(row tile, column tile) of program ``pid`` of a 1-D grid of ``n_rows * n_cols`` programs.

    Programs run roughly in ``pid`` order; ``GROUP`` consecutive row tiles sweep the column tiles
    together (the last group may be shorter), a bijection onto the tile grid.
    """
    per_group = GROUP * n_cols
    first = (pid // per_group) * GROUP
    size = tl.minimum(n_rows - first, GROUP)
    return first + (pid % per_group) % size, (pid % per_group) // size


def autotune_configs(names: tuple[str, ...], gpu_tiles, interpreter_tiles: tuple[int, ...], gpu: bool = False) -> list:
    """The config list for ``triton.autotune``.

    On a GPU one ``triton.Config`` per row of ``gpu_tiles`` (block sizes for ``names``, then ``num_warps``
    and ``num_stages``); under ``TRITON_INTERPRET=1`` only ``interpreter_tiles``: autotune does not
    benchmark a single config (the interpreter would run every candidate in Python), and the
    interpreter tests see fixed small tiles that exercise the masks on odd shapes. ``gpu=True``: the GPU
    configs in any case (what the offline compile check builds).

    Example:
        >>> configs = autotune_configs(("BLOCK_N",), [(64, 4, 3), (128, 8, 3)], (8,))
        >>> len(configs) == (1 if interpreting() else 2)
        True
    """
    if interpreting() and not gpu:
        return [triton.Config(dict(zip(names, interpreter_tiles)))]
    return [triton.Config(dict(zip(names, t[:-2])), num_warps=t[-2], num_stages=t[-1]) for t in gpu_tiles]


TILE_MODES = ("search", "pinned")


def tile_mode() -> str:
    """``FEATLEARN_TILES``: ``search`` (default: the autotuner times every config that fits the call) or
    ``pinned`` (the first config that fits, no timing: a GPU session too short for the full search)."""
    mode = os.environ.get("FEATLEARN_TILES", "search")
    if mode not in TILE_MODES:
        raise ConfigError("FEATLEARN_TILES", f"one of {TILE_MODES}", mode)
    return mode


def autotune(names: tuple[str, ...], gpu_tiles, interpreter_tiles: tuple[int, ...], key: list[str], fits=None,
             reset_to_zero: list[str] | None = None):
    """``triton.autotune`` over :func:`autotune_configs`, keyed on ``key`` (name the shapes that change
    the best tile, not the batch size: train, validation and test batches then share one search).

    ``fits(config_kwargs, args) -> bool`` drops the configs that cannot serve a call (``args``: the
    launch's arguments by name, constexprs included), e.g. tiles that spill registers in float64; the
    first row of ``gpu_tiles`` that fits must serve every call. ``reset_to_zero``: outputs a kernel adds into
    (atomics), zeroed before each timed config and before the chosen one runs. Under ``FEATLEARN_TILES=pinned`` only that
    first fitting config runs. The returned autotuner keeps ``gpu_configs`` and ``fits`` for the offline
    compile check (``featlearn gpu compile``), which compiles exactly the configs a call may pick.

    Example:
        >>> @autotune(("BLOCK",), [(64, 4, 3), (128, 8, 3)], (16,), key=["N"])
        ... @triton.jit
        ... def _copy(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
        ...     offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ...     tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)
        >>> [c.kwargs["BLOCK"] for c in _copy.gpu_configs]
        [64, 128]
    """
    gpu_configs = autotune_configs(names, gpu_tiles, interpreter_tiles, gpu=True)

    def prune(configs, nargs, **kwargs):
        args = {**nargs, **kwargs}
        kept = [c for c in configs if fits is None or fits(c.kwargs, args)]
        if not kept:
            raise ValueError(f"no autotune config of {names} fits this call; the tile list needs a smaller tile")
        return kept[:1] if tile_mode() == "pinned" else kept

    def decorate(fn):
        tuned = triton.autotune(configs=autotune_configs(names, gpu_tiles, interpreter_tiles), key=key,
                                prune_configs_by={"early_config_prune": prune}, reset_to_zero=reset_to_zero)(fn)
        tuned.gpu_configs, tuned.fits, tuned.prune_for_call = gpu_configs, fits, prune
        return tuned
    return decorate


def tile_grid(*dims: tuple[int, str] | int):
    """Launch grid of an autotuned kernel: ``(n, "BLOCK_X")`` is ``cdiv(n, BLOCK_X)`` of the config
    being run, a plain int is taken as is.

    Example:
        >>> tile_grid((100, "BLOCK_N"), 1)({"BLOCK_N": 32})
        (4, 1)
    """
    def grid(meta):
        return tuple(d if isinstance(d, int) else triton.cdiv(d[0], meta[d[1]]) for d in dims)
    return grid


def grouped_grid(rows: tuple[int, str], cols: tuple[int, str] | int):
    """Launch grid of a kernel that maps its program id with :func:`grouped_tile`: one program per tile
    of the ``rows`` x ``cols`` output (``(n, "BLOCK_X")`` as in :func:`tile_grid`, ``cols`` may be 1).

    Example:
        >>> grouped_grid((100, "BLOCK_M"), (40, "BLOCK_N"))({"BLOCK_M": 32, "BLOCK_N": 16})
        (12,)
    """
    tiles = tile_grid(rows, cols)
    return lambda meta: (math.prod(tiles(meta)),)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (tests on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreter_scalar_index_fix() -> None:
    """Triton <= 3.6's interpreter indexes a runtime scalar (``D`` in ``range(0, D, BLOCK_K)``) with
    ``int(a)`` of its one-element 1-d numpy array, which numpy >= 2.4 refuses ("only 0-dimensional arrays
    can be converted to Python scalars"); every kernel loop with a runtime bound fails. Triton 3.7+ reads
    ``int(a.squeeze())`` (triton-lang/triton#9172): do the same where the old line is still there."""
    import inspect

    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or "int(self.handle.data))" not in inspect.getsource(patch_tensor):
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


if interpreting():
    _interpreter_scalar_index_fix()


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError("backend", f"one of {BACKENDS}", backend)
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
    if backend == "auto":  # under torch.compile (a module's compiled loss) the PyTorch form, which it can trace
        return "triton" if on_cuda and not torch.compiler.is_compiling() else "torch"
    if backend == "triton" and not on_cuda and not interpreting():
        raise ConfigError("backend", "'torch' or 'auto' for CPU tensors unless TRITON_INTERPRET=1", backend)
    return backend
