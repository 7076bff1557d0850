"""Shi 2024, Chapter 6 (Shi, Ming, Fan, Sala, Liang, CPAL 2024, arXiv:2303.07527): does a nuclear-norm (or rank)
penalty on the features keep the invariant features and drop the spurious ones, as measured out of distribution?

Three parts, settings in ``configs/erm_nu/experiment.yaml`` (:class:`~featlearn.lightning_modules.erm_nu.ERMNU`
on :class:`~featlearn.datamodules.domain_shift.DomainShiftDataModule`):

1. **Toy** (``toy.yaml``, Sec. 6.3.1): ERM, ERM-l2, ERM-NU and ERM-rank (rank(A) <= 1) on the same model, data and
   steps, each with the same budget of ``len(lams)`` fits per seed: l2 and NU try the grid ``lams``, ERM and
   rank as many restarts; fit k of every column starts from the same initialisation (``model.init``). Each column
   reports the fit with the best in-distribution validation accuracy (DomainBed's training-domain selection). Predicted:
   NU >= ERM out of distribution; the chapter reports ERM 0.76 against ERM-NU 0.94.
2. **Prop. 6.3** (``theory.yaml``, Sec. 6.4): ERM-l2 (``lam_l2``, and ``lam_l2_above`` above the proposition's
   lambda threshold with its constant taken as 1) against ERM-rank (``b_rank``) on D_gamma across (r, d, gamma).
   Predicted inside the proposition's conditions: ERM-rank 100% OOD accuracy, ERM-l2 at most exp(-r/10); Lemma
   6.1's alpha on R, beta on U, ``alpha / beta < 3 / (4 gamma)``, against the population optimum.
3. **Fig. 6.5's trend** (``theory.yaml``): ERM-NU across lambda at one size: OOD accuracy (predicted to rise then
   fall) and the stable rank of the OOD features (predicted to fall).

Usage::

    python -m featlearn.experiments.erm_nu --seed 0 1 2
"""

import os
import time
from dataclasses import dataclass

import torch

from featlearn.experiments.common import (CONFIGS, experiment_parser, markdown_table, mean_range,
                                          parse_experiment_args, quiet_lightning, scalars)
from featlearn.experiments.study import Run, Study, load_settings
from featlearn.metrics.figures import bars_figure, plt
from featlearn.metrics.spectrum import effective_rank, stable_rank
from featlearn.theory.erm_nu import (accuracy_normal, l2_ood_bound, l2_optimum, lemma61_ratio_bound,
                                     prop63_conditions, prop63_lambda_threshold)


# no postponed annotations in this module: see featlearn.experiments.settings.load_settings
@dataclass
class Toy:
    steps: int
    lams: list[float]           # l2 and nuclear: this grid; erm and rank: as many restarts
    x1_noise: list[float]


@dataclass
class Point:
    r: int
    d: int
    gamma: float


@dataclass
class Theory:
    steps: int
    batch_size: int
    lam_l2: float
    b_rank: int
    support_step: int
    points: list[Point]
    lam_l2_above: float | None = None  # ERM-l2 again, above Prop. 6.3's lambda threshold (its constant taken as 1),
    lr_l2_above: float | None = None   # at this lr (None: theory.yaml's)


@dataclass
class Variant:
    """Sweep fits with other training settings than the sweep's (None: the sweep's)."""
    lams: list[float]
    lr: float | None = None
    steps: int | None = None
    batch_size: int | None = None


@dataclass
class Sweep:
    point: Point
    batch_size: int
    steps: int
    lams: list[float]
    variants: list[Variant]


@dataclass
class Settings:
    """``configs/erm_nu/experiment.yaml``."""
    toy: Toy
    theory: Theory
    sweep: Sweep


SETTINGS = load_settings(CONFIGS / "erm_nu" / "experiment.yaml", Settings)
COLUMNS = ("erm", "l2", "nuclear", "rank")
LABELS = {"erm": "ERM", "l2": "ERM-l2", "nuclear": "ERM-NU", "rank": "ERM-rank"}
PAPER_TOY = {"erm": 0.76, "nuclear": 0.94}  # the chapter's OOD accuracies (Sec. 6.3.1, trained to convergence)


def evaluate(fitted) -> dict:
    """The fit's test loop (in-distribution test and OOD splits), then its final metrics, and the stable and
    effective rank of its features on the validation split."""
    trained = fitted.model.final_metrics()  # the validation values, before the test loop replaces the logged ones
    fitted.test()
    out = scalars({**trained, **fitted.model.final_metrics()})
    with torch.no_grad():
        F = fitted.model.feature_map(fitted.datamodule.full("val")["x"])
    return {**out, "val_stable_rank": round(stable_rank(F), 4), "val_effective_rank": round(effective_rank(F), 4),
            "steps": fitted.steps}


def quiet(steps: int) -> dict:
    """Overrides that evaluate and draw only at the end of a fit of ``steps`` steps."""
    return {"trainer.max_steps": steps, "trainer.val_check_interval": steps, "heatmap.every_n_steps": steps,
            "spectrum.every_n_steps": steps}


def toy_runs(settings: Toy, noise: float, column: str) -> list[Run]:
    """The budget of one column (every seed trained together): fit k starts from initialisation k of its seed; l2
    and nuclear take the k-th value of the grid, erm and rank no penalty."""
    return [Run("erm_nu/toy.yaml", f"toy/noise{noise:g}/{column}/fit{k}", {
        "model.init_args.regularizer": column, "model.init_args.init": k,
        "model.init_args.lam": lam if column in ("l2", "nuclear") else 0.0, "data.init_args.x1_noise": noise,
        **quiet(settings.steps)}) for k, lam in enumerate(settings.lams)]


def select(fits: list[dict]) -> dict:
    """The fit with the best in-distribution validation accuracy (the first among equals), with its index.

    Example:
        >>> select([{"accuracy": 0.9}, {"accuracy": 0.95}, {"accuracy": 0.95}])["fit"]
        1
    """
    best = max(range(len(fits)), key=lambda k: (fits[k]["accuracy"], -k))
    return {**fits[best], "fit": best}


def toy_table(selected: dict, settings: Toy) -> str:
    """One row per noise level and column: the selected fits' ID and OOD accuracies (mean (min-max) over seeds),
    the exact OOD accuracy of their linear boundary, ``w2 / w1`` and the chosen lambdas."""
    rows = {}
    for (noise, column), by_seed in selected.items():
        fits = list(by_seed.values())
        cell = {"ID accuracy": mean_range([f["test_accuracy"] for f in fits]),
                "OOD accuracy": mean_range([f["ood_accuracy"] for f in fits]),
                "OOD exact (closed form)": mean_range([f.get("ood_accuracy_exact") for f in fits]),
                "w2 / w1": mean_range([f.get("spurious_ratio") for f in fits], "{:.2f}"),
                "paper's OOD": PAPER_TOY.get(column, "-") if noise == 0 else "-",
                "chosen": ("lam " + ", ".join(f"{settings.lams[f['fit']]:g}" for f in fits)
                           if column in ("l2", "nuclear") else "restart " + ", ".join(str(f["fit"]) for f in fits))}
        rows[f"x1 noise {noise:g}, {LABELS[column]}"] = cell
    return markdown_table(rows, ["ID accuracy", "OOD accuracy", "OOD exact (closed form)", "w2 / w1", "paper's OOD",
                                 "chosen"])


def l2_fits(settings: Theory) -> dict[str, tuple[float, float | None]]:
    """The ERM-l2 columns, name -> (lambda, lr or None): ``l2`` at ``lam_l2`` and, if set, ``l2_above``."""
    above = {} if settings.lam_l2_above is None else {"l2_above": (settings.lam_l2_above, settings.lr_l2_above)}
    return {"l2": (settings.lam_l2, None), **above}


def prop_run(settings: Theory, point: Point, column: str) -> Run:
    """``column``: ``rank``, or an ERM-l2 column of :func:`l2_fits`."""
    lam, lr = l2_fits(settings).get(column, (0.0, None))
    return Run("erm_nu/theory.yaml", f"prop63/r{point.r}_d{point.d}_g{point.gamma:g}/{column}", {
        "model.init_args.regularizer": "rank" if column == "rank" else "l2", "model.init_args.lam": lam,
        **({} if lr is None else {"model.init_args.lr": lr}), "model.init_args.b_rank": settings.b_rank,
        "model.init_args.support_step": settings.support_step, "data.init_args.r": point.r,
        "data.init_args.d": point.d, "data.init_args.gamma": point.gamma,
        "data.init_args.batch_size": settings.batch_size, **quiet(settings.steps)})


def prop_table(results: dict, settings: Theory) -> tuple[str, dict]:
    """Two tables. Prop. 6.3, a row per point: the conditions (lambda's apart), the lambda threshold with its constant
    taken as 1, ERM-rank's OOD accuracy and support, and each ERM-l2 column's OOD accuracy beside exp(-r/10). Lemma
    6.1, a row per point and ERM-l2 lambda: alpha and beta against the population optimum, ``alpha / beta`` against
    ``3 / (4 gamma)``, and the OOD accuracy predicted at the optimum."""
    prop_rows, lemma_rows, predicted = {}, {}, {}
    for point in settings.points:
        key, name = (point.r, point.d, point.gamma), f"r = {point.r}, d = {point.d}, gamma = {point.gamma:g}"
        conditions = prop63_conditions(point.r, point.d, point.gamma, settings.b_rank)
        rank = list(results[key, "rank"].values())
        failed = [k for k, v in conditions.items() if not v]
        row = {"conditions but lambda's": "no: " + ", ".join(failed) if failed else "yes",
               "lambda threshold (constant 1)": f"{prop63_lambda_threshold(point.r):.2f}",
               "ERM-rank OOD": mean_range([f["ood_accuracy"] for f in rank], "{:.4f}"),
               "rank support in R": mean_range([f["support_invariant"] for f in rank], "{:.2f}"),
               "exp(-r/10)": f"{l2_ood_bound(point.r):.2g}"}
        predicted[f"r{point.r}_d{point.d}_g{point.gamma:g}"] = points = {**conditions}
        for column, (lam, _) in l2_fits(settings).items():
            alpha, beta = l2_optimum(point.r, point.d, point.gamma, lam)
            ood = accuracy_normal(torch.cat([torch.full((point.r,), alpha), torch.full((point.d - point.r,), beta)]),
                                  point.r, -point.gamma)
            above = prop63_conditions(point.r, point.d, point.gamma, lam=lam)["lambda_constant_1"]
            points[f"lam{lam:g}"] = {"alpha": alpha, "beta": beta, "ood_accuracy": ood, "lambda_constant_1": above}
            l2 = list(results[key, column].values())
            row[f"ERM-l2 OOD, lambda {lam:g}"] = mean_range([f["ood_accuracy"] for f in l2], "{:.4f}")
            lemma_rows[f"{name}, lambda {lam:g}{'' if above else ' (below the threshold)'}"] = {
                "alpha": mean_range([f["alpha"] for f in l2], "{:.4f}"), "alpha at the optimum": f"{alpha:.4f}",
                "beta": mean_range([f["beta"] for f in l2], "{:.4f}"), "beta at the optimum": f"{beta:.4f}",
                "alpha / beta < 3/(4 gamma)": f"{mean_range([f['alpha_beta_ratio'] for f in l2], '{:.2f}')} < "
                                              f"{lemma61_ratio_bound(point.gamma):.2f}",
                "ID accuracy": mean_range([f["test_accuracy"] for f in l2], "{:.4f}"),
                "OOD accuracy at the optimum": f"{ood:.2g}"}
        prop_rows[name] = row
    return (markdown_table(prop_rows, list(next(iter(prop_rows.values())))) + "\n\nERM-l2 against Lemma 6.1's "
            "optimum:\n\n" + markdown_table(lemma_rows, list(next(iter(lemma_rows.values()))))), predicted


def variant_text(lam: float, variant: Variant | None = None) -> str:
    """A sweep fit's label, e.g. ``lambda = 0.01, lr 0.1, 1000 steps``.

    Example:
        >>> variant_text(0.0), variant_text(0.001, Variant(lams=[0.001], batch_size=128))
        ('lambda = 0 (ERM)', 'lambda = 0.001, batches of 128')
    """
    parts = [f"lambda = {lam:g}" + (" (ERM)" if lam == 0 else "")]
    if variant is not None:
        settings = (("lr ", variant.lr, ""), ("", variant.steps, " steps"), ("batches of ", variant.batch_size, ""))
        parts += [f"{name}{value:g}{unit}" for name, value, unit in settings if value is not None]
    return ", ".join(parts)


def sweep_run(settings: Sweep, lam: float, variant: Variant | None = None) -> Run:
    """ERM-NU at ``lam`` (ERM at 0) on the sweep's point, with a variant's lr, steps or batch size."""
    p, v = settings.point, variant or Variant(lams=[])
    name = "sweep/" + variant_text(lam, variant).replace("lambda = ", "lam").replace(" (ERM)", "").replace(", ", "_")
    lr_setting = {} if v.lr is None else {"model.init_args.lr": v.lr}
    return Run("erm_nu/theory.yaml", name.replace(" ", ""), {
        "model.init_args.regularizer": "nuclear" if lam > 0 else "erm", "model.init_args.lam": lam, **lr_setting,
        "data.init_args.r": p.r, "data.init_args.d": p.d, "data.init_args.gamma": p.gamma,
        "data.init_args.batch_size": v.batch_size or settings.batch_size, **quiet(v.steps or settings.steps)})


def sweep_fits(settings: Sweep) -> list[tuple[float, Variant | None]]:
    """The sweep's lambdas, then each variant's."""
    return [(lam, None) for lam in settings.lams] + [(lam, v) for v in settings.variants for lam in v.lams]


SWEEP_COLUMNS = {"ID accuracy": ("test_accuracy", "{:.4f}"), "OOD accuracy": ("ood_accuracy", "{:.4f}"),
                 "OOD stable rank": ("ood_stable_rank", "{:.3f}"), "val effective rank": ("val_effective_rank", "{:.1f}"),
                 "share of |w| on R": ("invariant_share", "{:.3f}")}


def sweep_table(results: dict) -> str:
    """One row per sweep fit (keyed by :func:`variant_text`): mean (min-max) over seeds."""
    rows = {label: {name: mean_range([f[key] for f in fitted.values()], fmt)
                    for name, (key, fmt) in SWEEP_COLUMNS.items()} for label, fitted in results.items()}
    return markdown_table(rows, list(SWEEP_COLUMNS))


def sweep_figure(results: dict, settings: Sweep) -> plt.Figure:
    """Fig. 6.5's layout: OOD accuracy (left axis) and the OOD features' stable rank (right axis) against lambda,
    one line per seed; lambda = 0 (ERM) drawn at a tenth of the smallest positive lambda; markers: the variants."""
    xs = [lam or min(x for x in settings.lams if x > 0) / 10 for lam in settings.lams]
    fig, ax = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
    right = ax.twinx()
    main = [results[variant_text(lam)] for lam in settings.lams]
    for i, seed in enumerate(sorted(main[0])):
        ax.plot(xs, [fits[seed]["ood_accuracy"] for fits in main], "o-", color="C0", alpha=0.7,
                label="OOD accuracy" if i == 0 else None)
        right.plot(xs, [fits[seed]["ood_stable_rank"] for fits in main], "s--", color="C3", alpha=0.7,
                   label="OOD stable rank" if i == 0 else None)
    for k, variant in enumerate(settings.variants):  # other training settings: one marker per fit
        for lam in variant.lams:
            fits = results[variant_text(lam, variant)]
            label = variant_text(lam, variant).split(", ", 1)[1]
            ax.plot([lam] * len(fits), [f["ood_accuracy"] for f in fits.values()], "*^v"[k % 3],
                    color=f"C{k + 1}", markersize=11, label=f"OOD accuracy, {label}" if lam == variant.lams[0] else None)
    ax.set_xscale("log")
    p = settings.point
    ax.set(xlabel="lambda (leftmost: 0, ERM)", ylabel="OOD accuracy", ylim=(-0.02, 1.02),
           title=f"ERM-NU on D_gamma (r = {p.r}, d = {p.d}, gamma = {p.gamma:g})")
    right.set_ylabel("stable rank of the OOD features")
    fig.legend(loc="outside lower center", ncols=3, fontsize="small")
    return fig


def main(argv=None) -> dict:
    parser = experiment_parser(__doc__.split("\n")[0], "runs/erm_nu")
    args = parse_experiment_args(parser, argv)
    quiet_lightning()
    toy, theory, sweep = SETTINGS.toy, SETTINGS.theory, SETTINGS.sweep
    n_seeds, prop_columns = len(args.seed), (*l2_fits(theory), "rank")
    fits = n_seeds * (len(toy.x1_noise) * len(COLUMNS) * len(toy.lams) + len(prop_columns) * len(theory.points)
                      + len(sweep_fits(sweep)))
    t0, selected, prop, swept = time.time(), {}, {}, {}
    with Study(args, "fits", fits=fits) as study:
        for noise in toy.x1_noise:
            for column in COLUMNS:
                budget = [study.fit_seeds(run, args.seed, evaluate) for run in toy_runs(toy, noise, column)]
                selected[noise, column] = {seed: select([fits[seed] for fits in budget]) for seed in args.seed}
        t_toy = time.time() - t0
        for pt, column in ((pt, column) for pt in theory.points for column in prop_columns):
            prop[(pt.r, pt.d, pt.gamma), column] = study.fit_seeds(prop_run(theory, pt, column), args.seed, evaluate)
        t_prop = time.time() - t0 - t_toy
        for lam, variant in sweep_fits(sweep):
            swept[variant_text(lam, variant)] = study.fit_seeds(sweep_run(sweep, lam, variant), args.seed, evaluate)
    t_all = time.time() - t0
    prop_text, predicted = prop_table(prop, theory)
    notes = (f"Seeds {' '.join(map(str, args.seed))}; cells are mean (min-max) over seeds. Wall time {t_all:.0f} s on "
             f"{args.threads} CPU thread(s) (toy {t_toy:.0f} s, Prop. 6.3 {t_prop:.0f} s, sweep "
             f"{t_all - t_toy - t_prop:.0f} s).")
    toy_notes = (f"A (2x2) and a linear head, SGD lr 0.1, batches of 64 from 2000 training samples, {toy.steps} steps, "
                 f"logistic loss. Every column has {len(toy.lams)} fits per seed, fit k from initialisation k of the "
                 f"seed (the seeds of a fit trained together, lightning fit --seeds): ERM-l2 and ERM-NU with lambda = "
                 f"{', '.join(map(str, toy.lams))} (NU: lambda ||X_batch A^T||_*, l2: lambda/2 of every squared "
                 f"weight), ERM restarts, ERM-rank rank(A) <= 1 from step 50. Reported: the fit with the best ID "
                 f"validation accuracy (1000 samples; ties to the first fit, the smallest lambda); ID test and OOD on "
                 f"10000 each. OOD exact: the closed form of the boundary's accuracy (noise-free x1 only).")
    above = "" if theory.lam_l2_above is None else (f" and {theory.lam_l2_above:g} at lr {theory.lr_l2_above or 1:g} "
                                                    f"(above Prop. 6.3's threshold, constant 1)")
    prop_notes = (f"f_w(x) = sum_j w_j x_j from w = 0, SGD lr 1 on fresh batches of {theory.batch_size}, {theory.steps} "
                  f"steps. ERM-l2: lambda = {theory.lam_l2:g}{above}; its optimum (alpha, beta) and OOD accuracy from "
                  f"Lemma 6.1's population objective (normal margin, :func:`featlearn.theory.erm_nu.l2_optimum`). "
                  f"Conditions but lambda's: the gamma window, the dimension, B_rank <= r; lambda's threshold: sqrt(r) "
                  f"/ exp(sqrt(r) / 5) (Omega(.) with its constant taken as 1). ERM-rank: B_rank = {theory.b_rank}, the "
                  f"support = the largest |w_j| after {theory.support_step} ERM steps, then a refit on it. OOD on "
                  f"10000 samples from D_-gamma.")
    p = sweep.point
    failed = [k for k, v in prop63_conditions(p.r, p.d, p.gamma).items() if not v]
    sweep_notes = (f"ERM-NU at r = {p.r}, d = {p.d}, gamma = {p.gamma:g} (Prop. 6.3's conditions: "
                   f"{'fail: ' + ', '.join(failed) if failed else 'hold'}), fresh batches of {sweep.batch_size} > d, "
                   f"{sweep.steps} steps, SGD lr 1, lambda ||X_batch diag(w)||_* (unnormalised). Stable rank "
                   f"||F||_F^2 / ||F||_2^2 of the centred OOD features (10000 samples); effective rank on the 2000 "
                   f"validation samples; share of |w| on R: sum_R |w_j| / sum_j |w_j|.")
    markdown = (f"# Shi 2024, Chapter 6: ERM-NU, ERM-l2 and ERM-rank on synthetic domain shifts\n\n{notes}\n\n"
                f"## (i) The 2-D toy (Sec. 6.3.1)\n\n{toy_table(selected, toy)}\n\n{toy_notes}\n\n"
                f"## (ii) Prop. 6.3 on D_gamma\n\n{prop_text}\n\n{prop_notes}\n\n"
                f"## (iii) Fig. 6.5's trend: ERM-NU against lambda\n\n{sweep_table(swept)}\n\n{sweep_notes}")
    kinds = (("ID", "test_accuracy"), ("OOD", "ood_accuracy"))
    toy_bars = {LABELS[c]: {f"{kind}, noise {noise:g}": sum(f[key] for f in selected[noise, c].values()) / n_seeds
                            for noise in toy.x1_noise for kind, key in kinds} for c in COLUMNS}
    prop_labels = {**{c: f"ERM-l2, lambda {lam:g}" for c, (lam, _) in l2_fits(theory).items()}, "rank": "ERM-rank"}
    prop_bars = {prop_labels[c]: {f"r{pt.r} d{pt.d} g{pt.gamma:g}": sum(
        f["ood_accuracy"] for f in prop[(pt.r, pt.d, pt.gamma), c].values()) / n_seeds for pt in theory.points}
        for c in prop_columns}
    figures = {"toy": bars_figure(toy_bars, ylabel="accuracy (selected fit, mean over seeds)", zoom=True,
                                  title="2-D toy: ID and OOD accuracy"),
               "prop63": bars_figure(prop_bars, ylabel="OOD accuracy (mean over seeds)", title="Prop. 6.3: OOD accuracy"),
               "sweep": sweep_figure(swept, sweep)}
    results = {"toy": {f"noise{n:g}_{c}": v for (n, c), v in selected.items()},
               "prop63": {f"r{k[0]}_d{k[1]}_g{k[2]:g}_{c}": v for (k, c), v in prop.items()},
               "prop63_predicted": predicted, "sweep": swept,
               "wall_s": round(t_all, 1), "notes": [notes, toy_notes, prop_notes, sweep_notes]}
    study.write("erm_nu", results, markdown, figures)
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
