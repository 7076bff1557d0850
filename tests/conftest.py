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
