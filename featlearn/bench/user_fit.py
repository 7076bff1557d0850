"""The step a user gets: ``lightning fit`` of a method's step case, run as a user runs it, timed from its own logs.

``featlearn bench step --fit`` adds a ``lightning fit`` variant to each step case: the case's config (its main
job; non-contrastive population mode: ``with_head_population.yaml``) with the case's data and model settings,
fitted on the CPU by the ``lightning`` command in a process of its own with everything a run has (progress bar,
TensorBoard logger, checkpoints, divergence guard, heat maps, validation when it falls due). Its step time is
read from the wall times of the run's ``train/loss`` events: each interval between two logged steps after the
first :data:`SKIP` steps (start-up, the first compile or autotune) divided by its steps. So the variant's
speed-ups against the plain loops, and its ratio to the ``featlearn`` variant (the step inside a bare
Trainer), say what the command line adds.

Example:
    >>> argv = fit_argv("mrp/teacher_student.yaml", {"k": 4}, {"lr": 0.5}, steps=300, out="/tmp/x")
    >>> " ".join(argv[:5]), " ".join(argv[-4:])
    ('fit --config configs/mrp/teacher_student.yaml --trainer.max_steps 300', '--data.init_args.k 4 --model.init_args.lr 0.5')
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from featlearn.bench.step_methods import MAIN_JOBS
from featlearn.experiments.common import CONFIGS
from featlearn.experiments.study import text

SKIP = 50
"""Steps left out at the start of the run (process start, building, the first steps' one-off costs)."""
INTERVALS = 6
"""Logged intervals timed at least (the run is ``SKIP + INTERVALS * log_every_n_steps`` steps, 300 at least)."""


def config_of(case: str) -> str:
    """The config a step case's ``lightning fit`` starts from (its main job's)."""
    return {"noncontrastive sample": MAIN_JOBS["noncontrastive"],
            "noncontrastive population": "noncontrastive/with_head_population.yaml"}.get(case) or MAIN_JOBS[case]


def fit_argv(config: str, data: dict, model: dict, steps: int, out: str) -> list[str]:
    """``lightning`` arguments: ``configs/<config>`` with ``data`` and ``model`` init arguments set, ``steps`` steps,
    TensorBoard logs in ``out``."""
    settings = [*[(f"data.init_args.{k}", v) for k, v in data.items()],
                *[(f"model.init_args.{k}", v) for k, v in model.items()]]
    return ["fit", "--config", f"configs/{config}", "--trainer.max_steps", str(steps), "--trainer.accelerator", "cpu",
            "--trainer.logger.init_args.save_dir", out, "--trainer.logger.init_args.version", "fit",
            *[a for key, value in settings for a in (f"--{key}", text(value))]]


def fit_step_seconds(config: str, data: dict, model: dict, log_every: int, threads: int = 0) -> list[float]:
    """Per-step seconds of each logged interval after :data:`SKIP` of a ``lightning fit`` (see the module
    docstring) in a fresh process, with ``threads`` torch threads (0: torch's default)."""
    steps = max(300, SKIP + INTERVALS * log_every)
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "-m", "featlearn.cli", *fit_argv(config, data, model, steps, out)]
        done = subprocess.run(argv, cwd=CONFIGS.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"lightning fit of {config} failed: {done.stderr.strip().splitlines()[-1:]}")
        events = next(Path(out).rglob("events.out.tfevents.*"), None)
        if events is None:
            raise RuntimeError(f"lightning fit of {config} wrote no TensorBoard events (is its logger off?)")
        scalars = EventAccumulator(str(events.parent), size_guidance={"scalars": 0}).Reload().Scalars("train/loss")
    logged = [(e.step, e.wall_time) for e in scalars if e.step >= SKIP]
    return [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(logged, logged[1:]) if s1 > s0]
