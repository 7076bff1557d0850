"""With vs without prediction head at the validated default config (spec 004 demo-A), over several seeds.

``python -m featlearn.experiments.noncontrastive [--out DIR] [--seeds 16] [--steps 400000] [--no-compile]``

Runs population gradient descent (the N = infinity limit of Algorithm 1, spec 5.6; the mode in which
demo-A was validated and the only one whose ~2e5-step dynamics fit on a CPU) for every seed with the
identity-initialised off-diagonal head and without a head, all runs batched in one tensor. The initial
weights are those ``NonContrastiveModule(gradient="population", init_seed=seed)`` builds (W ~ N(0, I/d)
from the framework RNG, lucky neuron first). Prints and saves (``noncontrastive.json``,
``noncontrastive.md``) a table: fraction of runs whose neurons cover both features (DIV), collapsed
(COL) or partial (PAR), peak and final off-diagonal entries of E, final loss vs OPT, final
|Corr(f1, f2)|, and the median phase boundaries T1..T4 of the head runs.

Theory (Thm 4.1 vs 4.3): diverse features with the head, collapse onto v1 without it; finite-d seeds
may still collapse or stay partial with a head (spec 5.3: DIV 5 / COL 2 / PAR 3 of 10 proto seeds).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
from featlearn.experiments.common import add_output_arguments, output_dir
from featlearn.lightning_modules.noncontrastive import (NonContrastiveModule, PhaseTracker, feature_outcome,
                                                        representation_correlation, simulate_population)

DEMO_A = dict(dim=100, num_patches=32, num_feature_patches=8, alphas=[4.0, 2.7], noise_std=1.0)


def initial_weights(seeds, dm) -> torch.Tensor:
    ws = []
    for seed in seeds:
        model = NonContrastiveModule(width=2, gradient="population", init_seed=seed).attach(dm)
        ws.append(model.w.detach().clone())
    return torch.stack(ws)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return int(statistics.median(xs)) if xs else None


def summarise(name: str, out: dict, idx: list[int], dm, opt: float, lr_ratio: float) -> dict:
    steps = out["steps"].tolist()
    e = out["E"][:, idx]                                    # [T, S, 2, 2]
    off = (e - torch.diag_embed(torch.diagonal(e, dim1=-2, dim2=-1))).norm(dim=(-2, -1))
    e21 = e[..., 1, 0].abs()                                # lag (1) <- lead (0)
    outcomes, bounds, corr = [], [], []
    for s in idx:
        outcomes.append(feature_outcome(out["cos"][-1, s])[0])
        w = out["w"][s]
        corr.append(float(representation_correlation(w, dm.features, dm.alphas, dm.probs, dm.num_patches,
                                                     dm.num_feature_patches, dm.noise_std)[0, 1].abs()))
        tr = PhaseTracker(0, dm.dim, lr_ratio)
        for t in range(len(steps)):
            tr.update(steps[t], out["cos"][t, s], out["B"][t, s], out["R"][t, s], out["E"][t, s],
                      _subst(out, t, s, dm))
        bounds.append(dict(tr.bounds))
    n = len(idx)
    final_loss = out["loss"][-1, idx]
    row = {
        "variant": name, "runs": n,
        "DIV": outcomes.count("DIV") / n, "COL": outcomes.count("COL") / n, "PAR": outcomes.count("PAR") / n,
        "peak_E21_mean": float(e21.max(0).values.mean()), "peak_E21_max": float(e21.max()),
        "peak_offdiag_fro_mean": float(off.max(0).values.mean()),
        "peak_E12_max": float(e[..., 0, 1].abs().max()),
        # E21 rose (peak >= 0.05) and fell back (final ||offdiag E|| <= 0.1 peak): the Fig. 3/4 shape
        "rise_and_fall": float(((e21.max(0).values >= 0.05) & (off[-1] <= 0.1 * off.max(0).values)).double().mean()),
        "final_offdiag_fro_mean": float(off[-1].mean()), "final_offdiag_fro_max": float(off[-1].max()),
        "final_loss_mean": float(final_loss.mean()), "OPT": opt,
        "final_gap_mean": float((final_loss - opt).mean()), "final_gap_max": float((final_loss - opt).max()),
        "final_abs_corr_f1f2_mean": sum(corr) / n,
        "outcomes": outcomes,
    }
    for key in ("T1", "T2", "T3", "T4"):
        row[f"median_{key}"] = _median([b[key] for b in bounds])
        row[f"runs_reaching_{key}"] = sum(b[key] is not None for b in bounds)
    row["phases_per_run"] = bounds
    return row


def _subst(out, t, s, dm) -> float:
    """Population substitution ratio (Lemma 5.2, v1-samples) from the recorded B, R = ||U_j||^2 and E."""
    b, e = out["B"][t, s], out["E"][t, s]
    c = dm.constants()
    r = out["R"][t, s] * dm.noise_std ** 2             # a_jj = s^2 ||U_j||^2; M_jj = 15 a_jj^3
    ms = [c["C1"] * dm.alphas[0] ** 6 * float(b[j, 0]) ** 6 + c["C2"] * 15 * float(r[j]) ** 3 for j in (0, 1)]
    return abs(float(e[1, 0])) * math.sqrt(ms[0] / ms[1])


def markdown(rows: list[dict], meta: dict) -> str:
    cols = [("variant", "variant", "{}"), ("runs", "runs", "{}"), ("DIV", "both features (DIV)", "{:.2f}"),
            ("COL", "collapsed (COL)", "{:.2f}"), ("PAR", "partial (PAR)", "{:.2f}"),
            ("peak_E21_mean", "peak abs E21 (mean)", "{:.3f}"), ("peak_E21_max", "peak abs E21 (max)", "{:.3f}"),
            ("peak_E12_max", "peak abs E12 (max)", "{:.3f}"), ("rise_and_fall", "E21 rise+fall", "{:.2f}"),
            ("final_offdiag_fro_mean", "final offdiag(E) (mean)", "{:.2e}"),
            ("final_loss_mean", "final loss (mean)", "{:.4f}"), ("OPT", "OPT", "{:.4f}"),
            ("final_gap_mean", "loss - OPT (mean)", "{:.2e}"),
            ("final_abs_corr_f1f2_mean", "abs Corr(f1,f2) (mean)", "{:.3f}"),
            ("median_T1", "median T1", "{}"), ("median_T2", "median T2", "{}"),
            ("median_T3", "median T3", "{}"), ("median_T4", "median T4", "{}")]
    lines = ["# Non-contrastive learning: with vs without prediction head (spec 004 demo-A, population GD)",
             "", ", ".join(f"{k}={v}" for k, v in meta.items()), "",
             "| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for k, _, f in cols:
            cell = "-" if r[k] is None else f.format(r[k])
            if k.startswith("median_T") and r[k] is not None:
                cell += f" ({r['runs_reaching_' + k[7:]]} runs)"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Phase boundaries (spec 5.2, PhaseTracker; lead = lucky neuron at t = 0; recorded every "
              f"{meta['record_every']} steps): medians over the runs that reach them (T2 needs the substitution "
              "ratio >= log d, see PhaseTracker)."]
    if len(rows) == 2:  # same initial weights in both variants: paired comparison
        pairs = list(zip(rows[0]["outcomes"], rows[1]["outcomes"]))
        both = sum(a == "DIV" and b == "DIV" for a, b in pairs)
        head_only = sum(a == "DIV" and b != "DIV" for a, b in pairs)
        nohead_only = sum(a != "DIV" and b == "DIV" for a, b in pairs)
        lines += ["", f"Paired by seed (same W0): DIV with and without head {both}, only with head {head_only}, "
                  f"only without head {nohead_only} of {len(pairs)}. Without a head each neuron races alone and "
                  "wins the feature with the larger alpha_l^6 |B_jl(0)|^4 (spec 5.2), so at d = 100 some inits are "
                  "diverse anyway."]
    lines += ["", "Outcomes per seed: " + "; ".join(f"{r['variant']}: {' '.join(r['outcomes'])}" for r in rows)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(ap, "runs/noncontrastive")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--steps", type=int, default=400_000)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--head-lr", type=float, default=0.05)
    ap.add_argument("--record-every", type=int, default=1000)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny tensors: 1 is fastest)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out_dir = output_dir(args.out, args.overwrite)
    t0 = time.time()
    dm = TwoFeaturePatchDataModule(**DEMO_A, batch_size=1)
    opt = dm.constants()["OPT"]
    seeds = list(range(args.seeds))
    w0 = initial_weights(seeds, dm)
    w0 = torch.cat([w0, w0])                        # same inits with and without head
    heads = ["offdiag"] * len(seeds) + ["none"] * len(seeds)
    out = simulate_population(w0, dm.features, dm.alphas, dm.probs, dm.num_patches, dm.num_feature_patches,
                              dm.noise_std, steps=args.steps, lr=args.lr, head_lr=args.head_lr, head=heads,
                              record_every=args.record_every, compile=not args.no_compile)
    t_sim = time.time() - t0
    n = len(seeds)
    rows = [summarise("head (offdiag, identity init)", out, list(range(n)), dm, opt, args.lr / args.head_lr),
            summarise("no head", out, list(range(n, 2 * n)), dm, opt, args.lr / args.head_lr)]
    wall = time.time() - t0
    meta = {"config": "demo-A", **{k: v for k, v in DEMO_A.items()}, "width": 2, "lr": args.lr,
            "head_lr": args.head_lr, "steps": args.steps, "seeds": f"0..{n - 1}", "mode": "population GD",
            "compile": not args.no_compile, "wall_s": round(wall, 1), "sim_s": round(t_sim, 1),
            "threads": args.threads, "record_every": args.record_every}
    md = markdown(rows, meta)
    print(md)
    with open(out_dir / "noncontrastive.json", "w") as fh:
        json.dump({"meta": meta, "rows": rows,
                   "trajectory_E21_seed0": {"steps": out["steps"].tolist(),
                                            "head": out["E"][:, 0, 1, 0].tolist()}}, fh, indent=1)
    with open(out_dir / "noncontrastive.md", "w") as fh:
        fh.write(md)
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
