"""Reruns and concurrent runs lose nothing: the Study of an experiment resumes its own folder, writes another
experiment's rerun to a new folder (or, with --overwrite, replaces the old one whole), claims its folder so
that two experiments started together never share one, and every config logs under its own name."""
import argparse
import subprocess
import sys
import time
from pathlib import Path

import yaml

from featlearn.experiments.common import CONFIGS
from featlearn.experiments.study import Run, Study

TINY = {"trainer.max_steps": 2, "data.init_args.num_pretrain": 32}


def files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def study(out: Path, overwrite=False, **options) -> Study:
    return Study(argparse.Namespace(out=out, overwrite=overwrite, threads=1, seed=[0], **options), "test", fits=1)


def fit_into(s: Study) -> None:
    with s:
        s.fit(Run("mrp/teacher_student.yaml", "pretrain", TINY, seed=0))


def test_a_rerun_with_other_options_makes_a_new_folder_and_leaves_the_first_untouched(tmp_path, one_thread):
    first = study(tmp_path / "mrp", knob=1)
    fit_into(first)
    before = files(first.out)
    assert any(name.endswith("config.yaml") for name in before) and any("events" in name for name in before)
    second = study(tmp_path / "mrp", knob=2)      # what `--out runs/mrp` picks for another experiment
    assert second.out == tmp_path / "mrp-2"
    fit_into(second)                              # used to abort in SaveConfigCallback, after a stray events file
    assert files(first.out) == before
    assert study(tmp_path / "mrp", knob=3).out == tmp_path / "mrp-3"


def test_overwrite_replaces_the_old_run_whole(tmp_path, one_thread):
    first = study(tmp_path / "mrp", knob=1)
    fit_into(first)
    (first.out / "stale.md").write_text("from the previous run")
    again = study(tmp_path / "mrp", overwrite=True, knob=1)
    assert again.out == first.out and [p.name for p in again.out.iterdir()] == ["study.lock"]
    fit_into(again)
    assert not (again.out / "stale.md").exists()


HOLD = """
import argparse, sys, time
from featlearn.experiments.study import Study
s = Study(argparse.Namespace(out=sys.argv[1], overwrite=False, threads=1, seed=[0]), "hold", fits=1)
print(s.out, flush=True)
time.sleep(60)
"""


def test_two_experiments_started_together_never_share_a_folder(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "mrp")], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == str(tmp_path / "mrp")   # it holds runs/mrp, still empty
        mine = study(tmp_path / "mrp")                                     # same options, started meanwhile
        assert mine.out == tmp_path / "mrp-2"
    finally:
        other.kill()
        other.wait()
    time.sleep(0.1)
    assert study(tmp_path / "mrp").out == tmp_path / "mrp"  # its lock died with it: the folder is free


def test_every_config_logs_under_its_own_name():
    names = {}
    for path in sorted(CONFIGS.glob("*/*.yaml")):
        logger = (yaml.safe_load(path.read_text()) or {}).get("trainer", {}).get("logger")
        if logger is None:
            continue  # a shared block (data_tiny.yaml), not a run
        names.setdefault(logger["init_args"]["name"], []).append(path.name)
    assert all(len(v) == 1 for v in names.values()), names
    runs = [p for p in CONFIGS.glob("*/*.yaml") if "trainer" in (yaml.safe_load(p.read_text()) or {})]
    assert len(names) == len(runs)


def test_an_out_that_cannot_be_a_folder_is_refused_before_work(tmp_path, capsys):
    import pytest
    from featlearn.experiments.common import experiment_parser, parse_experiment_args
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "file" / "below", Path("/proc/featlearn-x")):
        with pytest.raises(SystemExit) as stop:
            parse_experiment_args(experiment_parser("demo", "runs/demo"), ["--out", str(bad)])
        assert stop.value.code == 2
        assert f"--out: must be a folder featlearn can create and write, got {bad}" in capsys.readouterr().err
