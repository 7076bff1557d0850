"""MRP (Pan et al. 2023): pretrain -> fine-tune vs supervised learning, on equal terms, over sizes and seeds.

    python -m featlearn.experiments.mrp                                  # main job: tiny size, seed 0
    python -m featlearn.experiments.mrp --seed 0 1 2 --grid              # + each method at its best over the grid
    python -m featlearn.experiments.mrp --mu 0 0.02 0.05 0.2 --seed 0 1 2   # Lemma 1 against mu
    python -m featlearn.experiments.mrp --preset k8 tiny k16 k32 --seed 0 1 2   # sizes
    python -m featlearn.experiments.mrp --k 12 --d 128 --m 5 --N 2000    # any size

For every (size, mu, seed) it runs ``configs/mrp/teacher_student.yaml`` (pretraining, labels unused), fine-tunes the
encoder with ``finetune.yaml`` on the labelled downstream set, trains ``supervised.yaml`` from scratch on the same
downstream set, and tests both on one test set split by view type.

Equal terms: both encoders share q, sigma0 and m (``shared`` in ``configs/mrp/experiment.yaml``); with ``--grid``
each method is also run at every point of the same grid (``grid`` in the YAML: q values x lr scales of pretraining
for MRP and of training for SL; shipped: q = 3, lr x 0.5, 1, 2) and the point with the best balanced validation
accuracy (mean of multi- and single-view) is reported beside the shared one.

Size rule (:func:`size_rule`): m = max(4, ceil(2.5 ln k)) kernels per class (polylog(k) <= m; the measured capture
curve, ``experiments/mrp_capture.py``), N = 100 k pretraining and N2 = 50 k labelled samples (N2 >= k, Assumption 2).
Every feature sits in about 1/k of the samples, so its gradient is Theta(eta / k) (Claim E.5) and step sizes grow
with k: pretraining eta = k/2 and supervised eta = 2k, each times the grid's lr scale; fine-tuning eta_1 = k/100,
eta_2 = k (our values for Lemma G.1's eta_2 = Theta(k), eta_1 << eta_2; not tuned, as pretraining is). Budgets:
pretraining stops 200 steps after every feature is captured (at most 3000 + 30 k steps), fine-tuning 300 steps,
supervised learning 1500 steps.

Writes ``mrp_table.{md,json}`` (per-seed rows in the JSON), ``mrp_table_capture.png`` (features captured against the
pretraining step, a curve per seed) and ``mrp_table_accuracy.png`` (test accuracy per view, MRP + fine-tuning against
SL, mean and min-max over seeds); ``<out>/study.json`` keeps each finished fit, so the same command resumes.
"""
import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from featlearn.experiments.common import (CONFIGS, experiment_parser, markdown_table, mean_range,
                                         parse_experiment_args, quiet_lightning, scalars)
from featlearn.experiments.points import grid
from featlearn.experiments.study import Run, Study, load_settings
from featlearn.metrics.figures import bars_figure, curves_figure


@dataclass
class Shared:  # the encoder both methods use, and the lr scale they run at beside the grid
    q: int
    sigma0: float
    lr_scale: float


@dataclass
class Grid:  # q values x lr scales of pretraining (MRP) and of training (SL)
    q: list[int]
    lr_scale: list[float]


@dataclass
class Settings:  # configs/mrp/experiment.yaml: named sizes, the shared encoder, the grid, the val/test sets
    presets: dict[str, dict[str, int]]
    shared: Shared
    grid: Grid
    eval_mu: float
    num_val: int
    num_test: int


SETTINGS = load_settings(CONFIGS / "mrp" / "experiment.yaml", Settings)
KNOBS = ("k", "d", "P", "m", "N", "N2")


@dataclass(frozen=True)
class Size:
    k: int
    d: int
    P: int
    m: int
    N: int
    N2: int


def size_rule(k: int, d: int = 256, P: int = 16, m: int | None = None, N: int | None = None,
              N2: int | None = None) -> Size:
    """The size of a run from ``k`` and whatever else is given; m: the smallest measured m whose pretraining captures
    every feature in >= 0.9 of seeds at k = 8, 10, 16 (``benchmarks/results/mrp/mrp_capture.md``).

    Example:
        >>> [size_rule(k).m for k in (8, 10, 16, 32)], size_rule(10)
        ([6, 6, 7, 9], Size(k=10, d=256, P=16, m=6, N=1000, N2=500))
    """
    return Size(k, d, P, max(4, math.ceil(2.5 * math.log(k))) if m is None else m, 100 * k if N is None else N,
                50 * k if N2 is None else N2)


def step_sizes(size: Size, lr_scale: float) -> dict[str, float]:
    """Step sizes of the three runs at this size: every rate is Theta(eta / k), so eta grows with k."""
    return {"pretrain": 0.5 * size.k * lr_scale, "finetune": 0.01 * size.k, "head": float(size.k),
            "supervised": 2.0 * size.k * lr_scale}


def _settings(size: Size, mu: float, **model) -> dict:
    """The overrides of one run: the data at this size and mu, and ``model``'s arguments."""
    data = dict(k=size.k, d=size.d, P=size.P, num_pretrain=size.N, num_downstream=size.N2, mu=mu,
                eval_mu=SETTINGS.eval_mu, num_val=SETTINGS.num_val, num_test=SETTINGS.num_test)
    return {**{f"data.init_args.{k}": v for k, v in data.items()},
            **{f"model.init_args.{k}": v for k, v in {**model, "m": size.m}.items()}}


def _encoder_row(metrics: dict) -> dict:
    """The capture columns, from a trained module's final theory metrics."""
    return {"features captured": metrics["frac_captured"], "classes with both features": metrics["classes_both"],
            "pure / same-class / cross-class kernels": " / ".join(
                str(int(metrics[f"kernels/{kind}"])) for kind in ("pure", "sameclass", "crossclass"))}


def _classifier_row(fitted, start: float) -> dict:
    """A fine-tuned or supervised classifier's row: capture columns, val/test accuracy, steps, seconds."""
    val = scalars(fitted.validate())
    test = scalars(fitted.test())
    return {**_encoder_row(scalars(fitted.model.final_metrics())),
            "test acc multi-view": test["test/acc/multi"], "test acc single-view": test["test/acc/single"],
            "val balanced acc": round((val["val/acc/multi"] + val["val/acc/single"]) / 2, 4),
            "steps": fitted.steps, "seconds": round(time.time() - start, 1)}


def _pretrain_row(fitted, start: float) -> dict:
    """The pretraining row, and (``_checkpoint``, ``_seconds``) what its fine-tuning needs."""
    metrics = scalars(fitted.model.final_metrics())
    return {**_encoder_row(metrics), "steps": fitted.steps,
            "all captured by step": int(metrics["first_capture/max"]) if metrics["frac_captured"] == 1 else None,
            "first capture steps": fitted.model.first_capture_step.tolist(),
            "_checkpoint": str(Path(fitted.checkpoint).resolve()),  # final state
            "_seconds": time.time() - start}


def mrp(study: Study, size: Size, mu: float, seed: int, q: int, sigma0: float, lr_scale: float) -> dict:
    """Pretrain and fine-tune: the pretraining row and the fine-tuning row of the table."""
    start, lrs, name = time.time(), step_sizes(size, lr_scale), f"k{size.k}_mu{mu:g}/seed{seed}/%s_q{q}_lr{lr_scale:g}"
    pre = study.fit(Run("mrp/teacher_student.yaml", name % "pretrain", {
        **_settings(size, mu, q=q, sigma0=sigma0, lr=lrs["pretrain"]), "trainer.max_steps": 3000 + 30 * size.k},
        seed=seed), lambda fitted: _pretrain_row(fitted, start))
    if pre.get("diverged"):
        return {"pretrain": pre, "finetune": {"diverged": True, "error": "pretraining diverged"}}
    pretrain = {k: v for k, v in pre.items() if not k.startswith("_")}
    start = time.time() - pre["_seconds"]
    finetune = study.fit(Run("mrp/finetune.yaml", name % "finetune", _settings(
        size, mu, q=q, pretrained=pre["_checkpoint"], lr=lrs["finetune"], lr_head=lrs["head"]), seed=seed),
        lambda fitted: _classifier_row(fitted, start))
    return {"pretrain": pretrain, "finetune": finetune}


def supervised(study: Study, size: Size, mu: float, seed: int, q: int, sigma0: float, lr_scale: float) -> dict:
    """Supervised learning from scratch with the same encoder: its row of the table."""
    start = time.time()
    return study.fit(Run("mrp/supervised.yaml", f"k{size.k}_mu{mu:g}/seed{seed}/supervised_q{q}_lr{lr_scale:g}",
                         _settings(size, mu, q=q, sigma0=sigma0, lr=step_sizes(size, lr_scale)["supervised"]),
                         seed=seed), lambda fitted: _classifier_row(fitted, start))


def shared_point() -> dict:  # the settings every method runs at before (and beside) the grid
    return {"q": SETTINGS.shared.q, "lr_scale": SETTINGS.shared.lr_scale}


def grid_points() -> list[dict]:
    return grid(**asdict(SETTINGS.grid))


def _point(p: dict) -> str:
    return f"q={p['q']}, lr x{p['lr_scale']:g}"


def run(study: Study, size: Size, mu: float, seed: int, with_grid: bool) -> dict:
    """All rows of one (size, mu, seed): shared settings, and with ``with_grid`` each method's best grid point."""
    sigma0 = SETTINGS.shared.sigma0
    point = shared_point()
    both = mrp(study, size, mu, seed, sigma0=sigma0, **point)
    rows = {name: {**row, "point": _point(point)} for name, row in (
        ("MRP pretraining", both["pretrain"]), ("MRP + fine-tuning", both["finetune"]),
        ("SL from scratch", supervised(study, size, mu, seed, sigma0=sigma0, **point)))}
    if with_grid:
        mrp_rows, sl_rows = [], []
        for p in grid_points():
            same = p == point
            mrp_rows.append((p, rows["MRP + fine-tuning"] if same else mrp(study, size, mu, seed, sigma0=sigma0, **p)["finetune"]))
            sl_rows.append((p, rows["SL from scratch"] if same else supervised(study, size, mu, seed, sigma0=sigma0, **p)))
        for name, points in (("MRP + fine-tuning, best of grid", mrp_rows), ("SL from scratch, best of grid", sl_rows)):
            p, row = max(points, key=lambda pr: pr[1].get("val balanced acc", -1.0))  # best val; diverged lose
            rows[name] = {**row, "point": _point(p)}
        rows["grid"] = {"MRP + fine-tuning": [{**p, **r} for p, r in mrp_rows],
                        "SL from scratch": [{**p, **r} for p, r in sl_rows]}
    return rows


COLUMNS = ["features captured", "classes with both features", "pure / same-class / cross-class kernels",
           "test acc multi-view", "test acc single-view", "val balanced acc", "all captured by step", "steps"]
NUMERIC = [c for c in COLUMNS if c != "pure / same-class / cross-class kernels"]
# Columns a row cannot have: "n/a" there, never an empty cell or a zero. Pretraining has no classifier;
# the capture step belongs to pretraining alone.
UNDEFINED = {"MRP pretraining": {"test acc multi-view", "test acc single-view", "val balanced acc"}}
PRETRAINING_ONLY = {"all captured by step"}


def summarise(per_seed: dict[int, dict]) -> dict[str, dict]:
    """Rows over seeds: ``mean (min-max)`` of every numeric column over the seeds whose run did not diverge
    (the grid-point cell says how many did), kernel counts and grid points per seed."""
    seeds = list(per_seed)
    out = {}
    for name in per_seed[seeds[0]]:
        if name == "grid":
            continue
        runs = [per_seed[s][name] for s in seeds]
        kept = [r for r in runs if not r.get("diverged")]
        row = {}
        for column in COLUMNS:
            values = [r.get(column) for r in kept]
            if column in UNDEFINED.get(name, PRETRAINING_ONLY) or not kept:
                row[column] = "n/a"
            elif column == "all captured by step":
                done = [v for v in values if v is not None]  # seeds that never captured every feature have no step
                row[column] = (f"{mean_range(done, '{:.0f}')} ({len(done)}/{len(values)} seeds)" if done
                               else f"never (0/{len(values)} seeds)")
            elif column in NUMERIC:
                row[column] = mean_range(values, "{:.0f}" if column == "steps" else "{:.3f}")
            else:
                row[column] = ", ".join(str(v) for v in values)
        points = [r.get("point") for r in runs]
        row["point"] = points[0] if len(set(points)) == 1 else "; ".join(f"seed {s}: {p}" for s, p in zip(seeds, points))
        if len(kept) < len(runs):
            row["point"] += f" ({len(runs) - len(kept)}/{len(runs)} seeds diverged)"
        out[name] = row
    return out


def gap_line(per_seed: dict[int, dict]) -> str:
    """Paired single-view differences (MRP + fine-tuning minus SL, same seed and data) per seed."""
    def gaps(mrp_name, sl_name):
        return ", ".join("n/a" if a is None or b is None else f"{a - b:+.3f}" for a, b in (
            (rows[mrp_name].get("test acc single-view"), rows[sl_name].get("test acc single-view"))
            for rows in per_seed.values()))
    line = f"shared settings {gaps('MRP + fine-tuning', 'SL from scratch')}"
    if "MRP + fine-tuning, best of grid" in next(iter(per_seed.values())):
        line += f"; best of grid {gaps('MRP + fine-tuning, best of grid', 'SL from scratch, best of grid')}"
    return line


def parse_args(argv=None) -> tuple[argparse.Namespace, list[Size]]:
    """Options and the sizes they name; every bad value is refused here, naming the option, before any run
    and before the output folder is made."""
    parser = experiment_parser(__doc__, "runs/mrp")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--preset", nargs="+", choices=sorted(SETTINGS.presets), default=None,
                        help="named sizes from configs/mrp/experiment.yaml (default tiny)")
    for knob in KNOBS:
        parser.add_argument(f"--{knob}", type=int, default=None, help=f"size knob {knob} (overrides the preset's)")
    parser.add_argument("--mu", type=float, nargs="+", default=[0.02],
                        help="share of single-view samples in pretraining and downstream training (default 0.02)")
    parser.add_argument("--grid", action="store_true", help="also run each method over the grid and report its best")
    args = parse_experiment_args(parser, argv, _refuse_bad_options)
    return args, args.sizes


def _refuse_bad_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad options, naming them; set ``args.sizes``."""
    for option, values in (("--preset", args.preset or []), ("--mu", [f"{mu:g}" for mu in args.mu])):
        if len(set(values)) != len(values):
            parser.error(f"{option}: values must be distinct, got {values}")
    if any(not 0 <= mu <= 1 for mu in args.mu):
        parser.error(f"--mu: must be in [0, 1], got {args.mu}")
    if args.k is not None and args.preset:
        parser.error("--k: give the size either with --k or with --preset, not both")
    knobs = {k: getattr(args, k) for k in KNOBS if k != "k" and getattr(args, k) is not None}
    args.sizes = sizes = ([size_rule(args.k, **knobs)] if args.k is not None else
                          [size_rule(**{**SETTINGS.presets[p], **knobs}) for p in (args.preset or ["tiny"])])
    data = Run("mrp/teacher_student.yaml", "data").resolved()["data"]["init_args"]  # fixed constants (s, C_p)
    smallest_P = data["C_p"] * (2 + 4 * data["s"])
    for size in sizes:
        for option, value, low, why in (("--k", size.k, 2, ""), ("--m", size.m, 1, ""), ("--N", size.N, 1, ""),
                                        ("--d", size.d, 2 * size.k, f" (2k for k = {size.k})"),
                                        ("--P", size.P, smallest_P, " (C_p (2 + 4 s) patches)"),
                                        ("--N2", size.N2, size.k, f" (N2 >= k = {size.k}, Assumption 2)")):
            if value < low:
                parser.error(f"{option}: must be at least {low:g}{why}, got {value}")


def figures(results: list[dict]) -> dict:
    """The headline PNGs: pretraining capture against the step (one curve per seed) and test accuracy per
    view, MRP + fine-tuning against SL (mean over seeds, min-max range as error bars)."""
    curves, bars, ranges = {}, {}, {}
    for r in results:
        group = f"k={r['size']['k']}, mu={r['mu']:g}"
        pretrained = [rows["MRP pretraining"] for rows in r["per_seed"].values()
                      if not rows["MRP pretraining"].get("diverged")]
        if pretrained:
            steps = torch.arange(max(row["steps"] for row in pretrained) + 1)[:, None]
            first = [torch.tensor(row["first capture steps"])[None] for row in pretrained]
            curves[group] = [((f >= 0) & (f <= steps)).double().mean(1) for f in first]
        for method in ("MRP + fine-tuning", "SL from scratch"):
            name = f"{group}: {method}" if len(results) > 1 else method
            bars[name], ranges[name] = {}, {}
            for view in ("multi-view", "single-view"):
                values = [rows[method][f"test acc {view}"] for rows in r["per_seed"].values()
                          if f"test acc {view}" in rows[method]]
                if values:
                    bars[name][view] = sum(values) / len(values)
                    ranges[name][view] = (min(values), max(values))
    return {"capture": curves_figure({g: range(len(c[0])) for g, c in curves.items()}, curves,
                                     xlabel="pretraining step", ylabel="share of features captured",
                                     title="MRP pretraining: features captured (one curve per seed)"),
            "accuracy": bars_figure(bars, ylabel="test accuracy", errors=ranges, zoom=True,
                                    title="Test accuracy by view (mean, min-max over seeds)")}


def report(study: Study, results: list[dict], command: str) -> dict[str, dict]:
    """Write ``mrp_table.{md,json}`` for the runs in ``results`` (one entry per (size, mu)) and print the table."""
    groups = {f"k={r['size']['k']}, mu={r['mu']:g}": summarise({int(s): rows for s, rows in r["per_seed"].items()})
              for r in results}
    for result, summary in zip(results, groups.values()):
        result["summary"] = summary
    gaps = "\n".join(f"- {group}: {gap_line(result['per_seed'])}" for group, result in zip(groups, results))
    notes = (f"`{command}`. Seeds {results[0]['seeds']}: mean (min-max) over seeds. Shared encoder q={SETTINGS.shared.q}, "
             f"sigma0={SETTINGS.shared.sigma0}; grid {asdict(SETTINGS.grid)} (best = highest balanced validation accuracy). Sizes: "
             + "; ".join(dict.fromkeys(" ".join(f"{k}={v}" for k, v in r["size"].items()) for r in results))
             + f". Val/test: {SETTINGS.num_val}/{SETTINGS.num_test} samples, single-view share "
               f"{SETTINGS.eval_mu}. Kernels: capturing kernels holding one feature / both features of one class / "
               "features of several classes (one entry per seed).")
    table = markdown_table({f"{group}: {name}": row for group, settings in groups.items()
                            for name, row in settings.items()}, ["point", *COLUMNS])  # a group per (size, mu)
    study.write("mrp_table", {"command": command, "settings": asdict(SETTINGS), "groups": results},
                f"{table}\n\nSingle-view test accuracy, MRP + fine-tuning minus SL, per seed:\n{gaps}\n\n{notes}",
                figures(results))
    return groups


def main(argv=None) -> dict:
    args, sizes = parse_args(argv)
    quiet_lightning()
    jobs = [(size, mu, seed) for size in sizes for mu in args.mu for seed in args.seed]
    fits = 3 * (1 + sum(p != shared_point() for p in grid_points())) if args.grid else 3  # pretrain, fine-tune, SL
    with Study(args, "size x mu x seed", fits=len(jobs) * fits) as study:
        per_seed = {(size, mu, seed): run(study, size, mu, seed, args.grid) for size, mu, seed in jobs}
    results = [{"size": asdict(size), "mu": mu, "seeds": args.seed,
                "per_seed": {seed: per_seed[size, mu, seed] for seed in args.seed}}
               for size in sizes for mu in args.mu]
    command = "python -m featlearn.experiments.mrp " + " ".join(sys.argv[1:] if argv is None else argv)
    return report(study, results, command)


if __name__ == "__main__":
    main()
