"""MAE vs contrastive learning with a one-layer softmax ViT across the information gap Delta (Huang et al. 2025).

    python -m featlearn.experiments.vit                      # p256_pos and p256_neg, MAE and CL, seeds 0-4
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
The fits run through the experiment engine (:class:`~featlearn.experiments.study.Study`): each finished fit's
result is kept in ``<out>/study.json``, so the same command run again resumes. Each per-seed entry's
``config`` in the JSON is the ``lightning fit`` command that trains the same run; its TensorBoard logs and
checkpoints are in ``<out>/<point>/seed<S>/<method>/``.

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
``loss_floor`` (MAE: the floor of the same last batch, a bound of its loss; ``loss_floor_expected`` per seed its
expectation), the dip and the per-seed values and curves) and the PNGs ``vit_table_areas.png`` (mean area
attention, query area x key area, at the end of training), ``vit_table_queries.png`` (one local query's
attention on the 16 x 16 grid) and ``vit_table_curves.png`` (the metrics over training); the table,
its checks and the figures are :mod:`featlearn.experiments.vit_report`.
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from dataclasses import dataclass

import lightning as L
import torch

from featlearn.experiments.common import experiment_parser, parse_experiment_args, quiet_lightning
from featlearn.experiments.study import Run, Study
from featlearn.experiments.vit_report import ATTN_HALF, METHODS, figures, markdown, summarise
from featlearn.lightning_modules.vit_common import area_matrix
from featlearn.lightning_modules.vit_mae import ViTMAE
from featlearn.theory.vit import area_sizes, embedding_dim, patch_vectors

CURVES = ("phi_local_own", "phi_local_to_global", "phi_global_own", "attn_own_local", "attn_own_global",
          "attn_glob_from_local", "attn_to_masked", "loss")


@dataclass(frozen=True)
class Point:
    """One data point: the MAE and the CL run (config, overrides) at one Delta, and its area sizes."""
    name: str
    label: str
    sizes: tuple[int, int]
    mae: tuple[str, dict]
    cl: tuple[str, dict]


def _small_areas_cl() -> dict:
    """``cl.yaml`` on the p256_pos_small exponents, with d widened to ``roundup(P + K N, 64)``."""
    sizes = area_sizes(256, 0.75, 0.25)
    K = Run("vit/cl.yaml", "cl").resolved()["data"]["init_args"]["K"]
    return {"data.init_args.kappa_c": 0.75, "data.init_args.kappa_s": 0.25,
            "data.init_args.d": embedding_dim(256, K * sizes["n_areas"])}


PRESETS = {
    "p256_pos": lambda: Point("p256_pos", "p256_pos: C_1 = 128, 8 x C_s = 16", (128, 16), ("vit/mae.yaml", {}),
                              ("vit/cl.yaml", {})),
    "p256_neg": lambda: Point("p256_neg", "p256_neg: C_1 = 32, 14 x C_s = 16", (32, 16), ("vit/mae_neg.yaml", {}),
                              ("vit/cl_neg.yaml", {})),
    "p256_pos_small": lambda: Point("p256_pos_small", "p256_pos_small: C_1 = 64, 48 x C_s = 4", (64, 4),
                                    ("vit/mae_small_areas.yaml", {}), ("vit/cl.yaml", _small_areas_cl())),
}


def delta_point(delta: float) -> Point:
    """The P = 256, C_s = 16 data point whose effective Delta is nearest ``delta``: ``mae.yaml`` / ``cl.yaml``
    with ``kappa_c = ln C_1 / ln 256`` for the global area ``C_1 = 256 - 16 n`` (n = 1 .. 14 local areas; our
    size rule, leftover patches to the global area, allows no other sizes at C_s = 16), so nominal and
    effective Delta agree.

    Example:
        >>> p = delta_point(-0.1)
        >>> p.label, p.mae[1]
        ('Delta -0.104: C_1 = 48, 13 x C_s = 16', {'data.init_args.kappa_c': 0.6981203126})
    """
    log_p = math.log(256)
    gaps = {n: 2 * math.log(256 - 16 * n) / log_p - 1.5 for n in range(1, 15)}
    n = min(gaps, key=lambda k: abs(gaps[k] - delta))
    over = {"data.init_args.kappa_c": float(f"{math.log(256 - 16 * n) / log_p:.10g}")}
    return Point(f"delta{gaps[n]:+.3f}", f"Delta {gaps[n]:+.3f}: C_1 = {256 - 16 * n}, {n} x C_s = 16",
                 (256 - 16 * n, 16), ("vit/mae.yaml", over), ("vit/cl.yaml", over))


class TheoryCurves(L.Callback):
    """The module's theory metrics every ``every`` steps (and at step 0) on a fixed held-out batch of the
    validation split, kept in memory; at the end of training the mean area attention and one sample's
    attention rows for the figures; :meth:`collect` makes the run's result of them."""

    def __init__(self, every: int, n_eval: int):
        self.every, self.n_eval, self.t0 = every, n_eval, time.time()
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
        self.end = {"area_matrix": area_matrix(A, own).cpu().tolist(), **self._query_map(module)}

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
        return {"query": query, "query_attention": attn[query].cpu().tolist(), "query_area": int(area[query]),
                "area": area.cpu().tolist(), "mask": mask.cpu().tolist(), "vmax": float(module.sample_vmax)}

    def collect(self, fitted, method: str, run: Run) -> dict:
        """The run's per-seed result: final metrics, measured init, curves and (``end``) the figures' maps."""
        model, dm, c = fitted.model, fitted.datamodule, self.curves
        half = next((i for i, a in enumerate(c["attn_own_local"]) if a >= ATTN_HALF), None)
        return {
            "seed": run.seed, "config": shlex.join(["lightning", "fit", "--config", f"configs/{run.config}",
                                                    *run.argv()]),
            "steps": fitted.steps, "lr": float(model.lr), "K": dm.K, "d": dm.d, "P": dm.P,
            "C_1": dm.C_1, "C_s": dm.C_s, "n_local": dm.n_local, "delta": dm.delta, "delta_eff": dm.delta_eff,
            "z_low": dm.z_low, "mask_ratio": float(model.gamma if method == "mae" else model.gamma0),
            **{k: float(v) for k, v in model.final_metrics().items()},
            "init_own_area_local": c["attn_own_local"][0], "init_own_area_global": c["attn_own_global"][0],
            "init_attn_global": c["attn_glob_from_local"][0],
            # phase II: the first evaluated step where local queries put half their attention on their own
            # area, and how far the global correlation had dipped by then
            "step_own_local_half": self.steps[half] if half is not None else None,
            "phi_local_to_global_at_half": c["phi_local_to_global"][half] if half is not None else None,
            # the first curve point after step 0: phase I of Delta > 0 moves the global correlation, not the own
            "early_step": self.steps[1], "phi_local_own_early": c["phi_local_own"][1],
            "phi_local_to_global_early": c["phi_local_to_global"][1],
            "curves": {"step": self.steps, **{k: [round(v, 5) for v in vals] for k, vals in c.items()}},
            "area_matrix": [[round(float(v), 4) for v in row] for row in self.end["area_matrix"]],
            "wall_s": round(time.time() - self.t0, 1), "end": self.end,
        }


def fit(study: Study, point: Point, method: str, seed: int, args) -> dict:
    """Train one run (or take it from the study's results): its per-seed result, the figures' ``end`` in it."""
    config, extra = getattr(point, method)
    steps = args.steps_mae if method == "mae" else args.steps_cl
    run = Run(config, f"{point.name}/seed{seed}/{method}",
              {**extra, **({} if steps is None else {"trainer.max_steps": steps})}, seed=seed)
    curves = TheoryCurves(args.every, args.eval_batch)
    return study.fit(run, lambda fitted: curves.collect(fitted, method, run), callbacks=[curves])


def parse_args(argv=None) -> argparse.Namespace:
    """The options; every bad value is refused here, naming the option, before any run or folder."""
    parser = experiment_parser(__doc__, "runs/vit")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.set_defaults(seed=[0, 1, 2, 3, 4])   # the committed tables: 5 seeds
    parser._option_string_actions["--seed"].help = "one seed or several, distinct (default 0 1 2 3 4): mean (min-max)"
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
    with Study(args, "data point x method x seed", fits=len(jobs)) as study:
        done = {(p.name, m, s): fit(study, p, m, s, args) for p, m, s in jobs}
    kept = {key: result for key, result in done.items() if not result.get("diverged")}
    ends = {(m, p, s): result["end"] for (p, m, s), result in kept.items()}
    rows = []
    for point in args.points:
        for method in args.methods:
            runs = [{k: v for k, v in kept[point.name, method, s].items() if k != "end"}
                    for s in args.seed if (point.name, method, s) in kept]
            if runs:
                rows.append(summarise(method, point, runs))
    command = shlex.join(["python", "-m", "featlearn.experiments.vit", *(sys.argv[1:] if argv is None else argv)])
    meta = {"command": command, "seeds": " ".join(map(str, args.seed)), "eval_batch": args.eval_batch,
            "threads": args.threads, "wall_s": time.time() - t0,
            "diverged": [f"{p} {m} seed {s}" for (p, m, s), result in done.items() if result.get("diverged")]}
    for row in rows:
        row["command"], row["wall_s_total"] = command, round(meta["wall_s"], 1)
    study.write("vit_table", rows, markdown(rows, meta), figures(rows, ends))
    return rows


if __name__ == "__main__":
    main()
