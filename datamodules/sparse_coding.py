"""Sparse-coding data ``x = M z + xi`` with RandomMask views (Wen & Li 2021, Def. 2.1, 2.3).

* ``M`` (``d1 x d``): orthonormal dictionary. ``dictionary="random"`` (default) is the Q factor of a
  Gaussian matrix, hence delocalised (``||M_j||_inf ~ sqrt(2 log(d1 d)/d1)``); ``"coordinate"`` uses
  ``d`` distinct standard basis vectors (a negative control: RandomMask then removes
  all view cross-covariance and nothing is learned).
* ``z`` in ``{-1,0,1}^d`` i.i.d.: ``Pr(z_j = +-1) = p/2`` with ``p = C_z log log d / d``.
* ``xi ~ N(0, sigma_xi^2 I)`` with ``sigma_xi^2 = C_xi sqrt(log d)/d``.
* labels (Wen & Li 2021, Def. 3.1): ``y_reg = <w*, z>``, ``y_cls = sign(y_reg)`` (0 when ``<w*,z> = 0``: probes drop
  those), ``w*_j = s_j u_j`` with random signs and ``u_j ~ U[0.5, 1.5]`` (the paper: ``|w*_j| = Theta(1)``).

**Augmentation lives here, in** :meth:`SparseCodingDataModule.sample` (decision for issue 3): the mask
``D`` of training sample ``i`` is drawn from its own RNG stream as a function of ``(seed, i)``, so a
sample and its two views are identical whatever the batch size or device. Training batches contain

* ``x_a = 2 D x`` (anchor, receives gradient) and ``x_q = 2 (I - D) x`` (positive key), or
  ``x_a = x_q = x`` when ``augment="none"``; general mask probability ``q``: ``D/q`` and ``(I-D)/(1-q)``;
* ``x_neg``: the pool of negatives, fresh population samples, **not** augmented unless
  ``augment_negatives=True`` (then one masked view ``D' x_n / q``). ``negatives="shared"`` gives one pool
  ``[N, d1]`` for the whole *global* batch (all devices): each anchor index owns
  ``r = ceil(N / global batch)`` negatives (a pure function of (seed, index)) and the pool is the first
  ``N`` of them taken anchor by anchor in increasing sample index (:func:`pool_negatives`). On several
  devices a batch keeps its anchors' own negatives ``[B, r, d1]`` and sets ``neg_pool_size = N``: the
  model pools their representations after gathering them from every device, so every step is the
  one-device step on the same global batch. ``"per_anchor"`` gives every anchor its own ``N``
  negatives ``[B, N, d1]`` (the paper-exact estimator; memory ``B N d1``, tiny sizes only).

Validation/test batches hold ``x, z, xi, y_reg, y_cls`` only (used by the probes and metrics). The test stage
reads the validation split, then the test split (:meth:`SparseCodingDataModule.test_dataloader`): the probes
are fitted on the first and scored on the second.

Example:
    >>> dm = SparseCodingDataModule(d=16, d1=64, batch_size=8, num_negatives=8)
    >>> b = dm.sample(torch.arange(8), "train")
    >>> bool(torch.allclose(b["x_a"] + b["x_q"], 2 * b["x"]))
    True
    >>> dm.features.shape  # one atom per row
    torch.Size([16, 64])
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from featlearn.datamodules import rng
from featlearn.datamodules.base import SyntheticDataModule, matmul_per_seed
from featlearn.errors import ConfigError
from featlearn.validation import (LeftOpenUnitInterval, NonNegativeFloat, OpenUnitInterval, PositiveFloat, PositiveInt,
                                  check_args, int_at_least)

# per-split quantities (RNG streams via SyntheticDataModule.stream(split, q))
_Q_SUPPORT, _Q_SIGN, _Q_NOISE, _Q_MASK = 1, 2, 3, 4
_Q_NEG_SUPPORT, _Q_NEG_SIGN, _Q_NEG_NOISE, _Q_NEG_MASK = 5, 6, 7, 8
# global quantities (not per sample)
_G_DICT, _G_COORD, _G_WSTAR_SIGN, _G_WSTAR_MAG = 11, 12, 13, 14


def _masked(x: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.where(mask, x / q, 0.0)`` in vectorised arithmetic (``torch.where`` is a scalar loop on CPU, ~5x
    slower): ``+ 0.0`` turns the -0.0 of a negative x times 0 into where's 0.0 (only an x of -0.0 itself, which the
    noise never gives, would differ in sign)."""
    return x.div(q).mul_(mask).add_(0.0)


def views_alike(batch: dict) -> bool:
    """Whether a training batch's positive views are its anchors (``augment="none"``: the same storage)."""
    xa, xq = batch["x_a"], batch["x_q"]
    return xq is xa or xq.data_ptr() == xa.data_ptr()


def pool_negatives(owned: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """The shared pool: the first ``size`` of the anchors' own negatives ``owned [K, r, ...]``, taken
    anchor by anchor in increasing sample ``index [K]``; works on inputs and on representations alike.

    Ordering by sample index rather than by batch position makes the pool a function of the set of
    anchors in the global batch only, so the rows gathered from any split of it over devices give
    exactly the pool one device builds.

    Example:
        >>> owned = torch.arange(12.0).reshape(4, 3, 1)            # anchor k owns 3k, 3k+1, 3k+2
        >>> pool_negatives(owned, torch.tensor([7, 2, 9, 5]), 5).flatten().tolist()
        [3.0, 4.0, 5.0, 9.0, 10.0]
    """
    r = owned.shape[1]
    first = torch.argsort(index)[: math.ceil(size / r)]
    return owned[first].flatten(0, 1)[:size]


class SparseCodingDataModule(SyntheticDataModule):
    """Sparse-coding distribution with RandomMask views; see the module docstring.

    Args:
        d: number of dictionary atoms (latent features). d1: input dimension (``> d``).
        C_z, C_xi: constants of ``p = C_z log log d / d`` and ``sigma_xi^2 = C_xi sqrt(log d)/d``.
        p, sigma_xi: override the two formulas (``None`` = use them).
        dictionary: ``"random"`` (delocalised orthonormal) or ``"coordinate"`` (negative control).
        augment: ``"random_mask"`` or ``"none"``. mask_prob: ``q = Pr(D_ll = 1)`` (paper: 1/2).
        augment_negatives: mask the negatives too (ablation; default False as in the paper).
        num_negatives: ``N``, negatives per anchor (size of the shared pool).
        negatives: ``"shared"`` pool or ``"per_anchor"`` (paper-exact) negatives.
        seed, mode, batch_size, num_train, num_val, num_test, steps_per_epoch, shuffle: see
            :class:`~featlearn.datamodules.base.SyntheticDataModule` (``batch_size`` = K anchors/step).
    """

    pool_negatives = staticmethod(pool_negatives)
    """How a model pools the representations of the anchors' own negatives it gathered from every device
    (batches with ``neg_pool_size``): :func:`pool_negatives`."""

    def __init__(
        self,
        d: int_at_least(3) = 32,  # log log d must be > 0
        d1: PositiveInt = 256,
        C_z: PositiveFloat = 1.0,
        C_xi: NonNegativeFloat = 1.0,
        p: LeftOpenUnitInterval | None = None,
        sigma_xi: NonNegativeFloat | None = None,
        dictionary: Literal["random", "coordinate"] = "random",
        augment: Literal["random_mask", "none"] = "random_mask",
        mask_prob: OpenUnitInterval = 0.5,
        augment_negatives: bool = False,
        num_negatives: PositiveInt = 256,
        negatives: Literal["shared", "per_anchor"] = "shared",
        # SyntheticDataModule's arguments whose defaults differ here; the others pass through **synthetic
        mode: Literal["fixed", "online"] = "online", batch_size: PositiveInt | None = 256,
        num_val: PositiveInt = 8000, num_test: PositiveInt = 4000, **synthetic,
    ):
        check_args("data", SparseCodingDataModule.__init__, locals())
        if d1 <= d:
            raise ConfigError("data.d1", f"an integer > d = {d}", d1)
        if p is None:
            p = C_z * math.log(math.log(d)) / d
            if p > 1.0:
                raise ConfigError("data.p", "in (0, 1] (C_z log log d / d is outside it)", p)
        if sigma_xi is None:
            sigma_xi = math.sqrt(C_xi * math.sqrt(math.log(d)) / d)
        super().__init__(mode=mode, batch_size=batch_size, num_val=num_val, num_test=num_test, **synthetic)
        per_step = batch_size if batch_size is not None else self.sizes["train"]
        owned = num_negatives if negatives == "per_anchor" else math.ceil(num_negatives / per_step)
        # a training sample holds x, z, xi, x_a, x_q and its negatives; an evaluation sample x, z, xi
        self.check_memory({"d": d, "d1": d1, "num_negatives": num_negatives},
                          train_values=4 * d1 + d + owned * (d1 + d), eval_values=2 * d1 + d, out_bytes=4,
                          consts=32 * d1 * d)
        self.d, self.d1 = d, d1
        self.C_z, self.C_xi = C_z, C_xi
        self.p, self.sigma_xi = float(p), float(sigma_xi)
        self.dictionary, self.augment, self.mask_prob = dictionary, augment, mask_prob
        self.augment_negatives, self.num_negatives, self.negatives = augment_negatives, num_negatives, negatives
        self._consts: dict[str, dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------------------------------
    # global quantities
    # ------------------------------------------------------------------------------------------
    def _build_consts(self) -> dict[str, torch.Tensor]:
        if self.dictionary == "random":
            M = rng.global_orthonormal(self.seed, _G_DICT, self.d1, self.d)
        else:
            coords = rng.permutation(self.seed, _G_COORD, torch.zeros((), dtype=torch.int64), self.d1)[: self.d]
            M = torch.zeros(self.d1, self.d, dtype=torch.float64)
            M[coords, torch.arange(self.d)] = 1.0
        zero = torch.zeros((), dtype=torch.int64)
        signs = torch.where(rng.bernoulli(self.seed, _G_WSTAR_SIGN, zero, (self.d,), 0.5), 1.0, -1.0)
        mags = 0.5 + rng.uniform(self.seed, _G_WSTAR_MAG, zero, (self.d,), torch.float64)
        return {"M": M.float(), "w_star": (signs * mags).float()}

    def _const(self, name: str, device) -> torch.Tensor:
        key = str(torch.device(device))
        if key not in self._consts:
            if "cpu" not in self._consts:
                self._consts["cpu"] = self._build_consts()
            self._consts[key] = {k: v.to(device) for k, v in self._consts["cpu"].items()}
        return self._consts[key][name]

    @property
    def M(self) -> torch.Tensor:
        """The dictionary ``[d1, d]`` (orthonormal columns), on CPU."""
        return self._const("M", "cpu")

    @property
    def w_star(self) -> torch.Tensor:
        """Downstream regression weights ``[d]``."""
        return self._const("w_star", "cpu")

    @property
    def features(self) -> torch.Tensor:
        """Dictionary atoms, one per row: ``M^T`` of shape ``[d, d1]``."""
        return self.M.t()

    def dictionary_on(self, device) -> torch.Tensor:
        return self._const("M", device)

    # ------------------------------------------------------------------------------------------
    # sampling
    # ------------------------------------------------------------------------------------------
    def _draw(self, index: torch.Tensor, split: str, shape: tuple[int, ...], q_support: int, q_sign: int,
              q_noise: int, seed=None, Mt=None) -> tuple[torch.Tensor, ...]:
        """``x, z, xi`` of one seed, or of a tensor of ``S`` seeds with their dictionaries' transposes ``Mt`` (a
        list)."""
        s, seed = self.stream, self.seed if seed is None else seed
        Mt = self._const("M", index.device).t() if Mt is None else Mt
        support = rng.bernoulli(seed, s(split, q_support), index, shape + (self.d,), self.p)
        sign = rng.bernoulli(seed, s(split, q_sign), index, shape + (self.d,), 0.5)
        z = sign.float().mul_(2.0).sub_(1.0).mul_(support)  # torch.where is a scalar loop on CPU: ~5x slower
        xi = self.sigma_xi * rng.normal(seed, s(split, q_noise), index, shape + (self.d1,))
        return matmul_per_seed(z, Mt) + xi, z, xi

    def _mask_views(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.mask_prob
        return _masked(x, mask, q), _masked(x, mask.logical_not(), 1.0 - q)

    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """Samples with these indices on ``index.device``; training adds views and negatives."""
        return self._sample(index, split, self.seed, None, self._const("w_star", index.device))

    def _sample(self, index: torch.Tensor, split: str, seed, Mt, w_star) -> dict[str, torch.Tensor]:
        x, z, xi = self._draw(index, split, (), _Q_SUPPORT, _Q_SIGN, _Q_NOISE, seed, Mt)
        y = matmul_per_seed(z, w_star)
        out = {"x": x, "z": z, "xi": xi, "y_reg": y, "y_cls": torch.sign(y)}
        if split != "train":
            return out
        if self.augment == "random_mask":
            mask = rng.bernoulli(seed, self.stream(split, _Q_MASK), index, (self.d1,), self.mask_prob)
            out["x_a"], out["x_q"] = self._mask_views(x, mask)
        else:
            out["x_a"], out["x_q"] = x, x
        out["x_neg"] = self._negatives(index, split, self.negatives_per_anchor(), seed, Mt)  # pooled in batch()
        return out

    def sample_seeds(self, members: list, index: torch.Tensor, split: str) -> dict[str, torch.Tensor] | None:
        """The online training batches of every member in one draw, negatives pooled as :meth:`batch` pools
        them (per seed)."""
        if split != "train":
            return None
        seeds = self.seeds_of(members, index.device)
        Mt = [m._const("M", index.device).t() for m in members]
        w_star = [m._const("w_star", index.device) for m in members]
        out = self._sample(index, split, seeds, Mt, w_star)
        return self._pool(out, index, lambda owned: torch.stack([pool_negatives(o, index, self.num_negatives)
                                                                  for o in owned]))

    def negatives_per_anchor(self) -> int:
        """``r``: negatives owned by each anchor, ``N`` per anchor, else ``ceil(N / global batch)``.

        Sized from the global batch (per-device batch x devices) so that the pool of ``W`` devices with
        ``B`` anchors each is the pool of one device with ``W B`` anchors.
        """
        if self.negatives == "per_anchor":
            return self.num_negatives
        global_batch = self.sizes["train"] if self.batch_size is None else self.batch_size * self._world()[2]
        return math.ceil(self.num_negatives / global_batch)

    def _negatives(self, index: torch.Tensor, split: str, r: int, seed=None, Mt=None) -> torch.Tensor:
        seed = self.seed if seed is None else seed
        xn, _, _ = self._draw(index, split, (r,), _Q_NEG_SUPPORT, _Q_NEG_SIGN, _Q_NEG_NOISE, seed, Mt)
        if self.augment_negatives:
            mneg = rng.bernoulli(seed, self.stream(split, _Q_NEG_MASK), index, (r, self.d1), self.mask_prob)
            xn = _masked(xn, mneg, self.mask_prob)
        return xn

    def batch(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """As the base class, then turns the per-anchor negatives into the configured pool.

        On several devices a shared pool spans the global batch: ``x_neg`` stays ``[B, r, d1]`` and
        ``neg_pool_size`` tells the model to pool after gathering (see the module docstring).
        """
        out = dict(super().batch(index, split))
        if "x_neg" not in out:
            return out
        r = self.negatives_per_anchor()
        if out["x_neg"].shape[1] != r:  # a fixed split cached before the trainer (device count) was attached
            out["x_neg"] = self._negatives(index, split, r)
        return self._pool(out, index, lambda owned: pool_negatives(owned, index, self.num_negatives))

    def _pool(self, out: dict, index: torch.Tensor, pool) -> dict[str, torch.Tensor]:
        """The shared pool of negatives (``pool`` of the owned ones), or on several devices its size for the
        model, which pools after gathering."""
        if self.negatives == "shared":
            if self._world()[2] > 1:
                out["neg_pool_size"] = self.num_negatives
            else:
                out["x_neg"] = pool(out["x_neg"])
        return out

    def test_dataloader(self) -> list:
        """The validation split (dataloader 0), then the test split (dataloader 1)."""
        return [self._loader("val"), self._loader("test")]

    # ------------------------------------------------------------------------------------------
    # closed forms (from Def. 2.1 and 2.3; checked against samples in tests/test_sparse_coding.py)
    # ------------------------------------------------------------------------------------------
    def covariance(self) -> torch.Tensor:
        """``Sigma_x = p M M^T + sigma^2 I`` (float64)."""
        M = self.M.double()
        return self.p * M @ M.t() + self.sigma_xi ** 2 * torch.eye(self.d1, dtype=torch.float64)

    def view_cross_covariance(self) -> torch.Tensor:
        """``E[x_a x_q^T]``: ``Sigma_x - Diag(Sigma_x)`` with RandomMask, ``Sigma_x`` without (float64)."""
        sigma = self.covariance()
        if self.augment == "none":
            return sigma
        return sigma - torch.diag(torch.diagonal(sigma))

    def raw_probe_nmse(self) -> float:
        """Population nMSE of the best linear regression probe on raw x: ``sigma^2 / (p + sigma^2)``."""
        s2 = self.sigma_xi ** 2
        return s2 / (self.p + s2)
