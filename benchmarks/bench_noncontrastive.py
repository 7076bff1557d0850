"""Benchmark the non-contrastive method's hot loops (spec 004 section 7): the batch-norm cosine loss and the
cubic patch encoder of both views, forward + backward.

For each op it times, in one run:

* ``eager``: the plain PyTorch expression with autograd (``bn_cosine_loss_reference``, which spawns the
  N x m BN temporaries; the encoder as ``einsum`` + cube + two masked patch sums);
* ``compile``: ``torch.compile`` of that expression (skipped with a note if compilation fails);
* ``fused``: ``bn_cosine_loss(backend=...)`` / ``encode(...)`` through ``patch_activation_sum``
  (Triton on CUDA, the PyTorch fallbacks on CPU);

and prints a Markdown table of median times and speed-ups vs eager. Sizes: ``medium`` = spec 7.1
(N 4096, P 32, d 1024; loss at m = 2 and m = 64, the encoder at m = 64); ``tiny`` = N 256, P 8, d 32
(the CPU default).

Usage:
    python benchmarks/bench_noncontrastive.py                 # tiny on CPU, medium on CUDA
    python benchmarks/bench_noncontrastive.py --size medium --save benchmarks/results/noncontrastive_h100.md
"""
from __future__ import annotations

import argparse

import torch

from featlearn.kernels.bn_cosine_loss import bn_cosine_loss, bn_cosine_loss_reference
from featlearn.lightning_modules.noncontrastive import encode
from timing import median_seconds  # benchmarks/timing.py (scripts run from benchmarks/)

SIZES = {  # N, P, d, widths for the loss, width for the encoder
    "tiny": (256, 8, 32, (2, 16), 16),
    "small": (1024, 16, 256, (2, 64), 16),
    "medium": (4096, 32, 1024, (2, 64), 64),
}


def _encoder_eager(x, w, m1):
    a = torch.einsum("bpd,rd->bpr", x, w) ** 3
    f = (a * m1[..., None]).sum(1)
    with torch.no_grad():
        g = (a.detach() * (1 - m1)[..., None]).sum(1)
    return f, g


def _encoder_fused(x, w, m1):
    f = encode(x, w, m1)
    with torch.no_grad():
        g = encode(x, w.detach(), 1 - m1)
    return f, g


def bench(size: str, device: torch.device, reps: int, dtype: torch.dtype):
    n, patches, d, loss_widths, enc_width = SIZES[size]
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []

    def run(label, fns):
        base = None
        for name, fn in fns:
            try:
                t = median_seconds(fn, device, repeats=reps)
                note = ""
            except Exception as err:  # compile may be unavailable on some stacks
                t, note = None, f"failed: {type(err).__name__}"
            if name == "eager":
                base = t
            rows.append((label, name, t, note if note else (f"{base / t:.2f}x" if base and t else "")))

    for m in loss_widths:
        p = torch.randn(n, m, generator=gen, dtype=dtype).to(device).requires_grad_(True)
        z = (0.5 * p.detach() + torch.randn(n, m, generator=gen, dtype=dtype).to(device))

        def eager():
            bn_cosine_loss_reference(p, z).backward()

        compiled = torch.compile(lambda a, b: bn_cosine_loss_reference(a, b))

        def comp():
            compiled(p, z).backward()

        def fused():
            bn_cosine_loss(p, z).backward()

        run(f"bn_cosine_loss N={n} m={m}", [("eager", eager), ("compile", comp), ("fused", fused)])

    x = torch.randn(n, patches, d, generator=gen, dtype=dtype).to(device)
    m1 = (torch.rand(n, patches, generator=gen) < 0.5).to(dtype).to(device)
    w = (torch.randn(enc_width, d, generator=gen, dtype=dtype) / d ** 0.5).to(device).requires_grad_(True)
    coef = torch.randn(n, enc_width, generator=gen, dtype=dtype).to(device)

    def enc(fn):
        def step():
            f, g = fn(x, w, m1)
            ((f * coef).sum() + 0 * g.sum()).backward()
        return step

    enc_compiled = torch.compile(_encoder_eager)
    run(f"encoder fwd+bwd N={n} P={patches} d={d} m={enc_width}",
        [("eager", enc(_encoder_eager)), ("compile", enc(enc_compiled)), ("fused", enc(_encoder_fused))])
    return rows


def table(rows, device, size, dtype) -> str:
    head = f"# bench_noncontrastive ({size}, {dtype}, {device})\n\n| op | impl | median ms | vs eager |\n|---|---|---|---|\n"
    body = "".join(f"| {op} | {impl} | {'-' if t is None else f'{1e3 * t:.3f}'} | {note} |\n"
                   for op, impl, t, note in rows)
    return head + body


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=tuple(SIZES), default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--save", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or ("medium" if device.type == "cuda" else "tiny")
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # spec 1.3 / 8.14: the dynamics need full fp32
    out = table(bench(size, device, args.reps, dtype), device, size, dtype)
    print(out)
    if args.save:
        with open(args.save, "w") as fh:
            fh.write(out)


if __name__ == "__main__":
    main()
