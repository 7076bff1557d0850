"""Capture probability of MRP pretraining against m (kernels per class): where the size rule's m comes from.

    python -m featlearn.experiments.mrp_capture --points k8=4,6,8 tiny=4,6,8 k16=5,7@5 --seed 0 1 2 3 4 5 6 7 8 9

Each point ``PRESET=M,M,...`` is a size of ``configs/mrp/experiment.yaml`` (d, P as the preset gives them, N by
:func:`featlearn.experiments.mrp.size_rule`) at each listed m; ``@S`` runs only the first S seeds of ``--seed``
there. Every run is the MRP experiment's pretraining (``configs/mrp/teacher_student.yaml`` at the shared
encoder q, sigma0, lr x1 and mu = 0.02, the same overrides as ``experiments/mrp.py``), with labels, fine-tuning
and SL left out: capture is decided by pretraining alone. Two differences, neither touching the dynamics:
pretraining stops at the step the last feature is captured (``stop_after_capture: 0``; the experiment runs 200
steps more) or at ``--horizon`` steps (default 1200; ``cap``: the experiment's 3000 + 30 k), and the figure
and metric logging is sparse. The horizon can bind (a late feature at step 1776 at k = 10), so a shorter one only
lowers the capture share; the table gives the latest first-capture step at each point, and ``--horizon cap`` re-runs
the seeds that missed a feature to the experiment's cap (``benchmarks/results/mrp/mrp_capture_cap.md``).

Per point: the share of seeds that capture every one of the 2k features (with a 95% Wilson interval), the mean
share of features captured, and the seconds per fit. Per k: the smallest measured m whose capture share is at
least 0.9, against the size rule's m. Writes ``mrp_capture.{md,json,png}``; ``<out>/study.json`` keeps each
finished fit, and seeds or m values added to the same command resume (only the new fits run).
"""
import argparse
import math
import sys
import time
from dataclasses import asdict

import torch

from featlearn.experiments import mrp
from featlearn.experiments.common import experiment_parser, parse_experiment_args, quiet_lightning
from featlearn.experiments.study import Run, Study
from featlearn.metrics.figures import plt

TARGET = 0.9  # the capture share the size rule is chosen for
MU = 0.02  # the experiment's main training share of single-view samples (the lottery ignores labels)


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial share (sensible at 0/n and n/n, unlike the normal one).

    Example:
        >>> [round(v, 3) for v in wilson(10, 10)]
        [0.722, 1.0]
    """
    p, z2 = successes / n, z * z
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def pretrain_run(size: mrp.Size, seed: int, horizon: int, name: str) -> Run:
    """The experiment's pretraining run at ``size`` (shared encoder, lr x1), stopped at full capture or ``horizon``."""
    shared = mrp.SETTINGS.shared
    lr = mrp.step_sizes(size, shared.lr_scale)["pretrain"]
    return Run("mrp/teacher_student.yaml", name, {
        **mrp._settings(size, MU, q=shared.q, sigma0=shared.sigma0, lr=lr),
        "model.init_args.stop_after_capture": 0, "trainer.max_steps": horizon,
        "trainer.log_every_n_steps": 100, "heatmap.every_n_steps": 10 ** 6}, seed=seed)


def capture_row(fitted, start: float) -> dict:
    """What decides capture: each feature's first-capture step (-1: never), the count, the final step."""
    first = fitted.model.first_capture_step.tolist()
    captured = sum(s >= 0 for s in first)
    return {"features": len(first), "captured": captured, "all captured": captured == len(first),
            "frac captured at end": round(float(fitted.model.final_metrics()["frac_captured"]), 4),
            "first capture steps": first, "steps": fitted.steps,
            "seconds": round(time.time() - start, 1)}


def fit_one(study: Study, size: mrp.Size, seed: int, horizon: int, name: str) -> dict:
    start = time.time()
    return study.fit(pretrain_run(size, seed, horizon, name), lambda fitted: capture_row(fitted, start))


def summarise(rows: list[dict]) -> dict:
    """One point over its seeds (diverged fits count as not capturing)."""
    n, full = len(rows), sum(bool(r.get("all captured")) for r in rows)
    low, high = wilson(full, n)
    shares = [r["captured"] / r["features"] if "captured" in r else 0.0 for r in rows]
    steps = [s for r in rows for s in r.get("first capture steps", []) if s >= 0]
    return {"seeds": n, "all captured": full, "capture probability": round(full / n, 3),
            "95% interval": [round(low, 3), round(high, 3)], "mean share captured": round(sum(shares) / n, 4),
            "min share captured": round(min(shares), 4), "latest capture step": max(steps, default=None),
            "seconds per fit": round(sum(r.get("seconds", 0.0) for r in rows) / n, 1)}


def choose(points: dict[int, dict[int, dict]]) -> dict[int, int | None]:
    """Per k, the smallest measured m with capture probability >= TARGET (None: no measured m reaches it)."""
    return {k: next((m for m in sorted(by_m) if by_m[m]["capture probability"] >= TARGET), None)
            for k, by_m in points.items()}


def parse_points(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--points PRESET=M,M[@S]`` into ``args.plan``: (preset, size, m, seeds) per point; refused by name."""
    plan = []
    for text in args.points:
        preset, _, rest = text.partition("=")
        ms, _, count = rest.partition("@")
        if preset not in mrp.SETTINGS.presets or not ms:
            parser.error(f"--points: must be PRESET=M,M,... with PRESET one of {sorted(mrp.SETTINGS.presets)}, got {text}")
        try:
            values, n = [int(m) for m in ms.split(",")], int(count) if count else len(args.seed)
        except ValueError:
            parser.error(f"--points: m values and @S must be integers, got {text}")
        if any(m < 1 for m in values) or len(set(values)) != len(values) or not 1 <= n <= len(args.seed):
            parser.error(f"--points: distinct m >= 1 and 1 <= S <= {len(args.seed)} seeds, got {text}")
        plan += [(preset, mrp.size_rule(**{**mrp.SETTINGS.presets[preset], "m": m}), m, args.seed[:n]) for m in values]
    if len({(p, m) for p, _, m, _ in plan}) != len(plan):
        parser.error(f"--points: each (preset, m) once, got {args.points}")
    args.plan = plan


def parse_args(argv=None) -> argparse.Namespace:
    parser = experiment_parser(__doc__, "runs/mrp_capture")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--points", nargs="+", required=True, help="PRESET=M,M,...[@S] (see above)")
    parser.add_argument("--horizon", default="1200",
                        help="pretraining steps at most (default 1200), or cap: the experiment's 3000 + 30 k")
    args = parse_experiment_args(parser, argv, parse_points)
    if args.horizon != "cap" and not (args.horizon.isdigit() and int(args.horizon) >= 1):
        parser.error(f"--horizon: must be a step count >= 1 or cap, got {args.horizon}")
    args.horizon = args.horizon if args.horizon == "cap" else int(args.horizon)
    return args


def horizon_at(horizon: int | str, k: int) -> int:
    return 3000 + 30 * k if horizon == "cap" else int(horizon)


def figure(points: dict[int, dict[int, dict]], rule: dict[int, int]):
    fig, ax = plt.subplots(figsize=(6.4, 4.0), constrained_layout=True)
    for i, (k, by_m) in enumerate(sorted(points.items())):
        ms = sorted(by_m)
        p = [by_m[m]["capture probability"] for m in ms]
        lo = [p_ - by_m[m]["95% interval"][0] for p_, m in zip(p, ms)]
        hi = [by_m[m]["95% interval"][1] - p_ for p_, m in zip(p, ms)]
        ax.errorbar([m + 0.06 * (i - 1) for m in ms], p, yerr=[lo, hi], marker="o", capsize=3, color=f"C{i}",
                    label=f"k = {k} (rule m = {rule[k]})")
    ax.axhline(TARGET, color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="m (kernels per class)", ylabel="share of seeds capturing every feature", ylim=(-0.03, 1.03),
           title="MRP pretraining: capture probability (95% Wilson interval)")
    ax.legend()
    return fig


def main(argv=None) -> dict:
    args = parse_args(argv)
    quiet_lightning()
    # only the horizon defines the fits beyond their own specs, so adding points or seeds resumes this folder
    options = argparse.Namespace(out=args.out, overwrite=args.overwrite, seed=args.seed, horizon=args.horizon)
    with Study(options, "(k, m) x seed", fits=sum(len(seeds) for *_, seeds in args.plan)) as study:
        rows = {(size.k, m): {seed: fit_one(study, size, seed, horizon_at(args.horizon, size.k),
                                            f"{preset}_m{m}/seed{seed}") for seed in seeds}
                for preset, size, m, seeds in args.plan}
    points: dict[int, dict[int, dict]] = {}
    for (k, m), per_seed in rows.items():
        points.setdefault(k, {})[m] = summarise(list(per_seed.values()))
    rule = {k: mrp.size_rule(k).m for k in points}
    chosen = choose(points)
    command = "python -m featlearn.experiments.mrp_capture " + " ".join(sys.argv[1:] if argv is None else argv)
    head = ("| k | m | seeds | all captured | capture probability (95% interval) | mean share captured (min) "
            "| latest capture step | s per fit |\n|---|---|---|---|---|---|---|---|")
    lines = [f"| {k} | {m}{' (rule)' if m == rule[k] else ''} | {r['seeds']} | {r['all captured']}/{r['seeds']} | "
             f"{r['capture probability']:.2f} ({r['95% interval'][0]:.2f}-{r['95% interval'][1]:.2f}) | "
             f"{r['mean share captured']:.3f} ({r['min share captured']:.3f}) | {r['latest capture step']} | "
             f"{r['seconds per fit']} |" for k, by_m in sorted(points.items()) for m, r in sorted(by_m.items())]
    picks = "; ".join(f"k = {k}: m = {chosen[k] if chosen[k] is not None else 'none measured'} (rule {rule[k]})"
                      for k in sorted(points))
    sizes = "; ".join(f"{p}: " + " ".join(f"{n}={v}" for n, v in asdict(s).items() if n != "m") for p, s, *_ in
                      {p: (p, s) for p, s, *_ in args.plan}.values())
    text = (f"{head}\n" + "\n".join(lines) + f"\n\nSmallest measured m with capture probability >= {TARGET}: {picks}."
            f"\n\n`{command}`. Pretraining only (teacher-student, q = {mrp.SETTINGS.shared.q}, sigma0 = "
            f"{mrp.SETTINGS.shared.sigma0}, lr x{mrp.SETTINGS.shared.lr_scale:g}, mu = {MU}), stopped at full capture "
            f"or step {'3000 + 30 k' if args.horizon == 'cap' else args.horizon}. Sizes: {sizes}. A seed captures a feature when some kernel's correlation with "
            "it reaches rho = 0.25 at some step.")
    results = {"command": command, "horizon": args.horizon, "target": TARGET, "rule": rule, "chosen": chosen,
               "points": {str(k): {str(m): r for m, r in sorted(by_m.items())} for k, by_m in sorted(points.items())},
               "per_seed": {f"k{k}_m{m}": {str(s): r for s, r in per_seed.items()} for (k, m), per_seed in rows.items()}}
    study.write("mrp_capture", results, text, {"curve": figure(points, rule)})
    return results


if __name__ == "__main__":
    main()
