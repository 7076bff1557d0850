"""Masked softmax attention with shared query rows and large head dim (the ViTs of Huang et al. 2025).

For keys K[b] (P, d), values V[b] (P, dv) and queries q[b, i] (d,)::

    S[b, i, q]          = <q[b, i], K[b, q]>                      (scale 1: no 1/sqrt(d); no causal mask)
    A[b, i, q]          = softmax_q(S[b, i, :])                  over the keys not in key_padding_mask
    out[b, i]           = sum_q A[b, i, q] V[b, q]                (B, Pq, dv), differentiable in the queries
    group_attn[b, i, g] = sum_{q: key_groups[b, q] = g} A[b, i, q]   (B, Pq, n_groups), no gradient

Queries come either per sample, ``(B, Pq, d)``, or as rows ``(R, d)`` shared by every sample (MAE: a
masked query is ``e_p``, so its row ``e_p^T Q`` is the same in every sample), picked per sample by a
``(B, Pq)`` long ``query_index`` (or all R rows in order when it is None). The gradient of a shared row
is the sum over every (b, i) that gathered it. ``group_attn`` is the area reduction (the unmasked
area attention ``A_{p,m}`` of the paper's Sec. 4: give masked keys a group of their own) without a (B, Pq, P) tensor.

Backends (``backend="auto"`` picks Triton for CUDA tensors, see ``featlearn.kernels.backend``):

* ``torch``: gather, batched GEMM, masked softmax, batched GEMM, as eager PyTorch; it keeps the
  probabilities A (B, Pq, P) for the backward, which forms the gradients of queries, keys and values
  (each only when needed).
* ``triton``: flash-style, the (B, Pq, P) scores never reach memory. One program per (sample, BLOCK_M
  queries) sweeps the key tiles once with an online softmax. d goes up to ~4k, so neither the query
  tile nor the output rows fit on chip (64 x 1152 fp32 = 295 KB): per key tile the logits accumulate
  over d in BLOCK_D steps, then the output rows are updated BLOCK_D columns at a time in global memory,
  ``O = alpha O + P V``, normalised by the row sum on the last key tile (the program owns its rows: no
  atomics; they are meant to stay in L2). The forward costs ``4 B Pq P d`` FLOPs, the minimum, plus an O
  read-modify-write per key tile, ``8 B Pq dv P / BLOCK_N`` bytes. The alternatives cost FLOPs instead:
  a stats pass then an output pass (the two-kernel design) recomputes S, ``6 B Pq P d``; a grid over
  output d-tiles with O in registers recomputes S per d-tile, ``(2 + 2 d / BLOCK_D) B Pq P d``, 5x the
  minimum at d = 1152, BLOCK_D = 128. ``group_attn`` is the same update with one-hot values (one
  ``tl.dot`` per BLOCK_D groups). Saved for the backward: out and the LSE (B, Pq). Backward (queries
  only): one program per (sample, BLOCK_M queries) forms ``rowsum(dO * O)``, then per key tile rebuilds
  S and A from the LSE, ``dS = A * (dO V^T - rowsum)``, and adds ``dS K`` into the (B, Pq, d) row
  gradient in d-tiles (``6 B Pq P d`` FLOPs); a host ``index_add`` sums the rows into the shared (R, d)
  gradient. Keys and values that require grad are refused on this path (the data needs none).

A program's loop runs over all key tiles of its sample, which is not the grouped GEMM order: the grid is
(query tiles, samples), the query tiles of one sample adjacent in launch order so that they read its keys
and values from L2. FLOPs, bytes and the expected fraction of the roofline at the MAE size
B = 64, P = 1024, d = 1152: ``docs/performance.md``.
Length (~500 lines): two kernels with three device helpers, a torch path with
key and value gradients, and the argument checks.

Dtypes follow the shared policy (queries, keys and values all float32 or all float64); the Triton dots
follow ``input_precision`` (``"auto"``: TF32 for float32, IEEE for float64) and accumulate in float32
(float64 for float64 inputs).

Example:
    >>> import torch
    >>> from featlearn.kernels.masked_attention import masked_attention
    >>> rows = torch.randn(6, 8, requires_grad=True)                 # shared query rows (R, d)
    >>> keys, values = torch.randn(2, 5, 8), torch.randn(2, 5, 3)
    >>> idx = torch.tensor([[0, 4], [5, 0]])                          # (B, Pq) rows per sample
    >>> groups = torch.tensor([[0, 0, 1, 1, 1], [1, 0, 1, 0, 1]])
    >>> out, ga = masked_attention(rows, keys, values, idx, key_groups=groups, n_groups=2, backend="torch")
    >>> out.shape, ga.shape, torch.allclose(ga.sum(-1), torch.ones(2, 2))
    (torch.Size([2, 2, 3]), torch.Size([2, 2, 2]), True)
    >>> out.sum().backward(); rows.grad.shape
    torch.Size([6, 8])
"""
from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from featlearn.errors import ConfigError
from featlearn.kernels import backend as kb  # kb.new_output: the allocation tests poison
from featlearn.kernels.backend import (KernelInputError, acc_dtype, autotune, check_backend, check_float_inputs,
                                       contiguous, resolve_backend, resolve_precision, tile_grid,
                                       tiles_by_precision)

__all__ = ["masked_attention", "masked_attention_reference", "MaskedAttentionFunction"]

OP = "masked_attention"
# (BLOCK_M queries, BLOCK_N keys, BLOCK_D columns of the d and dv loops, num_warps, num_stages). The
# probabilities (BLOCK_M x BLOCK_N) stay in registers while the output tiles stream through; a wide
# BLOCK_N halves the O read-modify-writes. The backward holds A and dO V^T at once: smaller tiles.
ATTN_FWD_TILES = ((64, 128, 32, 8, 2), (64, 128, 16, 8, 2), (64, 64, 32, 8, 2), (128, 64, 32, 8, 2),
                  (128, 128, 16, 8, 2), (64, 64, 64, 8, 2),
                  # IEEE float32 dots run on the FMA units and keep operand slices in registers: short d tiles
                  (32, 128, 16, 8, 2), (64, 32, 16, 4, 2))
ATTN_BWD_TILES = ((64, 128, 32, 8, 2), (64, 128, 16, 8, 2), (64, 64, 32, 8, 2), (64, 64, 16, 4, 2),
                  (128, 32, 32, 8, 2))
# What each kernel builds spill-free for sm_90 at the featlearn.gpu.cases sizes (`featlearn gpu compile --all-configs`,
# benchmarks/results/gpu/): with TF32 dots every forward tile but 128 x 128 (72 bytes of spill), with IEEE
# float32 two short-d tiles (the others spill 8-1600 bytes), in float64 the two 64-row tiles whose
# d tile keeps the registers (the rest spill 8-288 bytes); the backward spills in float64 except at 64 x 64 x 32.
_FWD_FITS = tiles_by_precision(tf32=[t[:3] for t in ATTN_FWD_TILES[:6] if t[:2] != (128, 128)],
                               ieee=[t[:3] for t in ATTN_FWD_TILES[6:]], fp64=[(64, 128, 16), (64, 64, 32)])
_BWD_FITS = tiles_by_precision(tf32=[t[:3] for t in ATTN_BWD_TILES], ieee=[t[:3] for t in ATTN_BWD_TILES],
                               fp64=[(64, 64, 32)])
# interpreter: 16-wide tiles, so the tests' odd sizes span several query, key and d tiles
INTERPRETER_ATTN_TILE = (16, 16, 16)
_NEG_START = tl.constexpr(-1e30)  # running max before the first key: finite, so alpha = exp(m_old - m_new) is never nan


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _masked_attn_rows(idx_ptr, b, rm, m_ok, PQ, SHARED: tl.constexpr, HAS_INDEX: tl.constexpr):
    """int64 row of ``queries`` read by queries ``rm`` of sample ``b``."""
    if HAS_INDEX:
        rows = tl.load(idx_ptr + b * PQ + rm, mask=m_ok, other=0).to(tl.int64)
    elif SHARED:
        rows = rm.to(tl.int64)
    else:
        rows = b * PQ + rm.to(tl.int64)
    return rows


@triton.jit
def _masked_attn_scores(a_ptr, a_rows, m_ok, b_ptr, b_base, rn, n_ok, K, PRECISION: tl.constexpr,
                        ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``a[a_rows] @ b[b_base + rn]^T`` (BLOCK_M x BLOCK_N), both row-major with K columns, over K in tiles."""
    rk = tl.arange(0, BLOCK_D)
    s = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, K, BLOCK_D):
        kk = k0 + rk
        at = tl.load(a_ptr + a_rows[:, None] * K + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < K), other=0.0)
        bt = tl.load(b_ptr + b_base + rn[None, :] * K + kk[:, None], mask=n_ok[None, :] & (kk[:, None] < K),
                     other=0.0)
        s = tl.dot(at.to(ACC), bt.to(ACC), s, input_precision=PRECISION, out_dtype=ACC)
    return s


@triton.jit
def _masked_attn_update(o_ptr, o_rows, m_ok, src_ptr, src_base, rn, n_ok, p, alpha, scale, n0, NCOL,
                        ONEHOT: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr):
    """``o[o_rows] = (alpha o[o_rows] + p @ src) * scale`` over NCOL columns in BLOCK_D tiles; ``o`` reads
    as 0 on the first key tile (``n0 == 0``). ``src`` is the value rows ``src_base + rn`` or, with ONEHOT,
    the one-hot of the group ids at ``src_base + rn``."""
    rc = tl.arange(0, BLOCK_D)
    if ONEHOT:
        grp = tl.load(src_ptr + src_base + rn, mask=n_ok, other=-1)
    for c0 in range(0, NCOL, BLOCK_D):
        cc = c0 + rc
        c_ok = cc < NCOL
        if ONEHOT:
            vt = (grp[:, None] == cc[None, :]).to(ACC)
        else:
            vt = tl.load(src_ptr + src_base + rn[:, None] * NCOL + cc[None, :], mask=n_ok[:, None] & c_ok[None, :],
                         other=0.0).to(ACC)
        offs = o_rows[:, None] * NCOL + cc[None, :]
        omask = m_ok[:, None] & c_ok[None, :]
        # .cg: read back from L2 what this program stored on the previous key tile (not a stale L1 line)
        o = tl.load(o_ptr + offs, mask=omask & (n0 > 0), other=0.0, cache_modifier=".cg").to(ACC)
        o = tl.dot(p, vt, o * alpha[:, None], input_precision=PRECISION, out_dtype=ACC) * scale[:, None]
        tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=omask)


@autotune(("BLOCK_M", "BLOCK_N", "BLOCK_D"), ATTN_FWD_TILES, INTERPRETER_ATTN_TILE, fits=_FWD_FITS,
          key=["PQ", "P", "D", "DV", "N_GROUPS", "SHARED", "HAS_INDEX", "HAS_MASK", "HAS_GROUPS", "PRECISION"])
@triton.jit
def _masked_attn_fwd_kernel(q_ptr, idx_ptr, k_ptr, v_ptr, pad_ptr, grp_ptr, o_ptr, lse_ptr, ga_ptr,
                            PQ, P, D, DV, N_GROUPS, SHARED: tl.constexpr, HAS_INDEX: tl.constexpr,
                            HAS_MASK: tl.constexpr, HAS_GROUPS: tl.constexpr, PRECISION: tl.constexpr,
                            ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program: BLOCK_M queries of sample b against all P keys, one pass (online softmax)
    b = tl.program_id(1).to(tl.int64)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < PQ
    q_rows = _masked_attn_rows(idx_ptr, b, rm, m_ok, PQ, SHARED, HAS_INDEX)
    o_rows = b * PQ + rm
    m_i = tl.full((BLOCK_M,), _NEG_START, ACC)
    l_i = tl.zeros((BLOCK_M,), ACC)
    for n0 in range(0, P, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        n_ok = rn < P
        s = _masked_attn_scores(q_ptr, q_rows, m_ok, k_ptr, b * P * D, rn, n_ok, D, PRECISION, ACC,
                                BLOCK_M, BLOCK_N, BLOCK_D)
        keep = n_ok
        if HAS_MASK:
            keep = keep & (tl.load(pad_ptr + b * P + rn, mask=n_ok, other=1) == 0)
        s = tl.where(keep[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        # the sums are final on the last key tile: normalise there
        scale = tl.where(n0 + BLOCK_N >= P, 1.0 / l_i, tl.full((BLOCK_M,), 1.0, ACC))
        _masked_attn_update(o_ptr, o_rows, m_ok, v_ptr, b * P * DV, rn, n_ok, p, alpha, scale, n0, DV, False,
                            PRECISION, ACC, BLOCK_D)
        if HAS_GROUPS:
            _masked_attn_update(ga_ptr, o_rows, m_ok, grp_ptr, b * P, rn, n_ok, p, alpha, scale, n0, N_GROUPS,
                                True, PRECISION, ACC, BLOCK_D)
        tl.debug_barrier()  # the rows just stored are read back, by other threads, on the next key tile
    tl.store(lse_ptr + o_rows, (m_i + tl.log(l_i)).to(lse_ptr.dtype.element_ty), mask=m_ok)


@autotune(("BLOCK_M", "BLOCK_N", "BLOCK_D"), ATTN_BWD_TILES, INTERPRETER_ATTN_TILE, fits=_BWD_FITS,
          key=["PQ", "P", "D", "DV", "SHARED", "HAS_INDEX", "HAS_MASK", "PRECISION"])
@triton.jit
def _masked_attn_bwd_dq_kernel(q_ptr, idx_ptr, k_ptr, v_ptr, pad_ptr, delta_ptr, do_ptr, lse_ptr, dq_ptr,
                               PQ, P, D, DV, SHARED: tl.constexpr, HAS_INDEX: tl.constexpr, HAS_MASK: tl.constexpr,
                               PRECISION: tl.constexpr, ACC: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # dq_rows[b, i] = sum_q dS[b, i, q] K[b, q], dS = A * (dO V^T - rowsum(dO * O)), A rebuilt from the LSE
    b = tl.program_id(1).to(tl.int64)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < PQ
    q_rows = _masked_attn_rows(idx_ptr, b, rm, m_ok, PQ, SHARED, HAS_INDEX)
    o_rows = b * PQ + rm
    rc = tl.arange(0, BLOCK_D)
    # delta = rowsum(dO * O) comes from the launcher: summed here, it is replicated across the threads of the
    # reduced axis and re-laid out for the dot through shared memory, where those copies all store the same
    # value to the same address (the race compute-sanitizer reported on an H100); loaded, it is laid out
    # as the dot needs it directly, as the LSE is
    delta = tl.load(delta_ptr + o_rows, mask=m_ok, other=0.0).to(ACC)
    lse = tl.load(lse_ptr + o_rows, mask=m_ok, other=0.0).to(ACC)
    for n0 in range(0, P, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        n_ok = rn < P
        s = _masked_attn_scores(q_ptr, q_rows, m_ok, k_ptr, b * P * D, rn, n_ok, D, PRECISION, ACC,
                                BLOCK_M, BLOCK_N, BLOCK_D)
        keep = n_ok
        if HAS_MASK:
            keep = keep & (tl.load(pad_ptr + b * P + rn, mask=n_ok, other=1) == 0)
        a = tl.where(keep[None, :], tl.exp(s - lse[:, None]), 0.0)
        dp = _masked_attn_scores(do_ptr, o_rows, m_ok, v_ptr, b * P * DV, rn, n_ok, DV, PRECISION, ACC,
                                 BLOCK_M, BLOCK_N, BLOCK_D)
        ds = a * (dp - delta[:, None])
        for c0 in range(0, D, BLOCK_D):
            cc = c0 + rc
            kt = tl.load(k_ptr + b * P * D + rn[:, None] * D + cc[None, :], mask=n_ok[:, None] & (cc[None, :] < D),
                         other=0.0).to(ACC)
            offs = o_rows[:, None] * D + cc[None, :]
            omask = m_ok[:, None] & (cc[None, :] < D)
            dq = tl.load(dq_ptr + offs, mask=omask & (n0 > 0), other=0.0, cache_modifier=".cg").to(ACC)
            dq = tl.dot(ds, kt, dq, input_precision=PRECISION, out_dtype=ACC)
            tl.store(dq_ptr + offs, dq.to(dq_ptr.dtype.element_ty), mask=omask)
        tl.debug_barrier()  # as in the forward: the dq rows are read back on the next key tile


# ----------------------------------------------------------------------------------------------
# launchers and PyTorch fallback: (out, LSE or A, group_attn) forward, (grad_queries, grad_keys, grad_values)
# backward
# ----------------------------------------------------------------------------------------------
def _n_queries(queries, query_index):
    if query_index is not None:
        return query_index.shape[1]
    return queries.shape[0] if queries.dim() == 2 else queries.shape[1]


def _placeholder(t, like):
    return like if t is None else t  # a pointer the kernel never reads (its constexpr flag is off)


def _masked_attn_fwd_triton(queries, keys, values, query_index, pad, groups, n_groups, precision):
    B, P, D = keys.shape
    DV, PQ = values.shape[2], _n_queries(queries, query_index)
    out = kb.new_output((B, PQ, DV), keys)
    lse = kb.new_output((B, PQ), keys)
    group_attn = kb.new_output((B, PQ, n_groups), keys)
    # the padding mask goes in as int32: triton 3.6 cannot build a float64 dot whose operand comes from 8-bit
    # data ("fp64 don't support largeK MMA"), and B x P words cost nothing next to the keys
    _masked_attn_fwd_kernel[tile_grid((PQ, "BLOCK_M"), B)](
        queries, _placeholder(query_index, keys), keys, values,
        _placeholder(None if pad is None else pad.to(torch.int32), keys), _placeholder(groups, keys),
        out, lse, group_attn if n_groups else out, PQ, P, D, DV, n_groups, SHARED=queries.dim() == 2,
        HAS_INDEX=query_index is not None, HAS_MASK=pad is not None, HAS_GROUPS=n_groups > 0, PRECISION=precision,
        ACC=acc_dtype(keys))
    return out, lse, group_attn


def _masked_attn_bwd_triton(grad_out, queries, keys, values, query_index, pad, out, lse, need, precision):
    (grad_out,) = contiguous(grad_out)
    B, P, D = keys.shape
    DV, PQ = values.shape[2], _n_queries(queries, query_index)
    dq_rows = kb.new_output((B, PQ, D), keys)
    delta = torch.linalg.vecdot(out, grad_out)  # (B, PQ): rowsum(dO * O) in the accumulator's dtype
    _masked_attn_bwd_dq_kernel[tile_grid((PQ, "BLOCK_M"), B)](
        queries, _placeholder(query_index, keys), keys, values,
        _placeholder(None if pad is None else pad.to(torch.int32), keys), delta, grad_out, lse, dq_rows,
        PQ, P, D, DV, SHARED=queries.dim() == 2, HAS_INDEX=query_index is not None, HAS_MASK=pad is not None,
        PRECISION=precision, ACC=acc_dtype(keys))
    return _sum_rows(dq_rows, queries, query_index), None, None


def _gather_rows(queries, query_index):
    """(B, Pq, d) per-sample queries, or shared (R, d) rows (broadcast by matmul) when there is no index."""
    if query_index is None:
        return queries
    return queries[query_index]


def _sum_rows(dq_rows, queries, query_index):
    """The gradient of ``queries`` from the (B, Pq, d) gradient of the rows each query read."""
    if queries.dim() == 3:
        return dq_rows
    if query_index is None:
        return dq_rows.sum(0)
    return torch.zeros_like(queries).index_add_(0, query_index.reshape(-1), dq_rows.reshape(-1, queries.shape[1]))


def _scores(queries, keys, query_index, pad):
    s = torch.matmul(_gather_rows(queries, query_index), keys.transpose(1, 2))
    return s if pad is None else s.masked_fill_(pad[:, None, :], float("-inf"))


def _group_sums(a, groups, n_groups):
    B, PQ, P = a.shape
    out = torch.zeros(B, PQ, n_groups, dtype=a.dtype, device=a.device)
    if n_groups:
        out.scatter_add_(2, groups[:, None, :].expand(B, PQ, P), a)
    return out


def _masked_attn_fwd_torch(queries, keys, values, query_index, pad, groups, n_groups):
    """(out, A, group_attn): the probabilities A are in memory anyway and stand in for the LSE."""
    a = torch.softmax(_scores(queries, keys, query_index, pad), dim=-1)
    return a @ values, a, _group_sums(a, groups, n_groups)


def _masked_attn_bwd_torch(grad_out, queries, keys, values, query_index, pad, out, a, need):
    ds = (grad_out @ values.transpose(1, 2)).sub_((grad_out * out).sum(-1, keepdim=True)).mul_(a)
    dq = _sum_rows(ds @ keys, queries, query_index) if need[0] else None
    dk = ds.transpose(1, 2) @ _gather_rows(queries, query_index) if need[1] else None
    dv = a.transpose(1, 2) @ grad_out if need[2] else None
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# autograd.Function
# ----------------------------------------------------------------------------------------------
class MaskedAttentionFunction(torch.autograd.Function):
    """``forward(ctx, queries, keys, values, query_index, pad, groups, n_groups, backend, precision)
    -> (out, group_attn)``; both backends save the inputs, out and the softmax statistics: the LSE
    (B, Pq) on Triton, the probabilities A (B, Pq, P) on torch, which holds them anyway (as eager autograd
    would) and so skips recomputing S. ``group_attn`` is (B, Pq, n_groups), possibly empty, and not
    differentiable."""

    @staticmethod
    def forward(ctx, queries, keys, values, query_index, pad, groups, n_groups, backend, precision):
        if backend == "triton":
            out, stats, group_attn = _masked_attn_fwd_triton(queries, keys, values, query_index, pad, groups,
                                                             n_groups, precision)
        else:
            out, stats, group_attn = _masked_attn_fwd_torch(queries, keys, values, query_index, pad, groups,
                                                            n_groups)
        ctx.save_for_backward(queries, keys, values, query_index, pad, out, stats)
        ctx.backend, ctx.precision = backend, precision
        ctx.mark_non_differentiable(group_attn)
        return out, group_attn

    @staticmethod
    def backward(ctx, grad_out, _grad_group_attn):
        queries, keys, values, query_index, pad, out, stats = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        if ctx.backend == "triton":
            grads = _masked_attn_bwd_triton(grad_out, queries, keys, values, query_index, pad, out, stats, need,
                                            ctx.precision)
        else:
            grads = _masked_attn_bwd_torch(grad_out, queries, keys, values, query_index, pad, out, stats, need)
        return (*grads, None, None, None, None, None, None)


# ----------------------------------------------------------------------------------------------
# functional API
# ----------------------------------------------------------------------------------------------
def _refuse(field, problem, requirement, got):
    raise KernelInputError(OP, field, problem, requirement, got)


def _check_index(field, t, shape, dtype, device):
    """An integer or bool tensor argument: type, shape (``None`` = any size >= 1 there), dtype, device."""
    want = "(" + ", ".join(">= 1" if n is None else str(n) for n in shape) + ")"
    if not isinstance(t, torch.Tensor):
        _refuse(field, f"is a {type(t).__name__}", f"must be a {dtype} tensor of shape {want} or None",
                type(t).__name__)
    if t.dim() != len(shape) or any(n < 1 if w is None else n != w for n, w in zip(t.shape, shape)):
        _refuse(field, f"has shape {list(t.shape)}", f"must have shape {want}", tuple(t.shape))
    if t.dtype != dtype:
        _refuse(field, f"has dtype {t.dtype}", f"must be {dtype}", t.dtype)
    if t.device != device:
        _refuse(field, f"is on {t.device}", f"must be on the device of keys ({device})", str(t.device))


def _validate(queries, keys, values, query_index, key_padding_mask, key_groups, n_groups, backend,
              check_values=True):
    check_backend(backend)
    dtype = check_float_inputs(OP, queries=queries, keys=keys, values=values)
    if keys.dim() != 3 or min(keys.shape) < 1:
        _refuse("keys", f"has shape {list(keys.shape)}", "must be a non-empty (B, P, d) tensor", tuple(keys.shape))
    B, P, D = keys.shape
    if values.dim() != 3 or tuple(values.shape[:2]) != (B, P) or values.shape[2] < 1:
        _refuse("values", f"has shape {list(values.shape)}", f"must be (B, P, dv) = ({B}, {P}, dv >= 1) as keys",
                tuple(values.shape))
    shared = queries.dim() == 2
    if shared and (queries.shape[0] < 1 or queries.shape[1] != D):
        _refuse("queries", f"has shape {list(queries.shape)}", f"shared rows must be (R >= 1, d = {D})",
                tuple(queries.shape))
    if queries.dim() == 3 and (queries.shape[0] != B or queries.shape[1] < 1 or queries.shape[2] != D):
        _refuse("queries", f"has shape {list(queries.shape)}", f"per-sample queries must be ({B}, Pq >= 1, {D})",
                tuple(queries.shape))
    if queries.dim() not in (2, 3):
        _refuse("queries", f"has shape {list(queries.shape)}", "must be shared rows (R, d) or per-sample (B, Pq, d)",
                tuple(queries.shape))
    for name, t in (("queries", queries), ("values", values)):
        if t.device != keys.device:
            _refuse(name, f"is on {t.device}", f"must be on the device of keys ({keys.device})", str(t.device))
    if query_index is not None:
        if not shared:
            _refuse("query_index", "is given with per-sample queries",
                    "must be None unless queries are shared (R, d) rows", type(query_index).__name__)
        _check_index("query_index", query_index, (B, None), torch.int64, keys.device)
    if key_padding_mask is not None:
        _check_index("key_padding_mask", key_padding_mask, (B, P), torch.bool, keys.device)
    if not isinstance(n_groups, numbers.Integral) or isinstance(n_groups, bool) or n_groups < 0:
        raise ConfigError("n_groups", "an integer >= 0", n_groups)
    if key_groups is None and n_groups:
        raise ConfigError("n_groups", "0 when key_groups is None", n_groups)
    if key_groups is not None:
        if not n_groups:
            raise ConfigError("n_groups", "an integer >= 1 (the number of group ids) when key_groups is given",
                              n_groups)
        _check_index("key_groups", key_groups, (B, P), torch.int64, keys.device)
    # the value checks cost one host sync for all of them
    checks = []
    if not check_values:
        return dtype
    if query_index is not None:
        checks.append(("query_index", "has rows out of range", f"must hold rows in [0, R = {queries.shape[0]})",
                       ((query_index >= 0) & (query_index < queries.shape[0])).all()))
    if key_groups is not None:
        checks.append(("key_groups", "has ids out of range", f"must hold group ids in [0, n_groups = {n_groups})",
                       ((key_groups >= 0) & (key_groups < n_groups)).all()))
    if key_padding_mask is not None:
        checks.append(("key_padding_mask", "leaves out every key of a sample",
                       "must keep at least one key per sample (a False in each row)", (~key_padding_mask).any(1).all()))
    if checks:
        for (field, problem, requirement, _), ok in zip(checks, torch.stack([c[3] for c in checks]).tolist()):
            if not ok:
                _refuse(field, problem, requirement, "out-of-range values")
    return dtype


@kb.profiled
def masked_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_index: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    key_groups: torch.Tensor | None = None,
    n_groups: int = 0,
    backend: str = "auto",
    input_precision: str = "auto",
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of (shared or per-sample) queries over each sample's keys: ``(out, group_attn)``.

    Args:
        queries: ``(R, d)`` rows shared by every sample, or ``(B, Pq, d)`` per sample. The only input that
            gets a gradient on the Triton path; float32 or float64, as keys and values.
        keys: ``(B, P, d)``. values: ``(B, P, dv)``.
        query_index: ``(B, Pq)`` int64 rows of shared ``queries`` (in ``[0, R)``); None with shared
            queries: every row, Pq = R. Must be None with per-sample queries.
        key_padding_mask: ``(B, P)`` bool, True = key left out of the softmax (every sample keeps one).
        key_groups: ``(B, P)`` int64 group id of each key, in ``[0, n_groups)``; n_groups: their number
            (0 without key_groups).
        backend: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"torch"`` or ``"triton"``. Triton
            refuses keys or values that require grad.
        input_precision: the Triton ``tl.dot`` precision, ``"auto"`` (TF32 for float32, IEEE for float64),
            ``"tf32"`` or ``"ieee"`` (see ``featlearn.kernels.backend.resolve_precision``). The PyTorch
            fallback follows ``torch.backends.cuda.matmul.allow_tf32``.
        check_values: check the index and group ranges and the padding (one host sync, which stalls a GPU
            stream); a caller whose indices come from one generator checks its first call only.

    Returns:
        ``out`` (B, Pq, dv) and ``group_attn`` (B, Pq, n_groups), the attention summed per key group (no
        gradient), or None when n_groups is 0. Scale 1 (no 1/sqrt(d)), no causal mask.

    Refuses bad arguments (shapes, dtypes, devices, index and group ranges, fully padded samples) with a
    ``KernelInputError`` / ``ConfigError`` naming the argument, before any work; the range checks
    (``check_values``) cost one host sync.
    """
    precision = resolve_precision(input_precision, _validate(queries, keys, values, query_index, key_padding_mask,
                                                             key_groups, n_groups, backend, check_values))
    which = resolve_backend(backend, queries, keys, values)
    if which == "triton":
        if torch.is_grad_enabled():
            for name, t in (("keys", keys), ("values", values)):
                if t.requires_grad:
                    _refuse(name, "requires grad", "the Triton path differentiates queries only (detach it, or use "
                            "backend='torch')", True)
        queries, keys, values, query_index, key_padding_mask, key_groups = contiguous(
            queries, keys, values, query_index, key_padding_mask, key_groups)
    out, group_attn = MaskedAttentionFunction.apply(queries, keys, values, query_index, key_padding_mask, key_groups,
                                                    int(n_groups), which, precision)
    return out, (group_attn if n_groups else None)


# ----------------------------------------------------------------------------------------------
# float64 reference
# ----------------------------------------------------------------------------------------------
def masked_attention_reference(queries, keys, values, query_index=None, key_padding_mask=None, key_groups=None,
                               n_groups=0):
    """Plain autograd expression of :func:`masked_attention` (no checks); run it in float64 for tests.

    Example:
        >>> out, ga = masked_attention_reference(torch.zeros(3, 2), torch.randn(1, 4, 2), torch.ones(1, 4, 1))
        >>> out.squeeze(-1), ga
        (tensor([[1., 1., 1.]]), None)
    """
    q = queries.unsqueeze(0).expand(keys.shape[0], -1, -1) if queries.dim() == 2 else queries
    if query_index is not None:
        q = queries[query_index]
    s = torch.einsum("bid,bqd->biq", q, keys)
    if key_padding_mask is not None:
        s = s.masked_fill(key_padding_mask[:, None, :], float("-inf"))
    a = torch.softmax(s, dim=-1)
    out = torch.einsum("biq,bqv->biv", a, values)
    if not n_groups:
        return out, None
    onehot = torch.nn.functional.one_hot(key_groups, n_groups).to(a.dtype)
    return out, torch.einsum("biq,bqg->big", a, onehot).detach()
