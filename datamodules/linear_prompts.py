"""Prompts of in-context linear regression (Shi 2024, Ch. 8, Defs 8.2-8.5): the data of the looped transformer.

A prompt holds ``n`` examples ``x_i ~ N(0, I_d)`` of one task ``theta*``, uniform on the unit sphere, their labels
``y_i = <x_i, theta*>`` (noise-free, as in the chapter) and a query value ``alpha ~ U[alpha_low, alpha_high]``: the
model must output a vector ``q`` with ``<q, theta*> = alpha`` (the chapter's "linear vector generation"; ``q =
alpha theta*`` does it). Each prompt is a function of (seed, split, index), so every training step sees fresh
prompts (``mode: online``, the default) and the validation and test prompts are fixed.

The ground truth is per prompt: ``theta`` is in every batch. :attr:`LinearPromptDataModule.features` are the
coordinate axes ``theta*`` lives in.

Example:
    >>> dm = LinearPromptDataModule(d=4, n=16, batch_size=8)
    >>> b = dm.batch(torch.arange(8), "train")
    >>> tuple(b["X"].shape), bool(torch.allclose(b["y"], (b["X"] @ b["theta"].unsqueeze(-1)).squeeze(-1)))
    ((8, 16, 4), True)
"""
from __future__ import annotations

from typing import Literal

import torch

from featlearn.datamodules import rng
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.errors import ConfigError
from featlearn.validation import PositiveFloat, PositiveInt, check_args

_Q_X, _Q_THETA, _Q_ALPHA = 0, 1, 2  # the random quantities' streams within a split


class LinearPromptDataModule(SyntheticDataModule):
    """Linear-regression prompts (module docstring).

    Args:
        d: the task's dimension (the chapter's experiment: 4).
        n: examples per prompt, at least ``d`` (so that ``X^T X`` is invertible and ``theta*`` is determined).
        alpha_low, alpha_high: the query value's range, ``0 < alpha_low <= alpha_high``.
        seed, mode, batch_size, num_train, num_val, num_test, steps_per_epoch, shuffle: see
            :class:`~featlearn.datamodules.base.SyntheticDataModule`.
    """

    def __init__(self, d: PositiveInt = 4, n: PositiveInt = 16, alpha_low: PositiveFloat = 0.5,
                 alpha_high: PositiveFloat = 2.0, mode: Literal["fixed", "online"] = "online",
                 batch_size: PositiveInt | None = 1024, num_val: PositiveInt = 2048, num_test: PositiveInt = 2048,
                 **synthetic):
        check_args("data", LinearPromptDataModule.__init__, locals())
        if n < d:
            raise ConfigError("data.n", f"at least d = {d} (X^T X must be invertible for theta* to be determined)", n)
        if alpha_high < alpha_low:
            raise ConfigError("data.alpha_high", f"at least alpha_low = {alpha_low}", alpha_high)
        super().__init__(mode=mode, batch_size=batch_size, num_val=num_val, num_test=num_test, **synthetic)
        self.d, self.n, self.alpha_low, self.alpha_high = d, n, float(alpha_low), float(alpha_high)
        values = n * (d + 1) + d + 1  # X, y, theta, alpha
        self.check_memory({"d": d, "n": n}, train_values=values, eval_values=values, out_bytes=4)

    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """``X [B, n, d]``, ``y [B, n]``, ``theta [B, d]`` (unit norm) and ``alpha [B]``."""
        seed, st = self.seed, self.stream
        X = rng.normal(seed, st(split, _Q_X), index, (self.n, self.d))
        theta = torch.nn.functional.normalize(rng.normal(seed, st(split, _Q_THETA), index, (self.d,)), dim=-1)
        u = rng.uniform(seed, st(split, _Q_ALPHA), index)
        alpha = self.alpha_low + (self.alpha_high - self.alpha_low) * u
        return {"X": X, "y": (X @ theta.unsqueeze(-1)).squeeze(-1), "theta": theta, "alpha": alpha}

    @property
    def features(self) -> torch.Tensor:
        """The coordinate axes of ``R^d`` (``theta*`` differs per prompt; it is in every batch)."""
        return torch.eye(self.d)
