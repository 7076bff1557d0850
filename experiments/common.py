"""What every experiment shares: its command line, building one fit from a YAML config, progress over
fits, and the output files (the table as markdown and JSON, and PNG figures). The runs themselves go
through the one engine, :mod:`featlearn.experiments.study`.

An experiment is a module ``featlearn.experiments.<name>`` with a ``main(argv)``::

    parser = experiment_parser("what it compares", "runs/<name>")
    parser.add_argument(...)                      # its own options
    args = parse_experiment_args(parser, argv)    # --out, --overwrite, --seed S [S ...], --threads
    with Study(args, "seeds", fits=len(args.seed)) as study:
        rows = {seed: study.fit(Run("<method>/<config>.yaml", f"seed{seed}", {...}, seed=seed)) for seed in args.seed}
    study.write("table", rows, markdown, figures={"headline": figure})
"""
import argparse
import contextlib
import io
import json
import logging
import warnings
from pathlib import Path

import torch
import yaml
from lightning.pytorch import Callback
from tqdm.auto import tqdm

from featlearn.cli import FeatlearnCLI, make_cli
from featlearn.errors import ConfigError
from featlearn.metrics.figures import save_png
from featlearn.quiet import quiet_known_noise

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def experiment_parser(description: str, default_out: str) -> argparse.ArgumentParser:
    """The command line every experiment starts from: ``--out DIR``, ``--overwrite``, ``--seed S [S ...]``
    and ``--threads N``. Add the experiment's own options, then call :func:`parse_experiment_args`.

    Example:
        >>> parser = experiment_parser("demo", "runs/demo")
        >>> args = parser.parse_args(["--seed", "0", "1"])
        >>> args.seed, args.threads
        ([0, 1], 1)
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=Path(default_out),
                        help=f"output folder (default {default_out}); if it holds a previous run, a new folder "
                             f"DIR-2, DIR-3, ... is used unless --overwrite is given")
    parser.add_argument("--overwrite", action="store_true", help="delete a previous run in --out first")
    parser.add_argument("--seed", type=checked(int, lambda v: v >= 0, "a non-negative integer"), nargs="+", default=[0],
                        help="one seed or several, distinct (default 0); several give per-seed results and a "
                             "table of mean (min-max)")
    parser.add_argument("--threads", type=checked(int, lambda v: v >= 1, "at least 1"), default=1,
                        help="torch CPU threads (default 1: these sizes run fastest on one thread of a busy "
                             "2-core machine)")
    return parser


def parse_experiment_args(parser: argparse.ArgumentParser, argv=None, check=None) -> argparse.Namespace:
    """Parse, refuse repeated seeds (naming the option), run the experiment's own ``check(parser, args)``
    (which refuses with ``parser.error`` and may add derived values to ``args``) and set the torch thread
    count. The folder to write to is chosen by the :class:`~featlearn.experiments.study.Study`."""
    args = parser.parse_args(argv)
    repeated = sorted({s for s in args.seed if args.seed.count(s) > 1})
    if repeated:
        parser.error(f"--seed: seeds must be distinct, got {repeated} more than once")
    if check is not None:
        check(parser, args)
    out = getattr(args, "out", None)
    if out is not None:
        try:  # a file, /proc/x or a read-only place is refused here, before any work
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / ".featlearn-write-check").touch()
            (Path(out) / ".featlearn-write-check").unlink()
        except OSError as error:
            parser.error(f"--out: must be a folder featlearn can create and write, got {out} ({error.strerror})")
    torch.set_num_threads(args.threads)
    return args


class FitProgress(Callback):
    """Two bars on stderr while an experiment runs: its fits (``total``, counted as each ends) and the
    steps of the fit running. :func:`build` attaches the active one to every trainer it makes.

    Example:
        >>> with FitProgress(2, "demo") as bars:  # the bars go to stderr
        ...     bars.fits.update(2)
        >>> bars.fits.n, FitProgress.active is None
        (2, True)
    """

    active: "FitProgress | None" = None

    def __init__(self, total: int, desc: str, disable: bool = False):
        self.fits = tqdm(total=total, desc=desc, unit="fit", dynamic_ncols=True, disable=disable)
        self.steps = None
        self.disable = disable

    def __enter__(self) -> "FitProgress":
        FitProgress.active = self
        return self

    def __exit__(self, *exc) -> None:
        FitProgress.active = None
        if self.fits.total is not None and self.fits.n != self.fits.total:  # fewer fits than planned
            self.fits.total = self.fits.n
            self.fits.refresh()
        self.fits.close()

    def on_train_start(self, trainer, pl_module) -> None:
        name = getattr(trainer.logger, "name", None) or "fit"
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self.steps = tqdm(total=total, initial=trainer.global_step, desc=f"  {name}", unit="step", leave=False,
                          dynamic_ncols=True, disable=self.disable, mininterval=0.5)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.steps is not None:
            self.steps.update(trainer.global_step - self.steps.n)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.steps is not None:
            self.steps.close()
            self.steps = None
        if self.fits.total is not None and self.fits.n >= self.fits.total:  # more fits than planned
            self.fits.total = self.fits.n + 1
        self.fits.update(1)

    def on_exception(self, trainer, pl_module, exception) -> None:  # a diverged fit ends too
        self.on_train_end(trainer, pl_module)


def progress(items, desc: str, fits_per_item: int = 1):
    """Iterate over an experiment's jobs (seeds, sizes, settings, ...) with a :class:`FitProgress` that
    counts their ``len(items) * fits_per_item`` fits (a job that fits several models says how many)."""
    items = list(items)
    with FitProgress(len(items) * fits_per_item, desc):
        yield from items


def quiet_lightning() -> None:
    """Hide Lightning's start-up banners (an experiment runs many fits) and, beside what every featlearn
    run hides (:func:`featlearn.quiet.quiet_known_noise`), the warnings expected in these experiments."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    quiet_known_noise()
    for message in (".*`weights_only` was not set.*", ".*does not have many workers.*"):
        warnings.filterwarnings("ignore", message=message)


def build(config: str, out: Path, name: str, *overrides: str) -> FeatlearnCLI:
    """Instantiate trainer, model and data from ``configs/<config>`` with TensorBoard logs in ``out/name``."""
    args = ["--config", str(CONFIGS / config), "--trainer.logger.init_args.save_dir", str(out),
            "--trainer.logger.init_args.name", name, "--trainer.logger.init_args.version", "",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            *overrides]
    cli = make_cli(args, run=False)
    if FitProgress.active is not None:
        cli.trainer.callbacks.append(FitProgress.active)
    return cli


def resolved_config(config: str, *overrides: str) -> dict:
    """``configs/<config>`` with command-line ``overrides`` as the CLI composes and type-checks them (data
    presets, ``config:`` bases, dotted keys), without building anything: what ``lightning fit --config ...
    --print_config`` prints. A value the CLI refuses raises :class:`ConfigError` with the CLI's message."""
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        try:
            make_cli(["fit", "--config", str(CONFIGS / config), *overrides, "--print_config"])
        except SystemExit as stop:  # --print_config exits once it has printed; a refusal exits with 2
            if stop.code:
                message = errors.getvalue().strip().splitlines()
                raise ConfigError("settings", f"values the config {config} accepts",
                                  message[-1].removeprefix("error: ") if message else "refused") from None
    return yaml.safe_load(printed.getvalue())


def scalars(metrics: dict) -> dict[str, float]:
    """Scalar entries of a metrics dict (tensors or numbers) as rounded floats."""
    return {k: round(float(v), 4) for k, v in metrics.items()
            if isinstance(v, (int, float)) or (torch.is_tensor(v) and v.numel() == 1)}


def markdown_table(rows: dict[str, dict[str, object]], columns: list[str]) -> str:
    """Rows keyed by setting name, one column per metric."""
    head = "| setting | " + " | ".join(columns) + " |"
    rule = "|---|" + "---|" * len(columns)
    body = ["| " + name + " | " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for name, row in rows.items()]
    return "\n".join([head, rule, *body])


def write_results(out: Path, stem: str, results, table: str, figures: dict | None = None) -> None:
    """Save ``<stem>.md`` (the table), ``<stem>.json`` (``results``) and ``<stem>_<name>.png`` for each
    matplotlib figure in ``figures``, then print the table and what was written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{stem}.md", out / f"{stem}.json"]
    written[0].write_text(table + "\n")
    written[1].write_text(json.dumps(results, indent=2))
    for name, figure in (figures or {}).items():
        written.append(save_png(figure, out / f"{stem}_{name}.png"))
    print(table)
    print("\nwrote " + ", ".join(str(p) for p in written))


def checked(kind, ok, what: str):
    """An argparse ``type``: ``kind(text)`` when ``ok`` of it holds, else an error naming the rule and the value.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> _ = parser.add_argument("--steps", type=checked(int, lambda v: v > 0, "a positive integer"))
        >>> parser.parse_args(["--steps", "3"]).steps
        3
    """
    def parse(text):
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    return parse


def mean_range(values: list, fmt: str = "{:.3f}") -> object:
    """One cell summarising per-seed values: the value itself for one seed, ``mean (min-max)`` for several,
    ``n/a`` where the quantity is undefined (``None``) for any seed.

    Example:
        >>> mean_range([0.5, 1.0])
        '0.750 (0.500-1.000)'
        >>> mean_range([None, 1.0])
        'n/a'
        >>> mean_range([-0.4, -0.2])   # a negative range reads "to", not "--"
        '-0.300 (-0.400 to -0.200)'
    """
    if not values or any(v is None or v == "" or v == "n/a" for v in values):
        return "n/a"
    if len(values) == 1:
        return fmt.format(values[0])
    mean, low, high = sum(values) / len(values), fmt.format(min(values)), fmt.format(max(values))
    return f"{fmt.format(mean)} ({low} to {high})" if min(values) < 0 else f"{fmt.format(mean)} ({low}-{high})"

