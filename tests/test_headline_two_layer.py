"""Headline claims of Shi 2024, Ch. 2 (Table A.1) through the experiment's own functions at a small size
(parity, d = 100, D = 100, k = 5, m = 50, n = 4,000, T = 150, seed 0, the experiment's lr3 grid chosen on
validation accuracy for the methods that take stage-3 steps): the network's neurons align with
sum_A M_j after two steps (CosSim > 0.99); the best classifier on the step-2 features (Two Step) fits the
parity (the paper's ~100%); and the network beats the fixed features (NTK, RF) on test accuracy.

Stage 3 here is the old protocol's (one step size for both layers over T - 2 steps, ``stage3: False``): the
stage-3 protocol of experiment.yaml (the second layer's own step up to x1e4, 2,000 steps) is what fits the
parity at full size (docs/methods/two_layer.md) and does not fit a test's time. Measured (one thread, this
size, the grid x{0.01, 0.1, 1, 10, 100}; seeds 0 / 1 / 2 / 3 / 4): Two Step test 99.9 / 100.0 / 100.0%
(raw-feature readout), Network 80.4 / 82.1 / 84.8 / 81.1 / 76.1%
(lr3 x10, x10, x1, x10, x10), NTK 78.7 / 78.7 / 79.0 / 78.4 / 78.3% (x0.1), RF 72.3 / 70.7 / 72.1 / 72.0 /
71.1%; CosSim after step 2 0.993, RF (init) 0.273. The network's accuracy claim does not hold over seeds
at this size under the old stage 3 (seed 0: +1.7 points over the NTK, below the 2-point margin;
seed 4: 2.2 points under it): its stage-3 steps stop at or below the 'S >= 3' threshold rule (84.4% in
population; the correlation classifier a ~ E[y h] of the step-2 features; README, chapter 2), so it is a
strict xfail that says so."""
import argparse
import json

import pytest

from featlearn.experiments.study import Study
from featlearn.experiments.two_layer import SETTINGS, Setting, main, parse_args, tune

pytestmark = pytest.mark.usefixtures("one_thread")

# one step size for both layers over T - 2 stage-3 steps (stage3: False): the theory's own stage 3, the reading
# that stops at the threshold rule; the stage-3 protocol's steps x1e4 and budget do not fit a test's time
SETTING = Setting(name="small", data="data_parity.yaml", dim=100, width=50, steps=150, stage3=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each column's best trial of the grid, through the experiment's tuning (the probes' classifier is
    solved exactly: one trial)."""
    args = argparse.Namespace(width=None, steps=None, num_train=4000, seed=[0], lr3_grid=SETTINGS.plain_lr3_grid,
                              lr3a_grid=SETTINGS.lr3a_grid, stage3_steps=SETTINGS.stage3_steps,
                              stop_check_every=SETTINGS.stop_check_every,
                              out=tmp_path_factory.mktemp("two_layer_headline"), overwrite=False)
    with Study(args, "headline", fits=3 * len(SETTINGS.plain_lr3_grid) + 1) as study:
        best = {label: tune(study, SETTING, label, args) for label in ("Network", "NTK", "RF", "Two Step")}
    return {label: trials[lr]["result"] for label, (lr, trials) in best.items()}


def test_neurons_align_with_the_relevant_patterns(results):
    assert results["Network"]["cos"] > 0.99
    assert results["RF"]["cos"] < 0.5              # random features stay where they started


def test_step_two_features_fit_the_parity(results):
    """Lemma A.17: a linear classifier on the step-2 hidden layer has zero loss (99.9% measured against 99).
    One Step's scale-free readout is tested in test_two_layer.py (test_one_step_readout_is_scale_free)."""
    assert results["Two Step"]["test"] > 99.0 and results["Two Step"]["train"] > 99.0
    assert results["Two Step"]["test"] > max(results["NTK"]["test"], results["RF"]["test"]) + 15.0


@pytest.mark.xfail(strict=True, reason="measured at this size: Network 80.4% vs NTK 78.7% test accuracy (seed 0), "
                                       "below the 2-point margin, and 76.1% < 78.3% on seed 4; the theory's "
                                       "stage-3 steps stop at the threshold rule (module docstring)")
def test_network_beats_fixed_features(results):
    assert results["Network"]["test"] > max(results["NTK"]["test"], results["RF"]["test"]) + 2.0


def test_tables_write_md_json_png_and_probes_are_not_tuned(tmp_path):
    """A tiny Table A.1 (Network, RF, Two Step) and MOG (Network). Stage 3 on equal terms: Network and RF try
    the same (first layer, second layer) step pairs for the same stage-3 budget, which T does not change (T
    sets eta only); RF's first layer never moves, so its trials differing only there are one fit; the probe
    runs once ('exact'). The mixture's table has our numbers and the centre coverage, no paper column."""
    out = main(["--methods", "Network", "RF", "Two Step", "--steps", "600", "--stage3-steps", "3", "--num-train",
                "1000", "--width", "4", "--lr3-grid", "0.1", "1", "--lr3a-grid", "1", "100", "--out",
                str(tmp_path / "a1")])
    res = out["results"]["parity d=500"]
    pairs = ["w x0.1 / a x1", "w x0.1 / a x100", "w x1 / a x1", "w x1 / a x100"]
    assert list(res["Network"]["trials"]) == list(res["RF"]["trials"]) == pairs
    assert res["RF"]["trials"]["w x1 / a x100"] == res["RF"]["trials"]["w x0.1 / a x100"]
    assert res["Network"]["trials"]["w x1 / a x100"] != res["Network"]["trials"]["w x0.1 / a x100"]
    assert len(res["Two Step"]["trials"]) == 1 and res["Two Step"]["lr3_mult"] is None
    runs = json.loads((tmp_path / "a1" / "study.json").read_text())["runs"]
    assert len(runs) == 4 + 2 + 1
    assert {(r["run"]["settings"]["trainer.max_steps"], r["run"]["settings"]["model.init_args.steps"])
            for r in runs.values()} == {("5", "600")}
    md = (tmp_path / "a1" / "two_layer_A1.md").read_text()
    assert "| exact |" in md and "(100.0)" in md and "3 stage-3 minibatch steps" in md
    assert out["meta"]["stop_check_every"] == 0 and "| stop step |" not in md  # 50 > 5 steps: no validation
    mog = main(["--table", "MOG", "--methods", "Network", "--steps", "8", "--num-train", "1000", "--width", "4",
                "--lr3-grid", "100", "--out", str(tmp_path / "mog")])
    assert set(mog["results"]) == {s.name for s in SETTINGS.tables["MOG"]}
    md = (tmp_path / "mog" / "two_layer_MOG.md").read_text()
    assert "| Cos centres min |" in md and "(NA)" not in md
    assert json.loads((tmp_path / "mog" / "two_layer_MOG.json").read_text())["meta"]["num_train"] == 1000
    assert len(list((tmp_path / "mog").glob("two_layer_MOG_neurons_*.png"))) == 3


@pytest.mark.parametrize("argv, option", [
    (["--table", "A9"], "--table"), (["--lr3-grid", "-1"], "--lr3-grid"), (["--num-train", "-3"], "--num-train"),
    (["--steps", "2"], "--steps"), (["--lr3a-grid", "-1"], "--lr3a-grid"), (["--stage3-steps", "0"], "--stage3-steps"),
    (["--stop-check-every", "-1"], "--stop-check-every"),
    (["--seed", "1", "1"], "--seed"), (["--methods", "SVM"], "--methods"),
    (["--table", "MOG", "--methods", "Two Step"], "--methods"),
])
def test_bad_options_name_the_option(argv, option, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert option in capsys.readouterr().err


def test_the_stopping_step_is_chosen_on_validation(tmp_path):
    """With validation scored at every step, each fit keeps its best state: its validation accuracy is at least
    that of the same fit run to the end (whose last step is one of the candidates), the chosen step is recorded
    and printed; with 0 the fit runs to the end and records no step."""
    common = ["--methods", "Network", "--stage3-steps", "6", "--num-train", "1000", "--width", "4",
              "--lr3-grid", "1", "--lr3a-grid", "100", "--seed", "0"]
    stopped = main([*common, "--stop-check-every", "1", "--out", str(tmp_path / "stop")])["results"]["parity d=500"]
    ended = main([*common, "--stop-check-every", "0", "--out", str(tmp_path / "end")])["results"]["parity d=500"]
    for seed in ("0",):
        best, last = stopped["Network"]["per_seed"][seed], ended["Network"]["per_seed"][seed]
        assert 1 <= best["stop"] <= 8 and "stop" not in last
        assert best["val"] >= last["val"]
        assert best["val"] == pytest.approx(best["stop_val"], abs=1e-4)  # the kept model (logged in float32)
    assert "| stop step |" in (tmp_path / "stop" / "two_layer_A1.md").read_text()
    assert "| stop step |" not in (tmp_path / "end" / "two_layer_A1.md").read_text()


def test_a_setting_tuned_by_another_reuses_its_choices(tmp_path):
    """Table A.3's d = 2000 row searches nothing: each column is fitted at every seed with the pair chosen at d = 100,
    and the table says so."""
    out = main(["--table", "A3", "--methods", "Network", "One Step", "--stage3-steps", "3", "--num-train", "1000",
                "--width", "4", "--lr3-grid", "0", "1", "--lr3a-grid", "1", "--seed", "0", "1",
                "--out", str(tmp_path / "a3")])
    small, large = out["results"]["parity d=100"], out["results"]["parity d=2000"]
    for label in ("Network", "One Step"):
        assert large[label]["lr3_mult"] == small[label]["lr3_mult"] and large[label]["trials"] == {}
        assert large[label]["tuned_on"] == "parity d=100" and set(large[label]["per_seed"]) == {"0", "1"}
    assert small["Network"]["lr3_mult"] in ("w x0 / a x1", "w x1 / a x1") and small["One Step"]["lr3_mult"] is None
    names = json.loads((tmp_path / "a3" / "study.json").read_text())["runs"]
    assert sorted(n for n in names if "2000" in n) == [f"parity_d_2000_{c}_s{s}" for c in ("Network", "One_Step")
                                                       for s in (0, 1)]
    assert "(step sizes: the pairs chosen at parity d=100" in (tmp_path / "a3" / "two_layer_A3.md").read_text()


def test_tuned_by_must_name_an_earlier_setting(monkeypatch, capsys):
    rows = [Setting(name="b", data="data_parity.yaml", width=4, steps=10, tuned_by="a"),
            Setting(name="a", data="data_parity.yaml", width=4, steps=10)]
    monkeypatch.setitem(SETTINGS.tables, "A3", rows)
    with pytest.raises(SystemExit):
        parse_args(["--table", "A3"])
    assert "tables.A3.tuned_by: must name an earlier setting of the table (none), got 'a'" in capsys.readouterr().err
