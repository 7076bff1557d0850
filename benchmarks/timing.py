"""Timing shared by the benchmark scripts: median wall time with device synchronisation."""
import statistics
import time

import torch


def median_seconds(fn, device, warmup: int = 3, repeats: int = 10) -> float:
    """Median seconds of ``fn()`` after ``warmup`` calls; waits for CUDA work before reading the clock.

    The warmup also absorbs Triton compilation and autotuning: the first call of a kernel for each new
    autotune key (its size arguments) benchmarks every config before running the best one.
    """
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
