"""``featlearn profile``: a ``torch.profiler`` trace of a few training steps of any config.

Usage:
    featlearn profile --config configs/mrp/teacher_student.yaml --steps 10
    featlearn profile --config configs/vit/mae.yaml --steps 5 --skip 2 --out runs/profile_mae \\
        --data.init_args.batch_size 64          # any `lightning fit` override
    tensorboard --logdir runs/profile_mae       # PYTORCH_PROFILER tab (pip install torch-tb-profiler)

The run is the config's own ``lightning fit`` with ``trainer.max_steps = skip + steps``, no checkpoints and
no validation; the trace (``<out>/rank<r>.*.pt.trace.json``, one per rank) also opens in Perfetto
(ui.perfetto.dev) or ``chrome://tracing``. It prints the ops and phases by total CPU time. Phases:
see :class:`featlearn.callbacks.StepProfiler`.
"""
import argparse
import sys
import warnings
from pathlib import Path

from lightning.pytorch.cli import SaveConfigCallback

from featlearn.callbacks import StepProfiler
from featlearn.cli import _refuse, make_cli
from featlearn.errors import ConfigError, DivergenceError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="featlearn profile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a run config (configs/<method>/<run>.yaml)")
    p.add_argument("--steps", type=int, default=10, help="training steps recorded (default 10)")
    p.add_argument("--skip", type=int, default=3,
                   help="steps run first and not recorded: compilation, autotuning, first allocations (default 3)")
    p.add_argument("--out", default="lightning_logs/profile", help="folder of the trace (default lightning_logs/profile)")
    p.add_argument("--rows", type=int, default=20, help="rows of the printed summary (default 20)")
    return p


def main(argv: list[str]) -> None:
    args, overrides = parser().parse_known_args(argv)
    if args.steps < 1:
        _refuse(f"--steps: must be an integer >= 1, got {args.steps}")
    if args.skip < 0:
        _refuse(f"--skip: must be an integer >= 0, got {args.skip}")
    if not Path(args.config).is_file():
        _refuse(f"--config: must be an existing config file, got {args.config!r}")
    profiler = StepProfiler(steps=args.steps, skip=args.skip, out=args.out)
    cli_args = ["--config", args.config, *overrides, "--trainer.max_steps", str(profiler.total_steps),
                "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
                "--trainer.num_sanity_val_steps", "0", "--checkpoint.every_n_train_steps", "0",
                "--checkpoint.save_last", "false"]
    try:
        with warnings.catch_warnings():  # LightningCLI warns when args= and sys.argv are both present
            warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
            cli = make_cli(cli_args, run=False)
        # a profile is not a run to keep: no config.yaml beside it (LightningCLI refuses to overwrite one)
        cli.trainer.callbacks = [c for c in cli.trainer.callbacks if not isinstance(c, SaveConfigCallback)]
        cli.trainer.callbacks.append(profiler)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    except ConfigError as err:
        _refuse(str(err))
    except DivergenceError as err:
        sys.exit(f"diverged: {err}")
    print(profiler.summary(args.rows))
    traces = sorted(Path(args.out).glob("*.pt.trace.json"))
    print(f"trace of {args.steps} steps (after {args.skip} skipped): {traces[-1] if traces else 'none written'}\n"
          f"open it: tensorboard --logdir {args.out} (PYTORCH_PROFILER tab), or ui.perfetto.dev")
