"""A seed stack's online training batch drawn for every seed in one call (``sample_seeds``): each seed's tensors
bit for bit the batch its DataModule draws alone, the numbers of different seeds different; the one draw only
where the members differ in their seed alone, and for training batches only."""
import pytest
import torch

from featlearn.datamodules.hidden_representation import HiddenRepresentationDataModule
from featlearn.datamodules.seeds import SeedStackDataModule
from featlearn.datamodules.sparse_coding import SparseCodingDataModule

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN = dict(T=3, s=3, r=7, u=5, sigma_S=1.3, sigma_R=0.7, sigma_U=2.0, mode="online")
SPARSE = dict(d=12, d1=40, mode="online", num_negatives=50)
CASES = {  # name: (class, arguments, a different non-seed argument)
    "hidden": (HiddenRepresentationDataModule, HIDDEN, dict(sigma_S=2.0)),
    "hidden weighted, no spurious": (HiddenRepresentationDataModule, dict(HIDDEN, task_weights=[0.5, 0.2, 0.3], u=0),
                                     dict(target_task=1)),
    # d = 8: where a batched product (or a contiguous copy of the transposed Haar dictionary) rounds differently
    "hidden d = 8": (HiddenRepresentationDataModule, dict(T=2, s=2, r=4, u=2, mode="online"), dict(sigma_U=0.5)),
    "hidden d = 9": (HiddenRepresentationDataModule, dict(T=2, s=2, r=4, u=3, mode="online"), dict(u=2)),
    "sparse random mask, shared pool": (SparseCodingDataModule, SPARSE, dict(mask_prob=0.3)),
    "sparse d = 9, d1 = 37": (SparseCodingDataModule, dict(SPARSE, d=9, d1=37), dict(d1=36)),
    "sparse per-anchor, masked negatives": (SparseCodingDataModule, dict(SPARSE, negatives="per_anchor",
                                                                         num_negatives=3, augment_negatives=True),
                                            dict(num_negatives=4)),
    "sparse no augmentation, coordinate dictionary": (SparseCodingDataModule,
                                                      dict(SPARSE, augment="none", dictionary="coordinate"),
                                                      dict(p=0.2)),
}


@pytest.mark.parametrize("batch", [29, 33])  # odd: a seed's rows of the stack start at unaligned addresses
@pytest.mark.parametrize("case", list(CASES))
def test_one_draw_gives_each_seed_its_own_batch(case, batch):
    cls, args, other = CASES[case]
    seeds = [4, 0, 11, 7]
    members = [cls(seed=s, batch_size=batch, **args) for s in seeds]
    data = SeedStackDataModule(members, seeds)
    train = {"index": torch.arange(batch) + 5 * batch, "split": "train"}
    got = data.on_after_batch_transfer(dict(train), 0)
    assert "stacked" in got, "the one draw was not taken"
    for row, member in enumerate(members):
        own = member.on_after_batch_transfer(dict(train), 0)
        assert got["seeds"][row].keys() == own.keys()
        for key, value in own.items():
            assert torch.equal(got["seeds"][row][key], value), (seeds[row], key)
            assert torch.equal(got["stacked"][key][row], value), (seeds[row], key)
    assert not torch.equal(got["seeds"][0]["x"], got["seeds"][1]["x"])
    differs = SeedStackDataModule([*members[:3], cls(seed=7, batch_size=batch, **{**args, **other})], seeds)
    assert "stacked" not in differs.on_after_batch_transfer(dict(train), 0)
    assert "stacked" not in data.on_after_batch_transfer({"index": torch.arange(8), "split": "val"}, 0)
