"""soft_threshold_layer: Triton (interpreter) and PyTorch fallback against a float64 reference."""
import importlib
import itertools

import pytest
import torch

from featlearn.errors import ConfigError

st = importlib.import_module("featlearn.kernels.soft_threshold")

# (B, d1, m): odd sizes that straddle the 16-wide interpreter tiles, plus degenerate ones
SHAPES = [(7, 19, 13), (33, 50, 17), (5, 3, 40), (1, 1, 1), (17, 64, 33)]
# fp32 vs float64: each output is a d1-term dot product (rounding ~ sqrt(d1) 6e-8 of the scale);
# 2e-5 of the output scale leaves > 10x margin over what we see; an indexing bug gives O(1) errors.
TOL = 2e-5


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


@pytest.fixture
def poisoned(monkeypatch):
    """Every output buffer the kernels allocate starts as NaN (codes as 255): unwritten cells show up."""
    def _empty(shape, like, dtype=None):
        dtype = like.dtype if dtype is None else dtype
        fill = 255 if dtype == torch.uint8 else float("nan")
        return torch.full(shape, fill, device=like.device, dtype=dtype)

    monkeypatch.setattr(st, "_empty", _empty)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape,bias_kind,seed", [(s, k, i) for i, (s, k) in
                                                 enumerate(itertools.product(SHAPES, ["pos", "mixed", "zero"]))])
def test_forward_backward_vs_float64(poisoned, backend, shape, bias_kind, seed):
    x, w, b, grad = _inputs(seed, shape, bias_kind)
    xr, wr, br = (t.clone().requires_grad_(True) for t in (x, w, b))
    ref = st.soft_threshold_reference(xr, wr, br)
    ref.backward(grad)
    xf, wf, bf = (t.float().requires_grad_(True) for t in (x, w, b))
    out = st.soft_threshold_layer(xf, wf, bf, backend=backend)
    out.backward(grad.float())
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert _rel(out, ref) < TOL
    assert _rel(xf.grad, xr.grad) < TOL
    assert _rel(wf.grad, wr.grad) < TOL
    assert _rel(bf.grad, br.grad) < TOL


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True), (False, True, True)])
def test_triton_partial_gradients(poisoned, need):
    x, w, b, grad = _inputs(7, (9, 21, 18), "mixed")
    ref_in = [t.clone().requires_grad_(r) for t, r in zip((x, w, b), need)]
    st.soft_threshold_reference(*ref_in).backward(grad)
    ins = [t.float().requires_grad_(r) for t, r in zip((x, w, b), need)]
    st.soft_threshold_layer(*ins, backend="triton").backward(grad.float())
    for got, want, r in zip(ins, ref_in, need):
        if r:
            assert _rel(got.grad, want.grad) < TOL
        else:
            assert got.grad is None


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


def test_bias_none_is_linear_and_backends_agree():
    x, w, _, _ = _inputs(11, (6, 20, 9), "zero")
    x, w = x.float(), w.float()
    ref = x @ w.t()
    for backend in ("torch", "triton"):
        assert torch.allclose(st.soft_threshold_layer(x, w, None, backend=backend), ref, atol=1e-5)


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
