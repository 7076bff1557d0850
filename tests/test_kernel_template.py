"""Every op module of featlearn.kernels follows the one op template of docs/adding_an_op.md."""
import importlib
import inspect
import pkgutil
import re

import pytest
import torch
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import KernelInterface

import featlearn.kernels

# op module -> (public function, autograd.Function, Triton name prefix or None for a PyTorch-only op)
OPS = {
    "patch_activation_sum": ("patch_activation_sum", "PatchActivationSumFunction", "_patch_sum"),
    "soft_threshold": ("soft_threshold_layer", "SoftThresholdFunction", "_soft_threshold"),
    "bn_cosine_loss": ("bn_cosine_loss", "BNCosineLossFunction", "_bn_cosine"),
    "infonce": ("infonce_stopgrad", "InfoNCEStopGradFunction", None),
}
SHARED = {"backend", "activations"}  # helper modules, not ops


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
    assert found == set(OPS), "add the new op module to OPS in this test"


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
