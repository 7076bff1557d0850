"""Shi 2024, Chapter 4, Fig. 4.4: does grokking weaken as k grows?

The chapter trains a two-layer transformer on k-input modular addition at ``(k, p) = (2, 97), (3, 31), (4, 11),
(5, 5)`` (9,409 / 29,791 / 14,641 / 3,125 tuples, half trained on) and reports that the delay between fitting
the training half and generalising to the other half shrinks as k grows. This part of
``python -m featlearn.experiments.modular_addition`` measures that delay for the chapter's MLP
(``configs/modular_addition/mlp.yaml``, width ``2^(2k-2)(p-1)``, the fused op) with one setting for every k
(:data:`GROKKING`; the transformer is a GPU workload at the chapter's size). Per run, the full-split train and
held-out accuracy every :data:`EVERY` steps, the first step at which each reaches 99% and the gap between
them; and Nanda et al.'s progress measures for k inputs (``model.ablation``): the restricted loss (only the key
frequencies' part of the logits) and the excluded loss (the training split without it).
"""
from __future__ import annotations

import math

import lightning as L

from featlearn.experiments.common import markdown_table, mean_range
from featlearn.experiments.study import Run, final_metrics
from featlearn.lightning_modules.modular_addition import theorem_width
from featlearn.metrics.figures import plt

SIZES = ((2, 97), (3, 31), (4, 11), (5, 5))
"""The chapter's (k, p), chosen for roughly equal dataset sizes."""
GROKKING = {"model.init_args.lr": 0.001, "model.init_args.lam": 0.3, "model.init_args.ablation": True}
"""One setting for every (k, p) (overrides of ``configs/modular_addition/mlp.yaml``), chosen in trials on seed 0 at
(2, 97) for the clearest delay (lambda 1.0: 800 steps; 0.3: 2300), then run unchanged at every k."""
STEPS, EVERY = 6000, 100
CURVES = {"val/train_acc": "train_acc", "val/acc": "test_acc", "theory/restricted_loss": "restricted_loss",
          "theory/excluded_loss": "excluded_loss", "val/loss": "test_loss"}


class ValidationCurves(L.Callback):
    """The logged values of :data:`CURVES` at every validation, against the step."""

    def __init__(self):
        self.curves: dict[str, list[float]] = {"step": [], **{key: [] for key in CURVES.values()}}

    def on_validation_end(self, trainer, module) -> None:
        if trainer.sanity_checking:
            return
        self.curves["step"].append(int(trainer.global_step))
        for name, key in CURVES.items():
            value = trainer.callback_metrics.get(name)
            self.curves[key].append(None if value is None else round(float(value), 5))


def first_step(steps: list[int], values: list[float | None], level: float = 0.99) -> int | None:
    """The first step whose value reaches ``level`` (None: never).

    Example:
        >>> first_step([100, 200, 300], [0.5, 0.995, 1.0])
        200
    """
    return next((s for s, v in zip(steps, values) if v is not None and v >= level), None)


def grokking_runs(study, seeds: list[int], steps: int = STEPS) -> dict:
    """Fit every (k, p) of :data:`SIZES` for each seed; per run its final metrics, curves, the 99% steps and gap."""
    results = {}
    for seed in seeds:
        for k, p in SIZES:
            curves = ValidationCurves()

            def collect(fitted, curves=curves):
                c = curves.curves
                train, test = first_step(c["step"], c["train_acc"]), first_step(c["step"], c["test_acc"])
                return {**final_metrics(fitted), "curves": c, "train_99": train, "test_99": test,
                        "gap": None if train is None or test is None else test - train}
            run = Run("modular_addition/mlp.yaml", f"grokking/k{k}_p{p}/seed{seed}",
                      {**GROKKING, "data.init_args.k": k, "data.init_args.p": p, "trainer.max_steps": steps,
                       "data.init_args.batch_size": min(1024, p ** k // 2),  # a split smaller than 1024: full batch
                       "trainer.val_check_interval": min(EVERY, steps), "heatmap.every_n_steps": steps}, seed=seed)
            results.setdefault(f"k={k}, p={p}", {})[seed] = study.fit(run, collect=collect, callbacks=[curves])
    return results


def steps_cell(values: list[int | None]) -> str:
    """``mean (min-max)`` of the runs that reached the level, and how many never did.

    Example:
        >>> steps_cell([1200, 1800]), steps_cell([None, None]), steps_cell([4800, None])
        ('1500 (1200-1800)', 'never', '4800 (1 of 2 never)')
    """
    reached = [v for v in values if v is not None]
    if not reached:
        return "never"
    cell = mean_range(reached, "{:.0f}")
    return cell if len(reached) == len(values) else f"{cell} ({len(values) - len(reached)} of {len(values)} never)"


def grokking_table(results: dict) -> str:
    """Per (k, p): the 99% steps, the gap, the final accuracies, over seeds; then the chapter's prediction and
    whether the mean gap (over the seeds that generalised) shrinks with k.

    Example:
        >>> runs = {"k=2, p=97": {0: {"train_99": 300, "test_99": 2000, "gap": 1700, "test_acc": 1.0}},
        ...         "k=3, p=31": {0: {"train_99": 400, "test_99": 900, "gap": 500, "test_acc": 1.0}},
        ...         "k=5, p=5": {0: {"train_99": 400, "test_99": None, "gap": None, "test_acc": 0.02}}}
        >>> text = grokking_table(runs)
        >>> text.splitlines()[2].split(" | ")[:4], text.splitlines()[-1].split(" | ")[-1]
        (['| k=2, p=97', '9,409', '384', '300'], 'yes, over k = 2, 3 (k = 5: never generalised) |')
    """
    columns = ["tuples", "width", "train 99% step", "held-out 99% step", "gap (steps)", "held-out acc",
               "gap shrinks with k"]
    rows, gaps, never = {}, {}, []
    for name, per_seed in results.items():
        k, p = (int(part.split("=")[1]) for part in name.split(", "))
        runs = list(per_seed.values())
        gap = [r.get("gap") for r in runs]
        reached = [g for g in gap if g is not None]
        if reached:
            gaps[k] = sum(reached) / len(reached)
        else:
            never.append(k)
        rows[name] = {"tuples": f"{p ** k:,}", "width": theorem_width(k, p),
                      "train 99% step": steps_cell([r.get("train_99") for r in runs]),
                      "held-out 99% step": steps_cell([r.get("test_99") for r in runs]),
                      "gap (steps)": steps_cell(gap), "held-out acc": mean_range([r.get("test_acc") for r in runs]),
                      "gap shrinks with k": ""}
    means = [gaps[k] for k in sorted(gaps)]
    verdict = "n/a" if len(means) < 2 else "yes" if all(a > b for a, b in zip(means, means[1:])) else "no"
    if len(means) >= 2:
        verdict += f", over k = {', '.join(map(str, sorted(gaps)))}"
    if never:
        verdict += f" (k = {', '.join(map(str, never))}: never generalised)"
    rows["predicted (Fig. 4.4)"] = {**{c: "" for c in columns}, "gap (steps)": "shrinks as k grows",
                                    "gap shrinks with k": verdict}
    return markdown_table(rows, columns)


def notes(seeds: list[int], steps: int, wall: float) -> str:
    """The table's settings line."""
    setting = ", ".join(f"{key.split('.')[-1]} {value}" for key, value in GROKKING.items())
    return (f"The chapter's MLP at its width 2^(2k-2)(p-1), half of the tuples trained on, batch 1024, AdamW (0.9, "
            f"0.98) with 10 warm-up steps, lambda as weight decay; the same setting for every (k, p): {setting}; "
            f"{steps} steps, the whole of both splits evaluated every {min(EVERY, steps)} steps. Seeds "
            f"{' '.join(map(str, seeds))}{': mean (min-max)' if len(seeds) > 1 else ''} of the seeds that reached "
            f"99% (never: no seed did). Wall time {wall:.0f} s.")


def grokking_figures(results: dict, seed: int) -> dict:
    """For one seed, one colour per (k, p): train (solid) and held-out (dashed) accuracy against the step; the
    restricted (solid) and excluded (dashed) losses against the step."""
    runs = {name: per_seed[seed]["curves"] for name, per_seed in results.items() if seed in per_seed}
    panels = {"accuracy": (("train_acc", "test_acc"), "accuracy (train solid, held-out dashed)",
                                    "grokking against k"),
              "progress": (("restricted_loss", "excluded_loss"), "loss (restricted solid, excluded dashed)",
                                    "progress measures")}
    figures = {}
    for stem, ((solid, dashed), ylabel, title) in panels.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.0), constrained_layout=True)
        for i, (name, c) in enumerate(runs.items()):
            for key, style in ((solid, "-"), (dashed, "--")):
                values = [math.nan if v is None else v for v in c[key]]
                ax.plot(c["step"], values, style, color=f"C{i}", label=name if style == "-" else None)
        ax.set(xlabel="step", ylabel=ylabel, title=f"{title} (the MLP, seed {seed})")
        if stem == "progress":  # losses from 1e-5 to ~100: linear below 0.01, logarithmic above
            ax.set_yscale("symlog", linthresh=0.01)
        ax.legend()
        figures[stem] = fig
    return figures
