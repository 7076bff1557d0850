"""patch_activation_sum: torch fallback and Triton (interpreter) against a float64 reference."""
import importlib
import itertools

import pytest
import torch

from featlearn.errors import ConfigError
from featlearn.kernels import (Activation, KernelInputError, PatchSums, patch_activation_sum,
                               patch_activation_sum_reference)

# the package re-exports the function under the module's name, so fetch the module itself
pas = importlib.import_module("featlearn.kernels.patch_activation_sum")

BACKENDS = ["torch", "triton"]
ACTS = [Activation("srelu", q=3, rho=0.5), Activation("srelu", q=2, rho=0.2), Activation("relu"),
        Activation("pow", q=3), Activation("pow", q=2)]
# (mask kind, teacher_scale, squares)
OPTIONS = [(None, None, False), ("bool", 1.5, True), ("float", None, True), (None, 0.7, False), ("float", 1.5, True)]
SHAPES = [(5, 7, 37, 19), (3, 4, 17, 11), (1, 1, 1, 1), (4, 3, 20, 17), (2, 5, 33, 1), (5, 1, 3, 18)]
# float32 results vs float64: fp32 rounding (~6e-8) grows with the d-term dot products and the
# q-th power (relative error x q) and with the P-sum; 3e-5 of the output scale leaves a wide margin
# over the ~3e-7 seen, while any indexing/masking bug gives O(1) errors. float64 sees ~3e-16; 1e-12
# would catch a single float32 step (~1e-7).
TOL = {torch.float32: 3e-5, torch.float64: 1e-12}
# TF32 products (10 mantissa bits, ~5e-4 per operand, times q through the activation): 1e-2 of the scale
TF32_TOL = 1e-2
# save_preactivation_bytes: never save A (the backward recomputes it) / the default (these sizes fit)
RECOMPUTE, SAVE = 0, pas.SAVE_PREACTIVATION_BYTES
DTYPES = [torch.float32, torch.float64]


def _ids(a):
    return f"{a.name}{a.q}"


def _inputs(seed, shape, dtype, mask_kind):
    B, P, d, R = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, P, d, generator=g, dtype=torch.float64)
    w = torch.randn(R, d, generator=g, dtype=torch.float64) / d**0.5  # A ~ N(0, 1): both srelu regimes
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, P, generator=g) < 0.6
    elif mask_kind == "float":
        mask = torch.rand(B, P, generator=g, dtype=torch.float64) * 2
    if mask is not None and mask.dtype.is_floating_point:
        mask = mask.to(dtype)
    return x.to(dtype), w.to(dtype), mask


def _check(out, ref, tol, what):
    scale = max(ref.abs().max().item(), 1e-30)
    err = (out.double() - ref).abs().max().item() / scale
    assert torch.isfinite(out).all(), what
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"
    return err


def _compare(backend, act, shape, dtype, mask_kind, ts, squares, seed, loss="both", chunk=None, save=SAVE,
             precision="ieee", tol=None):
    """Forward and gradients against the float64 reference; IEEE products unless ``precision`` says."""
    x, w, mask = _inputs(seed, shape, dtype, mask_kind)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = patch_activation_sum(x, w, act, mask=mask, teacher_scale=ts, squares=squares, backend=backend,
                               chunk_elements=chunk, save_preactivation_bytes=save, input_precision=precision)
    assert isinstance(out, PatchSums)
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    m64 = mask.double() if mask is not None and mask.dtype.is_floating_point else mask
    ref = patch_activation_sum_reference(x64, w64, act, mask=m64, teacher_scale=ts, squares=squares)
    B, R = shape[0], shape[3]
    tol = TOL[dtype] if tol is None else tol
    assert out.student.shape == (B, R) and out.student.dtype == dtype
    _check(out.student, ref.student, tol, "student")
    assert (out.teacher is None) == (ts is None) and (out.squares is None) == (not squares)
    if ts is not None:
        assert not out.teacher.requires_grad and out.teacher.dtype == dtype
        _check(out.teacher, ref.teacher, tol, "teacher")
    if squares:
        _check(out.squares, ref.squares, tol, "squares")
    g = torch.Generator().manual_seed(seed + 1)
    gs = torch.randn(B, R, generator=g, dtype=torch.float64)
    gq = torch.randn(B, R, generator=g, dtype=torch.float64)
    terms, rterms = [], []
    if loss in ("both", "student") or not squares:
        terms.append((out.student * gs.to(dtype)).sum())
        rterms.append((ref.student * gs).sum())
    if squares and loss in ("both", "squares"):
        terms.append((out.squares * gq.to(dtype)).sum())
        rterms.append((ref.squares * gq).sum())
    gx, gw = torch.autograd.grad(sum(terms), [x, w])
    rx, rw = torch.autograd.grad(sum(rterms), [x64, w64])
    ex = _check(gx, rx, tol * 4, "grad x")
    ew = _check(gw, rw, tol * 4, "grad w")
    return ex, ew


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ACTS, ids=_ids)
@pytest.mark.parametrize("opt", range(len(OPTIONS)))
def test_matches_float64_reference(poisoned, backend, act, opt, dtype):
    mask_kind, ts, squares = OPTIONS[opt]
    case = ACTS.index(act) * len(OPTIONS) + opt
    shape = SHAPES[(case + DTYPES.index(dtype)) % len(SHAPES)]
    save = (SAVE, RECOMPUTE)[(case + DTYPES.index(dtype)) % 2]  # both backward paths over the cases
    _compare(backend, act, shape, dtype, mask_kind, ts, squares, seed=1000 + 100 * DTYPES.index(dtype) + case,
             save=save)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss", ["student", "squares"])
@pytest.mark.parametrize("save", [SAVE, RECOMPUTE])
def test_gradient_of_one_output_only(poisoned, backend, loss, dtype, save):
    # backward with only one of the two incoming gradients defined (the other is None)
    _compare(backend, ACTS[0], (4, 5, 19, 13), dtype, "bool", 1.5, True, seed=31, loss=loss, save=save)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [1, 2 * 7 * 19 + 5])
@pytest.mark.parametrize("save", [SAVE, RECOMPUTE])
def test_chunked_path_matches(poisoned, backend, chunk, dtype, save):
    # chunk=1: one sample per chunk; the other: 2 samples per chunk with a partial last chunk (B=5);
    # with A saved, each chunk reads its rows of the saved A
    _compare(backend, ACTS[0], (5, 7, 37, 19), dtype, "float", 1.5, True, seed=55, chunk=chunk, save=save)


@pytest.mark.parametrize("precision", ["tf32", "auto"])
@pytest.mark.parametrize("save", [SAVE, RECOMPUTE])
def test_float32_tf32_within_tf32_tolerance(poisoned, precision, save):
    # the float32 default ("auto" = TF32). The interpreter multiplies in full float32, so here this checks
    # that the TF32 variants compile, launch and write every cell; on a GPU it bounds the TF32 rounding
    _compare("triton", ACTS[0], (6, 5, 40, 21), torch.float32, "bool", 1.5, True, seed=61, save=save,
             precision=precision, tol=TF32_TOL)


@pytest.mark.parametrize("precision", ["tf32", "auto"])
def test_float64_ignores_tf32(poisoned, precision):
    # no float64 TF32: asking for it keeps float64 runs at float64 rounding
    _compare("triton", ACTS[3], (4, 3, 21, 17), torch.float64, "float", 0.7, True, seed=62, precision=precision)


def test_chunk_size_follows_dw_size():
    # default chunks: DW_REUSE * R * d elements of dA, clamped to [MIN_CHUNK_ELEMENTS, the save budget]
    P, itemsize = 32, 4
    assert pas._rows_per_chunk(P, 30, 256, itemsize, None, SAVE) == pas.MIN_CHUNK_ELEMENTS // (P * 30)
    R, d = 11264, 2048  # MRP at k = 512, m = 22: 16 R d elements would be 1.5 GB, over the 1 GiB budget
    assert pas._rows_per_chunk(P, R, d, itemsize, None, SAVE) == SAVE // itemsize // (P * R)
    R, d = 2048, 2048
    assert pas._rows_per_chunk(P, R, d, itemsize, None, SAVE) == pas.DW_REUSE * R * d // (P * R)
    assert pas._rows_per_chunk(P, R, d, itemsize, 5, SAVE) == 1  # an explicit bound wins


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_wrt_one_input_and_noncontiguous(backend):
    g = torch.Generator().manual_seed(3)
    big = torch.randn(7, 4, 2 * 23, generator=g, dtype=torch.float64)
    x = big.transpose(0, 1)[:, :, ::2]  # [4, 7, 23], non-contiguous
    w = (torch.randn(9, 23, generator=g, dtype=torch.float64) / 5).requires_grad_(True)
    act = ACTS[0]
    out = patch_activation_sum(x, w, act, squares=True, backend=backend)
    ref = patch_activation_sum_reference(x, w, act, squares=True)
    _check(out.student, ref.student.detach(), 1e-12, "student")
    (gw,) = torch.autograd.grad(out.squares.sum(), [w])
    (rw,) = torch.autograd.grad(ref.squares.sum(), [w])
    _check(gw, rw, 1e-12, "grad w")
    xg = x.detach().clone().requires_grad_(True)
    out = patch_activation_sum(xg, w.detach(), act, backend=backend)
    (gx,) = torch.autograd.grad(out.student.sum(), [xg])
    xr = x.detach().clone().requires_grad_(True)
    (rx,) = torch.autograd.grad(patch_activation_sum_reference(xr, w.detach(), act).student.sum(), [xr])
    _check(gx, rx, 1e-12, "grad x")


@pytest.mark.parametrize("backend", BACKENDS)
def test_poisoned_buffers_are_fully_overwritten(backend, poisoned):
    # B, R, d not multiples of any tile size; chunked backward with a partial last chunk
    _compare(backend, ACTS[0], (5, 3, 21, 19), torch.float32, "bool", 1.5, True, seed=77, chunk=2 * 3 * 19)
    _compare(backend, ACTS[3], (3, 2, 17, 33), torch.float64, None, None, True, seed=78)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_equals_zeroed_patches(backend):
    # f(0) = 0, so masking a patch (SimMIM style) equals replacing it by zeros
    x, w, mask = _inputs(5, (4, 6, 13, 7), torch.float64, "bool")
    act = ACTS[1]
    masked = patch_activation_sum(x, w, act, mask=mask, squares=True, backend=backend)
    zeroed = patch_activation_sum(x * mask.unsqueeze(-1), w, act, squares=True, backend=backend)
    torch.testing.assert_close(masked.student, zeroed.student, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(masked.squares, zeroed.squares, rtol=1e-13, atol=1e-15)
    unmasked = patch_activation_sum(x, w, act, backend=backend)
    assert (unmasked.student - masked.student).abs().max() > 1e-3  # the mask did something


@pytest.mark.parametrize("backend", BACKENDS)
def test_saves_a_only_within_budget_and_when_a_gradient_is_wanted(backend):
    B, P, d, R = 5, 7, 11, 13
    x, w, mask = _inputs(9, (B, P, d, R), torch.float32, "float")
    a_bytes = B * P * R * 4

    def saved_sizes(budget, grad):
        saved = []
        xg, wg = x.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            patch_activation_sum(xg, wg, ACTS[0], mask=mask, teacher_scale=1.5, squares=True, backend=backend,
                                 save_preactivation_bytes=budget)
        return saved

    for budget in (RECOMPUTE, a_bytes - 1):
        saved = saved_sizes(budget, True)
        assert saved and all(n < B * P * R for n in saved), saved  # only x, w, mask
    assert sorted(saved_sizes(a_bytes, True))[-1] == B * P * R  # A, once
    assert saved_sizes(a_bytes, False) == []  # no gradient wanted: nothing saved
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        patch_activation_sum_reference(x.requires_grad_(), w.requires_grad_(), ACTS[0], mask=mask, squares=True)
    assert sum(n >= B * P * R for n in saved) >= 3  # the check above would catch an unfused version


def test_gradcheck_torch_fallback_float64():
    g = torch.Generator().manual_seed(123)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(3, 4, generator=g, dtype=torch.float64) / 2).requires_grad_(True)
    mask = torch.rand(2, 3, generator=g, dtype=torch.float64)
    for act in (Activation("srelu", q=3, rho=0.4), Activation("pow", q=3)):
        def fn(x, w):
            out = patch_activation_sum(x, w, act, mask=mask, teacher_scale=1.3, squares=True,
                                       backend="torch", chunk_elements=3 * 3)
            return out.student, out.squares

        assert torch.autograd.gradcheck(fn, (x, w), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_auto_backend_on_cpu_is_torch(monkeypatch):
    def boom(*args):
        raise AssertionError("triton path used for CPU tensors with backend='auto'")

    monkeypatch.setattr(pas, "_patch_sum_fwd_triton", boom)
    x, w, _ = _inputs(1, (2, 3, 5, 4), torch.float64, None)
    out = patch_activation_sum(x, w, ACTS[2], backend="auto")
    torch.testing.assert_close(out.student, patch_activation_sum_reference(x, w, ACTS[2]).student)


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, _ = _inputs(1, (2, 3, 5, 4), torch.float32, None)
    with pytest.raises(ConfigError, match="^backend: must be"):
        patch_activation_sum(x, w, ACTS[0], backend="triton")


def _bad_cases():
    x = torch.randn(2, 3, 5)
    w = torch.randn(4, 5)
    act = ACTS[0]
    yield "x", dict(x=torch.randn(6, 5), w=w), "[B, P, d]"
    yield "x", dict(x=torch.randn(0, 3, 5), w=w), "non-empty"
    yield "w", dict(x=x, w=torch.randn(4, 6)), "d = 5"
    yield "w", dict(x=x, w=torch.randn(4, 5, 1)), "[R, d]"
    yield "activation", dict(x=x, w=w, activation="srelu"), "Activation"
    yield "mask", dict(x=x, w=w, mask=torch.ones(3, 2, dtype=torch.bool)), "[B, P] = (2, 3)"
    yield "mask", dict(x=x, w=w, mask=torch.ones(2, 3, dtype=torch.long)), "bool or floating"
    yield "teacher_scale", dict(x=x, w=w, teacher_scale=float("inf")), "finite"
    yield "teacher_scale", dict(x=x, w=w, teacher_scale="1.5"), "finite"
    yield "squares", dict(x=x, w=w, squares=1), "a bool"
    yield "backend", dict(x=x, w=w, backend="cuda"), "one of ('auto', 'torch', 'triton')"
    yield "chunk_elements", dict(x=x, w=w, chunk_elements=0), ">= 1"
    yield "save_preactivation_bytes", dict(x=x, w=w, save_preactivation_bytes=-1), "an integer >= 0"
    yield "save_preactivation_bytes", dict(x=x, w=w, save_preactivation_bytes=None), "an integer >= 0"
    yield "input_precision", dict(x=x, w=w, input_precision="fp32"), "one of ('auto', 'tf32', 'ieee')"
    del act


@pytest.mark.parametrize("field,kwargs,fragment", list(_bad_cases()), ids=itertools.count())
def test_bad_inputs_raise_config_error_naming_the_argument(field, kwargs, fragment):
    kwargs = dict(kwargs)
    kwargs.setdefault("activation", ACTS[0])
    x, w, act = kwargs.pop("x"), kwargs.pop("w"), kwargs.pop("activation")
    with pytest.raises(ConfigError) as info:
        patch_activation_sum(x, w, act, **kwargs)
    msg = str(info.value)
    assert info.value.field == field and fragment in msg, msg
    if field in ("x", "w", "mask"):  # a tensor argument: the op's KernelInputError
        assert isinstance(info.value, KernelInputError) and msg.startswith(f"patch_activation_sum: {field} "), msg
    else:
        assert msg.startswith(f"{field}: must be "), msg


SUPPORTED = "supported: torch.float32, torch.float64 (all inputs the same dtype)"


def _dtype_refusals():
    x, w = torch.randn(2, 3, 5), torch.randn(4, 5)
    mask = torch.rand(2, 3)
    yield "x", dict(x=x.half(), w=w.half()), "has dtype torch.float16"
    yield "x", dict(x=x.bfloat16(), w=w.bfloat16()), "has dtype torch.bfloat16"
    yield "x", dict(x=x.long(), w=w), "has dtype torch.int64"
    yield "w", dict(x=x, w=w.double()), "has dtype torch.float64 but x has torch.float32"
    yield "w", dict(x=x.double(), w=w.half()), "has dtype torch.float16"
    yield "mask", dict(x=x, w=w, mask=mask.double()), "has dtype torch.float64 but x has torch.float32"
    yield "mask", dict(x=x.double(), w=w.double(), mask=mask), "has dtype torch.float32 but x has torch.float64"
    yield "mask", dict(x=x, w=w, mask=mask.half()), "has dtype torch.float16"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("field,kwargs,problem", list(_dtype_refusals()), ids=itertools.count())
def test_dtype_policy_refuses_before_any_work(refused_before_work, backend, field, kwargs, problem):
    kwargs = dict(kwargs)
    x, w = kwargs.pop("x"), kwargs.pop("w")
    error = refused_before_work(pas.PatchActivationSumFunction,
                                lambda: patch_activation_sum(x, w, ACTS[0], backend=backend, **kwargs))
    assert str(error) == f"patch_activation_sum: {field} {problem}; {SUPPORTED}"
    assert error.field == field and isinstance(error, ConfigError)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bool_mask_is_accepted_with_either_dtype(dtype):
    x, w, mask = _inputs(4, (3, 4, 5, 6), dtype, "bool")
    out = patch_activation_sum(x, w, ACTS[2], mask=mask, backend="torch")
    ref = patch_activation_sum_reference(x, w, ACTS[2], mask=mask)
    assert out.student.dtype == dtype
    torch.testing.assert_close(out.student, ref.student)


@pytest.mark.parametrize("precision,tf32", [("tf32", True), ("ieee", False), ("auto", True)])
def test_triton_backward_gemms_follow_input_precision(monkeypatch, precision, tf32):
    # dW goes to cuBLAS on a GPU: the op's precision must reach it, and the global flag come back
    seen, real_mm = [], torch.mm

    def mm(*args, **kwargs):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", mm)
    before = torch.backends.cuda.matmul.allow_tf32
    x, w, _ = _inputs(3, (3, 4, 17, 5), torch.float32, None)
    w.requires_grad_(True)
    patch_activation_sum(x, w, ACTS[0], backend="triton", input_precision=precision).student.sum().backward()
    assert seen == [tf32] and torch.backends.cuda.matmul.allow_tf32 == before
