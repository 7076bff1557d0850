"""``featlearn bench op|step|data``: check every variant against float64, time them interleaved, write the tables.

Usage:
    featlearn bench op                                   # every op, tiny size, on CUDA if there is one
    featlearn bench op --op soft_threshold --size medium --device cuda
    featlearn bench step                                 # every method's training step at its main job's size
    featlearn bench step --method mrp --repeats 50
    featlearn bench step --fit                           # also `lightning fit` of each case, timed from its logs
    featlearn bench data --seeds 3 8 32                  # a seed stack's batches: one draw vs in turn
    featlearn bench op --size gpu --device cuda --ceilings OUT/ceilings.csv     # featlearn gpu check part 2

Writes ``<out>/<op|step>_<size>_<device>.{csv,md,png}`` (default ``benchmarks/results/bench``; the csv and md
after every case, so a run cut short keeps its rows) and exits 1 when any variant failed its correctness
check (failed variants are reported and not timed). ``--size gpu`` is refused off CUDA; ``--ceilings``
(a ``ceilings.csv`` of ``featlearn gpu check``) adds each variant's rates as shares of the measured ceilings.
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

from featlearn.bench import data, harness, ops, steps
from featlearn.cli import _refuse
from featlearn.gpu import ceilings as ceiling_file
from featlearn.validation import default_device


class _Parser(argparse.ArgumentParser):
    """One-line refusals naming the option, as the rest of the ``featlearn`` command."""

    def error(self, message: str):
        _refuse(message)


def _positive(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    value = int(text) if text.lstrip("-").isdigit() else None
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    default = default_device()
    top = _Parser(prog="featlearn bench", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="what", required=True, parser_class=_Parser)
    for name, choices, plural, sizes, help_ in (
            ("op", ops.OPS, "--op", ops.SIZES, "fused ops vs eager vs torch.compile"),
            ("step", steps.METHODS, "--method", steps.SIZES, "one training step of each method vs a plain loop"),
            ("data", data.METHODS, "--method", data.SIZES,
             "a seed stack's online batch: every seed's drawn in one call vs in turn")):
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument(plural, nargs="+", choices=choices, default=None, metavar="NAME",
                       help=f"one or more of {', '.join(choices)} (default: all; at --size gpu, all that have it)")
        p.add_argument("--size", choices=sizes, default="tiny", help=f"one of {', '.join(sizes)} (default: tiny)")
        p.add_argument("--device", choices=("cpu", "cuda"), default=default)
        p.add_argument("--repeats", type=_positive, default=20, help="timed interleaved rounds (default 20)")
        p.add_argument("--warmup", type=_non_negative, default=3,
                       help="untimed rounds first; they also absorb torch.compile and Triton autotuning")
        p.add_argument("--threads", type=_non_negative, default=0, help="torch CPU threads (0: torch's default)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", type=Path, default=Path("benchmarks/results/bench"), help="folder of the tables")
        p.add_argument("--no-compile", action="store_true",
                       help="leave out the torch.compile variants (each compile takes ~10-40 s)")
        if name == "step":
            p.add_argument("--seeds", nargs="+", type=_positive, default=[], metavar="S",
                           help="also time S seeds in one run (lightning fit --seeds) for each S, per seed-step")
            p.add_argument("--fit", action="store_true",
                           help="also time `lightning fit` of each case in its own process, from its logs "
                                "(featlearn.bench.user_fit; CPU sizes)")
        if name == "data":
            p.add_argument("--seeds", nargs="+", type=_positive, default=list(data.SEEDS), metavar="S",
                           help=f"seeds in the stack, one case each (default: {' '.join(map(str, data.SEEDS))})")
        p.add_argument("--ceilings", type=Path, default=None,
                       help="ceilings.csv of `featlearn gpu check`: rates as shares of the measured ceilings")
    plot = sub.add_parser("plot", help="the PNG of tables written elsewhere (a GPU's $OUT)",
                          description="the speed-up PNG beside each CSV of `featlearn bench op|step`")
    plot.add_argument("tables", nargs="+", type=Path, metavar="CSV")
    plot.add_argument("--title", default=None, help="figure title (default: the file name)")
    return top


def run(argv: list[str] | None = None, extra_cases: list | None = None) -> tuple[int, list[harness.Result], list[Path]]:
    """Parse, check, time and write; returns (exit status, results, files written). ``extra_cases`` are
    appended to the command's cases (the tests inject a deliberately wrong variant this way)."""
    args = parser().parse_args(argv)
    if args.what == "plot":
        missing = [str(t) for t in args.tables if not t.is_file()]
        if missing:
            parser().error(f"CSV: no such file {missing[0]}")
        files = [harness.plot_table(t, args.title) for t in args.tables]
        print("wrote " + ", ".join(str(f) for f in files))
        return 0, [], files
    if args.size == "gpu" and args.device != "cuda":
        parser().error(f"--size: gpu needs --device cuda (got --device {args.device}); the CPU sizes are smoke and tiny")
    if getattr(args, "fit", False) and args.device != "cpu":
        parser().error(f"--fit: times `lightning fit` on the CPU (its sizes are the CPU ones), got --device {args.device}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser().error("--device: cuda, but no CUDA device is visible")
    names = args.op if args.what == "op" else args.method
    if args.what == "step" and args.size == "gpu":
        missing = [m for m in names or () if m not in steps.GPU_METHODS]
        if missing:
            parser().error(f"--method: {missing[0]} has no --size gpu (those that do: {', '.join(steps.GPU_METHODS)})")
        names = names or list(steps.GPU_METHODS)
    names = names or list({"op": ops.OPS, "step": steps.METHODS, "data": data.METHODS}[args.what])
    if args.ceilings is not None and not args.ceilings.is_file():
        parser().error(f"--ceilings: no such file {args.ceilings}")
    ceilings = ceiling_file.read(args.ceilings)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cases = {"op": lambda: ops.cases(names, args.size, device),
             "data": lambda: data.cases(names, args.size, device, tuple(args.seeds)),
             "step": lambda: steps.cases(names, args.size, device, tuple(args.seeds), args.fit)}[args.what]()
    cases += extra_cases or []
    if args.no_compile:
        for case in cases:
            case.variants = [v for v in case.variants if harness.COMPILED not in v.name]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    header = (f"# featlearn bench {args.what}, size {args.size}, {args.device} ({where}), "
              f"{torch.get_num_threads()} threads, torch {torch.__version__}\n\n"
              f"median / IQR / mean of {args.repeats} interleaved rounds after {args.warmup} warm-up; "
              f"x = speed-up (baseline's median / variant's), > 1 is faster; peak = "
              + ("CUDA max_memory_allocated over the call" if device.type == "cuda" else
                 "growth of the peak RSS over one call, in an untimed pass after all timing, with glibc made to "
                 "return freed tensors (n/a for steps, whose calls also build the module and data)")
              + "; TFLOP/s and GB/s from each case's model FLOPs and fewest bytes"
              + (f", as % of the measured ceilings ({ceiling_file.device_of(args.ceilings)}: "
                 + ", ".join(f"{k} {v:.4g}" for k, v in ceilings.items()) + ")" if ceilings else ""))
    stem = f"{args.what}_{args.size}_{args.device}"
    results = harness.run_cases(cases, device, args.repeats, args.warmup, args.seed,
                                after_case=lambda done: harness.write(done, args.out, stem, header, ceilings, False))
    files = harness.write(results, args.out, stem, header, ceilings)
    print(harness.table(results, header, ceilings))
    print("\nwrote " + ", ".join(str(f) for f in files))
    failed = [f"{r.case} / {r.variant}" for r in results if not r.passed]
    if failed:
        print("FAILED (not timed): " + "; ".join(failed), file=sys.stderr)
    return (1 if failed else 0), results, files


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv)[0])
