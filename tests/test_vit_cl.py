"""The contrastive ViT of Huang et al. 2025 (Def. 2.6, eq. 2.11, Thm 4.4): the pooled form equals the fused
op, the InfoNCE loss with in-batch negatives and stop-gradient candidates, the exact gradient of Lemma J.2,
the support of Q, the init values, the collapse onto the global area and its failure for
K (1 - gamma0) <= 1 (outside the paper), the warning, the logged run and refusals."""
import doctest
import math
import warnings
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from featlearn.cli import make_cli
from featlearn.datamodules.global_local_patches import GlobalLocalPatchDataModule
from featlearn.errors import ConfigError
from featlearn.metrics.figures import plt
from featlearn.lightning_modules import vit_cl
from featlearn.lightning_modules.vit_cl import ViTCL, infonce_in_batch
from featlearn.theory import vit as theory

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]


def _dm(**kw):
    base = dict(P=47, K=6, kappa_c=None, kappa_s=None, C_1=12, C_s=5, d=97, batch_size=7, seed=2, dtype="float64")
    base.update(kw)
    return GlobalLocalPatchDataModule(**base)


def _model(pooling="pooled", **kw):
    dm = _dm(**kw)
    model = ViTCL(gamma0=0.4, pooling=pooling, backend="torch").attach(dm)
    with torch.no_grad():
        model.Q[:47].copy_(2.0 * torch.randn(47, 97, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    return model, dm, dm.batch(torch.arange(20, 27), "train")


def test_pooled_form_equals_the_fused_op_and_its_gradient():
    model, dm, batch = _model("pooled")
    op = ViTCL(gamma0=0.4, pooling="op", backend="torch").attach(_dm())
    with torch.no_grad():
        op.Q.copy_(model.Q)
    a, b = model.batch_loss(batch, with_areas=True), op.batch_loss(batch, with_areas=True)
    assert float(a["loss"].detach()) == pytest.approx(float(b["loss"].detach()), rel=1e-12)
    torch.testing.assert_close(a["F1"], b["F1"], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(a["A"], b["A"], rtol=1e-12, atol=1e-14)
    ga = torch.autograd.grad(a["loss"], (model.Q,))[0]
    gb = torch.autograd.grad(b["loss"], (op.Q,))[0]
    torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-14)
    assert float(ga.abs().max()) > 1e-4


def test_infonce_with_in_batch_negatives_against_its_definition():
    gen = torch.Generator().manual_seed(1)
    anchor = torch.randn(5, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    pos, every = torch.randn(5, 9, generator=gen, dtype=torch.float64), torch.randn(5, 9, generator=gen, dtype=torch.float64)
    loss, p_pos = infonce_in_batch(anchor, pos, every, torch.arange(5), 0.3)
    for i in range(5):
        cands = torch.cat([pos[i:i + 1], every[[j for j in range(5) if j != i]]])
        logits = cands @ anchor[i].detach() / 0.3
        ref = -0.3 * torch.log_softmax(logits, 0)[0]
        assert float(loss[i].detach()) == pytest.approx(float(ref), rel=1e-12)
        assert float(p_pos[i]) == pytest.approx(float(torch.softmax(logits, 0)[0]), rel=1e-12)
    # the candidates are constants: the gradient is the closed form -(1 - l_p) F(X++) + sum_s l_s F(X_s)
    (g,) = torch.autograd.grad(loss.sum(), (anchor,))
    for i in range(5):
        others = every[[j for j in range(5) if j != i]]
        w = torch.softmax(torch.cat([pos[i:i + 1], others]) @ anchor[i].detach() / 0.3, 0)
        want = -(1 - w[0]) * pos[i] + w[1:] @ others
        torch.testing.assert_close(g[i], want, rtol=1e-12, atol=1e-14)


def test_gradient_is_lemma_j2_on_the_query_rows():
    """Autograd on Q = E^T dW with dW_p = sum_b sum_q a_pq (h_q - c_p) X+_q (Lemma J.2), g = dL/dF(X+)."""
    model, dm, batch = _model()
    out = model.batch_loss(batch)
    (gq,) = torch.autograd.grad(out["loss"], (model.Q,))
    x = dm.dense(batch)
    x1, x2 = dm.dense(batch, "view1"), dm.dense(batch, "view2")
    W = model.query_rows().detach()

    def pooled(v):
        return (torch.softmax(W @ v.transpose(1, 2), -1).mean(1).unsqueeze(1) @ v).squeeze(1)

    f1, f2, fx = pooled(x1), pooled(x2), pooled(x)
    B = x.shape[0]
    g = torch.zeros_like(f1)
    for i in range(B):  # g_i = dL/dF1_i = (1/B) (-F2_i + sum_c w_c F_c)
        cands = torch.cat([f2[i:i + 1], fx[[j for j in range(B) if j != i]]])
        w = torch.softmax(cands @ f1[i] / model.tau, 0)
        g[i] = (-f2[i] + w @ cands) / B
    dW = theory.cl_gradient_rows(W, x1, g)
    scale = float(dW.abs().max())
    assert scale > 1e-6
    torch.testing.assert_close(model.E @ gq, dW, rtol=1e-9, atol=1e-12 * scale)
    assert float(gq[47:].abs().max()) == 0.0


def test_init_values_and_uniform_attention():
    """At Q = 0, F(X) = mean_q X_q, every query's attention to masked keys is gamma0 and its
    attention to the global area is |U+ cap P_1| / P (mean (1 - gamma0) C_1 / P)."""
    dm = GlobalLocalPatchDataModule(P=256, K=8, kappa_c=0.875, kappa_s=0.5, d=384, batch_size=32)
    model = ViTCL(gamma0=0.5).attach(dm)
    batch = dm.batch(torch.arange(32), "train")
    out = model.batch_loss(batch, with_areas=True)
    x1 = dm.dense(batch, "view1")
    torch.testing.assert_close(out["F1"], x1.mean(1), rtol=1e-5, atol=1e-7)
    A = out["A"]
    torch.testing.assert_close(A[..., -1], torch.full_like(A[..., -1], 0.5), rtol=1e-5, atol=1e-6)
    glob = ((~batch["mask1"]) & batch["is_global"]).sum(1).float() / 256
    torch.testing.assert_close(A[..., 0], glob.unsqueeze(1).expand_as(A[..., 0]), rtol=1e-5, atol=1e-6)
    met = model.metrics(batch, out)
    want = theory.init_values(256, 128, 16, 128)
    assert float(met["attn_glob_from_local"]) == pytest.approx(want["attn_glob_from_local"], rel=0.05)
    assert float(met["attn_own_local"]) == pytest.approx(want["attn_own_local"], rel=0.1)
    # the positive probability and the loss from their definitions, with F(X) = mean_q X_q of every view
    f1, f2, fx = x1.double().mean(1), dm.dense(batch, "view2").double().mean(1), dm.dense(batch).double().mean(1)
    p_pos = []
    for i in range(32):
        cands = torch.cat([f2[i:i + 1], fx[[j for j in range(32) if j != i]]])
        p_pos.append(torch.softmax(cands @ f1[i] / model.tau, 0)[0])
    p_pos = torch.stack(p_pos)
    assert 0.0 < float(p_pos.mean()) < 0.5
    assert float(met["p_pos"]) == pytest.approx(float(p_pos.mean()), rel=1e-4)
    assert float(met["loss"]) == pytest.approx(float(-model.tau * p_pos.log().mean()), rel=1e-4)
    assert model.tau == pytest.approx(1 / math.log(384))


def _sgd(model, dm, steps, B):
    opt = model.configure_optimizers()
    for t in range(steps):
        out = model.batch_loss(dm.batch(torch.arange(t * B, (t + 1) * B), "train"))
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        model.track_phi(t + 1)


def test_q_changes_only_in_its_positional_rows_but_in_every_column():
    """The query rows pick up noise (every column), the rows outside span(E) stay exactly 0."""
    dm = _dm(dtype="float32", d=128, K=8)
    model = ViTCL(gamma0=0.5, lr=2000.0).attach(dm)
    _sgd(model, dm, 5, 7)
    Q = model.Q.detach()
    assert float(Q[47:].abs().max()) == 0.0
    noise_cols = Q[:47, 47 + 8 * 8:]
    assert float((noise_cols != 0).float().mean()) > 0.99 and float(noise_cols.abs().max()) > 1e-4


def _metrics(model, dm, index):
    batch = dm.batch(index, "train")
    with torch.no_grad():
        out = model.batch_loss(batch, with_areas=True)
        met = {**model.metrics(batch, out), **model.phi_metrics()}
    return {k: float(v) for k, v in met.items()}


def test_collapse_onto_the_global_area_starts_within_30_steps():
    """A short headline run (p256_pos, K = 8, gamma0 = 0.5, d = 384, B = 32, eta = 5000, 30 steps; ~4 s). Measured on a
    held-out batch: attention of local queries to the global area 0.25 -> 0.59, own local area 0.031 -> 0.017,
    Phi_glob 1.43 against mean |Phi_local| 0.05."""
    dm = GlobalLocalPatchDataModule(P=256, K=8, kappa_c=0.875, kappa_s=0.5, d=384, batch_size=32)
    model = ViTCL(gamma0=0.5, lr=5000.0).attach(dm)
    held_out = torch.arange(10**6, 10**6 + 64)
    before = _metrics(model, dm, held_out)
    _sgd(model, dm, 30, 32)
    after = _metrics(model, dm, held_out)
    assert after["attn_glob_from_local"] >= before["attn_glob_from_local"] + 0.15
    assert after["attn_own_local"] <= before["attn_own_local"] + 0.005
    assert after["phi_global_own"] >= 5 * after["phi_local_features_absmean"]


def test_k_gamma0_at_one_makes_the_global_correlation_fall():
    """K = 2, gamma0 = 0.5 (K (1 - gamma0) = 1), eta = 500, 20 steps: Phi_glob < 0 and the
    attention to the global area below its init. Measured: phi_global_own -0.27, attention 0.25 -> 0.20
    (our numpy check: -0.29, 0.249 -> 0.196)."""
    dm = GlobalLocalPatchDataModule(P=256, K=2, kappa_c=0.875, kappa_s=0.5, d=320, batch_size=32)
    with pytest.warns(UserWarning, match=r"K \(1 - gamma0\) = 1.00"):
        model = ViTCL(gamma0=0.5, lr=500.0).attach(dm)
    held_out = torch.arange(10**6, 10**6 + 64)
    before = _metrics(model, dm, held_out)
    _sgd(model, dm, 20, 32)
    after = _metrics(model, dm, held_out)
    assert after["phi_global_own"] < 0 and after["attn_glob_all"] < before["attn_glob_all"] - 0.02


def test_no_warning_when_k_gamma0_is_large():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ViTCL(gamma0=0.5).attach(_dm(K=8, d=128))


@pytest.mark.slow
def test_headline_cl_collapses_for_either_sign_of_delta():
    """Thm 4.4 (p256_pos / p256_neg, K = 8, gamma0 = 0.5, d = 512, B = 32, eta = 5000, 100 steps; ~15 s a
    run on one thread). Measured on a held-out batch of 64, every 25 steps: Delta = +0.25: attention of local
    queries to the global area 0.25, 0.54, 0.61, 0.60, 0.61; own local 0.031 -> 0.016; Phi_glob 1.52.
    Delta = -0.25: 0.063, 0.071, 0.083, 0.107, 0.181 (rising; 0.78 by step 200); own local 0.031 -> 0.028;
    Phi_glob 1.20."""
    results = {}
    for name, kappa_c in (("pos", 0.875), ("neg", 0.625)):
        dm = GlobalLocalPatchDataModule(P=256, K=8, kappa_c=kappa_c, kappa_s=0.5, d=512, batch_size=32)
        model = ViTCL(gamma0=0.5, lr=5000.0).attach(dm)
        held_out = torch.arange(10**6, 10**6 + 64)
        trend = [_metrics(model, dm, held_out)]
        for _ in range(4):
            _sgd_continue(model, dm, 25)
            trend.append(_metrics(model, dm, held_out))
        results[name] = trend
    pos, neg = results["pos"], results["neg"]
    assert pos[-1]["attn_glob_from_local"] >= pos[0]["attn_glob_from_local"] + 0.2
    glob_neg = [m["attn_glob_from_local"] for m in neg]
    assert all(b >= a - 0.005 for a, b in zip(glob_neg, glob_neg[1:])) and glob_neg[-1] > glob_neg[0] + 0.05
    for trend in (pos, neg):
        assert trend[-1]["attn_own_local"] <= trend[0]["attn_own_local"] + 0.005
        assert trend[-1]["phi_global_own"] >= 5 * trend[-1]["phi_local_features_absmean"]


def _sgd_continue(model, dm, steps):
    opt = getattr(model, "_test_opt", None) or model.configure_optimizers()
    model._test_opt = opt
    start = getattr(model, "_test_step", 0)
    for t in range(start, start + steps):
        out = model.batch_loss(dm.batch(torch.arange(t * 32, (t + 1) * 32), "train"))
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        model.track_phi(t + 1)
    model._test_step = start + steps


def test_cli_run_logs_metrics_figures_and_results(tmp_path):
    cli = make_cli(["--config", str(ROOT / "configs/vit/cl.yaml"), "--trainer.max_steps", "4",
                    "--trainer.log_every_n_steps", "2", "--trainer.logger.init_args.save_dir", str(tmp_path),
                    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                    "--data.init_args.d", "384", "--data.init_args.batch_size", "8"], run=False)
    open_figures = set(plt.get_fignums())
    cli.trainer.fit(cli.model, cli.datamodule)
    assert set(plt.get_fignums()) == open_figures, "the attention figures outlived the fit"
    run = next(tmp_path.rglob("hparams.yaml")).parent
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()
    assert {"attention/areas", "attention/sample", "heatmap/correlation"} <= set(tags["images"])
    for name in ("train/attn_glob_from_local", "train/attn_own_local", "train/p_pos", "train/q_fro",
                 "train/noise_pickup", "train/objective", "theory/phi_global_own", "hp/own_area_local",
                 "hp/attn_global", "hp/final_loss", "hp/loss_floor", "hp/q_fro"):
        assert name in tags["scalars"], name
    final = cli.model.final_metrics()
    assert final["loss_floor"] == pytest.approx(theory.cl_loss_floor(7, 8, cli.model.tau))


@pytest.mark.parametrize("kwargs,field", [
    (dict(gamma0=1.0), "model.gamma0"), (dict(gamma0=0.0), "model.gamma0"), (dict(lr=-1.0), "model.lr"),
    (dict(temperature=0.0), "model.temperature"), (dict(weight_decay=-0.1), "model.weight_decay"),
    (dict(pooling="max"), "model.pooling"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        ViTCL(**kwargs)
    assert err.value.field == field


def test_refusals_that_need_the_data():
    with pytest.raises(ConfigError, match="data.batch_size:"):
        ViTCL().attach(_dm(batch_size=1, K=8, d=128))
    with pytest.raises(ConfigError, match="model.gamma0:"):
        ViTCL(gamma0=0.999).attach(_dm(K=8, d=128))


def test_docstring_examples():
    result = doctest.testmod(vit_cl, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_fused_op_through_the_triton_kernel_matches_the_pooled_form():
    """pooling="op" on the op's Triton path (interpreter, tiny sizes) = the pooled PyTorch form (float32)."""
    # P = 37: three 16-wide interpreter key tiles (the last partial), d = 71: five d-tiles
    kw = dict(P=37, K=4, C_1=9, C_s=4, d=71, batch_size=3, dtype="float32")
    pooled = ViTCL(gamma0=0.5, pooling="pooled").attach(_dm(**kw))
    fused = ViTCL(gamma0=0.5, pooling="op", backend="triton", input_precision="ieee").attach(_dm(**kw))
    with torch.no_grad():
        pooled.Q[:37].copy_(torch.randn(37, 71, generator=torch.Generator().manual_seed(5)))
        fused.Q.copy_(pooled.Q)
    dm = _dm(**kw)
    dm.use_cl_views(0.5)
    batch = dm.batch(torch.arange(3), "train")
    a, b = pooled.batch_loss(batch, with_areas=True), fused.batch_loss(batch, with_areas=True)
    assert float(b["loss"].detach()) == pytest.approx(float(a["loss"].detach()), rel=1e-5)
    torch.testing.assert_close(b["A"], a["A"], rtol=1e-5, atol=1e-6)
    ga = torch.autograd.grad(a["loss"], (pooled.Q,))[0]
    gb = torch.autograd.grad(b["loss"], (fused.Q,))[0]
    torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6 * float(ga.abs().max()))
