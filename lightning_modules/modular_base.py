"""What the k-input modular-addition methods of Shi 2024, Ch. 4 share
(:class:`~featlearn.lightning_modules.modular_addition.FourierMLP`,
:class:`~featlearn.lightning_modules.modular_transformer.ModularTransformer`): the training step of a
``batch_loss``, AdamW with a linear warm-up, and evaluation over whole splits.

* **Training.** ``batch_loss(batch) -> (loss, logits [B, p])``; ``train/loss`` and ``train/acc`` of the batch
  every ``log_every_n_steps`` steps. AdamW with the method's ``lr``, ``betas`` and :meth:`weight_decay`, its step
  size ramped linearly over ``warmup_steps`` steps (the chapter's code base's schedule).
* **Evaluation.** The DataModule serves the whole held-out split (dataloader 0) and the whole training split
  (1); each validation logs ``val/acc`` and ``val/loss`` of the first and ``val/train_acc`` of the second, from
  sums over every batch and every process (under DDP each rank scores its own range of each split, none padded,
  so every tuple counts once; a rank that saw no batch of a split adds zeros), then calls
  :meth:`ModularAdditionMethod.after_validation` with whether every tuple was seen and the smallest margin.

Example:
    >>> from featlearn.lightning_modules.modular_addition import FourierMLP
    >>> model = FourierMLP(lam=0.3).attach(ModularAdditionDataModule(k=2, p=5, batch_size=4))
    >>> model.weight_decay(), FourierMLP(lam=0.3, regularizer="norm").weight_decay()   # the norm is in the loss
    (0.3, 0.0)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from featlearn.datamodules.modular_addition import ModularAdditionDataModule
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.theory.modular_addition import margins


class ModularAdditionMethod(FeatureLearningModule):
    """The shared training and evaluation of the modular-addition methods (module docstring)."""

    datamodule_class = ModularAdditionDataModule
    compiled_loss = "batch_loss"

    def __init__(self):
        super().__init__()
        self._eval: dict[str, list] = {}

    def remember_splits(self, dm: ModularAdditionDataModule) -> None:
        """Keep the split sizes a whole-split pass sees (call from ``build``)."""
        self.split_sizes = {"val": dm.sizes["val"], "train": dm.sizes["train"]}

    def batch_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the training objective, the answer's logits ``[B, p]``)."""
        raise NotImplementedError

    def weight_decay(self) -> float:
        """AdamW's decoupled weight decay (default: ``lam``)."""
        return self.hparams.lam

    def training_step(self, batch, batch_idx):
        loss, logits = self.batch_loss(batch)
        if self.theory_due():
            self.log("train/loss", loss, sync_dist=True)
            self.log("train/acc", (logits.argmax(1) == batch["y"]).float().mean(), sync_dist=True)
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=tuple(hp.betas), weight_decay=self.weight_decay())
        warm = max(1, hp.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # --- evaluation: the held-out split (dataloader 0) and the whole training split (1) ---------
    def validation_step(self, batch, batch_idx, dataloader_idx: int = 0):
        with torch.no_grad():
            logits = self(batch["a"])
        sums = self._eval.setdefault("val" if dataloader_idx == 0 else "train", [0.0, 0, 0, math.inf])
        sums[0] += float(F.cross_entropy(logits, batch["y"], reduction="sum"))
        sums[1] += int((logits.argmax(1) == batch["y"]).sum())
        sums[2] += len(batch["y"])
        sums[3] = min(sums[3], float(margins(logits.double(), batch["y"]).min()))

    def on_validation_epoch_end(self) -> None:
        evals, self._eval = self._eval, {}
        if self._trainer is not None and self.trainer.sanity_checking:
            return
        empty = [0.0, 0, 0, math.inf]
        totals = {split: self._all_reduce(torch.tensor(evals.get(split, empty)[:3], dtype=torch.float64))
                  for split in ("val", "train")}
        smallest = self._all_reduce(torch.tensor([min(v[3] for v in [empty, *evals.values()])],
                                                 dtype=torch.float64), "min")
        for split, name in (("val", "val/acc"), ("train", "val/train_acc")):
            if totals[split][2] > 0:
                self.log(name, float(totals[split][1] / totals[split][2]), prog_bar=split == "val")
        if totals["val"][2] > 0:
            self.log("val/loss", float(totals["val"][0] / totals["val"][2]))
        whole = all(totals[s][2] >= n for s, n in self.split_sizes.items())  # not limit_val_batches
        self.after_validation(whole, float(smallest[0]))

    def after_validation(self, whole: bool, smallest_margin: float) -> None:
        """What a method logs after a validation: ``whole`` when every tuple of both splits was seen,
        ``smallest_margin`` the smallest margin over the tuples seen (on every process)."""

    def _all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self._trainer is None or self.trainer.world_size == 1:
            return t
        return self.trainer.strategy.reduce(t.to(self.device), reduce_op=op).cpu()

    def accuracy_results(self) -> dict[str, float]:
        """The last validation's held-out and training accuracies, where one ran (``test_acc``, ``train_acc``)."""
        out = {}
        if self._trainer is not None:
            for key, name in (("test_acc", "val/acc"), ("train_acc", "val/train_acc")):
                value = self.logged(name)
                if value is not None:
                    out[key] = float(value)
        return out
