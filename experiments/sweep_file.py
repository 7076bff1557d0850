"""The sweep file: what a sweep runs, read and checked before any run.

A sweep file (``configs/large_k/*.yaml``, read as a :class:`Sweep`) names a base run config and what changes
per point::

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

A rule is a :class:`~featlearn.experiments.points.Rule`: ``times * x**power`` (or ``times * ln x`` with
``log: true``) of the swept value ``x`` named by ``of`` (the dotted key or its last part), clamped to
``[at_least, at_most]`` and rounded (``ceil``, ``floor``, ``nearest``: an integer); or ``table: {x: value}``
covering every swept value. The whole file is checked before any run, naming the field: unknown fields and
wrong types (:func:`~featlearn.experiments.study.load_settings`), then what no type says: every dotted key must
exist in the base config as ``--print_config`` resolves it, no empty or repeated values, rules naming a swept
key, keys set once, and every point's values against the config's types.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from featlearn.errors import ConfigError
from featlearn.experiments.common import CONFIGS
from featlearn.experiments.points import Rule, grid, zipped
from featlearn.experiments.study import Run, load_settings, text


@dataclass(frozen=True)
class Sweep:
    """A sweep file (see the module docstring); :func:`load_sweep` reads and checks one."""
    base: str
    sweep: dict[str, list[Any]]
    steps: int
    metrics: list[str]
    grid: Literal["zip", "product"] = "zip"
    derived: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Rules by dotted key: each checked as a :class:`Rule` and held as one once loaded."""
    overrides: dict[str, Any] = field(default_factory=dict)
    timed_after: int = 3
    seeds: list[int] = field(default_factory=lambda: [0])
    seed_keys: list[str] = field(default_factory=lambda: ["data.init_args.seed"])
    cost_model: list[str] = field(default_factory=list)
    description: str = ""

    @property
    def keys(self) -> list[str]:
        return list(self.sweep)

    def points(self) -> list[dict]:
        """The swept values of every point, in file order (``zip``) or as their product (``product``)."""
        return (zipped if self.grid == "zip" else grid)(**self.sweep)

    def name(self, point: dict) -> str:
        """``k=16`` or ``d=32_d1=256``: the last part of each swept key and its value (a folder name)."""
        return "_".join(f"{key.rsplit('.', 1)[-1]}={text(v)}" for key, v in point.items())

    def settings(self, point: dict) -> dict:
        """Every dotted key this point sets: the fixed overrides, ``steps``, the swept values and the derived ones."""
        out = {**self.overrides, "trainer.max_steps": self.steps, **point}
        for key, rule in self.derived.items():
            out[key] = rule.apply(point[self.swept_key(rule.of)])
        return out

    def swept_key(self, name: str) -> str:
        return name if name in self.sweep else next(k for k in self.sweep if k.rsplit(".", 1)[-1] == name)

    def as_json(self) -> dict:
        """The file's content, normalised (what identifies the sweep in ``study.json``)."""
        return json.loads(json.dumps(asdict(self), default=str))


def _refuse(field_name: str, allowed: str, got) -> None:
    raise ConfigError(field_name, allowed, got)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rule(path: str, name: str, spec: dict, swept: dict) -> Rule:
    where = f"derived.{name}"
    load_settings(f"{path}: {where}", Rule, spec)  # unknown fields and types, naming the field
    short = {k.rsplit(".", 1)[-1]: k for k in swept}
    of = spec["of"]
    if of not in swept and of not in short:
        _refuse(f"{where}.of", f"a swept key ({', '.join(swept)}) or its last part ({', '.join(short)})", of)
    values = swept[of if of in swept else short[of]]
    if spec.get("table") is not None:
        if set(spec) - {"of", "table"}:
            _refuse(f"{where}.table", "a mapping {swept value: value}, alone beside 'of'", spec["table"])
        missing = [v for v in values if v not in spec["table"]]
        if missing:
            _refuse(f"{where}.table", f"an entry for every swept value of {of} (missing {missing})", list(spec["table"]))
    else:
        positive = spec.get("log") or not float(spec.get("power", 1)).is_integer()  # ln x, x^0.5: x > 0
        bad = [v for v in values if not is_number(v) or (positive and v <= 0)]
        if bad:
            _refuse(f"{where}.of", f"a key with positive numeric values for this rule (got {bad} in it)", of)
    # built from the file's own values: load_settings makes `times: 8` a float, and d1 = 8 d must stay an int
    return Rule(**spec)


def parse_sweep(data, path: str = "sweep file") -> Sweep:
    """A :class:`Sweep` from a parsed sweep file: its fields' types by :func:`load_settings`, then what types do
    not say; every problem is a :class:`ConfigError` naming the field.

    Example:
        >>> parse_sweep({"base": "mrp/teacher_student.yaml", "sweep": {"data.init_args.k": []}, "steps": 5,
        ...              "metrics": ["frac_captured"]})
        Traceback (most recent call last):
        featlearn.errors.ConfigError: sweep.data.init_args.k: must be a non-empty list of distinct values, got []
    """
    sweep = load_settings(path, Sweep, data)
    base = sweep.base
    if not base.endswith(".yaml") or not (CONFIGS / base).is_file() or Path(base).name.startswith(("data_", "experiment")):
        _refuse("base", f"a run config under {CONFIGS} such as mrp/teacher_student.yaml (not a data preset or "
                        "experiment settings)", base)
    if not sweep.sweep:
        _refuse("sweep", "a non-empty mapping {dotted.key: [values]}", sweep.sweep)
    for key, values in sweep.sweep.items():
        if not values or len({text(v) for v in values}) != len(values):
            _refuse(f"sweep.{key}", "a non-empty list of distinct values", values)
    sweep.points()  # zip: lists of one length
    shorts = [k.rsplit(".", 1)[-1] for k in sweep.sweep]
    if len(set(shorts)) != len(shorts):
        _refuse("sweep", "keys whose last parts differ (they name the points)", list(sweep.sweep))
    rules = {key: _rule(path, key, spec, sweep.sweep) for key, spec in sweep.derived.items()}
    if sweep.timed_after < 0:
        _refuse("timed_after", "an integer >= 0", sweep.timed_after)
    if sweep.steps < sweep.timed_after + 2:
        _refuse("steps", f"an integer >= timed_after + 2 = {sweep.timed_after + 2} (timed steps and a memory step)",
                sweep.steps)
    if not sweep.seeds or len(set(sweep.seeds)) != len(sweep.seeds) or min(sweep.seeds) < 0:
        _refuse("seeds", "a non-empty list of distinct integers >= 0", sweep.seeds)
    for key in ("metrics", "seed_keys", "cost_model"):
        value = getattr(sweep, key)
        if not all(value) or len(set(value)) != len(value) or (key == "metrics" and not value):
            _refuse(key, "a list of distinct names" + (" (final_metrics() keys)" if key == "metrics" else ""), value)
    for term in sweep.cost_model:
        try:
            cost_term(term)
        except ValueError:
            _refuse("cost_model", "dotted keys, each optionally with a power (data.init_args.P^2)", term)
    swept, overrides = set(sweep.sweep), set(sweep.overrides)
    clash = (swept & (set(rules) | overrides)) | (set(rules) & overrides)
    if clash:
        _refuse("derived", "keys set once (swept, derived or overrides, not two of them)", sorted(clash))
    return dataclasses.replace(sweep, derived=rules)


def load_sweep(path: Path) -> Sweep:
    """Read and check a sweep file (structure only; :func:`resolve_points` checks it against the base config)."""
    path = Path(path)
    if not path.is_file():
        _refuse("--config", "a sweep file (configs/large_k/*.yaml)", str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        _refuse("--config", "valid YAML", f"{path}: {str(err).splitlines()[0]}")
    return parse_sweep(data, str(path))


def lookup(config: dict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def point_run(sweep: Sweep, point: dict, seed: int) -> Run:
    """The run of one point and seed. Its seed goes to ``seed_everything`` and the sweep file's ``seed_keys``
    (default the data's seed only, not the Run's default of the model's too: the shipped sweeps' rows were
    made so, and a file may name other keys)."""
    return Run(sweep.base, f"{sweep.name(point)}/s{seed}", sweep.settings(point), seed=seed,
               seed_keys=tuple(sweep.seed_keys))


def resolve_points(sweep: Sweep, seeds: list[int]) -> dict[str, dict]:
    """Check every dotted key against the base config and every point's values against its types; return
    each point's resolved config (its cost-model and derived values are read from there)."""
    base = Run(sweep.base, "base").resolved()
    groups = [("sweep", sweep.sweep), ("derived", sweep.derived), ("overrides", sweep.overrides),
              ("seed_keys", sweep.seed_keys), ("cost_model", [cost_term(t)[0] for t in sweep.cost_model])]
    for group, keys in groups:
        for key in keys:
            try:
                lookup(base, key)
            except KeyError:
                _refuse(f"{group}.{key}" if group in ("sweep", "derived", "overrides") else group,
                        f"a dotted key of {sweep.base} (see lightning fit --config configs/{sweep.base} --print_config)",
                        key)
    resolved = {}
    for point in sweep.points():
        name = sweep.name(point)
        try:
            resolved[name] = point_run(sweep, point, seeds[0]).resolved()
        except ConfigError as err:
            raise ConfigError(f"point {name}", f"values the config {sweep.base} accepts", err.got) from None
    return resolved


def cost_term(term: str) -> tuple[str, float]:
    """A ``cost_model`` entry, ``key`` or ``key^power``, as (key, power).

    Example:
        >>> cost_term("data.init_args.P^2")
        ('data.init_args.P', 2.0)
    """
    key, _, power = term.partition("^")
    return key, float(power) if power else 1.0
