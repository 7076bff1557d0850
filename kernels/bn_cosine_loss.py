"""Fused batch-norm-normalised cosine loss of non-contrastive learning (Wen & Li 2022, eq. 3.1, 3.3, A.1).

Online outputs ``p = F [N, m]`` (after the prediction head) and target outputs ``z = G [N, m]`` (stop-grad)
are each normalised and compared by the mean squared error (the paper's eq. 3.3 with its constant fixed
to agree with the batch-norm outputs and with eq. A.1):

* ``out_norm="bn"`` (default): every column is batch-normalised with *batch* statistics (biased variance,
  no affine, no running stats, ``eps`` default 0)::

      L = 1/(m N) sum_i ||BN(F)_i - BN(G)_i||^2  =  2 - (2/m) sum_j rho_j        (eps = 0)

  with ``rho_j`` the batch correlation of column j of F and G.  Gradient (general eps)::

      dL/dF_ij = 2 a_j / (m N) * ((1 - r_j + rho_j) F~_ij - G~_ij),   a_j = (var F_j + eps)^-1/2,
      r_j = var F_j / (var F_j + eps),  F~ = (F - mu_F) a,  rho_j = mean_i F~_ij G~_ij

  (eps = 0 gives ``-(2 / (m N sd_j)) (G~ - rho F~)``).
* ``out_norm="l2"``: per-row l2 normalisation (the ablation of Fig. 3): ``L = 1/N sum_i ||F^_i - G^_i||^2``
  with ``F^_i = F_i / sqrt(||F_i||^2 + eps)``, i.e. ``2 - 2 mean_i cos(F_i, G_i)`` at eps = 0.

The target is detached by default (``z`` gets no gradient unless it requires grad: the no-stop-grad
ablation, where the symmetric formula is used).

Backends (``backend="auto"`` picks Triton for CUDA tensors); the per-column (bn) or per-row (l2)
coefficients of the gradient are formed in float64 on both:

* ``triton``: bn: one pass over p and z in which every program reduces its row range to column mean /
  centred second moments / co-moment, merged in registers with Chan's update (cancellation-free), a
  second small kernel that merges the per-program partials per column in float64, and a backward
  ``dF = g (A_j (F - mu_F) - B_j (G - mu_G))`` that reads grad_output ``g`` from the device.
  l2: per-row losses from row sums over column chunks, recomputed in the backward. Nothing N x m is
  written apart from the gradient (l2 forward: one float per row); one read of p, z per pass.
  Host-side ops per step (bn, unsynced): 2 launches and ~19 float64 ops on [m]-sized tensors in the
  forward (loss and backward coefficients, ``_bn_loss_and_coefficients``), 1 launch and none in the
  backward (was ~72 ops). They stay on the host side because the synced path forms the same
  coefficients after the all-gather; folding them into the merge kernel would duplicate the formulas.
  No host-to-device copy: N is a Python number unless it comes from the all-gather.
* ``torch``: the same statistics and coefficients with float64 torch ops.

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

Length (~500 lines): two normalisations (bn, l2) x two backends, Chan merging and the DDP all-gather.

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
from functools import partial

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from featlearn.errors import ConfigError
from featlearn.kernels import backend as kb  # kb.new_output: one allocation seam for every op
from featlearn.kernels.backend import (KernelInputError, acc_dtype, autotune, check_backend,
                                       check_float_inputs, contiguous, refuse_shape, resolve_backend, tile_grid,
                                       tiles_by_precision)

__all__ = ["bn_cosine_loss", "bn_cosine_loss_reference", "bn_column_stats", "BNCosineLossFunction", "OUT_NORMS"]

OUT_NORMS = ("bn", "l2")
# (BLOCK_N rows, BLOCK_M columns, num_warps, num_stages) of the streaming kernels; the interpreter's
# 8 x 4 tiles exercise the masks on the tests' odd shapes
_TILES = ((64, 64, 4, 2), (128, 32, 4, 2), (32, 128, 4, 2), (128, 64, 8, 2), (256, 16, 4, 2),
          # for the float64 l2 kernels, whose three row sums per tile row spill on the tiles above
          (32, 32, 4, 2), (64, 16, 4, 2), (16, 64, 4, 2), (64, 32, 8, 2))
# What each kernel builds spill-free for sm_90 (`featlearn gpu compile --all-configs`,
# benchmarks/results/gpu/): the l2 kernels in float64 only on the small tiles (the others spill 380-960
# bytes), the float32 l2 forward not at 128 x 32 (16 bytes), the bn kernels in float64 not at 128 x 64.
_LARGE, _SMALL = [t[:2] for t in _TILES[:5]], [t[:2] for t in _TILES[5:]]
_STATS_FITS = tiles_by_precision(tf32=_LARGE, ieee=_LARGE, fp64=[t for t in _LARGE if t != (128, 64)])
_BWD_BN_FITS = tiles_by_precision(tf32=_LARGE, ieee=_LARGE, fp64=[t for t in _LARGE if t != (128, 64)])
_FWD_L2_FITS = tiles_by_precision(tf32=_LARGE, ieee=[t for t in _LARGE if t != (128, 32)], fp64=_SMALL)
_BWD_L2_FITS = tiles_by_precision(tf32=_LARGE, ieee=_LARGE, fp64=_SMALL)
_INTERPRETER_TILE = (8, 4)
# rows one statistics program reduces: fixed, and a multiple of every BLOCK_N, so that the number of
# partials does not depend on the config autotune picks; the same under the interpreter (whose 8-row tile
# loops over them), so that the kernel it runs is the one a GPU compiles
_STATS_ROWS = 2 * max(t[0] for t in _TILES)
# the merge of the row-block partials: one program per BLOCK_M columns, a loop over the blocks
_MERGE_TILES = ((128, 4, 1), (256, 4, 1), (64, 2, 1))
# autotune keys: the column count only. N is the batch (train, validation and test batches differ and
# would each start a search); the tiles stream rows, so N does not change which one is best.
_streaming = partial(autotune, ("BLOCK_N", "BLOCK_M"), _TILES, _INTERPRETER_TILE)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _bn_cosine_load(p_ptr, z_ptr, rn, rm, N, M, ACC: tl.constexpr):
    """Tiles [rows rn, columns rm] of p and z (zero outside), their mask and offsets."""
    mask = (rn < N)[:, None] & (rm < M)[None, :]
    offs = rn.to(tl.int64)[:, None] * M + rm[None, :]  # N * M can pass 2^31
    f = tl.load(p_ptr + offs, mask=mask, other=0.0).to(ACC)
    g = tl.load(z_ptr + offs, mask=mask, other=0.0).to(ACC)
    return f, g, mask, offs


@_streaming(key=["M"], fits=_STATS_FITS)
@triton.jit
def _bn_cosine_fwd_stats_kernel(p_ptr, z_ptr, part_ptr, N, M, NPROG, ROWS: tl.constexpr, ACC: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program (i, j) reduces rows [i*ROWS, (i+1)*ROWS) of column block j to
    (mean_F, mean_G, M2_F, M2_G, C), merging its tiles with Chan's update (no cancellation)."""
    tl.static_assert(ROWS % BLOCK_N == 0)
    pid_n = tl.program_id(0)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_a = tl.zeros((BLOCK_M,), dtype=ACC)
    mf_a = tl.zeros((BLOCK_M,), dtype=ACC)
    mg_a = tl.zeros((BLOCK_M,), dtype=ACC)
    m2f_a = tl.zeros((BLOCK_M,), dtype=ACC)
    m2g_a = tl.zeros((BLOCK_M,), dtype=ACC)
    c_a = tl.zeros((BLOCK_M,), dtype=ACC)
    for t in range(ROWS // BLOCK_N):
        rn = pid_n * ROWS + t * BLOCK_N + tl.arange(0, BLOCK_N)
        f, g, mask, _ = _bn_cosine_load(p_ptr, z_ptr, rn, rm, N, M, ACC)
        n_b = tl.sum((rn < N).to(ACC), axis=0)
        n_b_safe = tl.maximum(n_b, 1.0)
        mf_b = tl.sum(f, axis=0) / n_b_safe
        mg_b = tl.sum(g, axis=0) / n_b_safe
        xf = tl.where(mask, f - mf_b[None, :], 0.0)
        xg = tl.where(mask, g - mg_b[None, :], 0.0)
        n = n_a + n_b
        n_safe = tl.maximum(n, 1.0)
        df = mf_b - mf_a
        dg = mg_b - mg_a
        w = n_a * n_b / n_safe
        mf_a = mf_a + df * (n_b / n_safe)
        mg_a = mg_a + dg * (n_b / n_safe)
        m2f_a = m2f_a + tl.sum(xf * xf, axis=0) + df * df * w
        m2g_a = m2g_a + tl.sum(xg * xg, axis=0) + dg * dg * w
        c_a = c_a + tl.sum(xf * xg, axis=0) + df * dg * w
        n_a = n
    stride = NPROG * M
    base = part_ptr + pid_n * M + rm
    cmask = rm < M
    tl.store(base, mf_a, mask=cmask)
    tl.store(base + stride, mg_a, mask=cmask)
    tl.store(base + 2 * stride, m2f_a, mask=cmask)
    tl.store(base + 3 * stride, m2g_a, mask=cmask)
    tl.store(base + 4 * stride, c_a, mask=cmask)


@autotune(("BLOCK_M",), _MERGE_TILES, (4,), key=["M"])
@triton.jit
def _bn_cosine_fwd_merge_kernel(part_ptr, stats_ptr, N, M, NPROG, ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Merge the NPROG row-block partials of each column (Chan's update, float64) into
    ``stats [5, M]`` = (mean_F, mean_G, M2_F, M2_G, C) of all N rows; block k holds min(ROWS, N - k ROWS)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cmask = rm < M
    n_a = tl.zeros((BLOCK_M,), dtype=tl.float64)
    mf_a = tl.zeros((BLOCK_M,), dtype=tl.float64)
    mg_a = tl.zeros((BLOCK_M,), dtype=tl.float64)
    m2f_a = tl.zeros((BLOCK_M,), dtype=tl.float64)
    m2g_a = tl.zeros((BLOCK_M,), dtype=tl.float64)
    c_a = tl.zeros((BLOCK_M,), dtype=tl.float64)
    stride = NPROG * M
    for k in range(0, NPROG):
        base = part_ptr + k * M + rm
        n_b = tl.minimum(N - k * ROWS, ROWS).to(tl.float64)
        n = n_a + n_b
        df = tl.load(base, mask=cmask, other=0.0).to(tl.float64) - mf_a
        dg = tl.load(base + stride, mask=cmask, other=0.0).to(tl.float64) - mg_a
        w = n_a * n_b / n
        mf_a = mf_a + df * (n_b / n)
        mg_a = mg_a + dg * (n_b / n)
        m2f_a = m2f_a + tl.load(base + 2 * stride, mask=cmask, other=0.0).to(tl.float64) + df * df * w
        m2g_a = m2g_a + tl.load(base + 3 * stride, mask=cmask, other=0.0).to(tl.float64) + dg * dg * w
        c_a = c_a + tl.load(base + 4 * stride, mask=cmask, other=0.0).to(tl.float64) + df * dg * w
        n_a = n
    tl.store(stats_ptr + rm, mf_a, mask=cmask)
    tl.store(stats_ptr + M + rm, mg_a, mask=cmask)
    tl.store(stats_ptr + 2 * M + rm, m2f_a, mask=cmask)
    tl.store(stats_ptr + 3 * M + rm, m2g_a, mask=cmask)
    tl.store(stats_ptr + 4 * M + rm, c_a, mask=cmask)


@_streaming(key=["M", "NEED_DZ"], fits=_BWD_BN_FITS)
@triton.jit
def _bn_cosine_bwd_bn_kernel(p_ptr, z_ptr, coef_ptr, gout_ptr, dp_ptr, dz_ptr, N, M, NEED_DZ: tl.constexpr,
                             ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """dF = g (A (F - mu_F) - B (G - mu_G)); dG = g (A' (G - mu_G) - B (F - mu_F)), g = grad_output.
    ``coef`` (float64) rows: mu_F, mu_G, A, B, A' per column; g is folded in here, in float64."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cmask = rm < M
    gout = tl.load(gout_ptr).to(tl.float64)  # stays on the device: no host sync
    f, g, mask, offs = _bn_cosine_load(p_ptr, z_ptr, rn, rm, N, M, ACC)
    xf = f - tl.load(coef_ptr + rm, mask=cmask, other=0.0).to(ACC)[None, :]
    xg = g - tl.load(coef_ptr + M + rm, mask=cmask, other=0.0).to(ACC)[None, :]
    ca = (gout * tl.load(coef_ptr + 2 * M + rm, mask=cmask, other=0.0)).to(ACC)[None, :]
    cb = (gout * tl.load(coef_ptr + 3 * M + rm, mask=cmask, other=0.0)).to(ACC)[None, :]
    tl.store(dp_ptr + offs, (ca * xf - cb * xg).to(dp_ptr.dtype.element_ty), mask=mask)
    if NEED_DZ:
        cz = (gout * tl.load(coef_ptr + 4 * M + rm, mask=cmask, other=0.0)).to(ACC)[None, :]
        tl.store(dz_ptr + offs, (cz * xg - cb * xf).to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bn_cosine_l2_row_sums(p_ptr, z_ptr, rn, N, M, ACC: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_M: tl.constexpr):
    """Row sums ||F_i||^2, ||G_i||^2, <F_i, G_i>; padding rows get norms 1 to keep the arithmetic finite."""
    a = tl.zeros((BLOCK_N,), dtype=ACC)
    b = tl.zeros((BLOCK_N,), dtype=ACC)
    c = tl.zeros((BLOCK_N,), dtype=ACC)
    for m0 in range(0, M, BLOCK_M):
        f, g, _, _ = _bn_cosine_load(p_ptr, z_ptr, rn, m0 + tl.arange(0, BLOCK_M), N, M, ACC)
        a += tl.sum(f * f, axis=1)
        b += tl.sum(g * g, axis=1)
        c += tl.sum(f * g, axis=1)
    return tl.where(rn < N, a, 1.0), tl.where(rn < N, b, 1.0), c


@_streaming(key=["M"], fits=_FWD_L2_FITS)
@triton.jit
def _bn_cosine_fwd_l2_kernel(p_ptr, z_ptr, loss_ptr, eps: tl.float64, N, M, ACC: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per-row l2 variant: loss_i = ||F^_i - G^_i||^2 (one float per row, summed in float64 on the host)."""
    eps = tl.full((), eps, ACC)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    a, b, c = _bn_cosine_l2_row_sums(p_ptr, z_ptr, rn, N, M, ACC, BLOCK_N, BLOCK_M)
    loss = a / (a + eps) + b / (b + eps) - 2.0 * c / tl.sqrt((a + eps) * (b + eps))
    tl.store(loss_ptr + rn, loss.to(loss_ptr.dtype.element_ty), mask=rn < N)


@_streaming(key=["M", "NEED_DZ"], fits=_BWD_L2_FITS)
@triton.jit
def _bn_cosine_bwd_l2_kernel(p_ptr, z_ptr, dp_ptr, dz_ptr, scale_ptr, eps: tl.float64, N, M,
                             NEED_DZ: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_M: tl.constexpr):
    """Per-row l2 variant, backward (row norms recomputed): dF = s (aF F - bF G)."""
    eps = tl.full((), eps, ACC)
    scale = tl.load(scale_ptr).to(ACC)  # grad_output / N stays on the device: no host sync
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    a, b, c = _bn_cosine_l2_row_sums(p_ptr, z_ptr, rn, N, M, ACC, BLOCK_N, BLOCK_M)
    cross = 2.0 / (tl.sqrt(a + eps) * tl.sqrt(b + eps))
    af = (scale * (2.0 * eps / ((a + eps) * (a + eps)) + cross * c / (a + eps)))[:, None]
    ag = (scale * (2.0 * eps / ((b + eps) * (b + eps)) + cross * c / (b + eps)))[:, None]
    bb = (scale * cross)[:, None]
    for m0 in range(0, M, BLOCK_M):
        f, g, mask, offs = _bn_cosine_load(p_ptr, z_ptr, rn, m0 + tl.arange(0, BLOCK_M), N, M, ACC)
        tl.store(dp_ptr + offs, (af * f - bb * g).to(dp_ptr.dtype.element_ty), mask=mask)
        if NEED_DZ:
            tl.store(dz_ptr + offs, (ag * g - bb * f).to(dz_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# launchers and PyTorch fallback. Forward: the per-rank part of the loss in float64 -- bn: column
# statistics ``[5, m]`` = (mean_F, mean_G, M2_F, M2_G, C) over this rank's rows; l2: the sum of the
# per-row losses. Backward: (dp, dz) from the float64 coefficients and grad_output (a 0-d tensor) --
# bn: ``[5, m]`` rows (mu_F, mu_G, A, B, A'); l2: the scale grad_out / N.
# ----------------------------------------------------------------------------------------------
def _bn_cosine_fwd_triton(p, z, out_norm, eps):
    n_rows, m = p.shape
    if out_norm == "l2":
        loss_rows = kb.new_output((n_rows,), p)
        _bn_cosine_fwd_l2_kernel[tile_grid((n_rows, "BLOCK_N"))](p, z, loss_rows, eps, n_rows, m, ACC=acc_dtype(p))
        return loss_rows.sum(dtype=torch.float64)
    nprog = triton.cdiv(n_rows, _STATS_ROWS)
    part = kb.new_output((5, nprog, m), p)
    _bn_cosine_fwd_stats_kernel[tile_grid(nprog, (m, "BLOCK_M"))](p, z, part, n_rows, m, nprog, ROWS=_STATS_ROWS,
                                                                  ACC=acc_dtype(p))
    stats = kb.new_output((5, m), p, torch.float64)
    _bn_cosine_fwd_merge_kernel[tile_grid((m, "BLOCK_M"))](part, stats, n_rows, m, nprog, ROWS=_STATS_ROWS)
    return stats


def _bn_cosine_bwd_triton(p, z, out_norm, coef, grad_out, eps, need_dp, need_dz):
    n_rows, m = p.shape
    dp = kb.new_output((n_rows, m), p)  # the kernels always write dp
    dz = kb.new_output((n_rows, m), z) if need_dz else None
    if out_norm == "bn":
        _bn_cosine_bwd_bn_kernel[tile_grid((n_rows, "BLOCK_N"), (m, "BLOCK_M"))](
            p, z, coef, grad_out, dp, dp if dz is None else dz, n_rows, m, NEED_DZ=need_dz, ACC=acc_dtype(p))
    else:
        _bn_cosine_bwd_l2_kernel[tile_grid((n_rows, "BLOCK_N"))](
            p, z, dp, dp if dz is None else dz, coef, eps, n_rows, m, NEED_DZ=need_dz, ACC=acc_dtype(p))
    return (dp if need_dp else None), dz


def _bn_cosine_fwd_torch(p, z, out_norm, eps):
    pf, zf = p.to(torch.float64), z.to(torch.float64)
    if out_norm == "l2":
        a, b, c = (pf * pf).sum(1), (zf * zf).sum(1), (pf * zf).sum(1)
        return (a / (a + eps) + b / (b + eps) - 2 * c / torch.sqrt((a + eps) * (b + eps))).sum()
    means = torch.stack([pf.mean(0), zf.mean(0)])
    cf, cg = pf - means[0], zf - means[1]
    return torch.cat([means, torch.stack([(cf * cf).sum(0), (cg * cg).sum(0), (cf * cg).sum(0)])])


def _bn_cosine_bwd_torch(p, z, out_norm, coef, grad_out, eps, need_dp, need_dz):
    pf, zf = p.to(torch.float64), z.to(torch.float64)
    if out_norm == "bn":
        g = grad_out.to(torch.float64)
        mf, mg, coef_a, coef_b, coef_az = coef
        xf, xg = pf - mf, zf - mg
        dp = g * (coef_a * xf - coef_b * xg) if need_dp else None
        dz = g * (coef_az * xg - coef_b * xf) if need_dz else None
    else:
        a, b, c = (pf * pf).sum(1, keepdim=True), (zf * zf).sum(1, keepdim=True), (pf * zf).sum(1, keepdim=True)
        cross = 2.0 / torch.sqrt((a + eps) * (b + eps))
        bb = coef * cross
        dp = coef * (2.0 * eps / (a + eps) ** 2 + cross * c / (a + eps)) * pf - bb * zf if need_dp else None
        dz = coef * (2.0 * eps / (b + eps) ** 2 + cross * c / (b + eps)) * zf - bb * pf if need_dz else None
    return (None if dp is None else dp.to(p.dtype)), (None if dz is None else dz.to(z.dtype))


def _merge(counts: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """Merge per-rank statistics (Chan et al.). ``counts [K]``, ``part [5, K, m]`` = (mean_F, mean_G, M2_F,
    M2_G, C). Returns ``[5, m]`` (mean_F, mean_G, M2_F, M2_G, C) in float64 over the union of the ranks."""
    w = counts.to(torch.float64)[:, None]
    part = part.to(torch.float64)
    means = (w * part[:2]).sum(1) / w.sum()
    dev = part[:2] - means[:, None]
    cross = torch.stack([dev[0] * dev[0], dev[1] * dev[1], dev[0] * dev[1]])
    return torch.cat([means, part[2:].sum(1) + (w * cross).sum(1)])


def _column_stats(p, z, backend, sync, group):
    """``(n, stats [5, m])`` of this rank's rows (n a float), or of the global batch when ``sync``
    (all-gathered and merged; n a 0-d float64 tensor on the device)."""
    stats = (_bn_cosine_fwd_triton if backend == "triton" else _bn_cosine_fwd_torch)(p, z, "bn", 0.0)
    if not sync:
        return float(p.shape[0]), stats
    flat = torch.cat([stats.new_full((1,), float(p.shape[0])), stats.reshape(-1)])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, flat, group=group)
    allv = torch.stack(out)  # [ranks, 1 + 5m]
    # per-rank (mean, M2, C) have the algebra of block partials
    return allv[:, 0].sum(), _merge(allv[:, 0], allv[:, 1:].reshape(-1, 5, stats.shape[1]).transpose(0, 1))


def _want_sync(sync: bool | None, group) -> bool:
    if sync is None:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if sync and not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("sync", "False or None when torch.distributed is not initialised", sync)
    return bool(sync)


def _bn_loss(n, stats: torch.Tensor, eps: float):
    """The bn loss from the column statistics, and its terms ``a`` (a_F, a_G), ``ab``, ``rho``, ``r``."""
    var = stats[2:4] / n  # var F, var G
    v = var + eps
    a = v.rsqrt()  # a_F, a_G
    ab = a[0] * a[1]
    rho = stats[4] / n * ab
    r = var / v
    return torch.sub(r.sum(), rho.sum(), alpha=2.0) / stats.shape[1], (a, ab, rho, r)


def _bn_loss_and_coefficients(n, stats: torch.Tensor, eps: float):
    """The bn loss and the backward's ``[5, m]`` coefficients (mu_F, mu_G, A, B, A') without grad_output,
    from the column statistics; float64, about 20 small ops on [m]-sized tensors (see module docstring)."""
    loss, (a, ab, rho, r) = _bn_loss(n, stats, eps)
    k = 2.0 / (stats.shape[1] * n)
    diag = (1.0 - r + rho).mul_(a * a).mul_(k)  # A, A'
    return loss, torch.cat([stats[:2], diag[:1], (ab * k)[None], diag[1:]])


# ----------------------------------------------------------------------------------------------
# autograd.Function
# ----------------------------------------------------------------------------------------------
class BNCosineLossFunction(torch.autograd.Function):
    """``forward(ctx, p, z, out_norm, eps, backend, sync, group) -> scalar loss`` (see module doc)."""

    @staticmethod
    def forward(ctx, p, z, out_norm, eps, backend, sync, group):
        if out_norm == "bn":
            n, stats = _column_stats(p, z, backend, sync, group)
            loss, coef = _bn_loss_and_coefficients(n, stats, eps)
        else:
            total = (_bn_cosine_fwd_triton if backend == "triton" else _bn_cosine_fwd_torch)(p, z, out_norm, eps)
            n = float(p.shape[0])
            if sync:
                buf = torch.stack([total, total.new_full((), n)])
                dist.all_reduce(buf, group=group)
                total, n = buf[0], buf[1]
            loss = total / n
            coef = 1.0 / n  # times grad_out in the backward
        ctx.save_for_backward(p, z)
        # coef is derived (not an input or output), so it may live on ctx; a float when unsynced l2
        ctx.coef, ctx.out_norm, ctx.eps, ctx.backend = coef, out_norm, eps, backend
        return loss.to(p.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        need_dp, need_dz = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dp or need_dz):
            return (None,) * 7
        p, z = ctx.saved_tensors
        coef = ctx.coef
        if ctx.out_norm == "l2":  # the per-row kernel reads its scale from the device
            coef, grad_out = grad_out.to(torch.float64) * coef, None
        bwd = _bn_cosine_bwd_triton if ctx.backend == "triton" else _bn_cosine_bwd_torch
        return (*bwd(p, z, ctx.out_norm, coef, grad_out, ctx.eps, need_dp, need_dz), None, None, None, None, None)


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
            refuse_shape(op, name, t, "must be a 2-D tensor [N, m]")
    if p.shape != z.shape:
        refuse_shape(op, "z", z, f"must have the shape of p {list(p.shape)}")
    if p.shape[1] < 1:
        refuse_shape(op, "p", p, "must have at least one column")


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


def _bn_cosine_traced(p, z, out_norm: str, eps: float) -> torch.Tensor:
    """The loss as differentiable PyTorch, the forward's float64 statistics and formulas, autograd's backward:
    what ``torch.compile`` traces (a module's compiled loss). Dynamo's trace of the autograd.Function gave
    gradients of 0 on torch 2.11 with CUDA, values right (the GPU tests' compiled step, 2026-11-28); the
    CPU on torch 2.13 agreed. Unsynced only: the all-gather has no autograd (:func:`_synced_untraced`)."""
    n = float(p.shape[0])
    if out_norm == "l2":
        return (_bn_cosine_fwd_torch(p, z, "l2", eps) / n).to(p.dtype)
    return _bn_loss(n, _bn_cosine_fwd_torch(p, z, "bn", 0.0), eps)[0].to(p.dtype)


@torch.compiler.disable
def _synced_untraced(p, z, out_norm: str, eps: float, backend: str, group) -> torch.Tensor:
    """The synced loss under ``torch.compile`` (several ranks): the Function run eagerly, a graph break rather
    than its trace (:func:`_bn_cosine_traced`)."""
    return BNCosineLossFunction.apply(p, z, out_norm, eps, backend, True, group)


@kb.profiled
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
    if torch.compiler.is_compiling():  # the Function's trace: zero gradients on torch 2.11 CUDA (below)
        if sync:
            return _synced_untraced(p, z, out_norm, float(eps), backend, group)
        return _bn_cosine_traced(p, z, out_norm, float(eps))
    if backend == "triton":
        p, z = contiguous(p, z)
    return BNCosineLossFunction.apply(p, z, out_norm, float(eps), backend, sync, group)


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
    if backend == "triton":
        p, z = contiguous(p, z)
    n, stats = _column_stats(p, z, backend, _want_sync(sync, group), group)
    mf, mg, vf, vg, cov = stats[0], stats[1], stats[2] / n, stats[3] / n, stats[4] / n
    return {"n": torch.as_tensor(n, dtype=torch.float64, device=p.device), "mean_p": mf, "mean_z": mg,
            "var_p": vf, "var_z": vg, "cov": cov, "rho": cov / torch.sqrt(vf * vg)}


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
