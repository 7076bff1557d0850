"""Non-contrastive module of Wen & Li 2022: frozen diagonal of E, stop-grad, population oracle (our reference run),
a short fixed-seed SGD run whose E21 rises, the Lightning/CLI wiring of every config."""
import glob
import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
from featlearn.errors import ConfigError
from featlearn.kernels.bn_cosine_loss import bn_cosine_loss_reference
from featlearn.lightning_modules.noncontrastive import NonContrastiveModule
from featlearn.theory.noncontrastive import (PhaseTracker, feature_outcome, hypergeometric_moments, population_loss,
                                             simulate_population)


pytestmark = pytest.mark.usefixtures("one_thread")


def _small_dm(**kw):
    base = dict(dim=12, num_patches=8, num_feature_patches=2, batch_size=64, seed=5)
    base.update(kw)
    return TwoFeaturePatchDataModule(**base)


class _Record(L.Callback):
    def __init__(self):
        self.heads = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.heads.append(pl_module.head.detach().clone())


def _fit(model, dm, steps, every=50):
    rec = _Record()
    trainer = L.Trainer(max_steps=steps, max_epochs=-1, log_every_n_steps=every, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", limit_val_batches=0, num_sanity_val_steps=0, callbacks=[rec])
    trainer.fit(model, datamodule=dm)
    return rec.heads


def _pin_lagging(model, dm, lead_cos=0.8):
    """Neuron 0 already aligned with v1, neuron 1 mostly noise with small (B21, B22) > 0: the phase-II state."""
    v = dm.features
    with torch.no_grad():
        u = model.w[1] - (model.w[1] @ v.T) @ v
        model.w[1] = 0.15 * v[0] + 0.05 * v[1] + u / u.norm()
        model.w[0] = lead_cos * v[0] + 0.5 * model.w[0]


def test_diag_of_head_never_changes_and_variants():
    dm = _small_dm()
    model = NonContrastiveModule(width=3, lr=0.05, head_lr=0.5)
    heads = _fit(model, dm, 6, every=2)
    assert len(heads) == 6
    for e in heads:
        assert torch.equal(torch.diagonal(e), torch.ones(3, dtype=e.dtype))    # exactly 1, every step
    assert (heads[-1] - torch.eye(3, dtype=heads[-1].dtype)).abs().max() > 0  # off-diagonal trained
    # no head: E is a constant identity buffer, not a parameter
    model = NonContrastiveModule(width=2, head="none")
    _fit(model, _small_dm(), 3, every=1)
    assert torch.equal(model.head, torch.eye(2, dtype=model.head.dtype))
    assert "head" not in dict(model.named_parameters())
    # full head: the diagonal moves too
    model = NonContrastiveModule(width=2, head="full", head_lr=0.5)
    heads = _fit(model, _small_dm(), 3, every=1)
    assert (torch.diagonal(heads[-1]) - 1).abs().max() > 0
    assert len(model.history) >= 1 and "theory/e_offdiag_fro" in model.history[0]


def test_stop_grad_matches_float64_reference_and_ema():
    dm = _small_dm(dim=9)
    batch = dm.sample(torch.arange(40), "train")
    model = NonContrastiveModule(width=2).attach(dm)
    with torch.no_grad():
        model.head[1, 0] = 0.3
    loss = model.batch_loss(batch)
    gw, ge = torch.autograd.grad(loss, (model.w, model.head))
    x, m1 = batch["x"], batch["view1"].double()
    w = model.w.detach().clone().requires_grad_()
    e = model.head.detach().clone().requires_grad_()
    f = (torch.einsum("bpd,rd->bpr", x, w) ** 3 * m1[..., None]).sum(1)
    g = (torch.einsum("bpd,rd->bpr", x, w.detach()) ** 3 * (1 - m1)[..., None]).sum(1)
    ref = bn_cosine_loss_reference(f @ e.T, g)
    rw, re = torch.autograd.grad(ref, (w, e))
    assert float(loss) == pytest.approx(float(ref), rel=1e-12)
    assert torch.allclose(gw, rw, rtol=1e-9, atol=1e-14) and torch.allclose(ge * (1 - torch.eye(2)), re * (1 - torch.eye(2)))
    assert float(ge.diagonal().abs().sum()) == 0.0
    # without stop-grad the gradient changes (the target path is real)
    nsg = NonContrastiveModule(width=2, stop_grad=False).attach(dm)
    with torch.no_grad():
        nsg.w.copy_(model.w)
        nsg.head.copy_(model.head)
    (gn,) = torch.autograd.grad(nsg.batch_loss(batch), (nsg.w,))
    assert (gn - gw).abs().max() > 1e-3 * gw.abs().max()
    # EMA target: w_t <- 0.9 w_t + 0.1 w after a step
    ema = NonContrastiveModule(width=2, target="ema", ema_decay=0.9).attach(dm)
    old_t = ema.w_target.clone()
    with torch.no_grad():
        ema.w.add_(1.0)
    with torch.no_grad():
        ema.finish_step(1)
    assert torch.allclose(ema.w_target, 0.9 * old_t + 0.1 * ema.w.detach())


def test_population_oracle_reproduces_reference_run():
    """The pinned demo-A init of our numpy prototype's reference run: at t = 2500 cos(w1,v1) = 0.883, E21 = 0.195,
    E12 = 0.011, loss 1.1758 (to +-0.02 and +-0.002), and E21 rises monotonically (substitution)."""
    d = 100
    b = torch.tensor([[0.0822, -0.1303], [0.0346, 0.0330]], dtype=torch.float64)
    a = torch.tensor([[0.7993, -0.1030], [-0.1030, 0.8948]], dtype=torch.float64)
    w = torch.zeros(1, 2, d, dtype=torch.float64)
    w[0, :, :2] = b
    w[0, :, 2:4] = torch.linalg.cholesky(a)                  # noise Gram U U^T = a
    out = simulate_population(w, torch.eye(2, d, dtype=torch.float64), [4.0, 2.7], [0.5, 0.5], 32, 8, 1.0,
                              steps=2500, lr=0.05, head_lr=0.05, record_every=250)
    cos, e, loss = out["cos"][-1, 0], out["E"][:, 0], out["loss"][:, 0]
    assert float(cos[0, 0]) == pytest.approx(0.883, abs=0.02)
    assert float(cos[1, 0]) == pytest.approx(0.041, abs=0.02) and float(cos[1, 1]) == pytest.approx(0.038, abs=0.02)
    assert float(e[-1, 1, 0]) == pytest.approx(0.195, abs=0.02)
    assert float(e[-1, 0, 1]) == pytest.approx(0.011, abs=0.005)
    assert float(loss[-1]) == pytest.approx(1.1758, abs=0.002)
    assert float(loss[0]) == pytest.approx(2.0, abs=1e-3)
    e21 = e[:, 1, 0]
    assert (e21[1:] > e21[:-1]).all()                         # the rise of E21
    assert (torch.diagonal(e, dim1=-2, dim2=-1) == 1).all()
    # sign(E21) = sign(B21 B11) (the driving term of E21 in Wen & Li 2022, Fact D.2)
    assert math.copysign(1, float(e21[-1])) == math.copysign(1, float(out["B"][-1, 0, 1, 0] * out["B"][-1, 0, 0, 0]))
    # same init, no head: E stays I, neuron 1 races on its own
    nh = simulate_population(w, torch.eye(2, d, dtype=torch.float64), [4.0, 2.7], [0.5, 0.5], 32, 8, 1.0,
                             steps=10, head="none", record_every=10)
    assert torch.equal(nh["E"][-1, 0], torch.eye(2, dtype=torch.float64))


def test_population_loss_matches_sampled_loss():
    """Closed form (Isserlis noise moments, hypergeometric constants) vs the sampled loss at N = 8192."""
    dm = TwoFeaturePatchDataModule(dim=10, num_patches=16, num_feature_patches=4, alphas=[3.0, 2.0],
                                   batch_size=8192, seed=2)
    model = NonContrastiveModule(width=2, init_seed=2).attach(dm)
    with torch.no_grad():
        model.w.mul_(1.5)
        model.w[0, 0] += 0.6
        model.head[1, 0] = 0.4
    batch = dm.sample(torch.arange(8192), "train")
    sampled = float(model.batch_loss(batch))
    pop = float(model.population_loss())
    assert 0.3 < pop < 1.9
    assert sampled == pytest.approx(pop, abs=0.03)
    # at w_j = v_j the loss is OPT for any data (noise invisible), exactly OPT in population
    with torch.no_grad():
        model.w.copy_(torch.eye(2, 10, dtype=torch.float64))
        model.head.copy_(torch.eye(2, dtype=torch.float64))
    opt = hypergeometric_moments(16, 4)["OPT"]
    assert float(model.population_loss()) == pytest.approx(opt, abs=1e-12)
    assert float(model.batch_loss(batch)) == pytest.approx(opt, abs=0.03)


def test_short_sgd_run_e21_rises():
    """Fixed seed, explicit samples, Lightning loop: from the phase-II state (neuron 0 on v1, neuron 1 noise
    with B21 > 0) E21 rises with the sign of B21 B11 while the diagonal stays 1."""
    dm = TwoFeaturePatchDataModule(dim=24, num_patches=16, num_feature_patches=4, batch_size=1024, seed=3)
    model = NonContrastiveModule(width=2, lr=0.05, head_lr=0.2, init_seed=3).attach(dm)
    _pin_lagging(model, dm)
    heads = _fit(model, dm, 30, every=1)  # theory metrics (and the phase tracker) at every step
    e21 = torch.stack([h[1, 0] for h in heads])
    b = model.w.detach() @ dm.features.T
    assert float(b[1, 0] * b[0, 0]) > 0
    assert float(e21[-10:].mean()) > 0.03                     # grew from 0 (per-step noise ~0.02)
    assert float(e21.max()) > 0.05
    assert all(torch.equal(torch.diagonal(h), torch.ones(2, dtype=h.dtype)) for h in heads)
    assert model.tracker is not None and model.tracker.bounds["T1"] == 0   # lead neuron learned at t = 0
    assert model.history[-1]["theory/subst_ratio"] > 0


TAG = re.compile(r"(train|val|test|theory|hp)/[a-z0-9_]+(/[a-z0-9_=.]+)*")


def test_logged_tags_follow_the_naming_scheme():
    """Every scalar the module logs (training, validation, theory, HPARAMS results) is named
    ``<section>/<name>[/<qualifier>...]`` in lower case, e.g. ``theory/e/1_0`` for E21."""
    dm = _small_dm()
    model = NonContrastiveModule(width=2, lr=0.05, head_lr=0.5).attach(dm)
    _pin_lagging(model, dm)                                    # the lead neuron has learned: theory/t1 is logged
    trainer = L.Trainer(max_steps=4, max_epochs=-1, log_every_n_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    tags = set(trainer.callback_metrics) | {f"hp/{k}" for k in model.final_metrics()}
    assert {"train/loss", "train/gap_to_opt", "train/rho/0", "val/loss", "theory/cos/0_1", "theory/e/1_0",
            "theory/phase", "theory/t1", "hp/peak_abs_e21"} <= tags, sorted(tags)
    assert [t for t in sorted(tags) if not TAG.fullmatch(t)] == []


def test_outcomes_and_phase_tracker():
    assert feature_outcome(torch.tensor([[0.9, 0.0], [0.8, 0.1]]))[0] == "COL"
    assert feature_outcome(torch.tensor([[0.9, 0.0], [0.1, 0.2]])) == ("PAR", [0, -1])
    assert feature_outcome(torch.tensor([[0.1, -0.9], [0.95, 0.1]]))[0] == "DIV"
    tr = PhaseTracker(lead=0, dim=100)
    eye = torch.eye(2)
    cos = torch.tensor([[0.9, 0.0], [0.05, 0.03]])
    b = cos.clone()
    r = torch.tensor([0.1, 0.8])
    assert tr.update(0, torch.tensor([[0.1, 0.0], [0.05, 0.03]]), b, r, eye, 0.0) == 1
    assert tr.update(10, cos, b, r, eye, 0.5) == 2
    e = torch.tensor([[1.0, 0.0], [0.4, 1.0]])
    assert tr.update(15, cos, b, r, e, 2.0) == 2                # ratio 2 < log d: not yet substituted
    assert tr.update(20, cos, b, r, e, 5.0) == 3
    b2 = torch.tensor([[0.9, 0.0], [0.05, 0.3]])
    assert tr.update(30, cos, b2, r, e, 5.0) == 4
    tr.update(40, cos, b2, r, eye, 0.0)
    assert tr.bounds == {"T1": 10, "T2": 20, "T2_paper": None, "T3": 30, "T4": 40}


@pytest.mark.parametrize("kw, field", [
    (dict(width=0), "model.width"), (dict(head="mlp"), "model.head"), (dict(target="momentum"), "model.target"),
    (dict(lr=0.0), "model.lr"), (dict(head_lr=-1.0), "model.head_lr"), (dict(out_norm="none"), "model.out_norm"),
    (dict(eps=-0.1), "model.eps"), (dict(gradient="exact"), "model.gradient"),
    (dict(gradient="population", out_norm="l2"), "model.gradient"), (dict(ema_decay=1.0), "model.ema_decay"),
    (dict(stop_grad=False, target="ema"), "model.stop_grad"), (dict(backend="cuda"), "model.backend"),
])
def test_config_errors(kw, field):
    with pytest.raises(ConfigError, match=field):
        NonContrastiveModule(**kw)


# runnable configs (a model or a base config), not the data presets or the experiment settings
CONFIGS = sorted(c for c in glob.glob(str(Path(__file__).resolve().parents[1] / "configs/noncontrastive/*.yaml"))
                 if {"model", "config"} & set(yaml.safe_load(Path(c).read_text())))


def test_all_variant_configs_exist():
    names = {Path(c).stem for c in CONFIGS}
    assert {"with_head", "no_head", "full_head", "ema_target"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: Path(c).stem)
def test_configs_run_through_cli(config, tmp_path, monkeypatch):
    from featlearn.cli import main
    monkeypatch.setattr("sys.argv", ["lightning"])
    main(["fit", "--config", config, "--trainer.max_steps", "2", "--trainer.logger", "false",
          "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
          "--trainer.accelerator", "cpu", "--data.init_args.dim", "10", "--data.init_args.num_patches", "8",
          "--data.init_args.num_feature_patches", "2", "--data.init_args.batch_size", "16",
          "--trainer.log_every_n_steps", "1", "--heatmap.every_n_steps", "1"])


@pytest.mark.parametrize("head", ["offdiag", "none"])
def test_lightning_population_mode_equals_simulator(head):
    """The Lightning loop (SGD param groups, frozen diagonal, simultaneous W/E update) reproduces the
    batched population simulator that the headline table uses, at every logged step of 400, to float64
    rounding: the table's numbers are the module's numbers. From the pinned demo-A init at the
    experiment's eta = 0.2 (head eta_E = 0.1, a separate param group), 400 steps take the lead neuron from
    cos 0.09 to 0.86 and, with the head, E21 from 0 to 0.12: the stretch where any mismatch in the update
    would compound."""
    steps, every, d = 400, 20, 100
    dm = TwoFeaturePatchDataModule(dim=d, num_patches=32, num_feature_patches=8, alphas=[4.0, 2.7], batch_size=2,
                                   seed=4)
    model = NonContrastiveModule(width=2, head=head, gradient="population", lr=0.2, head_lr=0.1).attach(dm)
    b = torch.tensor([[0.0822, -0.1303], [0.0346, 0.0330]], dtype=torch.float64)
    a = torch.tensor([[0.7993, -0.1030], [-0.1030, 0.8948]], dtype=torch.float64)
    with torch.no_grad():
        model.w.zero_()
        model.w[:, :2] = b
        model.w[:, 2:4] = torch.linalg.cholesky(a)                             # noise Gram U U^T = a
    w0 = model.w.detach().clone()
    _fit(model, dm, steps, every=1)  # the module's history at every step, compared on the simulator's records
    out = simulate_population(w0[None], dm.features, dm.alphas, dm.probs, 32, 8, 1.0, steps=steps, lr=0.2,
                              head_lr=0.1, head=head, record_every=every)
    logged = [h for h in model.history if h["step"] % every == 0]
    assert [h["step"] for h in logged] == out["steps"].tolist()[:-1]          # 0, 20, ..., 380
    b_mod = torch.tensor([[[h[f"theory/b/{j}_{l}"] for l in range(2)] for j in range(2)] for h in logged],
                         dtype=torch.float64)
    assert float((b_mod - out["B"][:-1, 0]).abs().max()) <= 1e-12              # whole trajectory, |B| <= 1
    assert torch.allclose(model.w.detach(), out["w"][0], rtol=1e-12, atol=1e-14)     # final point
    assert torch.allclose(model.head.detach(), out["head"][0], rtol=1e-12, atol=1e-14)
    # the module's running peak of |E| (its HPARAMS result) is the simulator's, over every step
    assert torch.allclose(model.head_peak, out["E_peak"][0], rtol=1e-12, atol=1e-14)
    assert model.final_metrics()["peak_abs_e21"] == pytest.approx(float(out["E_peak"][0, 1, 0]), rel=1e-12)
    e21 = out["E"][:, 0, 1, 0]
    if head == "offdiag":
        e_mod = torch.tensor([h["theory/e/1_0"] for h in logged], dtype=torch.float64)
        assert float((e_mod - e21[:-1]).abs().max()) <= 1e-12
        assert float(e21[-1]) > 0.1 and bool((e21[1:] > e21[:-1]).all())      # E21 rises (substitution)
    else:
        assert float(e21.abs().max()) == 0.0 and torch.equal(model.head, torch.eye(2, dtype=torch.float64))
    assert float(out["cos"][-1, 0, 0, 0]) > 0.8                              # lead neuron learned v1


def test_rotation_invariance_of_population_loss():
    """A random orthonormal feature basis gives the same loss/dynamics as e1, e2."""
    d = 9
    g = torch.Generator().manual_seed(11)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    w = torch.randn(3, d, generator=g, dtype=torch.float64) / 3
    e = torch.eye(3, dtype=torch.float64) + 0.2 * torch.randn(3, 3, generator=g, dtype=torch.float64)
    feats = torch.eye(2, d, dtype=torch.float64)
    args = ([4.0, 2.7], [0.5, 0.5], 32, 8, 1.0)
    base = population_loss(w, e, feats, *args)
    rot = population_loss(w @ q.T, e, feats @ q.T, *args)
    assert float(base) == pytest.approx(float(rot), rel=1e-12)
    dm = TwoFeaturePatchDataModule(dim=d, random_basis=True, seed=8, batch_size=2)
    assert not torch.allclose(dm.features.abs(), feats)
    # sampled data with the random basis: the module's correlations follow the basis
    model = NonContrastiveModule(width=2).attach(dm)
    with torch.no_grad():
        model.w.copy_(dm.features)
    assert torch.allclose(model.correlations(), torch.eye(2, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("gradient", ["population", "sample"])
def test_population_mode_draws_no_training_samples(gradient, monkeypatch):
    """The population loss never reads the batch, so the DataModule serves indices only: drawing the unused
    samples (~4 ms a step at batch size 2) cost half of every population step through the Trainer."""
    dm = TwoFeaturePatchDataModule(dim=12, num_patches=8, num_feature_patches=2, batch_size=16, seed=1)
    model = NonContrastiveModule(width=2, gradient=gradient).attach(dm)
    drawn = []
    sample = dm.sample
    monkeypatch.setattr(dm, "sample", lambda index, split: drawn.append(split) or sample(index, split))
    _fit(model, dm, 3, every=1)
    assert drawn.count("train") == (0 if gradient == "population" else 3)
    assert len(model.history) == 3 and all(math.isfinite(h["train/loss"]) for h in model.history)


def test_simulator_refuses_features_that_are_not_orthonormal():
    """The simulator steps on B = W V^T and U U^T, which describe W only for orthonormal features."""
    w0 = torch.randn(1, 2, 6, dtype=torch.float64)
    with pytest.raises(ConfigError, match="features"):
        simulate_population(w0, (1 + 5e-6) * torch.eye(2, 6, dtype=torch.float64), [4.0, 2.7], [0.5, 0.5], 32, 8,
                            1.0, steps=2)
