"""Fused two-layer hidden layer ``h = sigma_s(x W^T + b)`` with the Gaussian-smoothed truncated ReLU
(forward and backward), the activation of Shi 2024, Sec. 2.3 (Shi, Wei & Liang 2022).

The truncated ReLU ``sigma(z) = min(1, max(z, 0))`` smoothed by Gaussian noise ``xi ~ N(0, s^2)``,
``sigma_s(z) = E_xi sigma(z + xi)``, in closed form (no sampling)::

    sigma_s(z)  = H(z) - H(z - 1),    H(u) = u Phi(u/s) + s phi(u/s)
    sigma_s'(z) = Phi(z/s) - Phi((z - 1)/s)

with Phi / phi the standard normal CDF / density. ``s = 0`` is the truncated ReLU itself, derivative
``1[0 < z < 1]``. Shapes: x ``[B, d]``, W ``[M, d]``, b ``[M]`` -> h ``[B, M]``.

Backends (``backend="auto"`` picks Triton for CUDA tensors), both saving x, W and the slope
``sigma_s'(z)`` ``[B, M]`` (written by the forward epilogue, so ``z`` is never stored):

* ``triton``: three autotuned GEMM kernels (grouped launch order, ``tl.dot`` in TF32 or IEEE precision):
  ``x W^T + b`` with the smoothed-clamp epilogue (writes h and the slope), ``grad_x = (g * slope) W`` and
  ``grad_W = (g * slope)^T x``, whose first column tile also reduces ``grad_b = sum_B g * slope``.
  Cost 3 GEMMs of ``B*M*d`` multiply-adds (2 when x needs no gradient, as in training); extra memory one
  ``[B, M]`` slope in the input dtype.
* ``torch``: the same algebra with PyTorch ops.

At the paper's sizes (B = 50,000, d = 500, M = 600: 1.5e10 multiply-adds per GEMM) the epilogue (two erf,
two exp per element) is ~1e-3 of the GEMM's work: the gain over PyTorch is the one pass over ``[B, M]``
instead of five elementwise passes.

Dtypes follow the shared policy of ``featlearn.kernels.backend``: x, W and b all float32 or all float64,
computed in that dtype. The smoothing ``s`` is a Python float (a kernel argument rounded once to the
accumulator dtype).

Example:
    >>> import torch
    >>> from featlearn.kernels.smoothed_clamp import smoothed_clamp_layer, gaussian_smoothed_clamp
    >>> x, w = torch.randn(8, 32), torch.randn(16, 32, requires_grad=True)
    >>> smoothed_clamp_layer(x, w, torch.zeros(16), 0.04, backend="torch").shape
    torch.Size([8, 16])
    >>> gaussian_smoothed_clamp(torch.tensor([-5.0, 0.5, 5.0]), 0.1)
    tensor([0.0000, 0.5000, 1.0000])
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from featlearn.errors import ConfigError
from featlearn.kernels import backend as kb  # kb.new_output: the allocation tests poison
from featlearn.kernels.backend import (FMA_TILES, GEMM_TILES, INTERPRETER_GEMM_TILE, MMA_TILES, acc_dtype, autotune,
                                       blocks, check_backend, check_float_inputs, contiguous, grouped_grid,
                                       grouped_tile, refuse_shape, resolve_backend, resolve_precision,
                                       tiles_by_precision)

__all__ = ["smoothed_clamp_layer", "smoothed_clamp_reference", "gaussian_smoothed_clamp",
           "gaussian_smoothed_clamp_derivative", "SmoothedClampFunction"]

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)


# The tiles each kernel may use per precision: those its sm_90 builds at the sizes of
# featlearn.gpu.cases keep spill-free
# (`featlearn gpu compile --all-configs`, benchmarks/results/gpu/). The forward's epilogue (two normal
# CDFs and densities per element) leaves room for few accumulators: 64-row tiles with TF32, the two
# smallest FMA tiles in float64.
_FWD_FITS = tiles_by_precision(tf32=[(64, 64, 32, 8), (64, 16, 64, 8)], ieee=blocks(FMA_TILES),
                               fp64=[(64, 16, 16, 8), (32, 32, 16, 8)])
# The backward's 128 x 128 x 64 tile needs 229-233 KB of shared memory at d = 100 (the H100 has 227 KB).
_MMA_BUT_DEEPEST = [t for t in blocks(MMA_TILES) if t != (128, 128, 64, 8)]
_BWD_X_FITS = tiles_by_precision(tf32=_MMA_BUT_DEEPEST, ieee=blocks(FMA_TILES), fp64=blocks(FMA_TILES))
_BWD_W_FITS = tiles_by_precision(tf32=[t for t in _MMA_BUT_DEEPEST if t not in ((128, 64, 32, 8), (128, 16, 64, 8),
                                                                                (64, 128, 32, 8))],
                                 ieee=[(32, 64, 16, 8), (64, 16, 16, 8), (32, 32, 16, 8)],
                                 fp64=[(64, 64, 16, 8), (64, 32, 16, 8), (64, 16, 16, 8)])

# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _smoothed_clamp_epilogue(z, s, SMOOTH: tl.constexpr):
    # (sigma_s(z), sigma_s'(z)); s = 0 is the truncated ReLU (the constexpr keeps 1/s out of that path)
    if SMOOTH:
        inv = 1.0 / s
        t0 = z * inv
        t1 = (z - 1.0) * inv
        cdf0 = 0.5 * (1.0 + tl.math.erf(t0 * 0.7071067811865476))
        cdf1 = 0.5 * (1.0 + tl.math.erf(t1 * 0.7071067811865476))
        pdf0 = tl.exp(-0.5 * t0 * t0) * 0.3989422804014327
        pdf1 = tl.exp(-0.5 * t1 * t1) * 0.3989422804014327
        h = z * cdf0 + s * pdf0 - ((z - 1.0) * cdf1 + s * pdf1)
        d = cdf0 - cdf1
    else:
        h = tl.minimum(tl.maximum(z, 0.0), 1.0)
        d = ((z > 0.0) & (z < 1.0)).to(z.dtype)
    return h, d


@autotune(("BLOCK_B", "BLOCK_M", "BLOCK_K", "GROUP_M"), GEMM_TILES, INTERPRETER_GEMM_TILE, fits=_FWD_FITS,
          key=["M", "D", "SMOOTH", "PRECISION"])
@triton.jit
def _smoothed_clamp_fwd_kernel(x_ptr, w_ptr, b_ptr, h_ptr, slope_ptr, s: tl.float64, B, M, D,
                               SMOOTH: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
                               BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                               GROUP_M: tl.constexpr):
    # z[B, M] = x[B, D] @ w[M, D]^T + b with the smoothed-clamp epilogue (value and slope)
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
    z = acc + tl.load(b_ptr + rm, mask=rm < M, other=0.0).to(ACC)[None, :]
    h, d = _smoothed_clamp_epilogue(z, tl.full((), s, ACC), SMOOTH)
    omask = (rb[:, None] < B) & (rm[None, :] < M)
    offs = rb[:, None] * M + rm[None, :]
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=omask)
    tl.store(slope_ptr + offs, d.to(slope_ptr.dtype.element_ty), mask=omask)


@autotune(("BLOCK_B", "BLOCK_D", "BLOCK_K", "GROUP_M"), GEMM_TILES, INTERPRETER_GEMM_TILE, fits=_BWD_X_FITS,
          key=["M", "D", "PRECISION"])
@triton.jit
def _smoothed_clamp_bwd_x_kernel(g_ptr, slope_ptr, w_ptr, gx_ptr, B, M, D,
                                 PRECISION: tl.constexpr, ACC: tl.constexpr, BLOCK_B: tl.constexpr,
                                 BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # grad_x[B, D] = (g * slope)[B, M] @ w[M, D]
    pid_b, pid_d = grouped_tile(tl.program_id(0), tl.cdiv(B, BLOCK_B), tl.cdiv(D, BLOCK_D), GROUP_M)
    rb = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    rd = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_B, BLOCK_D), dtype=ACC)
    for k0 in range(0, M, BLOCK_K):
        kk = k0 + rk
        gmask = (rb[:, None] < B) & (kk[None, :] < M)
        g = tl.load(g_ptr + rb[:, None] * M + kk[None, :], mask=gmask, other=0.0).to(ACC)
        sl = tl.load(slope_ptr + rb[:, None] * M + kk[None, :], mask=gmask, other=0.0).to(ACC)
        wt = tl.load(w_ptr + kk[:, None] * D + rd[None, :], mask=(kk[:, None] < M) & (rd[None, :] < D), other=0.0)
        acc = tl.dot(g * sl, wt.to(ACC), acc, input_precision=PRECISION, out_dtype=ACC)
    omask = (rb[:, None] < B) & (rd[None, :] < D)
    tl.store(gx_ptr + rb[:, None] * D + rd[None, :], acc.to(gx_ptr.dtype.element_ty), mask=omask)


@autotune(("BLOCK_M", "BLOCK_D", "BLOCK_K", "GROUP_M"), GEMM_TILES, INTERPRETER_GEMM_TILE, fits=_BWD_W_FITS,
          key=["M", "D", "NEED_W", "NEED_B", "PRECISION"])
@triton.jit
def _smoothed_clamp_bwd_w_kernel(g_ptr, slope_ptr, x_ptr, gw_ptr, gb_ptr, B, M, D,
                                 NEED_W: tl.constexpr, NEED_B: tl.constexpr, PRECISION: tl.constexpr,
                                 ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # grad_w[M, D] = (g * slope)^T[M, B] @ x[B, D]; grad_b[M] = sum_B g * slope (first D tile only)
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
        # transposed loads: tile [BLOCK_M, BLOCK_K] of (g * slope)^T
        gu = (tl.load(g_ptr + kk[None, :] * M + rm[:, None], mask=gmask, other=0.0).to(ACC)
              * tl.load(slope_ptr + kk[None, :] * M + rm[:, None], mask=gmask, other=0.0).to(ACC))
        if NEED_W:
            xt = tl.load(x_ptr + kk[:, None] * D + rd[None, :], mask=(kk[:, None] < B) & (rd[None, :] < D), other=0.0)
            acc = tl.dot(gu, xt.to(ACC), acc, input_precision=PRECISION, out_dtype=ACC)
        if NEED_B:  # cheap; only the pid_d == 0 programs store it
            gb += tl.sum(gu, axis=1)
    if NEED_W:
        omask = (rm[:, None] < M) & (rd[None, :] < D)
        tl.store(gw_ptr + rm[:, None] * D + rd[None, :], acc.to(gw_ptr.dtype.element_ty), mask=omask)
    if NEED_B:
        limit = M * (pid_d == 0).to(tl.int64)  # only the first column tile writes grad_b
        tl.store(gb_ptr + rm, gb.to(gb_ptr.dtype.element_ty), mask=rm < limit)


# ----------------------------------------------------------------------------------------------
# launchers and PyTorch fallback: (h, slope) forward, (grad_x, grad_w, grad_b) backward
# ----------------------------------------------------------------------------------------------
def _smoothed_clamp_fwd_triton(x, w, bias, smoothing, precision):
    B, D = x.shape
    M = w.shape[0]
    h = kb.new_output((B, M), x)
    slope = kb.new_output((B, M), x)
    _smoothed_clamp_fwd_kernel[grouped_grid((B, "BLOCK_B"), (M, "BLOCK_M"))](
        x, w, bias, h, slope, float(smoothing), B, M, D, SMOOTH=smoothing > 0, PRECISION=precision,
        ACC=acc_dtype(x))
    return h, slope


def _smoothed_clamp_bwd_triton(grad_h, x, w, slope, need, precision):
    (grad_h,) = contiguous(grad_h)
    B, D = x.shape
    M = w.shape[0]
    need_x, need_w, need_b = need
    gx = kb.new_output((B, D), x) if need_x else None
    gw = kb.new_output((M, D), w) if need_w else None
    gb = kb.new_output((M,), w) if need_b else None
    if need_x:
        _smoothed_clamp_bwd_x_kernel[grouped_grid((B, "BLOCK_B"), (D, "BLOCK_D"))](
            grad_h, slope, w, gx, B, M, D, PRECISION=precision, ACC=acc_dtype(x))
    if need_w or need_b:
        # w stands in for the output not asked for: the kernel never touches it
        _smoothed_clamp_bwd_w_kernel[grouped_grid((M, "BLOCK_M"), (D, "BLOCK_D") if need_w else 1)](
            grad_h, slope, x, w if gw is None else gw, w if gb is None else gb, B, M, D,
            NEED_W=bool(need_w), NEED_B=bool(need_b), PRECISION=precision, ACC=acc_dtype(x))
    return gx, gw, gb


def _smoothed_clamp_fwd_torch(x, w, bias, smoothing):
    z = torch.addmm(bias, x, w.t())
    if smoothing == 0:
        return z.clamp(0.0, 1.0), ((z > 0) & (z < 1)).to(z.dtype)
    slope = torch.empty_like(z)
    # ~14 elementwise passes: over row blocks of ~64k elements each block stays in cache between them
    rows = max(1, (1 << 16) // max(1, z.shape[1]))
    for start in range(0, z.shape[0], rows):
        _smoothed_clamp_epilogue_(z[start:start + rows], slope[start:start + rows], smoothing)
    return z, slope


def _smoothed_clamp_epilogue_(z, slope, s):
    """``z <- sigma_s(z)``, ``slope <- sigma_s'(z)`` in place. They share the two normal CDFs and densities:
    ``h = z (c1 - c2) + c2 + s (phi1 - phi2)``, ``slope = c1 - c2`` (2 erf + 2 exp per element, not 4 + 2)."""
    t1 = z.div(s)
    t2 = t1 - 1.0 / s
    c2 = t2.mul(_INV_SQRT2).erf_().add_(1.0).mul_(0.5)
    torch.mul(t1, _INV_SQRT2, out=slope).erf_().add_(1.0).mul_(0.5).sub_(c2)
    # exp of a subnormal result is ~10x slower on x86 (3% of the entries at s = 1/k^2): stop the exponent where
    # the result is still normal; the densities it drops are below 1e-35 (float32) / 1e-304 (float64)
    floor = -80.0 if z.dtype == torch.float32 else -700.0
    dens = t1.square_().mul_(-0.5).clamp_min_(floor).exp_()
    dens.sub_(t2.square_().mul_(-0.5).clamp_min_(floor).exp_()).mul_(s * _INV_SQRT2PI)
    z.mul_(slope).add_(c2).add_(dens)


def _smoothed_clamp_bwd_torch(grad_h, x, w, slope, need):
    gu = grad_h * slope
    return (gu @ w if need[0] else None, gu.t() @ x if need[1] else None, gu.sum(0) if need[2] else None)


# ----------------------------------------------------------------------------------------------
# autograd.Function
# ----------------------------------------------------------------------------------------------
class SmoothedClampFunction(torch.autograd.Function):
    """``forward(ctx, x, w, bias, smoothing, backend, precision) -> h``; both backends save x, W and the slope.

    ``precision`` is the Triton GEMM input precision: ``"tf32"`` (float32 only) or ``"ieee"``.
    """

    @staticmethod
    def forward(ctx, x, w, bias, smoothing, backend, precision):
        if backend == "triton":
            h, slope = _smoothed_clamp_fwd_triton(x, w, bias, smoothing, precision)
        else:
            h, slope = _smoothed_clamp_fwd_torch(x, w, bias, smoothing)
        ctx.save_for_backward(x, w, slope)
        ctx.backend, ctx.precision = backend, precision
        return h

    @staticmethod
    def backward(ctx, grad_h):
        x, w, slope = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        if ctx.backend == "triton":
            grads = _smoothed_clamp_bwd_triton(grad_h, x, w, slope, need, ctx.precision)
        else:
            grads = _smoothed_clamp_bwd_torch(grad_h, x, w, slope, need)
        return (*grads, None, None, None)


# ----------------------------------------------------------------------------------------------
# functional API
# ----------------------------------------------------------------------------------------------
def _normal_cdf(t: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(t * _INV_SQRT2))


def _smoothed_ramp(u: torch.Tensor, s: float) -> torch.Tensor:
    """``H(u) = E max(u + xi, 0) = u Phi(u/s) + s phi(u/s)``."""
    t = u / s
    return u * _normal_cdf(t) + s * _INV_SQRT2PI * torch.exp(-0.5 * t * t)


def gaussian_smoothed_clamp(z: torch.Tensor, s: float) -> torch.Tensor:
    """``E_xi min(1, max(z + xi, 0))`` with ``xi ~ N(0, s^2)``, in closed form (module docstring);
    ``s = 0``: the truncated ReLU. Differentiable with autograd.

    Example:
        >>> gaussian_smoothed_clamp(torch.tensor([0.0, 1.0]), 0.0)
        tensor([0., 1.])
    """
    if s == 0:
        return z.clamp(0.0, 1.0)
    return _smoothed_ramp(z, s) - _smoothed_ramp(z - 1.0, s)


def gaussian_smoothed_clamp_derivative(z: torch.Tensor, s: float) -> torch.Tensor:
    """``Phi(z/s) - Phi((z - 1)/s)``; ``s = 0``: ``1[0 < z < 1]``.

    Example:
        >>> gaussian_smoothed_clamp_derivative(torch.tensor([-1.0, 0.5, 2.0]), 0.0)
        tensor([0., 1., 0.])
    """
    if s == 0:
        return ((z > 0) & (z < 1)).to(z.dtype)
    return _normal_cdf(z / s) - _normal_cdf((z - 1.0) / s)


def smoothed_clamp_layer(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, smoothing: float = 0.0,
                         *, backend: str = "auto", input_precision: str = "auto") -> torch.Tensor:
    """Hidden layer ``sigma_s(x W^T + b)`` of the smoothed truncated ReLU, differentiable in x, W and b.

    Args:
        x: ``[B, d]`` inputs. w: ``[M, d]`` weights. bias: ``[M]`` (``None`` = 0). All float32 or all
            float64 (``KernelInputError`` otherwise, see ``featlearn.kernels.backend``).
        smoothing: the noise std ``s >= 0`` (0: the truncated ReLU ``clamp(z, 0, 1)``).
        backend: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"torch"`` or ``"triton"``.
        input_precision: the Triton GEMMs' ``tl.dot`` precision: ``"auto"`` (TF32 for float32, IEEE for
            float64), ``"tf32"`` or ``"ieee"``; the PyTorch fallback ignores it.

    Returns ``[B, M]`` activations in ``x.dtype``.
    """
    check_backend(backend)
    precision = resolve_precision(input_precision, check_float_inputs("smoothed_clamp_layer", x=x, w=w, bias=bias))
    if x.dim() != 2:
        refuse_shape("smoothed_clamp_layer", "x", x, "must be a 2-D tensor [B, d]")
    if w.dim() != 2 or w.shape[1] != x.shape[1]:
        refuse_shape("smoothed_clamp_layer", "w", w, f"must be a 2-D tensor [M, {x.shape[1]}]")
    if bias is None:
        bias = torch.zeros(w.shape[0], device=w.device, dtype=w.dtype)
    if bias.shape != (w.shape[0],):
        refuse_shape("smoothed_clamp_layer", "bias", bias, f"must be a 1-D tensor [{w.shape[0]}]")
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0 <= smoothing < math.inf:
        raise ConfigError("smoothing", "a finite number >= 0", smoothing)
    which = resolve_backend(backend, x, w, bias)
    if which == "triton":
        x, w, bias = contiguous(x, w, bias)
    return SmoothedClampFunction.apply(x, w, bias, float(smoothing), which, precision)


# ----------------------------------------------------------------------------------------------
# float64 reference
# ----------------------------------------------------------------------------------------------
def smoothed_clamp_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                             smoothing: float = 0.0) -> torch.Tensor:
    """Plain autograd reference: ``gaussian_smoothed_clamp(x @ w.T + b, s)``. Run it in float64 for tests."""
    z = x @ w.t()
    if bias is not None:
        z = z + bias
    return gaussian_smoothed_clamp(z, smoothing)
