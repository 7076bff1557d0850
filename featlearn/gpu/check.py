"""``featlearn gpu check OUT --part 1|2`` (``--dry``): the one prepared script for a lent H100/H200.

The lent machine comes rarely, with 15 minutes of device time in all, so the check is two commands of at
most 5 minutes each (docs/gpu.md: the commands, the stack, each piece's time). A part runs its pieces as
subprocesses, each under its own timeout inside the part's budget (:data:`BUDGET_S`), so a hang costs one
slot, not the window. Output goes to ``OUT/log.txt``, results to their own files (at most 7 files:
env.txt, ceilings.csv, log.txt, bench_op.csv, bench_step.csv, large_k.csv, summary.md), and the part ends
by printing, and appending to summary.md, a row per piece: status (ok, skipped, failed, timeout), seconds,
headline. Part 1: env, the measured ceilings (:mod:`featlearn.gpu.ceilings`), ``pytest -m gpu``, a
20-step ``lightning fit``, ``compute-sanitizer --tool racecheck`` on :func:`racecheck_target`. Part 2
(``FEATLEARN_TILES=pinned``): ``featlearn bench op|step --size gpu`` against the ceilings (part 1's, from
:data:`CACHE`, when the device is the same: part 2's OUT is a new folder), two large-k MRP points.

``--dry`` runs both parts on the CPU (``TRITON_INTERPRET=1``, no CUDA visible, tiny sizes): what needs CUDA
is replaced by a CPU stand-in or skipped with the reason; orchestration, timeouts, files and summary are the
real ones (tests/test_gpu_check.py).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("FEATLEARN_GPU_CACHE", "/tmp/featlearn-gpu"))
BUDGET_S = {"1": 300, "2": 275, "all": 575}
"""Seconds a part may take: a device command may run 5 minutes, less the install (~5 s) and the summary."""
DRY_BUDGET_S = 170
LOG_TAIL = 300_000
"""Bytes of a piece's output kept in log.txt (its tail: a long racecheck report must not crowd out the rest)."""


@dataclass
class Run:
    out: Path
    dry: bool
    scratch: Path
    tables: list[str] = field(default_factory=list)
    """Markdown tables appended to summary.md after the rows (the bench tables)."""


@dataclass
class Piece:
    name: str
    part: str
    timeout: int
    dry_timeout: int
    command: Callable[[Run], list[str] | str]
    """argv, or the reason the piece is skipped."""
    headline: Callable[[Run, str], str] = lambda run, text: _marked(text)
    after: Callable[[Run], None] | None = None
    """Collects the piece's results into OUT; runs after a timeout too (the bench writes as it goes)."""
    env: dict = field(default_factory=dict)
    skip_codes: dict = field(default_factory=dict)
    """Exit codes that mean skipped, with the reason (pytest's 5: no tests collected)."""


def _marked(text: str) -> str:
    """The last ``HEADLINE: ...`` line a piece printed."""
    lines = [line[10:] for line in text.splitlines() if line.startswith("HEADLINE: ")]
    return lines[-1] if lines else ""


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


# ------------------------------------------------------------------------------------------------
# the racecheck target (env and ceilings: featlearn.gpu.ceilings.env_piece / ceilings_piece)
# ------------------------------------------------------------------------------------------------
def racecheck_target() -> None:
    """A small masked-attention forward and backward through the Triton kernels (both precisions, with key
    groups), sized so that queries, keys and d each span several tiles with a partial last one. Runs
    under compute-sanitizer on the GPU; under the interpreter in the dry mode."""
    os.environ.setdefault("FEATLEARN_TILES", "pinned")
    import torch
    import triton

    ma = importlib.import_module("featlearn.kernels.masked_attention")  # the package exports a function of that name

    for obj in vars(ma).values():  # one config per kernel: autotuning under racecheck would run every tile many times
        if isinstance(obj, triton.runtime.Autotuner) and not hasattr(obj, "prune_for_call"):
            obj.configs = obj.configs[:1]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    # the GPU tiles are 64-128 wide: 160 keys, 96 queries and d = 72 each end in a partial tile; the
    # interpreter's tiles are 16 wide and it runs every program in Python, so the dry mode uses less
    B, P, Pq, d, G = (2, 160, 96, 72, 3) if dev == "cuda" else (1, 40, 24, 20, 3)
    rows = torch.randn(P, d, generator=g, device=dev).mul_(d ** -0.5).requires_grad_(True)
    keys, values = (torch.randn(B, P, d, generator=g, device=dev) for _ in range(2))
    idx = torch.rand(B, P, generator=g, device=dev).argsort(1)[:, :Pq]
    groups = torch.randint(0, G, (B, P), generator=g, device=dev)
    for precision in ("ieee", "tf32"):
        out, _ = ma.masked_attention(rows, keys, values, idx, key_groups=groups, n_groups=G, backend="triton",
                                              input_precision=precision)
        out.square().sum().backward()
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"HEADLINE: masked_attention fwd+bwd ran on {dev} (B={B} P={P} Pq={Pq} d={d}, {G} groups, ieee and tf32)")


# ------------------------------------------------------------------------------------------------
# the pieces
# ------------------------------------------------------------------------------------------------
def _pytest(run: Run) -> list[str] | str:
    if run.dry:
        if not (ROOT / "tests" / "gpu").is_dir():
            return "tests/gpu not present"
        return _py("-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/gpu")
    per_test = ["--timeout", "120"] if importlib.util.find_spec("pytest_timeout") else []
    # tests/gpu only (collecting the whole suite costs ~6 s); the slowest tests listed in log.txt
    return _py("-m", "pytest", "-m", "gpu", "-k", "not large", "-p", "no:cacheprovider", "-q", "-rf", "--durations", "12",
               *per_test, "tests/gpu")


def _pytest_headline(run: Run, text: str) -> str:
    found = [line.strip("= ") for line in text.splitlines()
             if re.search(r"\d+ (passed|failed|errors?|skipped|deselected|tests? collected)|no tests ran", line)]
    return ("collect only (no CUDA): " if run.dry else "") + (found[-1] if found else "")


def _fit(run: Run) -> list[str]:
    steps, accelerator = ("3", "cpu") if run.dry else ("20", "gpu")
    logs = str(run.scratch / "fit")
    return _py("-m", "featlearn.cli", "fit", "--config", "configs/mrp/teacher_student.yaml", "--trainer.max_steps",
               steps, "--trainer.accelerator", accelerator, "--trainer.devices", "1", "--trainer.default_root_dir",
               logs, "--trainer.logger.init_args.save_dir", logs, "--trainer.enable_progress_bar", "false")


def _fit_headline(run: Run, text: str) -> str:
    ckpts = sorted((run.scratch / "fit").rglob("last.ckpt"))  # FinalCheckpoint writes it after the last step
    return f"{'CPU stand-in: 3' if run.dry else '20'} steps of configs/mrp/teacher_student.yaml, last.ckpt written" \
        if ckpts else ""


def _sanitizer() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (str(p) for p in Path("/usr/local").glob("cuda*/bin/compute-sanitizer") if p.is_file()), None)


def _racecheck(run: Run) -> list[str] | str:
    target = _py("-m", "featlearn.gpu.check", "--racecheck-target")
    if run.dry:
        return target
    tool = _sanitizer()
    if tool is None:
        return "no compute-sanitizer on PATH or under /usr/local/cuda*/bin"
    return [tool, "--tool", "racecheck", "--print-limit", "50", "--error-exitcode", "3", *target]


def _racecheck_headline(run: Run, text: str) -> str:
    if run.dry:
        return "CPU stand-in: the target under the Triton interpreter, no sanitizer; " + _marked(text)
    found = [line.replace("=========", "").strip() for line in text.splitlines() if "SUMMARY" in line]
    return found[-1] if found else _marked(text)


OP_ORDER = ("patch_activation_sum", "masked_attention", "soft_threshold", "smoothed_clamp", "infonce_stopgrad",
            "bn_cosine_loss")
"""The op bench's order: the ops the methods spend their steps in first, should the time run out."""


def _bench(what: str) -> Callable[[Run], list[str]]:
    def command(run: Run) -> list[str]:
        names = (["--op", *(("patch_activation_sum",) if run.dry else OP_ORDER)] if what == "op" else
                 ["--method", *(("mrp",) if run.dry else ("mrp", "contrastive"))])
        size = ["--size", "smoke", "--device", "cpu", "--repeats", "1", "--warmup", "1", "--no-compile"] if run.dry else \
            ["--size", "gpu", "--device", "cuda", "--repeats", "3" if what == "op" else "5", "--warmup", "1"]
        ceilings = run.out / "ceilings.csv"
        return _py("-m", "featlearn.bench", what, *size, *names, "--out", str(run.scratch / "bench"),
                   *(["--ceilings", str(ceilings)] if ceilings.is_file() else []))
    return command


def _bench_files(run: Run, what: str) -> tuple[Path, Path]:
    stem = f"{what}_{'smoke_cpu' if run.dry else 'gpu_cuda'}"
    return run.scratch / "bench" / f"{stem}.csv", run.scratch / "bench" / f"{stem}.md"


def _bench_after(what: str) -> Callable[[Run], None]:
    def after(run: Run) -> None:
        table, md = _bench_files(run, what)
        if table.is_file():
            shutil.copy2(table, run.out / f"bench_{what}.csv")
            run.tables.append(md.read_text())
    return after


def _bench_headline(what: str) -> Callable[[Run, str], str]:
    def headline(run: Run, text: str) -> str:
        table = run.out / f"bench_{what}.csv"
        if not table.is_file():
            return "no table written"
        rows = list(csv.DictReader(table.open()))
        ok = sum(r["passed"] == "True" for r in rows)
        first = {r["variant"]: r for r in rows if r["case"] == rows[0]["case"] and r["shape"] == rows[0]["shape"]}
        best = next((first[v] for v in ("featlearn triton", "featlearn", "featlearn torch") if v in first), None)
        rate = (f", {float(best['tflops']):.3g} TFLOP/s = {100 * float(best['frac_gemm_ceiling']):.0f}% of its GEMM "
                f"ceiling" if best and best["tflops"] not in ("", "nan") else "")
        what_ = (f"; {rows[0]['case']}: {best['variant']} {float(best['median_ms']):.3g} ms "
                 f"({float(best['speedup_vs_eager']):.2f}x eager{rate})") if best else ""
        return f"{ok}/{len(rows)} variants passed{what_}"
    return headline


def _large_k(run: Run) -> list[str]:
    import yaml

    sweep = yaml.safe_load((ROOT / "configs" / "large_k" / "mrp_k.yaml").read_text())
    sweep.update(sweep={"data.init_args.k": [4, 8] if run.dry else [256, 1024]}, steps=5 if run.dry else 8,
                 timed_after=2 if run.dry else 3, seeds=[0])
    if run.dry:  # a CPU-sized batch; the rest of the file as on the GPU
        sweep["overrides"].update({"data.init_args.batch_size": 16, "data.init_args.num_val": 16,
                                   "data.init_args.num_test": 16})
    path = run.scratch / "large_k.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return _py("-m", "featlearn.experiments.sweep", "--config", str(path), "--out", str(run.scratch / "large_k"),
               "--overwrite")


def _large_k_after(run: Run) -> None:
    """``large_k.csv``: ms per step, and the rate of the step's two GEMMs (4 B P d R, R = k m) against SGEMM."""
    from featlearn.gpu import ceilings

    state = run.scratch / "large_k" / "sweep.json"
    if not state.is_file():
        return
    sgemm = ceilings.read(run.out / "ceilings.csv" if (run.out / "ceilings.csv").is_file() else None).get("sgemm")
    with (run.out / "large_k.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["point", "k", "m", "d", "P", "batch", "steps", "timed_steps", "ms_per_step", "tflop_per_step",
                         "tflops", "frac_sgemm", "peak_mib", "wall_s", "device"])
        for r in json.loads(state.read_text())["rows"]:
            s = r["settings"]
            k, m, d, P, B = (s.get(f"{g}.init_args.{n}") for g, n in (("data", "k"), ("model", "m"), ("data", "d"),
                                                                        ("data", "P"), ("data", "batch_size")))
            flop = 4 * B * P * d * k * m
            ms = r["time_per_step_ms"]
            tflops = flop / ms / 1e9 if ms else float("nan")
            writer.writerow([r["point"], k, m, d, P, B, r["steps"], r["timed_steps"], ms, f"{flop / 1e12:.4g}",
                             f"{tflops:.4g}", f"{tflops / sgemm:.3f}" if sgemm else "", r["peak_mib"], r["wall_s"],
                             r["device"]])


def _large_k_headline(run: Run, text: str) -> str:
    table = run.out / "large_k.csv"
    rows = list(csv.DictReader(table.open())) if table.is_file() else []
    return "; ".join(f"{r['point']}: {r['ms_per_step']} ms/step ({r['tflops']} TFLOP/s)" for r in rows) or "no rows"


def _own(name: str, *extra: str) -> Callable[[Run], list[str]]:
    """A piece this module runs in a process of its own (``--piece``)."""
    return lambda run: _py("-m", "featlearn.gpu.check", "--piece", name, str(run.out), *extra, *["--dry"][:run.dry])


PINNED = {"FEATLEARN_TILES": "pinned"}
PIECES = [
    Piece("env", "1", 20, 60, _own("env")),
    Piece("ceilings", "1", 40, 60, _own("ceilings")),
    Piece("lightning fit", "1", 40, 60, _fit, _fit_headline, env=PINNED),
    Piece("racecheck", "1", 75, 60, _racecheck, _racecheck_headline, env=PINNED),
    # last: it takes what is left of the part's budget (the GPU tests' own estimate is 4-7 minutes for all
    # of tests/gpu; the large sizes are left out here, and the int32 cases run last within the folder)
    # 215 s: 146 s on the H200 (2026-11-28) before each compiled loss's step (12 aot_eager traces) was added
    Piece("pytest -m gpu", "1", 215, 60, _pytest, _pytest_headline, skip_codes={5: "no gpu tests collected"}),
    Piece("ceilings (part 2)", "2", 30, 30, _own("ceilings", "--reuse")),
    Piece("bench op", "2", 140, 90, _bench("op"), _bench_headline("op"), _bench_after("op"), env=PINNED),
    Piece("bench step", "2", 60, 90, _bench("step"), _bench_headline("step"), _bench_after("step"), env=PINNED),
    Piece("large-k MRP", "2", 110, 90, _large_k, _large_k_headline, _large_k_after, env=PINNED),
]
"""Seconds on the GPU (timeout) and in the dry mode (dry_timeout); docs/gpu.md gives the estimates."""


# ------------------------------------------------------------------------------------------------
# orchestration
# ------------------------------------------------------------------------------------------------
def _environment(run: Run, piece: Piece) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg",
           "PYTHONSAFEPATH": "1",  # the repository root must not shadow the installed package (see wheels.py)
           "TRITON_INTERPRET": "1" if run.dry else "0", **piece.env}
    if run.dry:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry mode is the CPU path even on a GPU machine
    return env


def run_piece(run: Run, piece: Piece, deadline: float) -> tuple[str, float, str]:
    """(status, seconds, headline) of one piece, its output appended to log.txt."""
    start = time.monotonic()
    try:
        command = piece.command(run)
    except Exception as err:  # noqa: BLE001 - a piece that cannot even be set up is reported, not fatal
        return "failed", 0.0, f"{type(err).__name__}: {err}"
    if isinstance(command, str):
        return "skipped", 0.0, command
    limit = min(piece.dry_timeout if run.dry else piece.timeout, deadline - start)
    if limit < 5:
        return "skipped", 0.0, "the part's time budget is spent"
    print(f"[{time.strftime('%H:%M:%S')}] {piece.name}: up to {limit:.0f} s", flush=True)
    log = run.scratch / f"{re.sub(r'[^a-z0-9]+', '_', piece.name)}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(command, cwd=ROOT, env=_environment(run, piece), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: a timeout kills its children too
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
    seconds = time.monotonic() - start
    text = log.read_bytes()[-LOG_TAIL:].decode(errors="replace")
    notes = []
    if piece.after is not None:
        try:
            piece.after(run)
        except Exception as err:  # noqa: BLE001
            notes.append(f"collecting results: {type(err).__name__}: {err}")
    status = "timeout" if code is None else "ok" if code == 0 else "skipped" if code in piece.skip_codes else "failed"
    try:
        headline = piece.skip_codes.get(code) or piece.headline(run, text)
    except Exception as err:  # noqa: BLE001
        headline = f"(no headline: {type(err).__name__}: {err})"
    if status == "timeout":
        headline = f"killed after {limit:.0f} s; " + headline
    elif status == "failed":
        headline = f"exit {code}; " + "; ".join(filter(None, [headline, _last_lines(text, 1)]))
    with (run.out / "log.txt").open("a") as fh:
        fh.write(f"\n===== {piece.name} (part {piece.part}): {status} in {seconds:.0f} s =====\n$ "
                 + " ".join(command) + "\n" + text + "\n" + "".join(f"{n}\n" for n in notes))
    return status, seconds, "; ".join([headline, *notes])


def _last_lines(text: str, n: int = 2) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])[:300]


def summary_table(rows: list[tuple[str, str, float, str]]) -> str:
    lines = ["| piece | status | seconds | headline |", "|---|---|---:|---|"]
    lines += [f"| {name} | {status} | {seconds:.0f} | {headline.replace('|', '/')} |"
              for name, status, seconds, headline in rows]
    return "\n".join(lines)


def check(out: Path, part: str, dry: bool) -> int:
    """Run the pieces of ``part`` into ``out``; 0 when none failed or timed out."""
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out.resolve(), dry, CACHE / ("dry" if dry else "run") / f"part{part}-{os.getpid()}")
    shutil.rmtree(run.scratch, ignore_errors=True)
    run.scratch.mkdir(parents=True)
    start = time.monotonic()
    deadline = start + (DRY_BUDGET_S if dry else BUDGET_S[part])
    rows = []
    for piece in PIECES:
        if part in ("all", piece.part):
            rows.append((piece.name, *run_piece(run, piece, deadline)))
            print(f"  -> {rows[-1][1]} in {rows[-1][2]:.0f} s: {rows[-1][3]}", flush=True)
    title = (f"## featlearn gpu check, part {part}{' (dry: CPU stand-ins)' if dry else ''}: "
             f"{datetime.datetime.now().isoformat(timespec='seconds')}, {socket.gethostname()}, "
             f"{time.monotonic() - start:.0f} s")
    table = summary_table(rows)
    with (out / "summary.md").open("a") as fh:
        fh.write(f"{title}\n\n{table}\n\n" + "".join(f"{t.strip()}\n\n" for t in run.tables))
    print(f"\n{title}\n\n{table}")
    shutil.rmtree(run.scratch, ignore_errors=True)
    return 1 if any(status in ("failed", "timeout") for _, status, _, _ in rows) else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="featlearn gpu check", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", help="folder of the results (the device's $OUT)")
    parser.add_argument("--part", choices=("1", "2", "all"), default="all",
                        help="1 or 2: one device command of at most 5 minutes each; all: both (the dry mode)")
    parser.add_argument("--dry", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny sizes, CUDA stand-ins")
    parser.add_argument("--racecheck-target", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--piece", choices=("env", "ceilings"), help=argparse.SUPPRESS)
    parser.add_argument("--reuse", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.racecheck_target:
        racecheck_target()
        return
    if args.out is None:
        parser.error("OUT: the folder of the results is required")
    if args.piece is not None:
        from featlearn.gpu import ceilings

        if args.piece == "env":
            ceilings.env_piece(args.out, args.dry)
        else:
            ceilings.ceilings_piece(args.out, args.dry, args.reuse, CACHE)
    else:
        sys.exit(check(args.out, args.part, args.dry))


if __name__ == "__main__":
    main()
