"""The seed-002 MAE module (spec 002 sections 3.1, 4.1-4.2, 5.4-5.5): the closed-form loss (T1), the exact
gradient against autograd on both paths (T2), the paths' identical SGD trajectories, basis invariance (T3),
the support of Q (T4), the init values and gradient signs (T5), the headline at P = 256 (T6), the logged
figures and refusals."""
import doctest
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from featlearn.cli import make_cli
from featlearn.datamodules.global_local_patches import GlobalLocalPatchDataModule
from featlearn.errors import ConfigError
from featlearn.kernels.masked_attention import masked_attention_reference
from featlearn.lightning_modules import vit_common, vit_mae
from featlearn.lightning_modules.vit_mae import ViTMAE
from featlearn.theory import vit as theory

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]


def _dm(**kw):
    # odd sizes: P = 47, 3 clusters of 8 areas (C_1 = 12, C_s = 5), d = 77
    base = dict(P=47, K=3, kappa_c=None, kappa_s=None, C_1=12, C_s=5, d=77, batch_size=6, seed=2, dtype="float64")
    base.update(kw)
    return GlobalLocalPatchDataModule(**base)


def _pair(gamma=0.6, masked_keys="include", **data):
    """A structured and a dense model at the same random (Phi, Upsilon), and a batch."""
    s = ViTMAE(gamma=gamma, masked_keys=masked_keys).attach(_dm(**data))
    d = ViTMAE(gamma=gamma, masked_keys=masked_keys, path="dense", backend="torch").attach(_dm(**data))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        s.phi.copy_(torch.randn(s.phi.shape, generator=gen, dtype=torch.float64))
        s.upsilon.copy_(0.5 * torch.randn(s.upsilon.shape, generator=gen, dtype=torch.float64))
        d.Q.copy_(s.Q_matrix())
    dm = _dm(**data)
    dm.use_mae_masks(gamma)
    return s, d, dm.batch(torch.arange(100, 106), "train")


def _reference_loss(model, batch):
    """The loss written from the definition (spec 3.1, 4.1), float64, with the op's plain reference."""
    x = theory.patch_vectors(batch["feat_id"], batch["z"], model.V)
    mx = x * (~batch["mask"]).unsqueeze(-1)
    out, _ = masked_attention_reference(model.E @ model.Q_matrix(), mx + model.E, mx, query_index=batch["masked_idx"])
    target = x.gather(1, batch["masked_idx"].unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return 0.5 * ((out - target) ** 2).sum((1, 2)).mean()


def test_closed_form_loss_equals_the_direct_loss():
    """T1: Lemma D.8 in area coordinates = the d-dimensional reconstruction loss, on both paths."""
    s, d, batch = _pair()
    ref = _reference_loss(s, batch)
    loss_s, per_query, A = s.batch_loss(batch)
    loss_d = d.batch_loss(batch)[0]
    own = batch["area"].gather(1, batch["masked_idx"])
    closed = theory.area_loss(A, batch["z_area"], own).sum(1).mean()
    assert float(ref.detach()) > 1.0
    for value in (loss_s, loss_d, closed):
        assert float(value) == pytest.approx(float(ref), rel=1e-12)
    torch.testing.assert_close(per_query, theory.area_loss(A, batch["z_area"], own), rtol=1e-12, atol=0)


@pytest.mark.parametrize("masked_keys", ["include", "exclude"])
def test_exact_gradient_equals_autograd_on_both_paths(masked_keys):
    """T2: autograd on the dense Q (projected on Phi, Upsilon) = autograd on the structured path = spec 4.2."""
    s, d, batch = _pair(masked_keys=masked_keys)
    g_phi, g_ups = torch.autograd.grad(s.batch_loss(batch)[0], (s.phi, s.upsilon))
    (g_q,) = torch.autograd.grad(d.batch_loss(batch)[0], (d.Q,))
    E, V = s.E, s.V
    scale = float(g_phi.abs().max())
    assert scale > 1e-3
    torch.testing.assert_close(E @ g_q @ V.T, g_phi, rtol=1e-10, atol=1e-12 * scale)
    torch.testing.assert_close(E @ g_q @ E.T, g_ups, rtol=1e-10, atol=1e-12 * scale)
    assert float(g_q[47:].abs().max()) == 0.0                           # content rows get no gradient
    if masked_keys == "include":
        attn = s.structured_attention(batch, batch["masked_idx"]).detach()
        alpha, beta = theory.mae_gradient_projections(attn, batch["masked_idx"], batch["area"], ~batch["mask"],
                                                      batch["z_area"], batch["cluster"], 3)
        torch.testing.assert_close(alpha, -g_phi, rtol=1e-10, atol=1e-12 * scale)
        torch.testing.assert_close(beta, -g_ups, rtol=1e-10, atol=1e-12 * scale)


def _sgd(model, dm, steps, start=0):
    opt = model.configure_optimizers()
    losses = []
    for t in range(start, start + steps):
        batch = dm.batch(torch.arange(t * 6, t * 6 + 6), "train")
        loss = model.batch_loss(batch)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_dense_and_structured_paths_follow_the_same_trajectory():
    dm_s, dm_d = _dm(), _dm()
    s = ViTMAE(gamma=0.6, lr=40.0).attach(dm_s)
    d = ViTMAE(gamma=0.6, lr=40.0, path="dense", backend="torch").attach(dm_d)
    ls, ld = _sgd(s, dm_s, 8), _sgd(d, dm_d, 8)
    assert ls[-1] < 0.8 * ls[0]
    torch.testing.assert_close(torch.tensor(ld), torch.tensor(ls), rtol=1e-10, atol=0)
    torch.testing.assert_close(d.correlations(), s.correlations(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(d.pp_correlations(), s.pp_correlations(), rtol=1e-9, atol=1e-12)
    assert float(s.correlations().abs().max()) > 0.5


def test_canonical_and_haar_bases_give_the_same_correlations():
    """T3: zero-init GD is equivariant under Q -> R Q R^T: Phi, Upsilon and the losses agree."""
    runs = {}
    for basis in ("canonical", "haar"):
        dm = _dm(basis=basis)
        model = ViTMAE(gamma=0.6, lr=40.0, path="dense", backend="torch").attach(dm)
        runs[basis] = (_sgd(model, dm, 30), model.correlations(), model.pp_correlations())
    (lc, pc, uc), (lh, ph, uh) = runs["canonical"], runs["haar"]
    torch.testing.assert_close(torch.tensor(lh), torch.tensor(lc), rtol=1e-9, atol=0)
    torch.testing.assert_close(ph, pc, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(uh, uc, rtol=1e-7, atol=1e-9)
    assert float(pc.abs().max()) > 1.0


def test_q_changes_only_in_its_positional_rows():
    """T4: after training, Q (canonical basis) is nonzero only in rows 0..P-1, columns 0..P+KN-1."""
    dm = _dm()
    model = ViTMAE(gamma=0.6, lr=40.0, path="dense", backend="torch").attach(dm)
    _sgd(model, dm, 5)
    Q = model.Q.detach()
    assert float(Q[:47, :47 + 24].abs().max()) > 0.1
    assert float(Q[47:].abs().max()) == 0.0 and float(Q[:, 47 + 24:].abs().max()) == 0.0
    # the structured path's Q is the same kind of matrix
    dm_s = _dm()
    s = ViTMAE(gamma=0.6, lr=40.0).attach(dm_s)
    _sgd(s, dm_s, 5)
    torch.testing.assert_close(s.Q_matrix(), Q, rtol=1e-9, atol=1e-12)


def test_init_values_match_spec_5_4():
    """T5: at Q = 0 attention is uniform: E[attn_own] = (1 - gamma) C / P, attention to masked keys = gamma."""
    dm = GlobalLocalPatchDataModule(P=256, K=4, kappa_c=0.875, kappa_s=0.5, batch_size=64)
    model = ViTMAE(gamma=0.75).attach(dm)
    batch = dm.batch(torch.arange(64), "train")
    loss, per_query, A = model.batch_loss(batch)
    met = model.metrics(batch, per_query, A)
    want = theory.init_values(256, 128, 16, 192, masked_query=True)
    assert float(met["attn_to_masked"]) == pytest.approx(0.75, abs=1e-6)           # exactly, every query
    assert float(met["attn_own_local"]) == pytest.approx(want["attn_own_local"], rel=0.03)
    assert float(met["attn_own_global"]) == pytest.approx(want["attn_own_global"], rel=0.02)
    assert float(met["attn_glob_from_local"]) == pytest.approx(want["attn_glob_from_local"], rel=0.02)
    # spec 5.4's (1 - gamma) C / P counts the query's own patch among the unmasked ones: 16/1024 and 128/1024
    spec = theory.init_values(256, 128, 16, 192)
    assert spec["attn_own_local"] == pytest.approx(16 / 1024) and spec["attn_own_global"] == pytest.approx(128 / 1024)
    assert want["attn_own_local"] == pytest.approx(spec["attn_own_local"], rel=0.07)
    # spec 4.1: per masked patch 1/2 E[z^2] (1 - (1 - gamma) C_a / P)^2 at init: 0.50 local, 0.38 global
    assert float(met["loss_local"]) == pytest.approx(0.5 * 1.0033 * (1 - 16 / 1024) ** 2, rel=0.03)
    assert float(met["loss_global"]) == pytest.approx(0.5 * 1.0033 * (1 - 128 / 1024) ** 2, rel=0.03)


def _init_alpha(P, kappa_c, kappa_s, batch_size=64, gamma=0.75):
    """Sums over the masked local queries of alpha_own and alpha_glob, and over the global ones of alpha_own,
    at Q = 0, from spec 4.2's exact formula (checked against autograd above) with ``A_m = |U cap P_m| / P``
    (uniform attention): no (B, Pq, P) tensor, so P = 4096 is cheap."""
    dm = GlobalLocalPatchDataModule(P=P, K=1, kappa_c=kappa_c, kappa_s=kappa_s, batch_size=batch_size)
    dm.use_mae_masks(gamma)
    b = dm.batch(torch.arange(batch_size), "train")
    N = dm.n_areas
    A = torch.zeros(batch_size, N, dtype=torch.float64).scatter_add_(1, b["area"], (~b["mask"]).double()) / P
    z = b["z_area"].double()
    own = b["area"].gather(1, b["masked_idx"])                                     # [B, Pq]
    A_n, z_n = A.gather(1, own), z.gather(1, own)
    sq = (z * A).square().sum(1, keepdim=True)                                      # sum_a z_a^2 A_a^2
    others_n = sq - (z_n * A_n).square()
    alpha_own = A_n * (z_n ** 3 * (1 - A_n).square() + others_n * z_n)
    A_1, z_1 = A[:, :1], z[:, :1]
    alpha_glob = A_1 * ((others_n - (z_1 * A_1).square()) * z_1 - z_1 * z_n.square() * (1 - A_n) * A_n
                        - z_1 ** 3 * (1 - A_1) * A_1)
    local = own > 0
    return float(alpha_own[local].sum()), float(alpha_glob[local].sum()), float(alpha_own[~local].sum()), dm


def test_initial_gradient_of_the_formula_is_autograds():
    """The Q = 0 shortcut of _init_alpha is the autograd gradient of the structured path."""
    dm = GlobalLocalPatchDataModule(P=256, K=1, kappa_c=0.875, kappa_s=0.5, batch_size=8)
    model = ViTMAE(gamma=0.75).attach(dm)
    loss = model.batch_loss(dm.batch(torch.arange(8), "train"))[0]
    (g,) = torch.autograd.grad(loss, (model.phi,))
    parts = model.phi_parts(-g.double() * 8)                                     # sums, not batch means
    own, glob, own_global, _ = _init_alpha(256, 0.875, 0.5, batch_size=8)
    assert float(parts["own"][parts["local"]].sum()) == pytest.approx(own, rel=1e-5)
    assert float(parts["glob"][parts["local"]].sum()) == pytest.approx(glob, rel=1e-5)
    assert float(parts["own"][~parts["local"]].sum()) == pytest.approx(own_global, rel=1e-5)


@pytest.mark.parametrize("kappa_c,delta", [(0.75, 0.25), (0.5, -0.25)])
def test_initial_gradient_signs_and_ratio_scale_like_p_to_the_delta(kappa_c, delta):
    """T5: alpha_own > 0 > alpha_glob for local patches, alpha_own > 0 for global ones, and
    |alpha_glob / alpha_own| ~ P^Delta. kappa_s = 1/4 and P = 256, 4096 keep the sizes exact powers
    (C_s = 4, 8; C_1 = 64, 512 or 16, 64). Measured slopes: +0.22 (Delta = +1/4), -0.30 (Delta = -1/4; the
    next term, -z_1 z_n^2 A_n A_1, scales like P^{kappa_c + kappa_s - 2} and steepens it)."""
    ratios = []
    for P in (256, 4096):
        own, glob, own_global, dm = _init_alpha(P, kappa_c, 0.25)
        assert own > 0 > glob and own_global > 0
        assert dm.delta_eff == pytest.approx(delta)
        ratios.append(abs(glob / own))
    slope = math.log(ratios[1] / ratios[0]) / math.log(16)
    assert slope == pytest.approx(delta, abs=0.07)


def test_first_step_moves_local_own_correlation_by_the_eta_rule():
    """Spec 4.4: with eta = eta_mae the first step moves a local patch's own-area correlation by ~0.02,
    since alpha_own^(0) ~ (gamma / K) E[z^3] (1 - gamma) C_s / P per entry."""
    dm = GlobalLocalPatchDataModule(P=256, K=2, kappa_c=0.875, kappa_s=0.5, batch_size=256)
    model = ViTMAE(gamma=0.75).attach(dm)
    assert model.lr == pytest.approx(theory.eta_mae(256, 2, 16, 0.75, dm.z_moments[2]))
    _sgd_one = model.configure_optimizers()
    loss = model.batch_loss(dm.batch(torch.arange(256), "train"))[0]
    loss.backward()
    _sgd_one.step()
    model.track_phi(1)
    assert float(model.phi_local_own_step1) == pytest.approx(0.02, rel=0.15)




def _fit(model, dm, steps):
    trainer = L.Trainer(max_steps=steps, max_epochs=-1, log_every_n_steps=50, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", limit_val_batches=0,
                        num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    return model.final_metrics()


def test_headline_mae_learns_every_area_and_dips_only_for_positive_delta():
    """T6 (spec 5.5; structured path, K = 2, gamma = 0.75, eta = 3, B = 32, 300 steps, seed 0), ~4 s a run.
    Measured: Delta = +0.25: own-area attention 0.958 (local, where visible) / 0.955 (global), local queries'
    attention to the global area 0.002, min phi_local_to_global -1.00 (still falling slowly at step 300: a
    plateau near -(Delta / 2L) ln P = -0.77, no recovery); Delta = -0.25: 0.957 / 0.955, min -0.26 (spec 5.6:
    -0.97 / -0.24). Local loss per masked patch on the last batch: 0.0035 / 0.0092 against the floor 0.0057."""
    out = {}
    for name, kappa_c in (("pos", 0.875), ("neg", 0.625)):
        dm = GlobalLocalPatchDataModule(P=256, K=2, kappa_c=kappa_c, kappa_s=0.5, batch_size=32, seed=0)
        out[name] = _fit(ViTMAE(gamma=0.75, lr=3.0), dm, 300)
    for name, m in out.items():
        assert m["own_area_local"] >= 0.85 and m["own_area_global"] >= 0.9, (name, m)
        assert m["loss_local"] <= 3 * m["loss_floor_local"] + 0.01, (name, m)
        assert m["attn_global"] < 0.05
    assert out["pos"]["phi_local_to_global_min"] <= 2 * out["neg"]["phi_local_to_global_min"] < 0
    assert out["pos"]["phi_local_to_global_argmin_step"] > 0


def test_cli_run_logs_metrics_figures_and_results(tmp_path):
    cli = make_cli(["--config", str(ROOT / "configs/vit/mae.yaml"), "--trainer.max_steps", "8",
                    "--trainer.log_every_n_steps", "2", "--trainer.logger.init_args.save_dir", str(tmp_path),
                    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                    "--heatmap.every_n_steps", "4"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    run = next(tmp_path.rglob("hparams.yaml")).parent
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()
    assert {"attention/areas", "attention/sample", "heatmap/correlation", "heatmap/upsilon"} <= set(tags["images"])
    scalars = set(tags["scalars"])
    for name in ("attn/attn_own_local", "attn/attn_glob_from_local", "attn/attn_to_masked", "attn/attn_other_local",
                 "corr/phi_local_to_global_min", "corr/upsilon_same_area_absmax", "loss/loss_local",
                 "hp/own_area_local", "hp/own_area_global", "hp/attn_global", "hp/final_loss", "hp/loss_floor",
                 "hp/phi_local_to_global_min"):
        assert name in scalars, name
    assert len(events.Scalars("attn/attn_own_local")) == 4                        # steps 2, 4, 6, 8 only


@pytest.mark.parametrize("kwargs,field", [
    (dict(gamma=1.0), "model.gamma"), (dict(gamma=0.0), "model.gamma"), (dict(lr=0.0), "model.lr"),
    (dict(path="sparse"), "model.path"), (dict(masked_keys="drop"), "model.masked_keys"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        ViTMAE(**kwargs)
    assert err.value.field == field


def test_refusals_that_need_the_data():
    with pytest.raises(ConfigError, match="model.gamma:"):       # round(0.001 * 47) = 0 masked patches
        ViTMAE(gamma=0.001).attach(_dm())
    with pytest.raises(ConfigError, match="model.path:"):        # the reduction is exact for noiseless data only
        ViTMAE().attach(_dm(noise_var=0.01))
    ViTMAE(path="dense", backend="torch").attach(_dm(noise_var=0.01))
    with pytest.raises(ConfigError, match="data.class_path:"):
        from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
        ViTMAE().attach(TwoFeaturePatchDataModule(dim=12, num_patches=8, num_feature_patches=2, batch_size=4))


def test_docstring_examples():
    for module in (vit_mae, vit_common):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_dense_path_through_the_triton_kernel_matches_the_structured_path():
    """The fused op's Triton path (interpreter, tiny sizes) inside the module: the same loss, area attention and
    gradient as the structured path (float32, IEEE dots)."""
    kw = dict(P=16, K=2, C_1=8, C_s=4, d=32, batch_size=2, dtype="float32")
    s = ViTMAE(gamma=0.5).attach(_dm(**kw))
    t = ViTMAE(gamma=0.5, path="dense", backend="triton", input_precision="ieee").attach(_dm(**kw))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        s.phi.copy_(torch.randn(s.phi.shape, generator=gen))
        s.upsilon.copy_(0.5 * torch.randn(s.upsilon.shape, generator=gen))
        t.Q.copy_(s.Q_matrix())
    dm = _dm(**kw)
    dm.use_mae_masks(0.5)
    batch = dm.batch(torch.arange(2), "train")
    loss_s, _, A_s = s.batch_loss(batch)
    loss_t, _, A_t = t.batch_loss(batch, with_areas=True)
    assert float(loss_t.detach()) == pytest.approx(float(loss_s.detach()), rel=1e-5)
    torch.testing.assert_close(A_t, A_s.detach(), rtol=1e-5, atol=1e-6)
    g_phi = torch.autograd.grad(loss_s, (s.phi,))[0]
    (g_q,) = torch.autograd.grad(loss_t, (t.Q,))
    torch.testing.assert_close(t.E @ g_q @ t.V.T, g_phi, rtol=1e-4, atol=1e-6)
