"""The benchmark harness shared by ``featlearn bench op`` and ``featlearn bench step``.

A :class:`Case` is a set of named :class:`Variant` callables computing the same function (outputs and the
gradients training needs), a float64 reference and a tolerance per dtype. :func:`check` runs every
variant on fresh random inputs against the reference first; a variant off by more than its tolerance (or
producing NaN) is FAILED and never timed. :func:`interleave` then times the variants round-robin (one call
of each per round, after warm-up rounds that also absorb ``torch.compile`` and Triton autotuning), so a
machine that slows down mid-run slows every variant alike.

Timing: on CPU ``time.perf_counter`` around each call; on CUDA ``triton.testing.do_bench`` (events, median
of its own repeats) per call of a pure function, CUDA events around a call with side effects (a training
step); every variant is held to the same input draw and the same rounds. Rates: a case may carry its
model FLOPs and fewest bytes per call (``Case.flops``, ``Case.bytes``); with the device's measured
ceilings (``featlearn gpu check`` part 1, :mod:`featlearn.gpu.ceilings`) the tables give each variant's
TFLOP/s and GB/s as a fraction of the GEMM ceiling of its precision and of the copy ceiling.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` reset before each call, less what was allocated
before it, the largest over a variant's timed calls; on CPU, in a pass of its own after all
timing (:func:`measure_cpu_peaks`), the growth of the kernel's peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs``) over one call, with glibc made to return freed tensors to the system
(Linux with glibc; n/a elsewhere).
"""
from __future__ import annotations

import csv
import ctypes
import statistics
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from featlearn.gpu.ceilings import achieved
from featlearn.metrics.figures import bars_figure, save_png

TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-10}
"""Relative error ``||out - ref|| / ||ref||`` allowed per output: float32 admits TF32 GEMMs (~3e-4)."""
TF32_TOLERANCE = 1e-2
"""A TF32 variant's: ~1e-3 per product sum, tripled by a cubic activation; 1e-2 still catches a wrong formula."""

KINK_MARGIN = 0.02
"""Half-width of the band around an activation's kink where an upstream gradient is zeroed: a TF32
pre-activation (error ~1e-3) on the other side of a kink changes the slope by O(1) there."""


def away_from_kinks(grad: torch.Tensor, preactivation: torch.Tensor, *kinks: torch.Tensor,
                    margin: float = KINK_MARGIN) -> torch.Tensor:
    """``grad`` with zeros where ``preactivation`` lies within ``margin`` of a kink (broadcast), so that an
    op whose slope jumps is compared on its formula, not on which side rounding put a pre-activation.
    One flipped slope among B x m moves ``grad_W`` by ~1/sqrt(B m) of its norm (4e-4 at 5120 x 1024), so
    without this a correct float32 GEMM fails a 1e-3 check by chance.

    Example:
        >>> u = torch.tensor([0.0, 0.295, 0.5]); g = torch.ones(3)
        >>> away_from_kinks(g, u, torch.tensor(0.3))
        tensor([1., 0., 1.])
    """
    if not kinks:
        return grad
    near = torch.stack([(preactivation - k).abs() for k in torch.broadcast_tensors(*kinks)]).amin(0) <= margin
    return grad.masked_fill(near, 0.0)


EAGER, COMPILED = "eager", "compiled"
"""The variant names every ratio is taken against (the baseline a user writes, and its torch.compile)."""


@dataclass
class Variant:
    name: str
    run: Callable[[dict], Sequence[torch.Tensor]]
    """inputs -> outputs (the forward results, then the gradients training needs)."""
    precision: str | None = None
    """``ieee``, ``tf32`` or ``fp64``: its GEMM ceiling (None: from the dtype)."""
    tolerance: float | None = None
    """None: :data:`TOLERANCE` of the case's dtype."""
    reference: Callable[[dict], Sequence[torch.Tensor]] | None = None
    """Its own float64 reference, for a variant that checks something the case's cannot (None: the case's)."""


@dataclass
class Case:
    name: str
    shape: str
    """The sizes, as printed in the table."""
    variants: list[Variant]
    inputs: Callable[[torch.dtype, torch.device, int], dict]
    """(dtype, device, seed) -> fresh random inputs."""
    reference: Callable[[dict], Sequence[torch.Tensor]]
    """float64 inputs -> float64 outputs in the variants' order."""
    dtype: torch.dtype = torch.float32
    """The dtype the variants are checked and timed in."""
    timer: Callable | None = None
    """Optional driver replacing :func:`interleave` (a training step timed inside the Trainer's loop)."""
    flops: float | None = None
    """Model FLOPs of one call (the GEMMs the computation needs; recomputation not counted)."""
    bytes: float | None = None
    """Fewest bytes one call must move: its inputs read once, its outputs written once."""


@dataclass
class Result:
    case: str
    shape: str
    variant: str
    error: float
    passed: bool
    seconds: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    note: str = ""
    precision: str = ""
    flops: float | None = None
    bytes: float | None = None

    def record(self, seconds: float, peak_bytes: int | None) -> None:
        """One timed call: its seconds, and the largest peak so far (``None``: no peak measured)."""
        self.seconds.append(seconds)
        if peak_bytes is not None:
            self.peak_bytes = max(self.peak_bytes or 0, peak_bytes)

    @property
    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.seconds) if self.seconds else float("nan")

    @property
    def iqr_ms(self) -> float:
        if len(self.seconds) < 2:
            return float("nan")
        q = statistics.quantiles(self.seconds, n=4, method="inclusive")
        return 1e3 * (q[2] - q[0])

    @property
    def mean_ms(self) -> float:
        return 1e3 * statistics.fmean(self.seconds) if self.seconds else float("nan")


def relative_error(outputs: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    """Largest ``||out - ref|| / ||ref||`` over the outputs (inf on a missing output, a shape mismatch or NaN)."""
    if len(outputs) != len(reference):
        return float("inf")
    worst = 0.0
    for out, ref in zip(outputs, reference):
        out, ref = out.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
        if out.shape != ref.shape:
            return float("inf")
        err = float((out - ref).norm() / ref.norm().clamp_min(1e-300))
        if err != err:
            return float("inf")
        worst = max(worst, err)
    return worst


def check(case: Case, device: torch.device, seed: int) -> list[Result]:
    """Every variant on fresh random inputs (one draw per variant) against the float64 reference."""
    results = []
    for i, variant in enumerate(case.variants):
        inputs = case.inputs(case.dtype, device, seed + 1000 + i)
        try:
            error = relative_error(variant.run(inputs), (variant.reference or case.reference)(to_float64(inputs)))
            note = ""
        except Exception as err:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
            error, note = float("inf"), error_note(err)
        tolerance = TOLERANCE[case.dtype] if variant.tolerance is None else variant.tolerance  # 0: bit for bit
        passed = error <= tolerance
        precision = variant.precision or ("fp64" if case.dtype == torch.float64 else "ieee")
        results.append(Result(case.name, case.shape, variant.name, error, passed,
                              note=note or ("" if passed else f"error {error:.1e} > {tolerance:.0e}"),
                              precision=precision, flops=case.flops, bytes=case.bytes))
    return results


def error_note(err: BaseException, width: int = 120) -> str:
    """``Type: first line of the message`` (``Type: `` for an exception without one, as torch's bare asserts)."""
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:width]}"


def to_float64(inputs: dict) -> dict:
    """A float64 copy of every floating tensor (leaf-ness and ``requires_grad`` kept); other values as is."""
    return {k: v.detach().to(torch.float64, copy=True).requires_grad_(v.requires_grad)
            if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


class Meter:
    """Seconds and peak memory of one call: ``with Meter(device) as m: ...`` -> ``m.seconds``,
    ``m.peak_bytes`` (None where the platform gives no peak)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events = self.cuda

    def __enter__(self) -> "Meter":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        if self.events:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.events:
            self.end.record()
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0
        if self.events:
            self.seconds = 1e-3 * self.start.elapsed_time(self.end)
        # CPU peaks come from a separate pass after all timing (measure_cpu_peaks): measuring them changes
        # how memory is allocated, which would slow the timed calls
        self.peak_bytes = torch.cuda.max_memory_allocated() - self.base if self.cuda else None


def _proc_status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return 1024 * int(line.split()[1])
    except OSError:
        return None
    return None


def _glibc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None  # not glibc: no CPU peaks


_LIBC = _glibc()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _reset_rss_peak() -> int | None:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0) and return the current RSS (None: unsupported)."""
    _LIBC.malloc_trim(0)  # what an earlier call freed on the heap is no longer resident
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _proc_status_kib("VmRSS")


def _rss_peak() -> int | None:
    return _proc_status_kib("VmHWM")


class ResidentGrowth:
    """The peak growth of the process's resident memory between :meth:`start` and :meth:`stop` (bytes; None
    without glibc or ``/proc``), measured the one way this harness does it.

    glibc serves large blocks by mmap and returns them on free, but raises its mmap threshold (up to
    32 MB) after the first such free; from then on tensors come from the heap and stay resident when
    freed, so a repeated call would show no growth. A fixed 64 KB threshold makes RSS follow live tensors,
    at the price of a page fault per allocation: measure in a pass of its own, never while timing.
    ``restore`` puts glibc back to its steady state (32 MB mmap, 64 MB trim thresholds) at :meth:`stop`,
    so that later timings run under the policy earlier ones had.

    Example:
        >>> growth = ResidentGrowth()
        >>> growth.start(); block = bytearray(64 << 20); grown = growth.stop()
        >>> grown is None or grown >= 32 << 20
        True
    """

    available = _LIBC is not None

    def __init__(self, restore: bool = True):
        self.restore, self.base = restore, None

    def start(self) -> None:
        if self.available:
            _LIBC.mallopt(_M_MMAP_THRESHOLD, 1 << 16)
            self.base = _reset_rss_peak()

    def stop(self) -> int | None:
        if not self.available:
            return None
        peak = _rss_peak()
        if self.restore:
            _LIBC.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
            _LIBC.mallopt(_M_TRIM_THRESHOLD, 64 << 20)
        return None if self.base is None or peak is None else max(0, peak - self.base)


def measure(result: Result, fn: Callable[[], object], device: torch.device) -> None:
    """Time one call of ``fn`` into ``result``. A pure function on CUDA goes through
    ``triton.testing.do_bench`` (median of its own event-timed repeats)."""
    if device.type == "cuda":
        import triton.testing

        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seconds = 1e-3 * triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
        result.record(seconds, torch.cuda.max_memory_allocated() - base)
    else:
        with Meter(device) as m:
            fn()
        result.record(m.seconds, m.peak_bytes)


def interleave(case: Case, results: list[Result], device: torch.device, rounds: int, warmup: int, seed: int) -> None:
    """Time the passed variants round-robin on one input draw: ``warmup`` untimed rounds, then ``rounds``."""
    inputs = case.inputs(case.dtype, device, seed)
    runs = {v.name: v.run for v in case.variants}
    timed = [r for r in results if r.passed]
    for _ in range(warmup):
        for r in timed:
            runs[r.variant](inputs)
    for _ in range(rounds):
        for r in timed:
            measure(r, lambda: runs[r.variant](inputs), device)


def measure_cpu_peaks(cases: list[Case], results: list[Result], seed: int) -> None:
    """Peak resident-set growth (:class:`ResidentGrowth`) of one call of each passed variant, in a pass of
    its own after all timing. Without glibc or ``/proc`` the column reads n/a, and so it does for step
    cases (their ``run`` builds a module and its data, which is not a step's working memory)."""
    if not ResidentGrowth.available:
        return
    passed = {(r.case, r.shape, r.variant): r for r in results if r.passed}
    cpu = torch.device("cpu")
    growth = ResidentGrowth(restore=False)  # one fixed threshold for the whole pass
    for case in cases:
        if case.timer is not None:  # a step case's run() builds its module and data: not a step's memory
            continue
        inputs = case.inputs(case.dtype, cpu, seed)
        for variant in case.variants:
            result = passed.get((case.name, case.shape, variant.name))
            if result is None:
                continue
            variant.run(inputs)  # first-call caches (compiled graphs) are not the variant's working memory
            growth.start()
            variant.run(inputs)
            grown = growth.stop()
            if grown is not None:
                result.peak_bytes = grown


def run_cases(cases: list[Case], device: torch.device, rounds: int, warmup: int, seed: int,
              progress: Callable[[str], None] = print,
              after_case: Callable[[list[Result]], None] | None = None) -> list[Result]:
    """Check, then time, every case; FAILED variants are reported and not timed. ``after_case(results so
    far)`` runs after each case (the command writes its tables there, so a run cut short keeps its rows)."""
    results = []
    for case in cases:
        progress(f"{case.name} [{case.shape}]: checking {len(case.variants)} variants against float64")
        checked = check(case, device, seed)
        for r in checked:
            if not r.passed:
                progress(f"  FAILED {r.variant}: {r.note}")
        progress(f"  timing {sum(r.passed for r in checked)} variants, {warmup} warm-up + {rounds} interleaved rounds")
        (case.timer or interleave)(case, checked, device, rounds, warmup, seed)
        results.extend(checked)
        if after_case is not None:
            after_case(results)
    if device.type == "cpu":
        progress("peak memory: one more call of each variant")
        measure_cpu_peaks(cases, results, seed)
    return results


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def ratios(results: list[Result]) -> dict[tuple[str, str, str], tuple[float, float]]:
    """(case, shape, variant) -> (speed-up vs eager, speed-up vs compiled): baseline time over the variant's."""
    base = {(r.case, r.shape, r.variant): r.median_ms for r in results if r.seconds}
    out = {}
    for r in results:
        if r.seconds:
            out[(r.case, r.shape, r.variant)] = tuple(base.get((r.case, r.shape, b), float("nan")) / r.median_ms
                                                      for b in (EAGER, COMPILED))
    return out


def _fmt(x: float, spec: str) -> str:
    return "-" if x != x else format(x, spec)


def rates(r: Result, ceilings: dict[str, float]) -> tuple[float, float, float, float]:
    """(TFLOP/s, fraction of its GEMM ceiling, GB/s, fraction of the copy ceiling) at the median time."""
    return achieved(r.flops, r.bytes, r.median_ms / 1e3, r.precision, ceilings)


def table(results: list[Result], header: str, ceilings: dict[str, float] | None = None) -> str:
    """A markdown table: median, IQR, mean, speed-ups vs eager and vs compiled, achieved rates (as a share
    of the measured ceilings), peak memory, check error."""
    rs = ratios(results)
    lines = [header, "",
             "| case | shape | variant | check (rel. error) | median ms | IQR ms | mean ms | x vs eager | x vs compiled "
             "| TFLOP/s | % GEMM ceiling | GB/s | % copy ceiling | peak MiB |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        status = (f"ok {r.error:.0e}" + (f"; {r.note}" if r.note else "")) if r.passed else f"FAILED ({r.note})"
        vs_e, vs_c = rs.get((r.case, r.shape, r.variant), (float("nan"), float("nan")))
        tf, f_gemm, gbs, f_copy = rates(r, ceilings or {})
        peak = "n/a" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.1f}"
        lines.append(f"| {r.case} | {r.shape} | {r.variant} | {status} | {_fmt(r.median_ms, '.3f')} | "
                     f"{_fmt(r.iqr_ms, '.3f')} | {_fmt(r.mean_ms, '.3f')} | {_fmt(vs_e, '.2f')} | {_fmt(vs_c, '.2f')} | "
                     f"{_fmt(tf, '.3g')} | {_fmt(100 * f_gemm, '.0f')} | {_fmt(gbs, '.4g')} | {_fmt(100 * f_copy, '.0f')} | "
                     f"{peak if r.seconds else '-'} |")
    return "\n".join(lines)


def write(results: list[Result], out: Path, stem: str, header: str, ceilings: dict[str, float] | None = None,
          figure: bool = True) -> list[Path]:
    """``<stem>.csv``, ``<stem>.md`` and (``figure``) ``<stem>.png`` (speed-up vs eager per case and
    variant) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rs = ratios(results)
    csv_path = out / f"{stem}.csv"
    with csv_path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["case", "shape", "variant", "passed", "rel_error", "median_ms", "iqr_ms", "mean_ms",
                         "speedup_vs_eager", "speedup_vs_compiled", "precision", "gflop", "mbytes", "tflops",
                         "frac_gemm_ceiling", "gbs", "frac_copy_ceiling", "peak_bytes", "repeats", "note"])
        for r in results:
            vs_e, vs_c = rs.get((r.case, r.shape, r.variant), (float("nan"), float("nan")))
            tf, f_gemm, gbs, f_copy = rates(r, ceilings or {})
            writer.writerow([r.case, r.shape, r.variant, r.passed, f"{r.error:.3e}", f"{r.median_ms:.4f}",
                             f"{r.iqr_ms:.4f}", f"{r.mean_ms:.4f}", f"{vs_e:.4f}", f"{vs_c:.4f}", r.precision,
                             "" if r.flops is None else f"{r.flops / 1e9:.4g}",
                             "" if r.bytes is None else f"{r.bytes / 1e6:.4g}",
                             f"{tf:.4g}", f"{f_gemm:.4f}", f"{gbs:.4g}", f"{f_copy:.4f}",
                             "" if r.peak_bytes is None else r.peak_bytes, len(r.seconds), r.note])
    md_path = out / f"{stem}.md"
    md_path.write_text(table(results, header, ceilings) + "\n")
    if not figure:
        return [csv_path, md_path]
    speedups = [(case, shape, variant, vs_e) for (case, shape, variant), (vs_e, _) in rs.items()]
    png_path = save_png(speedup_figure(speedups, header.lstrip("# ").split("\n")[0]), out / f"{stem}.png")
    return [csv_path, md_path, png_path]


def speedup_figure(speedups, title: str):
    """Bars of ``(case, shape, variant, speed-up vs eager)``, one group of bars per variant."""
    groups: dict[str, dict[str, float]] = {}
    for case, shape, variant, vs_eager in speedups:
        groups.setdefault(variant, {})[f"{case}\n" + textwrap.fill(shape, 20)] = vs_eager
    return bars_figure(groups, ylabel="speed-up vs eager (higher is faster)", title=title)


def plot_table(table: Path, title: str | None = None) -> Path:
    """``<table>.png`` beside a CSV that :func:`write` made elsewhere (a lent GPU's ``$OUT`` brings back
    the tables, not the figures). Untimed (FAILED) rows are left out.

    Example:
        >>> plot_table(Path("benchmarks/results/gpu/bench_op_gpu_h100.csv"))  # doctest: +SKIP
    """
    with table.open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["passed"] == "True"]
    speedups = [(r["case"], r["shape"], r["variant"], float(r["speedup_vs_eager"])) for r in rows]
    return save_png(speedup_figure(speedups, title or table.stem), table.with_suffix(".png"))
