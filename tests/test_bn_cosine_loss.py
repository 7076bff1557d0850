"""Fused batch-norm cosine loss (spec 004 section 7.3 K3) against the float64 reference, Triton through
the interpreter; the loss identities of spec 5.5 (tests 1, 2, 5)."""
import math

import pytest
import torch

import importlib

K = importlib.import_module("featlearn.kernels.bn_cosine_loss")  # the package re-exports a function of this name
from featlearn.errors import ConfigError
from featlearn.kernels.activations import Activation
from featlearn.kernels.bn_cosine_loss import bn_column_stats, bn_cosine_loss, bn_cosine_loss_reference
from featlearn.lightning_modules.noncontrastive import encode, noncontrastive_loss

GEN = torch.Generator().manual_seed(1234)
# fresh odd shapes (fixed seed): N not a multiple of the interpreter tiles (8 x 2), m not of 4
SHAPES = [(2, 1), (7, 3), (37, 5), (53, 2), (19, 9)]


def _pair(n, m, dtype, corr=0.6, offset=0.0):
    p = torch.randn(n, m, generator=GEN, dtype=torch.float64) * 2 + offset
    z = corr * p + torch.randn(n, m, generator=GEN, dtype=torch.float64) - 0.5
    return p.to(dtype), z.to(dtype)


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the loss allocates starts as NaN: unwritten outputs / partials would show."""
    real_empty, real_like = torch.empty, torch.empty_like

    def empty(*a, **k):
        t = real_empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty_like(t, *a, **k):
        out = real_like(t, *a, **k)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(K.torch, "empty", empty)
    monkeypatch.setattr(K.torch, "empty_like", empty_like)


# every (out_norm, dtype, eps) on the fallback; the interpreter (slow) gets both norms in fp64/eps 0 and
# fp32/eps 0.25
CASES = [("torch", o, dt, e) for o in ("bn", "l2") for dt in (torch.float64, torch.float32) for e in (0.0, 0.25)]
CASES += [("triton", o, dt, e) for o in ("bn", "l2") for dt, e in ((torch.float64, 0.0), (torch.float32, 0.25))]


@pytest.mark.parametrize("backend, out_norm, dtype, eps", CASES)
def test_forward_backward_vs_reference(backend, out_norm, dtype, eps, poisoned):
    tol = 1e-11 if dtype == torch.float64 else 2e-5
    shapes = SHAPES if backend == "torch" else SHAPES[1:4]  # the interpreter is slow: 3 odd shapes
    for n, m in shapes:
        p, z = _pair(n, m, dtype)
        pr = p.double().requires_grad_()
        zr = z.double().requires_grad_()
        ref = bn_cosine_loss_reference(pr, zr, out_norm, eps)
        gp_ref, gz_ref = torch.autograd.grad(ref, (pr, zr))
        # stop-grad (default): z gets no gradient
        pk = p.clone().requires_grad_()
        loss = bn_cosine_loss(pk, z, out_norm=out_norm, eps=eps, backend=backend)
        (gp,) = torch.autograd.grad(loss, (pk,))
        assert loss.dtype == dtype and torch.isfinite(gp).all()
        scale = gp_ref.abs().max().clamp_min(1e-3)  # l2 with m = 1 has an exactly zero gradient
        assert abs(float(loss.detach()) - float(ref)) <= tol * max(1.0, abs(float(ref))), (n, m)
        assert (gp.double() - gp_ref).abs().max() <= tol * 10 * scale, (n, m)
        # no-stop-grad ablation: both gradients
        pk2, zk2 = p.clone().requires_grad_(), z.clone().requires_grad_()
        gp2, gz2 = torch.autograd.grad(bn_cosine_loss(pk2, zk2, out_norm=out_norm, eps=eps, backend=backend),
                                       (pk2, zk2))
        assert (gp2.double() - gp_ref).abs().max() <= tol * 10 * scale
        assert (gz2.double() - gz_ref).abs().max() <= tol * 10 * gz_ref.abs().max().clamp_min(1e-3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_large_offset_is_cancellation_free(backend):
    # mean 1e4, spread 1: E[F^2] - mu^2 in float32 would lose every digit; Chan merging must not
    p, z = _pair(203, 3, torch.float64, offset=1e4)
    ref = bn_cosine_loss_reference(p, z)
    loss = bn_cosine_loss(p.float(), z.float(), backend=backend)
    assert abs(float(loss.detach()) - float(ref)) < 1e-3


def test_loss_identity_mse_equals_two_minus_mean_rho():
    p, z = _pair(41, 4, torch.float64)
    rho = bn_column_stats(p, z, backend="torch")["rho"]
    mse = bn_cosine_loss_reference(p, z)
    assert float(mse) == pytest.approx(float(2 - 2 / 4 * rho.sum()), rel=1e-12)
    assert torch.allclose(rho, torch.stack([torch.corrcoef(torch.stack([p[:, j], z[:, j]]))[0, 1]
                                            for j in range(4)]), atol=1e-12)
    rho_t = bn_column_stats(p, z, backend="triton")["rho"]
    assert torch.allclose(rho, rho_t, atol=1e-13)


@pytest.mark.parametrize("loss_backend", ["torch", "triton"])
def test_euler_identity_grad_dot_w_is_zero(loss_backend):
    """sum_j <grad_{w_j} L, w_j> = 0 for any batch and any head (L is 0-homogeneous in W, target fixed)."""
    n, patches, d, m = 29, 6, 7, 3
    x = torch.randn(n, patches, d, generator=GEN, dtype=torch.float64)
    view = torch.rand(n, patches, generator=GEN) < 0.5
    w = torch.randn(m, d, generator=GEN, dtype=torch.float64).requires_grad_()
    e = torch.eye(m, dtype=torch.float64) + 0.3 * torch.randn(m, m, generator=GEN, dtype=torch.float64)
    f = encode(x, w, view.double(), backend="torch")
    with torch.no_grad():
        g = encode(x, w.detach(), (~view).double(), backend="torch")
    loss = noncontrastive_loss(f, g, e, backend=loss_backend)
    (gw,) = torch.autograd.grad(loss, (w,))
    euler = float((gw * w).sum())
    assert abs(euler) <= 1e-10 * float(gw.norm() * w.norm())
    assert float(gw.norm()) > 1e-6  # the identity is not trivially 0 = 0


def test_encoder_kernel_vs_float64_reference():
    """The cubic patch encoder through the shared kernel (Triton interpreter) vs a float64 einsum."""
    n, patches, d, m = 11, 5, 9, 3
    x = torch.randn(n, patches, d, generator=GEN, dtype=torch.float64)
    mask = (torch.rand(n, patches, generator=GEN) < 0.5).double()
    w = torch.randn(m, d, generator=GEN, dtype=torch.float64)
    coef = torch.randn(n, m, generator=GEN, dtype=torch.float64)
    wr = w.clone().requires_grad_()
    ref = (torch.einsum("bpd,rd->bpr", x, wr) ** 3 * mask[..., None]).sum(1)
    (gref,) = torch.autograd.grad((ref * coef).sum(), (wr,))
    for backend, dtype, tol in (("triton", torch.float64, 1e-10), ("triton", torch.float32, 2e-4),
                                ("torch", torch.float32, 2e-4)):
        wk = w.to(dtype).requires_grad_()
        out = encode(x.to(dtype), wk, mask.to(dtype), backend=backend)
        (gk,) = torch.autograd.grad((out * coef.to(dtype)).sum(), (wk,))
        assert (out.double() - ref.detach()).abs().max() <= tol * ref.abs().max()
        assert (gk.double() - gref).abs().max() <= tol * gref.abs().max()
    assert Activation("pow", q=3)(torch.tensor(-2.0)) == -8.0


def test_config_errors():
    p, z = _pair(8, 2, torch.float64)
    with pytest.raises(ConfigError, match="out_norm"):
        bn_cosine_loss(p, z, out_norm="batch")
    with pytest.raises(ConfigError, match="eps"):
        bn_cosine_loss(p, z, eps=-1.0)
    with pytest.raises(ConfigError, match="eps"):
        bn_cosine_loss(p, z, eps=math.nan)
    with pytest.raises(ConfigError, match="^z"):
        bn_cosine_loss(p, z[:, :1])
    with pytest.raises(ConfigError, match="^p"):
        bn_cosine_loss(p[0], z[0])
    with pytest.raises(ConfigError, match="^p"):
        bn_cosine_loss(p[:1], z[:1], backend="torch")
    with pytest.raises(ConfigError, match="backend"):
        bn_cosine_loss(p, z, backend="cuda")
    with pytest.raises(ConfigError, match="sync"):
        bn_cosine_loss(p, z, sync=True)
