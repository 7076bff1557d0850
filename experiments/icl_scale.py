"""Shi 2024, Chapter 5 (Shi, Wei, Xu, Liang, ICML 2024), Section 5.4: do trained rank-r linear attentions reach the
closed-form optimum, and is the larger rank the more sensitive to label noise in context?

``configs/icl_scale/regression.yaml`` (:class:`~featlearn.lightning_modules.icl_lsa.LowRankLinearAttention`) is
trained for each rank r of ``--ranks`` from a random start (d = 16, covariance eigenvalues 1/i in a random basis,
N = 64 examples per prompt), every seed in one fit. Each trained ``Gamma = u W_K^T W_Q`` is then compared with
Theorem 5.4.1's optimum (excess population loss, distance) and evaluated exactly
(:func:`~featlearn.theory.icl_scale.expected_loss`) on prompts of M = 16 examples with label noise sigma, for a
task on the top eigen-direction (``w = Q e_1``, inside every model's top r), one on the last (``w = Q e_d``,
outside all but the full-rank model's) and the training tasks (``w ~ N(0, I)``), beside Theorem 5.4.2's prediction
for the optimum. The chapter's claims: the evaluation loss grows with sigma^2 at the rate ``tr(V^2 D^2) / M``,
which grows with r (Theorem 5.4.3: on the top task the larger model loses more, by ``rank_gap``), while on the
tail task without label noise only a model that attends to that direction does better than predicting 0 (with
noise every model does worse than 0 there).

Usage::

    python -m featlearn.experiments.icl_scale --seed 0 1 2 [--ranks 1 2 4 8 16] [--steps 3000]
"""
from __future__ import annotations

import os
import time

import torch

from featlearn.experiments.common import (checked, experiment_parser, markdown_table, mean_range,
                                          parse_experiment_args, quiet_lightning)
from featlearn.experiments.study import Run, Study
from featlearn.metrics.figures import curves_figure
from featlearn.theory.icl_scale import evaluation_loss, expected_loss, optimal_scales

SIGMAS = (0.0, 0.5, 1.0)
M = 16


def tasks(d: int) -> dict[str, torch.Tensor | None]:
    """The evaluation tasks in eigen-coordinates (``None``: ``w ~ N(0, I)``, averaged)."""
    return {"top": torch.eye(d, dtype=torch.float64)[0], "tail": torch.eye(d, dtype=torch.float64)[-1], "random": None}


def evaluate(fitted) -> dict:
    """The exact quantities of the fit's ``Gamma`` (``LowRankLinearAttention.theory``, unrounded) and its exact
    evaluation losses per (task, sigma), with Theorem 5.4.2's value for the rank-r optimum beside each."""
    model, dm = fitted.model, fitted.datamodule
    G, Q, lam = model.Gamma().detach().double(), dm.basis, dm.eigenvalues
    v = optimal_scales(lam, dm.N, model.hparams.rank)
    out = {**model.theory(), "steps": fitted.steps}  # unrounded: the excess losses are ~1e-4
    for task, s in tasks(dm.d).items():
        for sigma in SIGMAS:
            out[f"{task}_sigma{sigma}"] = float(expected_loss(G, dm.covariance, M, sigma, None if s is None else Q @ s))
            if s is None:  # Theorem 5.4.2 averaged over w ~ N(0, I): the optimum's exact loss
                optimum = Q @ torch.diag(v) @ Q.T
                out[f"{task}_sigma{sigma}_theory"] = float(expected_loss(optimum, dm.covariance, M, sigma))
            else:
                inside = s * (v > 0)
                out[f"{task}_sigma{sigma}_theory"] = evaluation_loss(lam, v, inside, s - inside, sigma, M)
    return out


def table(results: dict, ranks: list[int]) -> str:
    """Rows per rank: distance to the optimum, then each (task, sigma)'s loss, measured (theory).

    Example:
        >>> one = {"excess_loss": 1e-4, "gamma_error": 0.05, "noise_coefficient": 0.2, "noise_coefficient_optimum": 0.2,
        ...        **{f"{t}_sigma{s}{x}": 1.0 for t in ("top", "tail", "random") for s in SIGMAS for x in ("", "_theory")}}
        >>> row = table({1: {0: one}}, [1]).splitlines()[2]
        >>> row[:60]
        '| r = 1 | 1.0e-04 | 0.050 | 0.2000 (0.2000) | 1.000 (1.000) '
    """
    rows = {}
    for r in ranks:
        runs = [x for x in results.get(r, {}).values() if not x.get("diverged")]
        if not runs:
            continue
        row = {"excess loss": mean_range([x["excess_loss"] for x in runs], "{:.1e}"),
               "distance to Gamma* (relative)": mean_range([x["gamma_error"] for x in runs], "{:.3f}"),
               "d loss / d sigma^2": f"{mean_range([x['noise_coefficient'] for x in runs], '{:.4f}')} "
                                     f"({runs[0]['noise_coefficient_optimum']:.4f})"}
        for task in tasks(1):
            for sigma in SIGMAS:
                key = f"{task}_sigma{sigma}"
                row[f"{task}, sigma {sigma}"] = f"{mean_range([x[key] for x in runs], '{:.3f}')} ({runs[0][key + '_theory']:.3f})"
        rows[f"r = {r}"] = row
    columns = list(next(iter(rows.values()))) if rows else []
    return markdown_table(rows, columns)


def main(argv=None) -> dict:
    parser = experiment_parser(__doc__.split("\n")[0], "runs/icl_scale")
    parser.add_argument("--ranks", type=checked(int, lambda v: 1 <= v <= 16, "an integer in [1, d] = [1, 16]"), nargs="+",
                        default=[1, 2, 4, 8, 16], help="ranks r trained (default 1 2 4 8 16; at most d = 16)")
    parser.add_argument("--steps", type=checked(int, lambda v: v >= 1, "an integer >= 1"), default=3000,
                        help="Adam steps per fit (default 3000)")
    args = parse_experiment_args(parser, argv)
    quiet_lightning()
    t0, results = time.time(), {}
    with Study(args, "rank x seed", fits=len(args.ranks) * len(args.seed)) as study:
        for r in args.ranks:
            run = Run("icl_scale/regression.yaml", f"rank{r}", {
                "model.init_args.rank": r, "trainer.max_steps": args.steps, "trainer.val_check_interval": args.steps,
                "heatmap.every_n_steps": args.steps})
            results[r] = study.fit_seeds(run, args.seed, evaluate)
    notes = (f"d = 16, eigenvalues 1/i in a random basis, N = 64, seeds {' '.join(map(str, args.seed))}: mean "
             f"(min-max) over seeds; Adam lr 1e-2 (cosine to 0), {args.steps} steps of 512 fresh prompts from W_K, "
             f"W_Q entries N(0, 0.1^2) and u = 1. Excess loss: (population loss - the rank-r optimum's) / the "
             f"optimum's (Theorem 5.4.1). d loss / d sigma^2 = tr(Lambda Gamma^T Lambda Gamma) / M, the optimum's "
             f"in brackets. Evaluation columns: the exact loss of the trained Gamma on prompts of M = {M} examples "
             f"with label noise sigma (rho = M, noise-free query), task w = Q e_1 (top), Q e_16 (tail) or N(0, I) "
             f"(random); in brackets Theorem 5.4.2's value for the rank-r optimum. Wall time {time.time() - t0:.0f} s.")
    curves = {f"r = {r}": [[x[f"top_sigma{s}"] for s in SIGMAS] for x in results[r].values() if not x.get("diverged")]
              for r in args.ranks}
    figure = curves_figure([s ** 2 for s in SIGMAS], curves, xlabel="label noise sigma^2 (M = 16 examples)",
                           ylabel="loss on the top-direction task", title="larger rank, more noise-sensitive")
    study.write("icl_scale", {"results": {f"rank{r}": x for r, x in results.items()}, "notes": notes},
                f"# Shi 2024, Chapter 5: rank-r linear attention trained for in-context regression\n\n"
                f"{table(results, args.ranks)}\n\n{notes}", {"noise": figure})
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
