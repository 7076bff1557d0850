"""check_memory asks about this rank's own GPU: a bare "cuda" is cuda:LOCAL_RANK before Lightning selects
the rank's device, so no DDP rank opens a CUDA context on GPU 0 (no GPU needed: torch.cuda is faked)."""
import pytest
import torch

from featlearn.datamodules.sparse_coding import SparseCodingDataModule
from featlearn.validation import available_memory, own_cuda_device


@pytest.fixture
def gpus(monkeypatch):
    """Two fake GPUs; records the device every memory query asks about and whether CUDA was initialised
    (``current_device`` initialises it, on GPU 0's behalf when nothing chose a device)."""
    state = {"asked": [], "current": 0, "initialized": False, "current_calls": 0}

    def current_device():
        state["current_calls"] += 1
        state["initialized"] = True
        return state["current"]

    def mem_get_info(device=None):
        assert isinstance(device, int), f"asked about {device!r}, not one GPU's index"
        state["asked"].append(device)
        return (5 << 30, 8 << 30)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return state


def test_rank_1_asks_about_cuda_1_and_never_touches_gpu_0(gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    free, source = available_memory("cuda")
    assert gpus["asked"] == [1] and free == 5 << 30 and "cuda:1" in source
    assert gpus["current_calls"] == 0          # CUDA not even initialised on GPU 0's behalf
    # the callers pass no device: a DataModule's memory check is the rank's too
    SparseCodingDataModule(d=8, d1=32, batch_size=16, num_negatives=16)
    assert gpus["asked"] == [1, 1] and gpus["current_calls"] == 0


def test_explicit_index_and_fallbacks(gpus, monkeypatch):
    assert available_memory("cuda:1")[0] == 5 << 30 and gpus["asked"] == [1]
    assert own_cuda_device() == 0                         # one process, nothing chosen: the current device
    monkeypatch.setenv("LOCAL_RANK", "3")                 # one GPU per process (CUDA_VISIBLE_DEVICES)
    assert own_cuda_device() == 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    gpus["current"] = 1                                   # a device was chosen (Lightning's set_device)
    assert own_cuda_device() == 1
