"""Invariant and spurious features under a distribution shift (Shi 2024, Ch. 6 = Shi, Ming, Fan, Sala, Liang,
"Domain Generalization via Nuclear Norm Regularization", CPAL 2024, arXiv:2303.07527): the data of
:mod:`featlearn.lightning_modules.erm_nu`.

Labels ``y`` are +-1 with equal probability. ``model`` picks one of the chapter's two distributions:

* ``toy`` (Sec. 6.3.1): ``x = [x1, x2]``. The invariant ``x1 = y U[0,1]`` (plus ``x1_noise`` times a standard
  normal, default 0) is the same in and out of distribution. The environmental ``x2 = s y U[0,1]`` has the label's
  sign (``s = +1``) with probability ``p_align`` = 0.7 in distribution and ``1 - p_align`` out of it. The chapter
  states only the case y = +1; this is its symmetric completion (for y = -1, ``x2`` is in [-1, 0] with probability
  ``p_align``).
* ``theory`` (Sec. 6.4, the model of Prop. 6.3): ``x = z y`` in ``R^d`` with independent coordinates of ``z``.
  The first r coordinates (the invariant set R) are ``U[0,1]``. The other d - r (the spurious set U) follow
  ``D_gamma`` in distribution (``U[0,1]`` with probability 1/2 + gamma, ``U[-1,0]`` otherwise, so ``E z_j = gamma``)
  and ``D_-gamma`` out of it.

Splits: ``train``, ``val`` (in distribution, the split model selection reads), ``test`` (in distribution) and
``ood`` (out of distribution, ``num_ood`` samples, its own random streams). :meth:`test_dataloader` serves ``test``
then ``ood``. Each model's own fields (``p_align``, ``x1_noise``; ``r``, ``d``, ``gamma``) are null for the other.
The ground truth, :attr:`~DomainShiftDataModule.features`, is the set of invariant directions (one per row).

Example:
    >>> dm = DomainShiftDataModule(model="theory", r=4, d=10, gamma=0.4, seed=0)
    >>> b = dm.batch(torch.arange(5), "ood")
    >>> z = b["x"] * b["y"].unsqueeze(1)  # z = x y: the invariant coordinates (the first r) are >= 0
    >>> tuple(b["x"].shape), tuple(dm.features.shape), bool((z[:, :4] >= 0).all())
    ((5, 10), (4, 10), True)
"""
from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from torch.utils.data import DataLoader

from featlearn.datamodules import rng
from featlearn.datamodules.base import SPLITS, SyntheticDataModule, _collate, _Indices
from featlearn.errors import ConfigError
from featlearn.validation import ClosedUnitInterval, NonNegativeFloat, PositiveInt, check_args, number_type

OpenHalfInterval = number_type("OpenHalfIntervalFloat", float, 0, 0.5, True, True, "in (0, 1/2)")
THEORY_DEFAULTS = {"r": 64, "d": 512, "gamma": 0.45}  # inside Prop. 6.3: r / gamma^2 + r = 380 < d, 3 / sqrt(r) < gamma
TOY_DEFAULTS = {"p_align": 0.7, "x1_noise": 0.0}
_Q_LABEL, _Q_VALUE, _Q_SIGN, _Q_NOISE, _Q_X2 = 0, 1, 2, 3, 4  # the random quantities' streams within a split


class DomainShiftDataModule(SyntheticDataModule):
    """The chapter's 2-D toy or its theory model D_gamma, in and out of distribution (module docstring).

    Args:
        model: ``toy`` (2 inputs) or ``theory`` (d inputs).
        r: invariant coordinates (theory; default 64), less than d.
        d: input dimension (theory; default 512).
        gamma: the spurious coordinates' mean in distribution (theory; default 0.45), in (0, 1/2).
        p_align: probability that the environmental ``x2`` has the label's sign in distribution (toy; default 0.7).
        x1_noise: standard deviation of Gaussian noise added to the invariant ``x1`` (toy; default 0).
        num_ood: samples in the out-of-distribution split.
        seed, mode, batch_size, num_train, num_val, num_test, steps_per_epoch, shuffle: see
            :class:`~featlearn.datamodules.base.SyntheticDataModule` (defaults: the toy's n = 2000, batch 64).
    """

    def __init__(self, model: Literal["toy", "theory"] = "theory", r: PositiveInt | None = None,
                 d: PositiveInt | None = None, gamma: OpenHalfInterval | None = None,
                 p_align: ClosedUnitInterval | None = None, x1_noise: NonNegativeFloat | None = None,
                 num_ood: PositiveInt = 10000, mode: Literal["fixed", "online"] = "fixed",
                 batch_size: PositiveInt | None = 64, num_train: PositiveInt = 2000, num_val: PositiveInt = 1000,
                 num_test: PositiveInt = 10000, **synthetic):
        check_args("data", DomainShiftDataModule.__init__, locals())
        given = {"r": r, "d": d, "gamma": gamma, "p_align": p_align, "x1_noise": x1_noise}
        own, other = (TOY_DEFAULTS, THEORY_DEFAULTS) if model == "toy" else (THEORY_DEFAULTS, TOY_DEFAULTS)
        for name in other:
            if given[name] is not None:
                raise ConfigError(f"data.{name}", f"null with data.model {model} (a field of the other model)",
                                  given[name])
        values = {name: own[name] if given[name] is None else given[name] for name in own}
        if model == "theory" and values["r"] >= values["d"]:
            raise ConfigError("data.r", f"less than data.d = {values['d']} (the spurious set U needs a coordinate)",
                              values["r"])
        super().__init__(mode=mode, batch_size=batch_size, num_train=num_train, num_val=num_val, num_test=num_test,
                         **synthetic)
        self.model = model
        self.r, self.d = (1, 2) if model == "toy" else (values["r"], values["d"])
        self.gamma = values.get("gamma")
        self.p_align, self.x1_noise = values.get("p_align"), values.get("x1_noise")
        self.sizes["ood"] = num_ood
        self.check_memory({"d": self.d}, train_values=self.d + 2, eval_values=self.d + 2, out_bytes=4,
                          consts=num_ood * (self.d + 2) * 4)

    @staticmethod
    def stream(split: str, quantity: int = 0) -> int:
        """The base's streams for train / val / test; ``ood`` after them (its samples share no numbers)."""
        if split == "ood":
            return 1000 * (len(SPLITS) + 1) + quantity
        return SyntheticDataModule.stream(split, quantity)

    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """``x [B, d]`` and ``y [B]`` (+-1); the toy also gives ``aligned [B]`` (``x2`` has the label's sign)."""
        seed, st, ood = self.seed, self.stream, split == "ood"
        y = torch.where(rng.bernoulli(seed, st(split, _Q_LABEL), index, (), 0.5), 1.0, -1.0)
        if self.model == "toy":
            x1 = rng.uniform(seed, st(split, _Q_VALUE), index) * y
            if self.x1_noise:
                x1 = x1 + self.x1_noise * rng.normal(seed, st(split, _Q_NOISE), index)
            p = 1 - self.p_align if ood else self.p_align
            aligned = rng.bernoulli(seed, st(split, _Q_SIGN), index, (), p)
            x2 = rng.uniform(seed, st(split, _Q_X2), index) * torch.where(aligned, y, -y)
            return {"x": torch.stack([x1, x2], 1), "y": y, "aligned": aligned}
        z = rng.uniform(seed, st(split, _Q_VALUE), index, (self.d,))
        p_positive = 0.5 - self.gamma if ood else 0.5 + self.gamma  # D_gamma in distribution, D_-gamma out of it
        positive = rng.bernoulli(seed, st(split, _Q_SIGN), index, (self.d - self.r,), p_positive)
        z[:, self.r:] = torch.where(positive, z[:, self.r:], -z[:, self.r:])
        return {"x": z * y.unsqueeze(1), "y": y}

    @property
    def features(self) -> torch.Tensor:
        """The invariant directions ``[r, d]``: the toy's ``x1`` axis, the theory model's coordinates in R."""
        return torch.eye(self.d)[:self.r]

    # --- evaluation splits: whole, in one batch each --------------------------------------------------
    def _eval_loader(self, split: str) -> DataLoader:
        n = self.sizes[split]
        return DataLoader(_Indices(n), batch_size=n, shuffle=False, collate_fn=partial(_collate, split=split),
                          num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> list[DataLoader]:
        """The in-distribution test split (dataloader 0), then the out-of-distribution split (dataloader 1)."""
        return [self._eval_loader("test"), self._eval_loader("ood")]

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
