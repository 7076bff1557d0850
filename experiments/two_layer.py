"""Feature learning from input structure (Shi 2024, Chapter 2 = Shi, Wei & Liang 2022): the two-layer network
against fixed-feature baselines, Table A.1 (parity, d = 500) printed beside the paper's numbers.

``python -m featlearn.experiments.two_layer [--table A1|A2|A3|MOG] [--seed S ...] [--out DIR]``. Built from ``configs/two_layer/experiment.yaml``: its ``methods`` (Network, NTK, RF, One Step, Two Step,
w/o structure) each run their config (``network.yaml``, ``ntk.yaml``, ...) on the table's data preset
with the table's width m and step count T. Stage 3 (the protocol of ``experiment.yaml``): the second layer
takes its own step, ``lr3a_grid`` x the theory's eta at T, the first layer ``lr3_grid`` x eta, for
``stage3_steps`` minibatch steps after steps 1-2 (T sets eta only, so the budget is not tied to the step
size). Every method that takes stage-3 steps gets the same budget and grid: each pair of multipliers is
trained on the first seed and the pair with the best validation accuracy is kept for every seed (a setting
with ``tuned_by`` reuses an earlier setting's pairs: Table A.3's d = 2000 those of d = 100). One / Two
Step are "the best classifiers" on the frozen hidden layer (Shi 2024, Section A.7.1), solved exactly, so
they have no step size to tune. Cells are accuracy in % (train, test on a fresh 10,000-sample set) and
``CosSim = max_i cos(w_i, sum_A M_j)`` at the end (for RF the init, for One / Two Step the frozen first
layer after step 1 / 2; NA for the NTK, whose features are the init's). Several seeds give
``mean (min-max)``.

``--table MOG``: the mixture of Gaussians on hypercube vertices (Shi 2024, Section A.7.3, Table A.6:
(d, k, sigma_r) = (100, 4, 1), (25, 4, 0.7), (100, 5, 1)), trained by "typical practice" (``mog.yaml``:
plain minibatch steps, no feature-learning steps, since gamma = 0 there) for the Network and its NTK / RF;
the paper prints no accuracies, so the table has ours, and as Cos the centre coverage: over the 2^k cluster
centres, the best neuron's cosine with each, worst and mean.

Theory (Theorems 2.2-2.4 and A.20): the network's neurons align with ``+-sum_A M_j`` after step 2 and it
reaches ~100%; fixed features (NTK, RF) and the step-1 features cannot fit the parity; without input
structure the gradient carries no signal and test accuracy stays ~50%.

Writes ``two_layer_<table>.md`` / ``.json``, the MDS picture of the network's neurons after init, step 1
and step 2 (``two_layer_<table>_neurons_<setting>.png``; on the mixture after init, 5/8 of the steps and
the end, with the centres) and the test accuracies against the paper's (``two_layer_<table>_accuracy.png``).
"""

import argparse
import functools
import importlib
import math
import shlex
import sys
import time
from dataclasses import dataclass, field

from featlearn.callbacks import KeepBestOnValidation
from featlearn.experiments.common import (CONFIGS, checked, experiment_parser, parse_experiment_args,
                                          quiet_lightning)
from featlearn.experiments.study import Run, Study, load_settings
from featlearn.experiments.two_layer_report import markdown
from featlearn.lightning_modules.two_layer import draw_neurons
from featlearn.metrics.figures import bars_figure


# no postponed annotations in this module: see featlearn.experiments.settings.load_settings
@dataclass
class Method:
    """A column: its run config (``configs/two_layer/``), the model class replacing the config's
    (``model``, a class path) and whether the data keeps its input structure."""
    config: str
    model: str | None = None
    structure: bool = True


@dataclass
class Setting:
    """A table's setting: its data preset with ``dim`` and ``data_args`` on top, width m, steps T, and the
    block of methods it runs."""
    name: str
    data: str
    width: int
    steps: int
    dim: int | None = None
    methods: str = "methods"
    data_args: dict[str, int | float] = field(default_factory=dict)
    stage3: bool = True  # False: T steps, one step size for both layers (the mixture's plain schedule)
    tuned_by: str | None = None  # an earlier setting of the table whose chosen step sizes this one reuses


@dataclass
class Settings:
    """``configs/two_layer/experiment.yaml``."""
    methods: dict[str, Method]
    mog_methods: dict[str, Method]
    lr3_grid: list[float]
    plain_lr3_grid: list[float]
    lr3a_grid: list[float]
    stage3_steps: int
    stop_check_every: int
    reg3_mult: float
    tables: dict[str, list[Setting]]
    paper: dict[str, dict[str, list[float | None]]]


SETTINGS = load_settings(CONFIGS / "two_layer" / "experiment.yaml", Settings)


def methods_of(setting: Setting) -> dict[str, Method]:
    """The columns a table setting runs (its ``methods`` names a block of experiment.yaml)."""
    return getattr(SETTINGS, setting.methods)


def _positive(kind, what="a finite number > 0", zero=False):
    return checked(kind, lambda v: (0 <= v if zero else 0 < v) and v < math.inf, what)


def parse_args(argv=None) -> argparse.Namespace:
    ap = experiment_parser(__doc__.split("\n")[0], "runs/two_layer")
    ap.add_argument("--table", choices=sorted(SETTINGS.tables), default="A1",
                    help="A1: parity d=500 (default); A2: interval; A3: parity d=100 and d=2000; MOG: the "
                         "Gaussian mixtures of Table A.6")
    every = list(dict.fromkeys([*SETTINGS.methods, *SETTINGS.mog_methods]))
    ap.add_argument("--methods", nargs="+", choices=every, metavar="METHOD",
                    help="columns to run (default all of the table's: " + ", ".join(SETTINGS.methods) +
                         "; MOG: " + ", ".join(SETTINGS.mog_methods) + ")")
    ap.add_argument("--lr3-grid", type=_positive(float, "a finite number >= 0", zero=True), nargs="+",
                    help=f"multipliers of the first layer's stage-3 step size tried for every method that takes "
                         f"stage-3 steps (default {SETTINGS.lr3_grid}; the mixture's: {SETTINGS.plain_lr3_grid})")
    ap.add_argument("--lr3a-grid", type=_positive(float), nargs="+", default=SETTINGS.lr3a_grid,
                    help=f"multipliers of the second layer's stage-3 step size, tried with each of --lr3-grid "
                         f"(default {SETTINGS.lr3a_grid}; the mixture's table steps both layers with --lr3-grid)")
    ap.add_argument("--stage3-steps", type=_positive(int, "an integer > 0"), default=SETTINGS.stage3_steps,
                    help=f"minibatch steps after steps 1-2 (default {SETTINGS.stage3_steps}; the mixture's "
                         f"table: T)")
    ap.add_argument("--stop-check-every", type=_positive(int, "an integer >= 0", zero=True),
                    default=SETTINGS.stop_check_every,
                    help=f"score validation accuracy every this many global steps of a stage-3 fit and keep the best "
                         f"state (the stopping step chosen on validation); 0: every fit runs its whole budget "
                         f"(default {SETTINGS.stop_check_every})")
    ap.add_argument("--num-train", type=_positive(int, "an integer > 0"),
                    help="training samples (default the preset's 50,000)")
    ap.add_argument("--width", type=_positive(int, "an integer > 0"), help="m, replacing the table's")
    ap.add_argument("--steps", type=_positive(int, "an integer > 2 (two schedule steps, then minibatches)"),
                    help="T, replacing the table's: it sets the theory's eta (and the mixture's step count)")

    def check(parser, args):
        if args.stop_check_every > 2 + args.stage3_steps:  # no validation would run: say so, run to the end
            print(f"--stop-check-every {args.stop_check_every} is longer than a fit ({2 + args.stage3_steps} steps): "
                  f"every fit runs to the end (as --stop-check-every 0)")
            args.stop_check_every = 0
        if args.steps is not None and args.steps < 3:
            parser.error(f"--steps: must be an integer > 2 (two schedule steps, then minibatches), got {args.steps}")
        available = list(dict.fromkeys(m for st in SETTINGS.tables[args.table] for m in methods_of(st)))
        names = [st.name for st in SETTINGS.tables[args.table]]
        for i, st in enumerate(SETTINGS.tables[args.table]):
            if st.tuned_by is not None and st.tuned_by not in names[:i]:
                parser.error(f"tables.{args.table}.tuned_by: must name an earlier setting of the table "
                             f"({', '.join(names[:i]) or 'none'}), got {st.tuned_by!r}")
        if args.methods is None:
            args.methods = available
        elif set(args.methods) - set(available):
            parser.error(f"--methods: table {args.table} has the columns {', '.join(available)}, got "
                         f"{', '.join(m for m in args.methods if m not in available)}")
    return parse_experiment_args(ap, argv, check=check)


def run_of(setting: Setting, method: Method, seed: int, lr3: tuple[float, float | None], args, name: str) -> Run:
    """One method at one setting, seed and stage-3 step-size multipliers (first layer, second layer; None:
    the first's). On a stage-3 table with ``--stop-check-every`` N > 0 the fit scores the whole validation split
    every N global steps (:func:`stops_on_validation`); otherwise no validation during the fit. :func:`collect`
    scores the whole splits at the end."""
    T = args.steps or setting.steps
    over = {"data": CONFIGS / "two_layer" / setting.data, "model.init_args.width": args.width or setting.width,
            "model.init_args.steps": T, "trainer.max_steps": 2 + args.stage3_steps if setting.stage3 else T,
            "trainer.limit_val_batches": 0, "model.init_args.lr3_mult": lr3[0], "model.init_args.lr3a_mult": lr3[1],
            "model.init_args.reg3_mult": SETTINGS.reg3_mult, "heatmap.every_n_steps": 10 ** 9}
    if stops_on_validation(setting, args):
        over.update({"trainer.limit_val_batches": 1.0, "trainer.val_check_interval": args.stop_check_every,
                     "trainer.check_val_every_n_epoch": None})
    if method.model is not None:
        over["model"] = method.model
    if setting.dim is not None:
        over["data.init_args.dim"] = setting.dim
    over.update({f"data.init_args.{key}": value for key, value in setting.data_args.items()})
    if args.num_train is not None:
        over["data.init_args.num_train"] = args.num_train
    if not method.structure:
        over["data.init_args.structure"] = False
    return Run(f"two_layer/{method.config}", name, over, seed=seed)


def stops_on_validation(setting: Setting, args) -> bool:
    """Whether a setting's fits choose their stopping step on validation: the stage-3 tables, with
    ``--stop-check-every`` > 0 (the mixture's plain schedule keeps its T steps)."""
    return setting.stage3 and args.stop_check_every > 0


def fit(study: Study, run: Run, stop: bool, neurons: bool = False) -> dict:
    """:func:`collect` of ``run``'s fit; with ``stop`` the fit keeps its best validation state
    (:class:`~featlearn.callbacks.KeepBestOnValidation`) and the result says at which global step (``stop``)."""
    keep = [KeepBestOnValidation("val/acc", "max")] if stop else []
    return study.fit(run, functools.partial(collect, neurons=neurons, keep=keep[0] if keep else None), callbacks=keep)


def collect(fitted, neurons: bool = False, keep: KeepBestOnValidation | None = None) -> dict:
    """A fit's accuracies in % (train, val, test) and CosSim (None for a method without feature learning,
    the NTK: its features are the init's), whether its stage-3 step size matters, and with ``neurons`` the
    network's MDS picture (:meth:`~featlearn.lightning_modules.two_layer.TwoLayerBase.neuron_picture`). With
    ``keep`` the model is the one of its best validation score (restored when the fit ended), and ``stop`` is
    that global step."""
    model, dm = fitted.model, fitted.datamodule
    acc = {split: model.accuracy(dm.full(split)["x"], dm.full(split)["y"]) for split in ("train", "val", "test")}
    final, own = model.final_metrics(), model.feature_learning
    res = {"train": 100 * acc["train"], "val": 100 * acc["val"], "test": 100 * acc["test"],
           "cos": final["cos_final"] if own else None}
    if keep is not None and keep.best_step is not None:  # the validation score of the kept step, as scored then
        res["stop"], res["stop_val"] = keep.best_step, 100 * keep.best_score
    if "cos_centres_min" in final:
        res["cos_centres_min"] = final["cos_centres_min"] if own else None
        res["cos_centres_mean"] = final["cos_centres_mean"] if own else None
    return {"result": res, "tunes_lr3": model.tunes_lr3, "moves_w": model.frozen_after != 0,
            "neurons": model.neuron_picture() if neurons else None}


@functools.lru_cache(maxsize=None)
def grid_kind(config: str, model: str | None) -> int:
    """How many of a column's grid points it trains, from its resolved config, to count the fits before running
    them: 0 for a probe's readout solved exactly, 1 per second-layer step for a first layer frozen from the start
    (RF), else all."""
    over = {} if model is None else {"model": model}
    resolved = Run(f"two_layer/{config}", "", over).resolved()["model"]
    if resolved["init_args"].get("readout", "schedule") == "best":
        return 0
    module, name = resolved["class_path"].rsplit(".", 1)
    return 1 if getattr(getattr(importlib.import_module(module), name), "frozen_after", None) == 0 else 2


def grid_of(setting: Setting, args) -> list[tuple[float, float | None]]:
    """The (first layer, second layer) multipliers a tuned column tries: every pair of the two grids, or on
    a table without the stage-3 protocol ``lr3_grid`` for both layers."""
    if not setting.stage3:
        return [(lr, None) for lr in args.lr3_grid or SETTINGS.plain_lr3_grid]
    return [(lr, lra) for lr in args.lr3_grid or SETTINGS.lr3_grid for lra in args.lr3a_grid]


def lr3_key(lr3: tuple[float, float | None]) -> str:
    """A trial's name in the results: ``w x1 / a x100`` (``x1`` where both layers share it)."""
    return f"x{lr3[0]:g}" if lr3[1] is None else f"w x{lr3[0]:g} / a x{lr3[1]:g}"


def tune(study: Study, setting: Setting, label: str, args) -> tuple[tuple, dict]:
    """The multipliers of :func:`grid_of` with the best validation accuracy on the first seed, and every
    trial's collected result (one trial for a method whose step size changes nothing)."""
    method, first, trials = methods_of(setting)[label], args.seed[0], {}
    for lr3 in grid_of(setting, args):
        same = [t for t in trials if lr3[1] is not None and t[1] == lr3[1] and not trials[t].get("moves_w", True)]
        if same:  # a first layer frozen from the start (RF): its step size changes nothing, the trial is shared
            trials[lr3] = trials[same[0]]
            continue
        tag = "_".join(f"{v:g}" for v in lr3 if v is not None)
        run = run_of(setting, method, first, lr3, args, _slug(f"{setting.name}_{label}_lr{tag}_s{first}"))
        trials[lr3] = fit(study, run, stops_on_validation(setting, args), neurons=label == "Network")
        if not trials[lr3].get("tunes_lr3", True):  # a probe solved exactly: every step size gives the same fit
            break
    best = max(trials, key=lambda lr: trials[lr].get("result", {}).get("val", -1.0))
    return best, trials


def run_setting(study: Study, setting: Setting, args, chosen: dict) -> tuple[dict, object]:
    """Per method: the chosen lr3 multiplier, the per-seed results and the tuning trials; the network's
    neuron figure of the first seed. ``chosen[(setting name, label)]`` holds every tuned choice so far: a
    setting with ``tuned_by`` reuses that setting's instead of searching (Table A.3's d = 2000 row, where one fit
    costs ~4x one at d = 500: every column gets the choice made on the same grid at d = 100)."""
    out, figure = {}, None
    methods = methods_of(setting)
    for label in [m for m in args.methods if m in methods]:
        if setting.tuned_by is None:
            best, trials = tune(study, setting, label, args)
            tunes, seeds = trials[best].get("tunes_lr3", True), args.seed[1:]
            per_seed = {args.seed[0]: _result(trials[best])}
            if label == "Network":
                figure = draw_neurons(trials[best].get("neurons"))
        else:
            best, trials, per_seed, seeds = chosen[(setting.tuned_by, label)], {}, {}, args.seed
            tunes = grid_kind(methods[label].config, methods[label].model) != 0
        chosen[(setting.name, label)] = best
        for seed in seeds:
            run = run_of(setting, methods[label], seed, best, args, _slug(f"{setting.name}_{label}_s{seed}"))
            per_seed[seed] = _result(fit(study, run, stops_on_validation(setting, args)))
        out[label] = {"lr3_mult": lr3_key(best) if tunes else None, "per_seed": per_seed,
                      "trials": {lr3_key(lr): _result(r) for lr, r in trials.items()}, "tuned_on": setting.tuned_by}
    return out, figure


def _result(collected: dict) -> dict:  # the table's numbers of a collected fit (a diverged one: its error)
    return collected.get("result", collected)


def count_fits(args) -> int:
    seeds = len(args.seed) - 1
    def size(st, grid, kind):
        if st.tuned_by is not None:
            return 1  # no search: the first seed's fit at the reused choice
        return 1 if kind == 0 else len(grid) if kind == 2 or not st.stage3 else len({a for _, a in grid})
    return sum(size(st, grid_of(st, args), grid_kind(method.config, method.model)) + seeds
               for st in SETTINGS.tables[args.table] for label, method in methods_of(st).items() if label in args.methods)


def _preset_num_train(settings: list[Setting]) -> int | str:
    sizes = {Run("two_layer/network.yaml", "", {"data": CONFIGS / "two_layer" / st.data}).resolved()
             ["data"]["init_args"]["num_train"] for st in settings}
    return sizes.pop() if len(sizes) == 1 else "/".join(map(str, sorted(sizes)))


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def main(argv=None) -> dict:
    args = parse_args(argv)
    quiet_lightning()
    t0 = time.time()
    results, figures, chosen = {}, {}, {}
    with Study(args, f"Table {args.table}", fits=count_fits(args)) as study:
        for setting in SETTINGS.tables[args.table]:
            res, fig = run_setting(study, setting, args, chosen)
            results[setting.name] = res
            if fig is not None:
                figures[f"neurons_{_slug(setting.name)}"] = fig
    groups = {}
    for name, res in results.items():
        paper = SETTINGS.paper.get(name, {})
        groups[f"{name} measured"] = {m: sum(r.get("test", math.nan) for r in res[m]["per_seed"].values())
                                      / len(res[m]["per_seed"]) for m in res}
        if paper:
            groups[f"{name} paper"] = {m: paper[m][1] for m in res if m in paper}
    figures["accuracy"] = bars_figure(groups, ylabel="test accuracy (%)", title=f"Table {args.table}")
    from featlearn.experiments.noncontrastive import seed_ranges
    grids = {g for st in SETTINGS.tables[args.table] for g in [tuple(lr for lr, _ in grid_of(st, args))]}
    meta = {"table": args.table, "seeds": seed_ranges(args.seed), "lr3_grid": sorted(set().union(*grids)),
            "lr3a_grid": args.lr3a_grid, "stage3_steps": args.stage3_steps,
            "stop_check_every": args.stop_check_every,
            "T": "/".join(sorted({str(args.steps or st.steps) for st in SETTINGS.tables[args.table]})),
            "num_train": args.num_train or _preset_num_train(SETTINGS.tables[args.table]), "threads": args.threads,
            "wall_s": round(time.time() - t0, 1),
            "command": shlex.join(["python", "-m", "featlearn.experiments.two_layer",
                                   *(sys.argv[1:] if argv is None else argv)])}
    payload = {"meta": meta, "results": {name: {m: {**r, "per_seed": {str(s): v for s, v in r["per_seed"].items()}}
                                                for m, r in res.items()} for name, res in results.items()},
               "paper": {name: SETTINGS.paper.get(name) for name in results}}
    study.write(f"two_layer_{args.table}", payload, markdown(results, meta, SETTINGS.paper, SETTINGS.reg3_mult), figures)
    return payload


if __name__ == "__main__":
    main()
