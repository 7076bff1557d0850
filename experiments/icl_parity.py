"""Shi 2024, Chapter 5 (Shi, Wei, Xu, Liang, ICML 2024), Section 5.5: sparse parities in context, the small model
against the large one: Theorem 5.5.1's constructed optima and models trained from a random start.

Data: ``configs/icl_scale/parity.yaml`` (d = 8 features, the first k = 2 important, gamma = 0.2, N = 512 examples
per training prompt). Models (:class:`~featlearn.lightning_modules.icl_parity.MultiHeadParityAttention`): the
constructions for nu1 = 1 (4 heads: the important pair) and nu2 = 3 (8 heads: every pair), and 4- and 8-head models
trained by Adam on hinge loss plus weight decay 1e-4 at the theorem's task rate p_T = 2e-3 and, to see what the rate
does, at p_T = 0.05 (outside the theorem's range), every seed in one fit. Each is scored on 8192 prompts of the
important tasks (S1, the chapter's evaluation) and of the others (S2), with M = 512 or 64 examples and 0, 20% or 40%
of the in-context labels flipped. Theorem 5.5.2's noise energies ``E ||P_D(Xi)||^2`` (``Xi`` the mean of M uniform
sign vectors, ``D`` the heads' diagonals) are measured by Monte Carlo: their ratio small / large is predicted to be
``(nu1 + 1) / (nu2 + 1) = 1/2``.

Usage::

    python -m featlearn.experiments.icl_parity --seed 0 1 2 [--steps 2000]
"""
from __future__ import annotations

import os
import time

import torch

from featlearn.datamodules.parity_prompts import SparseParityPromptDataModule
from featlearn.experiments.common import (checked, experiment_parser, markdown_table, mean_range,
                                          parse_experiment_args, quiet_lightning)
from featlearn.experiments.study import Run, Study
from featlearn.lightning_modules.icl_parity import MultiHeadParityAttention
from featlearn.metrics.figures import curves_figure

SETTINGS = [(tasks, M, flip) for tasks in ("important", "less_important") for M in (512, 64) for flip in (0.0, 0.2, 0.4)]
PROMPTS, CHUNK = 8192, 1024
DATA = dict(d=8, k=2, gamma=0.2, N=512)


def column(tasks: str, M: int, flip: float) -> str:
    return f"{'S1' if tasks == 'important' else 'S2'}, M {M}, flip {flip:g}"


def scores(model, seed: int) -> dict[str, float]:
    """Accuracy per evaluation setting on fresh test prompts of the data seed ``seed`` (same dictionary)."""
    out = {}
    for tasks, M, flip in SETTINGS:
        dm = SparseParityPromptDataModule(**DATA, seed=seed, eval_examples=M, eval_tasks=tasks, eval_flip=flip,
                                          num_test=PROMPTS)
        right = sum(float(model.evaluate(dm.batch(torch.arange(s, s + CHUNK), "test"))["accuracy"]) * CHUNK
                    for s in range(0, PROMPTS, CHUNK))
        out[column(tasks, M, flip)] = right / PROMPTS
    return out


def noise_energy(diagonals: torch.Tensor, M: int, draws: int = 20000, seed: int = 0) -> float:
    """``M E ||P_D(Xi)||^2`` for ``Xi`` the mean of ``M`` uniform sign vectors and ``D`` the span of the heads'
    diagonals ``[m, d]`` with singular values at least 10% of the largest (exactly its rank, for the construction)."""
    U, s, _ = torch.linalg.svd(diagonals.double().T, full_matrices=False)
    basis = U[:, s >= 0.1 * s.max()]
    gen = torch.Generator().manual_seed(seed)
    xi = (torch.randint(0, 2, (draws, M, diagonals.shape[1]), generator=gen) * 2 - 1).double().mean(1)
    return float((xi @ basis).square().sum(1).mean() * M)


def evaluate(fitted) -> dict:
    out = {**fitted.model.final_metrics(), **scores(fitted.model, fitted.datamodule.seed)}
    out["noise_energy"] = noise_energy(fitted.model.head_diagonals(), 64)
    return out


def constructed(nu: int, seed: int) -> dict:
    model = MultiHeadParityAttention(heads=2 * (nu + 1), init="construction", construction_nu=nu).attach(
        SparseParityPromptDataModule(**DATA, seed=seed))
    return {**model.final_metrics(), **scores(model, seed), "noise_energy": noise_energy(model.head_diagonals(), 64)}


def table(rows: dict[str, list[dict]]) -> str:
    """Mean (min-max) over seeds of the diagonal share, the noise energy and each setting's accuracy.

    Example:
        >>> one = {"diagonal_share": 1.0, "noise_energy": 2.0, **{column(*s): 1.0 for s in SETTINGS}}
        >>> row = table({"4 heads": [one]}).splitlines()[2]
        >>> row[:48]
        '| 4 heads | 1.00 | 2.00 | 1.000 | 1.000 | 1.000 '
    """
    columns = ["diagonal share", "noise energy", *(column(*s) for s in SETTINGS)]
    body = {}
    for name, runs in rows.items():
        runs = [r for r in runs if not r.get("diverged")]
        if runs:
            body[name] = {"diagonal share": mean_range([r["diagonal_share"] for r in runs], "{:.2f}"),
                          "noise energy": mean_range([r["noise_energy"] for r in runs], "{:.2f}"),
                          **{column(*s): mean_range([r[column(*s)] for r in runs], "{:.3f}") for s in SETTINGS}}
    return markdown_table(body, columns)


def main(argv=None) -> dict:
    parser = experiment_parser(__doc__.split("\n")[0], "runs/icl_parity")
    parser.add_argument("--steps", type=checked(int, lambda v: v >= 1, "an integer >= 1"), default=2000,
                        help="Adam steps per fit (default 2000)")
    args = parse_experiment_args(parser, argv)
    quiet_lightning()
    t0, rows = time.time(), {}
    rows["construction, nu1 = 1 (4 heads)"] = [constructed(1, s) for s in args.seed]
    rows["construction, nu2 = 3 (8 heads)"] = [constructed(3, s) for s in args.seed]
    with Study(args, "p_T x heads x seed", fits=4 * len(args.seed)) as study:
        for p_T in (0.002, 0.05):
            for heads in (4, 8):
                run = Run("icl_scale/parity.yaml", f"pT{p_T:g}_heads{heads}", {
                    "model.init_args.heads": heads, "data.init_args.p_T": p_T, "trainer.max_steps": args.steps,
                    "trainer.val_check_interval": args.steps, "heatmap.every_n_steps": args.steps})
                rows[f"trained, {heads} heads, p_T = {p_T:g}"] = list(study.fit_seeds(run, args.seed, evaluate).values())
    small, large = rows["construction, nu1 = 1 (4 heads)"], rows["construction, nu2 = 3 (8 heads)"]
    ratio = sum(r["noise_energy"] for r in small) / sum(r["noise_energy"] for r in large)
    notes = (f"d = 8, k = 2, gamma = 0.2, N = 512, seeds {' '.join(map(str, args.seed))}: mean (min-max) over seeds "
             f"(a seed draws the dictionary G and, for trained models, the start). Trained: Adam lr 1e-2 (cosine to 0), "
             f"{args.steps} steps of 256 fresh prompts, hinge loss + 1e-4 sum ||W_h||^2, heads N(0, 0.1^2), a uniform in "
             f"[-1, 1] and kept there. Diagonal share: the heads' energy on the diagonals of G^T W_h G (1: each head reads "
             f"features one by one). Columns: accuracy on {PROMPTS} test prompts of the important tasks (S1) or the "
             f"others (S2), M in-context examples, a fraction flip of their labels flipped. "
             f"Noise energy: M E ||P_D(Xi)||^2 at M = 64 (Theorem "
             f"5.5.2; the rank of D for the construction); small / large construction: {ratio:.3f} (predicted "
             f"(nu1 + 1) / (nu2 + 1) = 0.5). Wall time {time.time() - t0:.0f} s.")
    flips = [f for tasks, M, f in SETTINGS if tasks == "important" and M == 64]
    curves = {name: [[r[column("important", 64, f)] for f in flips] for r in runs if not r.get("diverged")]
              for name, runs in rows.items()}
    figure = curves_figure(flips, curves, xlabel="fraction of in-context labels flipped (M = 64)",
                           ylabel="accuracy on the important tasks", title="sparse parity in context: small vs large")
    study.write("icl_parity", {"results": rows, "notes": notes},
                f"# Shi 2024, Chapter 5: sparse parities in context, small vs large models\n\n{table(rows)}\n\n{notes}",
                {"flips": figure})
    return rows


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
