"""The two-layer experiment's table (:mod:`featlearn.experiments.two_layer`): cells and markdown."""
from __future__ import annotations

from featlearn.experiments.common import mean_range

ROWS = ("Train", "Test", "Cos")
MOG_ROWS = ("Train", "Test", "Cos centres min", "Cos centres mean")


def cells(result: dict) -> dict[str, str]:
    """A column's cells: train and test accuracy (%) and the cosines, ``mean (min-max)`` over its seeds."""
    seeds = list(result["per_seed"].values())

    def cos(key):
        return "NA" if seeds[0].get(key) is None else mean_range([r.get(key) for r in seeds], "{:.3f}")
    return {"Train": mean_range([r.get("train") for r in seeds], "{:.1f}"),
            "Test": mean_range([r.get("test") for r in seeds], "{:.1f}"),
            "Cos": cos("cos"), "Cos centres min": cos("cos_centres_min"), "Cos centres mean": cos("cos_centres_mean")}


def stop_cell(result: dict) -> str:
    """The global steps at which a column's fits were stopped on validation: ``min-max`` over seeds (``-`` for an
    exact readout, where every step gives the same model)."""
    steps = [r.get("stop") for r in result["per_seed"].values()]
    if result["lr3_mult"] is None or any(s is None for s in steps):
        return "-"
    return str(min(steps)) if min(steps) == max(steps) else f"{min(steps)}-{max(steps)}"


def markdown(results: dict, meta: dict, paper_numbers: dict, reg3_mult: float) -> str:
    """The table as markdown: per setting a row per quantity, ``mean (min-max)`` over seeds (the paper's value
    in parentheses beside ours, except on the mixtures), and each column's chosen step-size pair."""
    mog = meta["table"] == "MOG"
    first = meta["seeds"].split(",")[0].split("..")[0]
    budget = (f"its step size chosen from x{meta['lr3_grid']} of the theory's" if mog else
              f"{meta['stage3_steps']} stage-3 minibatch steps after steps 1-2, the first layer's step x"
              f"{meta['lr3_grid']} and the second layer's x{meta['lr3a_grid']} of the theory's eta at T = "
              f"{meta['T']}, every pair tried, the pair chosen")
    stop = "" if mog or not meta.get("stop_check_every") else (
        f" In every such fit the stopping step is chosen on validation accuracy too, scored every "
        f"{meta['stop_check_every']} global steps, the best state kept (row 'stop step').")
    lines = [f"Shi 2024, Chapter 2, Table {meta['table']}: measured{'' if mog else ' (paper)'}. {meta['command']}", "",
             f"seeds {meta['seeds']}; n = {meta['num_train']} training samples; wall {meta['wall_s']} s. Same tuning "
             f"budget for every column that takes stage-3 steps: {budget} on validation accuracy (seed {first}); "
             f"lambda^(3..T) x{reg3_mult}." + stop +
             ("" if mog else " One / Two Step: the best classifier on the frozen hidden layer, solved exactly "
                             "(L2-SVM, Newton; 'exact'), as the paper's 'best classifiers'."), ""]
    if mog:
        lines[-1:-1] = ["The paper prints no accuracies for these runs. Network: 'typical practice' training "
                        "(configs/two_layer/mog.yaml: plain minibatch steps from the first, no feature-learning "
                        "steps); Cos centres: over the 2^k cluster centres, the best neuron's cosine with each, "
                        "worst (min) and mean (RF: the init's; NA for the NTK)."]
    for name, res in results.items():
        methods = list(res)
        paper = paper_numbers.get(name) or {}
        reused = next((r["tuned_on"] for r in res.values() if r.get("tuned_on")), None)
        lines += [f"**{name}**" + (f" (step sizes: the pairs chosen at {reused}, not searched again)" if reused
                                   else ""), "", "| row | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for i, row in enumerate(MOG_ROWS if mog else ROWS):
            row_cells = []
            for label in methods:
                ours = cells(res[label])[row]
                if mog:
                    row_cells.append(ours)
                    continue
                theirs = paper.get(label, [None] * 3)[i]
                row_cells.append(f"{ours} ({'NA' if theirs is None else theirs})")
            lines.append(f"| {row} | " + " | ".join(row_cells) + " |")
        lines.append("| lr3 x | " + " | ".join(res[m]["lr3_mult"] or "exact" for m in methods) + " |")
        if meta.get("stop_check_every") and not mog:
            lines.append("| stop step | " + " | ".join(stop_cell(res[m]) for m in methods) + " |")
        lines.append("")
    return "\n".join(lines)
