"""Timing shared by the benchmark scripts: median wall time with device synchronisation."""
import statistics
import time

import torch


def median_seconds(fn, device, warmup: int = 3, repeats: int = 10) -> float:
    """Median seconds of ``fn()`` after ``warmup`` calls; waits for CUDA work before reading the clock."""
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
