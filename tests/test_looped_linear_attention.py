"""looped_linear_attention: both backends (Triton under the interpreter) against a float64 reference on odd sizes,
every loop's row and every gradient (G, z0, Q, P, eta), float32 and float64, with poisoned outputs; partial
gradients; the PyTorch form under vmap; refusals before any work."""
import importlib

import pytest
import torch

from featlearn.errors import ConfigError
from featlearn.kernels.backend import KernelInputError

la = importlib.import_module("featlearn.kernels.looped_linear_attention")

# (B, D, T): odd batches ending in a partial block of the interpreter's 2 prompts, D = 3, 5, 7 (U tiles of 4 and
# 8, padded), T = 1, 4, 7
SHAPES = [(5, 3, 1), (7, 5, 4), (3, 7, 7), (9, 4, 5)]
NAMES = ("G", "z0", "Q", "P", "eta")
# T loops of D-term sums in a contraction (|I - eta U| <~ 1): rounding ~ T sqrt(D) eps of the scale
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}


def _inputs(seed, B, D, T, n=9):
    """Gram matrices of n examples, weights near the construction's (Q = P = I) and step sizes that make the
    loops contract, so every loop's row matters to the gradients."""
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(B, n, D, generator=g, dtype=torch.float64) / n ** 0.5
    eye = torch.eye(D, dtype=torch.float64)
    Q = eye + 0.3 * torch.randn(D, D, generator=g, dtype=torch.float64)
    P = eye + 0.3 * torch.randn(D, D, generator=g, dtype=torch.float64)
    eta = 0.05 + 0.1 * torch.rand(T, generator=g, dtype=torch.float64)
    ins = dict(G=E.mT @ E, z0=torch.randn(B, D, generator=g, dtype=torch.float64), Q=Q, P=P, eta=eta)
    return ins, torch.randn(B, T + 1, D, generator=g, dtype=torch.float64)


def _rel(out, ref):
    assert torch.isfinite(out).all()
    return (out.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _compare(backend, dtype, ins, grad, need=NAMES):
    """Relative errors of Z and of each gradient in ``need`` against the float64 reference's autograd."""
    ref_in = {k: v.detach().clone().requires_grad_(k in need) for k, v in ins.items()}
    ref = la.looped_linear_attention_reference(*ref_in.values())
    if need:
        ref.backward(grad)
    got_in = {k: v.detach().to(dtype).requires_grad_(k in need) for k, v in ins.items()}
    out = la.looped_linear_attention(*got_in.values(), backend=backend)
    assert out.dtype == dtype and out.shape == ref.shape
    errors = {"Z": _rel(out, ref.detach())}
    if need:
        out.backward(grad.to(dtype))
    for k in NAMES:
        assert (got_in[k].grad is not None) == (k in need), k
        if k in need:
            assert got_in[k].grad.dtype == dtype
            errors[f"grad_{k}"] = _rel(got_in[k].grad, ref_in[k].grad)
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed,shape", list(enumerate(SHAPES)))
def test_forward_backward_vs_float64(poisoned, backend, shape, seed, dtype):
    errors = _compare(backend, dtype, *_inputs(seed, *shape))
    assert max(errors.values()) < TOL[dtype], errors


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("D", [3, 9])  # 9: padded to a 16-wide tile
def test_non_symmetric_G(poisoned, backend, D):
    """The op takes any G (not only Gram matrices): a G / G^T mix-up in the forward or the backward fails here."""
    ins, grad = _inputs(30 + D, 5, D, 4)
    ins["G"] = ins["G"] + 0.5 * torch.randn(5, D, D, generator=torch.Generator().manual_seed(D), dtype=torch.float64)
    assert (ins["G"] - ins["G"].mT).abs().max() > 0.1
    errors = _compare(backend, torch.float64, ins, grad)
    assert max(errors.values()) < TOL[torch.float64], errors


@pytest.mark.parametrize("need", [("Q", "P", "eta"), ("eta",), ("G", "z0"), ()])
def test_triton_partial_gradients(poisoned, need):
    # ("Q", "P", "eta"): what the module differentiates; (): a forward with nothing to differentiate
    errors = _compare("triton", torch.float64, *_inputs(11, 7, 6, 3), need=need)
    assert max(errors.values()) < TOL[torch.float64], errors


def test_first_row_is_z0_and_one_loop_is_the_update(poisoned):
    ins, _ = _inputs(5, 3, 4, 2)
    for backend in ("torch", "triton"):
        Z = la.looped_linear_attention(*ins.values(), backend=backend)
        assert torch.equal(Z[:, 0], ins["z0"])
        U = ins["Q"] @ ins["G"] @ ins["P"]
        step = ins["z0"] - ins["eta"][0] * (ins["z0"].unsqueeze(1) @ U).squeeze(1)
        torch.testing.assert_close(Z[:, 1], step, rtol=1e-13, atol=1e-14)


def test_torch_backend_runs_under_vmap_over_the_weights():
    """A module's seeds in one call: Q, P, eta stacked per seed (the prompts too), vmapped, equal to a loop over
    the seeds, values and gradients."""
    seeds = [_inputs(20 + s, 5, 4, 3)[0] for s in range(3)]
    stacked = {k: torch.stack([s[k] for s in seeds]).requires_grad_(k in ("Q", "P", "eta")) for k in NAMES}
    out = torch.func.vmap(lambda *a: la.looped_linear_attention(*a, backend="torch"))(*stacked.values())
    (out.square().sum()).backward()
    for s, one in enumerate(seeds):
        mine = {k: v.detach().clone().requires_grad_(k in ("Q", "P", "eta")) for k, v in one.items()}
        ref = la.looped_linear_attention_reference(*mine.values())
        torch.testing.assert_close(out[s], ref.detach(), rtol=1e-12, atol=1e-14)
        ref.square().sum().backward()
        for k in ("Q", "P", "eta"):
            torch.testing.assert_close(stacked[k].grad[s], mine[k].grad, rtol=1e-11, atol=1e-13)


def test_torch_backend_takes_any_dimension():
    ins, grad = _inputs(3, 2, la.MAX_DIM + 1, 2)
    assert max(_compare("torch", torch.float64, ins, grad).values()) < TOL[torch.float64]


def test_bad_inputs_are_refused():
    ins, _ = _inputs(0, 3, 4, 5)
    G, z0, Q, P, eta = ins.values()
    op = la.looped_linear_attention
    with pytest.raises(ConfigError, match="^backend"):
        op(G, z0, Q, P, eta, backend="cuda")
    with pytest.raises(KernelInputError, match=r"^looped_linear_attention: G has shape \[4, 4\]; must be a 3-D tensor"):
        op(G[0], z0, Q, P, eta)
    with pytest.raises(KernelInputError, match=r"^looped_linear_attention: G has shape \[3, 4, 5\]; must be a 3-D"):
        op(torch.zeros(3, 4, 5, dtype=G.dtype), z0, Q, P, eta)
    with pytest.raises(KernelInputError, match=r"^looped_linear_attention: G has shape \[0, 4, 4\]"):
        op(G[:0], z0[:0], Q, P, eta)
    with pytest.raises(KernelInputError, match=r"^looped_linear_attention: z0 has shape \[2, 4\]; must be a tensor "
                                               r"\[3, 4\] \(G is \[3, 4, 4\]\)"):
        op(G, z0[:2], Q, P, eta)
    with pytest.raises(KernelInputError, match=r"^looped_linear_attention: Q has shape \[4, 3\]; must be a tensor "
                                               r"\[4, 4\]"):
        op(G, z0, Q[:, :3], P, eta)
    with pytest.raises(KernelInputError, match=r"^looped_linear_attention: P has shape \[4\]"):
        op(G, z0, Q, P[0], eta)
    for bad in (eta[:0], eta.reshape(5, 1), eta[0]):
        with pytest.raises(KernelInputError, match=r"^looped_linear_attention: eta has shape .*; must be a 1-D tensor "
                                                   r"\[T\] of step sizes with T >= 1"):
            op(G, z0, Q, P, bad)
    with pytest.raises(KernelInputError, match=r"^looped_linear_attention: eta is on meta; must be on G's device cpu"):
        op(G, z0, Q, P, eta.to("meta"))
    D = la.MAX_DIM + 1
    with pytest.raises(KernelInputError, match=rf"^looped_linear_attention: G has shape \[1, {D}, {D}\]; must have "
                                               rf"D <= {la.MAX_DIM} on the Triton backend"):
        op(torch.zeros(1, D, D), torch.zeros(1, D), torch.zeros(D, D), torch.zeros(D, D), torch.ones(2),
           backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dtype_policy_refuses_before_any_work(refused_before_work, backend):
    ins, _ = _inputs(0, 3, 4, 5)
    for field in ("G", "z0", "eta"):
        for dtype in (torch.float16, torch.bfloat16, torch.int64):
            args = {k: v.to(dtype) if k == field else v for k, v in ins.items()}
            error = refused_before_work(la.LoopedLinearAttentionFunction,
                                        lambda: la.looped_linear_attention(*args.values(), backend=backend))
            assert str(error).startswith(f"looped_linear_attention: {field} has dtype ") and error.field == field
    mixed = {**ins, "Q": ins["Q"].float()}  # float64 prompts, float32 weights
    error = refused_before_work(la.LoopedLinearAttentionFunction,
                                lambda: la.looped_linear_attention(*mixed.values(), backend=backend))
    assert str(error).startswith("looped_linear_attention: Q has dtype torch.float32 but G has torch.float64")
