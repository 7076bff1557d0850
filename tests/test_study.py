"""The experiment engine (featlearn.experiments.study): how a run is built, seeded and resolved, how a study
chooses its folder, resumes, survives a divergence, and how typed settings refuse bad files."""
import argparse
import json
from dataclasses import dataclass, field

import pytest
import yaml

from featlearn.errors import ConfigError
from featlearn.experiments import study as engine
from featlearn.experiments.points import Rule
from featlearn.experiments.study import Run, Study, load_settings
from tiny_sizes import MRP

TINY = dict(zip(MRP[::2], MRP[1::2]))  # the tiny MRP sizes as {"--data.init_args.k": "4", ...}
TINY = {key.removeprefix("--"): value for key, value in TINY.items()}


def _args(out, **options):
    return argparse.Namespace(out=out, overwrite=False, threads=1, seed=[0], **options)


def test_the_seed_sets_seed_everything_and_the_seed_arguments_each_class_takes():
    mrp = Run("mrp/supervised.yaml", "a", {"trainer.max_steps": 3}, seed=7).settings()
    assert mrp == {"seed_everything": 7, "data.init_args.seed": 7, "trainer.max_steps": 3}  # MRP's model has no seed
    contrastive = Run("contrastive/random_mask.yaml", "b", seed=2).settings()
    assert contrastive == {"seed_everything": 2, "data.init_args.seed": 2, "model.init_args.seed": 2}
    explicit = Run("contrastive/random_mask.yaml", "c", seed=2, seed_keys=("data.init_args.seed",)).settings()
    assert "model.init_args.seed" not in explicit


def test_a_group_file_comes_first_so_its_keys_can_be_overridden():
    run = Run("two_layer/network.yaml", "a", {"data.init_args.dim": 40, "data": "configs/x.yaml"}, seed=None)
    assert run.argv()[:2] == ["--data", "configs/x.yaml"]
    assert run.argv()[2:] == ["--data.init_args.dim", "40"]


def test_resolved_applies_the_overrides_and_refuses_what_the_cli_refuses():
    resolved = Run("mrp/supervised.yaml", "a", {**TINY, "model.init_args.lr": 0.25}, seed=3).resolved()
    assert resolved["model"]["init_args"]["lr"] == 0.25 and resolved["data"]["init_args"]["seed"] == 3
    assert resolved["seed_everything"] == 3 and resolved["data"]["init_args"]["k"] == 4
    with pytest.raises(ConfigError, match="lr"):
        Run("mrp/supervised.yaml", "a", {"model.init_args.lr": -1.0}).resolved()


def _tiny(name, seed=0, steps=3, **model):
    return Run("mrp/supervised.yaml", name, {**TINY, "trainer.max_steps": steps,
                                             **{f"model.init_args.{k}": v for k, v in model.items()}}, seed=seed)


def test_a_study_fits_records_and_resumes_without_refitting(tmp_path, monkeypatch, one_thread):
    out = tmp_path / "study"
    with Study(_args(out, knob=1), "demo", fits=2) as study:
        first = study.fit(_tiny("s0/sl"))
        second = study.fit(_tiny("s1/sl", seed=1))
    assert first["steps"] == 3 and second["steps"] == 3 and first != second  # seeds differ
    state = json.loads((out / "study.json").read_text())
    assert set(state["runs"]) == {"s0/sl", "s1/sl"} and state["options"]["knob"] == 1
    assert (out / "s0" / "sl").is_dir()  # the run's logs under <out>/<name>

    def no_fit(*a, **k):
        raise AssertionError("a finished run was fitted again")
    monkeypatch.setattr(engine, "build", no_fit)
    again = Study(_args(out, knob=1), "demo", fits=2)
    assert again.out == out  # same options: the folder is resumed
    with again:
        assert again.fit(_tiny("s0/sl")) == first and again.fit(_tiny("s1/sl", seed=1)) == second
    with pytest.raises(AssertionError, match="fitted again"):  # a changed run is refitted, not taken
        again.fit(_tiny("s0/sl", steps=4))


def test_other_options_write_to_a_new_folder_and_overwrite_empties(tmp_path, one_thread):
    out = tmp_path / "study"
    with Study(_args(out, knob=1), "demo", fits=1) as study:
        study.fit(_tiny("s0/sl", steps=2))
    other = Study(_args(out, knob=2), "demo", fits=1)
    assert other.out == tmp_path / "study-2"
    more_seeds = Study(argparse.Namespace(**{**vars(_args(out, knob=1)), "seed": [0, 1]}), "demo", fits=2)
    assert more_seeds.out == out and "s0/sl" in more_seeds.state["runs"]  # seeds added: resumed
    assert Study(_args(out, knob=1), "demo", fits=1).out == tmp_path / "study-3"  # held by more_seeds meanwhile
    with more_seeds:
        pass  # the study ends: its folder is free again
    fresh = Study(argparse.Namespace(**{**vars(_args(out, knob=1)), "overwrite": True}), "demo", fits=1)
    assert fresh.out == out and not (out / "study.json").exists() and fresh.state["runs"] == {}


def test_a_diverged_fit_is_a_result_not_a_crash(tmp_path, one_thread):
    with Study(_args(tmp_path / "s"), "demo", fits=1) as study:
        result = study.fit(_tiny("blowup", steps=300, lr=1e8))
    assert result["diverged"] is True and "lr" in result["error"]


def test_progress_counts_every_fit_resumed_or_run(tmp_path, one_thread):
    with Study(_args(tmp_path / "s"), "demo", fits=2) as study:
        study.fit(_tiny("a", steps=2))
        study.fit(_tiny("a", steps=2))  # the same run again: taken from the record, still one fit counted
        assert study.progress.fits.n == 2


@dataclass
class Settings:
    steps: int
    rule: Rule
    seeds: list[int] = field(default_factory=lambda: [0])


@pytest.mark.parametrize("data, named", [
    ({"steps": 5, "rule": {"of": "k"}, "bogus": 1}, "bogus"),
    ({"steps": "five", "rule": {"of": "k"}}, "steps"),
    ({"steps": 5, "rule": {"of": "k", "round": "up"}}, "rule"),
    ({"rule": {"of": "k"}}, "steps"),
    ({"steps": 5, "rule": {"of": "k"}, "seeds": ["a"]}, "seeds"),
])
def test_settings_refuse_bad_fields_naming_them(tmp_path, data, named):
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as refused:
        load_settings(path, Settings)
    assert named in refused.value.field + str(refused.value.got), str(refused.value)
    assert str(path) in str(refused.value)


def test_settings_read_typed_values(tmp_path):
    path = tmp_path / "experiment.yaml"
    path.write_text("steps: 5\nrule: {of: k, times: 4, round: ceil}\n")
    settings = load_settings(path, Settings)
    assert settings == Settings(5, Rule(of="k", times=4.0, round="ceil"), [0])
    assert settings.rule.apply(2.2) == 9


def test_a_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "experiment.yaml"
    path.write_text("steps: 5\nrule: {of: k\nseeds: [0]\n")
    with pytest.raises(ConfigError, match=r"line \d+, column \d+") as refused:
        load_settings(path, Settings)
    assert refused.value.field == str(path)


def test_compute_records_a_batched_job_and_counts_its_fits(tmp_path):
    calls = []
    with Study(_args(tmp_path / "s"), "demo", fits=6) as study:
        first = study.compute("batch", {"seeds": [0, 1, 2]}, lambda: calls.append(1) or {"value": 3}, fits=3)
        again = study.compute("batch", {"seeds": [0, 1, 2]}, lambda: calls.append(1) or {"value": 4}, fits=3)
        assert first == again == {"value": 3} and calls == [1] and study.progress.fits.n == 6
