"""``featlearn bench data``: a seed stack's online training batch drawn for every seed in one call
(:meth:`~featlearn.datamodules.base.SyntheticDataModule.sample_seeds`) against the seeds' DataModules drawing
theirs in turn (``eager``: what a stack does without it), checked bit for bit first.

A case: the main-job config's data (``tiny``: its own sizes; ``smoke``: small) of a method whose DataModule
offers the one draw, with S seeds; a call makes one step's batches of all S seeds (the stack's
``on_after_batch_transfer``), so the times are per step, not per seed.

Example:
    >>> print(*[case.name for case in cases(["universality", "contrastive"], "smoke", torch.device("cpu"), (3,))])
    universality x3 contrastive x3
"""
from __future__ import annotations

import torch

from featlearn.bench.harness import EAGER, Case, Variant
from featlearn.bench.step_methods import main_job
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.datamodules.hidden_representation import HiddenRepresentationDataModule
from featlearn.datamodules.seeds import SeedStackDataModule
from featlearn.datamodules.sparse_coding import SparseCodingDataModule

ONE_DRAW = "one draw"
METHODS = ("universality", "contrastive")
SIZES = ("smoke", "tiny")
SEEDS = (3, 8, 32)
"""Seed counts when ``--seeds`` is not given (the experiments train 3 to 7 together)."""
_DATA = {"universality": (HiddenRepresentationDataModule, dict(T=2, s=2, r=4, u=2, batch_size=64)),
         "contrastive": (SparseCodingDataModule, dict(d=8, d1=32, num_negatives=16, batch_size=16))}


def _data(name: str, size: str) -> dict:
    data = dict(main_job(name)[0], **(_DATA[name][1] if size == "smoke" else {}), mode="online")
    data.pop("seed", None)
    return data


def _stack(name: str, size: str, seeds: list[int]) -> SeedStackDataModule:
    cls = _DATA[name][0]
    if cls.sample_seeds is SyntheticDataModule.sample_seeds:
        raise ValueError(f"{name}: {cls.__name__} draws seed by seed (no sample_seeds)")
    return SeedStackDataModule([cls(**_data(name, size), seed=s) for s in seeds], seeds)


def _flat(batches: list[dict]) -> list[torch.Tensor]:
    """Every seed's tensors in one order (seed, then key): what the check compares."""
    return [b[k] for b in batches for k in sorted(b) if torch.is_tensor(b[k])]


def case(name: str, size: str, device: torch.device, count: int) -> Case:
    batch = _data(name, size)["batch_size"]

    def inputs(dtype, dev, seed):
        return {"stack": _stack(name, size, list(range(seed, seed + count))), "index": torch.arange(batch, device=dev)}

    def train(inputs):
        return {"index": inputs["index"], "split": "train"}

    def one_draw(inputs):
        out = inputs["stack"].on_after_batch_transfer(train(inputs), 0)
        assert "stacked" in out, "the one draw was not taken"
        return _flat(out["seeds"])

    def in_turn(inputs):
        return _flat([m.on_after_batch_transfer(train(inputs), 0) for m in inputs["stack"].members])

    # the reference is the seeds drawn in turn, in float64 where the sampler draws floats: exact equality
    # of the float32 draws is then a relative error of 0 (Variant tolerance 0)
    def reference(inputs):
        return [t.double() if t.is_floating_point() else t for t in in_turn(inputs)]

    # eager (the seeds in turn) is the reference itself: its check only confirms the harness's plumbing
    return Case(f"{name} x{count}", f"batch {batch}, {count} seeds",
                [Variant(EAGER, in_turn, tolerance=0.0), Variant(ONE_DRAW, one_draw, tolerance=0.0)],
                inputs, reference)


def cases(methods: list[str], size: str, device: torch.device, seeds: tuple[int, ...] = ()) -> list[Case]:
    return [case(name, size, device, count) for name in methods for count in (seeds or SEEDS)]
