"""Fused batch-norm-normalised cosine loss of non-contrastive learning (spec 004, sections 3.3, 4.1, 7.3 K3).

Online outputs ``p = F [N, m]`` (after the prediction head) and target outputs ``z = G [N, m]`` (stop-grad)
are each normalised and compared by the mean squared error (the paper's eq. 3.3 with the constant fixed
as in spec 004 section 8.1):

* ``out_norm="bn"`` (default): every column is batch-normalised with *batch* statistics (biased variance,
  no affine, no running stats, ``eps`` default 0)::

      L = 1/(m N) sum_i ||BN(F)_i - BN(G)_i||^2  =  2 - (2/m) sum_j rho_j        (eps = 0)

  with ``rho_j`` the batch correlation of column j of F and G.  Gradient (spec 4.2, general eps)::

      dL/dF_ij = 2 a_j / (m N) * ((1 - r_j + rho_j) F~_ij - G~_ij),   a_j = (var F_j + eps)^-1/2,
      r_j = var F_j / (var F_j + eps),  F~ = (F - mu_F) a,  rho_j = mean_i F~_ij G~_ij

  (eps = 0 gives the spec's ``-(2 / (m N sd_j)) (G~ - rho F~)``).
* ``out_norm="l2"``: per-row l2 normalisation (the ablation of Fig. 3): ``L = 1/N sum_i ||F^_i - G^_i||^2``
  with ``F^_i = F_i / sqrt(||F_i||^2 + eps)``, i.e. ``2 - 2 mean_i cos(F_i, G_i)`` at eps = 0.

The target is detached by default (``z`` gets no gradient unless it requires grad: the no-stop-grad
ablation, where the symmetric formula is used).

Layout (Liger-Kernel style):

* ``bn_cosine_loss_reference(p, z, out_norm, eps)``: plain autograd expression, the float64 oracle.
* Triton path: ``_bn_stats_kernel`` (phase A: one pass over p and z; every program reduces its row range
  to column mean / centred second moments / co-moment, merged in registers with Chan's update, so the
  statistics are cancellation-free), a tiny float64 merge of the per-program partials on the host side
  of the graph, and ``_bn_grad_kernel`` (phase B: ``dF = g * (A_j (F - mu_F) - B_j (G - mu_G))`` with
  per-column coefficients). The l2 variant has ``_l2_fwd_kernel`` / ``_l2_grad_kernel`` (row sums over
  column chunks, recomputed in the backward). No N x m temporary is written apart from the gradient.
* PyTorch fallback: the same statistics and coefficients with torch ops.
* ``BNCosineLoss``: the ``autograd.Function`` shared by both backends; ``bn_cosine_loss(...)`` the
  functional API; ``bn_column_stats(...)`` the (global) column statistics for logging.

Dtypes follow the shared policy of ``featlearn.kernels.backend``: p and z both float32 or both float64,
anything else refused up front. Float64 inputs are computed in float64 throughout; float32 inputs are
reduced in float32 in the Triton kernels and merged in float64 (the torch fallback uses float64 statistics).

Data parallelism: when ``torch.distributed`` is initialised (``sync=None``) or ``sync=True``, the
per-rank statistics ``(n, mean, M2, C)`` are all-gathered and merged, so mean / variance / correlation
are those of the concatenated global batch, and ``N`` in the loss is the global batch size. The loss is
then the global loss on every rank and the gradient w.r.t. the local rows is the exact derivative of the
global loss; the backward needs no collective. DDP *averages* parameter gradients over ranks, so a
training step that wants the exact global gradient multiplies the loss it backpropagates by the world
size (``NonContrastiveModule`` does).

Example:
    >>> import torch
    >>> p = torch.randn(64, 4, dtype=torch.float64, requires_grad=True)
    >>> z = torch.randn(64, 4, dtype=torch.float64)
    >>> loss = bn_cosine_loss(p, z, backend="torch")
    >>> ref = bn_cosine_loss_reference(p, z)
    >>> bool(torch.allclose(loss, ref))
    True
    >>> loss.backward()
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from featlearn.errors import ConfigError
from featlearn.kernels.backend import (KernelInputError, check_backend, check_float_inputs, interpreting,
                                       resolve_backend)

import triton
import triton.language as tl

__all__ = [
    "bn_cosine_loss",
    "bn_cosine_loss_reference",
    "bn_column_stats",
    "BNCosineLoss",
    "OUT_NORMS",
]

OUT_NORMS = ("bn", "l2")


# ----------------------------------------------------------------------------------------------
# float64 reference (plain autograd; no data parallelism)
# ----------------------------------------------------------------------------------------------
def bn_cosine_loss_reference(p: torch.Tensor, z: torch.Tensor, out_norm: str = "bn",
                             eps: float = 0.0) -> torch.Tensor:
    """The textbook expression ``mean ||norm(p) - norm(z)||^2`` (see module docstring), autograd only.

    Example:
        >>> p = torch.randn(16, 3, dtype=torch.float64)
        >>> float(bn_cosine_loss_reference(p, p)) < 1e-12
        True
    """
    if out_norm == "bn":
        def norm(t):
            c = t - t.mean(0, keepdim=True)
            return c / torch.sqrt((c * c).mean(0, keepdim=True) + eps)
        return ((norm(p) - norm(z)) ** 2).sum(1).mean() / p.shape[1]
    if out_norm == "l2":
        def norm(t):
            return t / torch.sqrt((t * t).sum(1, keepdim=True) + eps)
        return ((norm(p) - norm(z)) ** 2).sum(1).mean()
    raise ConfigError("out_norm", f"one of {OUT_NORMS}", out_norm)


# ----------------------------------------------------------------------------------------------
# statistics: per-block partials -> merged (Chan et al. parallel variance), optionally all-gathered
# ----------------------------------------------------------------------------------------------
def _merge(counts: torch.Tensor, part: torch.Tensor):
    """Merge block statistics. ``counts [K]``, ``part [5, K, m]`` = (mean_F, mean_G, M2_F, M2_G, C).

    Returns (n, mean_F, mean_G, M2_F, M2_G, C) in float64 over the union of the blocks.
    """
    counts = counts.to(torch.float64)
    part = part.to(torch.float64)
    n = counts.sum()
    w = counts[:, None]
    mf = (w * part[0]).sum(0) / n
    mg = (w * part[1]).sum(0) / n
    df, dg = part[0] - mf, part[1] - mg
    m2f = part[2].sum(0) + (w * df * df).sum(0)
    m2g = part[3].sum(0) + (w * dg * dg).sum(0)
    c = part[4].sum(0) + (w * df * dg).sum(0)
    return n, mf, mg, m2f, m2g, c


def _want_sync(sync: bool | None, group) -> bool:
    if sync is None:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if sync and not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("sync", "False or None when torch.distributed is not initialised", sync)
    return bool(sync)


def _gather_bn(stats, group):
    """All-gather one rank's merged statistics and merge them again (global batch statistics)."""
    n, mf, mg, m2f, m2g, c = stats
    m = mf.numel()
    flat = torch.cat([n.reshape(1), mf, mg, m2f, m2g, c]).to(torch.float64)
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, flat.contiguous(), group=group)
    allv = torch.stack(out)  # [R, 1 + 5m]
    counts = allv[:, 0]
    part = allv[:, 1:].reshape(-1, 5, m).permute(1, 0, 2)
    # merged per-rank (mean, M2, C) have the same algebra as block partials
    return _merge(counts, part)


def _stats_torch(p: torch.Tensor, z: torch.Tensor):
    pf, zf = p.to(torch.float64), z.to(torch.float64)
    n = torch.tensor(float(p.shape[0]), dtype=torch.float64, device=p.device)
    mf, mg = pf.mean(0), zf.mean(0)
    cf, cg = pf - mf, zf - mg
    return n, mf, mg, (cf * cf).sum(0), (cg * cg).sum(0), (cf * cg).sum(0)


def _bn_stats(p, z, backend, sync, group):
    stats = _stats_triton(p, z) if backend == "triton" else _stats_torch(p, z)
    if sync:
        stats = _gather_bn(stats, group)
    return stats


def _l2_partial_torch(p, z, eps):
    pf, zf = p.to(torch.float64), z.to(torch.float64)
    a, b, c = (pf * pf).sum(1), (zf * zf).sum(1), (pf * zf).sum(1)
    per_row = a / (a + eps) + b / (b + eps) - 2 * c / torch.sqrt((a + eps) * (b + eps))
    return per_row.sum()


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _bn_stats_kernel(p_ptr, z_ptr, part_ptr, N, M, NPROG,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, TILES: tl.constexpr,
                     F64: tl.constexpr):
    """Phase A: program (i, j) reduces rows [i*TILES*BLOCK_N, ...) of columns block j to
    (mean_F, mean_G, M2_F, M2_G, C), merging its tiles with Chan's update (no cancellation)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    acc_t = tl.float64 if F64 else tl.float32
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cmask = rm < M
    n_a = tl.zeros((BLOCK_M,), dtype=acc_t)
    mf_a = tl.zeros((BLOCK_M,), dtype=acc_t)
    mg_a = tl.zeros((BLOCK_M,), dtype=acc_t)
    m2f_a = tl.zeros((BLOCK_M,), dtype=acc_t)
    m2g_a = tl.zeros((BLOCK_M,), dtype=acc_t)
    c_a = tl.zeros((BLOCK_M,), dtype=acc_t)
    for t in range(TILES):
        rn = (pid_n * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rn < N
        mask = rmask[:, None] & cmask[None, :]
        offs = rn[:, None] * M + rm[None, :]
        f = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
        g = tl.load(z_ptr + offs, mask=mask, other=0.0).to(acc_t)
        n_b = tl.sum(rmask.to(acc_t), axis=0)
        n_b_safe = tl.maximum(n_b, 1.0)
        mf_b = tl.sum(f, axis=0) / n_b_safe
        mg_b = tl.sum(g, axis=0) / n_b_safe
        xf = tl.where(mask, f - mf_b[None, :], 0.0)
        xg = tl.where(mask, g - mg_b[None, :], 0.0)
        m2f_b = tl.sum(xf * xf, axis=0)
        m2g_b = tl.sum(xg * xg, axis=0)
        c_b = tl.sum(xf * xg, axis=0)
        n = n_a + n_b
        n_safe = tl.maximum(n, 1.0)
        df = mf_b - mf_a
        dg = mg_b - mg_a
        w = n_a * n_b / n_safe
        mf_a = mf_a + df * (n_b / n_safe)
        mg_a = mg_a + dg * (n_b / n_safe)
        m2f_a = m2f_a + m2f_b + df * df * w
        m2g_a = m2g_a + m2g_b + dg * dg * w
        c_a = c_a + c_b + df * dg * w
        n_a = n
    stride = NPROG * M
    base = part_ptr + pid_n * M + rm
    tl.store(base, mf_a, mask=cmask)
    tl.store(base + stride, mg_a, mask=cmask)
    tl.store(base + 2 * stride, m2f_a, mask=cmask)
    tl.store(base + 3 * stride, m2g_a, mask=cmask)
    tl.store(base + 4 * stride, c_a, mask=cmask)

@triton.jit
def _bn_grad_kernel(p_ptr, z_ptr, coef_ptr, dp_ptr, dz_ptr, N, M,
                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NEED_DZ: tl.constexpr,
                    F64: tl.constexpr):
    """Phase B: dF = A (F - mu_F) - B (G - mu_G); dG = A' (G - mu_G) - B (F - mu_F).
    ``coef`` rows: mu_F, mu_G, A, B, A' (per column, grad_output folded in)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    acc_t = tl.float64 if F64 else tl.float32
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cmask = rm < M
    mask = (rn < N)[:, None] & cmask[None, :]
    offs = rn[:, None] * M + rm[None, :]
    f = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
    g = tl.load(z_ptr + offs, mask=mask, other=0.0).to(acc_t)
    mu_f = tl.load(coef_ptr + rm, mask=cmask, other=0.0).to(acc_t)
    mu_g = tl.load(coef_ptr + M + rm, mask=cmask, other=0.0).to(acc_t)
    ca = tl.load(coef_ptr + 2 * M + rm, mask=cmask, other=0.0).to(acc_t)
    cb = tl.load(coef_ptr + 3 * M + rm, mask=cmask, other=0.0).to(acc_t)
    xf = f - mu_f[None, :]
    xg = g - mu_g[None, :]
    dp = ca[None, :] * xf - cb[None, :] * xg
    tl.store(dp_ptr + offs, dp.to(dp_ptr.dtype.element_ty), mask=mask)
    if NEED_DZ:
        cz = tl.load(coef_ptr + 4 * M + rm, mask=cmask, other=0.0).to(acc_t)
        dz = cz[None, :] * xg - cb[None, :] * xf
        tl.store(dz_ptr + offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)

@triton.jit
def _l2_row_sums(p_ptr, z_ptr, rn, rmask, M, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 F64: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    a = tl.zeros((BLOCK_N,), dtype=acc_t)
    b = tl.zeros((BLOCK_N,), dtype=acc_t)
    c = tl.zeros((BLOCK_N,), dtype=acc_t)
    for m0 in range(0, M, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        mask = rmask[:, None] & (rm < M)[None, :]
        offs = rn[:, None] * M + rm[None, :]
        f = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
        g = tl.load(z_ptr + offs, mask=mask, other=0.0).to(acc_t)
        a += tl.sum(f * f, axis=1)
        b += tl.sum(g * g, axis=1)
        c += tl.sum(f * g, axis=1)
    return a, b, c

@triton.jit
def _l2_fwd_kernel(p_ptr, z_ptr, part_ptr, sc_ptr, N, M,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, F64: tl.constexpr):
    """Per-row l2 variant, forward: program i writes sum over its rows of ||F^ - G^||^2.
    ``sc = (eps, scale)`` is read from memory so fp64 runs keep fp64 scalars."""
    pid = tl.program_id(0)
    eps = tl.load(sc_ptr)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rn < N
    a, b, c = _l2_row_sums(p_ptr, z_ptr, rn, rmask, M, BLOCK_N, BLOCK_M, F64)
    a = tl.where(rmask, a, 1.0)  # padding rows: keep the arithmetic finite
    b = tl.where(rmask, b, 1.0)
    loss = a / (a + eps) + b / (b + eps) - 2.0 * c / tl.sqrt((a + eps) * (b + eps))
    tl.store(part_ptr + pid, tl.sum(tl.where(rmask, loss, 0.0), axis=0))

@triton.jit
def _l2_grad_kernel(p_ptr, z_ptr, dp_ptr, dz_ptr, sc_ptr, N, M,
                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NEED_DZ: tl.constexpr,
                    F64: tl.constexpr):
    """Per-row l2 variant, backward (row norms recomputed): dF = s (aF F - bF G)."""
    pid = tl.program_id(0)
    acc_t = tl.float64 if F64 else tl.float32
    eps = tl.load(sc_ptr)
    scale = tl.load(sc_ptr + 1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rn < N
    a, b, c = _l2_row_sums(p_ptr, z_ptr, rn, rmask, M, BLOCK_N, BLOCK_M, F64)
    a = tl.where(rmask, a, 1.0)
    b = tl.where(rmask, b, 1.0)
    na = tl.sqrt(a + eps)
    nb = tl.sqrt(b + eps)
    cross = 2.0 / (na * nb)
    af = scale * (2.0 * eps / ((a + eps) * (a + eps)) + cross * c / (a + eps))
    ag = scale * (2.0 * eps / ((b + eps) * (b + eps)) + cross * c / (b + eps))
    bb = scale * cross
    for m0 in range(0, M, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        mask = rmask[:, None] & (rm < M)[None, :]
        offs = rn[:, None] * M + rm[None, :]
        f = tl.load(p_ptr + offs, mask=mask, other=0.0).to(acc_t)
        g = tl.load(z_ptr + offs, mask=mask, other=0.0).to(acc_t)
        dp = af[:, None] * f - bb[:, None] * g
        tl.store(dp_ptr + offs, dp.to(dp_ptr.dtype.element_ty), mask=mask)
        if NEED_DZ:
            dz = ag[:, None] * g - bb[:, None] * f
            tl.store(dz_ptr + offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)


def _blocks(m: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_M, TILES). Small tiles under the interpreter exercise the masks on odd shapes."""
    if interpreting():
        return 8, 4, 2
    block_m = min(64, max(2, triton.next_power_of_2(m)))
    return max(16, 4096 // block_m), block_m, 4


def _is_f64(t: torch.Tensor) -> bool:
    return t.dtype == torch.float64


def _stats_triton(p: torch.Tensor, z: torch.Tensor):
    n_rows, m = p.shape
    bn, bm, tiles = _blocks(m)
    rows = bn * tiles
    nprog = triton.cdiv(n_rows, rows)
    acc_dtype = torch.float64 if _is_f64(p) else torch.float32
    part = torch.empty((5, nprog, m), dtype=acc_dtype, device=p.device)
    _bn_stats_kernel[(nprog, triton.cdiv(m, bm))](p, z, part, n_rows, m, nprog,
                                                   BLOCK_N=bn, BLOCK_M=bm, TILES=tiles, F64=_is_f64(p))
    counts = (n_rows - rows * torch.arange(nprog, device=p.device)).clamp(0, rows)
    return _merge(counts, part)


# ----------------------------------------------------------------------------------------------
# autograd.Function shared by both backends
# ----------------------------------------------------------------------------------------------
class BNCosineLoss(torch.autograd.Function):
    """``forward(ctx, p, z, out_norm, eps, backend, sync, group) -> scalar loss`` (see module doc)."""

    @staticmethod
    def forward(ctx, p, z, out_norm, eps, backend, sync, group):
        p, z = p.contiguous(), z.contiguous()
        m = p.shape[1]
        if out_norm == "bn":
            n, mf, mg, m2f, m2g, c = _bn_stats(p, z, backend, sync, group)
            vf, vg = m2f / n + eps, m2g / n + eps  # (var + eps)
            rho = (c / n) / torch.sqrt(vf * vg)
            loss = ((m2f / n) / vf + (m2g / n) / vg - 2.0 * rho).sum() / m
            ctx.save_for_backward(p, z, n, mf, mg, vf, vg, rho, m2f / n, m2g / n)
        else:
            if backend == "triton":
                bn, bm, _ = _blocks(m)
                nprog = triton.cdiv(p.shape[0], bn)
                part = torch.empty(nprog, dtype=torch.float64 if _is_f64(p) else torch.float32,
                                   device=p.device)
                sc = torch.tensor([eps, 0.0], dtype=part.dtype, device=p.device)
                _l2_fwd_kernel[(nprog,)](p, z, part, sc, p.shape[0], m,
                                         BLOCK_N=bn, BLOCK_M=bm, F64=_is_f64(p))
                total = part.to(torch.float64).sum()
            else:
                total = _l2_partial_torch(p, z, eps)
            n = torch.tensor(float(p.shape[0]), dtype=torch.float64, device=p.device)
            if sync:
                buf = torch.stack([total, n])
                dist.all_reduce(buf, group=group)
                total, n = buf[0], buf[1]
            loss = total / n
            ctx.save_for_backward(p, z, n)
        ctx.out_norm, ctx.eps, ctx.backend = out_norm, eps, backend
        return loss.to(p.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        need_dp, need_dz = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dp or need_dz):
            return (None,) * 7
        g = grad_out.to(torch.float64)
        if ctx.out_norm == "bn":
            p, z, n, mf, mg, vf, vg, rho, varf, varg = ctx.saved_tensors
            m = p.shape[1]
            af, ag = vf.rsqrt(), vg.rsqrt()
            k = 2.0 * g / (m * n)
            coef_a = k * af * af * (1.0 - varf / vf + rho)
            coef_b = k * af * ag
            coef_az = k * ag * ag * (1.0 - varg / vg + rho)
            dp = torch.empty_like(p) if need_dp or ctx.backend == "triton" else None
            dz = torch.empty_like(z) if need_dz else None
            if ctx.backend == "triton":
                coef = torch.stack([mf, mg, coef_a, coef_b, coef_az]).to(
                    torch.float64 if _is_f64(p) else torch.float32).contiguous()
                bn, bm, _ = _blocks(m)
                grid = (triton.cdiv(p.shape[0], bn), triton.cdiv(m, bm))
                _bn_grad_kernel[grid](p, z, coef, dp, dz if need_dz else dp, p.shape[0], m,
                                      BLOCK_N=bn, BLOCK_M=bm, NEED_DZ=need_dz, F64=_is_f64(p))
            else:
                xf, xg = p.to(torch.float64) - mf, z.to(torch.float64) - mg
                if need_dp:
                    dp = (coef_a * xf - coef_b * xg).to(p.dtype)
                if need_dz:
                    dz = (coef_az * xg - coef_b * xf).to(z.dtype)
        else:
            p, z, n = ctx.saved_tensors
            eps = ctx.eps
            scale = g / n
            dp = torch.empty_like(p) if need_dp or ctx.backend == "triton" else None
            dz = torch.empty_like(z) if need_dz else None
            if ctx.backend == "triton":
                bn, bm, _ = _blocks(p.shape[1])
                sc = torch.stack([torch.full_like(scale, eps), scale]).to(
                    torch.float64 if _is_f64(p) else torch.float32)
                _l2_grad_kernel[(triton.cdiv(p.shape[0], bn),)](
                    p, z, dp, dz if need_dz else dp, sc, p.shape[0], p.shape[1],
                    BLOCK_N=bn, BLOCK_M=bm, NEED_DZ=need_dz, F64=_is_f64(p))
            else:
                pf, zf = p.to(torch.float64), z.to(torch.float64)
                a = (pf * pf).sum(1, keepdim=True)
                b = (zf * zf).sum(1, keepdim=True)
                c = (pf * zf).sum(1, keepdim=True)
                cross = 2.0 / torch.sqrt((a + eps) * (b + eps))
                bb = scale * cross
                if need_dp:
                    af = scale * (2.0 * eps / (a + eps) ** 2 + cross * c / (a + eps))
                    dp = (af * pf - bb * zf).to(p.dtype)
                if need_dz:
                    ag = scale * (2.0 * eps / (b + eps) ** 2 + cross * c / (b + eps))
                    dz = (ag * zf - bb * pf).to(z.dtype)
        return (dp if need_dp else None), dz, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# functional API
# ----------------------------------------------------------------------------------------------
def _check(op, p, z, out_norm, eps):
    check_float_inputs(op, p=p, z=z)
    if out_norm not in OUT_NORMS:
        raise ConfigError("out_norm", f"one of {OUT_NORMS}", out_norm)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise ConfigError("eps", "a finite number >= 0", eps)
    for name, t in (("p", p), ("z", z)):
        if t.dim() != 2:
            raise ConfigError(name, "a 2-D tensor [N, m]", tuple(t.shape))
    if p.shape != z.shape:
        raise ConfigError("z", f"the shape of p {tuple(p.shape)}", tuple(z.shape))
    if p.shape[1] < 1:
        raise ConfigError("p", "at least one column", tuple(p.shape))


# rows the loss needs: batch statistics need two, a per-row norm one
_MIN_ROWS = {"bn": (2, "out_norm='bn' needs N >= 2 rows (batch statistics)"),
             "l2": (1, "out_norm='l2' needs N >= 1 row")}


def _check_rows(op, p, out_norm, sync):
    """Refuse a batch too small for ``out_norm`` up front. Synced: the check would need the global
    size, i.e. a host sync every step, so it is left to the caller (a rank may hold fewer rows)."""
    need, requirement = _MIN_ROWS[out_norm]
    n = p.shape[0]
    if not sync and n < need:
        raise KernelInputError(op, "p", f"has {n} row{'' if n == 1 else 's'}", requirement, n)


def bn_cosine_loss(p: torch.Tensor, z: torch.Tensor, *, out_norm: str = "bn", eps: float = 0.0,
                   sync: bool | None = None, group=None, backend: str = "auto") -> torch.Tensor:
    """Normalised-MSE loss between online ``p [N, m]`` and target ``z [N, m]`` (module docstring).

    Args:
        p: online outputs (after the prediction head); gets the gradient.
        z: target outputs; treated as stop-grad unless ``z.requires_grad`` (no-stop-grad ablation).
            ``p`` and ``z`` are both float32 or both float64 (``KernelInputError`` otherwise, see
            ``featlearn.kernels.backend``); the loss comes back in that dtype.
        out_norm: ``"bn"`` (column batch-norm with batch statistics; needs N >= 2 rows) or ``"l2"``
            (per-row; N >= 1). Too few rows raise ``KernelInputError`` up front (unsynced only: a
            synced call would need the global size on the host).
        eps: added to the variance (bn) / squared row norm (l2); 0 = the theory.
        sync: all-gather the statistics over ``group`` (None: iff torch.distributed is initialised
            with more than one rank).
        backend: ``"auto"`` (Triton on CUDA), ``"torch"`` or ``"triton"``.

    Example:
        >>> p = torch.randn(32, 2, dtype=torch.float64)
        >>> float(bn_cosine_loss(p, p, backend="torch")) < 1e-12
        True
    """
    check_backend(backend)
    _check("bn_cosine_loss", p, z, out_norm, eps)
    backend = resolve_backend(backend, p, z)
    sync = _want_sync(sync, group)
    _check_rows("bn_cosine_loss", p, out_norm, sync)
    if not z.requires_grad:
        z = z.detach()
    return BNCosineLoss.apply(p, z, out_norm, float(eps), backend, sync, group)


@torch.no_grad()
def bn_column_stats(p: torch.Tensor, z: torch.Tensor, *, sync: bool | None = None, group=None,
                    backend: str = "auto") -> dict[str, torch.Tensor]:
    """Global column statistics (float64): ``n, mean_p, mean_z, var_p, var_z, cov, rho``.

    Example:
        >>> s = bn_column_stats(torch.randn(10, 2), torch.randn(10, 2), backend="torch")
        >>> sorted(s)
        ['cov', 'mean_p', 'mean_z', 'n', 'rho', 'var_p', 'var_z']
    """
    check_backend(backend)
    _check("bn_column_stats", p, z, "bn", 0.0)
    backend = resolve_backend(backend, p, z)
    n, mf, mg, m2f, m2g, c = _bn_stats(p.contiguous(), z.contiguous(), backend, _want_sync(sync, group),
                                        group)
    vf, vg = m2f / n, m2g / n
    return {"n": n, "mean_p": mf, "mean_z": mg, "var_p": vf, "var_z": vg, "cov": c / n,
            "rho": (c / n) / torch.sqrt(vf * vg)}
