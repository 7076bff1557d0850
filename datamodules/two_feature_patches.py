"""Two-feature patch data of Wen & Li (2022), "The mechanism of prediction head in non-contrastive SSL"
(Def. 3.1, Assumption 3.3), with the complementary-halves augmentation of eq. 3.2.

A sample is ``X [P, d]`` (P patches in R^d):

* a feature index ``ell`` ~ Uniform{0, 1} (or ``feature_probs``), a sign ``s`` ~ Uniform{+-1};
* a uniformly random set S of exactly ``num_feature_patches`` (P0) patches carries ``s * alpha[ell] * v[ell]``
  (no noise); v_0 = v1 is the strong feature, v_1 = v2 the weak one (``alphas[0] > alphas[1]``);
* every other patch is strong Gaussian noise ``xi ~ N(0, noise_std^2 * Proj_{span(v)^perp})``.

Augmentation (eq. 3.2): a uniformly random half ``view1`` of the P patches (exactly P/2) goes to the online
branch, the complementary half to the target branch; masked patches are zero (the encoder skips them).

Everything is a pure function of (seed, split, sample index) through :mod:`featlearn.datamodules.rng`,
so samples do not depend on batch size, device or device count. ``sample`` returns::

    x            [B, P, d]  un-augmented sample (dtype ``dtype``)
    view1        [B, P]     bool, the online view's patches (the target gets ``~view1``)
    feature_mask [B, P]     bool, the feature-patch set S
    ell          [B]        int64, feature index of the sample (co_occur: -1)
    sign         [B]        +-1 (dtype of x)

Options beyond the theory's default (Remark 3.2 and our extensions): more than two features
(``alphas`` of length K), class imbalance (``feature_probs``), co-occurring features (``co_occur``: the
first ceil(P0/2) patches of S carry v1, the rest v2, independent signs) and a random orthonormal feature
basis (``random_basis``) instead of e_1, e_2.

Example:
    >>> dm = TwoFeaturePatchDataModule(dim=16, num_patches=8, num_feature_patches=2, batch_size=4)
    >>> b = dm.sample(torch.arange(4), "train")
    >>> b["x"].shape, b["view1"].sum(1).tolist()
    (torch.Size([4, 8, 16]), [4, 4, 4, 4])
    >>> dm.features.shape
    torch.Size([2, 16])
"""
from __future__ import annotations

from typing import Literal

import torch

from featlearn.datamodules import rng
from featlearn.datamodules.base import GEN_BYTES, SyntheticDataModule
from featlearn.errors import ConfigError
from featlearn.theory.noncontrastive import hypergeometric_moments
from featlearn.validation import NonNegativeFloat, PositiveFloat, PositiveInt, check_args, int_at_least

_DTYPES = {"float32": torch.float32, "float64": torch.float64}

# RNG quantities (added to the split's stream id)
_Q_ELL, _Q_SIGN, _Q_SUBSET, _Q_VIEW, _Q_NOISE, _Q_SIGN2 = range(6)
_BASIS_STREAM = 77
_INIT_STREAM = 404  # model initialisation, apart from every sample and basis stream


class TwoFeaturePatchDataModule(SyntheticDataModule):
    """Two-feature patch distribution + complementary-halves views (module docstring).

    Args:
        dim: ambient dimension d (>= number of features + 1).
        num_patches: P (even, >= 2).
        num_feature_patches: P0 in [1, P].
        alphas: feature magnitudes, strongest first (length K >= 2; default demo-A (4, 2.7)).
        noise_std: per-coordinate std s of the noise patches (> 0).
        feature_probs: P(ell = k), default uniform.
        co_occur: every sample carries v1 and v2 (remark 3.2 (ii)); only for K = 2.
        random_basis: random orthonormal features (a pure function of ``seed``) instead of e_1..e_K.
        dtype: ``"float64"`` (default: the dynamics run through terms of 1e-8 .. 1e-12) or ``"float32"``.
        seed, mode, batch_size, num_train, num_val, num_test, steps_per_epoch: see the base class
            (default ``mode="online"``: fresh samples every step, Algorithm 1).
    """

    def __init__(
        self,
        dim: PositiveInt = 100,
        num_patches: int_at_least(2) = 32,
        num_feature_patches: PositiveInt = 8,
        alphas: list[PositiveFloat] | tuple[PositiveFloat, ...] = (4.0, 2.7),
        noise_std: PositiveFloat = 1.0,
        feature_probs: list[NonNegativeFloat] | None = None,
        co_occur: bool = False,
        random_basis: bool = False,
        dtype: Literal["float32", "float64"] = "float64",
        # SyntheticDataModule's arguments whose defaults differ here; the others pass through **synthetic
        mode: Literal["fixed", "online"] = "online", batch_size: PositiveInt | None = 4096,
        num_val: PositiveInt = 8192, num_test: PositiveInt = 8192, **synthetic,
    ):
        check_args("data", TwoFeaturePatchDataModule.__init__, locals())
        alphas = [float(a) for a in alphas]
        if len(alphas) < 2:
            raise ConfigError("data.alphas", "a list of >= 2 positive finite magnitudes", alphas)
        k = len(alphas)
        if dim < k + 1:
            raise ConfigError("data.dim", f"an integer >= number of features + 1 = {k + 1}", dim)
        if num_patches % 2:
            raise ConfigError("data.num_patches", "an even integer >= 2", num_patches)
        if num_feature_patches > num_patches:
            raise ConfigError("data.num_feature_patches", f"an integer in [1, {num_patches}]",
                              num_feature_patches)
        if feature_probs is not None:
            probs = [float(q) for q in feature_probs]
            if len(probs) != k or abs(sum(probs) - 1) > 1e-9:
                raise ConfigError("data.feature_probs", f"{k} non-negative numbers summing to 1",
                                  feature_probs)
            feature_probs = probs
        if co_occur and (k != 2 or num_feature_patches < 2):
            raise ConfigError("data.co_occur", "False unless there are 2 features and P0 >= 2", co_occur)
        super().__init__(mode=mode, batch_size=batch_size, num_val=num_val, num_test=num_test, **synthetic)
        item = _DTYPES[dtype].itemsize
        # x and the two patch masks per sample; drawing the noise also holds the projected copy and x
        self.check_memory({"dim": dim, "num_patches": num_patches}, train_values=num_patches * (dim + 2),
                          eval_values=num_patches * (dim + 2), out_bytes=item, consts=32 * k * dim,
                          gen_bytes=GEN_BYTES + 3 * item)
        self.dim, self.num_patches, self.num_feature_patches = dim, num_patches, num_feature_patches
        self.alphas, self.noise_std, self.feature_probs = alphas, float(noise_std), feature_probs
        self.co_occur, self.random_basis = bool(co_occur), bool(random_basis)
        self.dtype = _DTYPES[dtype]
        self._features = self._make_features()

    # --- ground truth ---------------------------------------------------------------------------
    def _make_features(self) -> torch.Tensor:
        k, d = len(self.alphas), self.dim
        if not self.random_basis:
            return torch.eye(k, d, dtype=torch.float64).to(self.dtype)
        g = rng.global_normal(self.seed, _BASIS_STREAM, (d, k), dtype=torch.float64)
        q, _ = torch.linalg.qr(g)
        return q.T.contiguous().to(self.dtype)

    @property
    def features(self) -> torch.Tensor:
        """``[K, d]`` orthonormal rows v_1 (strong), v_2 (weak), ..."""
        return self._features

    @property
    def num_features(self) -> int:
        return len(self.alphas)

    @property
    def probs(self) -> list[float]:
        k = self.num_features
        return self.feature_probs if self.feature_probs is not None else [1.0 / k] * k

    def initial_weights(self, width: int, seed: int | None = None) -> torch.Tensor:
        """Standard normal ``[width, dim]`` float64 draws for a model's initial weights (scale them to the
        init std), a pure function of (``seed``, default the data seed; width, dim) on a stream of their
        own, so an initialisation is reproducible on any device and apart from every sample.

        Example:
            >>> dm = TwoFeaturePatchDataModule(dim=5, num_patches=4, num_feature_patches=2, batch_size=2)
            >>> torch.equal(dm.initial_weights(2), dm.initial_weights(2, seed=0)), dm.initial_weights(2).shape
            (True, torch.Size([2, 5]))
        """
        return rng.global_normal(self.seed if seed is None else seed, _INIT_STREAM, (width, self.dim),
                                 dtype=torch.float64)

    def constants(self) -> dict[str, float]:
        """Hypergeometric constants (Wen & Li 2022, App. A) and the population optimum OPT (Cor. E.3)."""
        return hypergeometric_moments(self.num_patches, self.num_feature_patches)

    # --- sampling -------------------------------------------------------------------------------
    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        dev, B = index.device, index.shape[0]
        P, P0, d, k = self.num_patches, self.num_feature_patches, self.dim, self.num_features
        st = self.stream(split)
        v = self._features.to(dev)
        alphas = torch.tensor(self.alphas, dtype=self.dtype, device=dev)

        if self.co_occur:
            ell = torch.full((B,), -1, dtype=torch.int64, device=dev)
        elif self.feature_probs is None:
            ell = rng.randint(self.seed, st + _Q_ELL, index, (), k)
        else:
            u = rng.uniform(self.seed, st + _Q_ELL, index, (), torch.float64)
            cdf = torch.tensor(self.probs, dtype=torch.float64, device=dev).cumsum(0)
            ell = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1).clamp_max(k - 1)
        sign = rng.bernoulli(self.seed, st + _Q_SIGN, index, (), 0.5).to(self.dtype) * 2 - 1

        order = rng.permutation(self.seed, st + _Q_SUBSET, index, P)      # S = first P0 of a permutation
        rank = torch.argsort(order, dim=-1)                                # position of patch p in order
        feature_mask = rank < P0
        view1 = rng.permutation(self.seed, st + _Q_VIEW, index, P).argsort(-1) < P // 2

        noise = rng.normal(self.seed, st + _Q_NOISE, index, (P, d), self.dtype) * self.noise_std
        noise = noise - (noise @ v.T) @ v                                  # project onto span(v)^perp
        if self.co_occur:
            sign2 = rng.bernoulli(self.seed, st + _Q_SIGN2, index, (), 0.5).to(self.dtype) * 2 - 1
            first = rank < (P0 + 1) // 2                                   # first half of S carries v1
            vec1 = (sign * alphas[0])[:, None] * v[0]
            vec2 = (sign2 * alphas[1])[:, None] * v[1]
            feat = torch.where(first[..., None], vec1[:, None, :], vec2[:, None, :])
        else:
            feat = ((sign * alphas[ell])[:, None] * v[ell])[:, None, :].expand(B, P, d)
        x = torch.where(feature_mask[..., None], feat, noise)
        return {"x": x, "view1": view1, "feature_mask": feature_mask, "ell": ell, "sign": sign}

    @staticmethod
    def views(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(view-1 mask, view-2 mask) as float weights for the patch kernels."""
        m1 = batch["view1"].to(batch["x"].dtype)
        return m1, 1.0 - m1

    @staticmethod
    def augment(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Materialised views X^(1), X^(2) (masked patches zeroed); for reference code and plots only,
        the encoder consumes the masks directly."""
        m1, m2 = TwoFeaturePatchDataModule.views(batch)
        return batch["x"] * m1[..., None], batch["x"] * m2[..., None]
