"""``featlearn gpu compile``: every Triton kernel of ``featlearn.kernels`` built for the H100 (sm_90)
offline, with no GPU, as ``triton.compile`` does on first launch; registers, spills and shared memory
of each build.

How: each op is called, through its Triton path, at its methods' sizes (:mod:`featlearn.gpu.cases`) on ``meta`` tensors
with the interpreter's launch replaced by a recorder, so the launches (kernel, argument types, int values,
constexpr flags) are exactly the ones a training step makes, at no cost. Every launch is then compiled
for ``GPUTarget("cuda", 90, 32)`` with each autotune config the call may pick (the kernel's
``gpu_configs`` that its ``fits`` rule keeps; ``--all-configs`` adds the rest), in worker processes
that run Triton in compiled mode. The kernels' own ``tl.dot``, layouts and int specialisation (a size
divisible by 16 or not compiles differently) are therefore what is checked.

It fails (exit 1) on a compile error, on shared memory over the H100's 227 KB per block, and on a
stack frame (register spills) in a config the autotuner may pick; pruned configs are reported only.

Usage:
    featlearn gpu compile                       # every op, every variant; table on stdout
    featlearn gpu compile --op soft_threshold --out benchmarks/results/gpu --jobs 2

Example:
    >>> problems({"error": "", "shared": 1024, "stack": 16, "config": {"may_pick": True}})
    ['spills (16 B stack)']
"""
from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from featlearn.gpu.cases import cases

SM90_SHARED_LIMIT = 232448  # bytes of shared memory one H100/H200 block may use (227 KB, opt-in)
TARGET = ("cuda", 90, 32)


# ------------------------------------------------------------------------------------------------
# capture (interpreter mode): launches -> compile jobs
# ------------------------------------------------------------------------------------------------
_TORCH_TO_TRITON = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16", "uint8": "u8",
                    "int64": "i64", "int32": "i32", "int8": "i8", "bool": "u1"}


def _arg_type(value, annotation):
    """Triton's signature entry and divisibility for one argument (as its launcher specialises them)."""
    import torch

    if annotation:  # a scalar annotated e.g. tl.float64 keeps its declared type
        return annotation, None
    if isinstance(value, torch.Tensor):
        return "*" + _TORCH_TO_TRITON[str(value.dtype).removeprefix("torch.")], True  # fresh buffers: aligned
    if isinstance(value, bool):
        raise TypeError("a bool kernel argument must be a tl.constexpr")
    if isinstance(value, int):
        if value == 1:
            return "constexpr", None  # Triton specialises 1 to a constant
        return ("i32" if -2**31 <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", None
    raise TypeError(f"unexpected kernel argument {value!r}")


def _constant(value):
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"dtype": str(value)}
    if hasattr(value, "value"):  # tl.constexpr
        value = value.value
    return value


def _launch_job(kernel, args: dict) -> dict:
    """One launch's signature, constants and attributes, and the configs it may pick, as JSON."""
    import inspect

    import triton.language as tl

    fn = kernel.base_fn
    params = inspect.signature(fn).parameters
    config_names = set(kernel.gpu_configs[0].kwargs)
    signature, constants, attrs = {}, {}, []
    for i, (name, param) in enumerate(params.items()):
        ann = param.annotation
        if isinstance(ann, str):  # modules with ``from __future__ import annotations``
            ann = eval(ann, fn.__globals__)  # noqa: S307 -- the kernel's own annotation, e.g. tl.float64
        if ann is tl.constexpr or name in config_names or args.get(name) is None:
            signature[name] = "constexpr"
            if name not in config_names:
                constants[name] = _constant(args.get(name))
            continue
        kind, aligned = _arg_type(args[name], str(ann) if isinstance(ann, tl.dtype) else None)
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = args[name]
        elif aligned:
            attrs.append(i)
    fits = kernel.fits or (lambda config, call: True)
    configs = [{"kwargs": c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages,
                "may_pick": bool(fits(c.kwargs, args))} for c in kernel.gpu_configs]
    return {"module": fn.__module__, "kernel": fn.__name__, "signature": signature, "constants": constants,
            "attrs": attrs, "configs": configs}


def capture(ops=None) -> list[dict]:
    """``[{op, case, module, kernel, signature, constants, attrs, configs}]`` for every launch of every case
    (needs ``TRITON_INTERPRET=1``: the interpreter's launch is what gets replaced)."""
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    assert os.environ.get("TRITON_INTERPRET") == "1", "capture runs with TRITON_INTERPRET=1"
    seen: list[dict] = []
    current = {}
    original = Autotuner.run

    def record(self, *args, **kwargs):
        if not hasattr(self, "gpu_configs"):
            raise RuntimeError(f"{self.base_fn.__name__} is not decorated with featlearn.kernels.backend.autotune")
        call = {**dict(zip(self.arg_names, args)), **kwargs}
        seen.append({**current, **_launch_job(self, call)})

    def skip(self, *args, grid, warmup, **kwargs):  # a device helper's launch would land here: none expected
        raise RuntimeError("an untuned kernel launch; launch kernels through backend.autotune")

    Autotuner.run, saved_skip = record, interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = skip
    try:
        for op, calls in cases().items():
            if ops and op not in ops:
                continue
            for name, call in calls:
                current.update(op=op, case=name)
                call()
    finally:
        Autotuner.run, interpreter.InterpretedFunction.run = original, saved_skip
    return seen


# ------------------------------------------------------------------------------------------------
# compile (compiled mode, worker processes)
# ------------------------------------------------------------------------------------------------
def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _resources(cubin: bytes, name: str) -> dict:
    """REG / STACK / SHARED of the kernel in ``cubin``, read with the ``cuobjdump`` Triton ships."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    for line in text.splitlines():
        if "REG:" in line:
            fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
            return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "local": int(fields["LOCAL"])}
    raise RuntimeError(f"no resource usage for {name} in cuobjdump's output")


def compile_job(job: dict) -> dict:
    """Build one (launch, config) for sm_90; returns registers, stack bytes, shared memory or the error."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
    fn = kernel.fn  # the JITFunction under the autotuner
    constants = {k: getattr(tl, v["dtype"].replace("fp", "float")) if isinstance(v, dict) else v
                 for k, v in job["constants"].items()}
    constants.update(job["config"]["kwargs"])
    attrs = {(i,): [["tt.divisibility", 16]] for i in job["attrs"]}
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(fn, job["signature"], constants, attrs), target=GPUTarget(*TARGET),
                                  options={"num_warps": job["config"]["num_warps"],
                                           "num_stages": job["config"]["num_stages"]})
        row = {**_resources(compiled.asm["cubin"], job["kernel"]), "shared": int(compiled.metadata.shared),
               "error": ""}
    except Exception as e:  # noqa: BLE001 -- every compiler failure is a row of the report
        row = {"regs": -1, "stack": -1, "local": -1, "shared": -1, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {**row, "seconds": round(time.perf_counter() - start, 2)}


def _worker(path: str) -> None:
    """``--worker FILE``: compile the JSON jobs (one per line) of FILE, one JSON result per line on stdout."""
    for line in Path(path).read_text().splitlines():
        job = json.loads(line)
        print(json.dumps({"id": job["id"], **compile_job(job)}), flush=True)


def _run_python(args: list[str], interpret: bool, background: bool = False):
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    cmd = [sys.executable, "-m", "featlearn.gpu.compile", *args]
    if background:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def jobs_from(launches: list[dict], all_configs: bool) -> list[dict]:
    """Unique compile jobs (one per launch specialisation x config) and, per job id, the cases using it."""
    jobs, users = {}, collections.defaultdict(set)
    for launch in launches:
        for config in launch["configs"]:
            if not (config["may_pick"] or all_configs):
                continue
            job = {k: launch[k] for k in ("module", "kernel", "signature", "constants", "attrs")} | {"config": config}
            key = json.dumps(job, sort_keys=True)
            jobs.setdefault(key, job)
            users[key].add((launch["op"], launch["case"]))
    out = []
    for i, (key, job) in enumerate(jobs.items()):
        job["id"] = i
        job["cases"] = sorted(users[key])
        out.append(job)
    return out


def compile_all(jobs: list[dict], workers: int, progress=None) -> list[dict]:
    """Compile ``jobs`` in ``workers`` processes (Triton in compiled mode); results in job order."""
    shares = [jobs[i::workers] for i in range(workers)]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, share in enumerate(s for s in shares if s):
            path = Path(tmp) / f"jobs{i}.jsonl"
            path.write_text("".join(json.dumps(j) + "\n" for j in share))
            procs.append(_run_python(["--worker", str(path)], interpret=False, background=True))
        return _collect(procs, jobs, progress)


def _collect(procs, jobs, progress) -> list[dict]:
    results = {}
    for proc in procs:
        for line in proc.stdout:
            row = json.loads(line)
            results[row["id"]] = row
            if progress:
                progress(len(results), len(jobs))
        if proc.wait() != 0:
            raise RuntimeError("a compile worker failed; run `python -m featlearn.gpu.compile --worker` by hand")
    return [{**job, **results[job["id"]]} for job in jobs]


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def _variant(case: str) -> str:
    return case.split("/", 1)[1]


def problems(row: dict) -> list[str]:
    """Why a compiled row fails the check (empty: it passes)."""
    out = []
    if row["error"]:
        out.append("compile error")
    elif row["shared"] > SM90_SHARED_LIMIT:
        out.append(f"shared {row['shared']} B > {SM90_SHARED_LIMIT}")
    if not row["error"] and row["stack"] > 0 and row["config"]["may_pick"]:
        out.append(f"spills ({row['stack']} B stack)")
    return out


def summary(rows: list[dict]) -> list[dict]:
    """One line per kernel x variant: configs built, worst registers / stack / shared memory, failures."""
    groups = collections.defaultdict(list)
    for row in rows:
        for op, case in row["cases"]:
            groups[(row["kernel"], _variant(case))].append(row)
    lines = []
    for (kernel, variant), group in sorted(groups.items()):
        unique = {r["id"]: r for r in group}.values()
        ok = [r for r in unique if not r["error"]]
        lines.append({"kernel": kernel, "variant": variant, "configs": len(unique),
                      "max_regs": max((r["regs"] for r in ok), default=-1),
                      "max_stack": max((r["stack"] for r in ok if r["config"]["may_pick"]), default=0),
                      "max_shared_kb": round(max((r["shared"] for r in ok), default=0) / 1024, 1),
                      "failures": sum(bool(problems(r)) for r in unique)})
    return lines


def _config_text(config: dict) -> str:
    tiles = "x".join(str(v) for v in config["kwargs"].values())
    return f"{tiles} w{config['num_warps']} s{config['num_stages']}"


def write(rows: list[dict], out: Path, tag: str) -> tuple[Path, Path]:
    """``compile_sm90_<tag>.csv`` (every build) and ``.md`` (the summary and every failure)."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / f"compile_sm90_{tag}.csv", out / f"compile_sm90_{tag}.md"
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kernel", "cases", "config", "may_pick", "regs", "stack_bytes", "shared_bytes", "seconds",
                    "problems", "error"])
        for r in rows:
            w.writerow([r["kernel"], " ".join(c for _, c in r["cases"]), _config_text(r["config"]),
                        r["config"]["may_pick"], r["regs"], r["stack"], r["shared"], r["seconds"],
                        "; ".join(problems(r)), r["error"]])
    lines = [f"# sm_90 offline compile ({tag})", "",
             "| kernel | variant | configs | max regs | max stack B (pickable) | max shared KB | failures |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {s['kernel']} | {s['variant']} | {s['configs']} | {s['max_regs']} | {s['max_stack']} | "
              f"{s['max_shared_kb']} | {s['failures']} |" for s in summary(rows)]
    bad = [r for r in rows if problems(r)]
    if bad:
        lines += ["", "## Failures", ""] + [f"- {r['kernel']} {_config_text(r['config'])} "
                                           f"({', '.join(c for _, c in r['cases'])}): {'; '.join(problems(r))} "
                                           f"{r['error']}" for r in bad]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1])
    if argv[:1] == ["--capture"]:
        print(json.dumps(capture(argv[1:] or None)))
        return
    parser = argparse.ArgumentParser(prog="featlearn gpu compile", description=__doc__.splitlines()[0])
    parser.add_argument("--op", nargs="+", default=None, metavar="NAME", help="only these ops (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="write compile_sm90_<triton>.csv/.md here")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile workers")
    parser.add_argument("--all-configs", action="store_true", help="also build the configs the fits rules prune")
    args = parser.parse_args(argv)
    if args.op:
        unknown = sorted(set(args.op) - set(cases()))
        if unknown:
            parser.error(f"--op: unknown {unknown}; one of {sorted(cases())}")
    captured = _run_python(["--capture", *(args.op or [])], interpret=True)
    if captured.returncode != 0:
        sys.exit(f"featlearn gpu compile: capturing the launches failed:\n{captured.stderr[-3000:]}")
    jobs = jobs_from(json.loads(captured.stdout.splitlines()[-1]), args.all_configs)
    import triton

    start = time.perf_counter()
    rows = compile_all(jobs, max(1, args.jobs), progress=lambda done, total: done % 50 == 0 and print(
        f"{done}/{total} builds, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True))
    tag = f"triton{triton.__version__}"
    lines = summary(rows)
    width = max(len(s["kernel"]) for s in lines)
    print(f"sm_90 builds with triton {triton.__version__}: {len(rows)} in {time.perf_counter() - start:.0f} s")
    print(f"{'kernel':{width}s}  {'variant':34s} configs regs stack shared_KB failures")
    for s in lines:
        print(f"{s['kernel']:{width}s}  {s['variant']:34s} {s['configs']:7d} {s['max_regs']:4d} {s['max_stack']:5d} "
              f"{s['max_shared_kb']:9.1f} {s['failures']:8d}")
    if args.out:
        print("wrote", *write(rows, args.out, tag))
    bad = [r for r in rows if problems(r)]
    for r in bad:
        print(f"FAIL {r['kernel']} {_config_text(r['config'])}: {'; '.join(problems(r))} {r['error']}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
