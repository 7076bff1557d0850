"""Every op module of featlearn.kernels follows the one op template of docs/adding_an_op.md."""
import importlib
import inspect
import pkgutil
import re

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import KernelInterface

import featlearn.kernels
from featlearn.kernels.backend import grouped_grid, grouped_tile
from featlearn.kernels.registry import OPS as REGISTRY

# op module -> (public function, autograd.Function, Triton name prefix or None for a PyTorch-only op), from
# the one registry of ops
OPS = {op.module: (op.function, op.autograd, op.triton) for op in REGISTRY}
SHARED = {"backend", "activations", "registry"}  # helper modules, not ops
BATCH_ARGS = {op.triton: set(op.batch_args) for op in REGISTRY if op.triton}


def _module(name):
    # the package re-exports functions under their modules' names, so import the module itself
    return importlib.import_module(f"featlearn.kernels.{name}")


def _own(mod, kind):
    """(name, object) pairs defined in ``mod`` (not imported) that are instances / subclasses of ``kind``."""
    out = []
    for name, obj in vars(mod).items():
        if isinstance(kind, type) and issubclass(kind, KernelInterface):
            if isinstance(obj, kind) and _python_fn(obj).__module__ == mod.__name__:
                out.append((name, obj))
        elif inspect.isclass(obj) and issubclass(obj, kind) and obj.__module__ == mod.__name__:
            out.append((name, obj))
    return out


def _python_fn(kernel):
    return kernel.base_fn if isinstance(kernel, Autotuner) else kernel.fn


def _line(obj):
    return inspect.getsourcelines(_python_fn(obj) if isinstance(obj, KernelInterface) else obj)[1]


def test_every_op_module_is_checked():
    found = {m.name for m in pkgutil.iter_modules(featlearn.kernels.__path__)} - SHARED
    assert found == set(OPS), "add the new op module to featlearn/kernels/registry.py"


@pytest.mark.parametrize("name", OPS)
def test_exactly_one_autograd_function_named_like_the_op(name):
    functions = _own(_module(name), torch.autograd.Function)
    assert [n for n, _ in functions] == [OPS[name][1]]
    assert functions[0][0].endswith("Function")


@pytest.mark.parametrize("name", OPS)
def test_public_function_backend_and_reference(name):
    mod = _module(name)
    public, _, prefix = OPS[name]
    params = inspect.signature(getattr(mod, public)).parameters
    if prefix is None:
        assert "backend" not in params  # no Triton path: nothing to choose
    else:
        assert params["backend"].default == "auto"
    assert callable(getattr(mod, f"{name}_reference", None)), f"{name}_reference missing"


@pytest.mark.parametrize("name", [n for n, (_, _, prefix) in OPS.items() if prefix])
def test_triton_kernels_named_autotuned_and_safe_to_benchmark(name):
    mod = _module(name)
    prefix = OPS[name][2]
    jitted = _own(mod, KernelInterface)
    kernels = [(n, k) for n, k in jitted if n.endswith("_kernel")]
    assert kernels, "an op with a Triton path has kernels"
    pattern = re.compile(rf"^{prefix}_(fwd(_[a-z0-9]+)?|bwd_[a-z0-9]+)_kernel$")
    for kname, kernel in jitted:
        assert kname.startswith(prefix + "_"), kname
        if not kname.endswith("_kernel"):
            assert not isinstance(kernel, Autotuner), f"{kname}: a launched kernel's name ends in _kernel"
            continue
        assert pattern.match(kname), kname
        assert isinstance(kernel, Autotuner), f"{kname} is not autotuned"
        assert len(kernel.configs) == 1, f"{kname}: the interpreter must get one config (no benchmarking)"
        assert kernel.keys, f"{kname}: autotune needs a key of size arguments"
        # backend.autotune: the GPU configs stay reachable for the offline compile check, and a batch-size
        # argument in the key would start a new search for every batch size (train, validation, test)
        assert hasattr(kernel, "gpu_configs"), f"{kname}: decorate with featlearn.kernels.backend.autotune"
        assert not BATCH_ARGS[prefix] & set(kernel.keys), f"{kname}: a batch size in the autotune key {kernel.keys}"
        # autotune re-runs a kernel while benchmarking: one that accumulates into its output must reset it
        if "atomic_" in inspect.getsource(_python_fn(kernel)):
            assert kernel.reset_to_zero, f"{kname} accumulates with atomics but declares no reset_to_zero"


@pytest.mark.parametrize("name", OPS)
def test_sections_in_template_order(name):
    mod = _module(name)
    public, function, prefix = OPS[name]
    order = [_line(getattr(mod, function)), _line(getattr(mod, public)), _line(getattr(mod, f"{name}_reference"))]
    if prefix is not None:
        order.insert(0, max(_line(k) for _, k in _own(mod, KernelInterface)))
    assert order == sorted(order), "kernels, then the autograd.Function, then the public function, then the reference"
    doc = mod.__doc__ or ""
    assert "Example:" in doc and ">>>" in doc, "the module docstring ends with a usage example"


@pytest.mark.parametrize("name", OPS)
def test_shared_helpers_only(name):
    """Tile choice, layout and the interpreter switch come from featlearn.kernels.backend."""
    src = inspect.getsource(_module(name))
    for ad_hoc in (".contiguous()", "interpreting()", "def _block", "num_warps="):
        assert ad_hoc not in src, f"{name}: {ad_hoc!r} belongs in featlearn.kernels.backend"


@pytest.mark.parametrize("name", [n for n, (_, _, prefix) in OPS.items() if prefix])
def test_gemms_take_input_precision_and_grouped_order(name):
    """Every ``tl.dot`` takes the op's ``input_precision`` (no hard-coded precision) and accumulates in the
    accumulator dtype (Triton 3.6 refuses a float64 accumulator with the default float32 ``out_dtype``);
    every kernel tuned over a GROUP_M maps its program id through ``backend.grouped_tile``."""
    mod = _module(name)
    src = inspect.getsource(mod)
    dots = src.count("tl.dot(")
    assert src.count("input_precision=PRECISION, out_dtype=ACC)") == dots
    if dots:
        params = inspect.signature(getattr(mod, OPS[name][0])).parameters
        assert params["input_precision"].default == "auto"
    for kname, kernel in _own(mod, Autotuner):
        grouped = "GROUP_M" in kernel.configs[0].kwargs
        assert grouped == ("grouped_tile(" in inspect.getsource(_python_fn(kernel))), kname


@triton.jit
def _tile_map_kernel(out_ptr, n_rows, n_cols, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    row, col = grouped_tile(pid, n_rows, n_cols, GROUP)
    tl.store(out_ptr + 2 * pid, row)
    tl.store(out_ptr + 2 * pid + 1, col)


@pytest.mark.parametrize("n_rows,n_cols,group", [(1, 1, 1), (5, 3, 2), (7, 4, 8), (9, 1, 4), (6, 5, 3), (3, 7, 1)])
def test_grouped_tile_is_a_bijection_in_group_order(n_rows, n_cols, group):
    out = torch.full((n_rows * n_cols, 2), -1, dtype=torch.int32)
    _tile_map_kernel[grouped_grid((n_rows, "B"), (n_cols, "B"))({"B": 1})](out, n_rows, n_cols, GROUP=group)
    tiles = [tuple(t) for t in out.tolist()]
    assert sorted(tiles) == [(r, c) for r in range(n_rows) for c in range(n_cols)]  # every tile once
    # programs in order visit whole groups of `group` row tiles, each group sweeping all columns
    assert [r // group for r, _ in tiles] == sorted(r // group for r, _ in tiles)
    first = tiles[: min(group, n_rows)]
    assert first == [(r, 0) for r in range(min(group, n_rows))]
