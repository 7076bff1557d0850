"""Sweeps: one run of a config per point of a swept key (k, d, K, P, ...), with the method's theory metrics and
the cost of a training step at every point, a summary table, a PNG and the growth exponent of the cost.

    python -m featlearn.experiments.sweep --config configs/large_k/mrp_k_cpu.yaml            # seeds of the file
    python -m featlearn.experiments.sweep --config configs/large_k/mrp_k_cpu.yaml --seed 0 1 # these seeds
    python -m featlearn.experiments.sweep --config ... --out runs/x --overwrite              # start afresh

The sweep file's format and checks: :mod:`featlearn.experiments.sweep_file`.

Each point and seed is a :class:`~featlearn.experiments.study.Run` of a
:class:`~featlearn.experiments.study.Study`, with TensorBoard logs under ``--out/<point>/s<seed>``; each
finished run is kept in ``--out/study.json``, so the same command resumes a half-finished sweep (finished runs
are skipped, a run cut short is rerun from its start; more seeds fit only the new runs). A changed sweep file
writes to a new folder (``--out``-2, ...); ``--overwrite`` starts afresh in ``--out``.

Cost per point: the time of a training step from the Trainer's ``on_train_batch_start`` to its
``on_train_batch_end`` (forward, loss, backward, optimizer step and the method's step-finishing work; the batch
is made before), median over the steps after ``timed_after``; peak memory with the bench harness's rules
(:mod:`featlearn.bench.harness`): on CUDA ``max_memory_allocated`` over a step less what was allocated before
it, the largest over the timed steps; on CPU the growth of the peak resident set over the last step, measured
on that step alone (not timed) with glibc made to return freed tensors (n/a if the run stopped early).

Summary (``sweep.md``, ``sweep.json`` with every row, ``sweep_summary.png``): per point the swept and derived
values, the metrics, the steps run, ms per step, peak MiB, wall seconds (``mean (min-max)`` over seeds); the
growth exponent of the time per step against the first swept key (least squares in log-log, over all points
and over the larger half), printed beside the exponent of the FLOP model (the product of the ``cost_model``
values of each point, fitted the same way).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch

from featlearn.bench import harness
from featlearn.bench.harness import Meter
from featlearn.errors import ConfigError
from featlearn.experiments.common import experiment_parser, markdown_table, mean_range, quiet_lightning
from featlearn.experiments.study import Study, text
from featlearn.experiments.sweep_file import (Rule, Sweep, cost_term, is_number, load_sweep, lookup, parse_sweep,
                                              point_run, resolve_points)

__all__ = ["Rule", "Sweep", "parse_sweep", "load_sweep", "growth_exponent", "main"]


# ------------------------------------------------------------------------------------------------
# one run: its cost
# ------------------------------------------------------------------------------------------------
class StepClock(L.Callback):
    """Times training steps (``on_train_batch_start`` -> ``on_train_batch_end``) after the first ``skip``, and
    measures the peak memory of a step (see the module docstring): on CUDA over every timed step, on CPU on the
    last planned step alone (``last``, default the trainer's ``max_steps - 1``), which is then not timed.
    ``stopped``: the fit ended in an exception (the divergence guard's).

    Example:
        >>> clock = StepClock(skip=2, last=9, device=torch.device("cpu"))
        >>> clock.seconds, clock.peak_bytes
        ([], None)
    """

    def __init__(self, skip: int, last: int | None = None, device: torch.device | None = None):
        self.skip, self.last, self.device = skip, last, device
        self.seconds: list[float] = []
        self.peak_bytes: int | None = None
        self.meter, self.index, self.growth, self.stopped = None, 0, harness.ResidentGrowth(), False

    def on_train_start(self, trainer, pl_module) -> None:
        self.last = trainer.max_steps - 1 if self.last is None else self.last
        self.device = trainer.strategy.root_device if self.device is None else self.device

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.stopped = True

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


def fit_point(study: Study, sweep: Sweep, point: dict, seed: int) -> dict:
    """Fit one point with one seed (or take it from ``study.json``); its row (values, metrics, cost). A run the
    divergence guard stops keeps its row, with ``diverged: true`` and no metrics."""
    clock, start = StepClock(sweep.timed_after), time.perf_counter()

    def row(fitted) -> dict:
        device = fitted.trainer.strategy.root_device
        final = {} if clock.stopped else fitted.model.final_metrics()
        return {"point": sweep.name(point), "seed": seed, "values": point,
                "settings": {**sweep.settings(point), **{k: seed for k in sweep.seed_keys}},
                "device": _device_name(device), "threads": torch.get_num_threads(), "diverged": False,
                "metrics": {m: _metric_value(final[m]) if m in final else None for m in sweep.metrics},
                "steps": fitted.steps,
                "time_per_step_ms": round(1e3 * statistics.median(clock.seconds), 4) if clock.seconds else None,
                "timed_steps": len(clock.seconds),
                "peak_mib": None if clock.peak_bytes is None else round(clock.peak_bytes / 2 ** 20, 2),
                "wall_s": round(time.perf_counter() - start, 2)}

    return study.fit(point_run(sweep, point, seed), row, callbacks=[clock], collect_diverged=True)


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
        factors = {k: lookup(config, k) for k, _ in terms} if config else {}
        flops = (math.prod(factors[k] ** p for k, p in terms)
                 if terms and all(is_number(factors.get(k)) for k, _ in terms) else None)
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
    numeric = all(is_number(x) and x > 0 for x in xs)
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
    fixed = ", ".join(f"{k.replace('.init_args', '')} = {text(v)}" for k, v in sweep.overrides.items()) or "none"
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


def report(study: Study, sweep: Sweep, state: dict, resolved: dict, command: str) -> dict:
    summary = summarise(sweep, state["rows"], resolved)
    text_ = table(sweep, summary) + "\n\n" + notes(sweep, summary, command, state["rows"])
    state["summary"] = {"fit": summary["fit"], "against": summary["against"],
                        "flops_model": {n: p["flops_model"] for n, p in summary["points"].items()},
                        "command": command}
    study.write("sweep", state, f"# {sweep.description or 'Sweep of ' + sweep.base}\n\n{text_}",
                {"summary": figure(sweep, summary)})
    return summary


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
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
    except ConfigError as err:
        sys.stderr.write(f"error: {err}\n")
        raise SystemExit(2) from None
    torch.set_num_threads(args.threads)
    quiet_lightning()
    jobs = [(point, seed) for point in sweep.points() for seed in seeds]
    # the study is the sweep file's content (a changed file writes to a new folder); not the seeds: a run is
    # its point and seed, so the same folder takes more seeds and fits only their runs
    identity = argparse.Namespace(out=args.out, overwrite=args.overwrite, sweep=sweep.as_json())
    with Study(identity, "sweep points", fits=len(jobs)) as study:
        rows = [fit_point(study, sweep, point, seed) for point, seed in jobs]
    command = "python -m featlearn.experiments.sweep " + " ".join(sys.argv[1:] if argv is None else argv)
    return report(study, sweep, {"sweep": sweep.as_json(), "config": str(args.config), "rows": rows}, resolved,
                  command)


if __name__ == "__main__":
    main()
