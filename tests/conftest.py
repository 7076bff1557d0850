import os

# Triton kernels are tested on CPU through the interpreter; must be set before triton is imported. An
# explicit value wins: the GPU tests (tests/gpu, ``TRITON_INTERPRET=0 pytest -m gpu tests/gpu``) compile them.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two xdist workers on CI's 2 cores: one torch thread each, not two each fighting for them
    torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """One torch thread: small tensors on a busy 2-core machine run fastest and steadiest this way."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def refused_before_work(monkeypatch):
    """``check(function, call)``: ``call()`` must raise ``KernelInputError`` before ``function`` (an op's
    ``autograd.Function``) runs; returns the error."""
    from featlearn.kernels import KernelInputError

    def check(function, call):
        def trap(*args):
            raise AssertionError(f"{function.__name__} ran on refused inputs")

        monkeypatch.setattr(function, "apply", trap)
        with pytest.raises(KernelInputError) as info:
            call()
        return info.value

    return check


@pytest.fixture
def poisoned(monkeypatch):
    """Every output buffer an op allocates (``featlearn.kernels.backend.new_output``, the one allocation
    seam of every op) starts as NaN, integer codes as their largest value: cells a kernel fails to write show up."""
    from featlearn.kernels import backend

    def new_output(shape, like, dtype=None):
        dtype = like.dtype if dtype is None else dtype
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
        return torch.full(shape, fill, device=like.device, dtype=dtype)

    monkeypatch.setattr(backend, "new_output", new_output)
