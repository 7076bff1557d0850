"""With vs without prediction head (spec 004), over several seeds and sizes: does the head keep the
features diverse, does E21 rise and fall, does the loss reach OPT, and how do these trend with d?

``python -m featlearn.experiments.noncontrastive [--preset demoA ...] [--dim D ...] [--num-patches P]
[--seed S ...] [--lr ETA] [--steps T] [--out DIR] [--no-compile]``

Presets (spec 1.3 demo-A data: P0 = 8, alpha = (4, 2.7), noise std 1, width 2): ``demoA`` d = 100, P = 32;
``demoA-d200``, ``demoA-d300`` the same with d = 200, 300. ``--dim`` replaces the presets' d (several
give one row pair per d), ``--num-patches`` their P. Default seeds 100..115.

Dynamics: population gradient descent (the N = infinity limit of Algorithm 1, spec 5.6), run by
``simulate_population`` with every seed, with and without head, batched in one tensor. Initial weights
are those ``NonContrastiveModule(gradient="population", init_seed=seed)`` builds (W ~ N(0, I/d) from the
framework RNG, lucky neuron first), so both variants start from the same W0 and pair up by seed. The
simulator is the module's population mode step for step: tests/test_noncontrastive.py
(``test_lightning_population_mode_equals_simulator``) checks a ``Trainer.fit`` trajectory against it to
float64 rounding, with and without head.

Step rule. Phase times grow like d^2/eta (spec 5.2: T1 <= O(d^2/eta), end phase T4 - T3 = d^{2+o(1)}/eta),
so the gradient-flow time is ``tau = eta * T = 5e4 (d/100)^2`` and ``eta = eta_E = 0.2`` at every d
(``T = 2.5e5 (d/100)^2`` steps). tau = 5e4 at d = 100 is the spec's 1e6 steps at eta = 0.05 (needed for the
partial runs to resolve, spec 5.5 test 8). eta = 0.2 is on the gradient-flow path: at d = 100 over
seeds 0..15 and 100..115, eta = 0.05, 0.1, 0.2 and 0.4 at the same tau end in the same outcome for
every seed. Each table row also reports how many runs changed outcome in the second half of the budget
(0 = the budget is long enough for the outcome) and how many ended within 1e-3 of OPT.

Theory (Thm 4.1 vs 4.3, w.p. 1 - o(1) as d grows): with the head the two neurons learn different
features, E21 rises and falls back to 0, the loss reaches OPT; without it both neurons collapse onto
v1. At finite d some seeds collapse or stay partial with a head (spec 5.3), and without a head a neuron
wins whichever feature has the larger alpha_l^6 |B_jl(0)|^4, so some seeds are diverse anyway.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time

import torch

from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
from featlearn.experiments.common import add_output_arguments, add_seed_argument, apply_shared_options, mean_range, output_dir
from featlearn.lightning_modules.noncontrastive import (NonContrastiveModule, PhaseTracker, feature_outcome,
                                                        representation_correlation, simulate_population)

DEMO_A = dict(num_feature_patches=8, alphas=[4.0, 2.7], noise_std=1.0)
PRESETS = {"demoA": dict(dim=100, num_patches=32, **DEMO_A),
           "demoA-d200": dict(dim=200, num_patches=32, **DEMO_A),
           "demoA-d300": dict(dim=300, num_patches=32, **DEMO_A)}
LR = 0.2
FLOW_TIME_AT_D100 = 5e4
RISE = 0.05       # peak |E21| that counts as a rise
FALL = 0.1        # final ||offdiag E|| <= FALL * its peak counts as the fall back to E = I
AT_OPT = 1e-3     # final loss - OPT below this counts as converged to OPT
HEAD, NO_HEAD = "head (offdiag, identity init)", "no head"


def step_rule(dim: int, lr: float = LR) -> int:
    """Steps for flow time ``tau = 5e4 (d/100)^2`` at step size ``lr`` (module docstring).

    Example:
        >>> step_rule(100), step_rule(200)
        (250000, 1000000)
    """
    return int(round(FLOW_TIME_AT_D100 * (dim / 100) ** 2 / lr))


def initial_weights(seeds, dm) -> torch.Tensor:
    return torch.stack([NonContrastiveModule(width=2, gradient="population", init_seed=seed).attach(dm).w.detach()
                        for seed in seeds])


def _median(xs):
    xs = [x for x in xs if x is not None]
    return int(statistics.median(xs)) if xs else None


def _subst(out, t, s, dm) -> float:
    """Population substitution ratio (Lemma 5.2, v1-samples) from the recorded B, R = ||U_j||^2 and E."""
    b, e = out["B"][t, s], out["E"][t, s]
    c = dm.constants()
    r = out["R"][t, s] * dm.noise_std ** 2             # a_jj = s^2 ||U_j||^2; M_jj = 15 a_jj^3
    ms = [c["C1"] * dm.alphas[0] ** 6 * float(b[j, 0]) ** 6 + c["C2"] * 15 * float(r[j]) ** 3 for j in (0, 1)]
    return abs(float(e[1, 0])) * math.sqrt(ms[0] / ms[1])


def race_rule(w0: torch.Tensor, dm) -> list[str]:
    """No-head outcome the spec predicts from W0 alone (5.2 [derived]): without a head the loss decouples
    and each neuron wins the feature with the larger alpha_l^6 |B_jl(0)|^4; DIV if the winners differ."""
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
                      _subst(out, t, s, dm) if has_head else 0.0)
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
    if has_head:
        row.update(peak_E21=peak, rise_and_fall=sum(rise_fall) / n, final_offdiag=_round(off[-1].tolist()),
                   rise_and_fall_and_DIV=sum(r and o == "DIV" for r, o in zip(rise_fall, outcomes)) / n)
    else:
        row.update(peak_E21=None, rise_and_fall=None, final_offdiag=None, rise_and_fall_and_DIV=None)
    row["race_rule_DIV"] = None if race is None else race.count("DIV") / n
    row["race_rule_agrees"] = None if race is None else sum(a == b for a, b in zip(race, outcomes))
    for key in ("T1", "T2", "T3", "T4"):
        defined = has_head or key == "T1"                   # T2..T4 are stages of the head's mechanism
        row[f"median_{key}"] = _median([b[key] for b in bounds]) if defined else None
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
    lines = ["# Non-contrastive learning: with vs without prediction head (spec 004, population GD)", "",
             f"`{meta['command']}`", "",
             f"P={meta['num_patches']}, P0={meta['num_feature_patches']}, alphas={meta['alphas']}, "
             f"noise_std={meta['noise_std']}, width 2, seeds {meta['seeds']}, {meta['step_rule']}; {runs_meta}; "
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
        cells = []
        for key in ("T1", "T2", "T3", "T4"):
            v = r[f"median_{key}"]
            cells.append("n/a" if r[f"runs_reaching_{key}"] is None else
                         "-" if v is None else f"{v} ({r[f'runs_reaching_{key}']} runs)")
        lines.append(f"| {r['dim']} | {r['variant']} | " + " | ".join(cells) + " |")
    lines += ["", f"DIV: the two neurons end on different features (|cos| >= 0.5); COL: both on one; PAR: one "
              f"unlearned. Rise+fall: peak |E21| >= {RISE} and final ||offdiag E||_F <= {FALL} x its peak. "
              f"Phase boundaries (spec 5.2, PhaseTracker, lead = lucky neuron at t = 0; '-' = no run reached it) "
              f"are medians over the runs that reach them; T2..T4 are stages of the head's substitution "
              f"mechanism and are n/a without a head. Race rule (spec 5.2 [derived], no head only): each neuron "
              f"learns the feature with the larger alpha_l^6 |B_jl(0)|^4, predicted from W0 alone; at fixed alphas "
              f"its DIV probability does not depend on d (B(0) ~ N(0, 1/d) for both features)."]
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
    return "\n".join(lines) + "\n"


def _positive(kind):
    def parse(text):
        value = kind(text)
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        return value
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(ap, "runs/noncontrastive")
    add_seed_argument(ap, default=tuple(range(100, 116)))
    ap.add_argument("--preset", nargs="+", default=["demoA"], choices=sorted(PRESETS),
                    help="data size(s): demoA = d 100, P 32; demoA-d200 / demoA-d300: d 200 / 300 (default demoA)")
    ap.add_argument("--dim", type=int, nargs="+", help="d, replacing the presets' (several: one row pair each)")
    ap.add_argument("--num-patches", type=int, help="P, replacing the presets' (even, > P0 = 8)")
    ap.add_argument("--lr", type=_positive(float), default=LR, help=f"eta = eta_E (default {LR})")
    ap.add_argument("--steps", type=_positive(int),
                    help="steps at every size (default: the step rule, 2.5e5 (d/100)^2 at eta 0.2)")
    ap.add_argument("--records", type=_positive(int), default=500, help="recorded points per run (default 500)")
    ap.add_argument("--trajectory-seeds", type=int, default=4,
                    help="seeds whose E21 trajectory is saved in the JSON (default 4)")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args(argv)
    apply_shared_options(ap, args)
    if args.dim is not None and min(args.dim) < 4:
        ap.error(f"--dim: must be >= 4 (two features and noise room for two neurons), got {min(args.dim)}")
    p0 = DEMO_A["num_feature_patches"]
    if args.num_patches is not None and (args.num_patches % 2 or args.num_patches <= p0):
        ap.error(f"--num-patches: must be even (two equal views) and > {p0} (the feature patches), "
                 f"got {args.num_patches}")
    if args.trajectory_seeds < 0:
        ap.error(f"--trajectory-seeds: must be >= 0, got {args.trajectory_seeds}")
    return args


def sizes(args) -> list[dict]:
    out = []
    for name in args.preset:
        for dim in args.dim or [PRESETS[name]["dim"]]:
            size = dict(PRESETS[name], dim=dim)
            if args.num_patches is not None:
                size["num_patches"] = args.num_patches
            if size not in out:
                out.append(size)
    return out


def run_size(size: dict, args) -> tuple[list[dict], dict, dict]:
    t0 = time.time()
    dm = TwoFeaturePatchDataModule(**size, batch_size=1)
    seeds = args.seed
    steps = args.steps or step_rule(size["dim"], args.lr)
    chunk = 10
    record_every = max(chunk, steps // args.records // chunk * chunk)
    w0 = initial_weights(seeds, dm)
    n = len(seeds)
    out = simulate_population(torch.cat([w0, w0]), dm.features, dm.alphas, dm.probs, dm.num_patches,
                              dm.num_feature_patches, dm.noise_std, steps=steps, lr=args.lr, head_lr=args.lr,
                              head=["offdiag"] * n + ["none"] * n, record_every=record_every,
                              compile=not args.no_compile, chunk=chunk)
    sim_s = time.time() - t0
    rows = [summarise(HEAD, out, list(range(n)), dm, 1.0, True),
            summarise(NO_HEAD, out, list(range(n, 2 * n)), dm, 1.0, False, race_rule(w0, dm))]
    meta = {"dim": size["dim"], "lr": args.lr, "steps": steps, "flow_time": args.lr * steps,
            "record_every": record_every, "sim_s": round(sim_s, 1)}
    # every 5th recorded point keeps the JSON small and still resolves the ~5% of the run E21 takes to fall
    keep = slice(None, None, 5)
    k = min(args.trajectory_seeds, n)
    traj = {"dim": size["dim"], "steps": out["steps"][keep].tolist(),
            "E21_by_seed": {str(seeds[i]): [round(float(x), 4) for x in out["E"][keep, i, 1, 0]] for i in range(k)}}
    return rows, meta, traj


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


def _compact_json(obj: dict) -> str:
    """One line per row / trajectory so the committed file stays readable at a glance."""
    def fmt(v):
        return json.dumps(v, separators=(", ", ": "))
    parts = [f' "meta": {fmt(obj["meta"])}', ' "rows": [\n' + ",\n".join("  " + fmt(r) for r in obj["rows"]) + "\n ]",
             ' "E21_trajectories": [\n' + ",\n".join("  " + fmt(t) for t in obj["E21_trajectories"]) + "\n ]"]
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    out_dir = output_dir(args.out, args.overwrite)
    t0 = time.time()
    rows, size_meta, trajs = [], [], []
    for size in sizes(args):
        r, m, tr = run_size(size, args)
        # the larger sizes take minutes each
        print(f"d={m['dim']}: {m['steps']} steps at lr {m['lr']} in {m['sim_s']} s", flush=True)
        rows += r
        size_meta.append(m)
        trajs.append(tr)
    first = sizes(args)[0]
    meta = {"num_patches": first["num_patches"], "num_feature_patches": first["num_feature_patches"],
            "alphas": first["alphas"], "noise_std": first["noise_std"], "width": 2,
            "seeds": seed_ranges(args.seed),
            "step_rule": ("steps fixed by --steps" if args.steps else
                          f"eta = eta_E = {args.lr}, steps = {FLOW_TIME_AT_D100:g} (d/100)^2 / eta"),
            "mode": "population GD", "compile": not args.no_compile, "threads": args.threads,
            "wall_s": round(time.time() - t0, 1), "sizes": size_meta,
            "command": shlex.join(["python", "-m", "featlearn.experiments.noncontrastive",
                                   *(sys.argv[1:] if argv is None else argv)])}
    md = markdown(rows, meta)
    print(md)
    result = {"meta": meta, "rows": rows, "E21_trajectories": trajs}
    (out_dir / "noncontrastive.json").write_text(_compact_json(result))
    (out_dir / "noncontrastive.md").write_text(md)
    return result


if __name__ == "__main__":
    main()
