"""Experiment E1 of spec 001: contrastive learning with vs without RandomMask, plus the negative control.

Every setting is a config ``configs/contrastive/<setting>.yaml`` (tiny default config: d=32, d1=256,
m=128, K=N=256, eta=2, 1000 steps, tau=log d, lambda=d^-1.75), built through the featlearn CLI
(:func:`featlearn.experiments.common.build`) with only the output location, the number of steps and
the seed overridden. After training, prints and saves a table (``results.json`` / ``results.md``
beside the TensorBoard logs): final sparse-energy fraction (and its peak), singleton neurons, features
covered by singletons, regression probe nMSE on f(x) vs on raw x (fit on the val split, scored on the
test split), classification accuracy likewise, cos(f(x), f(Mz)), cos(f(x), f(xi)), T1, T2 and the
normalized final loss.

Default settings:
* ``random_mask``: RandomMask views, paper bias schedule (Thm 3.4).
* ``no_augmentation``: positive = the sample itself, bias 0 (Thm 3.2).
* ``coordinate_control``: RandomMask with a coordinate-aligned dictionary (spec 2.4, negative control).

Ablations (not in the default table): ``learned_bias`` / ``learned_bias_no_aug`` (bias learned by SGD
with / without augmentation, footnote 4) and ``paper_lambda`` (lambda = d^-1.25 inside the paper's
range, which the spec says stalls stage III at small d).

Usage:
    python -m featlearn.experiments.contrastive [--out DIR] [--steps 1000] [--seed 0] [--threads 1] [--settings a,b]

Runs on CPU in a few minutes (1 torch thread per run; more threads slow down on a busy 2-core box).
"""
from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch

from featlearn.experiments.common import (CONFIGS, add_output_arguments, build, markdown_table, output_dir,
                                         quiet_lightning, write_results)

SETTINGS = sorted(p.stem for p in (CONFIGS / "contrastive").glob("*.yaml"))
DEFAULT_SETTINGS = ("random_mask", "no_augmentation", "coordinate_control")

COLUMNS = [
    ("lambda", "lambda", "{:.1e}"),
    ("sparse_frac", "weights/sparse_frac_mean", "{:.3f}"),
    ("sparse_frac_peak", "weights/sparse_frac_peak", "{:.3f}"),
    ("singletons", "singletons_str", "{}"),
    ("coverage", "features/coverage", "{:.3f}"),
    ("nMSE f(x)", "probe/reg_nmse", "{:.3f}"),
    ("nMSE raw x", "probe/reg_nmse_raw", "{:.3f}"),
    ("acc f(x)", "probe/cls_acc", "{:.3f}"),
    ("acc raw x", "probe/cls_acc_raw", "{:.3f}"),
    ("cos(f(x),f(Mz))", "repr/cos_fx_fMz", "{:.2f}"),
    ("cos(f(x),f(xi))", "repr/cos_fx_fxi", "{:.2f}"),
    ("fire rate", "act/fire_rate_raw", "{:.3f}"),
    ("mean b", "bias/mean", "{:.3f}"),
    ("T1", "stage/T1", "{:.0f}"),
    ("T2", "stage/T2", "{:.0f}"),
    ("loss/uniform", "loss_normalized", "{:.3f}"),
    ("wall s", "wall_s", "{:.0f}"),
]


def run_setting(name: str, out: Path, steps: int = 1000, seed: int = 0) -> dict:
    """Train ``configs/contrastive/<name>.yaml`` (logs in ``out/name``) and return its summary metrics."""
    t0 = time.time()
    cli = build(f"contrastive/{name}.yaml", out, name, "--trainer.max_steps", str(steps),
                "--seed_everything", str(seed), "--data.init_args.seed", str(seed),
                "--model.init_args.seed", str(seed))
    trainer, model, dm = cli.trainer, cli.model, cli.datamodule
    trainer.fit(model, datamodule=dm)
    summary = model.summary()
    # final normalized contrastive loss on a fresh batch (mean over 4 batches)
    with torch.no_grad():
        vals = []
        for k in range(4):
            idx = torch.arange(dm.batch_size, device=model.device) + (10 ** 9 + k * dm.batch_size)
            loss, st = model.contrastive_loss(dm.batch(idx, "train"))
            vals.append(float(loss) / st["uniform"])
    summary["loss_normalized"] = sum(vals) / len(vals)
    summary["wall_s"] = time.time() - t0
    summary["singletons_str"] = f"{int(summary['features/singletons'])}/{int(summary['m'])}"
    summary["raw_nmse_population"] = dm.raw_probe_nmse()
    summary["lambda"] = float(model.lam)
    summary["d/d1"] = dm.d / dm.d1
    summary["config"] = {"d": dm.d, "d1": dm.d1, "m": model.m, "K": dm.batch_size, "N": dm.num_negatives,
                         "eta": model.hp.lr, "num_val": dm.sizes["val"], "num_test": dm.sizes["test"]}
    if trainer.logger is not None:
        trainer.logger.log_metrics({f"final/{k}": v for k, v in summary.items() if isinstance(v, float)},
                                   step=trainer.global_step)
    return summary


def format_table(results: dict[str, dict]) -> str:
    def cell(value, fmt):
        return "-" if isinstance(value, float) and math.isnan(value) else fmt.format(value)

    rows = {name: {col: cell(r.get(key, float("nan")), fmt) for col, key, fmt in COLUMNS}
            for name, r in results.items()}
    return markdown_table(rows, [col for col, _, _ in COLUMNS])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "runs/contrastive")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = leave torch's default)")
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                        help=f"comma-separated subset of {SETTINGS} (configs/contrastive/*.yaml)")
    args = parser.parse_args(argv)
    quiet_lightning()
    names = [s for s in args.settings.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        parser.error(f"--settings: must be among {SETTINGS}, got {unknown}")
    if args.steps < 1:
        parser.error(f"--steps: must be a positive integer, got {args.steps}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out = output_dir(args.out, args.overwrite)
    t0 = time.time()
    results = {name: run_setting(name, out, steps=args.steps, seed=args.seed) for name in names}
    total = time.time() - t0
    any_r = next(iter(results.values()))
    c = any_r["config"]
    sizes = f"K=N={c['K']}" if c["K"] == c["N"] else f"K={c['K']}, N={c['N']}"
    notes = (f"d={c['d']}, d1={c['d1']}, m={c['m']}, {sizes}, eta={c['eta']:g}, tau=log d, "
             f"lambda=d^-1.75 unless the row says otherwise, {args.steps} steps, seed {args.seed} "
             f"(configs/contrastive/<setting>.yaml). Population nMSE of the best linear probe on raw x: "
             f"sigma^2/(p+sigma^2) = {any_r['raw_nmse_population']:.3f}; d/d1 = {any_r['d/d1']:.3f}. "
             f"Probes: fit on {c['num_val']} val samples, scored on {c['num_test']} test samples. "
             f"Total wall time {total:.0f} s.")
    table = format_table(results)
    write_results(out, "results", {"results": results, "total_wall_s": total, "notes": notes},
                  f"# Contrastive learning: RandomMask vs no augmentation\n\n{table}\n\n{notes}")
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
