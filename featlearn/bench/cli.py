"""``featlearn bench op|step``: check every variant against float64, time them interleaved, write the tables.

Usage:
    featlearn bench op                                   # every op, tiny size, on CUDA if there is one
    featlearn bench op --op soft_threshold --size medium --device cuda
    featlearn bench step                                 # every method's training step at its main job's size
    featlearn bench step --method mrp --repeats 50

Writes ``<out>/<op|step>_<size>_<device>.{csv,md,png}`` (default ``benchmarks/results/bench``) and exits 1
when any variant failed its correctness check (failed variants are reported and not timed).
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

from featlearn.bench import harness, ops, steps
from featlearn.cli import _refuse
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
            ("step", steps.METHODS, "--method", steps.SIZES, "one training step of each method vs a plain loop")):
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument(plural, nargs="+", choices=choices, default=list(choices), metavar="NAME",
                       help=f"one or more of {', '.join(choices)} (default: all)")
        p.add_argument("--size", choices=sizes, default="tiny", help=f"one of {', '.join(sizes)} (default: tiny)")
        p.add_argument("--device", choices=("cpu", "cuda"), default=default)
        p.add_argument("--repeats", type=_positive, default=20, help="timed interleaved rounds (default 20)")
        p.add_argument("--warmup", type=_non_negative, default=3,
                       help="untimed rounds first; they also absorb torch.compile and Triton autotuning")
        p.add_argument("--threads", type=_non_negative, default=0, help="torch CPU threads (0: torch's default)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", type=Path, default=Path("benchmarks/results/bench"), help="folder of the tables")
    return top


def run(argv: list[str] | None = None, extra_cases: list | None = None) -> tuple[int, list[harness.Result], list[Path]]:
    """Parse, check, time and write; returns (exit status, results, files written). ``extra_cases`` are
    appended to the command's cases (the tests inject a deliberately wrong variant this way)."""
    args = parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser().error("--device: cuda, but no CUDA device is visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.what == "op":
        cases = ops.cases(args.op, args.size, device)
    else:
        cases = steps.cases(args.method, args.size, device)
    cases += extra_cases or []
    results = harness.run_cases(cases, device, args.repeats, args.warmup, args.seed)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    header = (f"# featlearn bench {args.what}, size {args.size}, {args.device} ({where}), "
              f"{torch.get_num_threads()} threads, torch {torch.__version__}\n\n"
              f"median / IQR / mean of {args.repeats} interleaved rounds after {args.warmup} warm-up; "
              f"x = speed-up (baseline's median / variant's), > 1 is faster; peak = "
              + ("CUDA max_memory_allocated over the call" if device.type == "cuda" else
                 "growth of the peak RSS over one call, in an untimed pass after all timing, with glibc made to "
                 "return freed tensors (n/a for steps, whose calls also build the module and data)"))
    files = harness.write(results, args.out, f"{args.what}_{args.size}_{args.device}", header)
    print(harness.table(results, header))
    print("\nwrote " + ", ".join(str(f) for f in files))
    failed = [f"{r.case} / {r.variant}" for r in results if not r.passed]
    if failed:
        print("FAILED (not timed): " + "; ".join(failed), file=sys.stderr)
    return (1 if failed else 0), results, files


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv)[0])
