"""Shi 2024, Chapter 3 (Shi, Wei, Liang, NeurIPS 2023): does the network learn the XOR mixture from its gradient
features while fixed features cannot, as the input dimension grows?

For each d of ``--dims``, ``configs/gradient_features/xor.yaml``
(:class:`~featlearn.lightning_modules.gradient_features.GradientFeatureNetwork`) trains the network (Algorithm 1),
random features and the linearised network (NTK) at the same width (4m = 256 neurons), the same steps and the same
fresh samples per step (n = 4 d^1.5), noise at the chapter's largest sigma = sqrt(d / (8 log log d)). The chapter
proves (Theorem B.42) that the network needs only ``Omega(log d)`` neurons and ``~d^1.5`` samples, while fixed
features need ``Omega(d^2)``: at this width and sample size the network's error should stay small as d grows and the
fixed features' grow towards chance. Also measured: Lemma 3.13, the share of "nice" neurons after step 1 against
a quarter of the gradient-feature probability p.

``--task parity`` runs structured parity instead (Sec. 3.4.2, ``configs/gradient_features/parity.yaml``): the three
models at the same width (4m = 512), steps and fresh samples, on the cases ``d = 64, k = 5, r in {1, 3}`` and
Proposition 3.23's kernel-hard instance (``M = I, r = 1, p_A = 1/4, k = d/16, p_o = 1/2`` at d = 80). Theorem 3.22
bounds the error of the best step ("there exists t in [T]"), so each fit validates every 50 steps and keeps its best
step on the validation split, and every model tries the step sizes :data:`PARITY_LRS` and keeps the one validated
best (the same rule and budget for all three); the table reports that fit's test error.

Usage::

    python -m featlearn.experiments.gradient_features --seed 0 1 2 [--dims 32 64 128 256] [--steps 200]
    python -m featlearn.experiments.gradient_features --task parity --seed 0 1 2 [--steps 600]
"""
from __future__ import annotations

import math
import os
import time

import torch

from featlearn.callbacks import KeepBestOnValidation
from featlearn.experiments.common import (checked, experiment_parser, markdown_table, mean_range,
                                          parse_experiment_args, quiet_lightning)
from featlearn.experiments.study import Run, Study, final_metrics
from featlearn.metrics.figures import bars_figure, curves_figure
from featlearn.theory.gradient_features import sparsest_readout

FEATURES = ("learned", "random", "ntk")
TICKET_SAMPLES = 20000  # fit and test samples of the lottery ticket's readouts (each)
PARITY_LRS = (0.1, 0.3)  # every model's step sizes, chosen on validation with the stopping step
PARITY_CASES = {  # name: the data's init_args (r = 3 takes p_A = 1/8: 1 - 2 r p_A must be >= 0, so not Prop. 3.23's 1/4)
    "r = 1, k = 5, d = 64": {"d": 64, "r": 1, "k": 5, "p_A": 0.25},
    "r = 3, k = 5, d = 64, p_A = 1/8": {"d": 64, "r": 3, "k": 5, "p_A": 0.125},
    "Prop. 3.23: M = I, k = d/16 = 5, p_o = 1/2, d = 80": {"d": 80, "r": 1, "k": 5, "p_A": 0.25, "p_o": 0.5,
                                                          "basis": "identity"}}


def evaluate(fitted) -> dict:
    """The fit's final metrics and, for the network, the lottery ticket after step 1 (Lemma 3.14): the fewest
    first-step neurons, the best aligned with the centres first, whose readout is within 1% of all 2m neurons'."""
    out, model = final_metrics(fitted), fitted.model
    if model.hparams.features != "learned" or model.W_first is None:
        return out
    m = model.hparams.width
    W1, b = model.W_first[:2 * m], model.b[:2 * m]  # neurons 2m..4m repeat these weights
    data = fitted.datamodule.sample(torch.arange(2 * TICKET_SAMPLES), "test")
    h = torch.relu(data["x"] @ W1.T - b)
    order = (W1 @ model.directions.T).abs().div(W1.norm(dim=1, keepdim=True).clamp_min(1e-30)).max(1).values.argsort(
        descending=True)
    n = TICKET_SAMPLES
    size, err, full = sparsest_readout(h[:n], data["y"][:n], h[n:], data["y"][n:], order)
    r = 2 * len(model.directions)  # the ground-truth network's gradient features (D_j, +-1)
    out.update(ticket_size=size, ticket_error=err, readout_error=full,
               ticket_scale=r * math.sqrt(m * 4 * out["p_quarter_pos"]))
    return out


def evaluate_best(fitted) -> dict:
    """:func:`evaluate` of the step kept on validation, with its test error on 20000 test samples disjoint from
    those the module's start (``eta^(1)``, p) and the lottery ticket read (indices from ``2 TICKET_SAMPLES`` on)."""
    out = evaluate(fitted)
    test = fitted.datamodule.sample(torch.arange(2 * TICKET_SAMPLES, 2 * TICKET_SAMPLES + 20000), "test")
    with torch.no_grad():
        out["error"] = float((fitted.model(test["x"]) * test["y"] <= 0).float().mean())
    keep = next(c for c in fitted.trainer.callbacks if isinstance(c, KeepBestOnValidation))
    out.update(best_step=keep.best_step, val_error=keep.best_score)
    return out


def table(results: dict, dims: list[int]) -> str:
    """Rows per d: each model's test error, the network's best cosine with the features, nice share and p / 4.

    Example:
        >>> one = {"error": 0.01, "cos_max": 0.9, "nice_fraction_pos": 0.05, "p_quarter_pos": 0.01}
        >>> row = table({(32, f): {0: one} for f in FEATURES}, [32]).splitlines()[2]
        >>> row[:60]
        '| d = 32 | 0.0100 | 0.0100 | 0.0100 | 0.900 | 0.900 | 0.050 '
    """
    columns = {"network error": ("learned", "error", "{:.4f}"), "random features": ("random", "error", "{:.4f}"),
               "NTK": ("ntk", "error", "{:.4f}"), "network cos max": ("learned", "cos_max", "{:.3f}"),
               "random cos max": ("random", "cos_max", "{:.3f}"),
               "nice share, b = +b~": ("learned", "nice_fraction_pos", "{:.3f}"),
               "p / 4, b = +b~": ("learned", "p_quarter_pos", "{:.3f}"),
               "nice share, b = -b~": ("learned", "nice_fraction_neg", "{:.3f}"),
               "p / 4, b = -b~": ("learned", "p_quarter_neg", "{:.3f}"),
               "lottery ticket (neurons)": ("learned", "ticket_size", "{:.0f}"),
               "r sqrt(m p)": ("learned", "ticket_scale", "{:.1f}"),
               "ticket's error": ("learned", "ticket_error", "{:.4f}"),
               "all 2m's error": ("learned", "readout_error", "{:.4f}")}
    rows = {}
    for d in dims:
        row = {}
        for name, (features, key, fmt) in columns.items():
            runs = [r for r in results.get((d, features), {}).values() if not r.get("diverged") and key in r]
            row[name] = mean_range([r[key] for r in runs], fmt) if runs else "n/a"
        rows[d if isinstance(d, str) else f"d = {d}"] = row
    return markdown_table(rows, list(columns))


def main(argv=None) -> dict:
    parser = experiment_parser(__doc__.split("\n")[0], "runs/gradient_features")
    parser.add_argument("--dims", type=checked(int, lambda v: v >= 16, "an integer >= 16"), nargs="+",
                        default=None, help="input dimensions d of the XOR task (default 32 64 128 256)")
    parser.add_argument("--steps", type=checked(int, lambda v: v >= 2, "an integer >= 2"), default=None,
                        help="steps of Algorithm 1 per fit (default 200 for xor, 600 for parity)")
    parser.add_argument("--task", choices=["xor", "parity"], default="xor",
                        help="the XOR mixture over --dims, or structured parity's three cases (default xor)")
    args = parse_experiment_args(parser, argv)
    quiet_lightning()
    if args.task == "parity":
        if args.dims is not None:
            parser.error("--dims: the XOR task's; structured parity runs its three cases (PARITY_CASES)")
        return parity(args, 600 if args.steps is None else args.steps)
    args.dims = [32, 64, 128, 256] if args.dims is None else args.dims
    args.steps = 200 if args.steps is None else args.steps
    t0, results = time.time(), {}
    with Study(args, "d x model x seed", fits=len(args.dims) * len(FEATURES) * len(args.seed)) as study:
        for d in args.dims:
            for features in FEATURES:
                results[d, features] = {}
                for seed in args.seed:
                    run = Run("gradient_features/xor.yaml", f"d{d}_{features}_seed{seed}", {
                        "data.init_args.d": d, "model.init_args.features": features, "trainer.max_steps": args.steps,
                        "trainer.val_check_interval": args.steps, "heatmap.every_n_steps": args.steps}, seed=seed)
                    results[d, features][seed] = study.fit(run, evaluate)
    notes = (f"seeds {' '.join(map(str, args.seed))}: mean (min-max) over seeds (a seed draws the centres, the "
             f"samples and the initialisation). XOR mixture: centres +-mu_1 (label +1), +-mu_3 (label -1), ||mu|| = "
             f"sqrt(d), noise sigma = sqrt(d / (8 log log d)). 4m = 256 neurons, sigma_w = 1/sqrt(d), sigma_a = 1, "
             f"bias b~ = sqrt(d log log d) sigma_w sigma; {args.steps} steps of n = 4 d^1.5 fresh samples, hinge loss, "
             f"step size 0.1 (the network's first step: weight decay 1/eta^(1), eta^(1) set from the first gradient's "
             f"median norm). Error: on 8192 held-out samples. cos max: the worse of the two directions' best "
             f"|cos(w_i, D_j)|. Nice share: Lemma 3.13's fewest nice neurons over the 4 signed directions, / m, per "
             f"bias sign, with gamma = 0.1 and B_G the median ||G|| of 2048 fresh initial neurons; p / 4: the lemma's "
             f"bound from p estimated on those neurons. Lottery ticket (Lemma 3.14): the fewest step-1 neurons (of 2m = "
             f"128, best aligned first, powers of two) whose L2-SVM readout, fitted on {TICKET_SAMPLES} samples, has a "
             f"held-out error within 0.01 of all 128's; the lemma's scale r sqrt(m p) with r = 4 and p the "
             f"least positive-bias p. Wall time {time.time() - t0:.0f} s.")
    curves = {label: [[results[d, f][s]["error"] for d in args.dims] for s in args.seed
                      if all(not results[d, f][s].get("diverged") for d in args.dims)]
              for f, label in zip(FEATURES, ("network", "random features", "NTK"))}
    figure = curves_figure(args.dims, curves, xlabel="input dimension d (n = 4 d^1.5 samples a step)",
                           ylabel="test error", title="XOR mixture: gradient features vs fixed features", logx=True)
    study.write("gradient_features", {"results": {f"d{d}_{f}": r for (d, f), r in results.items()}, "notes": notes},
                f"# Shi 2024, Chapter 3: the network against fixed features on the XOR mixture\n\n"
                f"{table(results, args.dims)}\n\n{notes}", {"errors": figure})
    return results


def chosen(results: dict) -> str:
    """The step size and stopping step each fit kept, per case and model (the notes' summary)."""
    return "; ".join(f"{case.split(':')[0]} {features}: " + ", ".join(
        f"{r.get('lr', '?')} @ {r.get('best_step', '?')}" for r in by_seed.values())
        for (case, features), by_seed in results.items())


def parity(args, steps: int) -> dict:
    """Structured parity: the three models on each case of :data:`PARITY_CASES` (module docstring)."""
    t0, results, every = time.time(), {}, max(1, min(50, steps // 4))
    fits = len(PARITY_CASES) * len(FEATURES) * len(args.seed) * len(PARITY_LRS)
    with Study(args, "case x model x seed x lr", fits=fits) as study:
        for case, data in PARITY_CASES.items():
            for features in FEATURES:
                results[case, features] = {}
                for seed in args.seed:
                    overrides = {f"data.init_args.{k}": v for k, v in data.items()}
                    tried = []
                    for lr in PARITY_LRS:
                        run = Run("gradient_features/parity.yaml", f"{data['d']}_{data['r']}_"
                                  f"{data.get('basis', 'random')}_{features}_lr{lr:g}_seed{seed}",
                                  {**overrides, "model.init_args.features": features, "model.init_args.lr": lr,
                                   "trainer.max_steps": steps, "trainer.val_check_interval": every,
                                   "heatmap.every_n_steps": steps}, seed=seed)
                        tried.append({**study.fit(run, evaluate_best, callbacks=[
                            KeepBestOnValidation("val/error", "min")]), "lr": lr})
                    results[case, features][seed] = min(tried, key=lambda r: r.get("val_error", math.inf))
    notes = (f"seeds {' '.join(map(str, args.seed))}: mean (min-max) over seeds (a seed draws M, the samples and the "
             f"initialisation). Structured parity: x = M phi, y = sign(sum_j parity of block j), a share p_A of the data "
             f"in each X_(j,+-) (block j all +-1), background +-1 with probability p_o each (default r k / (d - r k)). "
             f"4m = 512 neurons, sigma_w = 1/sqrt(d), sigma_a = 1, bias b~ = sqrt(r k) sigma_w (the chapter's C_b "
             f"sqrt(tau r k log d) sigma_w without its constants); {steps} steps of n = 4 d^1.5 fresh samples, hinge "
             f"loss, step size {' or '.join(map(str, PARITY_LRS))} (every model tries both). Each fit validated every "
             f"{every} steps on 8192 samples and kept its best step (Theorem 3.22's 'there exists t'); of the step "
             f"sizes, the one with the lower best validation error; the same rule for the three models. Error: that "
             f"step's, on 20000 test samples (disjoint from those the start and the ticket read). Chosen (step "
             f"size, step) per seed: {chosen(results)}. Nice share, p / 4 and the lottery ticket as in the XOR table, with r = 2 x blocks. Wall "
             f"time {time.time() - t0:.0f} s.")
    names, labels = list(PARITY_CASES), dict(zip(FEATURES, ("network", "random features", "NTK")))
    errors = {label: {case.split(":")[0]: [r["error"] for r in results[case, f].values() if "error" in r]
                      for case in names} for f, label in labels.items()}
    figure = bars_figure({g: {c: sum(v) / len(v) for c, v in bars.items() if v} for g, bars in errors.items()},
                         errors={g: {c: (min(v), max(v)) for c, v in bars.items() if v} for g, bars in errors.items()},
                         ylabel="test error (best validated step)", title="Structured parity: gradient vs fixed features")
    study.write("gradient_features_parity", {"results": {f"{c} | {f}": r for (c, f), r in results.items()},
                                             "notes": notes},
                f"# Shi 2024, Chapter 3: the network against fixed features on structured parity\n\n"
                f"{table(results, names)}\n\n{notes}", {"errors": figure})
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
