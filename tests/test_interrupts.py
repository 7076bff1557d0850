"""Ctrl-C on a real ``lightning fit``: the step in progress finishes and is saved as ``last.ckpt`` (issue 22,
section 4), and that checkpoint is the state of an uninterrupted run of as many steps."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from test_bad_inputs import config_path, run_cli

TINY = ["--data.init_args.k", "4", "--data.init_args.d", "16", "--data.init_args.P", "10", "--data.init_args.s", "1",
        "--data.init_args.num_pretrain", "16", "--model.init_args.m", "2", "--model.init_args.backend", "torch",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--checkpoint.every_n_train_steps", "20"]


def test_sigint_saves_the_last_finished_step(tmp_path):
    lightning = Path(sys.executable).parent / "lightning"
    log = tmp_path / "out.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([str(lightning), "fit", "--config", config_path("mrp/teacher_student"), *TINY,
                                 "--trainer.max_steps", "1000000", "--trainer.default_root_dir", str(tmp_path / "run")],
                                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env)
        last = tmp_path / "run" / "checkpoints" / "last.ckpt"
        try:
            deadline = time.monotonic() + 180
            while not last.exists():  # the first periodic save (step 20): training is under way
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
            time.sleep(1.5)  # well past the save, between two periodic saves most likely
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert code != 0 and "Traceback" not in text, text[-3000:]
    said = re.search(r"featlearn: interrupted after step (\d+): (\S+) holds step (\d+)", text)
    assert said, text[-3000:]
    step = int(said.group(1))
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == step == int(said.group(3)) and step > 20, (saved["global_step"], step)

    # the saved state is a whole step: an uninterrupted run of that many steps ends bit-equal
    code, out = run_cli(["fit", "--config", config_path("mrp/teacher_student"), *TINY, "--trainer.max_steps", str(step),
                         "--trainer.default_root_dir", str(tmp_path / "straight")])
    assert code in (0, None), out[-2000:]
    straight = torch.load(tmp_path / "straight" / "checkpoints" / "last.ckpt", weights_only=False)
    assert straight["global_step"] == step
    for key, value in straight["state_dict"].items():
        torch.testing.assert_close(saved["state_dict"][key], value, rtol=0, atol=0, msg=key)


def test_the_launchers_watcher_says_the_lost_rank_line_before_it_kills(monkeypatch, capsys, tmp_path):
    """Rank 0's thread that watches the launched ranks kills every process when one dies, and may do so before
    gloo's error reaches rank 0: it prints the lost-rank line first (the race lost one CI run, 2026-11-28)."""
    from types import SimpleNamespace

    from lightning.fabric.strategies.launchers import subprocess_script
    from featlearn.callbacks import checkpoint

    dead = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    dead.wait()
    callback = checkpoint.FinalCheckpoint(dirpath=tmp_path, save_last=True)
    callback.last_model_path, callback._last_global_step_saved = str(tmp_path / "last.ckpt"), 40
    trainer = SimpleNamespace(global_rank=0, world_size=2, global_step=57)
    monkeypatch.setattr(checkpoint, "_RUNNING", (lambda: callback, lambda: trainer))
    killed = []
    monkeypatch.setattr(subprocess_script.os, "kill", lambda pid, sig: killed.append(pid))
    watcher = subprocess_script._ChildProcessObserver(main_pid=12345, child_processes=[dead])
    assert isinstance(watcher, checkpoint._LostRankObserver)
    assert watcher._run() is True and killed == [12345]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: rank 0: lost rank 1 of 2 during step 58; {tmp_path / 'last.ckpt'} holds step 40"]
