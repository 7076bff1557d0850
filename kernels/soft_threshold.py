"""Fused soft-threshold layer ``h = ReLU(x W^T - b) - ReLU(-x W^T - b)`` (forward and backward).

The symmetrized-ReLU unit of Wen & Li (2021), spec 001 section 3.1. For ``b >= 0`` it is the
soft-threshold ``sign(u) * max(|u| - b, 0)`` with ``u = <w_i, x>``; for ``b < 0`` (learned-bias ablation)
the literal two-ReLU formula is used, which has slope 2 on ``|u| < -b``. Derivatives (all ``b``)::

    dh/du = 1{u > b} + 1{u < -b}          dh/db = 1{u < -b} - 1{u > b}

Layout (Liger-Kernel style):

* ``soft_threshold_reference(x, w, bias)``: plain autograd expression (use in float64 as the oracle).
* ``SoftThresholdTorch``: PyTorch fallback ``autograd.Function``; saves x, W and a uint8 code
  ``1{u>b} + 2*1{u<-b}`` (not ``u``), exactly like the Triton path.
* ``SoftThresholdTriton``: ``autograd.Function`` around three Triton kernels: a GEMM with a
  soft-threshold epilogue (writes ``h`` and the uint8 code), a GEMM ``grad_x = (g*slope) W`` whose
  prologue rebuilds ``grad_u`` from the code, and a GEMM ``grad_W = (g*slope)^T x`` that also reduces
  ``grad_b`` in the programs of the first column tile. ``u`` is never written to memory.
* ``soft_threshold_layer(x, w, bias, backend="auto")``: the functional API.

Dtypes follow the shared policy of ``featlearn.kernels.backend``: x, W and b all float32 or all float64,
anything else refused up front. Both backends compute in the input dtype; the Triton GEMMs accumulate in
it too, so float64 runs agree with the float64 reference to rounding (~1e-16 relative).

Example:
    >>> import torch
    >>> from featlearn.kernels.soft_threshold import soft_threshold_layer
    >>> x, w = torch.randn(8, 32), torch.randn(16, 32, requires_grad=True)
    >>> h = soft_threshold_layer(x, w, torch.full((16,), 0.5), backend="torch")
    >>> h.shape
    torch.Size([8, 16])
"""
from __future__ import annotations

import torch

from featlearn.errors import ConfigError
from featlearn.kernels.backend import check_backend, check_float_inputs, resolve_backend

import triton
import triton.language as tl

__all__ = [
    "soft_threshold_layer",
    "soft_threshold_reference",
    "symmetric_relu",
    "SoftThresholdTorch",
    "SoftThresholdTriton",
]


# ----------------------------------------------------------------------------------------------
# reference and elementwise helpers
# ----------------------------------------------------------------------------------------------
def symmetric_relu(u: torch.Tensor, bias: torch.Tensor | float) -> torch.Tensor:
    """Elementwise ``ReLU(u - b) - ReLU(-u - b)`` (broadcast ``b`` over the last dim)."""
    return torch.relu(u - bias) - torch.relu(-u - bias)


def soft_threshold_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain autograd reference: ``symmetric_relu(x @ w.T, bias)``. Run it in float64 for tests."""
    u = x @ w.t()
    if bias is None:
        return u
    return symmetric_relu(u, bias)


def _code(u: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (u > b).to(torch.uint8) + 2 * (u < -b).to(torch.uint8)


def _slope_and_dbias(code: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pos = (code & 1).to(dtype)
    neg = (code >> 1).to(dtype)
    return pos + neg, neg - pos


# ----------------------------------------------------------------------------------------------
# PyTorch fallback
# ----------------------------------------------------------------------------------------------
class SoftThresholdTorch(torch.autograd.Function):
    """PyTorch fallback with the same saved state as the Triton path (x, W, uint8 code)."""

    @staticmethod
    def forward(ctx, x, w, bias):
        u = x @ w.t()
        h = symmetric_relu(u, bias)
        ctx.save_for_backward(x, w, _code(u, bias))
        return h

    @staticmethod
    def backward(ctx, grad_h):
        x, w, code = ctx.saved_tensors
        slope, dbf = _slope_and_dbias(code, grad_h.dtype)
        gu = grad_h * slope
        gx = gu @ w if ctx.needs_input_grad[0] else None
        gw = gu.t() @ x if ctx.needs_input_grad[1] else None
        gb = (grad_h * dbf).sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _st_fwd_kernel(x_ptr, w_ptr, b_ptr, h_ptr, code_ptr, B, M, D,
                   BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, ACC: tl.constexpr):
    # u[B, M] = x[B, D] @ w[M, D]^T with the soft-threshold epilogue
    pid_b = tl.program_id(0)
    pid_m = tl.program_id(1)
    rb = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_B, BLOCK_M), dtype=ACC)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + rk
        xt = tl.load(x_ptr + rb[:, None] * D + kk[None, :],
                     mask=(rb[:, None] < B) & (kk[None, :] < D), other=0.0)
        wt = tl.load(w_ptr + rm[None, :] * D + kk[:, None],
                     mask=(rm[None, :] < M) & (kk[:, None] < D), other=0.0)
        acc = tl.dot(xt.to(ACC), wt.to(ACC), acc, input_precision=PRECISION)
    b = tl.load(b_ptr + rm, mask=rm < M, other=0.0).to(ACC)
    bb = b[None, :]
    h = tl.maximum(acc - bb, 0.0) - tl.maximum(-acc - bb, 0.0)
    code = (acc > bb).to(tl.uint8) + 2 * (acc < -bb).to(tl.uint8)
    omask = (rb[:, None] < B) & (rm[None, :] < M)
    offs = rb[:, None] * M + rm[None, :]
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=omask)
    tl.store(code_ptr + offs, code, mask=omask)

@triton.jit
def _st_bwd_x_kernel(g_ptr, code_ptr, w_ptr, gx_ptr, B, M, D,
                     BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr, ACC: tl.constexpr):
    # grad_x[B, D] = (g * slope)[B, M] @ w[M, D]; slope rebuilt from the code in the prologue
    pid_b = tl.program_id(0)
    pid_d = tl.program_id(1)
    rb = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    rd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=ACC)
    for k0 in range(0, M, BLOCK_K):
        kk = k0 + rk
        gmask = (rb[:, None] < B) & (kk[None, :] < M)
        g = tl.load(g_ptr + rb[:, None] * M + kk[None, :], mask=gmask, other=0.0).to(ACC)
        c = tl.load(code_ptr + rb[:, None] * M + kk[None, :], mask=gmask, other=0)
        slope = ((c & 1) + (c >> 1)).to(ACC)
        wt = tl.load(w_ptr + kk[:, None] * D + rd[None, :],
                     mask=(kk[:, None] < M) & (rd[None, :] < D), other=0.0)
        acc = tl.dot(g * slope, wt.to(ACC), acc, input_precision=PRECISION)
    omask = (rb[:, None] < B) & (rd[None, :] < D)
    tl.store(gx_ptr + rb[:, None] * D + rd[None, :], acc.to(gx_ptr.dtype.element_ty), mask=omask)

@triton.jit
def _st_bwd_w_kernel(g_ptr, code_ptr, x_ptr, gw_ptr, gb_ptr, B, M, D,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                     NEED_W: tl.constexpr, NEED_B: tl.constexpr, PRECISION: tl.constexpr,
                     ACC: tl.constexpr):
    # grad_w[M, D] = (g * slope)^T[M, B] @ x[B, D]; grad_b[M] = sum_B g * dbias (first D tile only)
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=ACC)
    gb = tl.zeros((BLOCK_M,), dtype=ACC)
    for k0 in range(0, B, BLOCK_K):
        kk = k0 + rk
        gmask = (rm[:, None] < M) & (kk[None, :] < B)
        # transposed loads: tile [BLOCK_M, BLOCK_K] of g^T
        g = tl.load(g_ptr + kk[None, :] * M + rm[:, None], mask=gmask, other=0.0).to(ACC)
        c = tl.load(code_ptr + kk[None, :] * M + rm[:, None], mask=gmask, other=0)
        pos = (c & 1).to(ACC)
        neg = (c >> 1).to(ACC)
        if NEED_W:
            xt = tl.load(x_ptr + kk[:, None] * D + rd[None, :],
                         mask=(kk[:, None] < B) & (rd[None, :] < D), other=0.0)
            acc = tl.dot(g * (pos + neg), xt.to(ACC), acc, input_precision=PRECISION)
        if NEED_B:  # cheap; only the pid_d == 0 programs store it
            gb += tl.sum(g * (neg - pos), axis=1)
    if NEED_W:
        omask = (rm[:, None] < M) & (rd[None, :] < D)
        tl.store(gw_ptr + rm[:, None] * D + rd[None, :], acc.to(gw_ptr.dtype.element_ty), mask=omask)
    if NEED_B:
        limit = M * (pid_d == 0).to(tl.int32)  # only the first column tile writes grad_b
        tl.store(gb_ptr + rm, gb.to(gb_ptr.dtype.element_ty), mask=rm < limit)


def _empty(shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Output allocation (tests replace this to poison outputs and catch unwritten elements)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype if dtype is None else dtype)


def _acc_dtype(x: torch.Tensor):
    # the accumulator follows the inputs: a fp32 accumulator would cap fp64 runs at ~1e-7 relative
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def _blocks(interpret: bool) -> tuple[int, int, int]:
    # small tiles keep the interpreter fast and exercise the masks on odd shapes
    return (16, 16, 16) if interpret else (64, 64, 32)


class SoftThresholdTriton(torch.autograd.Function):
    """Triton path in the inputs' dtype: fp32 inputs accumulate in fp32 (``allow_tf32`` selects TF32
    tensor-core GEMMs, default IEEE), fp64 inputs in fp64 with IEEE GEMMs (``allow_tf32`` is ignored:
    there is no fp64 TF32)."""

    @staticmethod
    def forward(ctx, x, w, bias, allow_tf32=False):
        from featlearn.kernels.backend import interpreting

        x = x.contiguous()
        w = w.contiguous()
        bias = bias.contiguous()
        B, D = x.shape
        M = w.shape[0]
        h = _empty((B, M), x)
        code = _empty((B, M), x, torch.uint8)
        bb, bm, bk = _blocks(interpreting())
        acc = _acc_dtype(x)
        prec = "tf32" if allow_tf32 and acc == tl.float32 else "ieee"
        grid = (triton.cdiv(B, bb), triton.cdiv(M, bm))
        _st_fwd_kernel[grid](x, w, bias, h, code, B, M, D,
                             BLOCK_B=bb, BLOCK_M=bm, BLOCK_K=bk, PRECISION=prec, ACC=acc)
        ctx.save_for_backward(x, w, code)
        ctx.prec = prec
        return h

    @staticmethod
    def backward(ctx, grad_h):
        from featlearn.kernels.backend import interpreting

        x, w, code = ctx.saved_tensors
        grad_h = grad_h.contiguous()
        B, D = x.shape
        M = w.shape[0]
        bb, bm, bk = _blocks(interpreting())
        acc = _acc_dtype(x)
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        gx = gw = gb = None
        if need_x:
            gx = _empty(tuple(x.shape), x)
            grid = (triton.cdiv(B, bb), triton.cdiv(D, bm))
            _st_bwd_x_kernel[grid](grad_h, code, w, gx, B, M, D,
                                   BLOCK_B=bb, BLOCK_D=bm, BLOCK_K=bk, PRECISION=ctx.prec, ACC=acc)
        if need_w or need_b:
            gw_buf = _empty(tuple(w.shape), w) if need_w else w  # dummy pointer when unused
            gb_buf = _empty((M,), w) if need_b else w
            grid = (triton.cdiv(M, bb), triton.cdiv(D, bm) if need_w else 1)
            _st_bwd_w_kernel[grid](grad_h, code, x, gw_buf, gb_buf, B, M, D,
                                   BLOCK_M=bb, BLOCK_D=bm, BLOCK_K=bk,
                                   NEED_W=bool(need_w), NEED_B=bool(need_b), PRECISION=ctx.prec, ACC=acc)
            gw = gw_buf if need_w else None
            gb = gb_buf if need_b else None
        return gx, gw, gb, None


# ----------------------------------------------------------------------------------------------
# functional API
# ----------------------------------------------------------------------------------------------
def soft_threshold_layer(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                         backend: str = "auto", allow_tf32: bool = False) -> torch.Tensor:
    """Soft-threshold layer ``ReLU(x W^T - b) - ReLU(-x W^T - b)``, differentiable in x, W and b.

    Args:
        x: ``[B, d1]`` inputs. w: ``[m, d1]`` weights. bias: ``[m]`` per-neuron bias (``None`` = 0,
            i.e. the linear map ``x W^T``). All float32 or all float64 (``KernelInputError`` otherwise,
            see ``featlearn.kernels.backend``); computed in that dtype.
        backend: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"torch"`` or ``"triton"``.
        allow_tf32: TF32 GEMMs in the Triton path for float32 inputs (default off: stage-I signals are
            ~1e-2 relative); no effect on float64.

    Returns ``[B, m]`` activations in ``x.dtype``.
    """
    check_backend(backend, "backend")
    check_float_inputs("soft_threshold_layer", x=x, w=w, bias=bias)
    if x.dim() != 2:
        raise ConfigError("x", "a 2-D tensor [B, d1]", tuple(x.shape))
    if w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ConfigError("w", f"a 2-D tensor [m, {x.shape[1]}]", tuple(w.shape))
    if bias is None:
        bias = torch.zeros(w.shape[0], device=w.device, dtype=w.dtype)
    if bias.shape != (w.shape[0],):
        raise ConfigError("bias", f"a 1-D tensor [{w.shape[0]}]", tuple(bias.shape))
    if resolve_backend(backend, x, w, bias) == "triton":
        return SoftThresholdTriton.apply(x, w, bias, allow_tf32)
    return SoftThresholdTorch.apply(x, w, bias)
