"""soft_threshold_layer: Triton (interpreter) and PyTorch fallback against a float64 reference."""
import importlib
import itertools

import pytest
import torch

from featlearn.errors import ConfigError

st = importlib.import_module("featlearn.kernels.soft_threshold")

# (B, d1, m): odd sizes that straddle the 16-wide interpreter tiles, plus degenerate ones
SHAPES = [(7, 19, 13), (33, 50, 17), (5, 3, 40), (1, 1, 1), (17, 64, 33)]
# vs float64 on the same (rounded) inputs: each output is a d1-term dot product, rounding ~ sqrt(d1) eps
# of the scale. fp32 (eps 6e-8): 2e-5 leaves > 10x margin over what we see; fp64 (eps 1e-16): 1e-12
# catches a float32 accumulator (~1e-7) by five orders. An indexing bug gives O(1) errors.
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}
# TF32 keeps 10 mantissa bits (rounding 2^-11 ~ 5e-4 per operand): a d1-term product sum lands near 1e-3
# of the scale; 1e-2 is the budget a float32 run may spend (the feature-learning signals are ~1e-2)
TF32_TOL = 1e-2
DTYPES = [torch.float32, torch.float64]


def _inputs(seed, shape, bias_kind):
    B, D, M = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g, dtype=torch.float64)
    w = torch.randn(M, D, generator=g, dtype=torch.float64) / D ** 0.5  # u ~ N(0, 1)
    if bias_kind == "pos":
        b = torch.rand(M, generator=g, dtype=torch.float64)  # thresholds inside the bulk of u
    elif bias_kind == "mixed":
        b = torch.randn(M, generator=g, dtype=torch.float64) * 0.7  # learned-bias ablation: b < 0 too
    else:
        b = torch.zeros(M, dtype=torch.float64)
    grad = torch.randn(B, M, generator=g, dtype=torch.float64)
    return x, w, b, grad


def _rel(out, ref):
    assert torch.isfinite(out).all()
    return (out.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _compare(backend, dtype, x, w, b, grad, need=(True, True, True), input_precision="ieee"):
    """Run the op in ``dtype`` and the reference in float64 on the same rounded inputs; relative errors.
    IEEE products by default: the float32 tolerance is tighter than TF32 rounding."""
    ins = [t.to(dtype).requires_grad_(r) for t, r in zip((x, w, b), need)]
    ref_in = [t.detach().double().requires_grad_(r) for t, r in zip(ins, need)]
    grad = grad.to(dtype)
    ref = st.soft_threshold_reference(*ref_in)
    ref.backward(grad.double())
    out = st.soft_threshold_layer(*ins, backend=backend, input_precision=input_precision)
    out.backward(grad)
    assert out.dtype == dtype and out.shape == ref.shape
    errs = [_rel(out, ref.detach())]
    for got, want, r in zip(ins, ref_in, need):
        if r:
            assert got.grad.dtype == dtype
            errs.append(_rel(got.grad, want.grad))
        else:
            assert got.grad is None
    return errs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape,bias_kind,seed", [(s, k, i) for i, (s, k) in
                                                 enumerate(itertools.product(SHAPES, ["pos", "mixed", "zero"]))])
def test_forward_backward_vs_float64(poisoned, backend, shape, bias_kind, seed, dtype):
    x, w, b, grad = _inputs(seed, shape, bias_kind)
    assert max(_compare(backend, dtype, x, w, b, grad)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True), (False, True, True)])
def test_triton_partial_gradients(poisoned, need, dtype):
    x, w, b, grad = _inputs(7, (9, 21, 18), "mixed")
    assert max(_compare("triton", dtype, x, w, b, grad, need)) < TOL[dtype]


@pytest.mark.parametrize("precision", ["tf32", "auto"])
def test_float64_ignores_tf32(poisoned, precision):
    # there is no fp64 TF32: asking for it must not lower a float64 run's precision (nor fail to compile)
    x, w, b, grad = _inputs(21, (13, 37, 19), "mixed")
    assert max(_compare("triton", torch.float64, x, w, b, grad, input_precision=precision)) < TOL[torch.float64]


@pytest.mark.parametrize("precision", ["tf32", "auto"])
def test_float32_tf32_within_tf32_tolerance(poisoned, precision):
    # the default for float32 ("auto" = TF32). The interpreter multiplies in full float32, so here this
    # checks that the TF32 variants compile, launch and write every cell; on a GPU it bounds TF32 rounding
    x, w, b, grad = _inputs(22, (33, 50, 17), "pos")
    assert max(_compare("triton", torch.float32, x, w, b, grad, input_precision=precision)) < TF32_TOL


def test_bad_input_precision_is_refused():
    x, w = torch.randn(3, 5), torch.randn(4, 5)
    with pytest.raises(ConfigError, match="^input_precision: must be one of"):
        st.soft_threshold_layer(x, w, input_precision="tf32x3")


def test_soft_threshold_identity():
    g = torch.Generator().manual_seed(3)
    u = torch.randn(50, 11, generator=g, dtype=torch.float64) * 2
    b = torch.rand(11, generator=g, dtype=torch.float64)
    # two-ReLU formula == sign(u) max(|u| - b, 0) for b >= 0, == u for b == 0
    assert torch.equal(st.symmetric_relu(u, b), torch.sign(u) * torch.clamp_min(u.abs() - b, 0))
    assert torch.equal(st.symmetric_relu(u, torch.zeros(11, dtype=torch.float64)), u)
    # b < 0: slope 2 inside |u| < -b, shifted identity outside
    v = torch.tensor([0.3, -0.3, 2.0], dtype=torch.float64)
    assert torch.allclose(st.symmetric_relu(v, torch.tensor(-1.0, dtype=torch.float64)),
                          torch.tensor([0.6, -0.6, 3.0], dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_none_is_linear_and_backends_agree(dtype):
    x, w, _, _ = _inputs(11, (6, 20, 9), "zero")
    x, w = x.to(dtype), w.to(dtype)
    ref = x.double() @ w.double().t()
    for backend in ("torch", "triton"):
        out = st.soft_threshold_layer(x, w, None, backend=backend)
        assert out.dtype == dtype and _rel(out, ref) < TOL[dtype]


def test_bad_inputs_raise_config_error():
    x, w = torch.randn(3, 5), torch.randn(4, 5)
    with pytest.raises(ConfigError, match="backend"):
        st.soft_threshold_layer(x, w, backend="cuda")
    with pytest.raises(ConfigError, match="w"):
        st.soft_threshold_layer(x, torch.randn(4, 6))
    with pytest.raises(ConfigError, match="bias"):
        st.soft_threshold_layer(x, w, torch.zeros(3))
    with pytest.raises(ConfigError, match="x"):
        st.soft_threshold_layer(torch.randn(2, 3, 5), w)


def _dtype_cases():
    x, w, b = torch.randn(3, 5), torch.randn(4, 5), torch.rand(4)
    yield "x", dict(x=x.half(), w=w.half(), bias=b.half()), "has dtype torch.float16;"
    yield "x", dict(x=x.bfloat16(), w=w.bfloat16(), bias=None), "has dtype torch.bfloat16;"
    yield "x", dict(x=x.long(), w=w, bias=b), "has dtype torch.int64;"
    yield "w", dict(x=x, w=w.double(), bias=b), "has dtype torch.float64 but x has torch.float32;"
    yield "bias", dict(x=x.double(), w=w.double(), bias=b), "has dtype torch.float32 but x has torch.float64;"
    yield "w", dict(x=x, w=w.half(), bias=None), "has dtype torch.float16;"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("field,args,fragment", list(_dtype_cases()), ids=itertools.count())
def test_dtype_policy_refuses_before_any_work(refused_before_work, backend, field, args, fragment):
    error = refused_before_work(st.SoftThresholdFunction,
                                lambda: st.soft_threshold_layer(args["x"], args["w"], args["bias"], backend=backend))
    msg = str(error)
    assert msg.startswith(f"soft_threshold_layer: {field} {fragment}"), msg
    assert msg.endswith("supported: torch.float32, torch.float64 (all inputs the same dtype)"), msg
    assert error.field == field and isinstance(error, ConfigError)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_without_gradient_skips_the_code_and_gives_the_same_values(dtype, monkeypatch):
    """Under no_grad (the contrastive step's positives and negatives) the fallback returns the forward without the
    backward's slope code: the same values, bit for bit, as the differentiable call."""
    x, w, b, _ = (t.to(dtype) for t in _inputs(5, (33, 50, 17), "mixed"))
    with_grad = st.soft_threshold_layer(x, w.requires_grad_(), b, backend="torch")
    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(st.SoftThresholdFunction, "apply", None)  # the autograd.Function is not called at all
        without = st.soft_threshold_layer(x, w, b, backend="torch")
    assert with_grad.grad_fn is not None and without.grad_fn is None
    assert torch.equal(with_grad.detach(), without)
    assert (without - st.soft_threshold_reference(x.double(), w.detach().double(), b.double())).abs().max() < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_vmappable_form_batches_seeds_under_vmap(dtype):
    """``vmappable=True`` (a seed stack's step): values bit for bit the Function's, gradients of x, W and b to
    rounding; under ``torch.func.vmap`` over three seeds each seed's row is its own call's to rounding (a batched
    product may sum in another order); the Triton backend is refused with it."""
    seeds = [tuple(t.to(dtype) for t in _inputs(40 + s, (29, 37, 19), "mixed")[:3]) for s in range(3)]
    g = torch.randn(3, 29, 19, dtype=dtype)
    stacked = [torch.stack(ts).requires_grad_() for ts in zip(*seeds)]
    out = torch.func.vmap(lambda x, w, b: st.soft_threshold_layer(x, w, b, vmappable=True))(*stacked)
    (out * g).sum().backward()
    for s, one in enumerate(seeds):
        mine = [t.clone().requires_grad_() for t in one]
        ref = st.soft_threshold_layer(*mine, backend="torch")
        (ref * g[s]).sum().backward()
        assert torch.equal(st.soft_threshold_layer(*one, vmappable=True), ref.detach())
        torch.testing.assert_close(out[s], ref, rtol=TOL[dtype], atol=TOL[dtype])
        for leaf, own in zip(stacked, mine):
            torch.testing.assert_close(leaf.grad[s], own.grad, rtol=TOL[dtype], atol=TOL[dtype])
    with pytest.raises(ConfigError, match="^backend"):
        st.soft_threshold_layer(*seeds[0], backend="triton", vmappable=True)
