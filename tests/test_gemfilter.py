"""GemFilter (Shi 2024, Ch. 9 = Shi, Ming, Nguyen, Liang, Joty, arXiv:2409.17422) on key-value retrieval: the task's
ground truth and depth statistic, the second pass's renumbered positions, the refusals, GemFilter against a direct
implementation of Algorithm 2 (App. G.4.1's code) and One-Run against a masked full pass, and the chapter's
ablation on a short-trained decoder."""
import pytest
import torch
import torch.nn.functional as F

from featlearn.datamodules.kv_retrieval import BOS, QUERY, KVRetrievalDataModule
from featlearn.errors import ConfigError
from featlearn.lightning_modules.retrieval_decoder import RetrievalDecoder

SMALL = dict(context=64, pairs=4, queries=2, fillers=8, keys=16, values=8)


def _model(dm, **kw):
    args = dict(layers=3, heads=4, kv_heads=2, head_dim=8, hidden=16, mlp_hidden=32, rope_dims=4, seed=1)
    return RetrievalDecoder(**{**args, **kw}).attach(dm).eval()


@pytest.mark.parametrize("split", ["train", "val"])
def test_the_needle_is_where_the_ground_truth_says_and_the_answer_is_its_value(split):
    dm = KVRetrievalDataModule(**SMALL, train_context=48, num_val=500, seed=3)
    b = dm.batch(torch.arange(500), split)
    tok, needle, n = b["tokens"], b["needle"], b["tokens"].shape[1]
    key, value = (tok.gather(1, needle[:, i:i + 1]).squeeze(1) for i in (0, 1))
    first_key, first_value = dm.first_token("key"), dm.first_token("value")
    assert n == (48 if split == "train" else 64) and bool((needle[:, 1] == needle[:, 0] + 1).all())
    assert bool(((key >= first_key) & (key < first_value)).all()) and torch.equal(value, b["answer"])
    assert torch.equal(tok[:, -1], key) and bool((tok[:, 0] == BOS).all())  # the last token asks the needle's key
    q = dm.queries if split == "train" else 1
    assert bool((tok[:, n - 2 * q] == QUERY).all()) and torch.equal(b["targets"][:, -1], b["answer"])
    haystack = tok[:, 1:n - 2 * q]
    is_key = (haystack >= first_key) & (haystack < first_value)
    assert bool((is_key.sum(1) == dm.pairs).all())  # every pair written whole, none over another
    after = haystack[:, 1:][is_key[:, :-1]]
    assert bool((after >= first_value).all())  # each key is followed by a value
    assert bool(((key.unsqueeze(1) == haystack).sum(1) == 1).all())  # the needle's key is unique in the haystack
    for j in range(q):  # each asked key's target is the value after its one occurrence
        pos = b["target_positions"][:, j]
        asked = tok.gather(1, pos[:, None])
        where = (haystack == asked).float().argmax(1) + 1
        assert torch.equal(tok.gather(1, (where + 1)[:, None]).squeeze(1), b["targets"][:, j])


def test_a_sample_is_a_function_of_seed_split_and_index():
    one = KVRetrievalDataModule(**SMALL, batch_size=4, seed=5)
    other = KVRetrievalDataModule(**SMALL, batch_size=16, seed=5)
    for split in ("train", "val", "test"):
        a, b = one.sample(torch.arange(16), split), other.sample(torch.arange(7, 9), split)
        assert all(torch.equal(a[key][7:9], b[key]) for key in a)
    assert not torch.equal(one.sample(torch.arange(4), "train")["tokens"],
                           KVRetrievalDataModule(**SMALL, seed=6).sample(torch.arange(4), "train")["tokens"])
    assert not torch.equal(one.sample(torch.arange(4), "val")["tokens"], one.sample(torch.arange(4), "test")["tokens"])


def test_the_needle_depth_is_uniform_and_evaluation_follows_the_grid():
    dm = KVRetrievalDataModule(**SMALL, num_val=11 * 30, eval_depths=[i / 10 for i in range(11)], seed=2)
    n, H = 20000, 64 - 1 - 2 * SMALL["queries"]
    b = dm.sample(torch.arange(n), "train")
    start = b["needle"][:, 0] - 1  # round(depth (H - 2)), depth uniform: the ends carry half a cell's mass
    assert torch.equal(start, (b["depth"].double() * (H - 2)).round().long())
    expected = torch.full((H - 1,), 1.0 / (H - 2), dtype=torch.float64)
    expected[[0, -1]] /= 2
    counts = torch.bincount(start, minlength=H - 1).double()
    chi2 = float(((counts - n * expected) ** 2 / (n * expected)).sum())
    assert chi2 < (H - 2) + 5 * (2 * (H - 2)) ** 0.5  # chi-square with H - 2 degrees of freedom, 5 sigma
    assert abs(float(b["depth"].double().mean()) - 0.5) < 4 * (1 / 12 / n) ** 0.5
    v = dm.batch(torch.arange(11 * 30), "val")
    grid = torch.arange(11 * 30) % 11 / 10
    assert torch.allclose(v["depth"].double(), grid.double(), atol=1e-6)
    assert torch.equal(v["needle"][:, 0] - 1, (grid.double() * (64 - 3 - 2)).round().long())


def test_the_second_pass_renumbers_the_selected_positions():
    dm = KVRetrievalDataModule(**SMALL, seed=1)
    model = _model(dm)
    with torch.no_grad():  # sharper attention than the initial one, so that positions matter
        for block in model.blocks:
            block.wq.weight.mul_(30)
            block.wk.weight.mul_(30)
    tokens = dm.batch(torch.arange(6), "val")["tokens"]
    out = model.gemfilter(tokens, layer=1, k=12)
    idx = out["indices"]
    sub, last = tokens.gather(1, idx), torch.full((6, 1), 11)
    with torch.no_grad():
        renumbered = model(sub, at=last)[:, 0]
        shifted = model(sub, at=last, positions=torch.arange(12) + 37)[:, 0]  # RoPE: a shift changes nothing
        original = model(sub, at=last, positions=idx)[:, 0]  # the gaps of the original positions do
    torch.testing.assert_close(out["logits"], renumbered, rtol=0, atol=0)
    torch.testing.assert_close(shifted, renumbered, rtol=1e-4, atol=1e-4)
    assert float((original - renumbered).abs().max()) > 0.03 * float(renumbered.abs().max())


def _direct(model, tokens, layer, k, row="last"):
    """Algorithm 2 step by step: Q, K of ``layer`` from a hook on a full forward, repeat_kv, the head sum of one query
    row's scores, avg_pool1d (kernel 5, padding 2), top-k, token ids sorted, a full forward on T_J."""
    seen = {}
    hook = model.blocks[layer].register_forward_hook(lambda mod, args, out: seen.update(qk=out[1][:2]))
    with torch.no_grad():
        model(tokens)
    hook.remove()
    q, K = seen["qk"]
    B, H, n, D = q.shape
    rep = H // K.shape[1]
    K = K[:, :, None].expand(B, K.shape[1], rep, n, D).reshape(B, H, n, D)  # transformers' repeat_kv
    r = n - 1 if row == "last" else (n - 1) // 2
    s = (q[:, :, r:r + 1] @ K.transpose(2, 3))[:, :, 0].sum(1, keepdim=True)
    s = F.avg_pool1d(s, kernel_size=5, padding=2, stride=1)[:, 0]
    s[:, r + 1:] = -float("inf")  # the row's causal past
    J, _ = torch.sort(torch.topk(s, k, dim=-1).indices, dim=-1)
    with torch.no_grad():
        return J, model(tokens.gather(1, J))[:, -1]


@pytest.mark.parametrize("layer, k, row", [(0, 8, "last"), (2, 20, "last"), (1, 16, "middle")])
def test_gemfilter_equals_a_direct_implementation_of_algorithm_2(layer, k, row):
    dm = KVRetrievalDataModule(**SMALL, seed=4)
    model = _model(dm)  # untrained, 4 query heads on 2 key-value heads
    b = dm.batch(torch.arange(5), "val")
    out = model.gemfilter(b["tokens"], layer, k, row=row, needle=b["needle"])
    J, logits = _direct(model, b["tokens"], layer, k, row)
    assert torch.equal(out["indices"], J)
    torch.testing.assert_close(out["logits"], logits, rtol=1e-5, atol=1e-5)
    kept = torch.tensor([[int(p in J[i]) for p in b["needle"][i].tolist()] for i in range(5)]).float().mean(1)
    torch.testing.assert_close(out["recall"], kept)


def test_one_run_is_the_full_pass_with_the_last_row_reading_the_selected_cache():
    dm = KVRetrievalDataModule(**SMALL, seed=4)
    model = _model(dm)
    tokens = dm.batch(torch.arange(5), "val")["tokens"]
    out = model.gemfilter(tokens, 1, 10, one_run=True)
    B, n = tokens.shape
    mask = torch.ones(n, n, dtype=torch.bool).tril().expand(B, 1, n, n).clone()
    mask[:, 0, -1] = torch.zeros(B, n, dtype=torch.bool).scatter(1, out["indices"], True) | (torch.arange(n) == n - 1)
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], model(tokens, mask=mask)[:, -1], rtol=1e-5, atol=1e-5)
        assert float((out["logits"] - model(tokens)[:, -1]).abs().max()) > 1e-3  # the eviction changes the answer
    kept = model.gemfilter(tokens, 1, 10, keep_last=2)["indices"]
    assert bool((kept[:, -2:] == torch.tensor([n - 2, n - 1])).all())


@pytest.mark.parametrize("call, field", [
    (lambda m, t: m.gemfilter(t, 0, 65), "gemfilter.k"),
    (lambda m, t: m.gemfilter(t, 0, 8, pool_kernel=4), "gemfilter.pool_kernel"),
    (lambda m, t: m.gemfilter(t, 3, 8), "gemfilter.layer"),
    (lambda m, t: m.gemfilter(t, -1, 8), "gemfilter.layer"),
    (lambda m, t: m.gemfilter(t, 0, 8, row="first"), "gemfilter.row"),
    (lambda m, t: m.gemfilter(t, 0, 8, keep_last=9), "gemfilter.keep_last"),
])
def test_gemfilter_refuses_bad_values_before_any_work(call, field, monkeypatch):
    dm = KVRetrievalDataModule(**SMALL)
    model = _model(dm)
    monkeypatch.setattr(model, "run", lambda *a, **k: pytest.fail("ran on refused values"))
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        call(model, dm.batch(torch.arange(2), "val")["tokens"])


@pytest.mark.parametrize("build, field", [
    (lambda: KVRetrievalDataModule(pairs=40, keys=32), "data.keys"),
    (lambda: KVRetrievalDataModule(context=20, pairs=8), "data.context"),
    (lambda: KVRetrievalDataModule(context=512, train_context=24, pairs=8, queries=4), "data.train_context"),
    (lambda: KVRetrievalDataModule(pairs=4, queries=5), "data.queries"),
    (lambda: KVRetrievalDataModule(eval_depths=[0.5, 1.5]), "data.eval_depths"),
    (lambda: KVRetrievalDataModule(eval_depths=[]), "data.eval_depths"),
    (lambda: RetrievalDecoder(pool_kernel=4), "model.pool_kernel"),
    (lambda: RetrievalDecoder(layers=4, val_layer=4), "model.val_layer"),
    (lambda: RetrievalDecoder(heads=4, kv_heads=3), "model.kv_heads"),
    (lambda: RetrievalDecoder(head_dim=8, rope_dims=10), "model.rope_dims"),
    (lambda: RetrievalDecoder(val_budgets=[600]).attach(KVRetrievalDataModule()), "model.val_budgets"),
])
def test_bad_values_are_refused_naming_the_field(build, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build()


TINY = dict(context=256, train_context=48, pairs=4, queries=3, fillers=8, keys=16, values=8, batch_size=16)


@pytest.fixture(scope="module")
def trained():
    """A 4-layer decoder (hidden 32) trained 250 Adam steps on 48-token prompts (about 8 s on one thread), and 128
    test prompts of 256 tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dm = KVRetrievalDataModule(**TINY, seed=0)
    model = RetrievalDecoder(layers=4, heads=2, head_dim=16, hidden=32, mlp_hidden=64, seed=0).attach(dm)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for step in range(250):
        b = dm.batch(torch.arange(step * 16, step * 16 + 16), "train")
        loss = F.cross_entropy(model(b["tokens"], at=b["target_positions"]).flatten(0, 1), b["targets"].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    return model.eval(), dm.batch(torch.arange(128), "test")


def _recall(model, b, layer, row):
    return float(model.gemfilter(b["tokens"], layer, 16, row=row, needle=b["needle"])["recall"].mean())


def test_headline_the_last_row_finds_the_needle_the_middle_row_does_not(trained):
    """At the layer that finds the needle (layer 0 here; the chapter's rule: the first layer that does), k = 16 of
    256 tokens: measured recall 0.75 with the last row, 0.09 with the middle row (0.28 with the largest-l2 row;
    chance 16/256 = 0.06). Seeds 1 and 2 of this size: 0.55 / 0.11 and 0.45 / 0.06."""
    model, b = trained
    assert float((model(b["tokens"])[:, -1].argmax(-1) == b["answer"]).float().mean()) > 0.9  # it learned the task
    assert _recall(model, b, 0, "last") > _recall(model, b, 0, "middle") + 0.3


@pytest.mark.xfail(strict=True, reason="measured: the trained decoder retrieves in layer 0; at the middle layer 1 "
                                       "of 4 the last row's recall is 0.03 (middle row 0.04, chance 0.06)")
def test_headline_a_middle_layer_suffices(trained):
    model, b = trained
    assert _recall(model, b, 1, "last") > max(0.5, _recall(model, b, 1, "middle") + 0.3)
