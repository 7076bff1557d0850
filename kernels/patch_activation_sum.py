"""Fused "GEMM + activation + sum over patches": the hot loop of every encoder in featlearn (spec 6.1-6.3).

For patches x[B, P, d], kernels w[R, d] and an activation f, with A[b,p,r] = <w_r, x[b,p]>:

    student[b, r] = sum_p m[b, p] f(A[b, p, r])                 (m = mask as float weights, 1 if None)
    squares[b, r] = sum_p m[b, p] f(A[b, p, r])**2               (only when squares=True)
    teacher[b, r] = sum_p f(teacher_scale * A[b, p, r])           (only with teacher_scale; unmasked,
                                                                   no gradient)

``student`` and ``squares`` are differentiable w.r.t. x and w (not w.r.t. the mask). The [B, P, R]
tensor A is never materialised as a whole.

Backends (``backend="auto"`` picks Triton for CUDA tensors, see ``featlearn.kernels.backend``):

* ``torch``: an autograd.Function working in chunks over B so that one chunk's A holds at most
  ``chunk_elements`` (default 2**24) elements. It saves only x, w and the mask; the backward
  recomputes A per chunk, forms dA = m (g_student + 2 g_squares f(A)) f'(A), accumulates
  dW += dA^T x and writes dX = dA w. Peak extra memory: a few chunk-sized temporaries.
* ``triton``: the forward is one kernel (grid over blocks of B x blocks of R; loop over the P patches,
  and over d in tiles with ``tl.dot`` in fp32/fp64 IEEE precision; the epilogue applies f, f(tau .)
  and f**2 and accumulates the sums over P in registers), writing only the [B, R] outputs.
  Backward design ("dA once + two GEMMs", chunked): for each chunk of samples, a Triton kernel
  recomputes the A tile in registers, forms dA there and writes it once to a chunk buffer
  [chunk*P, R]; then two cuBLAS GEMMs (torch.matmul) give dW += dA^T x_chunk and dX_chunk = dA w.
  Extra memory: one dA chunk of at most ``chunk_elements`` elements (64 MiB in fp32 by default)
  plus dX and dW themselves. Cost: 3 GEMM-equivalents (recompute + 2 grads) and one write + two
  reads of the dA chunk; the fully fused flash-style variant of spec 6.2 would avoid that traffic
  but only fits small d per accumulator tile, so this simpler design is used for any d.

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
from typing import NamedTuple, Optional

import torch
from torch.autograd.function import once_differentiable

from featlearn.errors import ConfigError
from featlearn.kernels.activations import Activation
from featlearn.kernels.backend import check_backend, check_float_inputs, interpreting, resolve_backend

import triton
import triton.language as tl

DEFAULT_CHUNK_ELEMENTS = 2**24


class PatchSums(NamedTuple):
    """Outputs of :func:`patch_activation_sum`, each [B, R] or None when not requested."""

    student: torch.Tensor
    teacher: Optional[torch.Tensor]
    squares: Optional[torch.Tensor]


def _new_output(shape, like: torch.Tensor) -> torch.Tensor:
    """Allocate an uninitialised buffer the kernels overwrite completely (tests poison it with NaN)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _rows_per_chunk(P: int, R: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // (P * R))


# ----------------------------------------------------------------------------------------------------
# PyTorch fallback
# ----------------------------------------------------------------------------------------------------
def _chunk_forward(xc, w, mc, act, teacher_scale, squares):
    a = xc @ w.T  # [b, P, R]
    y = act(a)
    s = torch.einsum("bp,bpr->br", mc, y) if mc is not None else y.sum(1)
    q = None
    if squares:
        y2 = y.square_()
        q = torch.einsum("bp,bpr->br", mc, y2) if mc is not None else y2.sum(1)
    t = act(a.mul_(teacher_scale)).sum(1) if teacher_scale is not None else None
    return s, t, q


def _save_context(ctx, x, w, mask, act, squares, chunk_elements, teacher, sq) -> None:
    """What both backends' backward needs; teacher (and squares when not asked for) get no gradient."""
    ctx.save_for_backward(x, w, mask)
    ctx.act, ctx.chunk_elements, ctx.squares = act, chunk_elements, squares
    ctx.mark_non_differentiable(*([teacher] if squares else [teacher, sq]))  # one call: it replaces
    ctx.set_materialize_grads(False)


def _backward_inputs(ctx, g_student, g_squares):
    """``(x, w, mask, g_squares, need_x, need_w)``, or None when no input needs a gradient."""
    x, w, mask = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not ctx.squares:
        g_squares = None
    if g_student is None and g_squares is None or not (need_x or need_w):
        return None
    return x, w, mask, g_squares, need_x, need_w


class _TorchPatchSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, mask, act, teacher_scale, squares, chunk_elements):
        B, P, _ = x.shape
        R = w.shape[0]
        student = _new_output((B, R), x)
        teacher = _new_output((B, R), x) if teacher_scale is not None else x.new_empty(0)
        sq = _new_output((B, R), x) if squares else x.new_empty(0)
        step = _rows_per_chunk(P, R, chunk_elements)
        for b0 in range(0, B, step):
            sl = slice(b0, min(B, b0 + step))
            s, t, q = _chunk_forward(x[sl], w, None if mask is None else mask[sl], act, teacher_scale, squares)
            student[sl] = s
            if t is not None:
                teacher[sl] = t
            if q is not None:
                sq[sl] = q
        _save_context(ctx, x, w, mask, act, squares, chunk_elements, teacher, sq)
        return student, teacher, sq

    @staticmethod
    @once_differentiable
    def backward(ctx, g_student, g_teacher, g_squares):
        inputs = _backward_inputs(ctx, g_student, g_squares)
        if inputs is None:
            return None, None, None, None, None, None, None
        x, w, mask, g_squares, need_x, need_w = inputs
        act = ctx.act
        B, P, d = x.shape
        R = w.shape[0]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros_like(w) if need_w else None
        step = _rows_per_chunk(P, R, ctx.chunk_elements)
        for b0 in range(0, B, step):
            sl = slice(b0, min(B, b0 + step))
            xc = x[sl]
            a = xc @ w.T
            coeff = None
            if g_student is not None:
                coeff = g_student[sl].unsqueeze(1).expand(-1, P, -1)
            if g_squares is not None:
                c2 = 2.0 * g_squares[sl].unsqueeze(1) * act(a)
                coeff = c2 if coeff is None else c2.add_(coeff)
            da = act.derivative(a).mul_(coeff)
            if mask is not None:
                da.mul_(mask[sl].unsqueeze(-1))
            if need_w:
                dw.addmm_(da.reshape(-1, R).T, xc.reshape(-1, d))
            if need_x:
                dx[sl] = da @ w
        return dx, dw, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _ipow(z, N: tl.constexpr):
    r = z * 0.0 + 1.0
    for _ in tl.static_range(N):
        r = r * z
    return r


@triton.jit
def _act(z, ACT: tl.constexpr, Q: tl.constexpr, rho, coef):
    if ACT == 0:  # smoothed ReLU: clamp(z,0,rho)^q / (q rho^(q-1)) + max(z - rho, 0)
        c = tl.minimum(tl.maximum(z, 0.0), rho)
        out = _ipow(c, Q) * coef + tl.maximum(z - rho, 0.0)
    elif ACT == 1:  # relu
        out = tl.maximum(z, 0.0)
    else:  # z ** q
        out = _ipow(z, Q)
    return out


@triton.jit
def _dact(z, ACT: tl.constexpr, Q: tl.constexpr, rho, inv_rho):
    if ACT == 0:  # (clamp(z,0,rho)/rho)^(q-1)
        c = tl.minimum(tl.maximum(z, 0.0), rho) * inv_rho
        out = _ipow(c, Q - 1)
    elif ACT == 1:
        out = tl.where(z > 0.0, 1.0, 0.0).to(z.dtype)
    else:
        out = _ipow(z, Q - 1) * Q
    return out


@triton.jit
def _fwd_kernel(
    x_ptr, w_ptr, m_ptr, prm_ptr, s_ptr, t_ptr, q_ptr,
    B, P, D, R,
    sxb, sxp, sxd, swr, swd, smb, smp, sob, sor,
    ACT: tl.constexpr, Q: tl.constexpr, ACC: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_TEACHER: tl.constexpr, HAS_SQUARES: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_r = tl.program_id(1)
    offs_b = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    offs_r = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    b_ok = offs_b < B
    r_ok = offs_r < R
    rho = tl.load(prm_ptr)
    coef = tl.load(prm_ptr + 1)
    tau = tl.load(prm_ptr + 3)
    s_acc = tl.zeros((BLOCK_B, BLOCK_R), dtype=ACC)
    t_acc = tl.zeros((BLOCK_B, BLOCK_R), dtype=ACC)
    q_acc = tl.zeros((BLOCK_B, BLOCK_R), dtype=ACC)
    for p in range(0, P):
        a = tl.zeros((BLOCK_B, BLOCK_R), dtype=ACC)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            d_ok = dd < D
            xt = tl.load(x_ptr + offs_b[:, None] * sxb + p * sxp + dd[None, :] * sxd,
                         mask=b_ok[:, None] & d_ok[None, :], other=0.0)
            wt = tl.load(w_ptr + dd[:, None] * swd + offs_r[None, :] * swr,
                         mask=d_ok[:, None] & r_ok[None, :], other=0.0)
            a = tl.dot(xt, wt, a, input_precision="ieee")
        y = _act(a, ACT, Q, rho, coef)
        if HAS_MASK:
            mv = tl.load(m_ptr + offs_b * smb + p * smp, mask=b_ok, other=0.0).to(ACC)
            my = mv[:, None] * y
            s_acc += my
            if HAS_SQUARES:
                q_acc += my * y
        else:
            s_acc += y
            if HAS_SQUARES:
                q_acc += y * y
        if HAS_TEACHER:
            t_acc += _act(a * tau, ACT, Q, rho, coef)
    out_off = offs_b[:, None] * sob + offs_r[None, :] * sor
    out_ok = b_ok[:, None] & r_ok[None, :]
    tl.store(s_ptr + out_off, s_acc.to(s_ptr.dtype.element_ty), mask=out_ok)
    if HAS_TEACHER:
        tl.store(t_ptr + out_off, t_acc.to(t_ptr.dtype.element_ty), mask=out_ok)
    if HAS_SQUARES:
        tl.store(q_ptr + out_off, q_acc.to(q_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def _dA_kernel(
    x_ptr, w_ptr, m_ptr, prm_ptr, gs_ptr, gq_ptr, da_ptr,
    M, P, D, R,
    sxm, sxd, swr, swd, sgb, sgr, sqb, sqr, sdm, sdr,
    ACT: tl.constexpr, Q: tl.constexpr, ACC: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_GS: tl.constexpr, HAS_GQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # rows m of the chunk are flattened (sample, patch) pairs: sample = m // P
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_r = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    m_ok = offs_m < M
    r_ok = offs_r < R
    rho = tl.load(prm_ptr)
    coef = tl.load(prm_ptr + 1)
    inv_rho = tl.load(prm_ptr + 2)
    a = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + offs_d
        d_ok = dd < D
        xt = tl.load(x_ptr + offs_m[:, None] * sxm + dd[None, :] * sxd,
                     mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        wt = tl.load(w_ptr + dd[:, None] * swd + offs_r[None, :] * swr,
                     mask=d_ok[:, None] & r_ok[None, :], other=0.0)
        a = tl.dot(xt, wt, a, input_precision="ieee")
    ok = m_ok[:, None] & r_ok[None, :]
    b_idx = (offs_m // P)[:, None]
    coeff = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    if HAS_GS:
        coeff += tl.load(gs_ptr + b_idx * sgb + offs_r[None, :] * sgr, mask=ok, other=0.0).to(ACC)
    if HAS_GQ:
        gq = tl.load(gq_ptr + b_idx * sqb + offs_r[None, :] * sqr, mask=ok, other=0.0).to(ACC)
        coeff += 2.0 * gq * _act(a, ACT, Q, rho, coef)
    da = coeff * _dact(a, ACT, Q, rho, inv_rho)
    if HAS_MASK:
        mv = tl.load(m_ptr + offs_m, mask=m_ok, other=0.0).to(ACC)
        da = da * mv[:, None]
    tl.store(da_ptr + offs_m[:, None] * sdm + offs_r[None, :] * sdr, da.to(da_ptr.dtype.element_ty), mask=ok)


def _block(n: int, lo: int, hi: int) -> int:
    """Power-of-two tile size covering n, clamped to [lo, hi] (lo >= 16 keeps tl.dot legal)."""
    b = lo
    while b < n and b < hi:
        b *= 2
    return b


def _params(act: Activation, teacher_scale, like: torch.Tensor) -> torch.Tensor:
    rho = act.rho
    tau = 1.0 if teacher_scale is None else float(teacher_scale)
    vals = [rho, 1.0 / (act.q * rho ** (act.q - 1)), 1.0 / rho, tau]
    return torch.tensor(vals, dtype=like.dtype, device=like.device)


def _launch_opts():
    # the interpreter runs every program in Python: fewer, larger tiles are much faster there
    return {} if interpreting() else {"num_warps": 4, "num_stages": 3}


class _TritonPatchSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, mask, act, teacher_scale, squares, chunk_elements):
        B, P, D = x.shape
        R = w.shape[0]
        acc = tl.float64 if x.dtype == torch.float64 else tl.float32
        prm = _params(act, teacher_scale, x)
        student = _new_output((B, R), x)
        teacher = _new_output((B, R), x) if teacher_scale is not None else x.new_empty(0)
        sq = _new_output((B, R), x) if squares else x.new_empty(0)
        m = mask if mask is not None else x.new_empty(0)
        hi_b, hi_r, hi_d = (64, 64, 64) if interpreting() else (64, 64, 32)
        BB, BR, BD = _block(B, 16, hi_b), _block(R, 16, hi_r), _block(D, 16, hi_d)
        grid = (triton.cdiv(B, BB), triton.cdiv(R, BR))
        _fwd_kernel[grid](
            x, w, m, prm, student, teacher, sq,
            B, P, D, R,
            x.stride(0), x.stride(1), x.stride(2), w.stride(0), w.stride(1),
            m.stride(0) if mask is not None else 0, m.stride(1) if mask is not None else 0,
            student.stride(0), student.stride(1),
            ACT=act.kind, Q=act.q, ACC=acc,
            HAS_MASK=mask is not None, HAS_TEACHER=teacher_scale is not None, HAS_SQUARES=bool(squares),
            BLOCK_B=BB, BLOCK_R=BR, BLOCK_D=BD, **_launch_opts(),
        )
        _save_context(ctx, x, w, mask, act, squares, chunk_elements, teacher, sq)
        ctx.prm = prm
        return student, teacher, sq

    @staticmethod
    @once_differentiable
    def backward(ctx, g_student, g_teacher, g_squares):
        inputs = _backward_inputs(ctx, g_student, g_squares)
        if inputs is None:
            return None, None, None, None, None, None, None
        x, w, mask, g_squares, need_x, need_w = inputs
        act = ctx.act
        B, P, D = x.shape
        R = w.shape[0]
        acc = tl.float64 if x.dtype == torch.float64 else tl.float32
        gs = g_student.contiguous() if g_student is not None else None
        gq = g_squares.contiguous() if g_squares is not None else None
        gs_st = gs.stride() if gs is not None else (0, 0)
        gq_st = gq.stride() if gq is not None else (0, 0)
        x2 = x.reshape(B * P, D)
        m1 = mask.reshape(B * P) if mask is not None else None
        dx = _new_output((B, P, D), x) if need_x else None
        dw = torch.zeros_like(w) if need_w else None
        step = _rows_per_chunk(P, R, ctx.chunk_elements)
        da_buf = _new_output((min(B, step) * P, R), x)
        hi_m, hi_r, hi_d = (64, 64, 64) if interpreting() else (64, 64, 32)
        for b0 in range(0, B, step):
            b1 = min(B, b0 + step)
            rows = slice(b0 * P, b1 * P)
            M = (b1 - b0) * P
            xc = x2[rows]
            da = da_buf[:M]
            BM, BR, BD = _block(M, 16, hi_m), _block(R, 16, hi_r), _block(D, 16, hi_d)
            grid = (triton.cdiv(M, BM), triton.cdiv(R, BR))
            _dA_kernel[grid](
                xc, w, m1[rows] if m1 is not None else x.new_empty(0), ctx.prm,
                gs[b0:b1] if gs is not None else x.new_empty(0),
                gq[b0:b1] if gq is not None else x.new_empty(0), da,
                M, P, D, R,
                xc.stride(0), xc.stride(1), w.stride(0), w.stride(1),
                gs_st[0], gs_st[1], gq_st[0], gq_st[1], da.stride(0), da.stride(1),
                ACT=act.kind, Q=act.q, ACC=acc,
                HAS_MASK=m1 is not None, HAS_GS=gs is not None, HAS_GQ=gq is not None,
                BLOCK_M=BM, BLOCK_R=BR, BLOCK_D=BD, **_launch_opts(),
            )
            if need_w:
                dw.addmm_(da.T, xc)
            if need_x:
                torch.matmul(da, w, out=dx.view(B * P, D)[rows])
        return dx, dw, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------
def _validate(x, w, activation, mask, teacher_scale, squares, backend, chunk_elements):
    # a float mask weights the sums, so it follows the dtype policy; a bool mask is exact in any dtype
    float_mask = mask if isinstance(mask, torch.Tensor) and mask.dtype.is_floating_point else None
    check_float_inputs("patch_activation_sum", x=x, w=w, mask=float_mask)
    if x.dim() != 3 or min(x.shape) < 1:
        raise ConfigError("x", "a non-empty tensor of shape [B, P, d]", tuple(x.shape))
    if w.dim() != 2 or w.shape[0] < 1 or w.shape[1] != x.shape[2]:
        raise ConfigError("w", f"a tensor of shape [R, d] with R >= 1 and d = {x.shape[2]} (from x)",
                          tuple(w.shape))
    if w.device != x.device:
        raise ConfigError("w", f"on the device of x ({x.device})", str(w.device))
    if not isinstance(activation, Activation):
        raise ConfigError("activation", "a featlearn.kernels.Activation", type(activation).__name__)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(x.shape[:2]):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ConfigError("mask", f"None or a tensor of shape [B, P] = {tuple(x.shape[:2])}", got)
        if mask.device != x.device:
            raise ConfigError("mask", f"on the device of x ({x.device})", str(mask.device))
        if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            raise ConfigError("mask", "a bool or floating tensor", mask.dtype)
    if teacher_scale is not None:
        ok = isinstance(teacher_scale, numbers.Real) and not isinstance(teacher_scale, bool)
        if not ok or not math.isfinite(float(teacher_scale)):
            raise ConfigError("teacher_scale", "None or a finite real number", teacher_scale)
    if not isinstance(squares, bool):
        raise ConfigError("squares", "a bool", squares)
    if not isinstance(chunk_elements, numbers.Integral) or isinstance(chunk_elements, bool) or chunk_elements < 1:
        raise ConfigError("chunk_elements", "an integer >= 1", chunk_elements)
    check_backend(backend)


def patch_activation_sum(
    x: torch.Tensor,
    w: torch.Tensor,
    activation: Activation,
    *,
    mask: Optional[torch.Tensor] = None,
    teacher_scale: Optional[float] = None,
    squares: bool = False,
    backend: str = "auto",
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
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
        chunk_elements: bound on the elements of one A-sized chunk (torch forward/backward, and the
            dA buffer of the Triton backward).

    Returns:
        PatchSums(student [B, R], teacher [B, R] or None, squares [B, R] or None), dtype of x.

    Example:
        >>> x, w = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
        >>> out = patch_activation_sum(x, w, Activation("relu"), mask=torch.tensor([[1, 0, 1], [1, 1, 1]]).bool())
        >>> torch.allclose(out.student, patch_activation_sum_reference(x, w, Activation("relu"),
        ...     mask=torch.tensor([[1, 0, 1], [1, 1, 1]]).bool()).student)
        True
    """
    _validate(x, w, activation, mask, teacher_scale, squares, backend, chunk_elements)
    which = resolve_backend(backend, x, w)
    m = mask.to(x.dtype).contiguous() if mask is not None else None
    fn = _TritonPatchSum if which == "triton" else _TorchPatchSum
    if which == "triton":
        x, w = x.contiguous(), w.contiguous()
    student, teacher, sq = fn.apply(x, w, m, activation, teacher_scale, squares, int(chunk_elements))
    return PatchSums(student, teacher if teacher_scale is not None else None, sq if squares else None)


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
