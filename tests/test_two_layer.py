"""TwoLayerNetwork and its baselines (Shi 2024, Sec. 2.3, App. A.7.1): mirrored init, the schedule's exact erasing
steps, the NTK linearisation against autograd's jvp, frozen layers of the baselines, the probes' exact readout, the
plain schedule on the Gaussian mixture, every config through the CLI, and bad values refused naming the
field."""
import json
from pathlib import Path

import pytest
import torch
from torch.func import jvp

from featlearn.datamodules.structured_parity import StructuredParityDataModule
from featlearn.errors import ConfigError
from featlearn.experiments.common import build, quiet_lightning
from featlearn.kernels.smoothed_clamp import smoothed_clamp_reference
from featlearn.lightning_modules.two_layer import ScheduledGD, TwoLayerNetwork, draw_neurons
from featlearn.lightning_modules.two_layer_baselines import TwoLayerNTK, TwoLayerRF, TwoLayerTwoStep
from featlearn.theory.two_layer import best_linear_classifier, centre_coverage, hinge, theory_schedule

pytestmark = pytest.mark.usefixtures("one_thread")


def _dm(**kw):
    base = dict(dim=41, num_patterns=17, k=3, num_train=256, batch_size=32, num_val=64, num_test=64, dtype="float64")
    base.update(kw)
    return StructuredParityDataModule(**base)


def test_mirrored_init_gives_zero_and_paper_scales():
    dm = _dm(dim=500, num_patterns=100, k=5, dtype="float32")
    model = TwoLayerNetwork(width=300, steps=600).attach(dm)
    assert model.init_values == pytest.approx({"sigma_w": 0.2, "sigma_b": 0.04, "sigma_a": 4.0})
    m = model.width
    assert torch.equal(model.w[:m], model.w[m:]) and torch.equal(model.a[:m], -model.a[m:])
    w, a = model.w.detach(), model.a.detach()
    assert abs(float(w[:m].std()) - 0.2) < 0.01 and abs(float(a[:m].std()) - 4.0) < 0.5
    x = dm.sample(torch.arange(100), "train")["x"]
    assert float(model(x).detach().abs().max()) == 0.0


def test_schedule_values_follow_theorem_a20_and_variants():
    s = theory_schedule(5, 300, 0.25, 5.0, 600)
    assert s["lr1"] == pytest.approx(0.0625 * 25 / (5 * 300 ** 3)) and s["smoothing1"] == pytest.approx(0.04)
    assert s["lr3"] == pytest.approx(25 / (600 * 300 ** (1 / 3))) and s["reg3"] == pytest.approx(125 / (5 * 300 ** (1 / 3)))
    a17 = theory_schedule(5, 300, 0.25, 5.0, 600, "A17")
    assert a17["lr1"] == pytest.approx(0.0625 * 5 / (5 * 300 ** 3)) and a17["smoothing1"] == pytest.approx(5 ** -1.5)
    a28 = theory_schedule(5, 300, 0.25, 5.0, 600, "A28", p_min=0.2)
    assert a28["lr1"] == pytest.approx(0.2 * a17["lr1"])
    model = TwoLayerNetwork(width=4, steps=10, lr3_mult=3.0).attach(_dm())
    one, two, three = (model.schedule_at(t) for t in (1, 2, 3))
    assert one["groups"]["w"][1] == 0.0 and one["groups"]["a"][1] == 1.0 and two["groups"]["a"] == (1.0, 0.0)
    assert three["smoothing"] == 0.0 and three["groups"]["b"][1] == 1.0
    th = model.theory_values()
    assert three["groups"]["a"] == pytest.approx((th["lr3"], 1 - 2 * th["lr3"] * th["reg3"]))


def test_second_layer_takes_its_own_stage3_step():
    """Stage 3 steps a with lr3a_mult x eta and w, b with lr3_mult x eta (Lemma A.18's problem is in a alone and
    needs |a_i| far beyond eta (T - 2)); lr3a_mult None keeps one step for both; steps 1-2 are untouched."""
    own = TwoLayerNetwork(width=4, steps=10, lr3_mult=0.5, lr3a_mult=200.0, reg3_mult=0.01).attach(_dm())
    shared = TwoLayerNetwork(width=4, steps=10, lr3_mult=0.5, reg3_mult=0.01).attach(_dm())
    th, groups = own.theory_values(), own.schedule_at(3)["groups"]
    assert groups["a"] == pytest.approx((th["lr3a"], 1 - 2 * th["lr3a"] * th["reg3"]))
    assert groups["a"][0] == pytest.approx(400 * groups["w"][0]) and groups["b"][0] == groups["w"][0]
    assert groups["w"] == shared.schedule_at(3)["groups"]["w"] == shared.schedule_at(3)["groups"]["a"]
    assert all(own.schedule_at(t)["groups"] == shared.schedule_at(t)["groups"] for t in (1, 2))


def test_step_one_erases_w_exactly():
    """lambda_w = 1/(2 eta): w^(1) = -eta grad_w L bit for bit, whatever w^(0) was (no cancellation)."""
    dm = _dm()
    model = TwoLayerNetwork(width=6, steps=10).attach(dm)
    batch = dm.sample(torch.arange(256), "train")
    loss = model.batch_loss(batch, 1)
    loss.backward()
    grad, lr = model.w.grad.clone(), model.schedule_at(1)["groups"]["w"][0]
    opt = ScheduledGD([{"params": [model.w], "name": "w"}])
    opt.param_groups[0]["lr"], opt.param_groups[0]["decay"] = lr, 0.0
    opt.step()
    assert torch.equal(model.w.detach(), grad * -lr)
    # and the step-1 gradient points along +-sum_A M_j (the structure's signal, gamma > 0)
    cos = (model.w.detach() @ dm.target_direction) / (model.w.detach().norm(dim=1) * dm.target_direction.norm())
    assert cos.abs().min() > 0.5


@pytest.mark.parametrize("s", [0.0, 0.2])
def test_ntk_linearisation_equals_jvp(s):
    dm = _dm()
    net = TwoLayerNetwork(width=5, steps=10).attach(dm)
    ntk = TwoLayerNTK(width=5, steps=10).attach(dm)
    assert torch.equal(ntk.w0, net.w.detach()) and torch.equal(ntk.a0, net.a.detach())
    g = torch.Generator().manual_seed(3)
    delta = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1 for n, p in (("w", net.w), ("b", net.b),
                                                                                    ("a", net.a))}
    with torch.no_grad():
        for n, t in delta.items():
            getattr(ntk, f"d{n}").copy_(t)  # the NTK's parameters are the displacements dw, db, da
    x = dm.sample(torch.arange(37), "train")["x"]
    params = {n: getattr(net, n).detach() for n in ("w", "b", "a")}

    def g_of(p):  # the network as a function of its parameters, through the op's float64 reference
        return smoothed_clamp_reference(x, p["w"], p["b"], s) @ p["a"]

    assert torch.allclose(g_of(params), net(x, s).detach(), atol=1e-12)
    _, tangent = jvp(g_of, (params,), (delta,))
    assert torch.allclose(ntk(x, s), tangent, atol=1e-12, rtol=1e-10)
    assert float(TwoLayerNTK(width=5, steps=10).attach(dm)(x).detach().abs().max()) == 0.0


def _fit(config: str, tmp_path: Path, *extra: str):
    quiet_lightning()
    over = ["--data.init_args.dim", "41", "--data.init_args.num_patterns", "17", "--data.init_args.k", "3",
            "--data.init_args.num_train", "256", "--data.init_args.batch_size", "32", "--data.init_args.num_val",
            "64", "--data.init_args.num_test", "64", "--model.init_args.width", "6", "--trainer.max_steps", "5",
            "--trainer.accelerator", "cpu", "--trainer.check_val_every_n_epoch", "1", "--trainer.val_check_interval", "5", "--heatmap.every_n_steps", "2",
            "--model.init_args.reg3_mult", "0",  # at T = 5 the theory's lambda would make the decay negative
            *extra]
    cli = build(f"two_layer/{config}", tmp_path, config.replace(".yaml", ""), *over)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli.model, cli.datamodule


@pytest.mark.parametrize("config", ["network.yaml", "ntk.yaml", "rf.yaml", "one_step.yaml", "two_step.yaml",
                                    "no_structure.yaml"])
def test_every_config_fits(config, tmp_path):
    model, dm = _fit(config, tmp_path)
    assert model.global_step == 5
    metrics = model.final_metrics()
    assert 0 <= metrics["val_acc"] <= 1
    if model.feature_learning:
        assert set(metrics) >= {"cos_init", "cos_final"}
    assert list((tmp_path / config.replace(".yaml", "")).glob("events.out.tfevents.*"))


def test_frozen_layers_of_the_baselines(tmp_path):
    init = TwoLayerNetwork(width=6, steps=5).attach(_dm(dtype="float32"))  # the configs' data, float32
    rf, _ = _fit("rf.yaml", tmp_path / "rf")
    assert torch.equal(rf.w.detach(), init.w.detach()) and torch.equal(rf.b.detach(), init.b.detach())
    assert not torch.equal(rf.a.detach(), init.a.detach())
    one, _ = _fit("one_step.yaml", tmp_path / "one")
    two, _ = _fit("two_step.yaml", tmp_path / "two")
    assert one.final_metrics()["cos_step1"] == pytest.approx(one.final_metrics()["cos_final"])
    assert two.final_metrics()["cos_step2"] == pytest.approx(two.final_metrics()["cos_final"])
    net, _ = _fit("network.yaml", tmp_path / "net")
    assert net.neuron_figure() is not None and rf.neuron_figure() is None
    # the picture the experiment keeps in its results (JSON) draws the same way
    assert isinstance(rf, TwoLayerRF) and draw_neurons(json.loads(json.dumps(net.neuron_picture()))) is not None


def test_hinge():
    assert float(hinge(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 3.0]))) == pytest.approx(1.5)


def _standardised_svm(model, x, y):
    """The probes' readout written out: the float64 hidden layer, standardised per neuron over ``x``, an
    intercept column, the L2-SVM; returns its margins' signs on ``x``."""
    h = torch.clamp(x.double() @ model.w.detach().double().T + model.b.detach().double(), 0, 1)
    std = h.std(0)
    h = (h - h.mean(0)) / torch.where(std > 0, std, torch.ones_like(std))
    h = torch.cat([h, torch.ones_like(h[:, :1])], 1)
    return torch.sign(h @ best_linear_classifier(h, y.double(), model.readout_ridge))


def test_probe_readout_is_the_best_classifier_on_the_training_split(tmp_path):
    """Two Step (readout: best): the readout is the L2-SVM of the frozen step-2 hidden layer, standardised,
    on the whole training split, solved at step 3 (a full batch), and no later step moves it."""
    two, dm = _fit("two_step.yaml", tmp_path / "two", "--model.init_args.backend", "torch")
    train = dm.full("train")
    expected = _standardised_svm(two, train["x"], train["y"])
    with torch.no_grad():
        assert torch.equal(torch.sign(two(train["x"])).double(), expected)
        expected = two.a.detach().clone()
    assert two.readout_step() == 3 and not two.tunes_lr3 and dm.full_batch_steps == 3
    one, _ = _fit("one_step.yaml", tmp_path / "one")
    assert one.readout_step() == 2 and one.global_step == 5
    # the old reading: the second layer trained by the stage-3 steps, so the step size matters
    sched, _ = _fit("two_step.yaml", tmp_path / "sched", "--model.init_args.readout", "schedule")
    assert sched.readout_step() is None and sched.tunes_lr3 and not torch.allclose(sched.a.detach(), expected)


def test_one_step_readout_is_scale_free(tmp_path):
    """The step-1 features vary by ~1e-8 around their mean: a readout on the raw float32 layer is the ridge's
    constant predictor (One Step was 50% on every seed). Standardised, the readout sees the features: it
    separates the training split better than the majority class, as the float64 standardised L2-SVM does."""
    one, dm = _fit("one_step.yaml", tmp_path / "one", "--data.init_args.num_train", "2048",
                   "--data.init_args.batch_size", "256", "--model.init_args.width", "24", "--model.init_args.backend",
                   "torch", "--trainer.max_steps", "3")
    train = dm.full("train")
    with torch.no_grad():
        pred = torch.sign(one(train["x"]))
        majority = max(float((train["y"] > 0).double().mean()), float((train["y"] < 0).double().mean()))
        assert float((pred == train["y"]).double().mean()) > majority + 0.05
        assert torch.equal(pred.double(), _standardised_svm(one, train["x"], train["y"]))


def test_best_linear_classifier_is_the_optimum():
    """Zero gradient of the squared-hinge objective at the answer; on separable data every margin is ~1 or
    more with a tiny ridge; the answer beats random perturbations of itself."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 7, generator=g, dtype=torch.float64)
    y = torch.sign(h @ torch.randn(7, generator=g, dtype=torch.float64))
    for ridge in (1e-8, 1e-2):
        a = best_linear_classifier(h, y, ridge)
        r = (1 - y * (h @ a)).clamp_min(0)
        grad = -2 / len(h) * (h.T @ (y * r)) + 2 * ridge * a
        assert float(grad.abs().max()) < 1e-9

        def obj(v):
            return float(((1 - y * (h @ v)).clamp_min(0) ** 2).mean() + ridge * (v @ v))
        assert all(obj(a) <= obj(a + 1e-3 * torch.randn(7, generator=g, dtype=torch.float64)) for _ in range(20))
    assert float((y * (h @ best_linear_classifier(h, y, 1e-10))).min()) > 0.99


def test_plain_schedule_on_the_gaussian_mixture(tmp_path):
    """mog.yaml: gamma = 0, every step a stage-3 minibatch step; the centre coverage is reported and the
    MDS picture has init, 5/8 of the way and the end."""
    quiet_lightning()
    cli = build("two_layer/mog.yaml", tmp_path, "mog", "--data.init_args.dim", "12", "--data.init_args.num_train",
                "256", "--data.init_args.batch_size", "32", "--data.init_args.num_val", "64",
                "--data.init_args.num_test", "64", "--model.init_args.width", "6", "--trainer.max_steps", "8",
                "--trainer.accelerator", "cpu", "--trainer.check_val_every_n_epoch", "1")
    cli.trainer.fit(cli.model, cli.datamodule)
    model, dm = cli.model, cli.datamodule
    assert model.schedule_at(1)["stage"] == 3 and model.schedule_at(1)["smoothing"] == 0.0
    assert dm.full_batch_steps == 0 and model.snapshot_steps() == (5, 8)
    metrics = model.final_metrics()
    cover = centre_coverage(model.w.detach().double(), dm.centres)
    assert metrics["cos_centres_min"] == pytest.approx(float(cover.min()))
    assert metrics["cos_centres_mean"] == pytest.approx(float(cover.mean()))
    assert "cos_step1" not in metrics and model.neuron_figure() is not None


def test_gamma_zero_needs_the_plain_schedule_and_sigma_a():
    mog = StructuredParityDataModule(dim=12, num_patterns=4, k=4, labeling="hypercube_mog", num_train=32,
                                     batch_size=8)
    with pytest.raises(ConfigError, match="^data.labeling"):
        TwoLayerNetwork(width=3, steps=5).attach(mog)
    with pytest.raises(ConfigError, match="^model.sigma_a"):
        TwoLayerNetwork(width=3, steps=5, schedule="plain").attach(mog)
    TwoLayerNetwork(width=3, steps=5, schedule="plain", sigma_a=0.1).attach(mog)


@pytest.mark.parametrize("kw, field", [
    (dict(width=0), "model.width"), (dict(schedule="A99"), "model.schedule"),
    (dict(lr3_mult=-1.0), "model.lr3_mult"), (dict(reg3_mult=-1.0), "model.reg3_mult"),
    (dict(lr3a_mult=0.0), "model.lr3a_mult"), (dict(lr3a_mult=float("inf")), "model.lr3a_mult"),
    (dict(sigma_w=float("nan")), "model.sigma_w"), (dict(steps=0), "model.steps"),
    (dict(schedule="plain", cls=TwoLayerTwoStep), "model.schedule"),
    (dict(readout="svm", cls=TwoLayerTwoStep), "model.readout"),
    (dict(readout_ridge=0.0, cls=TwoLayerTwoStep), "model.readout_ridge"),
])
def test_bad_values_are_refused_naming_the_field(kw, field):
    cls = kw.pop("cls", TwoLayerNetwork)
    with pytest.raises(ConfigError) as info:
        cls(**kw)
    assert info.value.field == field


def test_schedule_without_steps_is_refused():
    model = TwoLayerNetwork(width=3).attach(_dm())
    with pytest.raises(ConfigError, match="^model.steps"):
        model.schedule_at(1)


def test_a_negative_stage3_decay_is_refused_before_the_first_step():
    """A second-layer step x10^4 with the theory's lambda makes 1 - 2 eta lambda < 0 (a flips sign each step):
    refused by configure_optimizers, naming reg3_mult and the largest value that keeps the decay >= 0."""
    model = TwoLayerNetwork(width=4, steps=10, lr3a_mult=1e4).attach(_dm())
    with pytest.raises(ConfigError, match="^model.reg3_mult: must be at most") as info:
        model.configure_optimizers()
    ceiling = float(str(info.value).split("at most ")[1].split()[0])
    th = TwoLayerNetwork(width=4, steps=10, lr3a_mult=1e4, reg3_mult=ceiling * 0.99).attach(_dm()).theory_values()
    assert 0 <= 1 - 2 * th["lr3a"] * th["reg3"] < 0.05
    TwoLayerNetwork(width=4, steps=10, lr3a_mult=1e4, reg3_mult=0.0).attach(_dm()).configure_optimizers()
