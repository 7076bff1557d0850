"""token_selection (GemFilter): both backends (Triton under the interpreter) against the float64 reference of the
paper's Algorithm 2 on odd sizes (N = 37, 129; Dh = 24; H = 6 over H_kv = 2, 3, 6), float32 and float64 (and the
half types), outputs poisoned with NaN; the selected ids equal the reference's (tie-aware) and ascend; the pooling
at the edges; refusals before any work."""
import importlib

import pytest
import torch
import torch.nn.functional as F

from featlearn.errors import ConfigError
from featlearn.kernels.backend import KernelInputError

ts = importlib.import_module("featlearn.kernels.token_selection")

# (B, H, H_kv, N, Dh, k): GQA groups of 3, 2 and 1; k = 1, k = N; B = 3 prompts on the smaller N (interpreter time)
SHAPES = [(1, 6, 2, 37, 24, 5), (3, 6, 3, 37, 24, 9), (3, 6, 6, 37, 24, 37), (1, 6, 6, 129, 24, 17),
          (1, 6, 2, 129, 24, 1), (3, 6, 3, 129, 24, 40)]
# relative to the largest score: sums of H Dh = 144 products of unit normals and a 5-term average
TOL = {torch.float32: 1e-6, torch.float64: 1e-14, torch.bfloat16: 1e-6, torch.float16: 1e-6}


def _inputs(seed, B, H, H_kv, N, D, dtype=torch.float64):
    """Unit-normal query rows and keys, rounded to ``dtype`` (the reference reads the same rounded values)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g, dtype=torch.float64).to(dtype)
    return q, torch.randn(B, H_kv, N, D, generator=g, dtype=torch.float64).to(dtype)


def _rel(out, ref):
    assert torch.isfinite(out).all()
    return (out.double() - ref).abs().max().item() / ref.abs().max().item()


def _assert_selection(idx, ref_scores, k, tol):
    """``idx`` ascends and is the reference's top-k: exactly where the k-th and (k+1)-th reference scores are
    more than 2 tol apart, else up to ties within tol (each chosen score >= the k-th - tol, each other <= + tol)."""
    B, N = ref_scores.shape
    assert idx.dtype == torch.int64 and idx.shape == (B, k)
    assert (idx.diff(dim=-1) > 0).all(), "ids ascend, no repeats"
    ranked = ref_scores.sort(dim=-1, descending=True).values
    for b in range(B):
        kth = ranked[b, k - 1]
        chosen = torch.zeros(N, dtype=torch.bool)
        chosen[idx[b]] = True
        assert (ref_scores[b, chosen] >= kth - tol).all() and (ref_scores[b, ~chosen] <= kth + tol).all()
        if k == N or ranked[b, k - 1] - ranked[b, k] > 2 * tol:
            ref_idx = torch.sort(torch.topk(ref_scores[b], k).indices).values
            assert torch.equal(idx[b], ref_idx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed,shape", list(enumerate(SHAPES)))
def test_scores_and_selection_vs_float64(poisoned, backend, seed, shape, dtype):
    *sizes, k = shape
    q, keys = _inputs(seed, *sizes, dtype=dtype)
    ref = ts.selection_scores_reference(q, keys)
    scores = ts.selection_scores(q, keys, backend=backend)
    assert scores.dtype == dtype and scores.shape == ref.shape
    assert _rel(scores, ref) < TOL[dtype]
    idx = ts.select_tokens(q, keys, k, backend=backend)
    _assert_selection(idx, ref, k, TOL[dtype] * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_half_inputs_accumulate_in_float32(poisoned, backend, dtype):
    """An LLM's bf16 / fp16 activations as they are: float32 scores, float32 rounding of the sums only."""
    q, keys = _inputs(7, 2, 6, 2, 37, 24, dtype=dtype)
    ref = ts.selection_scores_reference(q, keys)
    scores = ts.selection_scores(q, keys, backend=backend)
    assert scores.dtype == torch.float32 and _rel(scores, ref) < TOL[dtype]
    _assert_selection(ts.select_tokens(q, keys, 6, backend=backend), ref, 6, TOL[dtype] * ref.abs().max().item())


def test_reference_follows_algorithm_2_literally():
    """repeat_kv, the last-row product per query head, the head sum, avg_pool1d (kernel 5, padding 2, stride 1),
    topk and the sorted values, against a loop over heads and tokens."""
    q, keys = _inputs(3, 2, 6, 3, 11, 4)
    raw = torch.zeros(2, 11, dtype=torch.float64)
    for b in range(2):
        for h in range(6):
            for n in range(11):
                raw[b, n] += q[b, h] @ keys[b, h // 2, n]
    padded = F.pad(raw, (2, 2))
    pooled = torch.stack([padded[:, n:n + 5].sum(1) / 5 for n in range(11)], 1)
    torch.testing.assert_close(ts.selection_scores_reference(q, keys), pooled, rtol=1e-14, atol=1e-14)
    idx = ts.select_tokens_reference(q, keys, 4)
    assert torch.equal(idx, torch.sort(pooled.topk(4).indices).values) and (idx.diff() > 0).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("N,pool", [(9, 5), (9, 1), (9, 3), (9, 7), (2, 5), (1, 3)])
def test_pooling_at_the_edges(poisoned, backend, N, pool):
    """Integer raw scores (exact in float64): the zero padding counts in the average (count_include_pad), so
    p[0] = (s_0 + .. + s_{pool//2}) / pool, also where the window is wider than the prompt."""
    raw = torch.arange(1, N + 1, dtype=torch.float64) ** 2  # raw score of token n: (n + 1)^2
    q = torch.zeros(1, 4, 3, dtype=torch.float64)
    q[0, :, 0] = 1.0  # the 4 heads read coordinate 0, where both kv heads hold raw / 4: s = raw
    keys = torch.zeros(1, 2, N, 3, dtype=torch.float64)
    keys[0, :, :, 0] = raw / 4
    half = pool // 2
    want = torch.stack([raw[max(0, n - half):n + half + 1].sum() / pool for n in range(N)])
    scores = ts.selection_scores(q, keys, pool_kernel=pool, backend=backend)
    torch.testing.assert_close(scores[0], want, rtol=1e-15, atol=0)
    torch.testing.assert_close(ts.selection_scores_reference(q, keys, pool), want[None], rtol=1e-15, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_first_token_kept_first(poisoned, backend):
    """A spike on token 0 (<bos>, a sink) pulls its pooled neighbours 0..2 in; ids come back ascending, 0 first."""
    q, keys = _inputs(5, 2, 6, 2, 37, 24)
    keys[:, :, 0] = 50 * q.unflatten(1, (2, 3)).sum(2) / q.unflatten(1, (2, 3)).sum(2).norm(dim=-1, keepdim=True)
    idx = ts.select_tokens(q, keys, 5, backend=backend)
    assert idx[:, :3].tolist() == [[0, 1, 2]] * 2
    assert torch.equal(idx, ts.select_tokens_reference(q, keys, 5))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_keys_and_no_gradient(backend):
    """Keys as transformers lays them out before its transpose ([B, N, H_kv, Dh] viewed as [B, H_kv, N, Dh]), and
    inputs that require grad: the scores are not differentiable (the op has no backward)."""
    q, keys = _inputs(9, 2, 6, 3, 37, 24)
    strided = keys.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    q.requires_grad_(True)
    scores = ts.selection_scores(q, strided.requires_grad_(True), backend=backend)
    assert not scores.requires_grad and scores.grad_fn is None
    assert _rel(scores, ts.selection_scores_reference(q.detach(), keys)) < TOL[torch.float64]


def test_fallback_in_chunks_of_tokens(monkeypatch):
    """The CPU fallback takes K in chunks of tokens (5 here, the last one partial): the same scores."""
    q, keys = _inputs(4, 3, 6, 3, 37, 24)
    monkeypatch.setattr(ts, "_CPU_CHUNK", 5 * 3 * 3 * 24)
    scores = ts.selection_scores(q, keys, backend="torch")
    assert _rel(scores, ts.selection_scores_reference(q, keys)) < TOL[torch.float64]


def _refused(monkeypatch, error, call):
    """``call()`` raises ``error`` before TokenSelectionFunction runs; returns the error."""
    def trap(*args):
        raise AssertionError("TokenSelectionFunction ran on refused arguments")

    monkeypatch.setattr(ts.TokenSelectionFunction, "apply", trap)
    with pytest.raises(error) as info:
        call()
    return info.value


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_arguments_refused_before_any_work(monkeypatch, backend):
    q, keys = _inputs(0, 2, 6, 2, 37, 8)
    sel = ts.select_tokens
    for k in (0, -1, 38, 2.0, True, None):
        e = _refused(monkeypatch, ConfigError, lambda: sel(q, keys, k, backend=backend))
        assert str(e).startswith("k: must be an integer in [1, N] = [1, 37]") and e.field == "k"
    for pool in (0, -1, 4, 2.0, True):
        for call in (lambda: sel(q, keys, 3, pool, backend=backend),
                     lambda: ts.selection_scores(q, keys, pool_kernel=pool, backend=backend)):
            e = _refused(monkeypatch, ConfigError, call)
            assert str(e).startswith("pool_kernel: must be an odd integer >= 1") and e.field == "pool_kernel"
    cases = {
        r"^select_tokens: q_last has shape \[6, 8\]; must be a 3-D tensor \[B, H, Dh\]": (q[0], keys),
        r"^select_tokens: q_last has shape \[2, 0, 8\]": (q[:, :0], keys),
        r"^select_tokens: keys has shape \[2, 37, 8\]; must be a 4-D tensor \[B, H_kv, N, Dh\] = \[2, H_kv, N, 8\]":
            (q, keys[:, 0]),
        r"^select_tokens: keys has shape \[1, 2, 37, 8\]; must be a 4-D": (q, keys[:1]),
        r"^select_tokens: keys has shape \[2, 2, 37, 7\]; must be a 4-D": (q, keys[..., :7]),
        r"^select_tokens: keys has shape \[2, 2, 0, 8\]; must be a 4-D": (q, keys[:, :, :0]),
        r"^select_tokens: keys has shape \[2, 4, 37, 8\]; must have H_kv dividing the query heads H = 6":
            (q, keys.repeat(1, 2, 1, 1)),
        r"^select_tokens: keys has dtype torch.int64; supported: torch.float32, torch.float64, torch.bfloat16, "
        r"torch.float16": (q, keys.long()),
        r"^select_tokens: keys has dtype torch.float32 but q_last has torch.float64": (q, keys.float()),
        r"^select_tokens: q_last is a list; must be a torch.Tensor": (q.tolist(), keys),
        r"^select_tokens: keys is on meta; must be on q_last's device cpu": (q, keys.to("meta")),
    }
    for pattern, (a, b) in cases.items():
        e = _refused(monkeypatch, KernelInputError, lambda: sel(a, b, 3, backend=backend))
        assert e.field in ("q_last", "keys")
        with pytest.raises(KernelInputError, match=pattern):
            sel(a, b, 3, backend=backend)
    e = _refused(monkeypatch, ConfigError, lambda: sel(q, keys, 3, backend="cuda"))
    assert e.field == "backend"


def test_sorted_top_k_returns_ids_not_positions():
    """The listing bug of the dissertation: torch.sort(idx).indices would give 0..k-1, here the token ids."""
    scores = torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0, 9.0]])
    assert ts.sorted_top_k(scores, 3).tolist() == [[1, 3, 5]]
