"""Benchmark of patch_activation_sum (spec 6.1/6.6): fused Triton vs eager PyTorch vs torch.compile vs the
chunked PyTorch fallback, forward and forward+backward, in one run (ratios are from the same run).

The workload is the Teacher-Student hot loop: smoothed ReLU (q=3, rho=0.25), masked student sum,
teacher sum with tau=1.5 (no gradient) and the masked sum of squares; the backward loss is
sum(g_s * student) + sum(g_q * squares) with fixed random g_s, g_q.

Usage:
    python benchmarks/bench_patch_activation_sum.py --config tiny --device cpu
    python benchmarks/bench_patch_activation_sum.py --config medium --device cuda --repeats 10 --save
"""
from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

from featlearn.kernels import Activation, patch_activation_sum
from featlearn.kernels.backend import interpreting
from timing import median_seconds  # benchmarks/timing.py (scripts run from benchmarks/)

CONFIGS = {
    "tiny": dict(B=1000, P=16, d=256, R=30),
    "medium": dict(B=16384, P=32, d=1024, R=512),
}
Q, RHO, TAU, KEEP = 3, 0.25, 1.5, 0.5


def naive(x, w, mask, q=Q, rho=RHO, tau=TAU):
    """The unfused composition of spec 6.1: separate GEMMs (teacher weights materialised) and
    elementwise ops, every intermediate a [B, P, R] tensor."""

    def f(a):
        c = torch.clamp(a, 0.0, rho)
        return torch.pow(c, q) / (q * rho ** (q - 1)) + torch.clamp(a - rho, min=0.0)

    a = x @ w.T
    y = f(a)
    my = mask.unsqueeze(-1) * y
    student = my.sum(1)
    squares = (my * y).sum(1)
    with torch.no_grad():
        teacher = f(x @ (tau * w).T).sum(1)
    return student, teacher, squares


def fused(backend):
    act = Activation("srelu", q=Q, rho=RHO)

    def run(x, w, mask):
        return tuple(patch_activation_sum(x, w, act, mask=mask, teacher_scale=TAU, squares=True, backend=backend))

    return run


def measure(name, method, x, w, mask, gs, gq, device, repeats, warmup):
    def fwd():
        return method(x, w, mask)

    def fwd_bwd():
        s, _, q = method(x, w, mask)
        ((s * gs).sum() + (q * gq).sum()).backward()
        x.grad = w.grad = None

    row = {"name": name}
    try:
        out = fwd()
        row["outputs"] = [o.detach() for o in out]
        del out
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        row["fwd"] = 1e3 * median_seconds(fwd, device, warmup, repeats)
        row["fwd_bwd"] = 1e3 * median_seconds(fwd_bwd, device, warmup, repeats)
        if cuda:
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    except torch.cuda.OutOfMemoryError:
        row["error"] = "OOM"
        torch.cuda.empty_cache()
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/patch_activation_sum_<device>.md")
    args = parser.parse_args(argv)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = args.device
    cfg = CONFIGS[args.config]
    B, P, d, R = cfg["B"], cfg["P"], cfg["d"], cfg["R"]
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    x = torch.randn(B, P, d, generator=g).to(device).requires_grad_(True)
    w = (torch.randn(R, d, generator=g) / d**0.5 * 0.5).to(device).requires_grad_(True)
    mask = (torch.rand(B, P, generator=g) < KEEP).float().to(device)
    gs = torch.randn(B, R, generator=g).to(device)
    gq = torch.randn(B, R, generator=g).to(device)

    methods = [("eager (unfused)", naive)]
    if not args.no_compile:
        methods.append(("torch.compile(eager)", torch.compile(naive)))
    methods.append(("fallback (chunked torch)", fused("torch")))
    skipped = []
    if device.startswith("cuda") or interpreting():
        methods.insert(0, ("triton (fused)", fused("triton")))
    else:
        skipped.append("triton (needs CUDA, or TRITON_INTERPRET=1 on CPU)")

    rows = [measure(n, m, x, w, mask, gs, gq, device, args.repeats, args.warmup) for n, m in methods]
    base = next(r for r in rows if r["name"].startswith("eager"))
    name_dev = torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu"
    lines = [
        f"# patch_activation_sum benchmark: config `{args.config}` on {device} ({name_dev})",
        "",
        f"B={B}, P={P}, d={d}, R={R}, float32, TF32 off, smoothed ReLU q={Q} rho={RHO}, teacher_scale={TAU}, "
        f"squares=True, mask keep={KEEP}; median of {args.repeats} runs after {args.warmup} warm-up; "
        f"torch {torch.__version__}; threads={torch.get_num_threads()}"
        + (", TRITON_INTERPRET=1" if interpreting() else ""),
        "",
        "| method | fwd ms | fwd+bwd ms | fwd speed-up vs eager | fwd+bwd speed-up vs eager | peak MiB | max rel. diff vs eager |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['error']} | | | | | |")
            continue
        diff = max(
            ((o - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            for o, b in zip(r["outputs"], base.get("outputs", r["outputs"]))
        )
        sp_f = base["fwd"] / r["fwd"] if "fwd" in base else float("nan")
        sp_b = base["fwd_bwd"] / r["fwd_bwd"] if "fwd_bwd" in base else float("nan")
        peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else "n/a"
        lines.append(f"| {r['name']} | {r['fwd']:.2f} | {r['fwd_bwd']:.2f} | {sp_f:.2f}x | {sp_b:.2f}x | {peak} | {diff:.1e} |")
    for s in skipped:
        lines.append(f"\nskipped: {s}")
    table = "\n".join(lines)
    print(table)
    if args.save:
        out = Path(__file__).resolve().parent / "results" / f"patch_activation_sum_{device.split(':')[0]}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table + "\n")
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
