"""Fused soft-threshold layer ``h = ReLU(x W^T - b) - ReLU(-x W^T - b)`` (forward and backward).

The symmetrized-ReLU unit of Wen & Li 2021, Sec. 2.2. For ``b >= 0`` it is the
soft-threshold ``sign(u) * max(|u| - b, 0)`` with ``u = <w_i, x>``; for ``b < 0`` (learned-bias ablation)
the literal two-ReLU formula is used, which has slope 2 on ``|u| < -b``. Derivatives (all ``b``)::

    dh/du = 1{u > b} + 1{u < -b}          dh/db = 1{u < -b} - 1{u > b}

Backends (``backend="auto"`` picks Triton for CUDA tensors), both saving x, W and a uint8 code
``1{u>b} + 2*1{u<-b}`` instead of ``u``:

* ``triton``: three autotuned GEMM kernels (grouped launch order, ``tl.dot`` in TF32 or IEEE precision):
  ``x W^T`` with a soft-threshold epilogue (writes ``h`` and the code), ``grad_x = (g*slope) W`` whose
  prologue rebuilds ``grad_u`` from the code, and ``grad_W = (g*slope)^T x`` that also reduces ``grad_b``
  in the programs of the first column tile. ``u`` is never written to memory; cost 3 GEMMs of ``B*m*d1``
  multiply-adds (2 when x needs no gradient, as in training), extra memory ``B*m`` bytes.
* ``torch``: the same algebra with PyTorch ops (``u`` exists as a temporary in the forward only).

Dtypes follow the shared policy of ``featlearn.kernels.backend``: x, W and b all float32 or all float64,
anything else refused up front. Both backends compute in the input dtype; the Triton GEMMs accumulate in
it too, so float64 runs agree with the float64 reference to rounding (~1e-16 relative). Float32 products
are TF32 by default in the Triton path (``input_precision="auto"``, ~1e-3 relative); ``"ieee"`` gives
float32 rounding (~1e-7), which contrastive runs want (see ``docs/performance.md``).

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
import triton
import triton.language as tl

from featlearn.errors import ConfigError
from featlearn.kernels import backend as kb  # kb.new_output: the allocation tests poison
from featlearn.kernels.backend import (FMA_TILES, GEMM_TILES, INTERPRETER_GEMM_TILE, MMA_TILES, acc_dtype, autotune,
                                       blocks, check_backend, check_float_inputs, contiguous, grouped_grid,
                                       grouped_tile, refuse_shape, resolve_backend, resolve_precision,
                                       tiles_by_precision)

__all__ = ["soft_threshold_layer", "soft_threshold_reference", "symmetric_relu", "SoftThresholdFunction"]


# The tiles each kernel may use per precision: those its sm_90 builds at the sizes of
# featlearn.gpu.cases keep spill-free
# (`featlearn gpu compile --all-configs`, benchmarks/results/gpu/): every MMA tile with TF32 dots on sizes
# that are multiples of 16, fewer on others (d = 500: 24-1840 bytes of spill on the rest), the FMA tiles
# with IEEE float32 and float64 dots (in the backward not all: 8-16 bytes of spill at d = 500 on the rest).
_SIZES = ("B", "M", "D")
_WIDE_MMA = [(128, 128, 32, 8), (64, 128, 32, 8), (64, 64, 32, 8), (128, 128, 32, 1)]
_FWD_FITS = tiles_by_precision(tf32=blocks(MMA_TILES), ieee=blocks(FMA_TILES), fp64=blocks(FMA_TILES),
                               tf32_unaligned=[(64, 16, 64, 8)], sizes=_SIZES)
_BWD_X_FITS = tiles_by_precision(tf32=blocks(MMA_TILES), ieee=blocks(FMA_TILES),
                                 fp64=[(64, 64, 16, 8), (32, 64, 16, 8), (32, 32, 16, 8)],
                                 tf32_unaligned=[t for t in _WIDE_MMA if t != (64, 128, 32, 8)], sizes=_SIZES)
_BWD_W_FITS = tiles_by_precision(tf32=blocks(MMA_TILES), ieee=blocks(FMA_TILES[:-1]),
                                 fp64=[(64, 64, 16, 8), (64, 16, 16, 8), (32, 32, 16, 8)],
                                 tf32_unaligned=_WIDE_MMA, sizes=_SIZES)

# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@autotune(("BLOCK_B", "BLOCK_M", "BLOCK_K", "GROUP_M"), GEMM_TILES, INTERPRETER_GEMM_TILE, fits=_FWD_FITS,
          key=["M", "D", "PRECISION"])
@triton.jit
def _soft_threshold_fwd_kernel(x_ptr, w_ptr, b_ptr, h_ptr, code_ptr, B, M, D,
                               PRECISION: tl.constexpr, ACC: tl.constexpr, BLOCK_B: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # u[B, M] = x[B, D] @ w[M, D]^T with the soft-threshold epilogue
    pid_b, pid_m = grouped_tile(tl.program_id(0), tl.cdiv(B, BLOCK_B), tl.cdiv(M, BLOCK_M), GROUP_M)
    rb = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_B, BLOCK_M), dtype=ACC)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + rk
        xt = tl.load(x_ptr + rb[:, None] * D + kk[None, :], mask=(rb[:, None] < B) & (kk[None, :] < D), other=0.0)
        wt = tl.load(w_ptr + rm[None, :] * D + kk[:, None], mask=(rm[None, :] < M) & (kk[:, None] < D), other=0.0)
        acc = tl.dot(xt.to(ACC), wt.to(ACC), acc, input_precision=PRECISION, out_dtype=ACC)
    bb = tl.load(b_ptr + rm, mask=rm < M, other=0.0).to(ACC)[None, :]
    h = tl.maximum(acc - bb, 0.0) - tl.maximum(-acc - bb, 0.0)
    code = (acc > bb).to(tl.uint8) + 2 * (acc < -bb).to(tl.uint8)
    omask = (rb[:, None] < B) & (rm[None, :] < M)
    offs = rb[:, None] * M + rm[None, :]
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=omask)
    tl.store(code_ptr + offs, code.to(code_ptr.dtype.element_ty), mask=omask)


@autotune(("BLOCK_B", "BLOCK_D", "BLOCK_K", "GROUP_M"), GEMM_TILES, INTERPRETER_GEMM_TILE, fits=_BWD_X_FITS,
          key=["M", "D", "PRECISION"])
@triton.jit
def _soft_threshold_bwd_x_kernel(g_ptr, code_ptr, w_ptr, gx_ptr, B, M, D,
                                 PRECISION: tl.constexpr, ACC: tl.constexpr, BLOCK_B: tl.constexpr,
                                 BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # grad_x[B, D] = (g * slope)[B, M] @ w[M, D]; slope rebuilt from the code in the prologue
    pid_b, pid_d = grouped_tile(tl.program_id(0), tl.cdiv(B, BLOCK_B), tl.cdiv(D, BLOCK_D), GROUP_M)
    rb = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    rd = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=ACC)
    for k0 in range(0, M, BLOCK_K):
        kk = k0 + rk
        gmask = (rb[:, None] < B) & (kk[None, :] < M)
        g = tl.load(g_ptr + rb[:, None] * M + kk[None, :], mask=gmask, other=0.0).to(ACC)
        c = tl.load(code_ptr + rb[:, None] * M + kk[None, :], mask=gmask, other=0)
        wt = tl.load(w_ptr + kk[:, None] * D + rd[None, :], mask=(kk[:, None] < M) & (rd[None, :] < D), other=0.0)
        acc = tl.dot(g * ((c & 1) + (c >> 1)).to(ACC), wt.to(ACC), acc, input_precision=PRECISION, out_dtype=ACC)
    omask = (rb[:, None] < B) & (rd[None, :] < D)
    tl.store(gx_ptr + rb[:, None] * D + rd[None, :], acc.to(gx_ptr.dtype.element_ty), mask=omask)


@autotune(("BLOCK_M", "BLOCK_D", "BLOCK_K", "GROUP_M"), GEMM_TILES, INTERPRETER_GEMM_TILE, fits=_BWD_W_FITS,
          key=["M", "D", "NEED_W", "NEED_B", "PRECISION"])
@triton.jit
def _soft_threshold_bwd_w_kernel(g_ptr, code_ptr, x_ptr, gw_ptr, gb_ptr, B, M, D,
                                 NEED_W: tl.constexpr, NEED_B: tl.constexpr, PRECISION: tl.constexpr,
                                 ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # grad_w[M, D] = (g * slope)^T[M, B] @ x[B, D]; grad_b[M] = sum_B g * dbias (first D tile only)
    n_d = tl.cdiv(D, BLOCK_D) if NEED_W else 1
    pid_m, pid_d = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), n_d, GROUP_M)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rd = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
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
            xt = tl.load(x_ptr + kk[:, None] * D + rd[None, :], mask=(kk[:, None] < B) & (rd[None, :] < D), other=0.0)
            acc = tl.dot(g * (pos + neg), xt.to(ACC), acc, input_precision=PRECISION, out_dtype=ACC)
        if NEED_B:  # cheap; only the pid_d == 0 programs store it
            gb += tl.sum(g * (neg - pos), axis=1)
    if NEED_W:
        omask = (rm[:, None] < M) & (rd[None, :] < D)
        tl.store(gw_ptr + rm[:, None] * D + rd[None, :], acc.to(gw_ptr.dtype.element_ty), mask=omask)
    if NEED_B:
        limit = M * (pid_d == 0).to(tl.int64)  # only the first column tile writes grad_b
        tl.store(gb_ptr + rm, gb.to(gb_ptr.dtype.element_ty), mask=rm < limit)


# ----------------------------------------------------------------------------------------------
# launchers and PyTorch fallback: (h, code) forward, (grad_x, grad_w, grad_b) backward
# ----------------------------------------------------------------------------------------------
def _soft_threshold_fwd_triton(x, w, bias, precision):
    B, D = x.shape
    M = w.shape[0]
    h = kb.new_output((B, M), x)
    # float64: an int32 code (triton 3.6 cannot build a float64 dot whose operand comes from 8-bit data:
    # "fp64 don't support largeK MMA"); float32 keeps the 1-byte code
    code = kb.new_output((B, M), x, torch.int32 if x.dtype == torch.float64 else torch.uint8)
    _soft_threshold_fwd_kernel[grouped_grid((B, "BLOCK_B"), (M, "BLOCK_M"))](
        x, w, bias, h, code, B, M, D, PRECISION=precision, ACC=acc_dtype(x))
    return h, code


def _soft_threshold_bwd_triton(grad_h, x, w, code, need, precision):
    (grad_h,) = contiguous(grad_h)
    B, D = x.shape
    M = w.shape[0]
    need_x, need_w, need_b = need
    gx = kb.new_output((B, D), x) if need_x else None
    gw = kb.new_output((M, D), w) if need_w else None
    gb = kb.new_output((M,), w) if need_b else None
    if need_x:
        _soft_threshold_bwd_x_kernel[grouped_grid((B, "BLOCK_B"), (D, "BLOCK_D"))](
            grad_h, code, w, gx, B, M, D, PRECISION=precision, ACC=acc_dtype(x))
    if need_w or need_b:
        # w stands in for the output not asked for: the kernel never touches it
        _soft_threshold_bwd_w_kernel[grouped_grid((M, "BLOCK_M"), (D, "BLOCK_D") if need_w else 1)](
            grad_h, code, x, w if gw is None else gw, w if gb is None else gb, B, M, D,
            NEED_W=bool(need_w), NEED_B=bool(need_b), PRECISION=precision, ACC=acc_dtype(x))
    return gx, gw, gb


def _slope_and_dbias(code: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pos = (code & 1).to(dtype)
    neg = (code >> 1).to(dtype)
    return pos + neg, neg - pos


def _soft_threshold_fwd_torch(x, w, bias):
    u = x @ w.t()
    return symmetric_relu(u, bias), (u > bias).to(torch.uint8) + 2 * (u < -bias).to(torch.uint8)


def _soft_threshold_bwd_torch(grad_h, x, w, code, need):
    slope, dbias = _slope_and_dbias(code, grad_h.dtype)
    gu = grad_h * slope
    return (gu @ w if need[0] else None, gu.t() @ x if need[1] else None,
            (grad_h * dbias).sum(0) if need[2] else None)


# ----------------------------------------------------------------------------------------------
# autograd.Function
# ----------------------------------------------------------------------------------------------
class SoftThresholdFunction(torch.autograd.Function):
    """``forward(ctx, x, w, bias, backend, precision) -> h``; both backends save x, W and the uint8 code.

    ``precision`` is the Triton GEMM input precision: ``"tf32"`` (float32 only) or ``"ieee"``.
    """

    @staticmethod
    def forward(ctx, x, w, bias, backend, precision):
        if backend == "triton":
            h, code = _soft_threshold_fwd_triton(x, w, bias, precision)
        else:
            h, code = _soft_threshold_fwd_torch(x, w, bias)
        ctx.save_for_backward(x, w, code)
        ctx.backend, ctx.precision = backend, precision
        return h

    @staticmethod
    def backward(ctx, grad_h):
        x, w, code = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        if ctx.backend == "triton":
            grads = _soft_threshold_bwd_triton(grad_h, x, w, code, need, ctx.precision)
        else:
            grads = _soft_threshold_bwd_torch(grad_h, x, w, code, need)
        return (*grads, None, None)


# ----------------------------------------------------------------------------------------------
# functional API
# ----------------------------------------------------------------------------------------------
def symmetric_relu(u: torch.Tensor, bias: torch.Tensor | float) -> torch.Tensor:
    """Elementwise ``ReLU(u - b) - ReLU(-u - b)`` (broadcast ``b`` over the last dim)."""
    return torch.relu(u - bias) - torch.relu(-u - bias)


@kb.profiled
def soft_threshold_layer(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                         backend: str = "auto", input_precision: str = "auto", vmappable: bool = False) -> torch.Tensor:
    """Soft-threshold layer ``ReLU(x W^T - b) - ReLU(-x W^T - b)``, differentiable in x, W and b.

    Args:
        x: ``[B, d1]`` inputs. w: ``[m, d1]`` weights. bias: ``[m]`` per-neuron bias (``None`` = 0,
            i.e. the linear map ``x W^T``). All float32 or all float64 (``KernelInputError`` otherwise,
            see ``featlearn.kernels.backend``); computed in that dtype.
        backend: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"torch"`` or ``"triton"``.
        input_precision: the Triton GEMMs' ``tl.dot`` precision: ``"auto"`` (TF32 for float32, IEEE for
            float64), ``"tf32"`` or ``"ieee"`` (exact float32 products; what contrastive stage-I runs want,
            their signals being ~1e-2 relative). Float64 is always IEEE; the PyTorch fallback ignores it
            (see ``featlearn.kernels.backend.resolve_precision``).
        vmappable: the PyTorch form with autograd's backward instead of the autograd.Function, which
            ``torch.func.vmap`` can batch (a seed stack's step; ``backend`` ``auto`` or ``torch``): the same values;
            the gradients to rounding (autograd forms ``W``'s as ``(x^T g)^T``).

    Returns ``[B, m]`` activations in ``x.dtype``.
    """
    check_backend(backend)
    precision = resolve_precision(input_precision, check_float_inputs("soft_threshold_layer", x=x, w=w, bias=bias))
    if x.dim() != 2:
        refuse_shape("soft_threshold_layer", "x", x, "must be a 2-D tensor [B, d1]")
    if w.dim() != 2 or w.shape[1] != x.shape[1]:
        refuse_shape("soft_threshold_layer", "w", w, f"must be a 2-D tensor [m, {x.shape[1]}]")
    if bias is None:
        bias = torch.zeros(w.shape[0], device=w.device, dtype=w.dtype)
    if bias.shape != (w.shape[0],):
        refuse_shape("soft_threshold_layer", "bias", bias, f"must be a 1-D tensor [{w.shape[0]}]")
    if vmappable and backend == "triton":
        raise ConfigError("backend", "auto or torch with vmappable=True (the Triton kernels have no vmap rule)",
                          backend)
    which = "torch" if vmappable else resolve_backend(backend, x, w, bias)
    if which == "torch" and (vmappable or not (torch.is_grad_enabled()
                                               and (x.requires_grad or w.requires_grad or bias.requires_grad))):
        return symmetric_relu(x @ w.t(), bias)  # autograd's backward, or no backward: no slope code to keep
    if which == "triton":
        x, w, bias = contiguous(x, w, bias)
    return SoftThresholdFunction.apply(x, w, bias, which, precision)


# ----------------------------------------------------------------------------------------------
# float64 reference
# ----------------------------------------------------------------------------------------------
def soft_threshold_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain autograd reference: ``symmetric_relu(x @ w.T, bias)``. Run it in float64 for tests."""
    u = x @ w.t()
    if bias is None:
        return u
    return symmetric_relu(u, bias)
