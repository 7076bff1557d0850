"""Fused "GEMM + activation + sum over patches": the hot loop of every patch encoder in featlearn.

For patches x[B, P, d], kernels w[R, d] and an activation f, with A[b,p,r] = <w_r, x[b,p]>:

    student[b, r] = sum_p m[b, p] f(A[b, p, r])                 (m = mask as float weights, 1 if None)
    squares[b, r] = sum_p m[b, p] f(A[b, p, r])**2               (only when squares=True)
    teacher[b, r] = sum_p f(teacher_scale * A[b, p, r])           (only with teacher_scale; unmasked,
                                                                   no gradient)

``student`` and ``squares`` are differentiable w.r.t. x and w (not w.r.t. the mask). When a gradient
is wanted and A [B*P, R] fits ``save_preactivation_bytes`` (default ``SAVE_PREACTIVATION_BYTES``, 1 GiB)
the forward writes A once and saves it with x, w and the mask; otherwise A is never materialised as a
whole and only x, w and the mask are saved.

Backends (``backend="auto"`` picks Triton for CUDA tensors, see ``featlearn.kernels.backend``):

* ``triton``: the forward is one autotuned kernel (grouped grid over blocks of B x blocks of R; loop over
  the P patches, and over d in tiles with ``tl.dot`` in TF32 or IEEE precision, ``input_precision``; the
  epilogue applies f, f(tau .) and f**2 and accumulates the sums over P in registers), writing the
  [B, R] outputs and, when saved, A.
* ``torch``: the same sums in chunks over B, each chunk one batched GEMM (into the saved A when it is
  kept) and PyTorch elementwise ops.

Backward (both backends, chunked over samples): per chunk, dA = m (g_student + 2 g_squares f(A)) f'(A)
is formed once into a chunk buffer [chunk*P, R] (from the saved A: elementwise only; else the Triton
kernel recomputes the A tile in registers, the torch path one GEMM), then dW (+)= dA^T x_chunk and,
only when x needs a gradient (never in training), dX_chunk = dA w (cuBLAS). Chunks hold
``DW_REUSE * R * d`` elements of dA (at least ``MIN_CHUNK_ELEMENTS``, at most the save budget), so dW's
read-modify-write per chunk stays small next to the chunk's dA traffic. Cost in training with A saved:
2 GEMMs per step (forward, dW) plus one write and one read of A and of dA; without it 3 GEMMs. The
flash-style variant (dW accumulated from A tiles in registers) would avoid the dA traffic
but fits only small d per accumulator tile, so this design is used for any d.

Length (~470 lines): three activations x three optional outputs x mask x saved A in both backends, plus checks.

Example:
    >>> import torch
    >>> from featlearn.kernels import Activation, patch_activation_sum
    >>> x, w = torch.randn(4, 5, 8), torch.randn(3, 8, requires_grad=True)
    >>> out = patch_activation_sum(x, w, Activation("srelu", q=3, rho=0.5), teacher_scale=1.5, squares=True)
    >>> out.student.shape, out.teacher.shape, out.squares.shape
    (torch.Size([4, 3]), torch.Size([4, 3]), torch.Size([4, 3]))
    >>> (out.student.sum() + out.squares.sum()).backward(); w.grad.shape
    torch.Size([3, 8])
"""
from __future__ import annotations

import math
import numbers
from functools import partial
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from featlearn.errors import ConfigError
from featlearn.kernels import backend as kb  # kb.new_output: the allocation tests poison
from featlearn.kernels.activations import Activation
from featlearn.kernels.backend import (FMA_8_WARP_TILES, FMA_TILES, GEMM_TILES, INTERPRETER_GEMM_TILE, MMA_TILES,
                                       KernelInputError, acc_dtype, autotune, blocks, check_backend, check_float_inputs,
                                       contiguous, cublas_precision, grouped_grid, grouped_tile, refuse_shape,
                                       resolve_backend, resolve_precision, tiles_by_precision)

__all__ = ["patch_activation_sum", "patch_activation_sum_reference", "PatchSums", "PatchActivationSumFunction"]

# The forward saves A = x w^T for the backward when B*P*R*itemsize fits this budget (1 GiB: MRP at
# configs/mrp/teacher_student_medium.yaml in float32, B*P*R = 16384*32*512, is exactly this); otherwise the
# backward recomputes A chunk by chunk, each chunk's dA holding at most the budget too.
SAVE_PREACTIVATION_BYTES = 2**30
# backward chunks (when chunk_elements is not given) hold dA for at least DW_REUSE * R * d elements, so
# that the read-modify-write of dW [R, d] per chunk is at most 1/DW_REUSE of the dA traffic, and at least
# MIN_CHUNK_ELEMENTS, so that small problems run in one or a few chunks
DW_REUSE = 16
MIN_CHUNK_ELEMENTS = 2**24


# The tiles each kernel may use per precision: those its sm_90 builds at the sizes of
# featlearn.gpu.cases keep spill-free
# (`featlearn gpu compile --all-configs`, benchmarks/results/gpu/). The forward holds three [rows x R]
# accumulators (student, teacher, squares) besides the A tile: the narrow MMA tiles with TF32 (64 x 64
# spills 8 bytes under triton 3.6), the smallest FMA tiles in IEEE float32, and in float64 one 8-warp tile.
_NARROW_MMA = [(64, 64, 32, 8), (64, 16, 64, 8), (128, 16, 64, 8)]
_FWD_FITS = tiles_by_precision(tf32=_NARROW_MMA[1:], ieee=[(64, 16, 16, 8), (32, 32, 16, 8)],
                               fp64=blocks(FMA_8_WARP_TILES))
_BWD_FITS = tiles_by_precision(tf32=_NARROW_MMA, ieee=blocks(FMA_TILES), fp64=blocks(FMA_TILES))

# ----------------------------------------------------------------------------------------------------
# Triton kernels. Per-call scalars (rho, coef, tau) are float64 arguments, rounded once to the
# accumulator dtype with tl.full: exact for float64 runs (a plain Python float would arrive as float32)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _patch_sum_ipow(z, N: tl.constexpr):
    r = z * 0.0 + 1.0
    for _ in tl.static_range(N):
        r = r * z
    return r


@triton.jit
def _patch_sum_act(z, ACT: tl.constexpr, Q: tl.constexpr, rho, coef):
    rho = tl.full((), rho, z.dtype)
    coef = tl.full((), coef, z.dtype)
    if ACT == 0:  # smoothed ReLU: clamp(z,0,rho)^q / (q rho^(q-1)) + max(z - rho, 0)
        c = tl.minimum(tl.maximum(z, 0.0), rho)
        out = _patch_sum_ipow(c, Q) * coef + tl.maximum(z - rho, 0.0)
    elif ACT == 1:  # relu
        out = tl.maximum(z, 0.0)
    else:  # z ** q
        out = _patch_sum_ipow(z, Q)
    return out


@triton.jit
def _patch_sum_dact(z, ACT: tl.constexpr, Q: tl.constexpr, rho, inv_rho):
    rho = tl.full((), rho, z.dtype)
    inv_rho = tl.full((), inv_rho, z.dtype)
    if ACT == 0:  # (clamp(z,0,rho)/rho)^(q-1)
        c = tl.minimum(tl.maximum(z, 0.0), rho) * inv_rho
        out = _patch_sum_ipow(c, Q - 1)
    elif ACT == 1:
        out = tl.where(z > 0.0, 1.0, 0.0).to(z.dtype)
    else:
        out = _patch_sum_ipow(z, Q - 1) * Q
    return out


@triton.jit
def _patch_sum_scores(x_rows, row_ok, sxd, w_ptr, offs_r, r_ok, swr, swd, D, ROWS: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """A tile [ROWS, BLOCK_R] = x[rows] @ w[offs_r]^T; ``x_rows`` points at the first element of each row."""
    a = tl.zeros((ROWS, BLOCK_R), dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        d_ok = dd < D
        xt = tl.load(x_rows[:, None] + dd[None, :] * sxd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        wt = tl.load(w_ptr + dd[:, None] * swd + offs_r[None, :] * swr, mask=d_ok[:, None] & r_ok[None, :], other=0.0)
        a = tl.dot(xt, wt, a, input_precision=PRECISION, out_dtype=ACC)
    return a


@autotune(("BLOCK_B", "BLOCK_R", "BLOCK_D", "GROUP_M"), GEMM_TILES, INTERPRETER_GEMM_TILE, fits=_FWD_FITS,
          key=["P", "D", "R", "HAS_MASK", "HAS_TEACHER", "HAS_SQUARES", "SAVE_A", "PRECISION"])
@triton.jit
def _patch_sum_fwd_kernel(
    x_ptr, w_ptr, m_ptr, s_ptr, t_ptr, q_ptr, a_ptr, rho: tl.float64, coef: tl.float64, tau: tl.float64,
    B, P, D, R,
    sxb, sxp, sxd, swr, swd, smb, smp, sob, sor,
    ACT: tl.constexpr, Q: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_TEACHER: tl.constexpr, HAS_SQUARES: tl.constexpr, SAVE_A: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_b, pid_r = grouped_tile(tl.program_id(0), tl.cdiv(B, BLOCK_B), tl.cdiv(R, BLOCK_R), GROUP_M)
    offs_b = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    offs_r = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    b_ok = offs_b < B
    r_ok = offs_r < R
    tau = tl.full((), tau, ACC)
    s_acc = tl.zeros((BLOCK_B, BLOCK_R), dtype=ACC)
    t_acc = tl.zeros((BLOCK_B, BLOCK_R), dtype=ACC)
    q_acc = tl.zeros((BLOCK_B, BLOCK_R), dtype=ACC)
    for p in range(0, P):
        a = _patch_sum_scores(x_ptr + offs_b * sxb + p * sxp, b_ok, sxd, w_ptr, offs_r, r_ok, swr, swd, D,
                              BLOCK_B, BLOCK_R, BLOCK_D, ACC, PRECISION)
        if SAVE_A:  # row b*P + p of the row-major [B*P, R] buffer the backward reads instead of a GEMM
            tl.store(a_ptr + (offs_b[:, None] * P + p) * R + offs_r[None, :], a.to(a_ptr.dtype.element_ty),
                     mask=b_ok[:, None] & r_ok[None, :])
        y = _patch_sum_act(a, ACT, Q, rho, coef)
        my = y
        if HAS_MASK:
            my = tl.load(m_ptr + offs_b * smb + p * smp, mask=b_ok, other=0.0).to(ACC)[:, None] * y
        s_acc += my
        if HAS_SQUARES:
            q_acc += my * y
        if HAS_TEACHER:
            t_acc += _patch_sum_act(a * tau, ACT, Q, rho, coef)
    out_off = offs_b[:, None] * sob + offs_r[None, :] * sor
    out_ok = b_ok[:, None] & r_ok[None, :]
    tl.store(s_ptr + out_off, s_acc.to(s_ptr.dtype.element_ty), mask=out_ok)
    if HAS_TEACHER:
        tl.store(t_ptr + out_off, t_acc.to(t_ptr.dtype.element_ty), mask=out_ok)
    if HAS_SQUARES:
        tl.store(q_ptr + out_off, q_acc.to(q_ptr.dtype.element_ty), mask=out_ok)


@autotune(("BLOCK_M", "BLOCK_R", "BLOCK_D", "GROUP_M"), GEMM_TILES, INTERPRETER_GEMM_TILE, fits=_BWD_FITS,
          key=["D", "R", "HAS_MASK", "HAS_GS", "HAS_GQ", "HAS_A", "PRECISION"])
@triton.jit
def _patch_sum_bwd_da_kernel(
    x_ptr, w_ptr, a_ptr, m_ptr, gs_ptr, gq_ptr, da_ptr, rho: tl.float64, coef: tl.float64, inv_rho: tl.float64,
    M, P, D, R,
    sxm, sxd, swr, swd, sgb, sgr, sqb, sqr, sdm, sdr,
    ACT: tl.constexpr, Q: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_GS: tl.constexpr, HAS_GQ: tl.constexpr, HAS_A: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_M: tl.constexpr,
):
    # rows m of the chunk are flattened (sample, patch) pairs: sample = m // P
    pid_m, pid_r = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(R, BLOCK_R), GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_r = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    m_ok = offs_m < M
    r_ok = offs_r < R
    ok = m_ok[:, None] & r_ok[None, :]
    if HAS_A:  # saved by the forward: elementwise, no GEMM
        a = tl.load(a_ptr + offs_m[:, None] * R + offs_r[None, :], mask=ok, other=0.0).to(ACC)
    else:
        a = _patch_sum_scores(x_ptr + offs_m * sxm, m_ok, sxd, w_ptr, offs_r, r_ok, swr, swd, D,
                              BLOCK_M, BLOCK_R, BLOCK_D, ACC, PRECISION)
    b_idx = (offs_m // P)[:, None]
    coeff = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    if HAS_GS:
        coeff += tl.load(gs_ptr + b_idx * sgb + offs_r[None, :] * sgr, mask=ok, other=0.0).to(ACC)
    if HAS_GQ:
        gq = tl.load(gq_ptr + b_idx * sqb + offs_r[None, :] * sqr, mask=ok, other=0.0).to(ACC)
        coeff += 2.0 * gq * _patch_sum_act(a, ACT, Q, rho, coef)
    da = coeff * _patch_sum_dact(a, ACT, Q, rho, inv_rho)
    if HAS_MASK:
        da = da * tl.load(m_ptr + offs_m, mask=m_ok, other=0.0).to(ACC)[:, None]
    tl.store(da_ptr + offs_m[:, None] * sdm + offs_r[None, :] * sdr, da.to(da_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------------
# launchers and PyTorch fallback. Forward: fill the (student, teacher, squares) buffers (None = not
# asked for) and, when asked, keep A. Backward, per chunk of samples: form dA (from the chunk's columns
# of the kept A^T [R, B*P], or recomputing A) in the flat buffer ``da_buf`` and return it as dA^T
# [R, chunk*P]. Both backends keep A^T: the Triton one as the transposed view of a row-major [B*P, R]
# buffer (coalesced stores along R), the torch one computed as w x^T, which CPU BLAS runs 2-3x faster
# than x w^T at small R (measured at the tiny size: 2.6 vs 8.4 ms, one thread)
# ----------------------------------------------------------------------------------------------------
def _act_args(act: Activation) -> dict:
    return dict(ACT=act.kind, Q=act.q, rho=act.rho, coef=1.0 / (act.q * act.rho ** (act.q - 1)))


def _patch_sum_fwd_triton(x, w, mask, act, teacher_scale, student, teacher, sq, save, precision):
    B, P, D = x.shape
    R = w.shape[0]
    empty = x.new_empty(0)
    a = kb.new_output((B * P, R), x) if save else None
    _patch_sum_fwd_kernel[grouped_grid((B, "BLOCK_B"), (R, "BLOCK_R"))](
        x, w, empty if mask is None else mask, student, empty if teacher is None else teacher,
        empty if sq is None else sq, empty if a is None else a,
        tau=1.0 if teacher_scale is None else float(teacher_scale),
        B=B, P=P, D=D, R=R, sxb=x.stride(0), sxp=x.stride(1), sxd=x.stride(2), swr=w.stride(0), swd=w.stride(1),
        smb=0 if mask is None else mask.stride(0), smp=0 if mask is None else mask.stride(1),
        sob=student.stride(0), sor=student.stride(1), ACC=acc_dtype(x), PRECISION=precision,
        HAS_MASK=mask is not None, HAS_TEACHER=teacher is not None, HAS_SQUARES=sq is not None,
        SAVE_A=save, **_act_args(act))
    return None if a is None else a.T


def _patch_sum_bwd_triton(da_buf, x, w, mask, act, gs, gq, at, precision):
    P, D = x.shape[1:]
    R = w.shape[0]
    xc = x.reshape(-1, D)  # a view: the Triton path gets contiguous x
    da = da_buf[: xc.shape[0] * R].view(xc.shape[0], R)
    empty = x.new_empty(0)
    gs_st = (0, 0) if gs is None else gs.stride()
    gq_st = (0, 0) if gq is None else gq.stride()
    _patch_sum_bwd_da_kernel[grouped_grid((xc.shape[0], "BLOCK_M"), (R, "BLOCK_R"))](
        xc, w, empty if at is None else at.T, empty if mask is None else mask.reshape(-1),
        empty if gs is None else gs, empty if gq is None else gq, da, inv_rho=1.0 / act.rho,
        M=xc.shape[0], P=P, D=D, R=R, sxm=xc.stride(0), sxd=xc.stride(1), swr=w.stride(0),
        swd=w.stride(1), sgb=gs_st[0], sgr=gs_st[1], sqb=gq_st[0], sqr=gq_st[1], sdm=da.stride(0),
        sdr=da.stride(1), ACC=acc_dtype(x), PRECISION=precision,
        HAS_MASK=mask is not None, HAS_GS=gs is not None, HAS_GQ=gq is not None, HAS_A=at is not None,
        **_act_args(act))
    return da.T


def _rows_per_chunk(P: int, R: int, D: int, itemsize: int, chunk_elements: int | None, budget: int) -> int:
    """Samples per chunk of the torch forward and of every backward: ``chunk_elements`` A-elements when
    given, else ``DW_REUSE * R * D`` clamped to [MIN_CHUNK_ELEMENTS, the save budget]."""
    if chunk_elements is None:
        chunk_elements = min(max(DW_REUSE * R * D, MIN_CHUNK_ELEMENTS), max(budget // itemsize, MIN_CHUNK_ELEMENTS))
    return max(1, chunk_elements // (P * R))


def _chunk(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if t is None else t[rows]


def _patch_sum(y: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[R, b] sums over the patches of ``y [R, b, P]``, weighted by ``mask [b, P]``."""
    return y.sum(2) if mask is None else torch.einsum("rbp,bp->rb", y, mask)


def _pre_activations(w: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """``A^T = w x^T`` ``[R, N]``, contiguous. On the CPU in float64 with a few rows (the non-contrastive
    encoder's R = 2), BLAS runs ``w @ x.T`` ~2.8x slower than ``x @ w.T`` plus the transposing copy
    (5.7 vs 2.2 ms at R = 2, d = 100, N = 32768, one thread); in float32 and at R >= 60 it is the faster one."""
    if x2d.device.type == "cpu" and x2d.dtype == torch.float64 and w.shape[0] <= 8:
        return kb.contiguous((x2d @ w.T).T)[0]
    return w @ x2d.T


def _patch_sum_fwd_torch(x, w, mask, act, teacher_scale, step, student, teacher, sq, save):
    """``save`` runs one chunk (A is then in memory whole anyway) and returns its A^T [R, B*P]."""
    B, P, D = x.shape
    R = w.shape[0]
    for b0 in range(0, B, B if save else step):
        rows = slice(b0, B if save else min(B, b0 + step))
        at = _pre_activations(w, x[rows].reshape(-1, D))  # [R, b*P]
        y = act.value_and_derivative(at, slope=False)[0].view(R, -1, P)
        if teacher is not None and teacher_scale == 1:  # the student's activations, unmasked: no second pass
            teacher[rows] = y.sum(2).T
        elif teacher is not None:  # at is scratch unless it is kept
            scaled = at * teacher_scale if save else at.mul_(teacher_scale)
            teacher[rows] = act.value_and_derivative(scaled, slope=False)[0].view(R, -1, P).sum(2).T
        student[rows] = _patch_sum(y, _chunk(mask, rows)).T
        if sq is not None:
            sq[rows] = _patch_sum(y.square_(), _chunk(mask, rows)).T
    return at if save else None


def _patch_sum_bwd_torch(da_buf, x, w, mask, act, gs, gq, at):
    b, P, D = x.shape
    R = w.shape[0]
    at = (_pre_activations(w, x.reshape(-1, D)) if at is None else at).view(R, b, P)
    if gq is None:
        slope, coeff = act.derivative(at), gs.T.unsqueeze(2)
    else:  # 2 g_squares f(A) (+ g_student), in place on the temporary f(A)
        value, slope = act.value_and_derivative(at)
        coeff = value.mul_(2.0 * gq.T.unsqueeze(2))
        if gs is not None:
            coeff.add_(gs.T.unsqueeze(2))
    da = torch.mul(slope, coeff, out=da_buf[: R * b * P].view(R, b, P))
    if mask is not None:
        da.mul_(mask)
    return da.view(R, b * P)


def _patch_sum_bwd_chunks(chunk_da, x, w, mask, at, act, gs, gq, step, dx, dw):
    """The backward's loop over sample chunks: dA^T of the chunk, then dW (+)= dA^T x_c, dX_c = dA w."""
    B, P, D = x.shape
    da_buf = kb.new_output((min(B, step) * P * w.shape[0],), x)
    for b0 in range(0, B, step):
        rows = slice(b0, min(B, b0 + step))
        flat = slice(b0 * P, rows.stop * P)
        dat = chunk_da(da_buf, x[rows], w, _chunk(mask, rows), act, _chunk(gs, rows), _chunk(gq, rows),
                       None if at is None else at[:, flat])
        if dw is not None and b0 == 0:  # the first chunk writes dW: no zero fill, one read-modify-write fewer
            torch.mm(dat, x[rows].reshape(-1, D), out=dw)
        elif dw is not None:
            dw.addmm_(dat, x[rows].reshape(-1, D))
        if dx is not None:
            torch.mm(dat.T, w, out=dx[flat])


# ----------------------------------------------------------------------------------------------------
# autograd.Function
# ----------------------------------------------------------------------------------------------------
class PatchActivationSumFunction(torch.autograd.Function):
    """``forward(ctx, x, w, mask, act, teacher_scale, squares, chunk_elements, save_bytes, precision,
    backend)`` -> ``(student, teacher, squares)`` (the last two empty when not asked for); saves x, w, mask
    and, when a gradient is wanted and B*P*R*itemsize <= save_bytes, A^T [R, B*P]."""

    @staticmethod
    def forward(ctx, x, w, mask, act, teacher_scale, squares, chunk_elements, save_bytes, precision, backend):
        B, P, D = x.shape
        R = w.shape[0]
        student = kb.new_output((B, R), x)
        teacher = kb.new_output((B, R), x) if teacher_scale is not None else None
        sq = kb.new_output((B, R), x) if squares else None
        wants_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        save = wants_grad and B * P * R * x.element_size() <= save_bytes
        step = _rows_per_chunk(P, R, D, x.element_size(), chunk_elements, save_bytes)
        if backend == "triton":
            at = _patch_sum_fwd_triton(x, w, mask, act, teacher_scale, student, teacher, sq, save, precision)
        else:
            at = _patch_sum_fwd_torch(x, w, mask, act, teacher_scale, step, student, teacher, sq, save)
        teacher = x.new_empty(0) if teacher is None else teacher
        sq = x.new_empty(0) if sq is None else sq
        ctx.save_for_backward(x, w, mask, at)
        ctx.act, ctx.step, ctx.squares, ctx.precision, ctx.backend = act, step, squares, precision, backend
        ctx.mark_non_differentiable(*([teacher] if squares else [teacher, sq]))  # one call: it replaces
        ctx.set_materialize_grads(False)
        return student, teacher, sq

    @staticmethod
    @once_differentiable
    def backward(ctx, g_student, g_teacher, g_squares):
        x, w, mask, at = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gs, gq = g_student, g_squares if ctx.squares else None  # strided views are fine for both backends
        if gs is None and gq is None or not (need_x or need_w):
            return (None,) * 10
        B, P, D = x.shape
        R = w.shape[0]
        dx = kb.new_output((B * P, D), x) if need_x else None
        dw = kb.new_output((R, D), w) if need_w else None
        if ctx.backend == "triton":  # its cuBLAS GEMMs (dW, dX) at the op's input_precision too
            with cublas_precision(ctx.precision):
                _patch_sum_bwd_chunks(partial(_patch_sum_bwd_triton, precision=ctx.precision), x, w, mask, at,
                                      ctx.act, gs, gq, ctx.step, dx, dw)
        else:
            _patch_sum_bwd_chunks(_patch_sum_bwd_torch, x, w, mask, at, ctx.act, gs, gq, ctx.step, dx, dw)
        return None if dx is None else dx.view(B, P, D), dw, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------
class PatchSums(NamedTuple):
    """Outputs of :func:`patch_activation_sum`, each [B, R] or None when not requested."""

    student: torch.Tensor
    teacher: Optional[torch.Tensor]
    squares: Optional[torch.Tensor]


def _validate(x, w, activation, mask, teacher_scale, squares, backend, chunk_elements, save_preactivation_bytes):
    # a float mask weights the sums, so it follows the dtype policy; a bool mask is exact in any dtype
    float_mask = mask if isinstance(mask, torch.Tensor) and mask.dtype.is_floating_point else None
    check_float_inputs("patch_activation_sum", x=x, w=w, mask=float_mask)
    op = "patch_activation_sum"
    if x.dim() != 3 or min(x.shape) < 1:
        refuse_shape(op, "x", x, "must be a non-empty tensor of shape [B, P, d]")
    if w.dim() != 2 or w.shape[0] < 1 or w.shape[1] != x.shape[2]:
        refuse_shape(op, "w", w, f"must be a tensor of shape [R, d] with R >= 1 and d = {x.shape[2]} (from x)")
    if w.device != x.device:
        raise KernelInputError(op, "w", f"is on {w.device}", f"must be on the device of x ({x.device})", str(w.device))
    if not isinstance(activation, Activation):
        raise ConfigError("activation", "a featlearn.kernels.Activation", type(activation).__name__)
    if mask is not None:
        want = f"must be None or a tensor of shape [B, P] = {tuple(x.shape[:2])}"
        if not isinstance(mask, torch.Tensor):
            raise KernelInputError(op, "mask", f"is a {type(mask).__name__}", want, type(mask).__name__)
        if tuple(mask.shape) != tuple(x.shape[:2]):
            refuse_shape(op, "mask", mask, want)
        if mask.device != x.device:
            raise KernelInputError(op, "mask", f"is on {mask.device}", f"must be on the device of x ({x.device})",
                                   str(mask.device))
        if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            raise KernelInputError(op, "mask", f"has dtype {mask.dtype}", "must be a bool or floating tensor",
                                   mask.dtype)
    if teacher_scale is not None:
        ok = isinstance(teacher_scale, numbers.Real) and not isinstance(teacher_scale, bool)
        if not ok or not math.isfinite(float(teacher_scale)):
            raise ConfigError("teacher_scale", "None or a finite real number", teacher_scale)
    if not isinstance(squares, bool):
        raise ConfigError("squares", "a bool", squares)
    for field, value, low, none_ok in (("chunk_elements", chunk_elements, 1, True),
                                       ("save_preactivation_bytes", save_preactivation_bytes, 0, False)):
        if value is None and none_ok:
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
            raise ConfigError(field, ("None or " if none_ok else "") + f"an integer >= {low}", value)
    check_backend(backend)


@kb.profiled
def patch_activation_sum(
    x: torch.Tensor,
    w: torch.Tensor,
    activation: Activation,
    *,
    mask: Optional[torch.Tensor] = None,
    teacher_scale: Optional[float] = None,
    squares: bool = False,
    backend: str = "auto",
    chunk_elements: Optional[int] = None,
    save_preactivation_bytes: int = SAVE_PREACTIVATION_BYTES,
    input_precision: str = "auto",
) -> PatchSums:
    """Sum over patches of f(<w_r, x_p>): student (masked), optional teacher f(tau .) and squares.

    Args:
        x: patches [B, P, d], float32 or float64 (``KernelInputError`` otherwise, see
            ``featlearn.kernels.backend``).
        w: kernels [R, d], same dtype and device.
        activation: the elementwise f.
        mask: optional [B, P] bool, or float weights m[b, p] in the dtype of x, on the student and
            squares sums (not differentiated).
        teacher_scale: tau; when given, ``teacher = sum_p f(tau <w_r, x_p>)`` unmasked and detached.
        squares: also return ``sum_p m f(.)**2`` (differentiable).
        backend: "auto" | "torch" | "triton".
        chunk_elements: bound on the elements of one A-sized chunk (the torch forward when it does not
            save A, and the dA buffer of the backward on both backends); None: sized from R*d
            (``DW_REUSE``, ``MIN_CHUNK_ELEMENTS``) and at most ``save_preactivation_bytes``.
        save_preactivation_bytes: when x or w needs a gradient and A [B*P, R] takes at most this many
            bytes, the forward saves A and the backward reads it instead of recomputing it (one GEMM
            less); 0 never saves.
        input_precision: the Triton ``tl.dot`` precision, ``"auto"`` (TF32 for float32, IEEE for
            float64), ``"tf32"`` or ``"ieee"`` (see ``featlearn.kernels.backend.resolve_precision``).
            The Triton path's backward GEMMs (cuBLAS) use it too; the PyTorch fallback follows
            ``torch.backends.cuda.matmul.allow_tf32``.

    Returns:
        PatchSums(student [B, R], teacher [B, R] or None, squares [B, R] or None), dtype of x.

    Example:
        >>> x, w = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
        >>> out = patch_activation_sum(x, w, Activation("relu"), mask=torch.tensor([[1, 0, 1], [1, 1, 1]]).bool())
        >>> torch.allclose(out.student, patch_activation_sum_reference(x, w, Activation("relu"),
        ...     mask=torch.tensor([[1, 0, 1], [1, 1, 1]]).bool()).student)
        True
    """
    _validate(x, w, activation, mask, teacher_scale, squares, backend, chunk_elements, save_preactivation_bytes)
    precision = resolve_precision(input_precision, x.dtype)
    which = resolve_backend(backend, x, w)
    (m,) = contiguous(None if mask is None else mask.to(x.dtype))
    if which == "triton":
        x, w = contiguous(x, w)
    student, teacher, sq = PatchActivationSumFunction.apply(
        x, w, m, activation, teacher_scale, squares, None if chunk_elements is None else int(chunk_elements),
        int(save_preactivation_bytes), precision, which)
    return PatchSums(student, teacher if teacher_scale is not None else None, sq if squares else None)


# ----------------------------------------------------------------------------------------------------
# float64 reference
# ----------------------------------------------------------------------------------------------------
def patch_activation_sum_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    activation: Activation,
    *,
    mask: Optional[torch.Tensor] = None,
    teacher_scale: Optional[float] = None,
    squares: bool = False,
) -> PatchSums:
    """Plain differentiable PyTorch version (materialises A = x w^T); for tests and small problems.

    Example:
        >>> out = patch_activation_sum_reference(torch.ones(1, 2, 3), torch.ones(1, 3), Activation("pow", q=2))
        >>> out.student
        tensor([[18.]])
    """
    a = torch.einsum("bpd,rd->bpr", x, w)
    y = activation(a)
    m = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if mask is None else mask.to(x.dtype)
    student = (m.unsqueeze(-1) * y).sum(1)
    sq = (m.unsqueeze(-1) * y * y).sum(1) if squares else None
    teacher = activation(teacher_scale * a).sum(1).detach() if teacher_scale is not None else None
    return PatchSums(student, teacher, sq)
