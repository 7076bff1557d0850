"""Shi 2024, Chapter 8, trained: does a looped linear transformer learn gradient descent, and keep working past the
loops it was trained for?

The chapter builds the weights (Theorem 8.14: ``Q = I``, ``P = diag(I, 0)``, ``eta = 1 / lambda_max(X^T X)`` make
T loops compute ``alpha`` times T steps of gradient descent) and trains nothing. Here
``configs/looped_transformer/trained.yaml`` (:class:`~featlearn.lightning_modules.looped_transformer.LoopedLinearTransformer`)
learns ``Q``, ``P`` and its step sizes from a random start on fresh prompts (d = 4, n = 16), for each loop count T
of ``--loops`` and each objective (the chapter's task ``E (<TF, theta*> - alpha)^2``, which ``alpha X^T y /
||y||^2`` solves as well as ``alpha theta*``; and ``E ||TF - alpha theta*||^2``, which only ``alpha theta*`` does),
every seed in one fit. On 2048 held-out
prompts it is scored at T, 2T and 4T loops (loops past T reuse the last step size) by the mean relative error
``|<TF, theta*> / alpha - 1|``, beside gradient descent with the chapter's step size at the same loop counts
(what the construction computes; the module also logs Theorem 8.16's bound); and compared with the
construction up to the model's symmetries: the cosine between the learned and the constructed maps ``G -> Q G P``
(1: the construction up to scale).

Usage::

    python -m featlearn.experiments.looped_transformer_trained --seed 0 1 2 [--loops 5 10 20] [--steps 3000]
"""
from __future__ import annotations

import os
import time

from featlearn.experiments.common import (checked, experiment_parser, markdown_table, mean_range,
                                          parse_experiment_args, quiet_lightning)
from featlearn.experiments.study import Run, Study
from featlearn.metrics.figures import curves_figure

OBJECTIVES = ("inner", "vector")


def table(results: dict, loops: list[int]) -> str:
    """Rows per (T, objective): the task's error at T, 2T, 4T over seeds and gradient descent's, the distance to
    ``alpha theta*`` at T (and gradient descent's), the cosine with ``X^T y`` and with the construction.

    Example:
        >>> one = {"error_loops2": 0.1, "error_loops4": 0.05, "error_loops8": 0.2, "gd_error_loops2": 0.3,
        ...        "gd_error_loops4": 0.2, "gd_error_loops8": 0.1, "vector_error_loops2": 0.4,
        ...        "gd_vector_error_loops2": 0.5, "cos_xty": 1.0, "construction_cosine": 0.5}
        >>> table({(2, "inner"): {0: one}}, [2]).splitlines()[2]
        '| T = 2, inner | 0.1000 | 0.0500 | 0.2000 | 0.3000 | 0.2000 | 0.1000 | 0.4000 | 0.5000 | 1.000 | 0.500 |'
    """
    columns = {"error at T": "error_loops{T}", "at 2T": "error_loops{2T}", "at 4T": "error_loops{4T}",
               "GD at T": "gd_error_loops{T}", "GD at 2T": "gd_error_loops{2T}", "GD at 4T": "gd_error_loops{4T}",
               "distance to alpha theta* at T": "vector_error_loops{T}", "GD's": "gd_vector_error_loops{T}",
               "cos(TF, X^T y)": "cos_xty", "construction cosine": "construction_cosine"}
    rows = {}
    for T in loops:
        for objective in OBJECTIVES:
            runs = [r for r in results.get((T, objective), {}).values() if not r.get("diverged")]
            if not runs:
                continue
            keys = {c: k.replace("{T}", str(T)).replace("{2T}", str(2 * T)).replace("{4T}", str(4 * T))
                    for c, k in columns.items()}
            rows[f"T = {T}, {objective}"] = {c: mean_range([r[k] for r in runs], "{:.4f}" if "loops" in k else "{:.3f}")
                                             for c, k in keys.items()}
    return markdown_table(rows, list(columns))


def main(argv=None) -> dict:
    parser = experiment_parser(__doc__.split("\n")[0], "runs/looped_transformer_trained")
    parser.add_argument("--loops", type=checked(int, lambda v: v >= 1, "an integer >= 1"), nargs="+",
                        default=[5, 10, 20], help="loop counts T trained (default 5 10 20)")
    parser.add_argument("--steps", type=checked(int, lambda v: v >= 1, "an integer >= 1"), default=3000,
                        help="Adam steps per fit (default 3000)")
    args = parse_experiment_args(parser, argv)
    quiet_lightning()
    t0, results = time.time(), {}
    with Study(args, "T x objective x seed", fits=len(args.loops) * len(OBJECTIVES) * len(args.seed)) as study:
        for T in args.loops:
            for objective in OBJECTIVES:
                run = Run("looped_transformer/trained.yaml", f"T{T}_{objective}", {
                    "model.init_args.loops": T, "model.init_args.objective": objective,
                    "trainer.max_steps": args.steps, "trainer.val_check_interval": args.steps,
                    "heatmap.every_n_steps": args.steps})
                results[T, objective] = study.fit_seeds(run, args.seed)
    notes = (f"d = 4, n = 16, alpha ~ U[0.5, 2], seeds {' '.join(map(str, args.seed))}: mean (min-max) over seeds; "
             f"Adam lr 1e-2 (cosine to 0), batch 1024 fresh prompts, {args.steps} steps from a random start (Q, "
             f"P entries N(0, 0.1^2), a step size per loop starting at 1 / (sqrt(n) + sqrt(d))^2); objective inner: "
             f"E (<TF, theta*> - alpha)^2 (the chapter's task), vector: E ||TF - alpha theta*||^2; 2048 held-out "
             f"prompts. Error: mean |<TF, theta*> / alpha - 1|; distance: mean ||TF / alpha - theta*||; loops past T "
             f"reuse the last loop's step size. GD: gradient descent from 0 with eta = 1 / lambda_max(X^T X) per "
             f"prompt, the construction of Theorem 8.14. cos(TF, X^T y): 1 for the solution alpha X^T y / ||y||^2 (about "
             f"0.93 for alpha theta* at these sizes). "
             f"Construction cosine: cos(Q, I) cos(P, diag(I, 0)), the cosine between the maps G -> Q G P (1 = the "
             f"construction up to scale). Wall time {time.time() - t0:.0f} s.")
    curves = {f"T = {T}, {objective}": [[r[f"error_loops{m * T}"] for m in (1, 2, 4)]
                                        for r in results[T, objective].values() if not r.get("diverged")]
              for T in args.loops for objective in OBJECTIVES}
    curves.update({f"GD, T = {T}": [[r[f"gd_error_loops{m * T}"] for m in (1, 2, 4)]
                                    for r in results[T, OBJECTIVES[0]].values() if not r.get("diverged")]
                   for T in args.loops})
    figure = curves_figure([1, 2, 4], curves, xlabel="loops / T (trained at T)", ylabel="mean |<TF, theta*>/alpha - 1|",
                           title="trained looped transformer vs gradient descent", logx=True)
    figure.axes[0].set_yscale("log")
    study.write("looped_transformer_trained", {"results": {f"T{T}_{o}": r for (T, o), r in results.items()},
                                               "notes": notes},
                f"# Shi 2024, Chapter 8: a looped linear transformer trained from a random start\n\n"
                f"{table(results, args.loops)}\n\n{notes}", {"errors": figure})
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
