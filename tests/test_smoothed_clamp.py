"""smoothed_clamp_layer: the closed form against Monte Carlo, both backends (Triton under the interpreter)
against a float64 reference on odd shapes, forward and every gradient, and refusals before any work."""
import importlib
import itertools

import pytest
import torch

from featlearn.errors import ConfigError
from featlearn.kernels.backend import KernelInputError

sc = importlib.import_module("featlearn.kernels.smoothed_clamp")

# (B, d, M): odd sizes straddling the 16-wide interpreter tiles, plus degenerate ones
SHAPES = [(7, 19, 13), (33, 50, 17), (1, 1, 1), (17, 40, 33)]
# each output is a d-term dot product then a smooth map with slope <= 1: rounding ~ sqrt(d) eps of the scale
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float64]


def _inputs(seed, shape):
    B, D, M = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g, dtype=torch.float64)
    w = torch.randn(M, D, generator=g, dtype=torch.float64) * 0.5 / D ** 0.5  # z spans both kinks 0 and 1
    b = torch.rand(M, generator=g, dtype=torch.float64)
    grad = torch.randn(B, M, generator=g, dtype=torch.float64)
    return x, w, b, grad


def _rel(out, ref):
    assert torch.isfinite(out).all()
    return (out.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _compare(backend, dtype, x, w, b, grad, s, need=(True, True, True)):
    ins = [t.to(dtype).requires_grad_(r) for t, r in zip((x, w, b), need)]
    ref_in = [t.detach().double().requires_grad_(r) for t, r in zip(ins, need)]
    ref = sc.smoothed_clamp_reference(*ref_in, s)
    ref.backward(grad.double())
    out = sc.smoothed_clamp_layer(*ins, s, backend=backend, input_precision="ieee")
    out.backward(grad.to(dtype))
    assert out.dtype == dtype and out.shape == ref.shape
    errs = [_rel(out, ref.detach())]
    for got, want, r in zip(ins, ref_in, need):
        if r:
            errs.append(_rel(got.grad, want.grad))
        else:
            assert got.grad is None
    return errs


@pytest.mark.parametrize("s", [0.0, 0.04, 0.3])
def test_closed_form_matches_monte_carlo(s):
    """E_xi clamp(z + xi, 0, 1), xi ~ N(0, s^2): 4e5 draws (standard error < 5e-4 of a [0, 1] variable)."""
    g = torch.Generator().manual_seed(5)
    z = torch.linspace(-0.7, 1.7, 25, dtype=torch.float64)
    xi = torch.randn(400_000, 1, generator=g, dtype=torch.float64) * s
    mc = (z + xi).clamp(0, 1).mean(0)
    assert (sc.gaussian_smoothed_clamp(z, s) - mc).abs().max() < 3e-3
    # the derivative: E 1[0 < z + xi < 1], and against autograd of the closed form
    mc_slope = ((z + xi > 0) & (z + xi < 1)).double().mean(0)
    assert (sc.gaussian_smoothed_clamp_derivative(z, s) - mc_slope).abs().max() < 3e-3
    if s > 0:
        zz = z.clone().requires_grad_(True)
        sc.gaussian_smoothed_clamp(zz, s).sum().backward()
        assert torch.allclose(zz.grad, sc.gaussian_smoothed_clamp_derivative(z, s), atol=1e-13)


def test_small_smoothing_tends_to_the_truncated_relu():
    z = torch.tensor([-0.5, 0.2, 0.8, 1.5], dtype=torch.float64)
    assert torch.allclose(sc.gaussian_smoothed_clamp(z, 1e-4), z.clamp(0, 1), atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape,s,seed", [(sh, s, i) for i, (sh, s) in enumerate(itertools.product(SHAPES, [0.0, 0.04]))])
def test_forward_backward_vs_float64(poisoned, backend, shape, s, seed, dtype):
    x, w, b, grad = _inputs(seed, shape)
    assert max(_compare(backend, dtype, x, w, b, grad, s)) < TOL[dtype]


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True), (False, True, True)])
def test_triton_partial_gradients(poisoned, need):
    x, w, b, grad = _inputs(7, (9, 21, 18))
    assert max(_compare("triton", torch.float64, x, w, b, grad, 0.1, need)) < TOL[torch.float64]


def test_float32_tf32_within_tf32_tolerance(poisoned):
    x, w, b, grad = _inputs(22, (33, 50, 17))
    ins = [t.float() for t in (x, w, b)]
    out = sc.smoothed_clamp_layer(*ins, 0.04, backend="triton", input_precision="tf32")
    assert _rel(out, sc.smoothed_clamp_reference(x, w, b, 0.04)) < 1e-2


def test_bad_inputs_raise_config_error():
    x, w = torch.randn(3, 5), torch.randn(4, 5)
    with pytest.raises(ConfigError, match="^backend"):
        sc.smoothed_clamp_layer(x, w, backend="cuda")
    # tensor shapes: a KernelInputError (a ConfigError) naming the op, the argument and the allowed shape
    with pytest.raises(KernelInputError, match=r"^smoothed_clamp_layer: w has shape \[4, 6\]; must be .* \[M, 5\]"):
        sc.smoothed_clamp_layer(x, torch.randn(4, 6))
    with pytest.raises(KernelInputError, match=r"^smoothed_clamp_layer: bias has shape \[3\]; must be .* \[4\]"):
        sc.smoothed_clamp_layer(x, w, torch.zeros(3))
    with pytest.raises(KernelInputError, match=r"^smoothed_clamp_layer: x has shape \[2, 3, 5\]; must be a 2-D"):
        sc.smoothed_clamp_layer(torch.randn(2, 3, 5), w)
    for s in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="^smoothing:"):
            sc.smoothed_clamp_layer(x, w, None, s)
    with pytest.raises(ConfigError, match="^input_precision"):
        sc.smoothed_clamp_layer(x, w, input_precision="fp8")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dtype_policy_refuses_before_any_work(refused_before_work, backend):
    x, w = torch.randn(3, 5), torch.randn(4, 5)
    for args, field in (((x.half(), w.half()), "x"), ((x, w.double()), "w"), ((x.long(), w), "x")):
        error = refused_before_work(sc.SmoothedClampFunction,
                                    lambda: sc.smoothed_clamp_layer(*args, None, 0.1, backend=backend))
        assert str(error).startswith(f"smoothed_clamp_layer: {field} ") and error.field == field
