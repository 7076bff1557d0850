"""The one engine every experiment, grid, sweep and bench step case runs through.

* A :class:`Run` is one fit of a YAML config under ``configs/``: the config, its overrides as a dict of
  dotted command-line keys, and a seed. :meth:`Run.resolved` is the config as ``lightning fit --config ...
  --print_config`` composes it (the bench's step cases build their modules from it).
* A :class:`Study` is an experiment's runs: its output folder, progress counted in fits, resumable results
  and divergence handling. Each finished fit's result is kept in ``<out>/study.json``, so the same command
  run again resumes (finished fits are skipped; a fit cut short starts over).
* Several seeds of one run train together in one Lightning fit (:meth:`Study.fit_seeds`, ``lightning fit
  --seeds``: :mod:`featlearn.lightning_modules.seeds`); each seed's result is kept as a fit of its own.
* What a collect reads of a finished fit, or of one seed of a stacked one, is a :class:`Fitted`.
* Points and derived values (grids, zipped axes, rules) are in :mod:`featlearn.experiments.points`.
* Typed settings: :func:`load_settings` reads an ``experiment.yaml`` (or a sweep file) into a dataclass with
  jsonargparse, refusing unknown fields and wrong types, naming the field.

Example:
    >>> run = Run("mrp/supervised.yaml", "seed3/supervised", {"model.init_args.lr": 2.0}, seed=3)
    >>> run.argv()  # doctest: +NORMALIZE_WHITESPACE
    ['--seed_everything', '3', '--data.init_args.seed', '3', '--model.init_args.lr', '2.0']

A whole experiment (see ``experiments/universality.py`` for one in full)::

    with Study(args, "seeds", fits=len(args.seed)) as study:  # args: --out, --overwrite, --seed, ... of the experiment
        rows = {seed: study.fit(Run("contrastive/random_mask.yaml", f"seed{seed}", {"trainer.max_steps": 50},
                                    seed=seed), collect=final_metrics)
                for seed in args.seed}
    study.write("demo_table", rows, table_text, figures={"headline": fig})
"""
from __future__ import annotations

import argparse
import fcntl
import functools
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from featlearn.errors import DivergenceError
from featlearn.cli import seeded_text
from featlearn.experiments.common import CONFIGS, FitProgress, build, resolved_config, scalars, write_results
from featlearn.experiments.settings import load_settings
from featlearn.lightning_modules.seed_guard import STEP
from featlearn.metrics.figures import run_folder

SEED_KEYS = ("data.init_args.seed", "model.init_args.seed")
LOCK = "study.lock"  # held by the process writing the folder


def text(value) -> str:
    """A value as the command line takes it: strings and paths as they are, the rest as JSON (``true``,
    ``null``, ``[1, 2]``).

    Example:
        >>> " ".join(text(v) for v in ("online", 0.5, True, None))
        'online 0.5 true null'
        >>> text([1, 2])
        '[1, 2]'
    """
    if isinstance(value, Path):
        return str(value)
    return value if isinstance(value, str) else json.dumps(value)


@functools.lru_cache(maxsize=None)
def _seed_keys(config: str, swapped: tuple) -> tuple[str, ...]:
    resolved = resolved_config(config, *swapped)
    return tuple(key for key in SEED_KEYS if "seed" in (resolved[key.split(".")[0]].get("init_args") or {}))


@dataclass(frozen=True)
class Run:
    """One fit: ``configs/<config>`` with ``overrides`` (dotted command-line keys, applied in order after the
    seed) and ``seed``, which sets ``seed_everything`` and each of ``seed_keys`` (default: the data's ``seed``
    and the model's where its class takes one). Logs go to ``<study out>/<name>``.

    A key without a dot replaces a whole group first (``{"data": "configs/two_layer/data_interval.yaml"}``).
    ``{seed}`` in a method's or data's text value (``model.*``, ``data.*``) is the run's seed (a per-seed
    checkpoint to start from, say), as the CLI reads it (:func:`featlearn.cli.seeded_text`).
    """
    config: str
    name: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = None
    seed_keys: tuple[str, ...] | None = None

    def settings(self) -> dict[str, Any]:
        """Every key this run sets, in command-line order: group files, the seed, then the overrides."""
        groups = {k: v for k, v in self.overrides.items() if "." not in k}
        rest = {k: v for k, v in self.overrides.items() if "." in k}
        seeded = {}
        if self.seed is not None:
            keys = self.seed_keys
            if keys is None:
                keys = _seed_keys(self.config, tuple(a for k, v in groups.items() for a in (f"--{k}", text(v))))
            seeded = {"seed_everything": self.seed, **{k: self.seed for k in keys}}
            rest = {k: seeded_text(k, v, self.seed) for k, v in rest.items()}
        return {**groups, **seeded, **rest}

    def argv(self) -> list[str]:
        return [arg for key, value in self.settings().items() for arg in (f"--{key}", text(value))]

    def resolved(self) -> dict:
        """The config with this run's settings as the CLI composes and type-checks them; a value it refuses
        raises :class:`~featlearn.errors.ConfigError` with the CLI's message."""
        return resolved_config(self.config, *self.argv())

    def spec(self) -> dict:
        """What identifies the run in ``study.json`` (a resumed study refits a run whose spec changed)."""
        return {"config": self.config, "settings": {k: text(v) for k, v in self.settings().items()}}


@dataclass
class Fitted:
    """What a collect reads of one finished fit, or of one seed of several fitted together: the method (``model``,
    that seed's own module), its ``datamodule``, the ``trainer`` that ran it, its final state's ``checkpoint``
    (a ``last.ckpt`` that ``lightning fit --ckpt_path`` resumes and ``reference`` settings start from), the
    optimisation ``steps`` it took, its ``seed`` (the run's), and :meth:`test` and :meth:`validate`. For one seed of
    several the trainer is the stack's: run the test and validation loops through these two, never through
    ``trainer.test(model, ...)`` on the seed's module (whose logs go to the stack)."""
    model: Any
    datamodule: Any
    trainer: Any
    checkpoint: str | None
    steps: int
    seed: int | None
    loop: Callable[[str], dict] = field(repr=False)

    def test(self) -> dict[str, float]:
        """Run the test loop (the method's ``test_step``) and return what it logged, as ``trainer.test`` does."""
        return self.loop("test")

    def validate(self) -> dict[str, float]:
        """Run the validation loop and return what it logged, as ``trainer.validate`` does."""
        return self.loop("validate")

    @staticmethod
    def of_cli(cli, seed: int | None) -> "Fitted":
        trainer = cli.trainer
        saved = trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback is not None else ""
        return Fitted(cli.model, cli.datamodule, trainer, saved or None, int(trainer.global_step), seed,
                      lambda kind: getattr(trainer, kind)(cli.model, cli.datamodule, verbose=False)[0])


def final_metrics(fitted: Fitted) -> dict[str, float]:
    """The default result of a fit: the module's ``final_metrics()`` scalars (rounded), and its step count."""
    metrics = getattr(fitted.model, "final_metrics", dict)()
    return {**scalars(metrics), "steps": fitted.steps}


class Study:
    """An experiment's runs (see the module docstring). ``args`` are :func:`experiment_parser`'s (``out``,
    ``overwrite``, ``seed``, and the experiment's own options, which identify the study for resuming).

    The output folder: a new or empty ``--out``; the same folder when it holds a ``study.json`` of the same
    options (resumed: finished fits are skipped, so ``--seed 0 1 2`` after ``--seed 0`` fits only seeds 1 and
    2); otherwise the first free ``out-2``, ``out-3``, ... (``--overwrite`` empties ``--out``).
    """

    def __init__(self, args: argparse.Namespace, desc: str, fits: int, name: str = "study"):
        self.options = {k: text(v) if isinstance(v, Path) else v for k, v in sorted(vars(args).items())
                        if k not in ("out", "overwrite", "threads", "seed")}
        self.options = json.loads(json.dumps(self.options, default=str))
        self.out = self._folder(Path(args.out), args.overwrite)
        self.path = self.out / f"{name}.json"
        self.state = json.loads(self.path.read_text()) if self.path.is_file() else {
            "options": self.options, "runs": {}}
        self.desc, self.fits, self.progress = desc, fits, None

    def _folder(self, out: Path, overwrite: bool) -> Path:
        """Claim the output folder (see the class docstring) with a lock held until the study ends, so two
        experiments started together never share one: the second takes ``out-2``."""
        chosen, n = out, 1
        while True:
            chosen.mkdir(parents=True, exist_ok=True)
            if self._lock(chosen):
                if overwrite and chosen == out:
                    for entry in chosen.iterdir():
                        if entry.name != LOCK:
                            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                state = chosen / "study.json"
                if state.is_file() and json.loads(state.read_text()).get("options") == self.options:
                    done = len(json.loads(state.read_text())["runs"])
                    print(f"resuming {chosen}: {done} finished fits kept (--overwrite starts afresh)")
                    return chosen
                if all(entry.name == LOCK for entry in chosen.iterdir()):
                    if chosen != out:
                        print(f"{out} holds another run: writing to {chosen} (--overwrite replaces {out})")
                    return chosen
                self._unlock()
            n += 1
            chosen = out.with_name(f"{out.name}-{n}")

    def _lock(self, folder: Path) -> bool:
        handle = open(folder / LOCK, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another living process holds it (a killed one's lock is released by the OS)
            handle.close()
            return False
        self._held = handle
        return True

    def _unlock(self) -> None:
        if getattr(self, "_held", None) is not None:
            self._held.close()  # closing the file releases the lock
            self._held = None

    def __enter__(self) -> "Study":
        self.progress = FitProgress(self.fits, self.desc).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)
        self.progress = None
        self._unlock()

    def fit(self, run: Run, collect: Callable[[Any], dict] | None = final_metrics, callbacks=(),
            collect_diverged: bool = False) -> dict:
        """Fit ``run`` (or take its result from ``study.json`` when a previous invocation finished it) and
        return ``collect(fitted)`` of its :class:`Fitted` (JSON-able; keep there whatever later steps need, such as
        a checkpoint path).
        ``callbacks`` are added to the run's trainer (a clock the collect then reads, say). A fit the
        divergence guard stops returns ``{"diverged": True, "error": <its first line>}``, merged with
        ``collect(fitted)`` when ``collect_diverged``."""
        def fit_now() -> dict:
            shutil.rmtree(self.out / run.name, ignore_errors=True)  # a fit cut short earlier starts over
            cli = build(run.config, self.out, run.name, *run.argv())
            cli.trainer.callbacks.extend(callbacks)
            try:
                cli.trainer.fit(cli.model, cli.datamodule)
            except DivergenceError as error:
                first = str(error).splitlines()[0]
                print(f"{run.name}: {first}")
                kept = collect(Fitted.of_cli(cli, run.seed)) if collect_diverged and collect else {}
                return {**kept, "diverged": True, "error": first}
            return collect(Fitted.of_cli(cli, run.seed)) if collect is not None else {}
        return self.compute(run.name, run.spec(), fit_now, counted_by_job=True)  # the trainer's FitProgress counts it

    def fit_seeds(self, run: Run, seeds: list[int], collect: Callable[[Fitted], dict] = final_metrics) -> dict[int, dict]:
        """``run`` at each of ``seeds``, trained together in one Lightning fit (``lightning fit --seeds``): seed s is
        the fit ``Run(run.config, f"{run.name}/seed_{s}", run.overrides, seed=s)``, kept in ``study.json`` under
        that name, so a resumed study fits only the seeds it lacks. Returns seed -> ``collect(Fitted)``; a seed
        that diverged gets ``{"diverged": True, "error": <why>}`` (the others go on). Logs and each seed's
        ``last.ckpt`` are in ``<out>/<run.name>/seed_<s>``. The first seed's ``test()`` (``validate()``) runs the
        loop for every seed at once, so a collect calls them before it reads what they set on the module."""
        if run.seed is not None or run.seed_keys is not None:
            raise ValueError("fit_seeds takes a run without a seed or seed_keys (each seed sets seed_everything and "
                             f"the data's and the model's seed, as under --seeds), got {run.seed}, {run.seed_keys}")
        runs = {s: Run(run.config, f"{run.name}/seed_{s}", run.overrides, seed=s) for s in seeds}
        todo = [s for s in seeds if self._kept(runs[s]) is None]
        if todo:
            group, kept = self.out / run.name, len(todo) < len(seeds)
            for entry in list(group.iterdir()) if group.is_dir() else []:  # what a stack cut short left behind
                seed = entry.name.removeprefix("seed_")
                if seed.isdigit() and int(seed) in todo or not kept and not seed.isdigit():
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                elif kept and entry.name in ("config.yaml", "hparams.yaml", "checkpoints"):  # rewritten by this fit
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            cli = build(run.config, self.out, run.name, *run.argv(), "--seeds", json.dumps(todo))
            try:
                cli.trainer.fit(cli.model, cli.datamodule)
                every = None
            except DivergenceError as error:
                every = str(error).splitlines()[0]
            stack, tested = cli.model, {}
            for row, seed in enumerate(todo):
                why = stack.guard.stopped.get(row, "")
                if why.startswith("diverged") or (every is not None and not why):
                    fields = " or ".join(f"model.init_args.{f}" for f in stack.members[row].step_size_fields)
                    result = {"diverged": True, "error": f"seed {seed} {why or every}; lower {fields} (its state "
                                                         f"before the damage: seed_{seed}/before_divergence.ckpt)"}
                    print(f"{runs[seed].name}: {result['error']}")
                else:
                    result = collect(_seed_fitted(cli, row, tested))
                self.state["runs"][runs[seed].name] = {"run": runs[seed].spec(), "result": result}
                self.save()
        if self.progress is not None:  # the trainer's FitProgress counted the stack as one fit
            self.progress.fits.update(len(seeds) - (1 if todo else 0))
        return {s: self.state["runs"][runs[s].name]["result"] for s in seeds}

    def _kept(self, run: Run) -> dict | None:
        """The result ``study.json`` keeps for ``run``, or None (never fitted, or fitted with other settings)."""
        done = self.state["runs"].get(run.name)
        return done["result"] if done is not None and done["run"] == run.spec() else None

    def compute(self, name: str, spec: dict, job: Callable[[], dict], fits: int = 1,
                counted_by_job: bool = False) -> dict:
        """``job()`` (JSON-able), or its result kept in ``study.json`` by a previous invocation with the same
        ``spec``; counts ``fits`` on the progress bar (unless the job, having run, counted itself).
        :meth:`fit` is this for one Lightning fit; an experiment that simulates many fits at once in a batch
        (the non-contrastive population runs) records the batch with it."""
        done = self.state["runs"].get(name)
        ran = done is None or done["run"] != spec
        if ran:
            self.state["runs"][name] = {"run": spec, "result": job()}
            self.save()
        if self.progress is not None and not (ran and counted_by_job):
            self.progress.fits.update(fits)
        return self.state["runs"][name]["result"]

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.state, indent=2, default=str))
        tmp.replace(self.path)  # a study killed mid-write keeps its previous results

    def write(self, stem: str, results, table: str, figures: dict | None = None) -> None:
        """The experiment's outputs: ``<stem>.md``, ``<stem>.json`` and PNGs (see :func:`write_results`)."""
        write_results(self.out, stem, results, table, figures)


def _seed_fitted(cli, row: int, tested: dict) -> Fitted:
    """Seed row ``row`` of a stacked fit; ``tested`` keeps one test (validation) of the stack for every seed."""
    stack, data, trainer = cli.model, cli.datamodule, cli.trainer
    held = stack.guard.snapshots[row] if row in stack.guard.stopped else None  # a seed its method stopped early
    steps = int(held[STEP]) if held is not None else int(trainer.global_step)

    def loop(kind: str) -> dict:
        if kind not in tested:  # one test (or validation) of the whole stack; each seed reads its own logs
            with stack.logs.fresh() as logged:
                getattr(trainer, kind)(stack, data, verbose=False)
            tested[kind] = logged
        stack.logs.last[row].update(tested[kind][row])  # from now on this seed's logs hold them, as one run's would
        return dict(tested[kind][row])

    checkpoint = Path(run_folder(trainer)) / f"seed_{stack.seeds[row]}" / "last.ckpt"
    return Fitted(stack.members[row], data.members[row], trainer, str(checkpoint), steps, stack.seeds[row], loop)


__all__ = ["Run", "Study", "Fitted", "load_settings", "final_metrics", "text", "CONFIGS"]
