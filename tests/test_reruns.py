"""Reruns and concurrent runs lose nothing: an experiment rerun goes to a new folder (or, with
--overwrite, replaces the old one whole), and every config logs under its own name."""
from pathlib import Path

import yaml

from featlearn.experiments.common import CONFIGS, build, output_dir

TINY = ["--trainer.max_steps", "2", "--data.init_args.num_pretrain", "32"]


def files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def fit_into(out: Path) -> None:
    cli = build("mrp/teacher_student.yaml", out, "pretrain", *TINY)
    cli.trainer.fit(cli.model, cli.datamodule)


def test_rerun_makes_a_new_folder_and_leaves_the_first_untouched(tmp_path, one_thread):
    first = output_dir(tmp_path / "mrp")
    fit_into(first)
    before = files(first)
    assert any(name.endswith("config.yaml") for name in before) and any("events" in name for name in before)
    second = output_dir(tmp_path / "mrp")        # what `--out runs/mrp` picks on the second run
    assert second == tmp_path / "mrp-2"
    fit_into(second)                             # used to abort in SaveConfigCallback, after a stray events file
    assert files(first) == before
    assert output_dir(tmp_path / "mrp") == tmp_path / "mrp-3"


def test_overwrite_replaces_the_old_run_whole(tmp_path, one_thread):
    first = output_dir(tmp_path / "mrp")
    fit_into(first)
    (first / "stale.md").write_text("from the previous run")
    again = output_dir(tmp_path / "mrp", overwrite=True)
    assert again == first and not any(again.iterdir())
    fit_into(again)
    assert not (again / "stale.md").exists()


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
