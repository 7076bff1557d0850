"""Prompts of in-context linear regression with anisotropic inputs (Shi 2024, Ch. 5 = Shi, Wei, Xu, Liang, ICML
2024, Section 5.4): the data on which a rank-r linear self-attention learns, :mod:`featlearn.lightning_modules.icl_lsa`.

A prompt holds ``n`` examples ``x_i ~ N(0, Lambda)`` of one task ``w ~ N(0, I_d)``, their labels ``y_i = <w, x_i>``
and a query ``x_q`` with its label ``y_q = <w, x_q>``. The covariance is ``Lambda = Q diag(lambda) Q^T`` with
``lambda_i = i^-decay`` (decreasing: the top-r eigen-directions are the first r) and ``Q`` a random rotation drawn
from the seed (``basis: random``) or the identity. Training prompts hold ``N`` noise-free examples, as in the
chapter; validation and test prompts hold ``eval_examples`` (the chapter's ``M``) examples whose labels carry
Gaussian noise of standard deviation ``eval_noise`` (``sigma``; the query's label stays noise-free), so
``val/loss`` measures Theorem 5.4.2's evaluation loss. Each prompt is a function of (seed, split, index).

The ground truth: :attr:`ICLRegressionDataModule.eigenvalues` ``lambda``, :attr:`~ICLRegressionDataModule.basis`
``Q`` (columns) and the covariance (float64); :attr:`~ICLRegressionDataModule.features` are the eigen-directions,
one per row, largest eigenvalue first.

Example:
    >>> dm = ICLRegressionDataModule(d=4, N=8, eval_examples=5, eval_noise=0.5)
    >>> train, val = dm.batch(torch.arange(3), "train"), dm.batch(torch.arange(3), "val")
    >>> tuple(train["X"].shape), tuple(val["X"].shape), tuple(round(v, 4) for v in dm.eigenvalues.tolist())
    ((3, 8, 4), (3, 5, 4), (1.0, 0.5, 0.3333, 0.25))
"""
from __future__ import annotations

from typing import Literal

import torch

from featlearn.datamodules import rng
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.errors import ConfigError
from featlearn.validation import PositiveFloat, PositiveInt, check_args

_Q_X, _Q_W, _Q_NOISE = 0, 1, 2  # the random quantities' streams within a split
_G_BASIS = 7  # the rotation's stream (global: not tied to a split)


class ICLRegressionDataModule(SyntheticDataModule):
    """In-context linear regression prompts with covariance ``Q diag(i^-decay) Q^T`` (module docstring).

    Args:
        d: the input dimension (default 16).
        N: examples per training prompt (default 64).
        decay: the spectrum ``lambda_i = i^-decay``, ``> 0`` so that the top-r directions are unique.
        basis: ``random`` (a rotation drawn from the seed) or ``identity`` (the eigen-directions are the axes).
        eval_examples: examples per validation and test prompt (``M``; default ``N``).
        eval_noise: the standard deviation ``sigma >= 0`` of the validation and test examples' label noise.
        seed, mode, batch_size, num_train, num_val, num_test, steps_per_epoch, shuffle: see
            :class:`~featlearn.datamodules.base.SyntheticDataModule`.
    """

    def __init__(self, d: PositiveInt = 16, N: PositiveInt = 64, decay: PositiveFloat = 1.0,
                 basis: Literal["random", "identity"] = "random", eval_examples: PositiveInt | None = None,
                 eval_noise: float = 0.0, mode: Literal["fixed", "online"] = "online",
                 batch_size: PositiveInt | None = 512, num_val: PositiveInt = 4096, num_test: PositiveInt = 4096,
                 **synthetic):
        check_args("data", ICLRegressionDataModule.__init__, locals())
        if not eval_noise >= 0:
            raise ConfigError("data.eval_noise", "a label-noise standard deviation >= 0", eval_noise)
        super().__init__(mode=mode, batch_size=batch_size, num_val=num_val, num_test=num_test, **synthetic)
        self.d, self.N, self.decay, self.basis_kind = d, N, float(decay), basis
        self.M = N if eval_examples is None else eval_examples
        self.sigma = float(eval_noise)
        n = max(N, self.M) + 1
        self.check_memory({"d": d, "N": N}, train_values=(N + 1) * (d + 1) + d, eval_values=n * (d + 1) + d,
                          out_bytes=4, consts=3 * d * d * 8)
        self.eigenvalues = torch.arange(1, d + 1, dtype=torch.float64) ** -self.decay
        if basis == "random":
            self.basis = rng.global_orthonormal(self.seed, _G_BASIS, d, d)
        else:
            self.basis = torch.eye(d, dtype=torch.float64)
        self.covariance = self.basis @ torch.diag(self.eigenvalues) @ self.basis.T
        self._root = (self.basis * self.eigenvalues.sqrt()).T.float()  # x = z @ root for z ~ N(0, I)

    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """``X [B, n, d]``, ``y [B, n]`` (noisy on val/test), ``x_q [B, d]``, ``y_q [B]`` and the task ``w [B, d]``;
        ``n = N`` for training, ``M`` otherwise."""
        seed, st = self.seed, self.stream
        n = self.N if split == "train" else self.M
        z = rng.normal(seed, st(split, _Q_X), index, (n + 1, self.d))
        x = z @ self._root.to(z.device)  # d x d: moved per batch (a CUDA run draws z on the GPU)
        w = rng.normal(seed, st(split, _Q_W), index, (self.d,))
        y = (x @ w.unsqueeze(-1)).squeeze(-1)
        X, y, y_q = x[:, :n], y[:, :n], y[:, n]
        if split != "train" and self.sigma > 0:
            y = y + self.sigma * rng.normal(seed, st(split, _Q_NOISE), index, (n,))
        return {"X": X, "y": y, "x_q": x[:, n], "y_q": y_q, "w": w}

    @property
    def features(self) -> torch.Tensor:
        """The eigen-directions of the covariance, one per row, largest eigenvalue first."""
        return self.basis.T.float()
