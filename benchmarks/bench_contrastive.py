"""Benchmark the contrastive method's hot loops: the soft-threshold layer and the stop-grad InfoNCE loss.

For each op (forward + backward, fp32) it times, in one run:

* ``eager``: the plain PyTorch expression with autograd (``soft_threshold_reference`` /
  ``infonce_reference`` which materialises the K x (N+1) logits and softmax);
* ``compile``: ``torch.compile`` of that expression (skipped with a note if compilation fails);
* ``fused``: ``soft_threshold_layer(backend=...)`` (Triton on CUDA, the PyTorch ``autograd.Function``
  fallback on CPU) / ``infonce_stopgrad`` (streamed over negative blocks, closed-form backward);

and prints a Markdown table of median times and speed-ups vs eager. Sizes (spec 001 section 1.4):
``medium`` = d1 2048, m 1024, K 1024 anchors (+K positives), N 4096 negatives; ``tiny`` = d1 256, m 128,
K = N = 256 (the CPU default).

Usage:
    python benchmarks/bench_contrastive.py                  # tiny on CPU, medium on CUDA
    python benchmarks/bench_contrastive.py --size medium --save benchmarks/results/contrastive_h100.md
"""
from __future__ import annotations

import argparse

import torch

from featlearn.kernels.soft_threshold import soft_threshold_layer, soft_threshold_reference
from featlearn.kernels.infonce import infonce_reference, infonce_stopgrad
from timing import median_seconds  # benchmarks/timing.py (scripts run from benchmarks/)

SIZES = {  # d1, m, K, N
    "tiny": (256, 128, 256, 256),
    "small": (512, 256, 512, 512),
    "medium": (2048, 1024, 1024, 4096),
}


def bench(size: str, device: torch.device, reps: int, chunk: int | None) -> list[tuple[str, str, float | None, str]]:
    d1, m, K, N = SIZES[size]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2 * K + N, d1, generator=g).to(device)  # anchors, positives and negatives go through W
    w = (torch.randn(m, d1, generator=g) / d1 ** 0.5).to(device).requires_grad_(True)
    b = (0.3 * torch.rand(m, generator=g)).to(device)
    grad_h = torch.randn(2 * K + N, m, generator=g).to(device)
    backend = "triton" if device.type == "cuda" else "torch"
    scale = 1.0 / m ** 0.5
    ha = (scale * torch.randn(K, m, generator=g)).to(device).requires_grad_(True)
    hq = (scale * torch.randn(K, m, generator=g)).to(device)
    hn = (scale * torch.randn(N, m, generator=g)).to(device)
    tau = 3.5

    def layer(fn):
        def run():
            w.grad = None
            fn(x, w, b).backward(grad_h)
        return run

    def loss(fn):
        def run():
            ha.grad = None
            fn(ha, hq, hn, tau).mean().backward()
        return run

    rows = []
    ops = [
        ("soft-threshold fwd+bwd", layer, soft_threshold_reference,
         lambda x_, w_, b_: soft_threshold_layer(x_, w_, b_, backend=backend), f"fused ({backend})"),
        ("InfoNCE fwd+bwd", loss, infonce_reference,
         lambda a, q, n, t: infonce_stopgrad(a, q, n, t, chunk_size=chunk)[0], f"streamed (chunk={chunk or N})"),
    ]
    for name, wrap, eager_fn, fused_fn, fused_label in ops:
        t_eager = median_seconds(wrap(eager_fn), device, repeats=reps)
        rows.append((name, "eager", t_eager, ""))
        try:
            compiled = torch.compile(eager_fn, dynamic=False)
            t_comp = median_seconds(wrap(compiled), device, repeats=reps)
            rows.append((name, "torch.compile", t_comp, ""))
        except Exception as err:  # noqa: BLE001 - report and go on (e.g. no C++ compiler on CPU)
            rows.append((name, "torch.compile", None, f"failed: {type(err).__name__}"))
        rows.append((name, fused_label, median_seconds(wrap(fused_fn), device, repeats=reps), ""))
    return rows


def table(rows, size, device) -> str:
    d1, m, K, N = SIZES[size]
    lines = [f"size {size}: d1={d1}, m={m}, K={K}, N={N}; device {device}; fp32; median of timed reps",
             "", "| op | variant | time (ms) | speed-up vs eager | note |", "|---|---|---|---|---|"]
    eager = {}
    for op, variant, t, note in rows:
        if variant == "eager":
            eager[op] = t
        ms = "-" if t is None else f"{1e3 * t:.3f}"
        ratio = "-" if t is None else f"{eager[op] / t:.2f}x"
        lines.append(f"| {op} | {variant} | {ms} | {ratio} | {note} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: medium on CUDA, tiny on CPU")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=None, help="negatives per block in the streamed loss")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--save", default=None, help="write the table (Markdown) to this path")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or ("medium" if device.type == "cuda" else "tiny")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out = table(bench(size, device, args.reps, args.chunk), size, name)
    print(out)
    if args.save:
        with open(args.save, "w") as fh:
            fh.write(out + "\n")


if __name__ == "__main__":
    main()
