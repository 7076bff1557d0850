"""Multi-view data of mask-reconstruction pretraining (Pan et al. 2023, Def. 3.1, after Allen-Zhu & Li 2023).

Each class ``i`` of ``k`` owns two orthonormal features ``v[i,0], v[i,1]``. A sample of class ``y``
has ``P`` patches of dimension ``d``; both own features (multi-view) or one main feature plus a weak
copy of the other (single-view, probability ``mu``) sit on ``C_p`` patches each, off-class features
appear with probability ``s/k`` each on their own ``C_p`` patches, every patch carries feature noise
``alpha ~ U[0, gamma]`` along all ``2k`` features and Gaussian noise (std ``sigma_p`` on feature
patches, ``gamma k / sqrt(d)`` on background patches). Coefficients split a per-feature sum ``S``
equally over its patches: own ``S ~ U[1, 1.2]``, single-view weak ``U[rho, 1.2 rho]``, off-class
``U[0.2, 0.4]`` (our choice within the paper's ranges, which leave the law open).

Splits: the training split is the unlabelled pretraining set (size ``num_pretrain``) or the labelled
downstream set (``num_downstream``), drawn from disjoint random streams; which one is the module's choice
(its ``train_set``, handed over by :meth:`MultiViewDataModule.use_train_set` in its ``build``), so one data
preset serves pretraining, fine-tuning and supervised learning. ``val`` and ``test`` are further disjoint
draws. Masked pretraining with sampled masks asks for a keep-mask per training sample
(:meth:`MultiViewDataModule.use_masks`): batches then carry ``mask`` ``[B, P]``.

Example:
    >>> dm = MultiViewDataModule(k=4, d=16, P=10, s=1, num_pretrain=8)
    >>> batch = dm.full("train")
    >>> batch["x"].shape, dm.features.shape
    (torch.Size([8, 10, 16]), torch.Size([8, 16]))
"""
from typing import Literal

import torch

from featlearn.datamodules import rng
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.errors import ConfigError
from featlearn.validation import (ClosedUnitInterval, LeftOpenUnitInterval, NonNegativeFloat, PositiveInt, check_args,
                                  int_at_least)

_STREAMS = {"pretrain": 1, "downstream": 2, "val": 3, "test": 4}
_Y, _SINGLE, _MAIN, _OFF, _PRIORITY, _PATCHES, _SUMS, _CLOSE, _ALPHA, _NOISE = range(10)


class MultiViewDataModule(SyntheticDataModule):
    """Samples of Pan et al. 2023, Def. 3.1; see the module docstring for the distribution.

    Args:
        k: classes (2k features). d: patch dimension (>= 2k). P: patches (>= C_p (2 + 4 s)).
        C_p: patches per feature. s: expected off-class features per class pair (probability s/k each).
        mu: probability of a single-view sample. rho: weight of the weak feature in single-view data.
        eval_mu: probability of a single-view sample in the val and test splits (default: ``mu``); set it
            to measure single-view accuracy precisely while the training share ``mu`` is small or zero.
        sigma_p: noise std on feature patches. gamma: feature-noise level (alpha ~ U[0, gamma]).
        close_prob: probability of putting a feature sum at its end point (1 own, 0.4 off-class).
        basis: ``identity`` (v = first 2k coordinate axes) or ``random`` orthonormal features.
        num_pretrain, num_downstream: sizes of the two training sets (see :meth:`use_train_set`).
        ``**synthetic``: seed, mode, batch_size, steps_per_epoch, shuffle (:class:`SyntheticDataModule`).
    """

    train_only_args = ("num_pretrain", "num_downstream")

    def __init__(
        self,
        k: int_at_least(2) = 10,
        d: PositiveInt = 256,
        P: PositiveInt = 16,
        C_p: PositiveInt = 1,
        s: NonNegativeFloat = 2.0,
        mu: ClosedUnitInterval = 0.2,
        eval_mu: ClosedUnitInterval | None = None,
        rho: LeftOpenUnitInterval = 0.1,
        sigma_p: NonNegativeFloat = 0.005,
        gamma: NonNegativeFloat = 0.002,
        close_prob: ClosedUnitInterval = 0.0,
        basis: Literal["identity", "random"] = "identity",
        num_pretrain: PositiveInt = 1000,
        num_downstream: PositiveInt = 500,
        num_val: PositiveInt = 1000,
        num_test: PositiveInt = 2000,
        **synthetic,
    ):
        check_args("data", MultiViewDataModule.__init__, locals())
        if d < 2 * k:
            raise ConfigError("data.d", f"at least 2k = {2 * k}", d)
        if s > k:
            raise ConfigError("data.s", f"in [0, k = {k}]", s)
        if P < C_p * (2 + 4 * s):
            raise ConfigError("data.P", f"at least C_p (2 + 4 s) = {C_p * (2 + 4 * s):g} patches", P)
        # the module picks the training set later (use_train_set): sized for the larger
        super().__init__(num_train=max(num_pretrain, num_downstream), num_val=num_val, num_test=num_test, **synthetic)
        self.check_memory({"d": d, "P": P, "k": k, "num_pretrain": num_pretrain, "num_downstream": num_downstream},
                          train_values=P * d, eval_values=P * d, out_bytes=4,
                          consts=2 * k * d * (32 if basis == "random" else 4))
        self.train_sizes = {"pretrain": num_pretrain, "downstream": num_downstream}
        self.k, self.d, self.P, self.C_p, self.s, self.mu, self.rho = k, d, P, C_p, s, mu, rho
        self.eval_mu = mu if eval_mu is None else eval_mu
        self.sigma_p, self.gamma, self.close_prob, self.basis = sigma_p, gamma, close_prob, basis
        self._features = self._make_features()
        self.mask_keep, self.mask_seed, self._devices = None, 0, 1
        self._select("pretrain")

    def _select(self, train_set: str) -> None:
        self.train_set, self.train_field = train_set, f"data.num_{train_set}"
        self.sizes["train"] = self.train_sizes[train_set]
        self._cache = {key: value for key, value in self._cache.items() if key[0] != "train"}

    def use_train_set(self, train_set: Literal["pretrain", "downstream"]) -> None:
        """Make ``train_set`` the training split (called by the module's ``build``; default ``pretrain``)."""
        self._select(train_set)
        if self.mode == "fixed" and self.batch_size is not None and self.batch_size > self.sizes["train"]:
            # checked here, not in the base class, so the message names the field the user sets
            raise ConfigError("data.batch_size", f"at most {self.train_field} = {self.sizes['train']} in fixed mode",
                              self.batch_size)
        super().check_devices(self._devices)

    def check_devices(self, world_size: int) -> None:
        # The training set is the module's choice, so the check waits for use_train_set.
        self._devices = world_size

    def use_masks(self, keep: float, seed: int) -> None:
        """Add a keep-mask ``[B, P]`` (each patch kept with probability ``keep``) to every training batch,
        a function of (seed, global step, sample index)."""
        self.mask_keep, self.mask_seed = keep, seed

    def keep_mask(self, index: torch.Tensor, step: int) -> torch.Tensor:
        """The keep-mask of these samples at training step ``step`` (see :meth:`use_masks`)."""
        return rng.bernoulli(self.mask_seed, 100_000 + step, index, (self.P,), self.mask_keep).float()

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        train = isinstance(batch, dict) and batch.get("split") == "train"
        batch = super().on_after_batch_transfer(batch, dataloader_idx)
        if train and self.mask_keep is not None:
            batch["mask"] = self.keep_mask(batch["index"], self._world()[0])
        return batch

    def _make_features(self) -> torch.Tensor:
        if self.basis == "identity":
            return torch.eye(2 * self.k, self.d)
        gauss = rng.global_normal(self.seed, 7, (self.d, 2 * self.k), dtype=torch.float64)
        return torch.linalg.qr(gauss).Q.T.float().contiguous()

    @property
    def features(self) -> torch.Tensor:
        """``[2k, d]``; row ``2 i + l`` is feature ``v[i, l]`` (class i, view l)."""
        return self._features

    def feature_class(self) -> torch.Tensor:
        """Class of each feature row: ``[0, 0, 1, 1, ...]``."""
        return torch.arange(2 * self.k) // 2

    def stream(self, split: str, quantity: int = 0) -> int:
        name = self.train_set if split == "train" else split
        return 1000 * _STREAMS[name] + quantity

    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """Samples ``{"x": [B,P,d], "y": [B], "single_view": [B] bool, "main_view": [B] (-1 multi),
        "dropped": [B] off-class features dropped for lack of patches}`` on ``index.device``."""
        k, P, C_p, dev = self.k, self.P, self.C_p, index.device
        F = 2 * k

        def draw(kind, fn, *args):
            return fn(self.seed, self.stream(split, kind), index, *args)

        y = draw(_Y, rng.randint, (), k)
        single = draw(_SINGLE, rng.bernoulli, (), self.mu if split == "train" else self.eval_mu)
        main = torch.where(single, draw(_MAIN, rng.randint, (), 2), torch.full_like(y, -1))
        fclass = torch.arange(F, device=dev) // 2
        own = fclass == y[:, None]                                                     # [B, F]
        present = own | (draw(_OFF, rng.bernoulli, (F,), self.s / k) & ~own)
        # Own features first, then present off-class features in random order; keep what fits in P.
        priority = torch.where(own, -1.0, draw(_PRIORITY, rng.uniform, (F,), torch.float64))
        priority = priority.masked_fill(~present, float("inf"))
        position = torch.argsort(torch.argsort(priority, dim=1), dim=1)                # rank of feature
        kept = present & (position < P // C_p)
        slots = position.clamp_max(P // C_p - 1)[..., None] * C_p + torch.arange(C_p, device=dev)
        patches = torch.gather(draw(_PATCHES, rng.permutation, P), 1, slots.flatten(1)).view(-1, F, C_p)

        u = draw(_SUMS, rng.uniform, (F,))
        close = draw(_CLOSE, rng.bernoulli, (F,), self.close_prob)
        own_sum = torch.where(close, 1.0, 1.0 + 0.2 * u)
        off_sum = torch.where(close, 0.4, 0.2 + 0.2 * u)
        weak = own & single[:, None] & ((torch.arange(F, device=dev) % 2) != main[:, None])
        sums = torch.where(own, torch.where(weak, self.rho * (1.0 + 0.2 * u), own_sum), off_sum) * kept

        z = torch.zeros(len(index), P, F, device=dev)
        z.scatter_(1, patches.transpose(1, 2), (sums / C_p)[:, None, :].expand(-1, C_p, -1))
        on_feature = z.sum(-1) > 0                                                      # [B, P]
        coeff = z + self.gamma * draw(_ALPHA, rng.uniform, (P, F))
        noise_std = torch.where(on_feature, self.sigma_p, self.gamma * k / self.d ** 0.5)
        x = draw(_NOISE, rng.normal, (P, self.d)).mul_(noise_std[..., None])
        if self.basis == "identity":
            x[..., :F] += coeff
        else:
            x += coeff @ self.features.to(dev)
        return {"x": x, "y": y, "single_view": single, "main_view": main,
                "dropped": (present & ~kept).sum(1)}
