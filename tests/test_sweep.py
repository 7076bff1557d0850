"""`python -m featlearn.experiments.sweep`: a tiny 2-point sweep writes its summary, resumes without refitting,
refuses bad sweep files naming the field, and fits the growth exponent."""
import json
import math
from pathlib import Path

import pytest
import yaml

from featlearn.errors import ConfigError
from featlearn.experiments import points
from featlearn.experiments import study as study_module
from featlearn.experiments import sweep as sweep_module
from featlearn.experiments.sweep import Rule, growth_exponent, main, parse_sweep

TINY = {
    "description": "tiny MRP sweep",
    "base": "mrp/teacher_student.yaml",
    "sweep": {"data.init_args.k": [4, 6]},
    "derived": {"data.init_args.d": {"of": "k", "times": 4, "at_least": 20, "round": "ceil"},
                "model.init_args.lr": {"of": "k", "times": 0.5}},
    "overrides": {"data.init_args.P": 10, "data.init_args.s": 1.0, "data.init_args.num_pretrain": 32,
                  "data.init_args.num_val": 8, "data.init_args.num_test": 8, "model.init_args.m": 2,
                  "heatmap.every_n_steps": 1000, "checkpoint.every_n_train_steps": 0, "trainer.accelerator": "cpu"},
    "steps": 5,
    "timed_after": 1,
    "metrics": ["frac_captured", "first_capture/max"],
    "cost_model": ["data.init_args.k", "model.init_args.m", "data.init_args.d", "data.init_args.P"],
}


def write(tmp_path, data, name="sweep.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def fits(monkeypatch):
    """The names of the runs the study really fits (a resumed run is not built)."""
    names = []
    real = study_module.build
    monkeypatch.setattr(study_module, "build", lambda config, out, name, *a: names.append(name) or real(
        config, out, name, *a))
    return names


def test_two_point_sweep_writes_summary_and_resumes(tmp_path, one_thread, fits, capsys):
    config, out = write(tmp_path, TINY), tmp_path / "out"
    summary = main(["--config", str(config), "--out", str(out)])
    assert fits == ["k=4/s0", "k=6/s0"]
    for name in ("sweep.md", "sweep.json", "sweep_summary.png", "study.json"):
        assert (out / name).stat().st_size > 0, name
    assert list((out / "k=4" / "s0").glob("events.out.tfevents.*")), "TensorBoard logs under --out/<point>"
    state = json.loads((out / "sweep.json").read_text())
    rows = state["rows"]
    assert [(r["point"], r["seed"]) for r in rows] == [("k=4", 0), ("k=6", 0)]
    for row in rows:
        assert row["steps"] == 5 and row["timed_steps"] == 5 - 1 - 1  # first step untimed, last one for memory
        assert row["time_per_step_ms"] > 0 and row["peak_mib"] is not None and row["diverged"] is False
        assert set(row["metrics"]) == {"frac_captured", "first_capture/max"}
        assert 0 <= row["metrics"]["frac_captured"] <= 1
    assert rows[1]["settings"]["data.init_args.d"] == 24 and rows[0]["settings"]["data.init_args.d"] == 20
    assert rows[1]["settings"]["model.init_args.lr"] == 3.0
    header = (out / "sweep.md").read_text().splitlines()[2]
    for column in ("k", "d", "lr", "m", "P", "frac_captured", "first_capture/max", "ms / step", "peak MiB"):
        assert f"| {column} |" in header, column
    # the FLOP model k m d P: 4*2*20*10 -> 6*2*24*10, so its exponent is log(1.8)/log(1.5)
    assert summary["fit"]["all"]["expected"] == pytest.approx(math.log(1.8) / math.log(1.5))
    assert "time per step ~ k^" in capsys.readouterr().out

    # the same command again fits nothing; one more seed fits only the new runs
    fits.clear()
    main(["--config", str(config), "--out", str(out)])
    assert fits == []
    main(["--config", str(config), "--out", str(out), "--seed", "0", "1"])
    assert fits == ["k=4/s1", "k=6/s1"]
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert [(r["point"], r["seed"]) for r in rows] == [("k=4", 0), ("k=4", 1), ("k=6", 0), ("k=6", 1)]

    # a changed sweep file writes to a new folder, or starts afresh in --out with --overwrite
    changed = write(tmp_path, {**TINY, "steps": 6, "timed_after": 3})
    fits.clear()
    main(["--config", str(changed), "--out", str(out)])
    assert fits == ["k=4/s0", "k=6/s0"] and (tmp_path / "out-2" / "sweep.json").is_file()
    main(["--config", str(changed), "--out", str(out), "--overwrite"])
    assert len(fits) == 4
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert [(r["steps"], r["timed_steps"]) for r in rows] == [(6, 2), (6, 2)]


def test_a_diverged_point_keeps_its_row(tmp_path, one_thread, fits):
    """The divergence guard stops k=6 (lr 1e8, no norm cap): its row says so, with no metrics; k=4 as usual."""
    data = {**TINY, "derived": {"model.init_args.lr": {"of": "k", "table": {4: 2.0, 6: 1.0e8}}},
            "overrides": {**TINY["overrides"], "model.init_args.norm_cap": None}}
    main(["--config", str(write(tmp_path, data)), "--out", str(tmp_path / "out")])
    rows = {r["point"]: r for r in json.loads((tmp_path / "out" / "sweep.json").read_text())["rows"]}
    assert rows["k=4"]["diverged"] is False and rows["k=6"]["diverged"] is True and rows["k=6"]["error"]
    assert set(rows["k=6"]["metrics"].values()) == {None}
    assert "0 (diverged)" in (tmp_path / "out" / "sweep.md").read_text()


@pytest.mark.parametrize("change, field", [
    ({"base": "mrp/nope.yaml"}, "base"),
    ({"base": "mrp/data_tiny.yaml"}, "base"),
    ({"sweep": {"data.init_args.k": []}}, "sweep.data.init_args.k"),
    ({"sweep": {"data.init_args.k": [4, 4]}}, "sweep.data.init_args.k"),
    ({"sweep": {"data.init_args.k": 4}}, "sweep.yaml: sweep"),
    ({"sweep": {}}, "sweep"),
    ({"sweep": {"data.init_args.k": [4, 6], "data.init_args.d": [20]}}, "sweep"),  # zip: one length
    ({"steps": 2}, "steps"),
    ({"steps": "five"}, "sweep.yaml: steps"),
    ({"timed_after": -1}, "timed_after"),
    ({"seeds": [0, 0]}, "seeds"),
    ({"metrics": []}, "metrics"),
    ({"grid": "diagonal"}, "sweep.yaml: grid"),
    ({"extra": 1}, "sweep.yaml: extra"),
    ({"cost_model": ["data.init_args.P^two"]}, "cost_model"),
    ({"derived": {"data.init_args.d": {"of": "kk", "times": 4}}}, "derived.data.init_args.d.of"),
    ({"derived": {"data.init_args.d": {"of": "k", "round": "up"}}}, "sweep.yaml: derived.data.init_args.d: round"),
    ({"derived": {"data.init_args.d": {"of": "k", "tims": 4}}}, "sweep.yaml: derived.data.init_args.d: tims"),
    ({"derived": {"data.init_args.d": {"of": "k", "table": {4: 20}}}}, "derived.data.init_args.d.table"),
    ({"derived": {"data.init_args.d": {"of": "k", "log": True}}, "sweep": {"data.init_args.k": [0, 4]}},
     "derived.data.init_args.d.of"),
    ({"derived": {"data.init_args.k": {"of": "k"}}}, "derived"),
])
def test_bad_sweep_files_are_refused_naming_the_field(change, field):
    with pytest.raises(ConfigError) as info:
        parse_sweep({**TINY, **change}, "sweep.yaml")
    assert info.value.field == field


@pytest.mark.parametrize("change, field", [
    ({"sweep": {"data.init_args.kk": [4, 6]}, "derived": {}}, "sweep.data.init_args.kk"),
    ({"overrides": {"model.init_args.nope": 1}}, "overrides.model.init_args.nope"),
    ({"cost_model": ["data.init_args.D"]}, "cost_model"),
    ({"sweep": {"data.init_args.k": [1, 4]}, "derived": {}}, "point k=1"),  # k >= 2: the config's own type
])
def test_keys_and_values_unknown_to_the_base_config_are_refused_before_any_run(tmp_path, change, field, capsys, fits):
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(write(tmp_path, {**TINY, **change})), "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {field}: must be ")
    assert not (tmp_path / "out").exists() and fits == []


def test_growth_exponent_recovers_a_known_slope():
    xs = [16, 32, 64, 128, 256]
    assert growth_exponent(xs, [7.0 * x ** 2.3 for x in xs]) == pytest.approx(2.3)
    # noise that is symmetric in log space around x^1.5 leaves the slope where it was
    noisy = [5.0 * x ** 1.5 * f for x, f in zip(xs, [1.1, 1 / 1.1, 1.0, 1.1, 1 / 1.1])]
    assert growth_exponent(xs, noisy) == pytest.approx(1.5, abs=0.05)
    assert growth_exponent([16], [1.0]) is None and growth_exponent([16, 32], [1.0, None]) is None


def test_rules():
    assert Rule is points.Rule  # one Rule: the experiments' points
    assert parse_sweep({**TINY, "derived": {"data.init_args.d": {"of": "k", "times": 8}}}).settings(
        {"data.init_args.k": 4})["data.init_args.d"] == 32  # an integer rule stays an integer (d1 = 8 d)
    assert Rule(of="k", times=4, at_least=256, round="ceil").apply(32) == 256
    assert Rule(of="k", log=True, times=2.5, at_least=4, round="ceil").apply(1024) == math.ceil(2.5 * math.log(1024))
    assert Rule(of="k", power=-1, times=0.02).apply(16) == pytest.approx(0.02 / 16)
    assert Rule(of="k", table={16: 400, 512: 15}).apply(512) == 15
    assert Rule(of="k", times=4, at_least=256, round="ceil").text("d") == "d = max(256, ceil(4 k))"


@pytest.mark.parametrize("path", sorted(Path("configs/large_k").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_sweep_file_resolves(path):
    """Each shipped sweep parses, and every point's settings resolve against its base config (no run)."""
    sweep = sweep_module.load_sweep(path)
    resolved = sweep_module.resolve_points(sweep, list(sweep.seeds) or [0])
    assert len(resolved) == len(list(sweep.points())) >= 2
