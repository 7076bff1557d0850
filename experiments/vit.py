"""MAE vs contrastive learning with a one-layer softmax ViT across the information gap Delta (Huang et al. 2025).

    python -m featlearn.experiments.vit                      # p256_pos and p256_neg, MAE and CL, seeds 0 1 2
    python -m featlearn.experiments.vit --seed 0             # one seed (~1.5 min on one thread)
    python -m featlearn.experiments.vit --preset p256_pos p256_neg p256_pos_small --delta 0 0.4
    python -m featlearn.experiments.vit --methods mae --preset --delta -0.1 0.1 0.4 --steps-mae 1000

Every data point runs two configs of ``configs/vit/``: ``p256_pos`` (P = 256, 128 global + 8 local areas of
16, Delta = +0.25) is ``mae.yaml`` and ``cl.yaml``; ``p256_neg`` (32 global + 14 local areas, Delta = -0.25)
``mae_neg.yaml`` and ``cl_neg.yaml``; ``p256_pos_small`` (64 global + 48 local areas of 4, Delta = +0.25)
``mae_small_areas.yaml`` (gamma = 0.5) and ``cl.yaml`` with its exponents and ``d = roundup(P + K N, 64)``.
``--delta D`` adds points at P = 256, C_s = 16: our size rule (whole local areas of C_s patches, the
leftover patches joining the global area) allows only global areas ``C_1 = 256 - 16 n`` there, so D picks
the one whose Delta is nearest (:func:`delta_point`) and runs ``mae.yaml`` and ``cl.yaml`` with
``--data.init_args.kappa_c ln C_1 / ln 256``. A run with seed S adds
``--seed_everything S --data.init_args.seed S`` (partitions and samples); seed 0 is the config as shipped.
Each per-seed entry's ``config`` in the JSON is the ``lightning fit`` command that trains the same run; its
TensorBoard logs and checkpoints are in ``<out>/<point>/seed<S>/``.

MAE (``mae.yaml``): K = 4, gamma = 0.75, the exact structured path, SGD with our eta rule
(``featlearn.theory.vit.eta_mae``: the first step moves the local own-area correlation by about 0.02), B = 32,
300 steps. CL (``cl.yaml``): K = 8, d = 512, gamma0 = 0.5, tau = 1/ln d, eta = 5000, B = 32, 200 steps.
Every ``--every`` steps (and at step 0) a callback evaluates the module's own metrics on a fixed held-out
batch of the validation split (``--eval-batch`` samples, fixed masks): the correlations ``phi_local_own``,
``phi_local_to_global``, ``phi_global_own`` and the attention ``attn_own_local`` (queries whose own area
has an unmasked patch), ``attn_own_global``, ``attn_glob_from_local``, ``attn_to_masked``; these are the
curves of the figure, and their step-0 values the measured init. The table's end values are the module's
``final_metrics()`` (what ``hp/`` shows in TensorBoard), on its last training batch.

Theory (Huang et al. 2025, Thm 4.1, 4.2, 4.4): MAE attends to each masked patch's own area, local and global,
for either sign of Delta; for Delta > 0 a local patch's correlation with the global feature first dips to
about ``-(Delta / 2L) ln P`` before its own-area correlation grows (two phases), for Delta < 0 it barely
moves. CL collapses: every query's attention goes to the global area, its own local area stays at or below
its init ``(1 - gamma0) C_s / P``.

Writes ``vit_table.md`` / ``vit_table.json`` (a list of rows, one per method and data point, with
``method``, ``delta``, ``own_area_local``, ``own_area_global``, ``attn_global``, ``final_loss``,
``loss_floor``, the dip and the per-seed values and curves) and the PNGs ``vit_table_areas.png`` (mean area
attention, query area x key area, at the end of training), ``vit_table_queries.png`` (one local query's
attention on the 16 x 16 grid) and ``vit_table_curves.png`` (the metrics over training).
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch

from featlearn.experiments.common import (build, experiment_parser, mean_range, parse_experiment_args, progress,
                                         quiet_lightning, resolved_config, write_results)
from featlearn.lightning_modules.vit_common import area_matrix
from featlearn.lightning_modules.vit_mae import ViTMAE
from featlearn.metrics.figures import plt
from featlearn.theory.vit import area_sizes, embedding_dim, patch_vectors

METHODS = ("mae", "cl")
LABELS = {"mae": "MAE", "cl": "CL"}
CURVES = ("phi_local_own", "phi_local_to_global", "phi_global_own", "attn_own_local", "attn_own_global",
          "attn_glob_from_local", "attn_to_masked", "loss")
# the numbers of a row: means over seeds of the per-seed values (the per-seed values stay in the row)
NUMBERS = ("own_area_local", "own_area_global", "attn_global", "attn_to_masked", "final_loss", "loss_floor",
           "phi_local_to_global_min", "phi_local_to_global_argmin_step", "phi_local_to_global", "phi_local_own",
           "phi_global_own", "init_own_area_local", "init_own_area_global", "init_attn_global",
           "step_own_local_half", "phi_local_to_global_at_half", "phi_local_own_early", "phi_local_to_global_early")
ATTN_HALF = 0.5  # the own-area attention of local queries that marks phase II (rapid growth) in the curves


@dataclass(frozen=True)
class Point:
    """One data point: the MAE and the CL run (config, overrides) at one Delta, and its area sizes."""
    name: str
    label: str
    sizes: tuple[int, int]
    mae: tuple[str, tuple[str, ...]]
    cl: tuple[str, tuple[str, ...]]


def _small_areas_cl() -> tuple[str, ...]:
    """``cl.yaml`` on the p256_pos_small exponents, with d widened to ``roundup(P + K N, 64)``."""
    sizes = area_sizes(256, 0.75, 0.25)
    K = resolved_config("vit/cl.yaml")["data"]["init_args"]["K"]
    return ("--data.init_args.kappa_c", "0.75", "--data.init_args.kappa_s", "0.25",
            "--data.init_args.d", str(embedding_dim(256, K * sizes["n_areas"])))


PRESETS = {
    "p256_pos": lambda: Point("p256_pos", "p256_pos: C_1 = 128, 8 x C_s = 16", (128, 16), ("vit/mae.yaml", ()),
                              ("vit/cl.yaml", ())),
    "p256_neg": lambda: Point("p256_neg", "p256_neg: C_1 = 32, 14 x C_s = 16", (32, 16), ("vit/mae_neg.yaml", ()),
                              ("vit/cl_neg.yaml", ())),
    "p256_pos_small": lambda: Point("p256_pos_small", "p256_pos_small: C_1 = 64, 48 x C_s = 4", (64, 4),
                                    ("vit/mae_small_areas.yaml", ()), ("vit/cl.yaml", _small_areas_cl())),
}


def delta_point(delta: float) -> Point:
    """The P = 256, C_s = 16 data point whose effective Delta is nearest ``delta``: ``mae.yaml`` / ``cl.yaml``
    with ``kappa_c = ln C_1 / ln 256`` for the global area ``C_1 = 256 - 16 n`` (n = 1 .. 14 local areas; our
    size rule, leftover patches to the global area, allows no other sizes at C_s = 16), so nominal and
    effective Delta agree.

    Example:
        >>> p = delta_point(-0.1)
        >>> p.label, p.mae[1]
        ('Delta -0.104: C_1 = 48, 13 x C_s = 16', ('--data.init_args.kappa_c', '0.6981203126'))
    """
    log_p = math.log(256)
    gaps = {n: 2 * math.log(256 - 16 * n) / log_p - 1.5 for n in range(1, 15)}
    n = min(gaps, key=lambda k: abs(gaps[k] - delta))
    kappa_c = f"{math.log(256 - 16 * n) / log_p:.10g}"
    over = ("--data.init_args.kappa_c", kappa_c)
    return Point(f"delta{gaps[n]:+.3f}", f"Delta {gaps[n]:+.3f}: C_1 = {256 - 16 * n}, {n} x C_s = 16",
                 (256 - 16 * n, 16), ("vit/mae.yaml", over), ("vit/cl.yaml", over))


class TheoryCurves(L.Callback):
    """The module's theory metrics every ``every`` steps (and at step 0) on a fixed held-out batch of the
    validation split, kept in memory; at the end of training the mean area attention and one sample's
    attention rows for the figures."""

    def __init__(self, every: int, n_eval: int):
        self.every, self.n_eval = every, n_eval
        self.steps: list[int] = []
        self.curves: dict[str, list[float]] = {name: [] for name in CURVES}
        self.end: dict = {}

    def on_train_start(self, trainer, module) -> None:
        self.batch = trainer.datamodule.batch(torch.arange(self.n_eval, device=module.device), "val")
        self._record(module, 0)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # steps completed, this one included
        if step % self.every == 0 or step == trainer.max_steps:
            self._record(module, step)

    def on_train_end(self, trainer, module) -> None:
        _, A, own = self._evaluate(module)
        self.end = {"area_matrix": area_matrix(A, own).cpu(), **self._query_map(module)}

    @torch.no_grad()
    def _evaluate(self, module) -> tuple[dict, torch.Tensor, torch.Tensor]:
        batch = self.batch
        if isinstance(module, ViTMAE):
            loss, per_query, A = module.batch_loss(batch, with_areas=True)
            met = module.metrics(batch, per_query, A)
            met["loss"] = met["loss_per_patch"]
            own = batch["area"].gather(1, batch["masked_idx"])
        else:
            out = module.batch_loss(batch, with_areas=True)
            met = module.metrics(batch, out)
            met["loss"], A, own = out["loss"], out["A"], batch["area"]
        met.update(module.phi_metrics())
        met["attn_own_local"] = met["attn_own_local_visible"]  # the event E_{k,n} of Huang et al. 2025, Lemma D.6
        return met, A, own

    def _record(self, module, step: int) -> None:
        met = self._evaluate(module)[0]
        values = torch.stack([met[name].detach().reshape(()).double() for name in CURVES]).tolist()
        self.steps.append(step)
        for name, value in zip(CURVES, values):
            self.curves[name].append(value)

    @torch.no_grad()
    def _query_map(self, module) -> dict:
        """Attention of one local query of the held-out batch's first sample over every key: a masked query
        (MAE) or any query (CL) whose own area has an unmasked patch."""
        one = {k: v[:1] for k, v in self.batch.items() if torch.is_tensor(v) and v.dim() >= 1}
        area = one["area"][0]
        if isinstance(module, ViTMAE):
            mask = one["mask"][0]
            attn = module.attention_of_all_queries(one)[0]
            candidates = mask & (area > 0)
        else:
            mask = one["mask1"][0]
            x = patch_vectors(one["feat_id"], one["z"], module.V) + one["noise"]
            attn = torch.softmax(module.query_rows() @ x[0].masked_fill(mask.unsqueeze(-1), 0.0).T, dim=-1)
            candidates = area > 0
        visible = torch.zeros(int(area.max()) + 1, dtype=torch.bool, device=area.device)
        visible[area[~mask]] = True
        hits = torch.nonzero(candidates & visible[area]).squeeze(1)
        query = int(hits[0]) if len(hits) else int(torch.nonzero(area > 0)[0])
        return {"query": query, "query_attention": attn[query].cpu(), "query_area": int(area[query]),
                "area": area.cpu(), "mask": mask.cpu(), "vmax": float(module.sample_vmax)}


def fit(point: Point, method: str, seed: int, out: Path, args) -> tuple[dict, dict]:
    """Train one run; returns its per-seed result (final metrics, measured init, curves) and its end maps."""
    config, extra = getattr(point, method)
    overrides = [*extra, "--seed_everything", str(seed), "--data.init_args.seed", str(seed)]
    steps = args.steps_mae if method == "mae" else args.steps_cl
    if steps is not None:
        overrides += ["--trainer.max_steps", str(steps)]
    t0 = time.time()
    cli = build(config, out, f"{point.name}_{method}_seed{seed}", *overrides)
    curves = TheoryCurves(args.every, args.eval_batch)
    cli.trainer.callbacks.append(curves)
    cli.trainer.fit(cli.model, cli.datamodule)
    model, dm = cli.model, cli.datamodule
    final = model.final_metrics()
    c = curves.curves
    half = next((i for i, a in enumerate(c["attn_own_local"]) if a >= ATTN_HALF), None)
    result = {
        "seed": seed, "config": shlex.join(["lightning", "fit", "--config", f"configs/{config}", *overrides]),
        "steps": cli.trainer.global_step, "lr": float(model.lr), "K": dm.K, "d": dm.d, "P": dm.P, "C_1": dm.C_1,
        "C_s": dm.C_s, "n_local": dm.n_local, "delta": dm.delta, "delta_eff": dm.delta_eff, "z_low": dm.z_low,
        "mask_ratio": float(model.gamma if method == "mae" else model.gamma0),
        **{k: float(v) for k, v in final.items()},
        "init_own_area_local": c["attn_own_local"][0], "init_own_area_global": c["attn_own_global"][0],
        "init_attn_global": c["attn_glob_from_local"][0],
        # phase II: the first evaluated step where local queries put half their attention on their own area,
        # and how far the global correlation had dipped by then
        "step_own_local_half": curves.steps[half] if half is not None else None,
        "phi_local_to_global_at_half": c["phi_local_to_global"][half] if half is not None else None,
        # the first curve point after step 0: phase I of Delta > 0 moves the global correlation, not the own one
        "early_step": curves.steps[1], "phi_local_own_early": c["phi_local_own"][1],
        "phi_local_to_global_early": c["phi_local_to_global"][1],
        "curves": {"step": curves.steps, **{k: [round(v, 5) for v in vals] for k, vals in c.items()}},
        "area_matrix": [[round(float(v), 4) for v in row] for row in curves.end["area_matrix"]],
        "wall_s": round(time.time() - t0, 1),
    }
    return result, curves.end


def summarise(method: str, point: Point, runs: list[dict]) -> dict:
    """One row: the mean over seeds of every number (None where a seed lacks it), and the seeds' runs."""
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
            _cell(runs, "attn_to_masked", "{:.3f}"), _cell(runs, "final_loss", "{:.4f}"), f"{r['loss_floor']:.4f}",
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
            f"1/2 E[z^2] P(area fully masked | p masked) (our floor: attending to masked keys can beat the "
            f"paper's L^low); CL the in-batch InfoNCE loss against the cluster-only level tau E[log(1 + n)], n ~ "
            f"Bin(B - 1, 1/K) (not a strict bound). phi_loc->glob: mean over local positions of Phi_{{p -> "
            f"v_k,1}}, its minimum over every step (0 at step 0 if it never falls) and the step of it (mean over "
            f"seeds); the theory's plateau for Delta > 0 is -(Delta/2L) ln P with L = 0.9. Wall time "
            f"{meta['wall_s']:.0f} s on {meta['threads']} thread(s).")


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
        matrix = ends[method, row["point"], row["seeds"][0]]["area_matrix"].double().numpy()
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
        P = end["area"].numel()
        side = math.isqrt(P)
        attn = end["query_attention"].double().reshape(side, side).numpy()
        image = ax.imshow(attn, vmin=0.0, vmax=end["vmax"], cmap="viridis", interpolation="nearest")
        own, glob = torch.nonzero(end["area"] == end["query_area"]).squeeze(1), torch.nonzero(end["area"] == 0).squeeze(1)
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


def parse_args(argv=None) -> argparse.Namespace:
    """The options; every bad value is refused here, naming the option, before any run or folder."""
    parser = experiment_parser(__doc__, "runs/vit")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.set_defaults(seed=[0, 1, 2])
    parser._option_string_actions["--seed"].help = "one seed or several, distinct (default 0 1 2): mean (min-max)"
    parser.add_argument("--preset", nargs="*", default=None, choices=sorted(PRESETS),
                        help="named P = 256 data points (default p256_pos p256_neg; '--preset' alone: none, "
                             "for --delta points only)")
    parser.add_argument("--delta", type=float, nargs="+", default=[],
                        help="data points added to the presets, at P = 256, C_s = 16: for each Delta in (-0.5, 0.5) "
                             "the global area "
                             "256 - 16 n whose effective Delta is nearest (-0.25, -0.10, 0, 0.08, 0.15, 0.20, 0.25, "
                             "0.29, 0.33, 0.36, 0.40, 0.43, 0.45, 0.48)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="default: mae cl")
    parser.add_argument("--steps-mae", type=int, help="MAE steps (default: the config's, 300)")
    parser.add_argument("--steps-cl", type=int, help="CL steps (default: the config's, 200)")
    parser.add_argument("--every", type=int, default=10, help="steps between curve points (default 10)")
    parser.add_argument("--eval-batch", type=int, default=32,
                        help="held-out validation samples the curves are measured on (default 32)")
    return parse_experiment_args(parser, argv, _refuse_bad_options)


def _refuse_bad_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad options, naming them; set ``args.points``."""
    presets = ["p256_pos", "p256_neg"] if args.preset is None else args.preset
    for option, values in (("--preset", presets), ("--delta", [f"{d:g}" for d in args.delta]),
                           ("--methods", args.methods)):
        if len(set(values)) != len(values):
            parser.error(f"{option}: values must be distinct, got {values}")
    for option, value, low in (("--steps-mae", args.steps_mae, 1), ("--steps-cl", args.steps_cl, 1),
                               ("--every", args.every, 1), ("--eval-batch", args.eval_batch, 2)):
        if value is not None and value < low:
            parser.error(f"{option}: must be an integer >= {low}, got {value}")
    points = [PRESETS[name]() for name in presets]
    for delta in args.delta:
        if not -0.5 < delta < 0.5:
            parser.error(f"--delta: must be in (-0.5, 0.5) (kappa_c in (0.5, 1) at kappa_s = 0.5), got {delta:g}")
        point = delta_point(delta)
        same = next((p for p in points if p.sizes == point.sizes), None)
        if same is not None:
            parser.error(f"--delta: {delta:g} gives the data point {point.label!r}, already run as {same.name}")
        points.append(point)
    if not points:
        parser.error("--preset: give at least one data point (--preset or --delta)")
    args.points = points


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    quiet_lightning()
    t0 = time.time()
    jobs = [(p, m, s) for p in args.points for m in args.methods for s in args.seed]
    runs, ends = {}, {}
    for point, method, seed in progress(jobs, "data point x method x seed"):
        runs[point.name, method, seed], ends[method, point.name, seed] = fit(
            point, method, seed, args.out / point.name / f"seed{seed}", args)
    rows = [summarise(m, p, [runs[p.name, m, s] for s in args.seed]) for p in args.points for m in args.methods]
    command = shlex.join(["python", "-m", "featlearn.experiments.vit", *(sys.argv[1:] if argv is None else argv)])
    meta = {"command": command, "seeds": " ".join(map(str, args.seed)), "eval_batch": args.eval_batch,
            "threads": args.threads, "wall_s": time.time() - t0}
    for row in rows:
        row["command"], row["wall_s_total"] = command, round(meta["wall_s"], 1)
    write_results(args.out, "vit_table", rows, markdown(rows, meta),
                  {"areas": areas_figure(rows, ends), "queries": queries_figure(rows, ends),
                   "curves": curves_panels(rows)})
    return rows


if __name__ == "__main__":
    main()
