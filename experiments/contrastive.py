"""Wen & Li 2021, Theorems 3.2 and 3.4: contrastive learning with vs without RandomMask, at equal bias, plus controls.

Every setting is a config ``configs/contrastive/<setting>.yaml`` (``random_mask.yaml`` with what the setting
changes; the data block is ``data_tiny.yaml``), fitted through the experiment engine
(:class:`featlearn.experiments.study.Study`: finished fits are kept in ``<out>/study.json``, so the same
command run again resumes) with the seed and the size knobs below overridden. Each run is trained, then tested
(``trainer.test``: probes fitted on the val split, scored on the test split). The command prints and saves a
table (``results.json`` / ``results.md``): sparse-energy fraction (final and peak), singleton neurons, features
covered by singletons, the bias each run got (``b/||w||``, T1), regression / classification probes on f(x) vs
raw x, cos(f(x), f(Mz)), cos(f(x), f(xi)), firing rate, T2 and the normalized final loss; and two PNGs beside
it: ``results_features.png`` (coverage and singletons / m per setting) and ``results_correlation.png`` (neuron x
atom heat map of the first setting's first seed). ``--sweep-d`` / ``--combine`` add ``sweep_d_coverage.png``.
With several ``--seed`` values every cell is ``mean (min-max)`` over seeds (``n/a`` where a quantity is
undefined for some seed, e.g. T2 never reached).

Default settings (each differs from ``random_mask`` in ONE thing; the configs' comments and
docs/methods/contrastive.md say more): ``random_mask`` (RandomMask views, the paper's bias schedule: b = 0 until
T1 = the first step with ``min_i rho_i >= 1/2``, reset to ``sqrt(2 log d/d)||w_i||``, grown to the cap
``(log d/sqrt d)||w_i||``), ``no_augmentation`` (the SAME schedule, T1 detected by the same rule on its own run;
the table reports T1 and the b/||w|| reached; ``--bias-reset-step N`` resets every run's bias at step N instead),
``linear_control`` (no augmentation and b = 0: f linear, its probe cannot beat raw x by construction) and
``coordinate_control`` (a coordinate-aligned dictionary: the views share no sparse signal). Ablations
(``--settings``): ``learned_bias`` / ``learned_bias_no_aug`` (footnote 4) and ``paper_lambda`` (d^-1.25).

Size rule (``--preset tiny|small|medium`` = d 32/64/128; ``--d``, ``--d1``, ``--width-mult`` override; its
sources and the choice of eta: docs/methods/contrastive.md): d1 = 8d, m = 4d, K = 256 anchors per step,
N = 8d shared negatives, tau = log d, lambda = d^-1.75 (below the paper's range, inside which the weights decay
before stage III at small d), eta = 2, steps = 1000 S(d)/S(32) with S(d) = d log d/log log d (the
d-dependence of the stage times, Wen & Li 2021, App. C and D.2): 1000 / 2093 / 4407 steps at d = 32 / 64 / 128.

Usage:
    python -m featlearn.experiments.contrastive [--preset tiny] [--seed 0 1 2] [--settings a,b] [--threads 1]
    python -m featlearn.experiments.contrastive --sweep-d 32 64 --seed 0 1 2     # d sweep -> sweep_d.md
    python -m featlearn.experiments.contrastive --combine runs/a runs/b          # one sweep table from runs
    python -m featlearn.experiments.contrastive --d1 1024 --bias-reset-step 40   # one bias clock for all runs

A tiny run takes ~25 s per setting and seed on one CPU thread, small ~100 s, medium ~8 min.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from featlearn.experiments.common import (CONFIGS, experiment_parser, markdown_table, mean_range,
                                         parse_experiment_args, quiet_lightning)
from featlearn.experiments.study import Run, Study
from featlearn.metrics.figures import bars_figure, heatmap_figure

SETTINGS = sorted(p.stem for p in (CONFIGS / "contrastive").glob("*.yaml") if not p.name.startswith("data_"))
DEFAULT_SETTINGS = ("random_mask", "no_augmentation", "linear_control", "coordinate_control")
SWEEP_SETTINGS = ("random_mask", "no_augmentation", "linear_control")
PRESETS = {"tiny": 32, "small": 64, "medium": 128}
LABELS = {
    "random_mask": "RandomMask (schedule bias)",
    "no_augmentation": "no augmentation (same schedule bias)",
    "linear_control": "linear control (b = 0, f linear: cannot beat raw x by construction)",
    "coordinate_control": "coordinate-aligned dictionary (negative control)",
    "learned_bias": "RandomMask, learned bias",
    "learned_bias_no_aug": "no augmentation, learned bias",
    "paper_lambda": "RandomMask, lambda = d^-1.25",
}
LAMBDA_EXPONENT = {"paper_lambda": -1.25}  # every other setting: -1.75

# (column, summary key, format); undefined values (NaN) print as n/a
COLUMNS = [
    ("sparse frac", "weights/sparse_frac_mean", "{:.3f}"), ("peak", "weights/sparse_frac_peak", "{:.3f}"),
    ("singletons", "features/singletons", "{:.0f}"), ("coverage", "features/coverage", "{:.3f}"),
    ("b/||w||", "bias/ratio_mean", "{:.2f}"), ("T1", "stage/T1", "{:.0f}"), ("T2", "stage/T2", "{:.0f}"),
    ("nMSE f(x)", "probe/reg_nmse", "{:.3f}"), ("nMSE raw x", "probe/reg_nmse_raw", "{:.3f}"),
    ("acc f(x)", "probe/cls_acc", "{:.3f}"), ("acc raw x", "probe/cls_acc_raw", "{:.3f}"),
    ("cos(f(x),f(Mz))", "repr/cos_fx_fMz", "{:.2f}"), ("cos(f(x),f(xi))", "repr/cos_fx_fxi", "{:.2f}"),
    ("fire rate", "act/fire_rate_raw", "{:.3f}"), ("loss/uniform", "loss_normalized", "{:.3f}"),
]
SWEEP_COLUMNS = ["d", "d1", "m", "steps", "sparse frac", "peak", "singletons", "coverage", "b/||w||", "T1",
                 "nMSE f(x)", "nMSE raw x"]


def size_rule(d: int, d1: int | None = None, width_mult: float = 4.0) -> dict:
    """The run sizes and hyperparameters at ``d`` (see the module docstring for the rule and its sources).

    Example:
        >>> r = size_rule(64); (r["d1"], r["m"], r["N"], r["eta"], r["steps"])
        (512, 256, 512, 2.0, 2093)
    """
    scale = lambda n: n * math.log(n) / math.log(math.log(n))  # noqa: E731 - T1, T2 ~ d log d/(eta log log d)
    return {"d": d, "d1": d1 if d1 is not None else 8 * d, "width_mult": width_mult,
            "m": max(1, int(round(width_mult * d))), "K": 256, "N": 8 * d, "eta": 2.0,
            "tau": math.log(d), "steps": int(round(1000 * scale(d) / scale(32)))}


def run(name: str, size: dict, seed: int | None, folder: str = "") -> Run:
    """The fit of ``configs/contrastive/<name>.yaml`` at ``size`` (logs in ``<out>/<folder><name>``; no seed: the
    run :meth:`~featlearn.experiments.study.Study.fit_seeds` fits at every seed, logs in ``.../seed_<s>``)."""
    lam = size["d"] ** LAMBDA_EXPONENT.get(name, -1.75)
    overrides = {"trainer.max_steps": size["steps"], "data.init_args.d": size["d"], "data.init_args.d1": size["d1"],
                 "data.init_args.batch_size": size["K"], "data.init_args.num_negatives": size["N"],
                 "model.init_args.width_mult": size["width_mult"], "model.init_args.lr": size["eta"],
                 "model.init_args.weight_decay": lam, "model.init_args.temperature": size["tau"]}
    if size.get("bias_reset_step") is not None:
        overrides["model.init_args.bias_reset_step"] = size["bias_reset_step"]
    return Run(f"contrastive/{name}.yaml", f"{folder}{name}", overrides, seed=seed)


def collector(correlation: int | None = None):
    """A fit's result: the model tested (probes fitted on the val split, scored on the test split), its summary,
    the normalized final loss and, for the seed ``correlation``, its neuron x atom correlations (rows sorted by
    atom). ``wall_s``: since the collector was made (the fit of every seed, and the collects before this one)."""
    t0 = time.time()

    def collect(fitted) -> dict:
        model, dm = fitted.model, fitted.datamodule
        fitted.test()
        summary = model.summary()
        # the final loss on fresh batches, normalized by its value at uniform logits (1 = nothing learned)
        with torch.no_grad():
            vals = []
            for k in range(4):
                idx = torch.arange(dm.batch_size, device=model.device) + (10 ** 9 + k * dm.batch_size)
                loss, st = model.contrastive_loss(dm.batch(idx, "train"))
                vals.append(float(loss) / st["uniform"])
        summary.update(loss_normalized=sum(vals) / len(vals), wall_s=time.time() - t0,
                       raw_nmse_population=dm.raw_probe_nmse(), **{"lambda": float(model.lam)})
        # NaN marks "never happened" (T1, T2): stored as null so the tables print n/a
        summary = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in summary.items()}
        if fitted.seed == correlation:
            summary["correlation"] = model.heatmaps()["correlation"].cpu().tolist()
        return summary
    return collect


def aggregate(per_seed: dict[int, dict]) -> dict[str, object]:
    """Table cells of one setting: ``mean (min-max)`` over seeds per column."""
    runs = list(per_seed.values())
    return {col: mean_range([r.get(key) for r in runs], fmt) for col, key, fmt in COLUMNS}


def label(name: str) -> str:
    return LABELS.get(name, name)


def run_size(study: Study, names: list[str], size: dict, seeds: list[int], folder: str = "") -> dict:
    """All settings x seeds at one size; writes ``<folder>results.json`` / ``.md`` and the figures."""
    t0 = time.time()
    (study.out / folder).mkdir(parents=True, exist_ok=True)
    runs = {name: study.fit_seeds(run(name, size, None, folder), seeds, collector(seeds[0] if name == names[0] else None))
            for name in names}
    first = runs[names[0]][seeds[0]]
    runs[names[0]][seeds[0]] = {k: v for k, v in first.items() if k != "correlation"}
    result = {"size": size, "seeds": seeds, "runs": runs, "total_wall_s": time.time() - t0}
    figures = {}
    if "correlation" in first:  # not when the fit diverged
        figures["correlation"] = heatmap_figure(
            torch.tensor(first["correlation"]), xlabel="atom j", ylabel="neuron i (sorted by its atom)", vmax=1.0,
            title=f"{label(names[0])}, seed {seeds[0]}: <w_i, M_j> / ||w_i||")
    write_size_results(study, result, f"{folder}results", figures)
    return result


def write_size_results(study: Study, result: dict, stem: str = "results", figures: dict | None = None) -> None:
    """``<stem>.json`` / ``<stem>.md`` / ``<stem>_*.png``: the table of one size from a :func:`run_size` result,
    the bars of coverage and singleton share per setting, and the given ``figures``."""
    runs = {name: {int(s): r for s, r in per_seed.items()} for name, per_seed in result["runs"].items()}
    rows = {label(name): aggregate(per_seed) for name, per_seed in runs.items()}
    size = result["size"]
    notes = size_notes(size, result["seeds"], runs) + f" Total wall time {result['total_wall_s']:.0f} s."
    bars = _feature_bars({name: per_seed.values() for name, per_seed in runs.items()},
                         f"d = {size['d']}, {len(result['seeds'])} seed(s): mean, bars min-max")
    study.write(stem, {**result, "notes": notes},
                  f"# Contrastive learning: RandomMask vs no augmentation at equal bias (d = {size['d']})\n\n"
                  f"{markdown_table(rows, [c for c, _, _ in COLUMNS])}\n\n{notes}",
                  figures={"features": bars, **(figures or {})})


def _feature_bars(groups: dict, title: str):
    """Coverage and singletons / m per group of runs (mean over the runs, min-max as error bars; diverged runs
    left out)."""
    values = {name: {"coverage": [r["features/coverage"] for r in group],
                     "singletons / m": [r["features/singletons"] / r["m"] for r in group]}
              for name, group in ((n, [r for r in g if not r.get("diverged")]) for n, g in groups.items()) if group}
    means = {g: {k: sum(v) / len(v) for k, v in bars.items()} for g, bars in values.items()}
    ranges = {g: {k: (min(v), max(v)) for k, v in bars.items()} for g, bars in values.items()}
    return bars_figure(means, ylabel="fraction", title=title, errors=ranges)


def size_notes(size: dict, seeds: list[int], runs: dict) -> str:
    raw = next((f"{r['raw_nmse_population']:.3f}" for per_seed in runs.values() for r in per_seed.values()
                if not r.get("diverged")), "n/a (every run diverged)")
    budget = ("set by --steps; the size rule gives " + str(size_rule(size["d"])["steps"]) if size.get("steps_override")
              else "rule: steps = 1000 S(d)/S(32), S(d) = d log d/log log d; see experiments/contrastive.py")
    clock = (f"at step {size['bias_reset_step']} in every run (--bias-reset-step)" if size.get("bias_reset_step")
             else "at T1 = first step with min_i rho_i >= 1/2, detected on each run")
    seeds_txt = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {' '.join(map(str, seeds))}: mean (min-max)"
    return (f"d={size['d']}, d1={size['d1']}, m={size['m']}, K={size['K']}, N={size['N']}, eta={size['eta']:g}, "
            f"tau=log d, lambda=d^-1.75 (paper_lambda: d^-1.25), {size['steps']} steps "
            f"({budget}), {seeds_txt}. "
            f"Singletons: |N_i| = 1 with N_i = {{j : |alpha_ij| >= max(b_i, sqrt(2 log d/d) ||w_i||)}}, the same "
            f"definition for every row. Bias: random_mask and no_augmentation run the same schedule (reset "
            f"{clock}; cap (log d/sqrt d) ||w_i|| = "
            f"{math.log(size['d']) / math.sqrt(size['d']):.2f} ||w_i||); columns T1 and b/||w|| give what each run "
            f"got (the linear control detects T1 but keeps b = 0). Population nMSE of the best linear probe on "
            f"raw x: sigma^2/(p+sigma^2) = {raw}. Probes: fit on the val split, "
            f"scored on the test split.")


def sweep_table(results: list[dict]) -> str:
    """One row per (d, setting) from several :func:`run_size` results."""
    rows = {}
    for res in sorted(results, key=lambda r: r["size"]["d"]):
        size = res["size"]
        for name, per_seed in res["runs"].items():
            cells = aggregate({int(s): r for s, r in per_seed.items()})
            cells.update({"d": size["d"], "d1": size["d1"], "m": size["m"], "steps": size["steps"]})
            seeds = f"{len(per_seed)} seed{'s' * (len(per_seed) > 1)}"
            rows[f"{label(name)}{_off_rule(size)}, d = {size['d']} ({seeds})"] = cells
    return markdown_table(rows, SWEEP_COLUMNS)


def _off_rule(size: dict) -> str:
    """What a run changed from the size rule (targeted runs), for its row label."""
    rule = size_rule(size["d"], width_mult=size["width_mult"])
    parts = [f"d1 = {size['d1']}" if size["d1"] != rule["d1"] else "",
             f"{size['steps']} steps" if size["steps"] != rule["steps"] else "",
             f"bias reset at step {size['bias_reset_step']}" if size.get("bias_reset_step") else ""]
    return "".join(f" [{p}]" for p in parts if p)


def write_sweep(study: Study, results: list[dict], extra_notes: str = "") -> None:
    seed_sets = sorted({tuple(r["seeds"]) for r in results}, key=len, reverse=True)
    notes = ("Each cell: mean (min-max) over the seeds counted in its row label. Size rule (experiments/contrastive.py): "
             "d1 = 8d, m = 4d, K = 256, N = 8d, eta = 2, tau = log d, lambda = d^-1.75, steps = 1000 S(d)/S(32) with "
             "S(d) = d log d/log log d. Singletons and coverage use one definition for every row "
             "(|alpha_ij| >= max(b_i, sqrt(2 log d/d)||w_i||)). RandomMask and no augmentation run the same bias "
             "schedule; T1 and b/||w|| are what each run got (T1 is detected in every run; the linear control keeps "
             "b = 0 at it, the coordinate control never reaches it). Rows with [...] are targeted runs that change "
             "what the brackets say from the rule. Seeds: "
             + "; ".join(f"{' '.join(map(str, ss))} ({len(ss)}-seed rows)" for ss in seed_sets)
             + f". Total wall time {sum(r['total_wall_s'] for r in results):.0f} s." + extra_notes)
    coverage = {}
    for res in sorted(results, key=lambda r: r["size"]["d"]):
        for name, per_seed in res["runs"].items():
            values = [r["features/coverage"] for r in per_seed.values() if not r.get("diverged")] or [float("nan")]
            coverage.setdefault(name, {})[f"d = {res['size']['d']}{_off_rule(res['size'])}"] = sum(values) / len(values)
    figure = bars_figure(coverage, ylabel="atoms covered by singletons", title="mean over each row's seeds")
    study.write("sweep_d", {"sizes": results, "notes": notes},
                f"# Contrastive learning across d: coverage, singletons, sparse-energy fraction\n\n"
                f"{sweep_table(results)}\n\n{notes}", figures={"coverage": figure})


def _load(run_dir: Path) -> list[dict]:
    """The per-size results saved by an earlier run (one size or a sweep)."""
    sweep, single = run_dir / "sweep_d.json", run_dir / "results.json"
    if sweep.exists():
        return json.loads(sweep.read_text())["sizes"]
    data = json.loads(single.read_text())
    return [{k: data[k] for k in ("size", "seeds", "runs", "total_wall_s")}]


def parse_args(argv=None) -> argparse.Namespace:
    """The options; every bad value is refused, naming the option, before the output folder is made."""
    parser = experiment_parser(__doc__.split("\n")[0], "runs/contrastive")
    parser.add_argument("--preset", choices=sorted(PRESETS, key=PRESETS.get), default="tiny",
                        help="size preset: " + ", ".join(f"{k} = d {v}" for k, v in PRESETS.items()))
    parser.add_argument("--d", type=int, help="number of dictionary atoms (overrides --preset)")
    parser.add_argument("--d1", type=int, help="input dimension (default 8d)")
    parser.add_argument("--width-mult", type=float, default=4.0, help="neurons per atom, m = width_mult * d")
    parser.add_argument("--steps", type=int, help="override the step budget of the size rule (one size only)")
    parser.add_argument("--bias-reset-step", type=int, metavar="N",
                        help="reset the scheduled bias at step N in every run instead of at its own T1 (one bias "
                             "clock for runs with and without augmentation)")
    parser.add_argument("--sweep-d", type=int, nargs="+", metavar="D",
                        help="run every setting at each d (sizes by the rule) and write sweep_d.md")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="DIR",
                        help="write one sweep_d table from earlier runs' results.json / sweep_d.json (no training)")
    parser.add_argument("--settings", help=f"comma-separated subset of {SETTINGS} (configs/contrastive/*.yaml); "
                                           f"default {','.join(DEFAULT_SETTINGS)}, with --sweep-d "
                                           f"{','.join(SWEEP_SETTINGS)}")
    return parse_experiment_args(parser, argv, _refuse_bad_options)


def _refuse_bad_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad options, naming them; set ``args.names`` (settings) and ``args.ds`` (sizes)."""
    default = SWEEP_SETTINGS if args.sweep_d else DEFAULT_SETTINGS
    args.names = [s for s in (args.settings or ",".join(default)).split(",") if s]
    args.ds = ds = args.sweep_d or [args.d if args.d is not None else PRESETS[args.preset]]
    if args.combine:
        given = [opt for opt, v in (("--sweep-d", args.sweep_d), ("--d", args.d), ("--d1", args.d1),
                                    ("--steps", args.steps), ("--settings", args.settings),
                                    ("--bias-reset-step", args.bias_reset_step)) if v is not None]
        if given:
            parser.error(f"--combine: tabulates earlier runs without training; drop {', '.join(given)}")
        missing = [str(p) for p in args.combine
                   if not (p / "sweep_d.json").exists() and not (p / "results.json").exists()]
        if missing:
            parser.error(f"--combine: no results.json or sweep_d.json in {missing}")
        return
    if args.settings is not None:
        unknown = [s for s in args.names if s not in SETTINGS]
        if unknown or not args.names:
            parser.error(f"--settings: must be among {SETTINGS}, got {unknown or args.settings!r}")
    if args.sweep_d and (args.d is not None or args.d1 is not None or args.steps is not None):
        parser.error("--sweep-d: sizes and steps come from the size rule; do not combine with --d, --d1 or --steps")
    for name, values in (("--d", [args.d]), ("--sweep-d", args.sweep_d or [])):
        bad = [v for v in values if v is not None and v < 4]
        if bad:
            parser.error(f"{name}: every d must be an integer >= 4 (log log d > 0), got {bad}")
    if args.d1 is not None and args.d1 <= ds[0]:
        parser.error(f"--d1: must exceed d = {ds[0]}, got {args.d1}")
    if not (args.width_mult > 0 and math.isfinite(args.width_mult)):
        parser.error(f"--width-mult: must be a positive number, got {args.width_mult}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps: must be a positive integer, got {args.steps}")
    if args.bias_reset_step is not None and args.bias_reset_step < 1:
        parser.error(f"--bias-reset-step: must be a positive integer, got {args.bias_reset_step}")
    if args.bias_reset_step is not None:
        # a reset at or after the last step never happens: the "equal bias" runs would silently keep b = 0
        steps = min(args.steps or size_rule(d, args.d1, args.width_mult)["steps"] for d in ds)
        if args.bias_reset_step >= steps:
            parser.error(f"--bias-reset-step: must be below the step budget {steps}, got {args.bias_reset_step}")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.combine:  # no fits: the Study only chooses the output folder
        results = [r for p in args.combine for r in _load(p)]
        write_sweep(Study(args, "combine", fits=0), results, f" Combined from {', '.join(map(str, args.combine))}.")
        return results
    quiet_lightning()
    sizes = [size_rule(d, args.d1, args.width_mult) for d in args.ds]
    for size in sizes:
        if args.steps is not None:
            size.update(steps=args.steps, steps_override=True)
        if args.bias_reset_step is not None:
            size["bias_reset_step"] = args.bias_reset_step
    with Study(args, "contrastive fits", fits=len(sizes) * len(args.names) * len(args.seed)) as study:
        results = [run_size(study, args.names, size, args.seed, f"d{size['d']}/" if args.sweep_d else "")
                   for size in sizes]
    if args.sweep_d:
        write_sweep(study, results)
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
