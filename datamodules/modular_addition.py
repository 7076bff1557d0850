"""k-input modular addition (Li, Liang, Shi, Song, Zhou 2024, arXiv:2402.09469; Shi's dissertation, Ch. 4,
Eq. 4.1): every tuple ``a = (a_1, ..., a_k)`` of ``Z_p^k`` with label ``c = (a_1 + ... + a_k) mod p``.

* **The enumeration is never held.** Tuple ``t`` in ``[0, p^k)`` is decoded from its index in mixed radix
  (``a_j = (t // p^(j-1)) mod p``), so a batch costs ``O(B k)`` integer operations whatever ``p^k`` is. (A
  shuffled epoch's order is a permutation of the training split, ``n_train`` int64 held per process: 0.6 GB
  at k = 6, p = 23; ``shuffle: false`` needs none.)
* **The split is a function of (seed, index).** A random permutation ``pi`` of ``[0, p^k)`` chosen by the
  seed (:func:`~featlearn.datamodules.rng.index_permutation`: a Feistel network, not a stored permutation)
  puts tuples ``pi(0), ..., pi(n_train - 1)`` in the training split and the rest in the held-out split, with
  ``n_train`` = ``train_fraction p^k`` rounded to the nearest integer: exactly that many, the chapter's
  "even split" at 0.5. Validation and test are both the held-out split (the chapter evaluates on the other
  half), served in order and in batches, so every evaluation covers every held-out tuple once (under DDP each
  rank its own contiguous range, :class:`RankRange`); validation also serves the whole training split in order
  (a second dataloader), for full-split training accuracy.
* **Training batches** are epochs of the training split in a per-epoch order that is a function of (seed,
  epoch), sliced by rank (the base class's fixed mode), so they do not depend on batch size per device,
  workers or device count.

A batch holds ``a`` (``[B, k]`` int64, the tuple) and ``y`` (``[B]``, the label). The ground-truth features
are the real Fourier modes of ``Z_p`` (``cos``/``sin(2 pi zeta a / p)`` for ``zeta = 1 .. (p-1)/2``): the
chapter's theorem says each neuron of a max-margin network uses one of them.

Example:
    >>> dm = ModularAdditionDataModule(k=3, p=5, batch_size=16)
    >>> dm.sizes["train"], dm.sizes["test"]
    (62, 63)
    >>> b = dm.batch(torch.arange(4), "train")
    >>> bool((b["a"].sum(1) % 5 == b["y"]).all()), tuple(b["a"].shape)
    (True, (4, 3))
"""
from __future__ import annotations

import math
from functools import partial

import torch
from torch.utils.data import DataLoader, DistributedSampler

from featlearn.datamodules import rng
from featlearn.datamodules.base import SyntheticDataModule, _collate, _Indices
from featlearn.errors import ConfigError
from featlearn.validation import OpenUnitInterval, PositiveInt, check_args, int_at_least

_SPLIT_STREAM = 7  # the permutation that splits the enumeration (shared by every split)


def is_prime(p: int) -> bool:
    """Trial division (p is at most a few hundred here).

    Example:
        >>> tuple(q for q in range(20) if is_prime(q))
        (2, 3, 5, 7, 11, 13, 17, 19)
    """
    return p >= 2 and all(p % q for q in range(2, math.isqrt(p) + 1))


def decode(t: torch.Tensor, k: int, p: int) -> torch.Tensor:
    """Tuple indices ``[B]`` -> tuples ``[B, k]`` (mixed radix, ``a_1`` the least significant digit).

    Example:
        >>> decode(torch.tensor([0, 1, 5, 24]), 2, 5).tolist()
        [[0, 0], [1, 0], [0, 1], [4, 4]]
    """
    powers = p ** torch.arange(k, device=t.device, dtype=torch.int64)
    return torch.div(t.to(torch.int64).unsqueeze(-1), powers, rounding_mode="floor") % p


def fourier_modes(p: int, dtype=torch.float64) -> torch.Tensor:
    """The real Fourier basis of functions on ``Z_p`` without the constant: rows ``cos(2 pi zeta a / p)``, then
    ``sin(...)``, for ``zeta = 1 .. (p-1)/2``, each of unit norm: ``[p - 1, p]`` for odd ``p``, orthonormal.

    Example:
        >>> F = fourier_modes(7)
        >>> F.shape, bool(torch.allclose(F @ F.T, torch.eye(6, dtype=torch.float64)))
        (torch.Size([6, 7]), True)
    """
    a = torch.arange(p, dtype=dtype)
    zeta = torch.arange(1, (p - 1) // 2 + 1, dtype=dtype).unsqueeze(1)
    angle = 2 * math.pi * zeta * a / p
    return torch.cat([torch.cos(angle), torch.sin(angle)]) * math.sqrt(2 / p)


class RankRange(DistributedSampler):
    """Indices ``[rank n / world, (rank + 1) n / world)`` of ``n``, in order: a rank's share of a split for
    evaluation, without the padding of Lightning's default sampler (which repeats up to ``world - 1`` samples so
    that every rank has as many); being a ``DistributedSampler``, Lightning keeps it.

    Example:
        >>> tuple(tuple(RankRange(7, rank, 3)) for rank in range(3))
        ((0, 1), (2, 3), (4, 5, 6))
    """

    def __init__(self, n: int, rank: int, world: int):
        super().__init__(_Indices(n), num_replicas=world, rank=rank, shuffle=False)
        self.start, self.stop = rank * n // world, (rank + 1) * n // world

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


class ModularAdditionDataModule(SyntheticDataModule):
    """All ``p^k`` tuples of ``Z_p^k`` labelled by their sum mod ``p``, split at random (module docstring).

    Args:
        k: inputs per tuple (>= 2; the chapter's theorem is for k >= 3).
        p: the modulus, a prime (an odd one: the Fourier features pair cos and sin).
        train_fraction: the share of tuples in the training split, in (0, 1) (the chapter: 0.5).
        batch_size: tuples per step and device (``null``: the whole training split, full batch).
        seed: chooses the split and the epochs' orders. shuffle: reorder the training split every epoch.
    """

    train_field = "data.train_fraction"

    def __init__(self, k: int_at_least(2) = 3, p: PositiveInt = 23, train_fraction: OpenUnitInterval = 0.5,
                 batch_size: PositiveInt | None = 1024, seed: int = 0, shuffle: bool = True):
        check_args("data", ModularAdditionDataModule.__init__, locals())
        if not is_prime(p) or p == 2:
            raise ConfigError("data.p", "an odd prime", p)
        total = p ** k
        if total > 1 << 62:
            raise ConfigError("data.k", f"at most {int(62 / math.log2(p))} for p = {p} (p^k tuples indexed in int64)",
                              k)
        n_train = min(max(round(train_fraction * total), 1), total - 1)
        if batch_size is not None and batch_size > n_train:
            raise ConfigError("data.batch_size", f"at most the training split's {n_train} tuples", batch_size)
        held_out = total - n_train
        super().__init__(seed=seed, mode="fixed", batch_size=batch_size, num_train=n_train, num_val=held_out,
                         num_test=held_out, shuffle=shuffle)
        self.k, self.p, self.total = k, p, total

    @property
    def features(self) -> torch.Tensor:
        return fourier_modes(self.p)

    def tuple_index(self, index: torch.Tensor, split: str) -> torch.Tensor:
        """The enumeration indices (``[0, p^k)``) of a split's samples ``index``."""
        offset = 0 if split == "train" else self.sizes["train"]
        return rng.index_permutation(self.seed, _SPLIT_STREAM, index.to(torch.int64) + offset, self.total)

    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        a = decode(self.tuple_index(index, split), self.k, self.p)
        return {"a": a, "y": a.sum(1) % self.p}

    def batch(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        # decoded on the fly: cheaper than caching p^k / 2 tuples (1.5e8 at k = 6, p = 23)
        return {**self.sample(index, split), "index": index}

    def _whole(self, split: str, served_as: str) -> DataLoader:
        """Every sample of ``split`` once, in order, in batches of ``batch_size``: under DDP each rank reads its own
        contiguous range (:class:`RankRange`), none padded, so sums over ranks count every tuple exactly once."""
        n = self.sizes[split]
        _, rank, world = self._world()
        return DataLoader(_Indices(n), batch_size=self.batch_size or n, sampler=RankRange(n, rank, world),
                          collate_fn=partial(_collate, split=served_as), num_workers=0)

    def val_dataloader(self) -> list[DataLoader]:
        """The held-out split, then the whole training split in order (a full-split training accuracy and the
        margin over every tuple), both in batches of ``batch_size``, each rank its own range."""
        return [self._whole("val", "val"), self._whole("train", "train_full")]

    def test_dataloader(self) -> DataLoader:
        return self._whole("test", "test")

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if isinstance(batch, dict) and batch.get("split") == "train_full":  # in order, not a training batch
            return self.batch(batch["index"], "train")
        return super().on_after_batch_transfer(batch, dataloader_idx)
