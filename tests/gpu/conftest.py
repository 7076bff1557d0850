"""GPU tests (``pytest.mark.gpu``): the Triton kernels compiled and run on a CUDA device.

* On a GPU machine: ``TRITON_INTERPRET=0 python3 -m pytest -m gpu tests/gpu`` (odd, medium, large and
  int32-boundary sizes). Under the interpreter (the default suite's ``TRITON_INTERPRET=1``) they skip: the
  interpreter would run every program of a large launch in Python.
* Dry mode, for CI without a GPU: ``FEATLEARN_GPU_DRY=1 python -m pytest -m gpu tests/gpu`` runs the same tests
  on the CPU through the Triton interpreter at tiny sizes, so that they cannot rot before a GPU is lent.
* Otherwise (the default suite on a CPU machine) every test skips with "needs CUDA".

Tiles: on CUDA the tests run with ``FEATLEARN_TILES=pinned`` unless the environment says otherwise (the
first autotune config that fits each call, no timing): a lent GPU session is short, and the search compiles
and times every config of every kernel at every size. ``FEATLEARN_TILES=search`` checks every config.
"""
import gc
import os
import sys
from pathlib import Path

import pytest
import torch

# the tests' shared helpers (tests/tiny_sizes.py) sit one folder up, off the path when only tests/gpu is collected
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DRY = os.environ.get("FEATLEARN_GPU_DRY") == "1"
CUDA = torch.cuda.is_available()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@pytest.fixture
def gpu_device(monkeypatch):
    """``cuda`` when there is a GPU, ``cpu`` in dry mode (``FEATLEARN_GPU_DRY=1``), else the test skips."""
    if CUDA:
        if _interpreting():
            pytest.skip("GPU tests compile the kernels: run them with TRITON_INTERPRET=0")
        monkeypatch.setenv("FEATLEARN_TILES", os.environ.get("FEATLEARN_TILES", "pinned"))
        # float32 cuBLAS GEMMs outside the ops (references, modules) in IEEE precision, whatever the
        # process default: the float32 tolerances are IEEE ones
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            yield torch.device("cuda")
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            gc.collect()  # the large cases hold up to ~26 GB: give it back before the next test
            torch.cuda.empty_cache()
    elif DRY:
        if not _interpreting():
            pytest.fail("FEATLEARN_GPU_DRY=1 runs the kernels through the Triton interpreter: set TRITON_INTERPRET=1")
        yield torch.device("cpu")
    else:
        pytest.skip("needs CUDA (FEATLEARN_GPU_DRY=1 runs these tests on the CPU through the Triton interpreter)")


@pytest.fixture
def pick(gpu_device):
    """``pick(cuda, tiny)``: the CUDA size on a GPU, the tiny one in dry mode (the interpreter runs every
    Triton program in Python, so dry sizes stay at a few tiles)."""
    return lambda cuda, tiny: cuda if gpu_device.type == "cuda" else tiny


def pytest_collection_modifyitems(config, items):
    """The int32-boundary cases run last: an index that overflows there may end in an illegal memory
    access, which poisons the CUDA context for every later test of the process."""
    last = [item for item in items if "int32" in item.name and item.get_closest_marker("gpu")]
    if last:
        ids = {id(item) for item in last}
        items[:] = [item for item in items if id(item) not in ids] + last
