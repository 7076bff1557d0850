"""Shi 2024, Chapter 8, Fig. 8.1: the looped linear transformer with the chapter's weights against its theory line.

Per n in {16, 32, 64, 128}: 10 prompts with ``X`` of n rows of 4 ``N(0, 1)`` entries, ``theta*`` uniform on the unit
sphere, ``y = X theta*``, ``alpha = 1``; 200 loops of the masked linear attention with ``Q = I``, ``P = diag(I, 0)``
and ``eta = 1 / lambda_max(X^T X)`` (:mod:`featlearn.theory.looped_transformer`), in float64. Every loop's output
is compared with gradient descent (Theorem 8.14: equal), and ``log(||theta_t - theta*||^2 / ||theta_0 - theta*||^2)``
with Theorem 8.25's line ``-t / kappa``. The table gives the mean kappa beside the chapter's, the measured decay
per loop (the slope of the log ratio before it reaches float64's floor) beside the bound's ``-1/kappa``, and the
largest gap between the loop and gradient descent.

Usage::

    python -m featlearn.experiments.looped_transformer --seed 0 1 2      # 10 prompts per n and seed
"""
from __future__ import annotations

import os
import time

import torch

from featlearn.experiments.common import experiment_parser, markdown_table, mean_range, parse_experiment_args
from featlearn.experiments.common import write_results
from featlearn.metrics.figures import plt
from featlearn.theory.looped_transformer import (condition_number, gd_construction, gradient_descent,
                                                 looped_attention, prompt_matrix, step_size)

SIZES, DIM, LOOPS, TRIALS = (16, 32, 64, 128), 4, 200, 10
PAPER_KAPPA = {16: 4.57, 32: 3.13, 64: 2.07, 128: 1.62}
FLOOR = -55.0  # log ratio below which float64 rounding, not the contraction, sets the curve


def run(n: int, seed: int) -> dict:
    """One seed's 10 prompts at size n: kappa, the loop-vs-GD gap, the mean log-ratio curve and the decay rates."""
    gen = torch.Generator().manual_seed(seed * 1000 + n)
    X = torch.randn(TRIALS, n, DIM, generator=gen, dtype=torch.float64)
    theta = torch.nn.functional.normalize(torch.randn(TRIALS, DIM, generator=gen, dtype=torch.float64), dim=1)
    y, alpha, eta = (X @ theta.unsqueeze(-1)).squeeze(-1), torch.ones(TRIALS, dtype=torch.float64), step_size(X)
    Z, outputs = prompt_matrix(X, y, alpha), [torch.zeros(TRIALS, DIM, dtype=torch.float64)]
    Q, P = gd_construction(DIM)
    for _ in range(LOOPS):  # one loop at a time: the output after every loop
        Z = looped_attention(Z, Q, P, eta, 1)
        outputs.append(-Z[:, n, :DIM] / alpha[:, None])
    loop = torch.stack(outputs)
    gd = gradient_descent(X, y, eta, LOOPS)
    log_ratio = ((loop - theta).square().sum(-1) / theta.square().sum(-1)).log()  # [LOOPS + 1, TRIALS]
    kappa = condition_number(X)
    rates = []
    for j in range(TRIALS):  # least-squares slope through 0 over the loops above the floor
        t = torch.arange(LOOPS + 1, dtype=torch.float64)[log_ratio[:, j] > FLOOR]
        rates.append(float((t * log_ratio[t.long(), j]).sum() / t.square().sum()))
    return {"kappa": kappa.tolist(), "rate": sum(rates) / TRIALS, "bound_rate": float((-1 / kappa).mean()),
            "gd_gap": float((loop - gd).abs().max()), "curve": log_ratio.mean(1).tolist()}


def table(results: dict) -> str:
    """Per n over seeds: mean kappa (measured, chapter), the decay per loop against the bound's, the GD gap.

    Example:
        >>> one = {"kappa": [4.0, 5.0], "rate": -0.5, "bound_rate": -0.22, "gd_gap": 1e-16}
        >>> table({0: {16: one}}).splitlines()[2]
        '| n = 16 | 4.50 | 4.57 | -0.500 | -0.220 | 2.27 | 1.0e-16 |'
    """
    columns = ["mean kappa", "chapter's kappa", "decay per loop", "bound -1/kappa", "decay / bound",
               "largest loop - GD gap"]
    rows = {}
    for n in SIZES:
        per_seed = [r[n] for r in results.values() if n in r]
        if not per_seed:
            continue
        rows[f"n = {n}"] = {
            "mean kappa": mean_range([sum(r["kappa"]) / len(r["kappa"]) for r in per_seed], "{:.2f}"),
            "chapter's kappa": f"{PAPER_KAPPA[n]:.2f}",
            "decay per loop": mean_range([r["rate"] for r in per_seed]),
            "bound -1/kappa": mean_range([r["bound_rate"] for r in per_seed]),
            "decay / bound": mean_range([r["rate"] / r["bound_rate"] for r in per_seed], "{:.2f}"),
            "largest loop - GD gap": f"{max(r['gd_gap'] for r in per_seed):.1e}"}
    return markdown_table(rows, columns)


def figure(results: dict, seed: int):
    """Fig. 8.1: the mean log ratio per n (solid) and ``-t / mean kappa`` (dashed), for one seed."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0), constrained_layout=True)
    t = list(range(LOOPS + 1))
    for i, n in enumerate(SIZES):
        r = results[seed][n]
        kappa = sum(r["kappa"]) / len(r["kappa"])
        ax.plot(t, r["curve"], color=f"C{i}", label=f"n = {n} (mean kappa {kappa:.2f})")
        ax.plot(t, [-s / kappa for s in t], "--", color=f"C{i}")
    ax.set(xlabel="loop t", ylabel="log(||theta_t - theta*||^2 / ||theta_0 - theta*||^2)", ylim=(-80, 2),
           title=f"measured (solid) and Thm 8.25's -t/kappa (dashed), seed {seed}")
    ax.legend()
    return fig


def main(argv=None) -> dict:
    args = parse_experiment_args(experiment_parser(__doc__.split("\n")[0], "runs/looped_transformer"), argv)
    t0 = time.time()
    results = {seed: {n: run(n, seed) for n in SIZES} for seed in args.seed}
    notes = (f"d = {DIM}, {TRIALS} prompts per n and seed (seeds {' '.join(map(str, args.seed))}), {LOOPS} loops, "
             f"float64, eta = 1 / lambda_max(X^T X), alpha = 1, theta_0 = 0. Decay per loop: the slope through 0 of "
             f"log(||theta_t - theta*||^2 / ||theta*||^2) over the loops above {FLOOR:.0f} (float64's floor), mean "
             f"over prompts; bound: Theorem 8.25's -1/kappa, mean over prompts. Wall time {time.time() - t0:.1f} s.")
    write_results(args.out, "looped_transformer", {"results": results, "notes": notes},
                  f"# Shi 2024, Chapter 8, Fig. 8.1: the looped linear transformer is gradient descent\n\n"
                  f"{table(results)}\n\n{notes}", {"curves": figure(results, args.seed[0])})
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
