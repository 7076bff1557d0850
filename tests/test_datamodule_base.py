"""The synthetic DataModule base: training samples depend on (seed, step, rank) only, not on the loop."""
from types import SimpleNamespace

import pytest
import torch

from featlearn.datamodules.multiview import MultiViewDataModule
from featlearn.errors import ConfigError


def data(**kw):
    return MultiViewDataModule(k=3, d=8, P=6, s=1.0, num_pretrain=48, seed=2, **kw)


def batch_at(dm, step, rank=0, world=1, local=None):
    dm.trainer = SimpleNamespace(global_step=step, global_rank=rank, world_size=world, accumulate_grad_batches=1)
    local = torch.zeros(local or dm.batch_size, dtype=torch.long)
    return dm.on_after_batch_transfer({"index": local, "split": "train"}, 0)


@pytest.mark.parametrize("mode", ["fixed", "online"])
def test_global_batch_is_the_same_on_one_or_two_devices(mode):
    one, two = data(mode=mode, batch_size=16), data(mode=mode, batch_size=8)
    for step in (0, 1, 2, 3, 7):
        single = batch_at(one, step)
        ranks = [batch_at(two, step, rank, 2) for rank in (0, 1)]
        torch.testing.assert_close(torch.cat([r["index"] for r in ranks]), single["index"], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([r["x"] for r in ranks]), single["x"], rtol=0, atol=0)


def test_fixed_epochs_cover_the_dataset_once_in_a_new_order():
    dm = data(batch_size=16)
    epochs = [torch.cat([batch_at(dm, 3 * e + j)["index"] for j in range(3)]) for e in range(2)]
    for indices in epochs:
        assert torch.equal(indices.sort().values, torch.arange(48))
    assert not torch.equal(epochs[0], epochs[1])


def test_the_kept_epoch_order_is_the_one_drawn_for_that_epoch():
    """The shuffled order is kept between steps of an epoch; going back to an earlier epoch (a resume) and
    jumping ahead give the order drawn afresh for that epoch."""
    dm, fresh = data(batch_size=16), data(batch_size=16)
    for step in (0, 1, 5, 3, 0, 2, 4):
        fresh._order_cache = None
        assert torch.equal(batch_at(dm, step)["index"], batch_at(fresh, step)["index"])


def test_online_steps_draw_fresh_samples_and_full_batch_is_everything():
    dm = data(mode="online", batch_size=5)
    assert torch.equal(batch_at(dm, 4)["index"], torch.arange(20, 25))
    full = data()
    assert torch.equal(batch_at(full, 9, local=48)["index"], torch.arange(48))
    torch.testing.assert_close(batch_at(full, 0, local=48)["x"], full.sample(torch.arange(48), "train")["x"])


def test_bad_sizes_are_refused():
    with pytest.raises(ConfigError, match="data.batch_size"):
        data(mode="online")
    with pytest.raises(ConfigError, match="data.batch_size: must be at most"):
        batch_at(data(batch_size=30), 0, world=2)
    with pytest.raises(ConfigError, match="data.num_pretrain: must be a multiple of the device count 5"):
        batch_at(data(), 0, world=5, local=48)
    dm = data(batch_size=8)
    dm.trainer = SimpleNamespace(global_step=0, global_rank=0, world_size=1, accumulate_grad_batches=2)
    with pytest.raises(ConfigError, match="trainer.accumulate_grad_batches"):
        dm.on_after_batch_transfer({"index": torch.zeros(8, dtype=torch.long), "split": "train"}, 0)


def test_eval_splits_are_generated_once_per_distribution():
    # the runs of one experiment differ in loader settings and training-set sizes, not in their test set
    a = data(batch_size=16)
    b = MultiViewDataModule(k=3, d=8, P=6, s=1.0, num_pretrain=64, num_downstream=32, seed=2, mode="online",
                            batch_size=4)
    for split in ("val", "test"):
        assert a.full(split)["x"] is b.full(split)["x"]
    assert data(batch_size=16).full("train")["x"] is not data(batch_size=16).full("train")["x"]
    other_seed = MultiViewDataModule(k=3, d=8, P=6, s=1.0, num_pretrain=48, seed=3)
    other_noise = data(sigma_p=0.5)
    for other in (other_seed, other_noise):
        assert not torch.equal(other.full("test")["x"], a.full("test")["x"])
    fresh = MultiViewDataModule(k=3, d=8, P=6, s=1.0, num_pretrain=48, seed=2, num_test=7)
    assert fresh.full("test")["x"].shape[0] == 7
    assert torch.equal(fresh.full("test")["x"], a.full("test")["x"][:7])  # a sample is (seed, index)
