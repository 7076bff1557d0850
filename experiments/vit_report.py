"""The report of :mod:`featlearn.experiments.vit`: one row per method and data point (the mean over seeds of
the per-seed results), the markdown table with its predicted-vs-measured lines, and the figures (mean area
attention, one local query's attention on the grid, the theory curves over training).

Example:
    >>> _cell([{"x": 0.5}, {"x": 1.0}], "x", "{:.2f}")
    '0.75 (0.50-1.00)'
"""
from __future__ import annotations

import math

import numpy as np
import torch

from featlearn.experiments.common import mean_range
from featlearn.metrics.figures import plt

METHODS = ("mae", "cl")
LABELS = {"mae": "MAE", "cl": "CL"}
# the numbers of a row: means over seeds of the per-seed values (the per-seed values stay in the row)
NUMBERS = ("own_area_local", "own_area_global", "attn_global", "attn_to_masked", "final_loss", "loss_floor",
           "phi_local_to_global_min", "phi_local_to_global_argmin_step", "phi_local_to_global", "phi_local_own",
           "phi_global_own", "init_own_area_local", "init_own_area_global", "init_attn_global",
           "step_own_local_half", "phi_local_to_global_at_half", "phi_local_own_early", "phi_local_to_global_early")
ATTN_HALF = 0.5  # the own-area attention of local queries that marks phase II (rapid growth) in the curves


def summarise(method: str, point, runs: list[dict]) -> dict:
    """One row of ``point`` (a data point: its ``name`` and ``label``): the mean over seeds of every number
    (None where a seed lacks it), and the seeds' runs."""
    first = runs[0]
    row = {"method": method, "point": point.name, "data": point.label, "delta": first["delta"],
           "delta_eff": first["delta_eff"], "P": first["P"], "K": first["K"], "d": first["d"],
           "C_1": first["C_1"], "C_s": first["C_s"], "n_local": first["n_local"], "mask_ratio": first["mask_ratio"],
           "lr": first["lr"], "steps": first["steps"], "early_step": first["early_step"],
           "seeds": [r["seed"] for r in runs]}
    for key in NUMBERS:
        values = [r.get(key) for r in runs]
        row[key] = None if any(v is None for v in values) else sum(values) / len(values)
    row["attn_global_end_minus_init"] = row["attn_global"] - row["init_attn_global"]
    row["own_area_local_end_minus_init"] = row["own_area_local"] - row["init_own_area_local"]
    # Huang et al. 2025, Thm 4.2(b) and App. F.2: for Delta > 0 the global correlation of a local patch stops near
    # -(Delta / 2L) ln P (L = z_low)
    row["theory_dip"] = (-(first["delta_eff"] / (2 * first["z_low"])) * math.log(first["P"])
                         if method == "mae" and first["delta_eff"] > 0 else None)
    row["per_seed"] = runs
    return row


def _cell(runs: list[dict], key: str, fmt: str, spread: bool = True) -> str:
    """``mean (min-max)`` over seeds, or one value where every seed gives it (or ``spread`` is off: the mean)."""
    values = [r.get(key) for r in runs]
    if None in values:
        return "n/a"
    if not spread or len({fmt.format(v) for v in values}) == 1:
        return fmt.format(sum(values) / len(values))
    return mean_range(values, fmt)


def markdown(rows: list[dict], meta: dict) -> str:
    """The table and the predicted-vs-measured lines, every number from ``rows``."""
    head = ("| method | data | Delta (eff) | steps, eta | own-area attn, local queries | init | own-area attn, "
            "global queries | local queries' attn to the global area | init | attn to masked keys | final loss | "
            "floor | phi_loc->glob: min over steps (step) | phi_loc->glob end | phi_loc->own | phi_glob->own |")
    lines = ["# One-layer softmax ViT: MAE vs contrastive learning across Delta (Huang et al. 2025)", "",
             f"`{meta['command']}`", "", head, "|" + "---|" * 16]
    for r in rows:
        runs = r["per_seed"]
        lines.append("| " + " | ".join([
            LABELS[r["method"]], r["data"],
            f"{r['delta']:+.2f} ({r['delta_eff']:+.3f})" if r["delta"] is not None else f"({r['delta_eff']:+.3f})",
            f"{r['steps']}, {r['lr']:.3g}", _cell(runs, "own_area_local", "{:.3f}"),
            _cell(runs, "init_own_area_local", "{:.3f}", False), _cell(runs, "own_area_global", "{:.3f}"),
            _cell(runs, "attn_global", "{:.3f}"), _cell(runs, "init_attn_global", "{:.3f}", False),
            _cell(runs, "attn_to_masked", "{:.3f}"), _cell(runs, "final_loss", "{:.4f}"), _cell(runs, "loss_floor", "{:.4f}"),
            f"{_cell(runs, 'phi_local_to_global_min', '{:.2f}')} "
            f"({_cell(runs, 'phi_local_to_global_argmin_step', '{:.0f}', False)})",
            _cell(runs, "phi_local_to_global", "{:.2f}"), _cell(runs, "phi_local_own", "{:.2f}"),
            _cell(runs, "phi_global_own", "{:.2f}"),
        ]) + " |")
    lines += ["", *checks(rows), "", notes(meta)]
    return "\n".join(lines)


def checks(rows: list[dict]) -> list[str]:
    """Predicted against measured, one line per prediction and data point (means over seeds)."""
    out = ["Predicted vs measured (means over seeds):"]
    mae = [r for r in rows if r["method"] == "mae"]
    cl = [r for r in rows if r["method"] == "cl"]
    for r in mae:
        ok = r["own_area_local"] >= 0.85 and r["own_area_global"] >= 0.9
        out.append(f"- MAE attends to its own area ({r['point']}, Delta {r['delta_eff']:+.2f}; Thm 4.1, our "
                   f"thresholds: local >= 0.85, global >= 0.9): local {r['own_area_local']:.3f}, "
                   f"global {r['own_area_global']:.3f}, global area from local queries {r['attn_global']:.3f}: "
                   f"{'holds' if ok else 'FAILS'}.")
    for r in mae:
        gap = [s["final_loss"] - s["loss_floor"] for s in r["per_seed"]]
        out.append(f"- MAE loss above its batch's floor ({r['point']}): final loss - floor "
                   f"{min(gap):.4f} to {max(gap):.4f} over seeds (expected floor "
                   f"{r['per_seed'][0]['loss_floor_expected']:.4f}): {'holds' if min(gap) >= -1e-6 else 'FAILS'}.")
    for r in mae:
        last = r["phi_local_to_global_argmin_step"] >= r["steps"] - 1
        phase = ("" if r["step_own_local_half"] is None else
                 f"; when local own-area attention first reached {ATTN_HALF} (step {r['step_own_local_half']:.0f}) "
                 f"phi_loc->glob was {r['phi_local_to_global_at_half']:.2f}")
        theory = ("-(Delta/2L) ln P = %.2f" % r["theory_dip"] if r["theory_dip"] is not None
                  else "Delta < 0: no dip, |Phi_glob| <= O(Phi_own / P^-Delta)")
        out.append(f"- MAE dip of phi_loc->glob ({r['point']}, Delta {r['delta_eff']:+.2f}): min "
                   f"{r['phi_local_to_global_min']:.2f} at step {r['phi_local_to_global_argmin_step']:.0f} of "
                   f"{r['steps']} ({theory}){phase}"
                   f"{'; the minimum is the last step: no recovery within the budget' if last else ''}.")
    pos = [r for r in mae if r["delta_eff"] > 0.05]
    # each Delta > 0 point against one reference: the most negative Delta
    neg = sorted((r for r in mae if r["delta_eff"] < -0.05), key=lambda r: r["delta_eff"])[:1]
    for p in pos:
        for n in neg:
            if None in (p["step_own_local_half"], n["step_own_local_half"]):
                continue
            ok = p["step_own_local_half"] >= 1.5 * n["step_own_local_half"]
            out.append(f"- Two phases for Delta > 0 (phase I moves the global correlation while the own one stays near "
                       f"0, so own-area learning starts later than at Delta < 0; {p['point']} vs {n['point']}): at step "
                       f"{p['early_step']} phi_loc->own {p['phi_local_own_early']:.2f} vs {n['phi_local_own_early']:.2f} "
                       f"and phi_loc->glob {p['phi_local_to_global_early']:.2f} vs {n['phi_local_to_global_early']:.2f}; "
                       f"local own-area attention reaches {ATTN_HALF} at step {p['step_own_local_half']:.0f} vs "
                       f"{n['step_own_local_half']:.0f} (a delay of 1.5x or more would show the phases): "
                       f"{'holds' if ok else 'FAILS'}.")
            ok = p["phi_local_to_global_min"] <= 2 * n["phi_local_to_global_min"] < 0
            out.append(f"- The dip is at least 2x deeper for Delta > 0 (Thm 4.2, our 2x threshold; {p['point']} vs "
                       f"{n['point']}): {p['phi_local_to_global_min']:.2f} vs "
                       f"{n['phi_local_to_global_min']:.2f}, ratio "
                       f"{p['phi_local_to_global_min'] / n['phi_local_to_global_min']:.1f}: "
                       f"{'holds' if ok else 'FAILS'}.")
    for r in cl:
        rise = r["attn_global"] - r["init_attn_global"]
        own = r["own_area_local"] - r["init_own_area_local"]
        ok = rise > 0.05 and own <= 0.005
        out.append(f"- CL collapses onto the global area ({r['point']}, Delta {r['delta_eff']:+.2f}): local queries' "
                   f"attention to the global area {r['init_attn_global']:.3f} -> {r['attn_global']:.3f} "
                   f"({rise:+.3f}), own local area {r['init_own_area_local']:.4f} -> {r['own_area_local']:.4f} "
                   f"({own:+.4f}; Thm 4.4, our tolerance: <= +0.005): {'holds' if ok else 'FAILS'}.")
    for r in mae:
        other = next((c for c in cl if c["point"] == r["point"]), None)
        if other is not None:
            ok = r["own_area_local"] > other["own_area_local"] + 0.5
            out.append(f"- Headline ({r['point']}): own-area attention of local queries MAE {r['own_area_local']:.3f} "
                       f"vs CL {other['own_area_local']:.3f}: {'holds' if ok else 'FAILS'}.")
    return out


def notes(meta: dict) -> str:
    return (f"Seeds {meta['seeds']}: each cell is the value (one seed) or mean (min-max). End values: the "
            f"module's final_metrics() on its last training batch (B = 32). Own-area attention of local "
            f"queries counts queries whose own area has an unmasked patch (the event E_{{k,n}} of Lemma D.6); "
            f"MAE metrics read masked queries, CL metrics every query of the anchor view X^+. init: mean over "
            f"seeds at step 0 on the fixed held-out batch ({meta['eval_batch']} validation samples), theory "
            f"(1 - gamma) C / P (uniform attention at Q = 0). Final loss: MAE per masked patch against the floor "
            f"of the same batch, 1/2 z_a^2 summed over the masked patches whose whole area is masked, per masked "
            f"patch (a lower bound of that batch's loss; its expectation is 1/2 E[z^2] P(area fully masked | p "
            f"masked), loss_floor_expected, which one batch's loss can fall below); CL the in-batch InfoNCE loss against the cluster-only level tau E[log(1 + n)], n ~ "
            f"Bin(B - 1, 1/K) (not a strict bound). phi_loc->glob: mean over local positions of Phi_{{p -> "
            f"v_k,1}}, its minimum over every step (0 at step 0 if it never falls) and the step of it (mean over "
            f"seeds); the theory's plateau for Delta > 0 is -(Delta/2L) ln P with L = 0.9. Wall time "
            f"{meta['wall_s']:.0f} s on {meta['threads']} thread(s)."
            + (f" Diverged runs, left out of the means: {', '.join(meta['diverged'])}." if meta["diverged"] else ""))


def _panel_grid(n_rows: int, n_cols: int, width: float = 3.6, height: float = 3.0):
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(width * n_cols, height * n_rows), constrained_layout=True,
                             squeeze=False)
    return fig, axes


def _method_point_panels(rows: list[dict], width: float = 3.6, height: float = 3.0):
    """A grid with a row per method (MAE above CL) and a column per data point; returns the figure, the axes
    and an iterator of ``(ax, method, row)`` over the cells that have a result (the others are blanked)."""
    points = list(dict.fromkeys(r["point"] for r in rows))
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    fig, axes = _panel_grid(len(methods), len(points), width, height)

    def cells():
        for i, method in enumerate(methods):
            for j, point in enumerate(points):
                row = next((r for r in rows if r["method"] == method and r["point"] == point), None)
                if row is None:
                    axes[i][j].axis("off")
                else:
                    yield axes[i][j], method, row

    return fig, axes, cells()


def areas_figure(rows: list[dict], ends: dict) -> plt.Figure:
    """Mean area attention (query area x key area, last column the masked keys) at the end of training, first
    seed, MAE above CL, one column per data point; one colour scale [0, 1]."""
    fig, axes, cells = _method_point_panels(rows)
    image = None
    for ax, method, row in cells:
        matrix = np.asarray(ends[method, row["point"], row["seeds"][0]]["area_matrix"], dtype=np.float64)
        image = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", interpolation="nearest")
        ax.set(xlabel="key area (0 = global; last: masked keys)", ylabel="query area (0 = global)",
               title=f"{LABELS[method]}, Delta {row['delta_eff']:+.2f}, step {row['steps']}")
    if image is not None:
        fig.colorbar(image, ax=axes, label="mean attention (seed %d)" % rows[0]["seeds"][0])
    return fig


def queries_figure(rows: list[dict], ends: dict) -> plt.Figure:
    """One local query's attention over the 16 x 16 grid at the end of training (first seed; MAE above CL);
    star: the query, white squares: its own area, red dots: the global area. A fixed scale per method (its
    ``sample_vmax``), a colour bar per panel."""
    fig, _, cells = _method_point_panels(rows, 3.8, 3.4)
    for ax, method, row in cells:
        end = ends[method, row["point"], row["seeds"][0]]
        area = torch.tensor(end["area"])
        side = math.isqrt(area.numel())
        attn = np.asarray(end["query_attention"], dtype=np.float64).reshape(side, side)
        image = ax.imshow(attn, vmin=0.0, vmax=end["vmax"], cmap="viridis", interpolation="nearest")
        own, glob = torch.nonzero(area == end["query_area"]).squeeze(1), torch.nonzero(area == 0).squeeze(1)
        r_own, c_own, r_glob, c_glob = own // side, own % side, glob // side, glob % side
        ax.scatter(c_glob, r_glob, marker=".", s=6, color="red")
        ax.scatter(c_own, r_own, marker="s", s=40, facecolors="none", edgecolors="white", linewidths=0.9)
        q = end["query"]
        ax.scatter([q % side], [q // side], marker="*", s=70, color="orange")
        ax.set(xlabel="grid column", ylabel="grid row",
               title=f"{LABELS[method]}, Delta {row['delta_eff']:+.2f}\nlocal query {q} (area {end['query_area']})")
        fig.colorbar(image, ax=ax, shrink=0.85, label="attention")
    return fig


def curves_panels(rows: list[dict]) -> plt.Figure:
    """phi_local_own, phi_local_to_global, attn_own_local and attn_glob_from_local against the step on the
    held-out batch: one colour per (method, data point), one line per seed; dashed: -(Delta/2L) ln P."""
    panels = (("phi_local_own", "phi_local_own: Phi(p -> own local feature)"),
              ("phi_local_to_global", "phi_local_to_global: Phi(local p -> global feature)"),
              ("attn_own_local", "own-area attention, local queries"),
              ("attn_glob_from_local", "local queries' attention to the global area"))
    fig, axes = _panel_grid(2, 2, 5.4, 3.8)
    for k, (key, title) in enumerate(panels):
        ax = axes[k // 2][k % 2]
        for i, r in enumerate(rows):
            for j, run in enumerate(r["per_seed"]):
                ax.plot(run["curves"]["step"], run["curves"][key], color=f"C{i}", alpha=0.9 if j == 0 else 0.45,
                        linestyle="-" if r["method"] == "mae" else "--",
                        label=f"{LABELS[r['method']]}, Delta {r['delta_eff']:+.2f}" if j == 0 else None)
            if key == "phi_local_to_global" and r["method"] == "mae" and r["delta_eff"] > 0:
                ax.axhline(r["theory_dip"], color=f"C{i}", linestyle=":", linewidth=1.0)
        ax.set(xlabel="step", ylabel=key, title=title)
    axes[0][0].legend(fontsize=7)
    axes[0][1].text(0.02, 0.02, "dotted: -(Delta/2L) ln P (MAE, Delta > 0)", transform=axes[0][1].transAxes,
                    fontsize=7)
    return fig


def figures(rows: list[dict], ends: dict) -> dict:
    """The PNGs of the table: ``ends[method, point, seed]`` is a run's end of training (its ``end`` result)."""
    return {"areas": areas_figure(rows, ends), "queries": queries_figure(rows, ends), "curves": curves_panels(rows)}
