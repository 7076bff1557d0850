"""What the device is (``env.txt``) and what it can do (``ceilings.csv``), and achieved rates as shares of it.

A roofline drawn from a data sheet flatters or punishes a kernel by whatever the sheet gets wrong about
this card, clock and driver, so ``featlearn gpu check`` measures the two ceilings the fused ops are held
against on the machine itself (part 1), writes them to ``ceilings.csv`` and ``featlearn bench op|step
--ceilings FILE`` reports each variant's TFLOP/s and GB/s as a fraction of them:

* ``copy``: one large device-to-device copy, GB/s counting the bytes read and the bytes written (an
  elementwise op that reads x and writes y moves the same bytes, so this is its ceiling);
* ``sgemm`` (float32, TF32 off: what the methods run), ``tf32`` and ``dgemm``: cuBLAS at n = 8192, TFLOP/s
  at 2 n^3 FLOPs, random data.

Each is the median of CUDA-event timings after warm-up. On a CPU (the dry mode) the same code runs at a
small size as a stand-in, and the TF32 row is empty (there is no TF32 on a CPU). :func:`env_piece` and
:func:`ceilings_piece` are the check's first pieces (each runs in a process of its own).

Example:
    >>> achieved(2e12, 1e9, 0.01, "ieee", {"sgemm": 50.0, "copy": 2000.0})
    (200.0, 4.0, 100.0, 0.05)
"""
from __future__ import annotations

import csv
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

FIELDS = ("name", "value", "unit", "device", "detail")
UNITS = {"copy": "GB/s", "sgemm": "TFLOP/s", "tf32": "TFLOP/s", "dgemm": "TFLOP/s"}
CEILING_OF = {"ieee": "sgemm", "tf32": "tf32", "fp64": "dgemm"}
"""Which GEMM ceiling a variant is held against, by the precision of its dots."""


def _median_seconds(fn, device, warmup: int, repeats: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(1e-3 * start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(device, n: int = 8192, copy_bytes: int = 2 << 30, warmup: int = 3, repeats: int = 10) -> list[dict]:
    """The ceiling rows of ``device`` (a ``torch.device``)."""
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    s = _median_seconds(lambda: dst.copy_(src), device, warmup, repeats)
    rows.append(dict(name="copy", value=2 * src.nbytes / s / 1e9, unit="GB/s", device=name,
                     detail=f"{src.nbytes / 2**20:.0f} MiB copied, read + write counted, median of {repeats}"))
    del src, dst
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        for key, dtype, tf32 in (("sgemm", torch.float32, False), ("tf32", torch.float32, True),
                                 ("dgemm", torch.float64, False)):
            if tf32 and device.type != "cuda":
                rows.append(dict(name=key, value="", unit=UNITS[key], device=name, detail="no TF32 on a CPU"))
                continue
            matmul.allow_tf32 = tf32
            a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
            out = torch.empty(n, n, dtype=dtype, device=device)
            s = _median_seconds(lambda: torch.mm(a, b, out=out), device, warmup, repeats)
            rows.append(dict(name=key, value=2 * n ** 3 / s / 1e12, unit=UNITS[key], device=name,
                             detail=f"torch.mm {n}^3 {str(dtype).removeprefix('torch.')}"
                                    f"{', TF32' if tf32 else ''}, median of {repeats}"))
            del a, b, out
    finally:
        matmul.allow_tf32 = before
    return rows


def write(rows: list[dict], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, FIELDS)
        writer.writeheader()
        for row in rows:
            value = row["value"]
            writer.writerow({**row, "value": f"{value:.4g}" if isinstance(value, float) else value})
    return path


def read(path: Path | None) -> dict[str, float]:
    """``{name: value}`` of a ceilings file (empty values left out); ``{}`` for ``None``."""
    if path is None:
        return {}
    with Path(path).open() as fh:
        return {r["name"]: float(r["value"]) for r in csv.DictReader(fh) if r.get("value")}


def device_of(path: Path) -> str:
    """The device a ceilings file was measured on ('' if unreadable)."""
    try:
        with Path(path).open() as fh:
            return next(csv.DictReader(fh), {}).get("device", "")
    except OSError:
        return ""


def achieved(flops: float | None, nbytes: float | None, seconds: float, precision: str,
             ceilings: dict[str, float]) -> tuple[float, float, float, float]:
    """(TFLOP/s, fraction of the GEMM ceiling of ``precision``, GB/s, fraction of the copy ceiling); NaN
    where a count or a ceiling is missing."""
    nan = float("nan")
    if not seconds or seconds != seconds:
        return nan, nan, nan, nan
    tflops = flops / seconds / 1e12 if flops else nan
    gbs = nbytes / seconds / 1e9 if nbytes else nan
    gemm = ceilings.get(CEILING_OF.get(precision, ""), nan)
    copy = ceilings.get("copy", nan)
    return tflops, tflops / gemm, gbs, gbs / copy


def env_piece(out: Path, dry: bool) -> None:
    """Versions and device properties into ``env.txt``."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    lines = [f"python: {sys.version.split()[0]} ({sys.executable})", f"host: {socket.gethostname()}",
             f"torch.version.cuda: {torch.version.cuda}"]
    for dist in ("torch", "triton", "lightning", "torchmetrics", "jsonargparse", "numpy", "matplotlib", "tensorboard",
                 "pytest"):
        try:
            lines.append(f"{dist}: {version(dist)}")
        except PackageNotFoundError:
            lines.append(f"{dist}: not installed")
    lines += [f"env {k}: {os.environ.get(k, '')}" for k in ("TRITON_INTERPRET", "FEATLEARN_TILES", "CUDA_VISIBLE_DEVICES")]
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit",
                            "--format=csv"], capture_output=True, text=True, timeout=30)
        lines += ["nvidia-smi: " + line for line in (q.stdout or q.stderr).strip().splitlines()]
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        props = {k: getattr(p, k) for k in ("name", "major", "minor", "multi_processor_count", "total_memory",
                                            "L2_cache_size", "max_threads_per_multi_processor") if hasattr(p, k)}
        lines += [f"device {k}: {v}" for k, v in props.items()]
        print(f"HEADLINE: {p.name} sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
              f"{p.total_memory / 2**30:.1f} GiB, L2 {props.get('L2_cache_size', 0) / 2**20:.0f} MiB; "
              f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        print(f"HEADLINE: {'CPU stand-in: ' if dry else ''}no CUDA device; torch {torch.__version__}")
    (out / "env.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def ceilings_piece(out: Path, dry: bool, reuse: bool, cache: Path) -> None:
    """``ceilings.csv`` in OUT (and, on a GPU, in ``cache`` for part 2, whose OUT is a new folder): the ones
    already in OUT or, with ``reuse``, those of ``cache`` measured on this device; else measured."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    target, cached = out / "ceilings.csv", cache / "ceilings.csv"
    if reuse and target.is_file():
        print(f"HEADLINE: from this OUT ({device_of(target)})")
        return
    if reuse and not dry and device_of(cached) == name:
        shutil.copy2(cached, target)
        print(f"HEADLINE: part 1's, from {cached} ({name})")
        return
    rows = measure(device) if device.type == "cuda" else measure(device, 384, 32 << 20, 1, 3)
    write(rows, target)
    if device.type == "cuda":
        write(rows, cached)
    print("\n".join(f"{r['name']}: {r['value']} {r['unit']} ({r['detail']})" for r in rows))
    print("HEADLINE: " + ("CPU stand-in: " if dry else "") + ", ".join(
        f"{r['name']} {r['value']:.4g} {r['unit']}" for r in rows if isinstance(r["value"], float)))
