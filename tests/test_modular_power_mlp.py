"""modular_power_mlp: both backends (Triton under the interpreter) against a float64 reference on odd shapes,
the logits and both gradients, float32 and float64, with poisoned outputs; refusals before any work."""
import importlib

import pytest
import torch

from featlearn.errors import ConfigError
from featlearn.kernels.backend import KernelInputError

mp = importlib.import_module("featlearn.kernels.modular_power_mlp")

# (B, k, V, m, C, power): odd sizes straddling the 16-wide interpreter tiles, a power below k, k = 1
SHAPES = [(37, 3, 7, 45, 7, 3), (5, 2, 11, 17, 11, 2), (20, 4, 5, 33, 5, 4), (9, 1, 3, 16, 3, 1),
          (18, 3, 13, 19, 13, 2)]
# the logits sum m products of q-fold products of k-term sums: rounding ~ sqrt(m) q eps of the scale
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}


def _inputs(seed, shape):
    B, k, V, m, C, _ = shape
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, V, (B, k), generator=g)
    U = torch.randn(k, V, m, generator=g, dtype=torch.float64) * 0.6
    W = torch.randn(m, C, generator=g, dtype=torch.float64) * 0.6
    return a, U, W, torch.randn(B, C, generator=g, dtype=torch.float64)


def _rel(out, ref):
    assert torch.isfinite(out).all()
    return (out.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def _compare(backend, dtype, a, U, W, grad, power, need=(True, True)):
    ins = [t.to(dtype).requires_grad_(r) for t, r in zip((U, W), need)]
    ref_in = [t.detach().double().requires_grad_(r) for t, r in zip(ins, need)]
    ref = mp.modular_power_mlp_reference(a, *ref_in, power)
    ref.backward(grad)
    out = mp.modular_power_mlp(a, *ins, power, backend=backend, input_precision="ieee")
    out.backward(grad.to(dtype))
    assert out.dtype == dtype and out.shape == ref.shape
    errs = [_rel(out, ref.detach())]
    for got, want, r in zip(ins, ref_in, need):
        errs.append(_rel(got.grad, want.grad) if r else 0.0)
        assert (got.grad is not None) == r
    return errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed,shape", list(enumerate(SHAPES)))
def test_forward_backward_vs_float64(poisoned, backend, shape, seed, dtype):
    a, U, W, grad = _inputs(seed, shape)
    assert max(_compare(backend, dtype, a, U, W, grad, shape[-1])) < TOL[dtype]


@pytest.mark.parametrize("need", [(True, False), (False, True)])
def test_triton_partial_gradients(poisoned, need):
    a, U, W, grad = _inputs(11, (21, 3, 7, 23, 7, 3))
    assert max(_compare("triton", torch.float64, a, U, W, grad, 3, need)) < TOL[torch.float64]


def test_repeated_tokens_add_up_in_the_embedding_gradient(poisoned):
    # every row the same tuple, and one token repeated across positions: the scatter-adds collide
    a = torch.tensor([[2, 2, 5]] * 19)
    _, U, W, grad = _inputs(3, (19, 3, 7, 20, 7, 3))
    assert max(_compare("triton", torch.float64, a, U, W, grad, 3)) < TOL[torch.float64]


def test_float32_tf32_within_tf32_tolerance(poisoned):
    a, U, W, _ = _inputs(22, SHAPES[0])
    out = mp.modular_power_mlp(a, U.float(), W.float(), 3, backend="triton", input_precision="tf32")
    assert _rel(out, mp.modular_power_mlp_reference(a, U, W, 3)) < 1e-2


def test_bad_inputs_are_refused():
    a, U, W = torch.zeros(4, 3, dtype=torch.long), torch.randn(3, 5, 8), torch.randn(8, 5)
    with pytest.raises(ConfigError, match="^backend"):
        mp.modular_power_mlp(a, U, W, 3, backend="cuda")
    with pytest.raises(KernelInputError, match=r"^modular_power_mlp: a has shape \[4, 2\]; must be a 2-D int32"):
        mp.modular_power_mlp(a[:, :2], U, W, 3)
    for dtype in (torch.float32, torch.int16, torch.uint8, torch.bool):
        with pytest.raises(KernelInputError, match=r"^modular_power_mlp: a has shape \[4, 3\]; must be a 2-D int32"):
            mp.modular_power_mlp(a.to(dtype), U, W, 3)
    with pytest.raises(KernelInputError, match=r"^modular_power_mlp: a is on meta; must be on U's device cpu"):
        mp.modular_power_mlp(a.to("meta"), U, W, 3)
    with pytest.raises(KernelInputError, match=r"^modular_power_mlp: W has shape \[7, 5\]; must be a 2-D tensor \[8, C\]"):
        mp.modular_power_mlp(a, U, torch.randn(7, 5), 3)
    with pytest.raises(KernelInputError, match=r"^modular_power_mlp: W has shape \[8, 300\]"):
        mp.modular_power_mlp(a, U, torch.randn(8, 300), 3)
    with pytest.raises(KernelInputError, match=r"^modular_power_mlp: U has shape \[5, 8\]; must be a 3-D"):
        mp.modular_power_mlp(a, U[0], W, 3)
    for power in (0, 2.0, True):
        with pytest.raises(ConfigError, match="^power:"):
            mp.modular_power_mlp(a, U, W, power)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dtype_policy_refuses_before_any_work(refused_before_work, backend):
    a, U, W = torch.zeros(4, 3, dtype=torch.long), torch.randn(3, 5, 8), torch.randn(8, 5)
    for args, field in (((U.half(), W.half()), "U"), ((U, W.double()), "W")):
        error = refused_before_work(mp.ModularPowerMLPFunction,
                                    lambda: mp.modular_power_mlp(a, *args, 3, backend=backend))
        assert str(error).startswith(f"modular_power_mlp: {field} ") and error.field == field
