import os

# Triton kernels are tested on CPU through the interpreter; must be set before triton is imported.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


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
