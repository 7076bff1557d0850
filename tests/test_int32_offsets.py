"""Offsets past 2^31 elements: every kernel that indexes an operand by (row x row length) does it in int64.

The cases (``tests/int32_boundary_cases.py``) run each kernel's last programs through the interpreter on
operands of 2^32+ elements that are never touched outside those rows. With int32 index arithmetic the
offsets wrap and the rows come out wrong (or the process dies reading unmapped memory); with int64 they
match the float64 reference to float32 rounding.
"""
import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("int32_boundary_cases.py")
EXPECTED = ("soft_threshold-forward", "soft_threshold-grad_x", "soft_threshold-grad_w", "smoothed_clamp-forward",
            "smoothed_clamp-grad_x", "smoothed_clamp-grad_w", "bn_cosine_loss-l2-rows", "patch_activation_sum-forward")


def test_kernels_index_past_2_32_elements():
    run = subprocess.run([sys.executable, str(CASES)], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"})
    results = dict(line.split() for line in run.stdout.splitlines() if len(line.split()) == 2)
    last = run.stdout.split()[-1] if run.stdout.split() else "(none)"
    assert run.returncode == 0, f"died in case {last} (exit {run.returncode}): {run.stderr[-2000:]}"
    assert tuple(results) == EXPECTED
    errors = {name: float(err) for name, err in results.items()}
    assert all(err < 1e-5 for err in errors.values()), errors
