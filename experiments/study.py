"""The one engine every experiment, grid, sweep and bench step case runs through.

* A :class:`Run` is one fit of a YAML config under ``configs/``: the config, its overrides as a dict of
  dotted command-line keys, and a seed. :meth:`Run.resolved` is the config as ``lightning fit --config ...
  --print_config`` composes it (the bench's step cases build their modules from it).
* A :class:`Study` is an experiment's runs: its output folder, progress counted in fits, resumable results
  and divergence handling. Each finished fit's result is kept in ``<out>/study.json``, so the same command
  run again resumes (finished fits are skipped; a fit cut short starts over).
* Points and derived values: :func:`grid` and :func:`zipped` make points from axes; a :class:`Rule` computes
  a per-point value from a swept one (the sweep files' ``derived`` rules). Experiments with a size rule in
  code apply it to their points before making runs.
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
import itertools
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from featlearn.errors import ConfigError, DivergenceError
from featlearn.experiments.common import CONFIGS, FitProgress, build, resolved_config, scalars, write_results
from featlearn.experiments.settings import load_settings

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
        return {**groups, **seeded, **rest}

    def argv(self) -> list[str]:
        return [arg for key, value in self.settings().items() for arg in (f"--{key}", text(value))]

    def resolved(self) -> dict:
        """The config with this run's settings as the CLI composes and type-checks them; a value it refuses
        raises :class:`ConfigError` with the CLI's message."""
        return resolved_config(self.config, *self.argv())

    def spec(self) -> dict:
        """What identifies the run in ``study.json`` (a resumed study refits a run whose spec changed)."""
        return {"config": self.config, "settings": {k: text(v) for k, v in self.settings().items()}}


def final_metrics(cli) -> dict[str, float]:
    """The default result of a fit: the module's ``final_metrics()`` scalars (rounded), and its step count."""
    metrics = getattr(cli.model, "final_metrics", dict)()
    return {**scalars(metrics), "steps": int(cli.trainer.global_step)}


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
        return ``collect(cli)`` (JSON-able; keep there whatever later steps need, such as a checkpoint path).
        ``callbacks`` are added to the run's trainer (a clock the collect then reads, say). A fit the
        divergence guard stops returns ``{"diverged": True, "error": <its first line>}``, merged with
        ``collect(cli)`` when ``collect_diverged``."""
        def fit_now() -> dict:
            shutil.rmtree(self.out / run.name, ignore_errors=True)  # a fit cut short earlier starts over
            cli = build(run.config, self.out, run.name, *run.argv())
            cli.trainer.callbacks.extend(callbacks)
            try:
                cli.trainer.fit(cli.model, cli.datamodule)
            except DivergenceError as error:
                first = str(error).splitlines()[0]
                print(f"{run.name}: {first}")
                return {**(collect(cli) if collect_diverged and collect else {}), "diverged": True, "error": first}
            return collect(cli) if collect is not None else {}
        return self.compute(run.name, run.spec(), fit_now, counted_by_job=True)  # the trainer's FitProgress counts it

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


# ------------------------------------------------------------------------------------------------
# points and derived values
# ------------------------------------------------------------------------------------------------
def grid(**axes) -> list[dict]:
    """Every combination of the axes' values, the last axis fastest.

    Example:
        >>> grid(q=[3], lr_scale=[0.5, 1])
        [{'q': 3, 'lr_scale': 0.5}, {'q': 3, 'lr_scale': 1}]
    """
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


def zipped(**axes) -> list[dict]:
    """The i-th values of every axis together (the axes must have one length).

    Example:
        >>> zipped(d=[32, 64], d1=[256, 512])
        [{'d': 32, 'd1': 256}, {'d': 64, 'd1': 512}]
    """
    lengths = {k: len(v) for k, v in axes.items()}
    if len(set(lengths.values())) > 1:
        raise ConfigError("sweep", "lists of one length (zipped points)", lengths)
    return [dict(zip(axes, combo)) for combo in zip(*axes.values())]


@dataclass(frozen=True)
class Rule:
    """A per-point value from a swept value ``x``: ``times * x**power`` (or ``times * ln x`` with ``log``),
    clamped to ``[at_least, at_most]`` and rounded to an integer (``ceil``, ``floor``, ``nearest``); or
    ``table[x]``.

    Example:
        >>> Rule(of="k", times=4, at_least=256, round="ceil").apply(100)
        400
        >>> Rule(of="k", log=True, times=2.5, at_least=4, round="ceil").apply(16)
        7
        >>> Rule(of="k", table={16: 300, 32: 100}).apply(32)
        100
    """
    of: str
    times: float = 1.0
    power: float = 1.0
    log: bool = False
    at_least: float | None = None
    at_most: float | None = None
    round: Literal["ceil", "floor", "nearest"] | None = None
    table: dict[int, Any] | None = None

    def apply(self, x):
        if self.table is not None:
            return self.table[x]
        value = self.times * (math.log(x) if self.log else x ** self.power)
        if self.at_least is not None:
            value = max(value, self.at_least)
        if self.at_most is not None:
            value = min(value, self.at_most)
        if self.round is not None:
            value = int({"ceil": math.ceil, "floor": math.floor, "nearest": round}[self.round](value))
        return value

    def text(self, name: str) -> str:
        """The rule as a formula, e.g. ``d = max(256, ceil(4 k))``."""
        if self.table is not None:
            return f"{name} = table of {self.of}: " + ", ".join(f"{k}: {v}" for k, v in self.table.items())
        x = self.of
        expr = f"ln {x}" if self.log else (x if self.power == 1 else f"{x}^{self.power:g}")
        expr = expr if self.times == 1 else f"{self.times:g} {expr}"
        if self.round is not None:
            expr = f"{self.round}({expr})"
        if self.at_least is not None:
            expr = f"max({self.at_least:g}, {expr})"
        if self.at_most is not None:
            expr = f"min({self.at_most:g}, {expr})"
        return f"{name} = {expr}"


__all__ = ["Run", "Study", "Rule", "grid", "zipped", "load_settings", "final_metrics", "text", "CONFIGS"]
