"""The data of several seeds in one run: one DataModule per seed, each drawing its batches as it would alone.

The loaders are the first member's (they carry sample indices only, which depend on the step, the rank and the
sizes, never on the seed); after the indices reach the device each member turns them into its own batch (its
shuffled order, features and samples are functions of its seed), so ``training_step`` of a
:class:`~featlearn.lightning_modules.seeds.SeedStack` receives ``{"seeds": [batch of seed 0, batch of seed 1,
...]}``. Online training batches of a class that offers
:meth:`~featlearn.datamodules.base.SyntheticDataModule.sample_seeds` are drawn for every seed in one call
(the same numbers, bit for bit); the batch then also holds them as ``"stacked"`` (each tensor ``[S, ...]``),
which the stack's vmapped loss reads as it is.

Example:
    >>> from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
    >>> data = SeedStackDataModule([TwoFeaturePatchDataModule(seed=s, dim=8, batch_size=4) for s in (0, 1)], [0, 1])
    >>> seed0, seed1 = data.on_after_batch_transfer({"index": torch.arange(4), "split": "val"}, 0)["seeds"]
    >>> len(seed0["x"]), len(seed1["x"]), bool((seed0["x"] != seed1["x"]).any())
    (4, 4, True)
"""
from __future__ import annotations

import lightning as L
import torch

from featlearn.datamodules.base import SyntheticDataModule


class SeedStackDataModule(L.LightningDataModule):
    """One :class:`~featlearn.datamodules.base.SyntheticDataModule` per seed (module docstring)."""

    def __init__(self, members: list[SyntheticDataModule], seeds: list[int]):
        super().__init__()
        self.members, self.seeds = list(members), [int(s) for s in seeds]
        # one draw for all seeds only where the members differ in their seed alone (a {seed} text may differ)
        settings = [{k: v for k, v in m.hparams_initial.items() if k != "data.seed"} for m in self.members]
        self._one_draw = all(type(m) is type(self.members[0]) and c == settings[0]
                             for m, c in zip(self.members, settings))

    @property
    def hparams_initial(self):
        return self.members[0].hparams_initial

    def _share_trainer(self) -> None:
        for member in self.members:
            member.trainer = self.trainer

    def setup(self, stage: str) -> None:
        self._share_trainer()
        for member in self.members:
            member.setup(stage)

    def check_devices(self, world_size: int) -> None:
        for member in self.members:
            member.check_devices(world_size)

    def train_dataloader(self):
        self._share_trainer()
        return self.members[0].train_dataloader()

    def val_dataloader(self):
        return self.members[0].val_dataloader()

    def test_dataloader(self):
        return self.members[0].test_dataloader()

    def predict_dataloader(self):
        return self.members[0].predict_dataloader()

    def on_after_batch_transfer(self, batch: dict[str, torch.Tensor], dataloader_idx: int) -> dict:
        self._share_trainer()
        first = self.members[0]
        module = getattr(self.trainer, "lightning_module", None)
        if (self._one_draw and isinstance(batch, dict) and batch.get("split") == "train" and first.mode == "online"
                and getattr(module, "samples_needed", True)):
            index = first._train_index(batch["index"])
            with torch.profiler.record_function("featlearn.data"):
                stacked = first.sample_seeds(self.members, index, "train")
            if stacked is not None:
                stacked["index"] = index.expand(len(self.members), -1)
                return {"seeds": [{k: v[s] if torch.is_tensor(v) else v for k, v in stacked.items()}
                                  for s in range(len(self.members))], "stacked": stacked}
        return {"seeds": [member.on_after_batch_transfer(dict(batch), dataloader_idx) for member in self.members]}

    def state_dict(self) -> dict:
        return {str(seed): member.state_dict() for seed, member in zip(self.seeds, self.members)}

    def load_state_dict(self, state_dict: dict) -> None:
        for seed, member in zip(self.seeds, self.members):
            member.load_state_dict(state_dict.get(str(seed), {}))

