"""Stop-gradient InfoNCE: streamed loss vs autograd, vs the corrected closed form, and through the model."""
import math

import pytest
import torch

from featlearn.datamodules.sparse_coding import SparseCodingDataModule
from featlearn.errors import ConfigError
from featlearn.kernels.infonce import infonce_grad_closed_form, infonce_reference, infonce_stopgrad
from featlearn.lightning_modules.contrastive import ContrastiveModule
from featlearn.metrics.probes import logistic_probe, ridge_probe

CASES = [  # (K, N, m, per_anchor, chunk)
    (7, 13, 5, False, None), (7, 13, 5, False, 1), (7, 13, 5, False, 4), (3, 29, 11, False, 8),
    (5, 6, 3, True, None), (5, 6, 3, True, 4), (1, 1, 1, False, None),
]


def _hs(seed, K, N, m, per_anchor, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    ha = scale * torch.randn(K, m, generator=g, dtype=torch.float64)
    hq = scale * torch.randn(K, m, generator=g, dtype=torch.float64)
    hn = scale * torch.randn(*((K, N, m) if per_anchor else (N, m)), generator=g, dtype=torch.float64)
    return ha, hq, hn


@pytest.mark.parametrize("K,N,m,per_anchor,chunk", CASES)
def test_streamed_loss_and_grad_match_autograd_and_closed_form(K, N, m, per_anchor, chunk):
    tau = 1.7
    ha, hq, hn = _hs(K * 100 + N, K, N, m, per_anchor)
    a1 = ha.clone().requires_grad_(True)
    q1, n1 = hq.clone().requires_grad_(True), hn.clone().requires_grad_(True)
    loss, p_pos = infonce_stopgrad(a1, q1, n1, tau, chunk_size=chunk)
    loss.mean().backward()
    a2 = ha.clone().requires_grad_(True)
    ref = infonce_reference(a2, hq, hn, tau)
    ref.mean().backward()
    assert torch.allclose(loss, ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(a1.grad, a2.grad, rtol=1e-10, atol=1e-12)
    # stop-gradient: keys and negatives get no gradient at all
    assert q1.grad is None and n1.grad is None
    # corrected closed form g = -(1 - l_p) f(q) + sum_s l_s f(n_s); the mean over K divides by K
    g = infonce_grad_closed_form(ha, hq, hn, tau)
    assert torch.allclose(a1.grad, g / K, rtol=1e-10, atol=1e-12)
    # p_pos is the softmax weight of the positive
    logits = torch.cat([(ha * hq).sum(-1, keepdim=True),
                        (torch.einsum("km,knm->kn", ha, hn) if per_anchor else ha @ hn.t())], -1) / tau
    assert torch.allclose(p_pos, torch.softmax(logits, -1)[:, 0], rtol=1e-12)


@pytest.mark.parametrize("per_anchor", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vmappable_loss_is_the_functions_bit_for_bit(per_anchor, dtype):
    """``vmappable=True`` (plain ops; a seed stack's step): loss, p_pos and the anchor's gradient bit for bit the
    autograd.Function's, streamed in blocks; under ``torch.func.vmap`` over three seeds, each row its own call's to
    rounding (a batched product may sum in another order)."""
    g = torch.Generator().manual_seed(7)
    K, N, m = 13, 21, 9
    ha = torch.randn(3, K, m, generator=g, dtype=dtype)
    hq = torch.randn(3, K, m, generator=g, dtype=dtype)
    hn = torch.randn(3, *((K, N) if per_anchor else (N,)), m, generator=g, dtype=dtype)
    weights = torch.rand(K, generator=g, dtype=dtype)  # the incoming gradient, not all ones
    batched = ha.clone().requires_grad_()
    loss, p_pos = torch.func.vmap(lambda a, q, n: infonce_stopgrad(a, q, n, 1.7, 8, vmappable=True))(batched, hq, hn)
    (loss * weights).sum().backward()
    for s in range(3):
        plain, function = ha[s].clone().requires_grad_(), ha[s].clone().requires_grad_()
        mine = infonce_stopgrad(plain, hq[s], hn[s], 1.7, 8, vmappable=True)
        theirs = infonce_stopgrad(function, hq[s], hn[s], 1.7, 8)
        (mine[0] * weights).sum().backward()
        (theirs[0] * weights).sum().backward()
        for a, b in ((mine[0], theirs[0]), (mine[1], theirs[1]), (plain.grad, function.grad)):
            assert torch.equal(a.detach(), b.detach()), float((a - b).abs().max())
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
        for a, b in ((loss[s], theirs[0]), (p_pos[s], theirs[1]), (batched.grad[s], function.grad)):
            torch.testing.assert_close(a.detach(), b.detach(), **tol)


def test_paper_printed_sign_is_wrong():
    """The paper prints +(1 - l_p) f(q); the autograd gradient has -(1 - l_p) f(q)."""
    ha, hq, hn = _hs(5, 6, 9, 4, False)
    a = ha.clone().requires_grad_(True)
    infonce_reference(a, hq, hn, 1.0).sum().backward()
    soft = torch.softmax(torch.cat([(ha * hq).sum(-1, keepdim=True), ha @ hn.t()], -1), -1)
    printed = (1 - soft[:, :1]) * hq + soft[:, 1:] @ hn
    assert torch.allclose(a.grad, infonce_grad_closed_form(ha, hq, hn, 1.0), rtol=1e-12)
    assert (a.grad - printed).abs().max() > 0.1


def test_large_logits_are_stable_and_uniform_value():
    ha, hq, hn = _hs(9, 4, 50, 8, False, scale=30.0)  # logits ~ 1e3 / tau: exp would overflow naively
    loss, p = infonce_stopgrad(ha, hq, hn, 0.5, chunk_size=7)
    assert torch.isfinite(loss).all() and torch.isfinite(p).all()
    assert torch.allclose(loss, infonce_reference(ha, hq, hn, 0.5), rtol=1e-10)
    # zero anchor: all logits equal -> loss = tau log(N + 1), p_pos = 1/(N+1)
    loss0, p0 = infonce_stopgrad(torch.zeros(3, 8), torch.randn(3, 8), torch.randn(10, 8), 2.0)
    assert torch.allclose(loss0, torch.full((3,), 2.0 * math.log(11)))
    assert torch.allclose(p0, torch.full((3,), 1 / 11))


def test_bad_loss_arguments():
    a = torch.randn(2, 3)
    with pytest.raises(ConfigError, match="temperature"):
        infonce_stopgrad(a, a, a, 0.0)
    with pytest.raises(ConfigError, match="chunk_size"):
        infonce_stopgrad(a, a, a, 1.0, chunk_size=0)


@pytest.mark.parametrize("augment,bias", [("random_mask", 0.0), ("random_mask", 0.05), ("none", 0.02)])
def test_weight_gradient_through_model_matches_closed_form(augment, bias):
    """dL/dw_i = mean_k g_ki 1{|<w_i, a_k>| > b_i} a_k  (Wen & Li 2021, App. A.1), through the module and the layer."""
    dm = SparseCodingDataModule(d=8, d1=40, batch_size=16, num_negatives=24, augment=augment, seed=3)
    model = ContrastiveModule(width=12, init_scale=0.3, backend="torch", seed=1).attach(dm)
    model.bias.fill_(bias)
    batch = dm.batch(torch.arange(16), "train")
    loss = model.training_step(batch, 0)
    loss.backward()
    xa, xq, xn = (batch[k].double() for k in ("x_a", "x_q", "x_neg"))
    w, b = model.w.detach().double(), model.bias.double()

    def f(x):
        u = x @ w.t()
        return torch.sign(u) * torch.clamp_min(u.abs() - b, 0)

    g = infonce_grad_closed_form(f(xa), f(xq), f(xn), model.tau)
    fire = ((xa @ w.t()).abs() > b).double()
    grad_w = (g * fire).t() @ xa / xa.shape[0]
    assert torch.allclose(model.w.grad.double(), grad_w, rtol=1e-4, atol=1e-6 * grad_w.abs().max())


def test_sgd_step_is_decayed_gradient_step():
    """w <- (1 - eta lambda) w - eta grad: weight_decay = lambda (penalty lambda/2 ||w||^2)."""
    dm = SparseCodingDataModule(d=8, d1=40, batch_size=16, num_negatives=16, seed=0)
    model = ContrastiveModule(width=6, lr=1.5, weight_decay=0.1, init_scale=0.1, backend="torch").attach(dm)
    opt = model.configure_optimizers()
    w0 = model.w.detach().clone()
    loss = model.training_step(dm.batch(torch.arange(16), "train"), 0)
    opt.zero_grad()
    loss.backward()
    grad = model.w.grad.clone()
    opt.step()
    assert torch.allclose(model.w.detach(), (1 - 1.5 * 0.1) * w0 - 1.5 * grad, atol=1e-7)


def test_probes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 5, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0]) + 0.7
    assert ridge_probe(x[:200], y[:200], x[200:], y[200:], ridge=1e-8) < 1e-8
    noise = torch.randn(400, 5, generator=g)
    assert ridge_probe(noise[:200], y[:200], noise[200:], y[200:]) > 0.9  # unrelated features: nMSE ~ 1
    ycls = torch.sign(y - 0.7)
    assert logistic_probe(x[:200], ycls[:200], x[200:], ycls[200:]) > 0.95
    assert 0.3 < logistic_probe(noise[:200], ycls[:200], noise[200:], ycls[200:]) < 0.7
    with torch.inference_mode():  # Lightning's validation and test loops
        assert logistic_probe(x[:200], ycls[:200], x[200:], ycls[200:]) > 0.95


def test_module_config_errors():
    for kw, field in [({"lr": 0}, "model.lr"), ({"bias_mode": "free"}, "model.bias_mode"),
                      ({"temperature": -1.0}, "model.temperature"), ({"backend": "cuda"}, "model.backend"),
                      ({"weight_decay": -1e-3}, "model.weight_decay"), ({"loss_chunk_size": 0}, "model.loss_chunk_size")]:
        with pytest.raises(ConfigError, match=field):
            ContrastiveModule(**kw)


def test_seed_stack_path_refuses_what_its_vmapped_loss_cannot_read():
    """The vmapped loss reads ``x_q is x_a`` from the datamodule the module was built with and cannot gather
    negatives: several processes turn it off, and a batch of another datamodule (views that are not the built
    one's) or one pooled after a gather is refused at the step, not trained on."""
    from types import SimpleNamespace

    same = SparseCodingDataModule(d=8, d1=16, batch_size=4, num_negatives=4, augment="none")
    masked = SparseCodingDataModule(d=8, d1=16, batch_size=4, num_negatives=4)
    model = ContrastiveModule(width=4, backend="torch").attach(same)
    assert model.seeds_vmap
    model._trainer = SimpleNamespace(world_size=2)
    assert not model.seeds_vmap
    model._trainer = None
    batch = same.batch(torch.arange(4), "train")
    model.record_step(model.seed_loss(batch), batch)  # its own datamodule's batch
    for bad in (masked.batch(torch.arange(4), "train"), {**batch, "neg_pool_size": 4}):
        with pytest.raises(RuntimeError, match="another datamodule|several processes"):
            model.record_step(model.seed_loss(bad), bad)
    assert not ContrastiveModule(width=4, backend="triton").attach(masked).seeds_vmap
