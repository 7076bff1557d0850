"""With vs without prediction head (Wen & Li 2022), over several seeds and sizes: does the head keep the
features diverse, does E21 rise and fall, does the loss reach OPT, and how do these trend with d?

``python -m featlearn.experiments.noncontrastive [--preset demoA ...] [--dim D ...] [--num-patches P]
[--seed S ...] [--lr ETA] [--steps T] [--out DIR] [--no-compile]``

Built from ``configs/noncontrastive/experiment.yaml`` (:class:`Settings`): its ``variants``
(``with_head_population.yaml``, ``no_head_population.yaml``) give each variant's model and the demo-A data
(P = 32, P0 = 8, alpha = (4, 2.7), noise std 1), its ``presets`` the sizes (d = 100, 200, 300) and ``lr`` /
``flow_time_at_d100`` the step rule. ``--dim`` replaces the presets' d, ``--num-patches`` the data's P.
Default seeds 100..115.

Each variant at each d is a :class:`~featlearn.experiments.study.Run` of its config; its fits, one per seed,
are population gradient descent (Algorithm 1 with N = infinity) from the W0 the Run's model builds with
``init_seed=seed`` (so the variants pair up by seed), all batched in one tensor by
``featlearn.theory.noncontrastive.simulate_population``, which is the module's population mode step for step
(``test_lightning_population_mode_equals_simulator``: to float64 rounding). Each size's results are kept in
``<out>/study.json``, so the same command run again resumes.

Step rule: phase times grow like d^2/eta (Wen & Li 2022, Lemma B.13, Theorem E.2), so the flow time is
``eta T = 5e4 (d/100)^2`` at ``eta = eta_E = 0.2`` (``T = 2.5e5 (d/100)^2`` steps; eta = 0.05 .. 0.4 at
equal flow time give the same outcomes at d = 100). Theory (Thm 4.1 vs 4.3): with the head the neurons learn
different features, E21 rises and falls, the loss reaches OPT; without it both collapse onto v1 (at finite d
a neuron wins the feature with the larger alpha_l^6 |B_jl(0)|^4: :func:`race_rule`). See
``docs/methods/noncontrastive.md``.

Writes ``noncontrastive.md`` / ``.json``, ``noncontrastive_E21_d<d>.png`` (E21 of the head runs by outcome) and
``noncontrastive_outcomes.png`` (DIV / COL / PAR with and without head).
"""

import argparse
import functools
import math
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
from featlearn.experiments.common import (CONFIGS, checked, experiment_parser, mean_range, parse_experiment_args,
                                          quiet_lightning)
from featlearn.experiments.study import Run, Study, load_settings
from featlearn.lightning_modules.noncontrastive import NonContrastiveModule
from featlearn.metrics.figures import bars_figure, curves_figure
from featlearn.theory.noncontrastive import (PhaseTracker, feature_outcome, representation_correlation,
                                             simulate_population, substitution_ratio)


# no postponed annotations in this module: see featlearn.experiments.settings.load_settings
@dataclass
class Preset:
    """A named size (``--preset``)."""
    dim: int


@dataclass
class Settings:
    """``configs/noncontrastive/experiment.yaml``: variant name -> run config, sizes, eta, the step rule's flow time."""
    variants: dict[str, str]
    presets: dict[str, Preset]
    lr: float
    flow_time_at_d100: float


SETTINGS = load_settings(CONFIGS / "noncontrastive" / "experiment.yaml", Settings)
RISE = 0.05       # peak |E21| that counts as a rise
FALL = 0.1        # final ||offdiag E|| <= FALL * its peak counts as the fall back to E = I
AT_OPT = 1e-3     # final loss - OPT below this counts as converged to OPT
CHUNK = 10        # compiled steps per call


def step_rule(dim: int, lr: float = SETTINGS.lr) -> int:
    """Steps for flow time ``tau = 5e4 (d/100)^2`` at step size ``lr`` (module docstring).

    Example:
        >>> step_rule(100), step_rule(200)
        (250000, 1000000)
    """
    return int(round(SETTINGS.flow_time_at_d100 * (dim / 100) ** 2 / lr))


@functools.cache
def variant_config(config: str) -> dict:
    """A variant's config as it stands (model and data arguments), resolved as the CLI resolves it."""
    return Run(f"noncontrastive/{config}", config).resolved()


def variant_runs(dim: int, steps: int, args) -> dict[str, Run]:
    """Variant name -> its Run at d = ``dim``, eta = eta_E = ``args.lr`` for ``steps`` steps. Seedless: population
    GD draws nothing but W0, which each of its fits takes from the model's ``init_seed``."""
    patches = {} if args.num_patches is None else {"data.init_args.num_patches": args.num_patches}
    over = {"data.init_args.dim": dim, "model.init_args.lr": args.lr, "model.init_args.head_lr": args.lr,
            "trainer.max_steps": steps, **patches}
    return {name: Run(f"noncontrastive/{config}", f"d{dim}/{config.removesuffix('.yaml')}", over)
            for name, config in SETTINGS.variants.items()}


def race_rule(w0: torch.Tensor, dm) -> list[str]:
    """No-head outcome predicted from W0 alone (our derivation from Wen & Li 2022, App. F): without a head
    the population loss (its Eq. A.1) decouples over neurons, each neuron runs its own tensor-power race
    and wins the feature with the larger alpha_l^6 |B_jl(0)|^4; DIV if the winners differ."""
    b0 = w0 @ dm.features.to(w0).T
    picks = (torch.tensor(dm.alphas, dtype=w0.dtype) ** 6 * b0.abs() ** 4).argmax(-1)
    return ["DIV" if int(p[0]) != int(p[1]) else "COL" for p in picks]


def summarise(name: str, out: dict, idx: list[int], dm, lr_ratio: float, has_head: bool,
              race: list[str] | None = None) -> dict:
    """One table row; quantities that need a trained head are ``None`` without one (printed n/a), and
    ``race`` (the no-head race rule's outcomes) is compared with the no-head runs only."""
    steps = out["steps"].tolist()
    opt = dm.constants()["OPT"]
    half = len(steps) // 2
    e = out["E"][:, idx]                                    # [T, S, 2, 2]
    off = (e - torch.diag_embed(torch.diagonal(e, dim1=-2, dim2=-1))).norm(dim=(-2, -1))
    outcomes, changed, bounds, corr = [], 0, [], []
    for s in idx:
        outcomes.append(feature_outcome(out["cos"][-1, s])[0])
        changed += outcomes[-1] != feature_outcome(out["cos"][half, s])[0]
        corr.append(float(representation_correlation(out["w"][s], dm.features, dm.alphas, dm.probs,
                                                     dm.num_patches, dm.num_feature_patches,
                                                     dm.noise_std)[0, 1].abs()))
        tr = PhaseTracker(0, dm.dim, lr_ratio, fall=FALL)
        for t in range(len(steps)):
            tr.update(steps[t], out["cos"][t, s], out["B"][t, s], out["R"][t, s], out["E"][t, s],
                      substitution_ratio(out["B"][t, s], out["R"][t, s], out["E"][t, s], dm.alphas[0],
                                         dm.num_patches, dm.num_feature_patches, dm.noise_std, 0)
                      if has_head else 0.0)
        bounds.append(tr.bounds)
    n = len(idx)
    gap = (out["loss"][-1, idx] - opt).tolist()
    # over every step: at eta 0.4 a rise and fall of E21 to 0.2 can fit between two records
    peak = _round(out["E_peak"][idx, 1, 0].tolist())               # lag (1) <- lead (0)
    rise_fall = [p >= RISE and float(off[-1, i]) <= FALL * max(float(off[:, i].max()), p) for i, p in enumerate(peak)]
    row = {"variant": name, "dim": dm.dim, "runs": n, "DIV": outcomes.count("DIV") / n,
           "COL": outcomes.count("COL") / n, "PAR": outcomes.count("PAR") / n, "changed_2nd_half": changed,
           "final_loss": _round([g + opt for g in gap]), "OPT": opt, "at_OPT": sum(g < AT_OPT for g in gap),
           "abs_corr_f1f2": _round(corr), "outcomes": " ".join(outcomes)}
    head_only = dict(peak_E21=peak, rise_and_fall=sum(rise_fall) / n, final_offdiag=_round(off[-1].tolist()),
                     rise_and_fall_and_DIV=sum(r and o == "DIV" for r, o in zip(rise_fall, outcomes)) / n)
    row.update(head_only if has_head else dict.fromkeys(head_only))
    row["race_rule_DIV"] = None if race is None else race.count("DIV") / n
    row["race_rule_agrees"] = None if race is None else sum(a == b for a, b in zip(race, outcomes))
    for key in ("T1", "T2", "T3", "T4"):
        defined = has_head or key == "T1"                   # T2..T4 are stages of the head's mechanism
        reached = [b[key] for b in bounds if b[key] is not None]
        row[f"median_{key}"] = int(statistics.median(reached)) if defined and reached else None
        row[f"runs_reaching_{key}"] = sum(b[key] is not None for b in bounds) if defined else None
    return row


def _round(xs: list[float]) -> list[float]:
    return [float(f"{x:.6g}") for x in xs]


def _cell(row, key, fmt="{:.3f}"):
    v = row[key]
    if isinstance(v, list):
        return mean_range(v, fmt)
    return "n/a" if v is None else fmt.format(v)


def markdown(rows: list[dict], meta: dict) -> str:
    runs_meta = "; ".join(f"d={m['dim']}: lr={m['lr']}, steps={m['steps']}, sim {m['sim_s']} s"
                          for m in meta["sizes"])
    lines = ["# Non-contrastive learning: with vs without prediction head (Wen & Li 2022, population GD)", "",
             f"`{meta['command']}`", "",
             f"P={meta['num_patches']}, P0={meta['num_feature_patches']}, alphas={meta['alphas']}, "
             f"noise_std={meta['noise_std']}, width {meta['width']}, seeds {meta['seeds']}, {meta['step_rule']}; {runs_meta}; "
             f"wall {meta['wall_s']} s, compile={meta['compile']}", "",
             "| d | variant | runs | DIV | COL | PAR | outcome changed in 2nd half | peak abs E21 mean (min-max) "
             "| E21 rise+fall | rise+fall and DIV | final offdiag(E) | final loss mean (min-max) | OPT "
             "| runs within 1e-3 of OPT | abs Corr(f1,f2) | race rule: DIV (runs agreeing) |",
             "|" + "---|" * 16]
    for r in rows:
        lines.append("| " + " | ".join([
            str(r["dim"]), r["variant"], str(r["runs"]), f"{r['DIV']:.2f}", f"{r['COL']:.2f}", f"{r['PAR']:.2f}",
            str(r["changed_2nd_half"]), _cell(r, "peak_E21"), _cell(r, "rise_and_fall", "{:.2f}"),
            _cell(r, "rise_and_fall_and_DIV", "{:.2f}"), _cell(r, "final_offdiag", "{:.1e}"),
            _cell(r, "final_loss", "{:.4f}"), f"{r['OPT']:.4f}", str(r["at_OPT"]),
            _cell(r, "abs_corr_f1f2"),
            "n/a" if r["race_rule_DIV"] is None else f"{r['race_rule_DIV']:.2f} ({r['race_rule_agrees']}/{r['runs']})",
            ]) + " |")
    lines += ["", "| d | variant | median T1 | median T2 | median T3 | median T4 |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = ["n/a" if r[f"runs_reaching_{k}"] is None else "-" if r[f"median_{k}"] is None else
                 f"{r[f'median_{k}']} ({r[f'runs_reaching_{k}']} runs)" for k in ("T1", "T2", "T3", "T4")]
        lines.append(f"| {r['dim']} | {r['variant']} | " + " | ".join(cells) + " |")
    lines += ["", f"DIV: the two neurons end on different features (|cos| >= 0.5); COL: both on one; PAR: one "
              f"unlearned. Rise+fall: peak |E21| >= {RISE} and final ||offdiag E||_F <= {FALL} x its peak. "
              f"Phase boundaries (Wen & Li 2022, Section 5, PhaseTracker, lead = lucky neuron at t = 0; '-' = no "
              f"run reached it) are medians over the runs that reach them; T2..T4 are stages of the head's "
              f"substitution mechanism and are n/a without a head. Race rule (our derivation, no head only): "
              f"each neuron learns the feature with the larger alpha_l^6 |B_jl(0)|^4, predicted from W0 alone; at "
              f"fixed alphas its DIV probability does not depend on d (B(0) ~ N(0, 1/d) for both features)."]
    for d in sorted({r["dim"] for r in rows}):
        pair = [r for r in rows if r["dim"] == d]
        if len(pair) != 2:
            continue
        ab = list(zip(pair[0]["outcomes"].split(), pair[1]["outcomes"].split()))
        lines += ["", f"d = {d}, paired by seed (same W0): DIV with and without head "
                  f"{sum(a == b == 'DIV' for a, b in ab)}, only with head "
                  f"{sum(a == 'DIV' != b for a, b in ab)}, only without head "
                  f"{sum(b == 'DIV' != a for a, b in ab)} of {len(ab)}. Outcomes per seed: head: "
                  f"{pair[0]['outcomes']}; no head: {pair[1]['outcomes']}"]
    return "\n".join(lines)


def seed_ranges(seeds: list[int]) -> str:
    """Seeds as short runs, in the order given.

    Example:
        >>> seed_ranges([0, 1, 2, 3, 100, 101, 7])
        '0..3, 100..101, 7'
    """
    runs = []
    for s in seeds:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def parse_args(argv=None) -> argparse.Namespace:
    ap = experiment_parser(__doc__.split("\n")[0], "runs/noncontrastive")
    ap.set_defaults(seed=list(range(100, 116)))
    ap.add_argument("--preset", nargs="+", default=["demoA"], choices=sorted(SETTINGS.presets),
                    help="sizes from configs/noncontrastive/experiment.yaml: demoA = d 100; demoA-d200 / demoA-d300 "
                         "(default demoA)")
    positive = "a finite number > 0"
    p0 = variant_config(next(iter(SETTINGS.variants.values())))["data"]["init_args"]["num_feature_patches"]
    ap.add_argument("--dim", type=checked(int, lambda v: v >= 4, ">= 4 (two features and noise room for two neurons)"),
                    nargs="+", help="d, replacing the presets' (several: one row pair each)")
    ap.add_argument("--num-patches", type=checked(int, lambda v: v % 2 == 0 and v > p0, f"even (two equal views) and "
                                                   f"> {p0} (the feature patches)"), help="P, replacing the data's")
    ap.add_argument("--lr", type=checked(float, lambda v: 0 < v < math.inf, positive), default=SETTINGS.lr,
                    help=f"eta = eta_E (default {SETTINGS.lr}, experiment.yaml)")
    ap.add_argument("--steps", type=checked(int, lambda v: v > 0, positive),
                    help="steps at every size (default: the step rule, 2.5e5 (d/100)^2 at eta 0.2)")
    ap.add_argument("--records", type=checked(int, lambda v: v > 0, positive), default=500,
                    help="recorded points per run (default 500)")
    ap.add_argument("--trajectory-seeds", type=checked(int, lambda v: v >= 0, ">= 0"), default=4,
                    help="seeds whose E21 trajectory is saved in the JSON (default 4)")
    ap.add_argument("--no-compile", action="store_true")
    return parse_experiment_args(ap, argv)


def run_size(study: Study, dim: int, args) -> dict:
    """Both variants at d = ``dim`` over every seed, in one simulation: the table rows, the size's meta, the
    kept E21 trajectories and the head runs' E21 by outcome (the figure)."""
    seeds, n = args.seed, len(args.seed)
    steps = args.steps or step_rule(dim, args.lr)
    record_every = max(CHUNK, steps // args.records // CHUNK * CHUNK)
    runs = variant_runs(dim, steps, args)
    # "simulator": results of the W-stepping simulator (before the moments) are refit, not mixed in
    spec = {"runs": [run.spec() for run in runs.values()], "seeds": seeds, "record_every": record_every,
            "simulator": "moments"}

    def simulate() -> dict:
        t0 = time.time()
        (head_name, none_name), (head, none) = runs, [run.resolved() for run in runs.values()]
        if head["data"] != none["data"]:
            raise ValueError("the variants of experiment.yaml must share their data (one batched simulation)")
        dm = TwoFeaturePatchDataModule(**head["data"]["init_args"])
        heads = [config["model"]["init_args"]["head"] for config in (head, none)]
        # [2S, m, d]: the W0 each variant's model builds with init_seed = seed, head runs first
        w0 = torch.stack([NonContrastiveModule(**{**config["model"]["init_args"], "init_seed": seed}).attach(dm).w
                          for config in (head, none) for seed in seeds]).detach()
        out = simulate_population(w0, dm.features, dm.alphas, dm.probs, dm.num_patches, dm.num_feature_patches,
                                  dm.noise_std, steps=steps, lr=args.lr, head_lr=args.lr,
                                  head=[h for h in heads for _ in seeds], record_every=record_every,
                                  compile=not args.no_compile, chunk=CHUNK, progress=True)
        sim_s = time.time() - t0
        rows = [summarise(head_name, out, list(range(n)), dm, 1.0, heads[0] != "none"),
                summarise(none_name, out, list(range(n, 2 * n)), dm, 1.0, heads[1] != "none",
                          race_rule(w0[n:], dm))]
        meta = {"dim": dim, "lr": args.lr, "steps": steps, "flow_time": args.lr * steps,
                "record_every": record_every, "sim_s": round(sim_s, 1)}
        # every 5th recorded point keeps the JSON small and still resolves the ~5% of the run E21 takes to fall
        keep = slice(None, None, 5)
        traj = {"dim": dim, "steps": out["steps"][keep].tolist(),
                "E21_by_seed": {str(seeds[i]): [round(float(x), 4) for x in out["E"][keep, i, 1, 0]]
                                for i in range(min(args.trajectory_seeds, n))}}
        by_outcome: dict[str, list] = {}
        for i, outcome in enumerate(rows[0]["outcomes"].split()):
            by_outcome.setdefault(outcome, []).append(out["E"][:, i, 1, 0].tolist())
        return {"rows": rows, "meta": meta, "trajectory": traj, "steps": out["steps"].tolist(),
                "E21_by_outcome": dict(sorted(by_outcome.items()))}

    return study.compute(f"d{dim}", spec, simulate, fits=len(spec["seeds"]) * len(spec["runs"]))


def main(argv=None) -> dict:
    args = parse_args(argv)
    quiet_lightning()
    t0 = time.time()
    rows, size_meta, trajs, figures = [], [], [], {}
    dims = dict.fromkeys(args.dim or [SETTINGS.presets[name].dim for name in args.preset])
    with Study(args, "fits", fits=2 * len(args.seed) * len(dims)) as study:
        for dim in dims:
            size = run_size(study, dim, args)
            rows += size["rows"]
            size_meta.append(size["meta"])
            trajs.append(size["trajectory"])
            figures[f"E21_d{dim}"] = curves_figure(size["steps"], size["E21_by_outcome"], xlabel="step", ylabel="E21",
                                                   title=f"{rows[-2]['variant']}, d = {dim}: E21 per seed, by outcome")
    variant = variant_config(next(iter(SETTINGS.variants.values())))
    data = variant["data"]["init_args"]
    meta = {"num_patches": args.num_patches or data["num_patches"], "num_feature_patches": data["num_feature_patches"],
            "alphas": data["alphas"], "noise_std": data["noise_std"], "width": variant["model"]["init_args"]["width"],
            "seeds": seed_ranges(args.seed),
            "step_rule": ("steps fixed by --steps" if args.steps else
                          f"eta = eta_E = {args.lr}, steps = {SETTINGS.flow_time_at_d100:g} (d/100)^2 / eta"),
            "mode": "population GD", "compile": not args.no_compile, "threads": args.threads,
            "wall_s": round(time.time() - t0, 1), "sizes": size_meta,
            "command": shlex.join(["python", "-m", "featlearn.experiments.noncontrastive",
                                   *(sys.argv[1:] if argv is None else argv)])}
    figures["outcomes"] = bars_figure({f"d={r['dim']}, {r['variant']}": {c: r[c] for c in ("DIV", "COL", "PAR")}
                                       for r in rows}, ylabel="fraction of runs", title="outcome per variant")
    result = {"meta": meta, "rows": rows, "E21_trajectories": trajs}
    study.write("noncontrastive", result, markdown(rows, meta), figures)
    return result


if __name__ == "__main__":
    main()
