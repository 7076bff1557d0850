"""`python -m featlearn.experiments.sweep`: a tiny 2-point sweep writes its summary, resumes without refitting,
refuses bad sweep files naming the field, and fits the growth exponent."""
import json
import math
from pathlib import Path

import pytest
import yaml

from featlearn.errors import ConfigError
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


def test_two_point_sweep_writes_summary_and_resumes(tmp_path, one_thread, monkeypatch, capsys):
    config, out = write(tmp_path, TINY), tmp_path / "out"
    fits = []
    real_run = sweep_module.run_point
    monkeypatch.setattr(sweep_module, "run_point", lambda *a: fits.append(a[1]) or real_run(*a))
    summary = main(["--config", str(config), "--out", str(out)])
    assert [p["data.init_args.k"] for p in fits] == [4, 6]
    for name in ("sweep.md", "sweep.json", "sweep_summary.png"):
        assert (out / name).stat().st_size > 0, name
    assert list((out / "k=4" / "s0").glob("events.out.tfevents.*")), "TensorBoard logs under --out/<point>"
    state = json.loads((out / "sweep.json").read_text())
    rows = state["rows"]
    assert [(r["point"], r["seed"]) for r in rows] == [("k=4", 0), ("k=6", 0)]
    for row in rows:
        assert row["steps"] == 5 and row["timed_steps"] == 5 - 1 - 1  # first step untimed, last one for memory
        assert row["time_per_step_ms"] > 0 and row["peak_mib"] is not None
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
    assert [p["data.init_args.k"] for p in fits] == [4, 6]
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert sorted((r["point"], r["seed"]) for r in rows) == [("k=4", 0), ("k=4", 1), ("k=6", 0), ("k=6", 1)]

    # a changed sweep file is refused for that folder, and starts afresh with --overwrite
    changed = write(tmp_path, {**TINY, "steps": 6})
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(changed), "--out", str(out)])
    assert stop.value.code == 2 and "['steps'] differ" in capsys.readouterr().err
    fits.clear()
    monkeypatch.setattr(sweep_module, "run_point", lambda *a: fits.append(a[1]) or {
        "point": a[0].name(a[1]), "seed": a[2], "values": a[1], "settings": a[0].settings(a[1]), "device": "cpu",
        "threads": 1, "diverged": False, "metrics": {"frac_captured": 0.5, "first_capture/max": None}, "steps": 6,
        "time_per_step_ms": 1.0, "timed_steps": 4, "peak_mib": 1.0, "wall_s": 0.1})
    main(["--config", str(changed), "--out", str(out), "--overwrite"])
    assert len(fits) == 2
    assert len(json.loads((out / "sweep.json").read_text())["rows"]) == 2


@pytest.mark.parametrize("change, field", [
    ({"base": "mrp/nope.yaml"}, "base"),
    ({"base": "mrp/data_tiny.yaml"}, "base"),
    ({"sweep": {"data.init_args.k": []}}, "sweep.data.init_args.k"),
    ({"sweep": {"data.init_args.k": [4, 4]}}, "sweep.data.init_args.k"),
    ({"sweep": {}}, "sweep"),
    ({"steps": 2}, "steps"),
    ({"timed_after": -1}, "timed_after"),
    ({"seeds": [0, 0]}, "seeds"),
    ({"metrics": []}, "metrics"),
    ({"grid": "diagonal"}, "grid"),
    ({"extra": 1}, "extra"),
    ({"derived": {"data.init_args.d": {"of": "kk", "times": 4}}}, "derived.data.init_args.d.of"),
    ({"derived": {"data.init_args.d": {"of": "k", "round": "up"}}}, "derived.data.init_args.d.round"),
    ({"derived": {"data.init_args.d": {"of": "k", "tims": 4}}}, "derived.data.init_args.d.tims"),
    ({"derived": {"data.init_args.d": {"of": "k", "table": {4: 20}}}}, "derived.data.init_args.d.table"),
    ({"derived": {"data.init_args.k": {"of": "k"}}}, "derived"),
])
def test_bad_sweep_files_are_refused_naming_the_field(change, field):
    with pytest.raises(ConfigError) as info:
        parse_sweep({**TINY, **change})
    assert info.value.field == field


@pytest.mark.parametrize("change, field", [
    ({"sweep": {"data.init_args.kk": [4, 6]}, "derived": {}}, "sweep.data.init_args.kk"),
    ({"overrides": {"model.init_args.nope": 1}}, "overrides.model.init_args.nope"),
    ({"cost_model": ["data.init_args.D"]}, "cost_model"),
    ({"sweep": {"data.init_args.k": [1, 4]}, "derived": {}}, "point k=1"),  # k >= 2: the config's own type
])
def test_keys_and_values_unknown_to_the_base_config_are_refused_before_any_run(tmp_path, change, field, capsys,
                                                                              monkeypatch):
    monkeypatch.setattr(sweep_module, "run_point", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(write(tmp_path, {**TINY, **change})), "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {field}: must be ")
    assert not (tmp_path / "out").exists()


def test_growth_exponent_recovers_a_known_slope():
    xs = [16, 32, 64, 128, 256]
    assert growth_exponent(xs, [7.0 * x ** 2.3 for x in xs]) == pytest.approx(2.3)
    # noise that is symmetric in log space around x^1.5 leaves the slope where it was
    noisy = [5.0 * x ** 1.5 * f for x, f in zip(xs, [1.1, 1 / 1.1, 1.0, 1.1, 1 / 1.1])]
    assert growth_exponent(xs, noisy) == pytest.approx(1.5, abs=0.05)
    assert growth_exponent([16], [1.0]) is None and growth_exponent([16, 32], [1.0, None]) is None


def test_rules():
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
