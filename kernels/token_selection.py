"""GemFilter's token selection (Shi 2024, Ch. 9: Shi, Ming, Nguyen, Liang, Joty, arXiv 2409.17422, Algorithm 2): the
prompt's last query row at the filter layer scores every token, and the k best are kept in their own order::

    s_b[n] = sum_h q_b^(h) . K_b^(h // (H / H_kv))[n, :]          (GQA: query head h reads kv head h // G, repeat_kv)
    p_b = avg_pool1d(s_b, pool_kernel, stride=1, padding=pool_kernel // 2)
    J_b = sort(topk(p_b, k).indices)                              (token ids ascending: <bos> stays first)

``q_last`` ``[B, H, Dh]`` (the chosen query row of each head), ``keys`` ``[B, H_kv, N, Dh]``, ``H = G H_kv``.
No softmax and no ``1/sqrt(Dh)`` (the reference repo's ``standard_dis_index``; a scale would not change J).
Pooling: zeros padded at both ends and counted in the average (``count_include_pad=True``, torch's default,
which the repo uses), so the first and last ``pool_kernel // 2`` tokens average over fewer real scores.
The dissertation's listing sorts with ``torch.sort(idx).indices`` (positions, not token ids): here the values.

Backends (``backend="auto"`` picks Triton for CUDA tensors), both through ``TokenSelectionFunction``:

* ``triton``: two kernels. ``_token_sel_fwd_dots_kernel``, one program per (tile of BLOCK_N tokens, kv head,
  prompt), sums the G query rows of the head's group in registers (``sum_h q_h . k = (sum_h q_h) . k``: K is
  read once, its repeat never formed) and dots them with the key tile in BLOCK_D chunks (FMAs, no ``tl.dot``:
  a matrix-vector product), writing per-kv-head partial scores ``[B, H_kv, N]``. ``_token_sel_fwd_pool_kernel``
  sums the H_kv partials and averages the window (a halo of ``pool_kernel // 2`` each side, zeros outside
  ``[0, N)``). Splitting the kv heads over programs gives ``B H_kv N / BLOCK_N`` of them (one prompt of 16k
  tokens fills an H100); the partials, written and read back, add ``8 H_kv`` bytes a token to the ``2 H_kv Dh``
  of bf16 K (3% at Dh = 128).
* ``torch``: the same algebra (grouped query sum, a batched matrix-vector product, ``F.avg_pool1d``).

top-k and the sort are torch's on both backends: a selection over all N needs every tile's scores (a
grid-wide reduction), torch's radix top-k reads the ``B N`` scores once (1/500 of K's bytes at H_kv = 8,
Dh = 128), and sorting k <= 4096 ids is a few microseconds.

No backward: GemFilter consumes indices. The scores come out of the one ``autograd.Function`` marked
non-differentiable on both backends (``requires_grad`` False whatever the inputs).

Dtypes: q_last and keys share one of float32, float64, bfloat16, float16. The half types are an exception to
the shared policy of ``featlearn.kernels.backend`` (which refuses them because training signals drown in
their rounding): here they are an LLM's activations read as they are, accumulated in float32, and the
reference sees the same rounded inputs. Scores are float64 for float64 inputs, float32 otherwise.

Cost: ``2 B H_kv N Dh`` FLOPs over ``B H_kv N Dh`` elements of K read once: memory-bound
(``docs/performance.md``). Offsets are int64 (K passes 2^31 elements at B H_kv N Dh > 2^31).

Example:
    >>> import torch
    >>> from featlearn.kernels.token_selection import select_tokens, select_tokens_reference
    >>> g = torch.Generator().manual_seed(0)
    >>> q, keys = torch.randn(1, 8, 16, generator=g), torch.randn(1, 2, 50, 16, generator=g)
    >>> idx = select_tokens(q, keys, 10)
    >>> idx.shape, bool(torch.equal(idx, select_tokens_reference(q, keys, 10))), bool((idx.diff() > 0).all())
    (torch.Size([1, 10]), True, True)
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from featlearn.errors import ConfigError
from featlearn.kernels import backend as kb  # kb.new_output: the allocation tests poison
from featlearn.kernels.backend import (KernelInputError, acc_dtype, autotune, check_backend, contiguous,
                                       refuse_shape, resolve_backend, tile_grid)

__all__ = ["selection_scores", "select_tokens", "sorted_top_k", "selection_scores_reference",
           "select_tokens_reference", "TokenSelectionFunction"]

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# (BLOCK_N, BLOCK_D, num_warps, num_stages). A program holds one [BLOCK_N, BLOCK_D] key tile; Dh = 64 / 96 / 128
# (Phi 3.5, LLaMA 3.1, Mistral Nemo) in chunks of 32-128. `fits` drops chunks wider than the head (a Dh = 24 head
# would mask 3/4 of a 128-wide chunk) and, where Dh is not a multiple of 16, tiles over 2048 values: unaligned rows
# are loaded element by element and each pipeline stage holds its tile in registers (248 of 255 a thread at
# 128 x 32 in float64, Dh = 24). What `fits` keeps builds spill-free for sm_90 at Dh = 24, 32, 96 and 128 in bf16,
# float32 and float64 under triton 3.6 and 3.9 (`featlearn gpu compile --all-configs`); dropped: 128 x 64 on 8 warps
# (8 bytes of spill in float32 at Dh = 128, triton 3.9) and 64 x 64 on 4 (8 bytes at Dh = 96, triton 3.6).
# The pooling kernel spills in float64 past 2 values a thread (24-32 bytes at 512 and 1024, triton 3.6).
# Not yet timed on a GPU.
_DOT_TILES = ((64, 64, 8, 3), (64, 128, 8, 3), (128, 32, 4, 3), (256, 32, 8, 3), (32, 128, 4, 3), (64, 32, 4, 3),
              (32, 32, 4, 2))
_POOL_TILES = ((256, 4, 2), (512, 4, 2), (1024, 8, 2), (128, 4, 2))
_INTERPRETER_DOT_TILE = (32, 16)  # the tests' N = 37 and 129 end in partial tiles, Dh = 24 in a partial chunk


def _dots_fit(config: dict, args: dict) -> bool:
    if config["BLOCK_D"] > max(32, triton.next_power_of_2(args["D"])):
        return False
    return args["D"] % 16 == 0 or config["BLOCK_N"] * config["BLOCK_D"] <= 2048


def _pool_fit(config: dict, args: dict) -> bool:
    return args["ACC"] != tl.float64 or config["BLOCK_N"] <= 256


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@autotune(("BLOCK_N", "BLOCK_D"), _DOT_TILES, _INTERPRETER_DOT_TILE, key=["D"], fits=_dots_fit)
@triton.jit
def _token_sel_fwd_dots_kernel(q_ptr, k_ptr, part_ptr, N, HKV, GROUP, D, ACC: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_D: tl.constexpr):
    # partial[b, j, n] = (sum_g q[b, j G + g, :]) . keys[b, j, n, :] for one tile of tokens n
    head = tl.program_id(2).to(tl.int64) * HKV + tl.program_id(1)  # b H_kv + j: the kv head's row of keys
    rn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rd = tl.arange(0, BLOCK_D)
    nmask = rn < N
    k_rows = k_ptr + (head * N + rn)[:, None] * D
    q_rows = q_ptr + head * GROUP * D  # query row b H + j G = (b H_kv + j) G, the group's first
    acc = tl.zeros((BLOCK_N,), dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + rd
        dmask = cols < D
        qs = tl.zeros((BLOCK_D,), dtype=ACC)
        for g in range(0, GROUP):
            qs += tl.load(q_rows + g * D + cols, mask=dmask, other=0.0).to(ACC)
        kt = tl.load(k_rows + cols[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0).to(ACC)
        acc += tl.sum(kt * qs[None, :], axis=1)
    tl.store(part_ptr + head * N + rn, acc.to(part_ptr.dtype.element_ty), mask=nmask)


@autotune(("BLOCK_N",), _POOL_TILES, (16,), key=["HKV"], fits=_pool_fit)  # 16: N = 37 ends in a partial tile
@triton.jit
def _token_sel_fwd_pool_kernel(part_ptr, s_ptr, N, HKV, POOL, ACC: tl.constexpr, BLOCK_N: tl.constexpr):
    # s[b, n] = sum_{w < POOL} (sum_j partial[b, j, n + w - POOL // 2]) / POOL, zeros outside [0, N): the
    # reference's order (heads summed per token, then the window)
    b = tl.program_id(1).to(tl.int64)
    rn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=ACC)
    for w in range(0, POOL):
        src = rn + (w - POOL // 2)
        inside = (src >= 0) & (src < N)
        col = tl.zeros((BLOCK_N,), dtype=ACC)
        for j in range(0, HKV):
            col += tl.load(part_ptr + (b * HKV + j) * N + src, mask=inside, other=0.0).to(ACC)
        acc += col
    tl.store(s_ptr + b * N + rn, (acc / POOL).to(s_ptr.dtype.element_ty), mask=rn < N)


# ----------------------------------------------------------------------------------------------
# launchers, PyTorch fallback and the top-k both share
# ----------------------------------------------------------------------------------------------
def _score_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _token_sel_fwd_triton(q_last, keys, pool_kernel):
    B, H, D = q_last.shape
    HKV, N = keys.shape[1], keys.shape[2]
    dtype = _score_dtype(q_last)
    part = kb.new_output((B, HKV, N), q_last, dtype)
    _token_sel_fwd_dots_kernel[tile_grid((N, "BLOCK_N"), HKV, B)](q_last, keys, part, N, HKV, H // HKV, D,
                                                                  ACC=acc_dtype(q_last))
    scores = kb.new_output((B, N), q_last, dtype)
    _token_sel_fwd_pool_kernel[tile_grid((N, "BLOCK_N"), B)](part, scores, N, HKV, pool_kernel, ACC=acc_dtype(q_last))
    return scores


_CPU_CHUNK = 2**20  # elements of K per product on the CPU (4 MB in float32)


def _token_sel_fwd_torch(q_last, keys, pool_kernel):
    B, H, D = q_last.shape
    HKV = keys.shape[1]
    dtype = _score_dtype(q_last)
    q_group = q_last.to(dtype).unflatten(1, (HKV, H // HKV)).sum(2, keepdim=True)  # [B, H_kv, 1, Dh]: groups summed
    if keys.is_cuda:  # cuBLAS's batched matrix-vector product reads K once
        s = (keys.to(dtype) @ q_group.mT).squeeze(-1)
    else:  # CPU BLAS runs a one-column product at a quarter of this speed; cache-sized chunks keep the temporary small
        step = max(1, _CPU_CHUNK // (B * HKV * D))
        s = torch.cat([(k.to(dtype) * q_group).sum(-1) for k in keys.split(step, dim=2)], dim=2)
    s = s.sum(1, keepdim=True)  # [B, 1, N]
    return F.avg_pool1d(s, pool_kernel, stride=1, padding=pool_kernel // 2).squeeze(1)


def sorted_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the ``k`` largest ``scores`` of each row, ascending (``torch.topk``, then the sorted values).

    Example:
        >>> tuple(sorted_top_k(torch.tensor([[0.1, 0.9, 0.5, 0.7]]), 2)[0].tolist())
        (1, 3)
    """
    return torch.sort(torch.topk(scores, k, dim=-1).indices, dim=-1).values


# ----------------------------------------------------------------------------------------------
# autograd.Function
# ----------------------------------------------------------------------------------------------
class TokenSelectionFunction(torch.autograd.Function):
    """``forward(q_last, keys, pool_kernel, backend) -> scores [B, N]``, marked non-differentiable: the op has no
    backward (its product is an index set). It exists as the op template's one dispatch seam."""

    @staticmethod
    def forward(q_last, keys, pool_kernel, backend):
        if backend == "triton":
            return _token_sel_fwd_triton(q_last, keys, pool_kernel)
        return _token_sel_fwd_torch(q_last, keys, pool_kernel)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output)


# ----------------------------------------------------------------------------------------------
# functional API
# ----------------------------------------------------------------------------------------------
def _as_int(x):
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


_NO_K = object()  # selection_scores: no k to check


def _checked(op, q_last, keys, pool_kernel, backend, k=_NO_K):
    """Refuse bad arguments before any work; return (backend, q_last, keys) ready for the Function."""
    check_backend(backend)
    first = None
    for name, t in (("q_last", q_last), ("keys", keys)):
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(op, name, f"is a {type(t).__name__}", "must be a torch.Tensor", type(t).__name__)
        allowed = "supported: " + ", ".join(map(str, DTYPES)) + " (both inputs the same dtype)"
        if t.dtype not in DTYPES:
            raise KernelInputError(op, name, f"has dtype {t.dtype}", allowed, t.dtype)
        if first is not None and t.dtype != first:
            raise KernelInputError(op, name, f"has dtype {t.dtype} but q_last has {first}", allowed, t.dtype)
        first = t.dtype
    if q_last.dim() != 3 or 0 in q_last.shape:
        refuse_shape(op, "q_last", q_last, "must be a 3-D tensor [B, H, Dh] (each head's query row), all sizes >= 1")
    B, H, D = q_last.shape
    if keys.dim() != 4 or 0 in keys.shape or keys.shape[0] != B or keys.shape[3] != D:
        refuse_shape(op, "keys", keys, f"must be a 4-D tensor [B, H_kv, N, Dh] = [{B}, H_kv, N, {D}] "
                                       f"(q_last is [{B}, {H}, {D}]), H_kv and N >= 1")
    if H % keys.shape[1]:
        refuse_shape(op, "keys", keys, f"must have H_kv dividing the query heads H = {H} (GQA: head h reads "
                                       f"kv head h // (H / H_kv))")
    if keys.device != q_last.device:
        raise KernelInputError(op, "keys", f"is on {keys.device}", f"must be on q_last's device {q_last.device}",
                               str(keys.device))
    pool = _as_int(pool_kernel)
    if pool is None or pool < 1 or pool % 2 == 0:
        raise ConfigError("pool_kernel", "an odd integer >= 1 (a centred window: pool_kernel // 2 tokens each side)",
                          pool_kernel)
    N = keys.shape[2]
    if k is not _NO_K and (_as_int(k) is None or not 1 <= _as_int(k) <= N):
        raise ConfigError("k", f"an integer in [1, N] = [1, {N}] (N: the tokens of keys)", k)
    which = resolve_backend(backend, q_last, keys)
    if which == "triton":
        q_last, keys = contiguous(q_last, keys)
    return which, q_last, keys


@kb.profiled
def selection_scores(q_last: torch.Tensor, keys: torch.Tensor, pool_kernel: int = 5, *,
                     backend: str = "auto") -> torch.Tensor:
    """GemFilter's pooled scores ``p [B, N]``: the head-summed ``q_last . K^T``, averaged over ``pool_kernel``
    tokens (zero padding counted). Not differentiable.

    Args:
        q_last: ``[B, H, Dh]`` each head's query row (GemFilter: the prompt's last token at the filter layer).
        keys: ``[B, H_kv, N, Dh]`` that layer's keys, ``H_kv`` dividing ``H`` (query head h reads kv head
            ``h // (H / H_kv)``).
        pool_kernel: the odd window of the average pooling (padding ``pool_kernel // 2``; 1: none).
        backend: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"torch"`` or ``"triton"``.

    Both tensors float32, float64, bfloat16 or float16 (one dtype), on one device. Returns float64 scores for
    float64 inputs, float32 otherwise.
    """
    which, q_last, keys = _checked("selection_scores", q_last, keys, pool_kernel, backend)
    return TokenSelectionFunction.apply(q_last, keys, operator.index(pool_kernel), which)


@kb.profiled
def select_tokens(q_last: torch.Tensor, keys: torch.Tensor, k: int, pool_kernel: int = 5, *,
                  backend: str = "auto") -> torch.Tensor:
    """GemFilter's index set: the ``k`` tokens of largest :func:`selection_scores`, ids ascending ``[B, k]`` (int64).

    ``1 <= k <= N`` (the reference repo clamps ``k`` to N; clamp before calling). Ties go as ``torch.topk``'s.
    Arguments otherwise as :func:`selection_scores`.
    """
    which, q_last, keys = _checked("select_tokens", q_last, keys, pool_kernel, backend, k=k)
    scores = TokenSelectionFunction.apply(q_last, keys, operator.index(pool_kernel), which)
    return sorted_top_k(scores, operator.index(k))


# ----------------------------------------------------------------------------------------------
# float64 reference (Algorithm 2 step by step: repeat_kv, matmul, sum over heads, avg_pool1d, topk, sort)
# ----------------------------------------------------------------------------------------------
def selection_scores_reference(q_last: torch.Tensor, keys: torch.Tensor, pool_kernel: int = 5) -> torch.Tensor:
    """The pooled scores in float64, as the reference repo computes them (its K repeated per query head)."""
    q, K = q_last.double(), keys.double()
    B, H_kv, N, D = K.shape
    rep = q.shape[1] // H_kv
    K = K[:, :, None].expand(B, H_kv, rep, N, D).reshape(B, H_kv * rep, N, D)  # transformers' repeat_kv
    s = torch.matmul(q.unsqueeze(2), K.transpose(2, 3))[:, :, 0, :].sum(1, keepdim=True)  # [B, 1, N]
    return F.avg_pool1d(s, kernel_size=pool_kernel, padding=pool_kernel // 2, stride=1)[:, 0]


def select_tokens_reference(q_last: torch.Tensor, keys: torch.Tensor, k: int, pool_kernel: int = 5) -> torch.Tensor:
    """``torch.topk`` of the float64 scores, then ``torch.sort(...).values``: the token ids ascending."""
    top = torch.topk(selection_scores_reference(q_last, keys, pool_kernel), k, dim=-1).indices
    return torch.sort(top, dim=-1).values


token_selection_reference = select_tokens_reference  # the op template's `<module>_reference`
