"""Shi 2024, Chapter 7: universality vs label efficiency of contrastive learning, and contrastive regularisation.

On the linear multi-task model (``configs/universality/data_tiny.yaml``: s = 5 shared, r = 10 invariant features
per task, u = 10 spurious, label noise 0.25), for each seed and each ``T`` of the c-table:

* ``universal``: ``configs/universality/universal.yaml`` (pretraining on the mixture of all T tasks);
* ``specific``: ``specific.yaml`` (the target task only);
* ``cr``: ``cr.yaml`` started from that universal run's ``last.ckpt`` (trust region gamma around it, no
  Frobenius cap, the exact projection onto both constraints);
* ``cr_closed``: the same from the closed-form universal ``W*`` (``reference: null``): Prop F.9's setting.

Tables (``universality_c.md`` / ``.json``, ``universality_m.md`` / ``.json``, ``universality_m_sweep.png``,
``universality_m_sweep_erm.png``):

1. **c-table**: the per-group squared column norms ``c_S``, ``c_{P_target}``, ``c_{P_other}`` (mean over the
   other tasks), ``c_U`` against the closed forms (universal ``1, 1/T, 1/T, 0``; specific ``1, 1, 0, 0``; CR
   ``min(1, sqrt(c_start) + gamma / sqrt(r - s))^2`` on the target, the rest kept), the final contrastive
   loss on fresh pairs against its closed form ``E l(c_S Z + c_P Z_t)`` at the predicted column norms, and the
   private overlap (:func:`~featlearn.theory.universality.private_overlap`): the trained universal ``W*`` is one
   of many optima (the loss never sees two tasks' private features together), and where the target's private
   directions overlap another task's, the spectral cap makes the target's gain that task's loss;
2. **m-sweep** at ``T = m_sweep.T``: test MSE on the target task and on another task, for the trained
   representations and, as reference rows, the closed-form ones, with two probes: ridge (lambda by leave-one-out
   on the m labels, one grid for every representation) and the paper's norm-constrained ERM
   (``||u|| <= B_{phi,t}``, :func:`~featlearn.theory.universality_downstream.predictor_bound` on the closed
   form of the representation's mode); with linear CKA between the trained representations on target-task
   inputs.

Settings in ``configs/universality/experiment.yaml``; ``--T``, ``--m``, ``--sweep-T``, ``--repeats``,
``--gamma``, ``--steps`` override them. With several ``--seed`` values every cell is ``mean (min-max)``. Every
fit goes through :class:`~featlearn.experiments.study.Study`: its measurements (and, at ``m_sweep.T``, its ``W``)
are kept in ``<out>/study.json``, so the same command run again resumes.

Usage:
    python -m featlearn.experiments.universality [--seed 0 1 2] [--T 2 4 8] [--gamma 1.0] [--threads 1]
"""

import argparse
import functools
import os
import time
from dataclasses import dataclass

import torch

from featlearn.datamodules.hidden_representation import HiddenRepresentationDataModule
from featlearn.experiments.common import (CONFIGS, experiment_parser, markdown_table, mean_range,
                                         parse_experiment_args, quiet_lightning)
from featlearn.experiments.study import Run, Study, load_settings
from featlearn.lightning_modules.universality import contrastive_loss
from featlearn.metrics.figures import curves_figure
from featlearn.theory.universality import (MODES, closed_form_representation, contrastive_loss_closed_form,
                                           predicted_column_norms, private_overlap)
from featlearn.theory.universality_downstream import downstream_errors, linear_cka, predictor_bound


@dataclass
class CTable:
    T: list[int]          # task counts of the c-table


@dataclass
class MSweep:
    T: int                # the m-sweep reuses the runs at this T
    m: list[int]          # labels per task
    repeats: int          # labelled sets per m


# no postponed annotations in this module: see featlearn.experiments.settings.load_settings
@dataclass
class Settings:
    """``configs/universality/experiment.yaml``."""
    c_table: CTable
    m_sweep: MSweep
    loss_samples: int     # fresh pairs on which the final contrastive loss is measured


SETTINGS = load_settings(CONFIGS / "universality" / "experiment.yaml", Settings)
LABELS = {"universal": "universal", "specific": "specific (target task)",
          "cr": "contrastive regularisation (from the trained universal W*)",
          "cr_closed": "contrastive regularisation (from the closed-form W*)"}
RUNS = tuple(LABELS)
GROUPS = ("S", "P_target", "P_other", "U")
SWEEP_KEYS = ("w", "predicted", "start", "other")  # kept for the m-sweep only (not in the c-table's JSON)


def mode_run(mode: str, T: int, seed: int | None, args, reference: str | None = None) -> Run:
    """``configs/universality/<mode>.yaml`` at ``T`` and ``seed`` (``cr_closed``: ``cr.yaml`` from the closed form;
    no seed: the run :meth:`~featlearn.experiments.study.Study.fit_seeds` fits at every seed)."""
    cr = mode.startswith("cr")
    overrides = {"data.init_args.T": T, "data.init_args.num_val": max(args.m),
                 "model.init_args.probe_repeats": args.repeats}
    if reference:
        overrides["model.init_args.reference"] = reference
    if cr:
        overrides["model.init_args.gamma"] = args.gamma
    if args.steps is not None:
        overrides["trainer.max_steps"] = max(1, args.steps // 3) if cr else args.steps
    return Run(f"universality/{mode.removesuffix('_closed')}.yaml", f"{mode}_T{T}", overrides, seed=seed)


def measure(fitted, mode: str, sweep: bool, t0: float) -> dict:
    """A fitted run's column norms against the prediction, its contrastive loss on fresh pairs against the
    closed form, the private overlap and its checkpoint; with ``sweep``, also what the m-sweep needs (``W``, the
    predicted norms per task, cr's start and the other task)."""
    model, dm = fitted.model, fitted.datamodule
    c, p = model.column_norms(), model.predicted()
    others = [t for t in range(dm.T) if t != model.target]
    split = lambda v: {"S": v["S"], "P_target": v[f"P{model.target}"], "U": v["U"],  # noqa: E731
                       "P_other": sum(v[f"P{t}"] for t in others) / len(others) if others else None}
    with torch.no_grad():
        idx = torch.arange(SETTINGS.loss_samples, device=model.device) + 10 ** 9
        batch = dm.sample(idx, "train")
        loss = float(contrastive_loss(model(batch["x"]), model(batch["x_pos"]), model.hparams.loss))
    tasks = range(dm.T) if mode == "universal" else [model.target]
    theory_loss = contrastive_loss_closed_form(p["S"], [p[f"P{t}"] for t in tasks], dm.s, dm.r, samples=100_000)
    overlap = private_overlap(model.w.detach(), dm.M, dm.groups, model.target)
    out = {"c": split(c), "c_theory": split(p), "loss": loss, "loss_theory": theory_loss, "overlap": overlap,
           "ckpt": fitted.checkpoint, "wall_s": time.time() - t0}  # wall_s: the fit that trained every seed
    if sweep:
        out.update(w=model.w.detach().cpu().tolist(), predicted=p, other=model.other,
                   start=model.start_norms[f"P{model.target}"] if mode == "cr" else None)
    return out


def fit_modes(study: Study, T: int, args) -> dict[int, dict]:
    """The four runs at ``T``, measured: seed -> mode -> result. Each mode's seeds train together in one fit; cr
    starts from the same seed's universal ``last.ckpt``."""
    runs = {}
    for mode in RUNS:
        reference, seeds = None, args.seed
        if mode == "cr":  # from each seed's own universal run; a seed whose universal run diverged has none
            reference = str(study.out / f"universal_T{T}" / "seed_{seed}" / "last.ckpt")
            seeds = [s for s in args.seed if not runs["universal"][s].get("diverged")]
        collect = functools.partial(measure, mode=mode, sweep=T == args.sweep_T, t0=time.time())
        runs[mode] = study.fit_seeds(mode_run(mode, T, None, args, reference), seeds, collect) if seeds else {}
        for seed in set(args.seed) - set(seeds):
            runs[mode][seed] = {"diverged": True, "error": "its universal run diverged: no reference to start from"}
    return {seed: {mode: runs[mode][seed] for mode in RUNS} for seed in args.seed}


def sweep_data(T: int, seed: int, args) -> HiddenRepresentationDataModule:
    """The universal run's data (the labelled and test samples are functions of its settings alone)."""
    return HiddenRepresentationDataModule(**_universal_data(T, max(args.m), args.repeats, args.steps), seed=seed)


@functools.lru_cache(maxsize=None)
def _universal_data(T: int, m: int, repeats: int, steps: int | None) -> dict:
    """The universal runs' data settings at ``T`` but the seed (the CLI resolves them in ~0.7 s: once per T)."""
    options = argparse.Namespace(m=[m], repeats=repeats, steps=steps)
    resolved = mode_run("universal", T, None, options).resolved()["data"]["init_args"]
    return {k: v for k, v in resolved.items() if k != "seed"}


def m_sweep(runs: dict, dm: HiddenRepresentationDataModule, args) -> dict:
    """Test MSE against m on the target and another task, for the trained and the closed-form representations,
    and linear CKA between the trained ones; ``runs`` maps mode to :func:`measure`'s result at one T."""
    reps = {mode: torch.tensor(r["w"], dtype=torch.float64) for mode, r in runs.items()}
    theory = {mode: predicted_column_norms(mode, dm.T, dm.s, dm.r, gamma=args.gamma if mode == "cr" else None,
                                           target=dm.target_task) for mode in MODES}
    for mode in MODES:
        reps[f"{mode} (closed form)"] = closed_form_representation(dm.groups, dm.M, theory[mode])
    theory.update({rep: r["predicted"] for rep, r in runs.items()})  # cr: from its own start
    out = {"errors": {}, "errors_erm": {}, "cka": {}, "cr_start": runs["cr"]["start"] if "cr" in runs else None,
           "erm_bound": {}}
    n = args.repeats * max(args.m)
    for name, task in (("target", dm.target_task), ("other", runs["universal"]["other"])):
        train, test = dm.labeled(task, torch.arange(n), "val"), dm.labeled(task, torch.arange(4000), "test")
        for rep, W in reps.items():
            f_train, f_test = train["x"].double() @ W.t(), test["x"].double() @ W.t()
            c = theory[rep.removesuffix(" (closed form)")]
            bound = predictor_bound(dm.label_vectors[task], dm.s, c["S"], c[f"P{task}"])
            out["erm_bound"].setdefault(rep, {})[name] = bound
            for key, probe_bound in (("errors", None), ("errors_erm", bound)):
                rows = downstream_errors(f_train, train["y"], f_test, test["y"], args.m, args.repeats, bound=probe_bound)
                out[key].setdefault(rep, {})[name] = {m: row["mse"] for m, row in rows.items()}
    x = dm.labeled(dm.target_task, torch.arange(4000), "test")["x"].double()
    trained = [m for m in RUNS if m in runs]
    for i, a in enumerate(trained):
        for b in trained[i + 1:]:
            out["cka"][f"{a} vs {b}"] = linear_cka(x @ reps[a].t(), x @ reps[b].t())
    return out


def c_table(results: dict, Ts: list[int]) -> tuple[str, dict]:
    """Markdown rows: one per (T, mode), measured (mean over seeds) next to the closed form."""
    rows = {}
    for T in Ts:
        for mode in RUNS:
            per_seed = [results[seed][T][mode] for seed in results]
            cells = {}
            for g in GROUPS:
                cells[f"c_{g}"] = mean_range([r["c"][g] for r in per_seed])
                theory = per_seed[0]["c_theory"][g]
                cells[f"c_{g} theory"] = "n/a" if theory is None else f"{theory:.3f}"
            cells["loss"] = mean_range([r["loss"] for r in per_seed], "{:.4f}")
            cells["loss theory"] = f"{per_seed[0]['loss_theory']:.4f}"
            cells["max |c - theory|"] = mean_range([max(abs(r["c"][g] - r["c_theory"][g]) for g in GROUPS
                                                        if r["c_theory"][g] is not None) for r in per_seed])
            cells["private overlap"] = mean_range([r["overlap"] for r in per_seed])
            rows[f"T = {T}, {LABELS[mode]}"] = cells
    columns = ([c for g in GROUPS for c in (f"c_{g}", f"c_{g} theory")]
               + ["loss", "loss theory", "max |c - theory|", "private overlap"])
    return markdown_table(rows, columns), rows


def m_table(sweeps: dict, ms: list[int], key: str = "errors") -> str:
    """Markdown rows: representation x task, one column per m (mean over seeds).

    Example:
        >>> sweeps = {0: {"errors": {"universal": {"target": {8: 0.75}, "other": {8: 0.7}}}}}
        >>> print(m_table(sweeps, [8]))
        | setting | m = 8 |
        |---|---|
        | universal, target task | 0.750 |
        | universal, other task | 0.700 |
    """
    first = next(iter(sweeps.values()))
    rows = {}
    for rep in first[key]:
        for task in ("target", "other"):
            rows[f"{rep}, {task} task"] = {f"m = {m}": mean_range([s[key][rep][task][m] for s in sweeps.values()])
                                           for m in ms}
    return markdown_table(rows, [f"m = {m}" for m in ms])


def parse_args(argv=None) -> argparse.Namespace:
    """The options; every bad value is refused, naming the option, before the output folder is made."""
    parser = experiment_parser(__doc__.split("\n")[0], "runs/universality")
    parser.add_argument("--T", type=int, nargs="+", default=SETTINGS.c_table.T,
                        help=f"task counts of the c-table (default {SETTINGS.c_table.T})")
    parser.add_argument("--sweep-T", type=int, default=SETTINGS.m_sweep.T,
                        help=f"T of the m-sweep (default {SETTINGS.m_sweep.T}; added to --T if missing)")
    parser.add_argument("--m", type=int, nargs="+", default=SETTINGS.m_sweep.m, help="labels per task")
    parser.add_argument("--repeats", type=int, default=SETTINGS.m_sweep.repeats,
                        help="labelled sets per m (test MSE averaged over them)")
    parser.add_argument("--gamma", type=float, default=1.0, help="trust-region radius of contrastive regularisation")
    parser.add_argument("--steps", type=int, help="pretraining steps (default: the configs'; cr runs a third)")
    return parse_experiment_args(parser, argv, _refuse_bad_options)


def _refuse_bad_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    bad_T = [t for t in args.T + [args.sweep_T] if t < 2]
    if bad_T:
        parser.error(f"--T / --sweep-T: every T must be an integer >= 2 (another task is needed), got {bad_T}")
    if len(set(args.T)) != len(args.T):
        parser.error(f"--T: task counts must be distinct, got {args.T}")
    if any(m < 2 for m in args.m):
        parser.error(f"--m: every m must be an integer >= 2 (leave-one-out needs two labels), got {args.m}")
    if args.repeats < 1:
        parser.error(f"--repeats: must be a positive integer, got {args.repeats}")
    if not (args.gamma > 0 and args.gamma < float("inf")):
        parser.error(f"--gamma: must be a finite number > 0, got {args.gamma}")
    if args.steps is not None and args.steps < 3:
        parser.error(f"--steps: must be an integer >= 3, got {args.steps}")
    args.m = sorted(set(args.m))
    if args.sweep_T not in args.T:
        args.T = sorted(args.T + [args.sweep_T])


def main(argv=None) -> dict:
    args = parse_args(argv)
    quiet_lightning()
    t0 = time.time()
    results, sweeps = {}, {}
    with Study(args, "T x seeds", fits=len(RUNS) * len(args.seed) * len(args.T)) as study:
        for T in args.T:
            for seed, runs in fit_modes(study, T, args).items():
                if T == args.sweep_T:
                    sweeps[seed] = m_sweep(runs, sweep_data(T, seed, args), args)
                results.setdefault(seed, {})[T] = {mode: {k: v for k, v in r.items() if k not in SWEEP_KEYS}
                                                   for mode, r in runs.items()}
    wall = time.time() - t0
    ctext, crows = c_table(results, args.T)
    seeds = " ".join(map(str, args.seed))
    notes = (f"s = 5, r = 10, u = 10 (configs/universality/data_tiny.yaml), label noise 0.25, projected SGD lr 0.5, "
             f"batch 2048, seeds {seeds}{': mean (min-max)' if len(args.seed) > 1 else ''}; CR: gamma = {args.gamma:g}, "
             f"no Frobenius cap, exact projection onto the spectral ball and the trust region (Dykstra), started from "
             f"the universal run (its theory from that run's measured c_P_target) or from the closed-form W*. Private "
             f"overlap: cosine of the smallest principal angle between the target's private columns of W M and the "
             f"other tasks' (0 in the closed form; the theory's 'other tasks keep their weight' assumes 0). "
             f"Loss: the multi-negative logistic loss on {SETTINGS.loss_samples} fresh pairs (batch-mean negative), "
             f"theory: E log(1 + exp(-(c_S Z + c_P Z_t))) at the predicted c. Total wall time {wall:.0f} s.")
    study.write("universality_c", {"results": results, "notes": notes},
                f"# Shi 2024, Chapter 7: column norms c = ||(W M)_:,j||^2 per group, measured vs theory\n\n"
                f"{ctext}\n\n{notes}")
    mtext, etext = m_table(sweeps, args.m), m_table(sweeps, args.m, "errors_erm")
    bounds = next(iter(sweeps.values()))["erm_bound"]
    cka = {pair: mean_range([s["cka"][pair] for s in sweeps.values()]) for pair in next(iter(sweeps.values()))["cka"]}
    cka_text = markdown_table({pair: {"linear CKA": v} for pair, v in cka.items()}, ["linear CKA"])
    bound_text = ", ".join(f"{rep} {b['target']:.2f} / {b['other']:.2f}" for rep, b in bounds.items()
                           if "closed form" not in rep)
    mnotes = (f"T = {args.sweep_T}; test MSE on 4000 samples, averaged over {args.repeats} nested label sets; label "
              f"noise variance 0.0625 (the floor). The other task is task 1. Ridge: no standardisation, lambda chosen "
              f"by leave-one-out on the m labels from one grid (1e-4 .. 1e3) for every representation. Norm-constrained "
              f"ERM (the paper's Eq. 7.2 with the squared loss): least squares with ||u|| <= B_phi,t, the norm of the "
              f"least-norm best predictor on the closed form of the representation's mode (its theory column norms; "
              f"features it does not encode take no norm), target / other task: {bound_text}. "
              f"Closed-form rows: W = [diag(sqrt c), 0] M^T at the predicted c. CKA: on target-task test inputs.")
    figures = {}
    for key, probe in (("errors", "ridge"), ("errors_erm", "||u|| <= B ERM")):
        figures["sweep" if key == "errors" else "sweep_erm"] = curves_figure(
            args.m, {f"{rep}, {task}": [[s[key][rep][task][m] for m in args.m] for s in sweeps.values()]
                     for rep in ("universal", "specific", "cr") for task in ("target", "other")},
            xlabel="labels m", ylabel="test MSE", logx=True,
            title=f"{probe}, T = {args.sweep_T} (one curve per seed)")
    study.write("universality_m", {"sweeps": sweeps, "notes": mnotes},
                f"# Shi 2024, Chapter 7: downstream test MSE against m (target task and another task)\n\n"
                f"## Ridge, lambda by leave-one-out\n\n{mtext}\n\n"
                f"## Norm-constrained ERM, ||u|| <= B_phi,t\n\n{etext}\n\n{cka_text}\n\n{mnotes}",
                figures=figures)
    return {"results": results, "sweeps": sweeps, "c_rows": crows, "wall_s": wall}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
