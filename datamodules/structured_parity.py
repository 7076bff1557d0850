"""The F_Xi family of Shi 2024, Sec. 2.3 (Shi, Wei & Liang 2022), with the settings of App. A.7: inputs built
from a dictionary of orthonormal patterns, labels from the class-relevant patterns only.

* ``M [d, D]`` with orthonormal columns (the Q factor of a Gaussian matrix, a function of the seed);
  ``A``, a random set of ``k`` of the ``D`` patterns (the class-relevant ones).
* A hidden vector ``phi in {0,1}^D``, ``x~ = M phi``, and ``x = (x~ - E x~) / sigma~`` with the *analytic*
  population mean and ``sigma~^2 = sum_j Var(phi_j)`` (:func:`featlearn.theory.two_layer.data_constants`).
* ``labeling``:

  - ``"parity"`` (the main setting, d = 500, D = 100, k = 5 odd, p_o = 1/2): ``y = +1`` iff
    ``S = sum_{j in A} phi_j`` is odd, with ``phi ~ D_mix = p_o D^(0) + (1 - p_o) D^(1)``: ``D^(0)`` is
    uniform, ``D^(1)`` has ``phi_A`` all zeros or all ones and background ``Bern(p_o / (2 - 2 p_o))``;
  - ``"interval"`` (d = 500, D = 100, k = 30): ``y = +1`` iff ``interval_low <= S <= interval_high``, with
    ``phi_A ~ Bern(relevant_prob)`` and background ``Bern(p_o)``;
  - ``"hypercube_mog"`` (App. A.7.3): ``x~ = sum_{i <= k} eps_i M_i + g``, ``g ~ N(0, mog_noise^2 (k/d) I)``,
    ``y = prod eps_i`` (2^k Gaussian clusters; D = k).

* ``structure=False``: the control F_Xi0, every ``phi_j ~ Bern(1/2)`` with the same labelling.
* ``neg_fraction``: class imbalance ``Pr[y = -1]`` (App. A.7.2), made by drawing the label first and then
  the hidden vector from its class (the same as sub-sampling a class; the paper does not say how).

Every sample is a pure function of (seed, split, index): the component and ``S`` come from one uniform
through the table ``P(c, S)``, ``phi_A`` is a uniformly random ``S``-subset of ``A`` (a random
permutation of ``A``), the background one Bernoulli draw per pattern. ``sample`` returns::

    x  [B, d]  normalised input (float32 or float64)
    y  [B]     label +-1 (dtype of x)
    s  [B]     int64, S = number of active relevant patterns
    c  [B]     int64, mixture component (parity with structure: 0 = D^(0), 1 = D^(1))

The model asks for full-batch steps with :meth:`StructuredParityDataModule.use_full_batch_steps`
(the schedule's steps 1-2 take the whole training split, later ones ``batch_size`` minibatches).

Example:
    >>> dm = StructuredParityDataModule(dim=40, num_patterns=20, k=3, num_train=64, batch_size=16)
    >>> b = dm.sample(torch.arange(6), "train")
    >>> b["x"].shape, bool(((b["s"] % 2 == 1) == (b["y"] > 0)).all())
    (torch.Size([6, 40]), True)
    >>> dm.features.shape, round(dm.constants["gamma"], 4), dm.constants["sigma2"]
    (torch.Size([3, 40]), 0.25, 5.0)
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from featlearn.datamodules import rng
from featlearn.datamodules.base import GEN_BYTES, SyntheticDataModule
from featlearn.errors import ConfigError
from featlearn.theory.two_layer import data_constants
from featlearn.validation import (LeftOpenUnitInterval, NonNegativeFloat, NonNegativeInt, OpenUnitInterval,
                                  PositiveInt, check_args)

_DTYPES = {"float32": torch.float32, "float64": torch.float64}

# RNG quantities (added to the split's stream id)
_Q_TABLE, _Q_SUBSET, _Q_BACKGROUND, _Q_NOISE = range(4)
_DICT_STREAM, _SUBSET_STREAM = 303, 304
_INIT_STREAM = 405  # model initialisation, apart from every sample and dictionary stream


class StructuredParityDataModule(SyntheticDataModule):
    """The F_Xi data family of Shi 2024, Sec. 2.3 (module docstring).

    Args:
        dim: d, input dimension (>= num_patterns).
        num_patterns: D, dictionary size (>= k; = k for hypercube_mog).
        k: |A|, number of class-relevant patterns (odd for parity).
        p_o: background probability of the patterns outside A, in (0, 1/2].
        labeling: ``"parity"``, ``"interval"`` or ``"hypercube_mog"``.
        structure: False = the no-structure control F_Xi0 (every phi_j ~ Bern(1/2)).
        interval_low, interval_high: the interval labelling's ``[low, high]`` (within [0, k]).
        relevant_prob: ``Pr[phi_j = 1]`` on A for the interval labelling.
        neg_fraction: ``Pr[y = -1]``; None = the distribution's own (1/2 for parity).
        mog_noise: sigma_r of hypercube_mog.
        normalize: ``"analytic"`` (population mean and sigma~) or ``"none"`` (x = x~).
        dtype: ``"float32"`` (default) or ``"float64"``.
        seed, mode, batch_size, num_train, num_val, num_test, steps_per_epoch, shuffle: see the base class
            (defaults: the paper's n = 50,000, minibatches of 1,000, fresh 10,000-sample val and test sets).
    """

    def __init__(
        self,
        dim: PositiveInt = 500,
        num_patterns: PositiveInt = 100,
        k: PositiveInt = 5,
        p_o: LeftOpenUnitInterval = 0.5,
        labeling: Literal["parity", "interval", "hypercube_mog"] = "parity",
        structure: bool = True,
        interval_low: NonNegativeInt = 20,
        interval_high: NonNegativeInt = 30,
        relevant_prob: OpenUnitInterval = 2 / 3,
        neg_fraction: OpenUnitInterval | None = None,
        mog_noise: NonNegativeFloat = 1.0,
        normalize: Literal["analytic", "none"] = "analytic",
        dtype: Literal["float32", "float64"] = "float32",
        # SyntheticDataModule's arguments whose defaults differ here; the others pass through **synthetic
        batch_size: PositiveInt | None = 1000, num_train: PositiveInt = 50000, num_val: PositiveInt = 10000,
        num_test: PositiveInt = 10000, **synthetic,
    ):
        check_args("data", StructuredParityDataModule.__init__, locals())
        if p_o > 0.5:
            raise ConfigError("data.p_o", "in (0, 1/2] (assumption A2)", p_o)
        if k > num_patterns:
            raise ConfigError("data.k", f"an integer <= num_patterns = {num_patterns}", k)
        if dim < num_patterns:
            raise ConfigError("data.dim", f"an integer >= num_patterns = {num_patterns} (orthonormal patterns)", dim)
        if labeling == "parity" and k % 2 == 0:
            raise ConfigError("data.k", "odd for the parity labelling (the all-ones pattern must be class +1)", k)
        if labeling == "hypercube_mog" and num_patterns != k:
            raise ConfigError("data.num_patterns", f"equal to k = {k} for hypercube_mog (one centre direction "
                                                   f"per eps_i)", num_patterns)
        if labeling == "interval" and not interval_low <= interval_high <= k:
            field = "data.interval_high" if interval_high > k else "data.interval_low"
            raise ConfigError(field, f"0 <= interval_low <= interval_high <= k = {k}",
                              interval_high if interval_high > k else interval_low)
        const = data_constants(labeling, k, num_patterns, p_o, structure, relevant_prob, interval_low,
                               interval_high, None, mog_noise, dim)
        if not 0 < const["prob_pos"] < 1:
            raise ConfigError("data.interval_low" if labeling == "interval" else "data.labeling",
                              "a labelling under which both classes have positive probability",
                              interval_low if labeling == "interval" else labeling)
        super().__init__(batch_size=batch_size, num_train=num_train, num_val=num_val, num_test=num_test, **synthetic)
        item = _DTYPES[dtype].itemsize
        # x and y per sample; generation holds the D uniforms, the centred phi and x
        self.check_memory({"dim": dim, "num_patterns": num_patterns}, train_values=dim + 1, eval_values=dim + 1,
                          out_bytes=item, consts=8 * dim * num_patterns,
                          gen_bytes=GEN_BYTES + item * (1 + num_patterns / dim))
        self.dim, self.num_patterns, self.k, self.p_o = dim, num_patterns, k, float(p_o)
        self.labeling, self.structure = labeling, bool(structure)
        self.interval = (interval_low, interval_high)
        self.relevant_prob, self.mog_noise = float(relevant_prob), float(mog_noise)
        self.neg_fraction = None if neg_fraction is None else float(neg_fraction)
        self.normalize, self.dtype = normalize, _DTYPES[dtype]
        self.constants = data_constants(labeling, k, num_patterns, p_o, structure, relevant_prob, interval_low,
                                        interval_high, self.neg_fraction, mog_noise, dim)
        self.full_batch_steps = 0
        self._dictionary, self._relevant = self._make_dictionary()

    # --- ground truth ---------------------------------------------------------------------------
    def _make_dictionary(self) -> tuple[torch.Tensor, torch.Tensor]:
        q = rng.global_orthonormal(self.seed, _DICT_STREAM, self.dim, self.num_patterns)
        if self.labeling == "hypercube_mog":
            relevant = torch.arange(self.k)
        else:
            perm = rng.permutation(self.seed, _SUBSET_STREAM, torch.zeros((), dtype=torch.int64), self.num_patterns)
            relevant = perm[: self.k].sort().values
        return q, relevant

    @property
    def dictionary(self) -> torch.Tensor:
        """``M [d, D]`` float64, orthonormal columns."""
        return self._dictionary

    @property
    def relevant(self) -> torch.Tensor:
        """The indices ``A`` of the class-relevant patterns (sorted, int64)."""
        return self._relevant

    @property
    def features(self) -> torch.Tensor:
        """``[k, d]``: the relevant patterns ``M_j, j in A``, one per row."""
        return self._dictionary[:, self._relevant].T.contiguous().to(self.dtype)

    @property
    def target_direction(self) -> torch.Tensor:
        """``sum_{j in A} M_j`` ``[d]`` (float64): the direction CosSim is measured against."""
        return self._dictionary[:, self._relevant].sum(1)

    @property
    def centres(self) -> torch.Tensor | None:
        """hypercube_mog: the ``2^k`` cluster centres ``sum_i eps_i M_i`` ``[2^k, d]`` (float64, row ``r`` has
        ``eps_i = +1`` where bit ``i`` of ``r`` is set); None for the other labellings.

        Example:
            >>> dm = StructuredParityDataModule(dim=6, num_patterns=2, k=2, labeling="hypercube_mog")
            >>> dm.centres.shape, round(float(dm.centres[3] @ dm.centres[0]), 9)
            (torch.Size([4, 6]), -2.0)
        """
        if self.labeling != "hypercube_mog":
            return None
        bits = (torch.arange(2 ** self.k)[:, None] >> torch.arange(self.k)) & 1
        return (2 * bits.double() - 1) @ self._dictionary.T

    @property
    def sigma_tilde(self) -> float:
        return math.sqrt(self.constants["sigma2"])

    def initial_normals(self, shape: tuple[int, ...], seed: int | None = None, stream: int = 0) -> torch.Tensor:
        """Standard normal float64 draws for a model's initialisation, a pure function of (``seed``,
        default the data seed; ``stream``, shape) on streams apart from every sample.

        Example:
            >>> dm = StructuredParityDataModule(dim=8, num_patterns=4, k=3, num_train=8, batch_size=4)
            >>> torch.equal(dm.initial_normals((2, 3)), dm.initial_normals((2, 3), seed=0))
            True
        """
        return rng.global_normal(self.seed if seed is None else seed, _INIT_STREAM + 1000 * stream, shape,
                                 dtype=torch.float64)

    def use_full_batch_steps(self, steps: int) -> None:
        """The first ``steps`` training steps take the whole training split (full-batch GD), the later
        ones ``batch_size`` minibatches (their order continues as if the full-batch steps had not been)."""
        if steps and self.mode != "fixed":
            raise ConfigError("data.mode", "'fixed' when the model takes full-batch steps", self.mode)
        self.full_batch_steps = int(steps)

    def _train_index(self, local: torch.Tensor) -> torch.Tensor:
        step, rank, world = self._world()
        if step < self.full_batch_steps:
            n = self.sizes["train"]
            if n % world:
                raise ConfigError(self.train_field, f"a multiple of the device count {world} in full-batch steps", n)
            return torch.arange(rank, n, world, device=local.device)
        if self.trainer is None or not self.full_batch_steps:
            return super()._train_index(local)
        # the minibatch schedule of the base class, counted from the first minibatch step
        return self._minibatch_index(local, step - self.full_batch_steps, rank, world)

    # --- sampling -------------------------------------------------------------------------------
    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        table = torch.tensor(self.constants["table"], dtype=torch.float64, device=device)
        return table, torch.tensor(self.constants["background"], dtype=torch.float64, device=device), \
            torch.tensor(self.constants["labels"], dtype=torch.int64, device=device)

    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        dev, B = index.device, index.shape[0]
        k, D, st = self.k, self.num_patterns, self.stream(split)
        table, background, labels = self._tables(dev)
        C = table.shape[0]
        # (component, S) by the inverse CDF of the flattened table P(c, S): one uniform per sample
        cdf = table.reshape(-1).cumsum(0)
        u = rng.uniform(self.seed, st + _Q_TABLE, index, (), torch.float64) * cdf[-1]
        cell = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1).clamp_max(C * (k + 1) - 1)
        c, s = cell // (k + 1), cell % (k + 1)
        # phi_A: the first S of a random order of A (a uniformly random S-subset)
        order = rng.permutation(self.seed, st + _Q_SUBSET, index, k)
        phi_a = torch.argsort(order, dim=-1) < s[:, None]
        m = self._dictionary.to(device=dev, dtype=self.dtype)
        relevant = self._relevant.to(dev)
        if self.labeling == "hypercube_mog":
            x = (2 * phi_a.to(self.dtype) - 1) @ m.T
            noise_std = self.mog_noise * math.sqrt(k / self.dim)
            x = x + rng.normal(self.seed, st + _Q_NOISE, index, (self.dim,), self.dtype) * noise_std
        else:
            phi = rng.uniform(self.seed, st + _Q_BACKGROUND, index, (D,), torch.float64) < background[c][:, None]
            phi[:, relevant] = phi_a
            mean = torch.full((D,), self.constants["mean_bg"], dtype=self.dtype, device=dev)
            mean[relevant] = self.constants["mean_A"]
            centred = phi.to(self.dtype) - mean if self.normalize == "analytic" else phi.to(self.dtype)
            x = centred @ m.T
        if self.normalize == "analytic":
            x = x / self.sigma_tilde
        y = labels[s].to(self.dtype)
        return {"x": x, "y": y, "s": s, "c": c}
