"""Fused batch-norm cosine loss (Wen & Li 2022, eq. 3.3) against the float64 reference, Triton through
the interpreter; the loss identities (the two forms of the loss, Lemma B.8a's sum_j <grad_wj L, w_j> = 0)."""
import math

import pytest
import torch

import importlib

K = importlib.import_module("featlearn.kernels.bn_cosine_loss")  # the package re-exports a function of this name
from featlearn.errors import ConfigError
from featlearn.kernels.backend import KernelInputError
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


# every (backend, out_norm, dtype, eps)
CASES = [(b, o, dt, e) for b in ("torch", "triton") for o in ("bn", "l2")
         for dt in (torch.float64, torch.float32) for e in (0.0, 0.25)]
# relative to the loss / gradient scale: fp64 sees ~1e-15, so 1e-12 catches any float32 step (~1e-7);
# fp32 sees ~3e-7 and gets 2e-5 for the loss, 2e-4 for the gradient (column sums of N terms)
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}
GRAD_TOL = {torch.float64: 1e-12, torch.float32: 2e-4}


@pytest.mark.parametrize("backend, out_norm, dtype, eps", CASES, ids=str)
def test_forward_backward_vs_reference(backend, out_norm, dtype, eps, poisoned):
    tol, gtol = TOL[dtype], GRAD_TOL[dtype]
    for n, m in SHAPES:
        p, z = _pair(n, m, dtype)
        pr = p.double().clone().requires_grad_()  # (clone: .double() of a float64 p is p itself)
        zr = z.double().clone().requires_grad_()
        ref = bn_cosine_loss_reference(pr, zr, out_norm, eps)
        gp_ref, gz_ref = torch.autograd.grad(ref, (pr, zr))
        ref = float(ref.detach())
        # stop-grad (default): z gets no gradient
        pk = p.clone().requires_grad_()
        loss = bn_cosine_loss(pk, z, out_norm=out_norm, eps=eps, backend=backend)
        (gp,) = torch.autograd.grad(loss, (pk,))
        assert loss.dtype == dtype and torch.isfinite(gp).all()
        # a degenerate case (N = 2 for bn, m = 1 for l2) has an exactly zero gradient: measure against the
        # natural size 1 / (N m sd) of a loss gradient instead
        floor = 1.0 / (n * m * float(p.double().std()))
        scale = gp_ref.abs().max().clamp_min(floor)
        assert abs(float(loss.detach()) - ref) <= tol * max(1.0, abs(ref)), (n, m)
        assert (gp.double() - gp_ref).abs().max() <= gtol * scale, (n, m)
        # no-stop-grad ablation: both gradients
        pk2, zk2 = p.clone().requires_grad_(), z.clone().requires_grad_()
        gp2, gz2 = torch.autograd.grad(bn_cosine_loss(pk2, zk2, out_norm=out_norm, eps=eps, backend=backend),
                                       (pk2, zk2))
        assert gz2.dtype == dtype and torch.isfinite(gz2).all()
        assert (gp2.double() - gp_ref).abs().max() <= gtol * scale
        assert (gz2.double() - gz_ref).abs().max() <= gtol * gz_ref.abs().max().clamp_min(floor)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("out_norm", ["bn", "l2"])
def test_grad_output_scales_both_gradients(backend, out_norm, poisoned):
    # grad_output is folded in on the device (in the kernels for Triton): a weight on the loss, e.g. DDP's
    # world-size factor, must scale dp and dz exactly
    p, z = _pair(23, 5, torch.float64)
    pr, zr = p.clone().requires_grad_(), z.clone().requires_grad_()
    gp_ref, gz_ref = torch.autograd.grad(-2.5 * bn_cosine_loss_reference(pr, zr, out_norm, 0.1), (pr, zr))
    pk, zk = p.clone().requires_grad_(), z.clone().requires_grad_()
    gp, gz = torch.autograd.grad(-2.5 * bn_cosine_loss(pk, zk, out_norm=out_norm, eps=0.1, backend=backend), (pk, zk))
    torch.testing.assert_close(gp, gp_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gz, gz_ref, rtol=1e-12, atol=1e-14)


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
    euler = float((gw * w.detach()).sum())
    assert abs(euler) <= 1e-10 * float(gw.norm() * w.detach().norm())
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
    with pytest.raises(KernelInputError, match=r"^bn_cosine_loss: z has shape \[8, 1\]; must have the shape of p"):
        bn_cosine_loss(p, z[:, :1])
    with pytest.raises(KernelInputError, match=r"^bn_cosine_loss: p has shape \[2\]; must be a 2-D tensor"):
        bn_cosine_loss(p[0], z[0])
    with pytest.raises(ConfigError, match="backend"):
        bn_cosine_loss(p, z, backend="cuda")
    with pytest.raises(ConfigError, match="sync"):
        bn_cosine_loss(p, z, sync=True)


SUPPORTED = "supported: torch.float32, torch.float64 (all inputs the same dtype)"


def _refusals():
    p, z = _pair(7, 3, torch.float32)
    yield "p", dict(p=p.half(), z=z.half()), f"has dtype torch.float16; {SUPPORTED}"
    yield "p", dict(p=p.bfloat16(), z=z.bfloat16()), f"has dtype torch.bfloat16; {SUPPORTED}"
    yield "z", dict(p=p, z=z.half()), f"has dtype torch.float16; {SUPPORTED}"
    yield "z", dict(p=p, z=z.double()), f"has dtype torch.float64 but p has torch.float32; {SUPPORTED}"
    yield "z", dict(p=p.double(), z=z), f"has dtype torch.float32 but p has torch.float64; {SUPPORTED}"
    yield "p", dict(p=p[:0], z=z[:0], out_norm="l2"), "has 0 rows; out_norm='l2' needs N >= 1 row"
    yield "p", dict(p=p[:1], z=z[:1]), "has 1 row; out_norm='bn' needs N >= 2 rows (batch statistics)"
    yield "p", dict(p=p[:0].double(), z=z[:0].double()), "has 0 rows; out_norm='bn' needs N >= 2 rows (batch statistics)"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("field,kwargs,message", list(_refusals()), ids=lambda v: v.split(";")[0] if isinstance(v, str) else "")
def test_refuses_bad_dtype_and_batch_size_before_any_work(refused_before_work, backend, field, kwargs, message):
    kwargs = dict(kwargs)
    p, z = kwargs.pop("p"), kwargs.pop("z")
    error = refused_before_work(K.BNCosineLossFunction,
                                lambda: bn_cosine_loss(p.requires_grad_(), z, backend=backend, **kwargs))
    assert str(error) == f"bn_cosine_loss: {field} {message}"
    assert error.field == field and isinstance(error, ConfigError)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_smallest_batches_are_accepted(backend):
    p, z = _pair(1, 4, torch.float64)
    loss = bn_cosine_loss(p, z, out_norm="l2", backend=backend)  # l2: one row is a batch
    assert abs(float(loss) - float(bn_cosine_loss_reference(p, z, "l2"))) < 1e-14
    p, z = _pair(2, 4, torch.float32)
    assert torch.isfinite(bn_cosine_loss(p, z, backend=backend))  # bn: two rows give batch statistics


def test_column_stats_follow_the_dtype_policy():
    p, z = _pair(9, 2, torch.float32)
    with pytest.raises(KernelInputError, match=r"^bn_column_stats: p has dtype torch.float16; supported"):
        bn_column_stats(p.half(), z.half(), backend="torch")
    with pytest.raises(KernelInputError, match=r"^bn_column_stats: z has dtype torch.float64 but p has"):
        bn_column_stats(p, z.double(), backend="torch")


@pytest.mark.parametrize("out_norm", ["bn", "l2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_traced_loss_equals_the_function(out_norm, dtype, monkeypatch):
    """Under ``torch.compile`` (a module's compiled loss) the loss is differentiable PyTorch, not the
    autograd.Function (whose dynamo trace gave zero gradients on torch 2.11 CUDA): same loss, same gradients
    of p and of a z that wants one, and the Function is never applied there."""
    p0, z0 = _pair(37, 5, dtype, offset=3.0)
    eager = []
    for compiled in (False, True):
        p, z = p0.clone().requires_grad_(True), z0.clone().requires_grad_(True)
        if compiled:
            def refuse(*args):  # dynamo traces forward's code (not apply's), so forward is what refuses
                raise AssertionError("the autograd.Function was traced")
            monkeypatch.setattr(K.BNCosineLossFunction, "forward", staticmethod(refuse))
            torch._dynamo.reset()
        loss_fn = torch.compile(bn_cosine_loss, backend="eager", fullgraph=True) if compiled else bn_cosine_loss
        loss = loss_fn(p, z, out_norm=out_norm, eps=0.25, backend="torch")
        got = (loss.detach(), *torch.autograd.grad(loss, (p, z)))
        if not compiled:
            eager = got
    assert got[0].dtype == dtype
    for name, a, b in zip(("loss", "grad p", "grad z"), got, eager):
        err = float((a - b).double().norm() / b.double().norm())
        assert err <= (TOL if name == "loss" else GRAD_TOL)[dtype], f"{name}: relative error {err:.1e}"
