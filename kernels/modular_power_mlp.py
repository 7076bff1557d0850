"""Fused forward and backward of the k-input modular-addition MLP (Li, Liang, Shi, Song, Zhou 2024, Eq. 4.2)::

    S[b, i]      = sum_j U[j, a[b, j], i]            (k gathers of embedding rows, summed)
    logits[b, c] = sum_i S[b, i]^q W[i, c]            (a power, then a GEMM)

with ``a`` ``[B, k]`` integer tokens in ``[0, V)``, embeddings ``U`` ``[k, V, m]``, output weights ``W``
``[m, C]`` and the power ``q`` (the chapter's network has ``q = k``). The backward::

    dW = (S^q)^T G,   dS = q S^(q-1) (G W^T),   dU[j, a[b, j], :] += dS[b, :]   (a scatter-add per input)

Backends (``backend="auto"`` picks Triton for CUDA tensors), both saving ``a``, ``U`` and ``W`` only (``S`` is
recomputed: k gathers are cheaper than a stored ``[B, m]``):

* ``triton``: the forward is one kernel per row block: it gathers and sums the k embedding rows of a
  ``[BLOCK_B, BLOCK_M]`` slab, raises it to the power in registers and accumulates ``S^q W`` over the slabs,
  so neither ``S`` nor ``S^q`` touches memory. The backward is two kernels: ``bwd_u`` recomputes the slab,
  forms ``dS`` from ``G W^T`` and adds it into the k embedding rows with atomics (so ``dU``'s sums run in no
  fixed order: float rounding differs run to run), and ``bwd_w`` reduces ``(S^q)^T G`` over the batch per
  ``m`` tile (a fixed order). All class axes are one tile of ``next_pow2(C)`` columns (C <= 256).
* ``torch``: the same algebra with ``index_select``, ``pow``, ``mm`` and ``index_add_``.

Cost per step: ``2 B m C`` multiply-adds for the forward GEMM, ``4 B m C`` for the backward, ``(k + q) B m``
elementwise; memory beyond the weights and their gradients: ``B C`` logits (the torch path holds ``[B, m]``
temporaries as well).

Dtypes follow the shared policy of ``featlearn.kernels.backend``: U and W both float32 or both float64; ``a`` is
an integer tensor.

Example:
    >>> import torch
    >>> from featlearn.kernels.modular_power_mlp import modular_power_mlp, modular_power_mlp_reference
    >>> a = torch.tensor([[0, 1, 2], [4, 4, 4]])
    >>> U, W = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)
    >>> out = modular_power_mlp(a, U, W, 3, backend="torch")
    >>> out.shape, bool(torch.allclose(out, modular_power_mlp_reference(a, U, W, 3)))
    (torch.Size([2, 5]), True)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from featlearn.errors import ConfigError
from featlearn.kernels import backend as kb  # kb.new_output: the allocation tests poison
from featlearn.kernels.backend import (KernelInputError, acc_dtype, autotune, check_backend, check_float_inputs,
                                       contiguous, grouped_grid, grouped_tile, refuse_shape, resolve_backend,
                                       resolve_precision, tile_grid, tiles_by_precision)

__all__ = ["modular_power_mlp", "modular_power_mlp_reference", "ModularPowerMLPFunction"]

MAX_CLASSES = 256  # one tile holds every class column

# (BLOCK_B, BLOCK_M, num_warps, num_stages) and, for the grouped backward, (BLOCK_B, BLOCK_M, GROUP_M, ...). The
# class tile is next_pow2(C) wide, so the accumulators are [BLOCK_B, C]. The tiles each kernel may use per
# precision are those its sm_90 builds keep spill-free (and within shared memory) at the chapter's sizes (k, p)
# = (4, 47), (3, 97), (5, 23) under both triton 3.6 (the GPU machines') and 3.9 (`featlearn gpu compile
# --all-configs --op modular_power_mlp`):
# the 128-wide class tile of p = 97 is what spills the larger IEEE and float64 tiles. Not yet timed on a GPU.
_TILES = ((64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 8, 3), (32, 32, 4, 3), (32, 16, 4, 2))
_GROUPED_TILES = ((64, 32, 8, 4, 3), (128, 32, 8, 8, 3), (64, 64, 8, 8, 3), (32, 32, 8, 4, 3), (32, 16, 8, 4, 2))
_INTERPRETER_TILE = (16, 16)
_INTERPRETER_GROUPED_TILE = (16, 16, 2)
_ALL = [t[:2] for t in _TILES]
_FWD_FITS = tiles_by_precision(tf32=_ALL, ieee=[(32, 16)], fp64=[(32, 32), (32, 16)])
_BWD_U_FITS = tiles_by_precision(tf32=[t[:3] for t in _GROUPED_TILES], ieee=[(32, 16, 8)],
                                 fp64=[(64, 64, 8), (32, 32, 8), (32, 16, 8)])
_BWD_W_FITS = tiles_by_precision(tf32=[(64, 32), (64, 64), (32, 16)], ieee=[(128, 32), (64, 64), (32, 32), (32, 16)],
                                 fp64=[(64, 32), (64, 64), (32, 32), (32, 16)])


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _modpow_slab(a_ptr, u_ptr, rb, rm, B, V, M, K: tl.constexpr, ACC: tl.constexpr, BLOCK_B: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    # S[rb, rm] = sum_j U[j, a[rb, j], rm]: k gathered embedding rows, summed in the accumulator dtype
    s = tl.zeros((BLOCK_B, BLOCK_M), dtype=ACC)
    mask = (rb[:, None] < B) & (rm[None, :] < M)
    for j in tl.static_range(K):
        tok = tl.load(a_ptr + rb * K + j, mask=rb < B, other=0).to(tl.int64)
        s += tl.load(u_ptr + (j * V + tok[:, None]) * M + rm[None, :], mask=mask, other=0.0).to(ACC)
    return s


@triton.jit
def _modpow_power(s, Q: tl.constexpr):
    # s^Q by repeated products (Q is small: the number of inputs)
    out = s
    for _ in tl.static_range(Q - 1):
        out = out * s
    return out


@autotune(("BLOCK_B", "BLOCK_M"), _TILES, _INTERPRETER_TILE, fits=_FWD_FITS, key=["V", "M", "C", "K", "Q", "PRECISION"])
@triton.jit
def _modpow_fwd_kernel(a_ptr, u_ptr, w_ptr, out_ptr, B, V, M, C, K: tl.constexpr, Q: tl.constexpr,
                       BLOCK_C: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr, BLOCK_B: tl.constexpr,
                       BLOCK_M: tl.constexpr):
    # logits[rb, :] = sum over m slabs of S^Q [BLOCK_B, BLOCK_M] @ W [BLOCK_M, C]
    rb = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    rc = tl.arange(0, BLOCK_C).to(tl.int64)
    acc = tl.zeros((BLOCK_B, BLOCK_C), dtype=ACC)
    for m0 in range(0, M, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
        p = _modpow_power(_modpow_slab(a_ptr, u_ptr, rb, rm, B, V, M, K, ACC, BLOCK_B, BLOCK_M), Q)
        wt = tl.load(w_ptr + rm[:, None] * C + rc[None, :], mask=(rm[:, None] < M) & (rc[None, :] < C), other=0.0)
        acc = tl.dot(p, wt.to(ACC), acc, input_precision=PRECISION, out_dtype=ACC)
    omask = (rb[:, None] < B) & (rc[None, :] < C)
    tl.store(out_ptr + rb[:, None] * C + rc[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@autotune(("BLOCK_B", "BLOCK_M", "GROUP_M"), _GROUPED_TILES, _INTERPRETER_GROUPED_TILE, fits=_BWD_U_FITS,
          key=["V", "M", "C", "K", "Q", "PRECISION"], reset_to_zero=["du_ptr"])
@triton.jit
def _modpow_bwd_u_kernel(a_ptr, u_ptr, w_ptr, g_ptr, du_ptr, B, V, M, C, K: tl.constexpr, Q: tl.constexpr,
                         BLOCK_C: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    # dS = Q S^(Q-1) (G W^T) on one [BLOCK_B, BLOCK_M] tile, added into the k embedding rows it came from
    pid_b, pid_m = grouped_tile(tl.program_id(0), tl.cdiv(B, BLOCK_B), tl.cdiv(M, BLOCK_M), GROUP_M)
    rb = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rc = tl.arange(0, BLOCK_C).to(tl.int64)
    s = _modpow_slab(a_ptr, u_ptr, rb, rm, B, V, M, K, ACC, BLOCK_B, BLOCK_M)
    g = tl.load(g_ptr + rb[:, None] * C + rc[None, :], mask=(rb[:, None] < B) & (rc[None, :] < C), other=0.0)
    wt = tl.load(w_ptr + rm[None, :] * C + rc[:, None], mask=(rm[None, :] < M) & (rc[:, None] < C), other=0.0)
    dp = tl.dot(g.to(ACC), wt.to(ACC), input_precision=PRECISION, out_dtype=ACC)
    ds = Q * _modpow_power(s, Q - 1) * dp if Q > 1 else dp
    mask = (rb[:, None] < B) & (rm[None, :] < M)
    for j in tl.static_range(K):
        tok = tl.load(a_ptr + rb * K + j, mask=rb < B, other=0).to(tl.int64)
        tl.atomic_add(du_ptr + (j * V + tok[:, None]) * M + rm[None, :], ds.to(du_ptr.dtype.element_ty), mask=mask)


@autotune(("BLOCK_B", "BLOCK_M"), _TILES, _INTERPRETER_TILE, fits=_BWD_W_FITS,
          key=["V", "M", "C", "K", "Q", "PRECISION"])
@triton.jit
def _modpow_bwd_w_kernel(a_ptr, u_ptr, g_ptr, dw_ptr, B, V, M, C, K: tl.constexpr, Q: tl.constexpr,
                         BLOCK_C: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    # dW[rm, :] = sum over batch slabs of (S^Q)^T [BLOCK_M, BLOCK_B] @ G [BLOCK_B, C]
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rc = tl.arange(0, BLOCK_C).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=ACC)
    for b0 in range(0, B, BLOCK_B):
        rb = b0 + tl.arange(0, BLOCK_B).to(tl.int64)
        p = _modpow_power(_modpow_slab(a_ptr, u_ptr, rb, rm, B, V, M, K, ACC, BLOCK_B, BLOCK_M), Q)
        g = tl.load(g_ptr + rb[:, None] * C + rc[None, :], mask=(rb[:, None] < B) & (rc[None, :] < C), other=0.0)
        acc = tl.dot(tl.trans(p), g.to(ACC), acc, input_precision=PRECISION, out_dtype=ACC)
    omask = (rm[:, None] < M) & (rc[None, :] < C)
    tl.store(dw_ptr + rm[:, None] * C + rc[None, :], acc.to(dw_ptr.dtype.element_ty), mask=omask)


# ----------------------------------------------------------------------------------------------
# launchers and PyTorch fallback: logits forward, (grad_U, grad_W) backward
# ----------------------------------------------------------------------------------------------
def _class_tile(C: int) -> int:
    return max(16, triton.next_power_of_2(C))  # tl.dot needs 16 at least


def _modpow_fwd_triton(a, U, W, power, precision):
    K, V, M = U.shape
    B, C = a.shape[0], W.shape[1]
    out = kb.new_output((B, C), U)
    _modpow_fwd_kernel[tile_grid((B, "BLOCK_B"))](a, U, W, out, B, V, M, C, K=K, Q=power, BLOCK_C=_class_tile(C),
                                                  PRECISION=precision, ACC=acc_dtype(U))
    return out


def _modpow_bwd_triton(grad, a, U, W, power, need, precision):
    (grad,) = contiguous(grad)
    K, V, M = U.shape
    B, C = a.shape[0], W.shape[1]
    common = dict(K=K, Q=power, BLOCK_C=_class_tile(C), PRECISION=precision, ACC=acc_dtype(U))
    du = dw = None
    if need[0]:
        du = torch.zeros_like(U)  # the kernel adds into it
        _modpow_bwd_u_kernel[grouped_grid((B, "BLOCK_B"), (M, "BLOCK_M"))](a, U, W, grad, du, B, V, M, C, **common)
    if need[1]:
        dw = kb.new_output((M, C), W)
        _modpow_bwd_w_kernel[tile_grid((M, "BLOCK_M"))](a, U, grad, dw, B, V, M, C, **common)
    return du, dw


def _modpow_sums_torch(a, U):
    s = U[0].index_select(0, a[:, 0])
    for j in range(1, U.shape[0]):
        s = s + U[j].index_select(0, a[:, j])
    return s


def _modpow_fwd_torch(a, U, W, power):
    return _modpow_sums_torch(a, U).pow(power) @ W


def _modpow_bwd_torch(grad, a, U, W, power, need):
    s = _modpow_sums_torch(a, U)
    du = dw = None
    if need[0]:
        ds = (grad @ W.t()).mul_(s.pow(power - 1)).mul_(power)
        du = torch.zeros_like(U)
        for j in range(U.shape[0]):
            du[j].index_add_(0, a[:, j], ds)
    if need[1]:
        dw = s.pow(power).t() @ grad
    return du, dw


# ----------------------------------------------------------------------------------------------
# autograd.Function
# ----------------------------------------------------------------------------------------------
class ModularPowerMLPFunction(torch.autograd.Function):
    """``forward(ctx, a, U, W, power, backend, precision) -> logits``; both backends save a, U and W."""

    @staticmethod
    def forward(ctx, a, U, W, power, backend, precision):
        if backend == "triton":
            out = _modpow_fwd_triton(a, U, W, power, precision)
        else:
            out = _modpow_fwd_torch(a, U, W, power)
        ctx.save_for_backward(a, U, W)
        ctx.power, ctx.backend, ctx.precision = power, backend, precision
        return out

    @staticmethod
    @once_differentiable  # the Triton gradients are not differentiable: both backends refuse a double backward
    def backward(ctx, grad):
        a, U, W = ctx.saved_tensors
        need = ctx.needs_input_grad[1:3]
        if ctx.backend == "triton":
            du, dw = _modpow_bwd_triton(grad, a, U, W, ctx.power, need, ctx.precision)
        else:
            du, dw = _modpow_bwd_torch(grad, a, U, W, ctx.power, need)
        return None, du, dw, None, None, None


# ----------------------------------------------------------------------------------------------
# functional API
# ----------------------------------------------------------------------------------------------
def modular_power_mlp(a: torch.Tensor, U: torch.Tensor, W: torch.Tensor, power: int, *, backend: str = "auto",
                      input_precision: str = "auto") -> torch.Tensor:
    """Logits ``(sum_j U[j, a[:, j]])^power @ W`` of the modular-addition MLP, differentiable in U and W.

    Args:
        a: ``[B, k]`` int32 or int64 tokens in ``[0, V)`` on U's device (not checked against ``V``: an
            out-of-range token reads another row; the DataModule makes them in range). U: ``[k, V, m]``
            embeddings. W: ``[m, C]`` output weights, ``C <= 256``. U and W both float32 or both float64.
        power: the integer power ``q >= 1`` (the chapter's network: ``q = k``).
        backend: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"torch"`` or ``"triton"``.
        input_precision: the Triton GEMMs' ``tl.dot`` precision: ``"auto"`` (TF32 for float32, IEEE for
            float64), ``"tf32"`` or ``"ieee"``; the PyTorch fallback ignores it.

    Returns ``[B, C]`` logits in ``U.dtype``.
    """
    check_backend(backend)
    precision = resolve_precision(input_precision, check_float_inputs("modular_power_mlp", U=U, W=W))
    if U.dim() != 3:
        refuse_shape("modular_power_mlp", "U", U, "must be a 3-D tensor [k, V, m]")
    K, V, M = U.shape
    if a.dim() != 2 or a.shape[1] != K or a.dtype not in (torch.int32, torch.int64):
        refuse_shape("modular_power_mlp", "a", a, f"must be a 2-D int32 or int64 tensor [B, {K}]")
    if a.device != U.device:
        raise KernelInputError("modular_power_mlp", "a", f"is on {a.device}", f"must be on U's device {U.device}",
                               str(a.device))
    if W.dim() != 2 or W.shape[0] != M or W.shape[1] > MAX_CLASSES:
        refuse_shape("modular_power_mlp", "W", W, f"must be a 2-D tensor [{M}, C] with C <= {MAX_CLASSES}")
    if isinstance(power, bool) or not isinstance(power, int) or power < 1:
        raise ConfigError("power", "an integer >= 1", power)
    which = resolve_backend(backend, U, W)
    if which == "triton":
        a, U, W = contiguous(a, U, W)
    return ModularPowerMLPFunction.apply(a, U, W, power, which, precision)


# ----------------------------------------------------------------------------------------------
# float64 reference
# ----------------------------------------------------------------------------------------------
def modular_power_mlp_reference(a: torch.Tensor, U: torch.Tensor, W: torch.Tensor, power: int) -> torch.Tensor:
    """Plain autograd reference: ``(sum_j U[j][a[:, j]])^power @ W``. Run it in float64 for tests."""
    s = sum(U[j][a[:, j]] for j in range(U.shape[0]))
    return s ** power @ W
