"""Base DataModule for synthetic distributions whose samples are pure functions of (seed, split, index).

Dataloaders only carry sample indices; the samples themselves are generated after the batch reaches
the model's device (``on_after_batch_transfer``), so generation costs no CPU time on a GPU run and the
same seed gives the same samples whatever the batch size, worker count or device count.

Two modes:
* ``fixed``: ``num_train`` samples drawn once (the theory's full-batch setting), cached on device;
  ``batch_size=None`` means full batch: one step per epoch.
* ``online``: fresh training samples every step: step ``t`` on rank ``r`` of ``W`` uses indices
  ``(t W + r) B + [0, B)``. Validation and test stay fixed.

Training indices depend only on (seed, global step, rank): a resumed run continues exactly, and the
same global batch (``batch_size`` x devices) gives the same samples on any number of devices.

The validation and test splits are generated once per process for each distribution (class and data
arguments) and device, and shared by every DataModule that asks for them: the runs of one experiment
(pretraining, fine-tuning, supervised baselines, a grid) evaluate on the same tensors.

Subclasses implement :meth:`sample` and :attr:`features`.

Example:
    >>> class Gauss(SyntheticDataModule):
    ...     features = torch.eye(3)
    ...     def sample(self, index, split):
    ...         return {"x": rng.normal(self.seed, self.stream(split), index, (3,))}
    >>> dm = Gauss(num_train=8, batch_size=4)
    >>> dm.full("train")["x"].shape
    torch.Size([8, 3])
"""
from collections import OrderedDict
from functools import partial
from typing import Literal

import lightning as L
import torch
from lightning.fabric.utilities.data import AttributeDict
from torch.utils.data import DataLoader, Dataset

from featlearn.datamodules import rng
from featlearn.errors import ConfigError
from featlearn.validation import PositiveInt, check_args, check_memory, format_bytes

GEN_BYTES = 20
"""Peak bytes of temporaries per generated value: the counter-based generator holds int32 words and
float32 Box-Muller terms behind every float it returns (measured 16.4 bytes on CPU, output included)."""

SPLITS = ("train", "val", "test")

_LOADER_ONLY = frozenset({"mode", "batch_size", "num_train", "num_val", "num_test", "steps_per_epoch", "shuffle"})
"""Data arguments that choose how samples are served, not what a validation or test sample is."""

_SHARED_EVAL_SPLITS: "OrderedDict[tuple, dict]" = OrderedDict()
_SHARED_EVAL_LIMIT = 4  # distributions kept per process (least recently used dropped first)


def matmul_per_seed(x: torch.Tensor, weights: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """``x @ weights`` for one seed; for a list of weights, one per seed of ``x``'s leading axis, ``x[s] @
    weights[s]`` seed by seed, stacked: each seed's product as it computes it alone, bit for bit, given the
    seeds' own weight tensors. Each ``x[s]`` is copied first: BLAS picks its kernels by layout and by address
    alignment, and a seed's own operand is a fresh (aligned) tensor while a row of the stack sits at any
    offset; a batched product, or a copy of the weights in another layout, may round differently too.

    Example:
        >>> x, w = torch.randn(3, 5, 9), [torch.randn(2, 9).t() for _ in range(3)]
        >>> alone = torch.randn(5, 9)
        >>> x[1] = alone
        >>> bool(torch.equal(matmul_per_seed(x, w)[1], matmul_per_seed(alone, w[1])))
        True
    """
    if torch.is_tensor(weights):
        return x @ weights
    return torch.stack([a.clone() @ w for a, w in zip(x, weights)])


class _Indices(Dataset):
    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> int:
        return i

    def __getitems__(self, indices: list[int]) -> list[int]:
        # the DataLoader's batched fetch: one call per batch instead of one per sample (0.24 -> 0.15 ms at 2048)
        return indices


def _collate(items: list[int], split: str) -> dict:
    return {"index": torch.tensor(items, dtype=torch.int64), "split": split}


class SyntheticDataModule(L.LightningDataModule):
    """Shared plumbing for every synthetic distribution; see the module docstring.

    Args:
        seed: seed of the whole distribution (features and samples).
        mode: ``fixed`` (N samples, full-batch theory) or ``online`` (fresh samples every step).
        batch_size: samples per step and per device; ``None`` = the whole fixed split.
        num_train, num_val, num_test: sizes of the fixed splits (``num_train`` unused online).
        steps_per_epoch: training steps per epoch in online mode.
        shuffle: reshuffle fixed training minibatches every epoch (order is a function of seed, epoch).
    """

    train_field = "data.num_train"  # the config field that sizes the training split (named in refusals)
    train_only_args: tuple[str, ...] = ()  # a subclass's arguments that never change a val / test sample

    def __init__(
        self,
        seed: int = 0,
        mode: Literal["fixed", "online"] = "fixed",
        batch_size: PositiveInt | None = None,
        num_train: PositiveInt = 1000,
        num_val: PositiveInt = 1000,
        num_test: PositiveInt = 1000,
        steps_per_epoch: PositiveInt = 100,
        shuffle: bool = True,
    ):
        check_args("data", SyntheticDataModule.__init__, locals())
        super().__init__()
        if mode == "online" and batch_size is None:
            raise ConfigError("data.batch_size", "a positive integer in online mode", batch_size)
        if mode == "fixed" and batch_size is not None and batch_size > num_train:
            raise ConfigError("data.batch_size", f"at most the training split's {num_train} samples", batch_size)
        self.seed, self.mode, self.batch_size, self.shuffle = seed, mode, batch_size, shuffle
        self.sizes = {"train": num_train, "val": num_val, "test": num_test}
        self.steps_per_epoch = steps_per_epoch
        self._cache: dict[tuple[str, str], dict] = {}
        self.save_hyperparameters()  # every subclass's arguments too: they reach TensorBoard's HPARAMS tab

    @property
    def hparams_initial(self):
        """The data's arguments as ``data.<name>``, so that they sit beside the model's in the HPARAMS tab
        without clashing with model arguments of the same name (``rho``, ``seed``)."""
        return AttributeDict({f"data.{k}": v for k, v in super().hparams_initial.items() if not k.startswith("_")})

    def check_memory(self, sizes: dict, train_values: float, eval_values: float, out_bytes: int,
                     consts: float = 0, gen_bytes: float = GEN_BYTES) -> None:
        """Refuse, before allocating anything, sizes whose data cannot fit in the free memory of the
        device that will generate it (see :func:`featlearn.validation.check_memory`). Call it at the end
        of a subclass's ``__init__``.

        The estimate adds the constants (``consts`` bytes), the cached fixed splits (val, test, and train
        in fixed mode), one training batch, and the generator's temporaries while the largest split or
        batch is drawn (``gen_bytes`` per value). ``train_values`` / ``eval_values`` are the values per
        training / evaluation sample, ``out_bytes`` the size of one. The field named is the one of
        ``sizes`` (the subclass's own size fields: value) or of the split sizes that grew most over its
        default.
        """
        mode, batch_size = self.mode, self.batch_size
        num_train, num_val, num_test = self.sizes["train"], self.sizes["val"], self.sizes["test"]
        sizes = {"num_train": num_train, "num_val": num_val, "num_test": num_test, "batch_size": batch_size or 0,
                 **sizes}
        train_rows = num_train if mode == "fixed" else 0
        cached = ((num_val + num_test) * eval_values + train_rows * train_values) * out_bytes
        batch = (batch_size or num_train) * train_values * out_bytes
        largest = max(num_val * eval_values, num_test * eval_values,
                      (num_train if mode == "fixed" else batch_size or num_train) * train_values)
        temporaries = largest * gen_bytes
        needed = consts + cached + batch + temporaries
        what = (f"the data (constants {format_bytes(consts)}, cached splits {format_bytes(cached)}, one batch "
                f"{format_bytes(batch)}, generation temporaries {format_bytes(temporaries)})")
        check_memory("data", type(self), sizes, needed, what)

    # --- to implement -------------------------------------------------------------------------
    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """The samples with these indices, generated on ``index.device``."""
        raise NotImplementedError

    @property
    def features(self) -> torch.Tensor:
        """Ground-truth feature directions, one per row ``[F, d]``."""
        raise NotImplementedError

    # --- shared -------------------------------------------------------------------------------
    @staticmethod
    def stream(split: str, quantity: int = 0) -> int:
        """RNG stream id for one random quantity of one split (so splits never share numbers)."""
        return 1000 * (SPLITS.index(split) + 1) + quantity

    def full(self, split: str, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The whole fixed split on ``device`` (cached); ``index`` holds the sample indices.

        Validation and test splits come from a per-process cache shared with every DataModule of the
        same class and data arguments (the sizes of other splits and the loader settings aside).
        """
        key = (split, str(torch.device(device)))
        if key not in self._cache:
            shared = self._shared_key(split, key[1]) if split != "train" else None
            if shared in _SHARED_EVAL_SPLITS:
                _SHARED_EVAL_SPLITS.move_to_end(shared)
                self._cache[key] = _SHARED_EVAL_SPLITS[shared]
            else:
                index = torch.arange(self.sizes[split], device=device)
                self._cache[key] = {**self.sample(index, split), "index": index}
                if shared is not None:
                    _SHARED_EVAL_SPLITS[shared] = self._cache[key]
                    while len(_SHARED_EVAL_SPLITS) > _SHARED_EVAL_LIMIT:
                        _SHARED_EVAL_SPLITS.popitem(last=False)
        return self._cache[key]

    def _shared_key(self, split: str, device: str) -> tuple:
        skip = _LOADER_ONLY | set(self.train_only_args)
        args = sorted((k, repr(v)) for k, v in super().hparams_initial.items() if k not in skip)
        return type(self).__module__, type(self).__qualname__, split, self.sizes[split], device, tuple(args)

    def batch(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """Samples for these indices: fixed splits are read from the device cache, online ones drawn.

        A batch holding a whole fixed split (indices in order) is the cache itself, not a copy.
        """
        if split == "train" and self.mode == "online":
            return {**self.sample(index, split), "index": index}
        data = self.full(split, index.device)
        if len(index) == self.sizes[split]:
            return dict(data)
        return {k: v[index] for k, v in data.items()}

    def sample_seeds(self, members: list, index: torch.Tensor, split: str) -> dict[str, torch.Tensor] | None:
        """The online samples of several DataModules of this class and arguments but their seeds (``members``,
        this one among them) in one call: each tensor ``[S, ...]``, row ``s`` what ``members[s].sample(index,
        split)`` gives (the samplers of :mod:`~featlearn.datamodules.rng` take a tensor of seeds), for a class
        whose :meth:`batch` adds nothing to an online sample but its ``index``. None (the default): the stack
        draws member by member (:class:`~featlearn.datamodules.seeds.SeedStackDataModule`)."""
        return None

    def seeds_of(self, members: list, device) -> torch.Tensor:
        """The members' seeds as a tensor on ``device``, made once (a copy to a GPU every step would wait)."""
        key = (tuple(m.seed for m in members), str(device))
        if getattr(self, "_seeds_of", (None,))[0] != key:
            self._seeds_of = (key, torch.tensor(key[0], device=device))
        return self._seeds_of[1]

    def _world(self) -> tuple[int, int, int]:
        """(global step, rank, world size) of the attached trainer, or of a single process without one."""
        trainer = self.trainer
        if trainer is None:
            return 0, 0, 1
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError("trainer.accumulate_grad_batches", "1 (sample streams follow the optimizer step; "
                              "raise data.batch_size instead)", trainer.accumulate_grad_batches)
        return trainer.global_step, trainer.global_rank, trainer.world_size

    def check_devices(self, world_size: int) -> None:
        """Refuse, before fitting, a fixed training split that cannot be shared by ``world_size`` devices
        (the same checks the dataloaders make once fitting has started)."""
        if self.mode != "fixed":
            return
        if self.batch_size is None and self.sizes["train"] % world_size:
            raise ConfigError(self.train_field, f"a multiple of the device count {world_size} in full-batch mode",
                              self.sizes["train"])
        if self.batch_size is not None:
            self._steps_per_data_epoch(world_size)

    def _steps_per_data_epoch(self, world_size: int) -> int:
        global_batch = self.batch_size * world_size
        steps = self.sizes["train"] // global_batch
        if steps < 1:
            raise ConfigError("data.batch_size", f"at most {self.train_field[5:]} / devices = "
                                                 f"{self.sizes['train'] // world_size}",
                              self.batch_size)
        return steps

    def _loader(self, split: str) -> DataLoader:
        if split == "train" and self.batch_size is not None:
            world = self._world()[2]
            steps = self.steps_per_epoch if self.mode == "online" else self._steps_per_data_epoch(world)
            length = steps * self.batch_size * world
        else:
            length = self.sizes[split]
        return DataLoader(_Indices(length), batch_size=self.batch_size or length, shuffle=False,
                          collate_fn=partial(_collate, split=split), num_workers=0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if not (isinstance(batch, dict) and "split" in batch and "index" in batch):
            return batch
        split, index = batch["split"], batch["index"]
        if split == "train":
            index = self._train_index(index)
            if not getattr(getattr(self.trainer, "lightning_module", None), "samples_needed", True):  # a population loss: the step reads no samples
                return {"index": index}
        with torch.profiler.record_function("featlearn.data"):  # a phase of `featlearn profile`'s trace
            return self.batch(index, split)

    def _train_index(self, local: torch.Tensor) -> torch.Tensor:
        """Sample indices of this rank's training batch, a function of (global step, rank) only.

        Lightning's epoch and batch counters are ignored on purpose: a run resumed from any
        checkpoint, or run on another number of devices with the same global batch, sees exactly
        the same samples at every step.
        """
        step, rank, world = self._world()
        n_local, device = len(local), local.device
        if self.mode == "online":
            return (step * world + rank) * n_local + torch.arange(n_local, device=device)
        n = self.sizes["train"]
        if self.batch_size is None:
            if n % world:  # unequal shares would make DDP's average differ from the full-batch mean
                raise ConfigError(self.train_field, f"a multiple of the device count {world} in full-batch mode", n)
            return torch.arange(rank, n, world, device=device)
        return self._minibatch_index(local, step, rank, world)

    def _epoch_order(self, epoch: int, n: int, device) -> torch.Tensor:
        """The shuffled order of ``epoch``, kept until the epoch changes: drawing and sorting n keys every step
        cost a third of a two-layer stage-3 step at n = 50,000."""
        key = (self.seed, epoch, n, str(device))
        cached = getattr(self, "_order_cache", None)
        if cached is None or cached[0] != key:
            order = rng.permutation(self.seed, 999, torch.tensor([epoch], device=device), n)[0]
            self._order_cache = cached = (key, order)
        return cached[1]

    def _minibatch_index(self, local: torch.Tensor, step: int, rank: int, world: int) -> torch.Tensor:
        """Fixed-mode minibatch ``step`` of rank ``rank``: epochs of the training split, reshuffled per epoch
        (a function of seed and epoch) when ``shuffle``."""
        n, device = self.sizes["train"], local.device
        epoch, position = divmod(step, self._steps_per_data_epoch(world))
        if self.shuffle and self.batch_size < n:
            order = self._epoch_order(epoch, n, device)
        else:
            order = torch.arange(n, device=device)
        start = (position * world + rank) * self.batch_size
        return order[start:start + self.batch_size]
