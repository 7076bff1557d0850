"""What a new user meets on the command line: misspelled or abbreviated options are refused with a
suggestion, `featlearn --help` lists every command, a plain run prints where its logs and final checkpoint
went and no warning that does not apply, and an experiment's progress counts fits and their steps."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from featlearn.cli import main, make_cli
from featlearn.experiments.common import FitProgress, build, progress
from tiny_sizes import MRP, PATCHES, SPARSE

ROOT = Path(__file__).resolve().parents[1]
MRP_CONFIG = "configs/mrp/teacher_student.yaml"
TINY = ["--trainer.max_steps", "3", "--data.init_args.num_pretrain", "32"]


@pytest.mark.parametrize("argv, said", [
    (["fit", "--config", MRP_CONFIG, "--trainer.max_step", "5"],
     "unrecognized arguments: --trainer.max_step 5; did you mean --trainer.max_steps?"),
    (["fit", "--config", MRP_CONFIG, "--heatmap.every_n_step", "5"], "did you mean --heatmap.every_n_steps?"),
    (["fit", "--config", MRP_CONFIG, "--trainer.max_stepz", "5"], "did you mean --trainer.max_steps?"),
])
def test_an_abbreviated_or_misspelled_option_is_refused_with_a_suggestion(argv, said, capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        main(argv + ["--trainer.logger.init_args.save_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and said in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # refused before any work


def test_a_misspelled_config_key_gets_a_suggestion(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_stepz: 3\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", MRP_CONFIG, "--config", str(bad)])
    err = capsys.readouterr().err
    assert "trainer.max_stepz" in err and "did you mean --trainer.max_steps?" in err


def test_help_lists_featlearns_own_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("featlearn bench", "featlearn profile", "featlearn gpu", "featlearn.experiments"):
        assert command in out


@pytest.mark.parametrize("config, tiny", [(MRP_CONFIG, MRP), ("configs/contrastive/random_mask.yaml", SPARSE),
                                          ("configs/noncontrastive/with_head.yaml", PATCHES)])
def test_a_plain_fit_says_where_it_wrote_and_warns_nothing(config, tiny, tmp_path):
    # a subprocess: what a user's terminal shows, with Python's default warning filters
    run = subprocess.run([sys.executable, "-m", "featlearn.cli", "fit", "--config", config, "--trainer.max_steps", "3",
                          *tiny, "--trainer.logger.init_args.save_dir", str(tmp_path),
                          "--trainer.enable_progress_bar", "false"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"featlearn: logs in {tmp_path}" in run.stdout and "tensorboard --logdir" in run.stdout
    assert "featlearn: final checkpoint" in run.stdout and "last.ckpt" in run.stdout
    said = run.stdout + run.stderr
    assert not [line for line in said.splitlines() if "warn" in line.lower() or "litlogger" in line], said[-3000:]


def test_experiment_progress_counts_fits_and_their_steps(tmp_path, one_thread):
    seen = []
    for item in progress(["a", "b"], "demo", fits_per_item=2):
        bars = FitProgress.active
        for fit in range(2):
            cli = build("mrp/teacher_student.yaml", tmp_path, f"{item}{fit}", *TINY)
            assert bars in cli.trainer.callbacks
            cli.trainer.fit(cli.model, cli.datamodule)
            seen.append((bars.fits.n, bars.fits.total))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert FitProgress.active is None
    cli = make_cli(["--config", MRP_CONFIG, *TINY, "--trainer.logger", "false"], run=False)
    assert not any(isinstance(c, FitProgress) for c in cli.trainer.callbacks)  # outside an experiment: none
