"""The XOR mixture of Gaussians (Shi 2024, Ch. 3 = Shi, Wei, Liang, NeurIPS 2023, App. B.5.3, after Refinetti et
al. 2021): the data of :mod:`featlearn.lightning_modules.gradient_features`.

Four clusters with equal weight and centres ``mu_1 = -mu_2`` and ``mu_3 = -mu_4``, ``||mu_j|| = sqrt(d)``,
``<mu_1, mu_3> = 0`` (two orthonormal directions ``D_1, D_3`` drawn from the seed, scaled by ``sqrt(d)``), and
isotropic noise of variance ``sigma^2``: ``x = mu_j + sigma z``. Clusters 1 and 2 are labelled +1, clusters 3 and 4
are labelled -1, so no linear classifier does better than chance. ``sigma`` defaults to the largest the chapter
allows, ``sqrt(d / (tau log log d))`` with ``tau = 8``. Every training step draws fresh samples (``mode:
online``), as the chapter's Algorithm 1 does; ``batch_size`` defaults to its ``n = 4 d^1.5``.

The ground truth: :attr:`~XORMixtureDataModule.centres` ``[4, d]`` and :attr:`~XORMixtureDataModule.features`,
the unit directions ``D_1, D_3`` (one per row).

Example:
    >>> dm = XORMixtureDataModule(d=16, seed=0)
    >>> b = dm.batch(torch.arange(6), "train")
    >>> tuple(b["x"].shape), dm.batch_size, sorted(set(b["y"].tolist())) == [-1.0, 1.0]
    ((6, 16), 256, True)
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from featlearn.datamodules import rng
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.errors import ConfigError
from featlearn.theory.gradient_features import xor_bias
from featlearn.validation import PositiveFloat, PositiveInt, check_args

_Q_CLUSTER, _Q_NOISE = 0, 1  # the random quantities' streams within a split
_G_CENTRES = 7


def default_sigma(d: int, tau: float = 8.0) -> float:
    """The chapter's largest noise standard deviation, ``sqrt(d / (tau log log d))`` (App. B.5.3; needs d > e^e)."""
    return math.sqrt(d / (tau * math.log(math.log(d))))


class XORMixtureDataModule(SyntheticDataModule):
    """The XOR mixture of four Gaussians (module docstring).

    Args:
        d: the input dimension, at least 16 (``log log d > 0``).
        sigma: the noise standard deviation (default ``sqrt(d / (8 log log d))``).
        batch_size: samples per step (default ``round(4 d^1.5)``, the chapter's n).
        seed, mode, num_train, num_val, num_test, steps_per_epoch, shuffle: see
            :class:`~featlearn.datamodules.base.SyntheticDataModule`.
    """

    def __init__(self, d: PositiveInt = 64, sigma: PositiveFloat | None = None,
                 mode: Literal["fixed", "online"] = "online", batch_size: PositiveInt | None = None,
                 num_val: PositiveInt = 8192, num_test: PositiveInt = 20000, **synthetic):
        check_args("data", XORMixtureDataModule.__init__, locals())
        if d < 16:
            raise ConfigError("data.d", "at least 16 (the noise default needs log log d > 0)", d)
        batch_size = round(4 * d ** 1.5) if batch_size is None else batch_size
        super().__init__(mode=mode, batch_size=batch_size, num_val=num_val, num_test=num_test, **synthetic)
        self.d = d
        self.sigma = default_sigma(d) if sigma is None else float(sigma)
        self.check_memory({"d": d}, train_values=d + 2, eval_values=d + 2, out_bytes=4, consts=4 * d * 8)
        self.directions = rng.global_orthonormal(self.seed, _G_CENTRES, d, 2).T  # [2, d] orthonormal: D_1, D_3
        mu = math.sqrt(d) * self.directions
        self.centres = torch.stack([mu[0], -mu[0], mu[1], -mu[1]])  # float64 [4, d]

    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """``x [B, d]``, ``y [B]`` (+1 for clusters 1-2, -1 for 3-4) and the ``cluster [B]`` (0-3)."""
        seed, st = self.seed, self.stream
        cluster = rng.randint(seed, st(split, _Q_CLUSTER), index, (), 4)
        noise = rng.normal(seed, st(split, _Q_NOISE), index, (self.d,))
        x = self.centres.to(noise)[cluster] + self.sigma * noise
        return {"x": x, "y": torch.where(cluster < 2, 1.0, -1.0).to(noise.device), "cluster": cluster}

    @property
    def features(self) -> torch.Tensor:
        """``D_1, D_3``, the unit directions of the two centre pairs (one per row)."""
        return self.directions.float()

    @property
    def signal_norm(self) -> float:
        """How far along its feature direction a sample's signal lies: the centres' norm ``sqrt(d)``."""
        return math.sqrt(self.d)

    def bias_scale(self, sigma_w: float) -> float:
        """The chapter's bias scale for the XOR mixture, ``sqrt(d log log d) sigma_w sigma`` (App. B.5.3)."""
        return xor_bias(self.d, sigma_w, self.sigma)
