"""Sweeps: one run of a config per point of a swept key (k, d, K, P, ...), with the method's theory metrics and
the cost of a training step at every point, a summary table, a PNG and the growth exponent of the cost.

    python -m featlearn.experiments.sweep --config configs/large_k/mrp_k_cpu.yaml            # seeds of the file
    python -m featlearn.experiments.sweep --config configs/large_k/mrp_k_cpu.yaml --seed 0 1 # these seeds
    python -m featlearn.experiments.sweep --config ... --out runs/x --overwrite              # start afresh

A sweep file (``configs/large_k/*.yaml``) names a base run config and what changes per point::

    base: mrp/teacher_student.yaml        # a run config under configs/
    sweep:                                # swept dotted CLI keys and their values (zipped; grid: product)
      data.init_args.k: [16, 32, 64]
    derived:                              # per-point values from a swept key, by a rule (no code per method)
      data.init_args.d: {of: k, times: 4, at_least: 256, round: ceil}          # d = max(256, 4 k)
      model.init_args.m: {of: k, log: true, times: 2.5, at_least: 4, round: ceil}
      trainer.max_steps: {of: k, table: {16: 300, 32: 300, 64: 100}}          # or an explicit table
    overrides: {data.init_args.mode: online}   # the same at every point
    steps: 300                            # trainer.max_steps of every point (a derived rule may replace it)
    timed_after: 3                        # steps not timed (first allocations, compilation)
    seeds: [0]                            # --seed overrides; each seed sets seed_everything and seed_keys
    metrics: [frac_captured, first_capture/max]   # keys of the module's final_metrics() to tabulate
    cost_model: [data.init_args.k, model.init_args.m, data.init_args.d, data.init_args.P]  # FLOPs ~ product (key^2: squared)

A rule is ``times * x**power`` (or ``times * ln x`` with ``log: true``) of the swept value ``x`` named by
``of`` (the dotted key or its last part), clamped to ``[at_least, at_most]`` and rounded (``ceil``, ``floor``,
``nearest``: an integer); or ``table: {x: value}`` covering every swept value. The whole file is checked
before any run, naming the field: unknown fields and keys (every dotted key must exist in the base config as
``--print_config`` resolves it), empty or repeated values, rules naming no swept key, and every point's values
against the config's types.

Each point (and seed) is built through the featlearn CLI (:func:`featlearn.experiments.common.build`) with
TensorBoard logs under ``--out/<point>/s<seed>``; after it finishes its row is appended to ``--out/sweep.json``,
so the same command resumes a half-finished sweep (finished points are skipped; a point cut short is rerun
from its start). A sweep file that differs from the one ``sweep.json`` was started with is refused;
``--overwrite`` starts afresh.

Cost per point: the time of a training step from the Trainer's ``on_train_batch_start`` to its
``on_train_batch_end`` (forward, loss, backward, optimizer step and the method's step-finishing work; the batch
is made before), median over the steps after ``timed_after``; peak memory with the bench harness's rules
(:mod:`featlearn.bench.harness`): on CUDA ``max_memory_allocated`` over a step less what was allocated before
it, the largest over the timed steps; on CPU the growth of the peak resident set over the last step, measured
on that step alone (not timed) with glibc made to return freed tensors (n/a if the run stopped early).

Summary (``sweep.md``, ``sweep.json``, ``sweep_summary.png``): per point the swept and derived values, the
metrics, the steps run, ms per step, peak MiB, wall seconds (``mean (min-max)`` over seeds); the growth
exponent of the time per step against the first swept key (least squares in log-log, over all points and
over the larger half), printed beside the exponent of the FLOP model (the product of the ``cost_model``
values of each point, fitted the same way).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import lightning as L
import torch
import yaml

from featlearn.bench import harness
from featlearn.bench.harness import Meter
from featlearn.errors import ConfigError, DivergenceError
from featlearn.experiments.common import (CONFIGS, build, experiment_parser, markdown_table, mean_range, progress,
                                         quiet_lightning, resolved_config, write_results)

ROUNDING = ("ceil", "floor", "nearest")


# ------------------------------------------------------------------------------------------------
# the sweep file
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """A per-point value computed from a swept value ``x`` (see the module docstring).

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
    round: str | None = None
    table: dict | None = None

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


@dataclass(frozen=True)
class Sweep:
    base: str
    sweep: dict
    steps: int
    metrics: list
    grid: str = "zip"
    derived: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)
    timed_after: int = 3
    seeds: list = field(default_factory=lambda: [0])
    seed_keys: list = field(default_factory=lambda: ["data.init_args.seed"])
    cost_model: list = field(default_factory=list)
    description: str = ""

    @property
    def keys(self) -> list[str]:
        return list(self.sweep)

    def points(self) -> list[dict]:
        """The swept values of every point, in file order (``zip``) or as their product (``product``)."""
        values = list(self.sweep.values())
        combos = zip(*values) if self.grid == "zip" else itertools.product(*values)
        return [dict(zip(self.keys, combo)) for combo in combos]

    def name(self, point: dict) -> str:
        """``k=16`` or ``d=32_d1=256``: the last part of each swept key and its value (a folder name)."""
        return "_".join(f"{key.rsplit('.', 1)[-1]}={_text(v)}" for key, v in point.items())

    def settings(self, point: dict) -> dict:
        """Every dotted key this point sets: the fixed overrides, ``steps``, the swept values and the derived ones."""
        out = {**self.overrides, "trainer.max_steps": self.steps, **point}
        for key, rule in self.derived.items():
            out[key] = rule.apply(point[self.swept_key(rule.of)])
        return out

    def swept_key(self, name: str) -> str:
        return name if name in self.sweep else next(k for k in self.sweep if k.rsplit(".", 1)[-1] == name)

    def as_json(self) -> dict:
        """The file's content, normalised (what ``sweep.json`` stores to recognise the same sweep)."""
        return json.loads(json.dumps(asdict(self), default=str))


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _refuse(field_name: str, allowed: str, got) -> None:
    raise ConfigError(field_name, allowed, got)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rule(name: str, spec, swept: dict) -> Rule:
    where = f"derived.{name}"
    if not isinstance(spec, dict):
        _refuse(where, "a rule {of: KEY, times, power, log, at_least, at_most, round} or {of: KEY, table: {...}}",
                spec)
    unknown = set(spec) - {f.name for f in fields(Rule)}
    if unknown:
        _refuse(f"{where}.{sorted(unknown)[0]}", f"one of {[f.name for f in fields(Rule)]}", sorted(unknown)[0])
    short = {k.rsplit(".", 1)[-1]: k for k in swept}
    of = spec.get("of")
    if of not in swept and of not in short:
        _refuse(f"{where}.of", f"a swept key ({', '.join(swept)}) or its last part ({', '.join(short)})", of)
    for num in ("times", "power", "at_least", "at_most"):
        if num in spec and spec[num] is not None and not _number(spec[num]):
            _refuse(f"{where}.{num}", "a finite number", spec[num])
    if "log" in spec and not isinstance(spec["log"], bool):
        _refuse(f"{where}.log", "true or false", spec["log"])
    if spec.get("round") is not None and spec["round"] not in ROUNDING:
        _refuse(f"{where}.round", f"one of {ROUNDING} or null", spec["round"])
    values = swept[of if of in swept else short[of]]
    if spec.get("table") is not None:
        table = spec["table"]
        if not isinstance(table, dict) or set(spec) - {"of", "table"}:
            _refuse(f"{where}.table", "a mapping {swept value: value}, alone beside 'of'", table)
        missing = [v for v in values if v not in table]
        if missing:
            _refuse(f"{where}.table", f"an entry for every swept value of {of} (missing {missing})", list(table))
    else:
        positive = spec.get("log") or not float(spec.get("power", 1)).is_integer()  # ln x, x^0.5: x > 0
        bad = [v for v in values if not _number(v) or (positive and v <= 0)]
        if bad:
            _refuse(f"derived.{name}.of", f"a key with positive numeric values for this rule (got {bad} in it)", of)
    return Rule(**spec)


def parse_sweep(data) -> Sweep:
    """A :class:`Sweep` from a parsed sweep file; every problem is a :class:`ConfigError` naming the field.

    Example:
        >>> parse_sweep({"base": "mrp/teacher_student.yaml", "sweep": {"data.init_args.k": []}, "steps": 5,
        ...              "metrics": ["frac_captured"]})
        Traceback (most recent call last):
        featlearn.errors.ConfigError: sweep.data.init_args.k: must be a non-empty list of distinct values, got []
    """
    if not isinstance(data, dict):
        _refuse("sweep file", "a mapping of fields (base, sweep, steps, metrics, ...)", data)
    names = [f.name for f in fields(Sweep)]
    for key in data:
        if key not in names:
            _refuse(str(key), f"a field of a sweep file ({', '.join(names)})", key)
    for key in ("base", "sweep", "steps", "metrics"):
        if key not in data:
            _refuse(key, "given (required field)", None)
    base = data["base"]
    if not isinstance(base, str) or not base.endswith(".yaml") or not (CONFIGS / base).is_file():
        _refuse("base", f"a run config under {CONFIGS} such as mrp/teacher_student.yaml", base)
    if (CONFIGS / base).name.startswith(("data_", "experiment")):
        _refuse("base", "a run config (not a data preset or experiment settings)", base)
    swept = data["sweep"]
    if not isinstance(swept, dict) or not swept:
        _refuse("sweep", "a non-empty mapping {dotted.key: [values]}", swept)
    for key, values in swept.items():
        if not isinstance(values, list) or not values or len({_text(v) for v in values}) != len(values):
            _refuse(f"sweep.{key}", "a non-empty list of distinct values", values)
    grid = data.get("grid", "zip")
    if grid not in ("zip", "product"):
        _refuse("grid", "'zip' (the i-th values together) or 'product' (every combination)", grid)
    if grid == "zip" and len({len(v) for v in swept.values()}) > 1:
        _refuse("sweep", "lists of one length with grid: zip", {k: len(v) for k, v in swept.items()})
    shorts = [k.rsplit(".", 1)[-1] for k in swept]
    if len(set(shorts)) != len(shorts):
        _refuse("sweep", "keys whose last parts differ (they name the points)", list(swept))
    derived = data.get("derived") or {}
    if not isinstance(derived, dict):
        _refuse("derived", "a mapping {dotted.key: rule}", derived)
    rules = {key: _rule(key, spec, swept) for key, spec in derived.items()}
    overrides = data.get("overrides") or {}
    if not isinstance(overrides, dict):
        _refuse("overrides", "a mapping {dotted.key: value}", overrides)
    steps, timed_after = data["steps"], data.get("timed_after", 3)
    if not isinstance(timed_after, int) or isinstance(timed_after, bool) or timed_after < 0:
        _refuse("timed_after", "an integer >= 0", timed_after)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < timed_after + 2:
        _refuse("steps", f"an integer >= timed_after + 2 = {timed_after + 2} (timed steps and a memory step)", steps)
    seeds = data.get("seeds", [0])
    if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        _refuse("seeds", "a non-empty list of distinct integers >= 0", seeds)
    for key in ("metrics", "seed_keys", "cost_model"):
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) or len(set(value)) != len(value):
            _refuse(key, "a list of distinct names", value)
    for term in data.get("cost_model", []):
        power = term.partition("^")[2]
        try:
            float(power or 1)
        except ValueError:
            _refuse("cost_model", "dotted keys, each optionally with a power (data.init_args.P^2)", term)
    if not data["metrics"]:
        _refuse("metrics", "a non-empty list of final_metrics() keys", data["metrics"])
    clash = (set(swept) & (set(rules) | set(overrides))) | (set(rules) & set(overrides))
    if clash:
        _refuse("derived", "keys set once (swept, derived or overrides, not two of them)", sorted(clash))
    description = data.get("description", "")
    if not isinstance(description, str):
        _refuse("description", "a string", description)
    return Sweep(base=base, sweep=swept, steps=steps, metrics=list(data["metrics"]), grid=grid, derived=rules,
                 overrides=overrides, timed_after=timed_after, seeds=list(seeds),
                 seed_keys=list(data.get("seed_keys", ["data.init_args.seed"])),
                 cost_model=list(data.get("cost_model", [])), description=description)


def load_sweep(path: Path) -> Sweep:
    """Read and check a sweep file (structure only; :func:`resolve_points` checks it against the base config)."""
    path = Path(path)
    if not path.is_file():
        _refuse("--config", "a sweep file (configs/large_k/*.yaml)", str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        _refuse("--config", "valid YAML", f"{path}: {str(err).splitlines()[0]}")
    return parse_sweep(data)


def _lookup(config: dict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def _cli_args(settings: dict) -> list[str]:
    return [arg for key, value in settings.items() for arg in (f"--{key}", _text(value))]


def resolve(base: str, settings: dict) -> dict:
    """``configs/<base>`` with ``settings`` (dotted keys) as the CLI composes and type-checks them, without
    building anything; a value the CLI refuses raises ConfigError with its message."""
    return resolved_config(base, *_cli_args(settings))


def resolve_points(sweep: Sweep, seeds: list[int]) -> dict[str, dict]:
    """Check every dotted key against the base config and every point's values against its types; return
    each point's resolved config (its cost-model and derived values are read from there)."""
    base = resolve(sweep.base, {})
    groups = [("sweep", sweep.sweep), ("derived", sweep.derived), ("overrides", sweep.overrides),
              ("seed_keys", sweep.seed_keys), ("cost_model", [cost_term(t)[0] for t in sweep.cost_model])]
    for group, keys in groups:
        for key in keys:
            try:
                _lookup(base, key)
            except KeyError:
                _refuse(f"{group}.{key}" if group in ("sweep", "derived", "overrides") else group,
                        f"a dotted key of {sweep.base} (see lightning fit --config configs/{sweep.base} --print_config)",
                        key)
    resolved = {}
    for point in sweep.points():
        name = sweep.name(point)
        settings = {**sweep.settings(point), **{k: seeds[0] for k in sweep.seed_keys}}
        try:
            resolved[name] = resolve(sweep.base, settings)
        except ConfigError as err:
            raise ConfigError(f"point {name}", f"values the config {sweep.base} accepts", err.got) from None
    return resolved


# ------------------------------------------------------------------------------------------------
# one run: its cost
# ------------------------------------------------------------------------------------------------
class StepClock(L.Callback):
    """Times training steps (``on_train_batch_start`` -> ``on_train_batch_end``) after the first ``skip``, and
    measures the peak memory of a step (see the module docstring): on CUDA over every timed step, on CPU on the
    last planned step alone (``last``), which is then not timed.

    Example:
        >>> clock = StepClock(skip=2, last=9, device=torch.device("cpu"))
        >>> clock.seconds, clock.peak_bytes
        ([], None)
    """

    def __init__(self, skip: int, last: int, device: torch.device):
        self.skip, self.last, self.device = skip, last, device
        self.seconds: list[float] = []
        self.peak_bytes: int | None = None
        self.meter, self.index, self.growth = None, 0, harness.ResidentGrowth()

    def _memory_step(self) -> bool:
        return self.device.type == "cpu" and self.index == self.last and self.growth.available

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.index = trainer.global_step
        if self._memory_step():
            self.growth.start()
        self.meter = Meter(self.device).__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.meter.__exit__(None, None, None)
        if self._memory_step():
            grown = self.growth.stop()  # glibc back to its steady state for the next point's timed steps
            if grown is not None:
                self.peak_bytes = grown
            return
        if self.index >= self.skip:
            self.seconds.append(self.meter.seconds)
            if self.meter.peak_bytes is not None:
                self.peak_bytes = max(self.peak_bytes or 0, self.meter.peak_bytes)


def _metric_value(value):
    value = float(value)
    return round(value, 6) if math.isfinite(value) else None


def run_point(sweep: Sweep, point: dict, seed: int, out: Path) -> dict:
    """Fit one point with one seed; its row (values, metrics, cost)."""
    name = sweep.name(point)
    folder = out / name
    shutil.rmtree(folder / f"s{seed}", ignore_errors=True)  # a point cut short earlier starts over
    settings = {**sweep.settings(point), **{k: seed for k in sweep.seed_keys}}
    start = time.perf_counter()
    cli = build(sweep.base, folder, f"s{seed}", "--seed_everything", str(seed), *_cli_args(settings))
    device = cli.trainer.strategy.root_device
    max_steps = cli.trainer.max_steps
    clock = StepClock(sweep.timed_after, max_steps - 1, device)
    cli.trainer.callbacks.append(clock)
    row = {"point": name, "seed": seed, "values": point, "settings": settings, "device": _device_name(device),
           "threads": torch.get_num_threads()}
    try:
        cli.trainer.fit(cli.model, cli.datamodule)
        final = cli.model.final_metrics()
        row["diverged"] = False
    except DivergenceError as err:
        print(f"{name} s{seed}: {str(err).splitlines()[0]}")
        final, row["diverged"] = {}, True
    row["metrics"] = {m: _metric_value(final[m]) if m in final else None for m in sweep.metrics}
    row["steps"] = int(cli.trainer.global_step)
    row["time_per_step_ms"] = round(1e3 * statistics.median(clock.seconds), 4) if clock.seconds else None
    row["timed_steps"] = len(clock.seconds)
    row["peak_mib"] = None if clock.peak_bytes is None else round(clock.peak_bytes / 2 ** 20, 2)
    row["wall_s"] = round(time.perf_counter() - start, 2)
    return row


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ------------------------------------------------------------------------------------------------
# summary
# ------------------------------------------------------------------------------------------------
def growth_exponent(xs, ys) -> float | None:
    """Least-squares slope of ``log y`` against ``log x`` (None without two distinct positive x values).

    Example:
        >>> round(growth_exponent([16, 32, 64], [3 * 16 ** 2.5, 3 * 32 ** 2.5, 3 * 64 ** 2.5]), 6)
        2.5
    """
    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    if len({p[0] for p in pairs}) < 2:
        return None
    mx = sum(p[0] for p in pairs) / len(pairs)
    my = sum(p[1] for p in pairs) / len(pairs)
    return sum((a - mx) * (b - my) for a, b in pairs) / sum((a - mx) ** 2 for a, _ in pairs)


def cost_term(term: str) -> tuple[str, float]:
    """A ``cost_model`` entry, ``key`` or ``key^power``, as (key, power).

    Example:
        >>> cost_term("data.init_args.P^2")
        ('data.init_args.P', 2.0)
    """
    key, _, power = term.partition("^")
    return key, float(power) if power else 1.0


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarise(sweep: Sweep, rows: list[dict], resolved: dict[str, dict]) -> dict:
    """Per point: values, cost-model factors, metrics and cost over seeds; the growth exponents."""
    key = sweep.keys[0]
    short = key.rsplit(".", 1)[-1]
    points, per_point = [], {}
    for point in sweep.points():
        name = sweep.name(point)
        mine = [r for r in rows if r["point"] == name]
        if not mine:
            continue
        config = resolved.get(name, {})
        terms = [cost_term(t) for t in sweep.cost_model]
        factors = {k: _lookup(config, k) for k, _ in terms} if config else {}
        flops = (math.prod(factors[k] ** p for k, p in terms)
                 if terms and all(_number(factors.get(k)) for k, _ in terms) else None)
        per_point[name] = {"x": point[key], "flops_model": flops, "rows": mine,
                           "time_per_step_ms": _mean([r["time_per_step_ms"] for r in mine]),
                           "peak_mib": _mean([r["peak_mib"] for r in mine]), "factors": factors}
        points.append(name)
    xs = [per_point[p]["x"] for p in points]
    fit = {}
    half = points[-max(2, math.ceil(len(points) / 2)):]
    for label, names in (("all", points), ("larger half", half))[:1 if half == points else 2]:
        fit[label] = {
            "points": names,
            "measured": growth_exponent([per_point[p]["x"] for p in names], [per_point[p]["time_per_step_ms"] for p in names]),
            "expected": growth_exponent([per_point[p]["x"] for p in names], [per_point[p]["flops_model"] for p in names]),
        }
    return {"against": short, "x": xs, "points": per_point, "fit": fit}


def _fmt_exp(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def exponent_lines(sweep: Sweep, summary: dict) -> list[str]:
    """One line per fit: the measured growth exponent of the time per step beside the FLOP model's."""
    x = summary["against"]
    model = " * ".join(t.rsplit(".", 1)[-1] for t in sweep.cost_model) or "(no cost_model)"
    lines = []
    for label, fit in summary["fit"].items():
        lines.append(f"time per step ~ {x}^{_fmt_exp(fit['measured'])} (least squares in log-log over {label} "
                     f"points: {', '.join(fit['points'])}); FLOP model {model} ~ {x}^{_fmt_exp(fit['expected'])} "
                     f"over the same points")
    return lines


def table(sweep: Sweep, summary: dict) -> str:
    """Markdown: one row per point; cells are ``mean (min-max)`` over seeds."""
    shown = [*sweep.keys, *[k for k in sweep.derived if k not in sweep.keys],
             *dict.fromkeys(k for k, _ in map(cost_term, sweep.cost_model) if k not in sweep.keys and k not in sweep.derived)]
    columns = [k.rsplit(".", 1)[-1] for k in shown] + list(sweep.metrics) + ["steps", "ms / step", "peak MiB",
                                                                            "wall s", "seeds"]
    body = {}
    for name, p in summary["points"].items():
        rows = p["rows"]
        first = rows[0]
        values = {}
        for k in shown:
            v = first["settings"].get(k, p["factors"].get(k))
            values[k.rsplit(".", 1)[-1]] = "" if v is None else (f"{v:.4g}" if isinstance(v, float) else v)
        for m in sweep.metrics:
            values[m] = mean_range([r["metrics"].get(m) for r in rows], "{:.4g}")
        values["steps"] = mean_range([r["steps"] for r in rows], "{:.0f}")
        values["ms / step"] = mean_range([r["time_per_step_ms"] for r in rows], "{:.2f}")
        values["peak MiB"] = mean_range([r["peak_mib"] for r in rows], "{:.1f}")
        values["wall s"] = mean_range([r["wall_s"] for r in rows], "{:.1f}")
        values["seeds"] = ", ".join(str(r["seed"]) + (" (diverged)" if r.get("diverged") else "") for r in rows)
        body[name] = values
    return markdown_table(body, columns)


def figure(sweep: Sweep, summary: dict):
    """Theory metrics against the swept value (log x) and the cost against it (log-log, with the fitted slope
    and the FLOP model's slope through the largest point)."""
    import matplotlib.pyplot as plt

    x_name = summary["against"]
    n = len(sweep.metrics) + 2
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n, 3.4), constrained_layout=True)
    pts = list(summary["points"].values())
    xs = [p["x"] for p in pts]
    numeric = all(_number(x) and x > 0 for x in xs)
    for ax, metric in zip(axes, sweep.metrics):
        for p in pts:
            ys = [r["metrics"].get(metric) for r in p["rows"]]
            ax.scatter([p["x"]] * len(ys), [y if y is not None else float("nan") for y in ys], color="C0", alpha=0.4, s=12)
        ax.plot(xs, [_mean([r["metrics"].get(metric) for r in p["rows"]]) or float("nan") for p in pts], "o-", color="C0")
        ax.set(xlabel=x_name, ylabel=metric, title=metric)
    t_ax, m_ax = axes[-2], axes[-1]
    times = [p["time_per_step_ms"] or float("nan") for p in pts]
    t_ax.plot(xs, times, "o-", color="C1", label="measured")
    fit = summary["fit"]["all"]
    if numeric and fit["expected"] is not None and pts[-1]["time_per_step_ms"]:
        x1, y1 = xs[-1], pts[-1]["time_per_step_ms"]
        t_ax.plot(xs, [y1 * (x / x1) ** fit["expected"] for x in xs], "--", color="grey",
                  label=f"FLOP model slope {fit['expected']:.2f}")
    if fit["measured"] is not None:
        t_ax.plot([], [], " ", label=f"fitted slope {fit['measured']:.2f}")
    t_ax.set(xlabel=x_name, ylabel="ms per training step", title="time per step")
    t_ax.legend(fontsize=8)
    m_ax.plot(xs, [p["peak_mib"] or float("nan") for p in pts], "o-", color="C2")
    m_ax.set(xlabel=x_name, ylabel="peak MiB", title="peak memory of a step")
    if numeric:  # limits set here: an axis with no finite value (a metric n/a everywhere) has none of its own
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlim(min(xs) / 1.3, max(xs) * 1.3)
        for ax, ys in ((t_ax, times), (m_ax, [p["peak_mib"] for p in pts])):
            if any(y is not None and y > 0 for y in ys):
                ax.set_yscale("log")
    fig.suptitle(sweep.description or f"sweep of {sweep.base} over {x_name}")
    return fig


def notes(sweep: Sweep, summary: dict, command: str, rows: list[dict]) -> str:
    rules = "; ".join(r.text(k.rsplit(".", 1)[-1]) for k, r in sweep.derived.items()) or "none"
    fixed = ", ".join(f"{k.replace('.init_args', '')} = {_text(v)}" for k, v in sweep.overrides.items()) or "none"
    devices = sorted({f"{r['device']}, {r['threads']} thread(s)" for r in rows})
    wall = sum(r["wall_s"] for r in rows)
    return "\n".join([
        f"`{command}`. Base config `configs/{sweep.base}`; swept {', '.join(sweep.keys)} ({sweep.grid}); "
        f"derived: {rules}; fixed: {fixed}; {sweep.steps} steps per point unless a rule sets trainer.max_steps.",
        f"ms / step: median over the steps after the first {sweep.timed_after} (Trainer on_train_batch_start -> "
        "on_train_batch_end: forward, loss, backward, update, metrics; the batch is made before). peak MiB: CUDA "
        "max_memory_allocated growth over a step (largest over the timed steps); CPU peak-RSS growth over the last "
        "step alone, glibc returning freed tensors (bench harness rules; n/a if the run stopped early).",
        f"Device: {'; '.join(devices)}. Total wall time {wall:.0f} s over {len(rows)} runs. n/a: the run did not "
        "produce the metric (e.g. first_capture/max before any feature is captured).",
        "", *[f"- {line}" for line in exponent_lines(sweep, summary)]])


def report(out: Path, sweep: Sweep, state: dict, resolved: dict, command: str) -> dict:
    summary = summarise(sweep, state["rows"], resolved)
    text = table(sweep, summary) + "\n\n" + notes(sweep, summary, command, state["rows"])
    state["summary"] = {"fit": summary["fit"], "against": summary["against"],
                        "flops_model": {n: p["flops_model"] for n, p in summary["points"].items()},
                        "command": command}
    write_results(out, "sweep", state, f"# {sweep.description or 'Sweep of ' + sweep.base}\n\n{text}",
                  {"summary": figure(sweep, summary)})
    return summary


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
def _save(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)  # a sweep killed mid-write keeps its previous rows


def open_state(out: Path, sweep: Sweep, config: Path, overwrite: bool) -> dict:
    """The rows finished so far in ``out/sweep.json`` (none for a new sweep); a different sweep is refused."""
    path = out / "sweep.json"
    if overwrite and out.exists():
        shutil.rmtree(out)
    if path.is_file():
        state = json.loads(path.read_text())
        old = state.get("sweep", {})
        if old != sweep.as_json():
            changed = sorted(k for k in set(old) | set(sweep.as_json()) if old.get(k) != sweep.as_json().get(k))
            _refuse("--config", f"the sweep {out}/sweep.json was started with (fields {changed} differ); "
                                "--overwrite starts afresh, or give another --out", str(config))
        return state
    if out.exists() and any(out.iterdir()):
        _refuse("--out", "a new or empty folder, or one holding a sweep (sweep.json); --overwrite empties it", str(out))
    out.mkdir(parents=True, exist_ok=True)
    return {"sweep": sweep.as_json(), "config": str(config), "rows": []}


def parse_args(argv=None) -> argparse.Namespace:
    parser = experiment_parser(__doc__.split("\n\n")[0], "runs/sweep/<config name>")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", type=Path, required=True, help="a sweep file, e.g. configs/large_k/mrp_k_cpu.yaml")
    parser.set_defaults(seed=None)
    parser.set_defaults(out=None)
    args = parser.parse_args(argv)
    if args.seed is not None and len(set(args.seed)) != len(args.seed):
        parser.error(f"--seed: seeds must be distinct, got {args.seed}")
    if args.out is None:
        args.out = Path("runs/sweep") / args.config.stem
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        sweep = load_sweep(args.config)
        seeds = args.seed if args.seed is not None else sweep.seeds
        resolved = resolve_points(sweep, seeds)
        state = open_state(args.out, sweep, args.config, args.overwrite)
    except ConfigError as err:
        sys.stderr.write(f"error: {err}\n")
        raise SystemExit(2) from None
    torch.set_num_threads(args.threads)
    quiet_lightning()
    done = {(r["point"], r["seed"]) for r in state["rows"]}
    jobs = [(p, s) for p in sweep.points() for s in seeds]
    skipped = sum((sweep.name(p), s) in done for p, s in jobs)
    if skipped:
        print(f"resuming {args.out}: {skipped} of {len(jobs)} runs already done")
    for point, seed in progress(jobs, "sweep points"):
        if (sweep.name(point), seed) in done:
            continue
        state["rows"].append(run_point(sweep, point, seed, args.out))
        _save(args.out / "sweep.json", state)
    command = "python -m featlearn.experiments.sweep " + " ".join(sys.argv[1:] if argv is None else argv)
    wanted = {(sweep.name(p), s) for p, s in jobs}
    state["rows"] = [r for r in state["rows"] if (r["point"], r["seed"]) in wanted] + \
                    [r for r in state["rows"] if (r["point"], r["seed"]) not in wanted]
    shown = {**state, "rows": [r for r in state["rows"] if (r["point"], r["seed"]) in wanted]}
    summary = report(args.out, sweep, shown, resolved, command)
    state["summary"] = shown["summary"]
    _save(args.out / "sweep.json", state)
    return summary


if __name__ == "__main__":
    main()
