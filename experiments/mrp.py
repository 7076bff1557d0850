"""The MRP main job (seed 000, spec 3.6): pretrain -> fine-tune vs supervised learning from scratch.

    python -m featlearn.experiments.mrp [--out runs/mrp] [--seed 0]
    python -m featlearn.experiments.mrp --out runs/mrp_seeds --seed 0 1 2 3 4   # mean over seeds

Runs ``configs/mrp/teacher_student.yaml`` (pretraining, labels unused), fine-tunes its encoder with
``configs/mrp/finetune.yaml`` on the labelled downstream set, trains ``configs/mrp/supervised.yaml``
from scratch on the same downstream set with the same seed, tests both on one test set split by view
type, and prints/saves the table (``mrp_table.json`` / ``.md``) beside the TensorBoard logs.
"""
import argparse
import statistics
import time
from pathlib import Path

from featlearn.experiments.common import (add_output_arguments, build, markdown_table, output_dir, quiet_lightning,
                                         scalars, write_results)

COLUMNS = ["features captured", "all captured by step", "classes with both features", "pure / same-class / cross-class kernels",
           "test acc multi-view", "test acc single-view", "test acc all", "steps", "seconds"]


def _encoder_row(metrics: dict, prefix: str) -> dict:
    return {
        "features captured": metrics[f"{prefix}/frac_captured"],
        "all captured by step": int(metrics[f"{prefix}/first_capture/max"]) if metrics[f"{prefix}/frac_captured"] == 1 else "",
        "classes with both features": metrics[f"{prefix}/classes_both"],
        "pure / same-class / cross-class kernels": " / ".join(
            str(int(metrics[f"{prefix}/kernels/{kind}"])) for kind in ("pure", "sameclass", "crossclass")),
    }


def _downstream(config: str, out: Path, name: str, seed: int, *overrides: str) -> dict:
    start = time.time()
    cli = build(config, out, name, "--seed_everything", str(seed), "--data.init_args.seed", str(seed), *overrides)
    cli.trainer.fit(cli.model, cli.datamodule)
    trained = scalars(cli.trainer.callback_metrics)
    tested = scalars(cli.trainer.test(cli.model, cli.datamodule, verbose=False)[0])
    encoder = {k: v for k, v in _encoder_row(trained, "encoder").items() if k != "all captured by step"}
    return {**encoder, "test acc multi-view": tested["test/acc/multi"],
            "test acc single-view": tested["test/acc/single"], "test acc all": tested["test/acc/all"],
            "steps": cli.trainer.global_step, "seconds": round(time.time() - start, 1)}


def run(out: Path, seed: int = 0) -> dict:
    start = time.time()
    pre = build("mrp/teacher_student.yaml", out, "pretrain", "--seed_everything", str(seed),
                "--data.init_args.seed", str(seed))
    pre.trainer.fit(pre.model, pre.datamodule)
    ckpt = Path(pre.trainer.checkpoint_callback.last_model_path).resolve()  # the final state of pretraining
    pretrain = {**_encoder_row(scalars(pre.trainer.callback_metrics), "pretrain"),
                "steps": pre.trainer.global_step, "seconds": round(time.time() - start, 1)}
    rows = {
        "MRP pretraining": pretrain,
        "MRP + fine-tuning": _downstream("mrp/finetune.yaml", out, "finetune", seed,
                                         "--model.init_args.pretrained", str(ckpt)),
        "SL from scratch": _downstream("mrp/supervised.yaml", out, "supervised", seed),
    }
    table = markdown_table(rows, COLUMNS)
    write_results(out, "mrp_table", {"seed": seed, "rows": rows}, table)
    return rows


def run_seeds(out: Path, seeds: list[int]) -> dict:
    """:func:`run` once per seed (in ``out/seed<N>``) and a table of per-seed values and their means."""
    per_seed = {seed: run(out / f"seed{seed}", seed) for seed in seeds}
    numeric = ["features captured", "classes with both features", "test acc multi-view",
               "test acc single-view", "test acc all"]
    rows = {}
    for setting in per_seed[seeds[0]]:
        values = {c: [per_seed[s][setting].get(c) for s in seeds] for c in numeric}
        rows[setting] = {c: (f"{statistics.mean(v):.3f} ({min(v):.2f}-{max(v):.2f})" if None not in v and v[0] != "" else "")
                         for c, v in values.items()}
    table = markdown_table(rows, numeric)
    write_results(out, "mrp_table_seeds", {"seeds": seeds, "per_seed": per_seed}, f"seeds {seeds}: mean (min-max)\n\n{table}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "runs/mrp")
    parser.add_argument("--seed", type=int, nargs="+", default=[0],
                        help="one seed (default 0), or several: then per-seed runs and a table of means")
    args = parser.parse_args()
    quiet_lightning()
    out = output_dir(args.out, args.overwrite)
    if len(args.seed) == 1:
        run(out, args.seed[0])
    else:
        run_seeds(out, args.seed)


if __name__ == "__main__":
    main()
