"""Dissertation Ch. 4 (k-input modular addition): the sampler against what it states (the split, the labels,
every training tuple once per epoch across ranks), the closed-form margin, and the spectral metrics on planted
cosine neurons."""
import math

import pytest
import torch

from featlearn.datamodules.modular_addition import ModularAdditionDataModule, decode, fourier_modes, is_prime
from featlearn.datamodules.rng import index_permutation
from featlearn.errors import ConfigError
from featlearn.theory.modular_addition import (frequency_coverage, gamma_star, margins, neuron_spectra,
                                               norm_2_kplus1, spectrum)


# ---- the enumeration and its split ----------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 12167, 2 ** 16 + 1])
def test_index_permutation_is_a_bijection_and_inverts(n):
    i = torch.arange(n)
    perm = index_permutation(11, 3, i, n)
    assert torch.equal(torch.sort(perm).values, i)
    assert torch.equal(index_permutation(11, 3, perm, n, inverse=True), i)


def test_index_permutation_is_uniform_over_seeds():
    # where 0 and 1 go, over 6000 seeds: 30 ordered pairs, each 1/30 (chi-square, 29 dof, p = 0.001 at 58.3)
    n, seeds = 6, 6000
    pairs = torch.stack([index_permutation(s, 1, torch.tensor([0, 1]), n) for s in range(seeds)])
    counts = torch.bincount(pairs[:, 0] * n + pairs[:, 1], minlength=n * n).double()
    counts = counts[counts > 0]
    assert len(counts) == n * (n - 1)
    expected = seeds / (n * (n - 1))
    assert float(((counts - expected) ** 2 / expected).sum()) < 58.3


@pytest.mark.parametrize("k, p, fraction", [(2, 11, 0.5), (3, 7, 0.3), (4, 5, 0.9)])
def test_the_split_is_exact_disjoint_and_covers_every_tuple(k, p, fraction):
    dm = ModularAdditionDataModule(k=k, p=p, train_fraction=fraction, batch_size=None, seed=4)
    total = p ** k
    train = dm.tuple_index(torch.arange(dm.sizes["train"]), "train")
    test = dm.tuple_index(torch.arange(dm.sizes["test"]), "test")
    assert dm.sizes["train"] == round(fraction * total) and dm.sizes["val"] == dm.sizes["test"] == total - len(train)
    assert torch.equal(torch.sort(torch.cat([train, test])).values, torch.arange(total))
    for split in ("train", "val", "test"):
        b = dm.batch(torch.arange(dm.sizes[split]), split)
        assert torch.equal(b["y"], b["a"].sum(1) % p) and int(b["a"].min()) >= 0 and int(b["a"].max()) < p


def test_the_split_depends_on_the_seed_only():
    a = ModularAdditionDataModule(k=3, p=7, batch_size=8, seed=1)
    b = ModularAdditionDataModule(k=3, p=7, batch_size=64, seed=1, shuffle=False)
    c = ModularAdditionDataModule(k=3, p=7, batch_size=8, seed=2)
    index = torch.arange(a.sizes["train"])
    assert torch.equal(a.tuple_index(index, "train"), b.tuple_index(index, "train"))
    assert not torch.equal(a.tuple_index(index, "train"), c.tuple_index(index, "train"))


def test_each_input_is_uniform_over_the_training_split():
    # a uniformly random half of Z_11^3: each digit of each position near 1/11 of the tuples
    dm = ModularAdditionDataModule(k=3, p=11, batch_size=None, seed=0)
    a = dm.batch(torch.arange(dm.sizes["train"]), "train")["a"]
    counts = torch.stack([torch.bincount(a[:, j], minlength=11) for j in range(3)]).double()
    expected = len(a) / 11
    # chi-square per position, 10 dof: p = 0.001 at 29.6 (a random half of the tuples is not exactly uniform)
    assert float(((counts - expected) ** 2 / expected).sum(1).max()) < 29.6


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_training_tuple_once_per_epoch_across_ranks(world):
    dm = ModularAdditionDataModule(k=2, p=11, batch_size=60 // world // 2, seed=5)  # 60 train tuples, 2 steps
    steps = dm._steps_per_data_epoch(world)
    assert steps * dm.batch_size * world == dm.sizes["train"]
    for epoch in range(2):
        seen = torch.cat([dm._minibatch_index(torch.arange(dm.batch_size), epoch * steps + s, r, world)
                          for s in range(steps) for r in range(world)])
        assert torch.equal(torch.sort(seen).values, torch.arange(dm.sizes["train"]))


@pytest.mark.parametrize("args, field", [
    (dict(p=9), "data.p"), (dict(p=2), "data.p"), (dict(k=1), "data.k"),
    (dict(train_fraction=1.0), "data.train_fraction"),
    (dict(train_fraction=0.0), "data.train_fraction"), (dict(k=2, p=3, batch_size=8), "data.batch_size"),
])
def test_bad_values_are_refused_naming_the_field(args, field):
    with pytest.raises(ConfigError) as err:
        ModularAdditionDataModule(**args)
    assert err.value.field == field


def test_decode_is_mixed_radix_and_the_features_are_an_orthonormal_fourier_basis():
    t = torch.arange(7 ** 3)
    a = decode(t, 3, 7)
    assert torch.equal(a[:, 0] + 7 * a[:, 1] + 49 * a[:, 2], t)
    F = fourier_modes(11)
    assert torch.allclose(F @ F.T, torch.eye(10, dtype=torch.float64))
    assert float(F.sum(1).abs().max()) < 1e-12  # no constant component
    assert [q for q in range(2, 30) if is_prime(q)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]


# ---- theory ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k, p, value", [(3, 97, 2.01e-5), (4, 47, 1.02e-5), (5, 23, 1.19e-5), (4, 31, 2.93e-5),
                                        (3, 61, 5.12e-5), (5, 17, 3.00e-5), (2, 97, 2.88e-4)])
def test_gamma_star_matches_the_spec_values(k, p, value):
    assert gamma_star(k, p) == pytest.approx(value, rel=6e-3)  # values to three significant digits


def test_the_norm_and_margins_follow_their_definitions():
    U, W = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    per = [math.sqrt(float(U[:, :, i].square().sum() + W[i].square().sum())) for i in range(4)]
    assert float(norm_2_kplus1(U, W)) == pytest.approx(sum(v ** 4 for v in per) ** 0.25, rel=1e-12)
    logits = torch.randn(50, 5, dtype=torch.float64)
    y = torch.randint(0, 5, (50,))
    want = [float(logits[n, y[n]] - max(logits[n, c] for c in range(5) if c != y[n])) for n in range(50)]
    assert margins(logits, y).tolist() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("p", [7, 23])
def test_planted_cosine_neurons_score_power_one_with_their_frequency_and_phase(p):
    gen = torch.Generator().manual_seed(p)
    k, m = 3, 12
    zeta = torch.randint(1, (p - 1) // 2 + 1, (m,), generator=gen)
    z = zeta.double()  # the angles in float64 (an int tensor times a float is float32)
    phases = (torch.rand(k, m, generator=gen, dtype=torch.float64) * 2 - 1) * math.pi
    beta = torch.rand(m, generator=gen, dtype=torch.float64) + 0.5
    a = torch.arange(p, dtype=torch.float64)
    U = beta * torch.cos(phases[:, None, :] + 2 * math.pi * z * a[:, None] / p)  # [k, p, m]
    W = (beta * torch.cos(phases.sum(0) + 2 * math.pi * z * a[:, None] / p)).T  # phases sum: residual 0
    s = neuron_spectra(U, W)
    assert torch.allclose(s["power"], torch.ones(m, dtype=torch.float64), atol=1e-12)
    assert bool(s["shared"].all()) and torch.equal(s["frequency"], zeta)
    assert float(s["phase_residual"].abs().max()) < 1e-9
    one = spectrum(U[0].T)
    assert torch.allclose(torch.cos(one["phase"] - phases[0]), torch.ones(m, dtype=torch.float64))
    # a mixed neuron: power below 1, and a broken phase sum shows in the residual
    W2 = W.clone()
    W2[0] = beta[0] * torch.cos(phases[:, 0].sum() + 1.0 + 2 * math.pi * z[0] * a / p)
    U2 = U.clone()
    U2[0, :, 1] += 0.5 * torch.cos(2 * math.pi * (zeta[1] % ((p - 1) // 2) + 1) * a / p)
    s2 = neuron_spectra(U2, W2)
    assert float(s2["phase_residual"][0]) == pytest.approx(-1.0, abs=1e-9)
    assert float(s2["power"][1]) < 0.9
    assert frequency_coverage(zeta, p).tolist() == [int((zeta == z).sum()) for z in range(1, (p - 1) // 2 + 1)]


# ---- the module -----------------------------------------------------------------------------------------
def _module(**model):
    from featlearn.lightning_modules.modular_addition import FourierMLP

    dm = ModularAdditionDataModule(k=3, p=7, batch_size=32, seed=1)
    return FourierMLP(**{"width": 20, **model}).attach(dm), dm


def test_the_module_is_the_chapters_network_and_both_readings_of_lambda():
    from featlearn.kernels import modular_power_mlp_reference

    model, dm = _module(regularizer="norm", lam=0.1)
    batch = dm.batch(torch.arange(32), "train")
    logits = model(batch["a"])
    U, W = model.U.detach().double(), model.W.detach().double()
    want = sum(U[j][batch["a"][:, j]] for j in range(3)) ** 3 @ W
    assert torch.allclose(logits.double(), want, rtol=1e-5, atol=1e-7)
    assert torch.allclose(want, modular_power_mlp_reference(batch["a"], U, W, 3))
    loss, _ = model.batch_loss(batch)
    ce = torch.nn.functional.cross_entropy(logits, batch["y"])
    assert float(loss) == pytest.approx(float(ce.detach() + 0.1 * norm_2_kplus1(model.U.detach(), model.W.detach())),
                                        rel=1e-6)
    decay = {g["weight_decay"] for g in model.configure_optimizers()["optimizer"].param_groups}
    assert decay == {0.0}  # the penalty reading: no decay on top
    plain, _ = _module(lam=0.1)
    assert {g["weight_decay"] for g in plain.configure_optimizers()["optimizer"].param_groups} == {0.1}
    assert float(plain.batch_loss(batch)[0]) == pytest.approx(float(torch.nn.functional.cross_entropy(
        plain(batch["a"]), batch["y"])), rel=1e-6)


def test_the_width_defaults_to_the_chapters_and_a_width_memory_cannot_hold_is_refused(monkeypatch):
    from featlearn import validation
    from featlearn.lightning_modules.modular_addition import FourierMLP

    dm = ModularAdditionDataModule(k=3, p=7, batch_size=32)
    assert FourierMLP().attach(dm).U.shape == (3, 7, 2 ** 4 * 6)
    monkeypatch.setattr(validation, "available_memory", lambda device: (1 << 20, "test limit"))
    with pytest.raises(ConfigError) as err:
        FourierMLP(width=100_000).attach(ModularAdditionDataModule(k=3, p=7, batch_size=32))
    assert err.value.field == "model.width" and "small enough to fit in memory" in str(err.value)


def test_the_spectral_metrics_of_a_planted_network():
    # every neuron a pure cosine on one frequency with phases that sum: power 1, one frequency, residual 0
    model, _ = _module(width=9)
    a = torch.arange(7, dtype=torch.float64)
    zeta = torch.tensor([1, 2, 3] * 3, dtype=torch.float64)
    phases = torch.linspace(-1, 1, 27, dtype=torch.float64).reshape(3, 9)
    with torch.no_grad():
        model.U.copy_(torch.cos(phases[:, None, :] + 2 * math.pi * zeta * a[:, None] / 7))
        model.W.copy_(torch.cos(phases.sum(0) + 2 * math.pi * zeta * a[:, None] / 7).T)
    m = model.spectral_metrics()
    assert m["max_power"] == pytest.approx(1.0, abs=1e-6) and m["single_frequency"] == 1.0
    assert m["phase_residual"] < 1e-5 and m["frequencies_used"] == 1.0


def test_dead_neurons_do_not_dilute_the_spectral_metrics():
    # half the neurons pure cosines, half tiny noise (what weight decay leaves of unused neurons)
    model, _ = _module(width=8)
    a = torch.arange(7, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.U.copy_(torch.randn(3, 7, 8, generator=gen) * 1e-4)
        model.W.copy_(torch.randn(8, 7, generator=gen) * 1e-4)
        for i, zeta in enumerate((1, 2, 3, 1)):
            model.U[:, :, i] = torch.cos(2 * math.pi * zeta * a / 7)
            model.W[i] = torch.cos(2 * math.pi * zeta * a / 7)
    m = model.spectral_metrics()
    assert m["max_power"] > 0.999 and m["single_frequency"] > 0.999 and m["phase_residual"] < 1e-3
    assert m["live_neurons"] == 0.5 and m["frequencies_used"] == 1.0
    s = neuron_spectra(model.U.detach(), model.W.detach())
    assert float(s["power"].mean()) < 0.8  # the plain mean would have counted the noise


@pytest.mark.slow  # ~65 s on one thread
def test_trained_neurons_become_single_frequency_fourier_neurons(tmp_path):
    """Theorem 4.9's prediction at k = 3, p = 23 (the experiment's ``strong decay, m = 64`` run): neurons of one
    frequency with phases that sum, every frequency used, and the held-out half classified. Measured for seeds
    0-2: max power 0.92-0.93, one frequency 0.98-1.0, phase residual 0.05, held-out accuracy 1.0."""
    from featlearn.cli import make_cli

    cli = make_cli(["fit", "--config", "configs/modular_addition/mlp.yaml", "--trainer.logger", "false",
                    "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
                    "--model.init_args.lam", "0.4", "--model.init_args.lr", "0.01", "--model.init_args.width", "64",
                    "--trainer.max_steps", "6000", "--trainer.val_check_interval", "1000", "--seed_everything", "1",
                    "--data.init_args.seed", "1", "--model.init_args.seed", "1"])
    m = cli.model.final_metrics()
    assert m["test_acc"] >= 0.99 and m["train_acc"] == 1.0
    assert m["max_power"] >= 0.9 and m["single_frequency"] >= 0.95 and m["phase_residual"] <= 0.1
    assert m["frequencies_used"] == 1.0


def test_the_experiment_writes_its_table_and_refuses_bad_options(tmp_path, capsys):
    from featlearn.experiments import modular_addition as experiment

    out = experiment.main(["--k", "3", "--p", "5", "--steps", "12", "--seed", "0", "--part", "fourier",
                           "--out", str(tmp_path)])
    runs, grokking = out["results"][0], out["grokking"]
    assert grokking is None and not (tmp_path / "modular_addition_grokking.md").exists()
    assert set(runs) == set(experiment.RUNS)
    for result in runs.values():
        assert {"test_acc", "train_acc", "max_power", "margin_ratio", "coverage", "power"} <= set(result)
        assert len(result["coverage"]) == 2 and result["steps"] == 12
    table = (tmp_path / "modular_addition.md").read_text()
    assert "predicted (Thm 4.9, Lemma 4.7)" in table and "| chapter |" in table
    assert (tmp_path / "modular_addition_power.png").is_file() and (tmp_path / "modular_addition_coverage.png").is_file()
    for argv, words in ((["--p", "9"], "--p: must be an odd prime, got 9"), (["--k", "1"], "--k: must be an integer >= 2"),
                        (["--steps", "3"], "--steps: must be an integer >= 6"),
                        (["--grokking-steps", "0"], "--grokking-steps"), (["--part", "both"], "--part")):
        with pytest.raises(SystemExit):
            experiment.main([*argv, "--out", str(tmp_path / "bad")])
        assert words in capsys.readouterr().err


@pytest.mark.slow  # ~60 s on one thread
def test_the_mlp_groks_at_two_inputs(tmp_path):
    """Grokking (Fig. 4.4's k = 2, p = 97, the experiment's setting): the training half is fitted long before the
    held-out half. Measured for seeds 0-2: train 99% at step 500, held-out 99% at 2700-2800."""
    from featlearn.experiments.common import build
    from featlearn.experiments.modular_addition_grokking import GROKKING, ValidationCurves, first_step

    curves = ValidationCurves()
    overrides = [arg for key, value in GROKKING.items() for arg in (f"--{key}", str(value).lower())]
    cli = build("modular_addition/mlp.yaml", tmp_path, "grok", *overrides, "--data.init_args.k", "2",
                "--data.init_args.p", "97", "--trainer.max_steps", "3500", "--trainer.val_check_interval", "100",
                "--seed_everything", "1", "--data.init_args.seed", "1", "--model.init_args.seed", "1")
    cli.trainer.callbacks.append(curves)
    cli.trainer.fit(cli.model, cli.datamodule)
    c = curves.curves
    train, test = first_step(c["step"], c["train_acc"]), first_step(c["step"], c["test_acc"])
    assert train is not None and train <= 1000 and test is not None and test - train >= 1000
    # the circuit forms while the held-out half is still unsolved: the excluded loss rises past the restricted
    assert c["excluded_loss"][-1] > c["restricted_loss"][-1]


def test_the_grokking_part_writes_its_table_and_figures(tmp_path, monkeypatch):
    from featlearn.experiments import modular_addition as experiment
    from featlearn.experiments import modular_addition_grokking as grokking

    monkeypatch.setattr(grokking, "SIZES", ((2, 7), (3, 5)))  # the chapter's sizes take minutes
    out = experiment.main(["--part", "grokking", "--grokking-steps", "30", "--seed", "0", "1", "--out", str(tmp_path)])
    runs = out["grokking"]
    assert set(runs) == {"k=2, p=7", "k=3, p=5"} and set(runs["k=2, p=7"]) == {0, 1}
    for per_seed in runs.values():
        for result in per_seed.values():
            curves = result["curves"]
            assert curves["step"] == [30] and len(curves["restricted_loss"]) == 1 and result["steps"] == 30
            assert curves["restricted_loss"][0] is not None and curves["excluded_loss"][0] > 0
    table = (tmp_path / "modular_addition_grokking.md").read_text()
    assert "| k=2, p=7 | 49 | 24 |" in table and "predicted (Fig. 4.4)" in table
    assert (tmp_path / "modular_addition_grokking_accuracy.png").is_file()
    assert (tmp_path / "modular_addition_grokking_progress.png").is_file()
