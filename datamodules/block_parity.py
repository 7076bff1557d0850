"""Structured parity of the gradient-feature framework (Shi 2024, Ch. 3 = Shi, Wei, Liang, NeurIPS 2023, Sec. 3.4.2,
Assumption 3.19): the second data of :mod:`featlearn.lightning_modules.gradient_features`.

A hidden vector ``phi in {-1, 0, +1}^d`` and ``x = M phi`` with ``M`` orthonormal (``basis: random``, drawn from the
seed, or ``identity``). The class-relevant coordinates ``A = {1..rk}`` form ``r`` blocks ``A_j`` of ``k`` (both odd)
and the label is ``y = sign(sum_j prod_{l in A_j} phi_l)``. ``phi_A`` comes from the mixture ``(1 - 2 r p_A) X_U +
sum_j p_A (X_{j,+} + X_{j,-})``: in ``X_U`` it is uniform on ``{-1, +1}^{rk}`` (the hard, parity part); in
``X_{j,+-}`` block ``j`` is all ``+-1`` and the other blocks are 0 (the structure that leaks the label to the
gradient). Every background coordinate is independently ``+1`` or ``-1`` with probability ``p_o`` each and 0
otherwise; ``p_o`` defaults to the chapter's ``rk / (d - rk)``. Proposition 3.23's kernel-hard instance is ``basis:
identity, r = 1, p_A = 1/4, k = d/16, p_o = 1/2``.

The ground truth: :attr:`~BlockParityDataModule.features`, the gradient features ``D_j = M 1_{A_j} / sqrt(k)`` (one
row per block). A batch also holds ``component`` (``0``: ``X_U``; ``2j+1`` / ``2j+2``: ``X_{j,+}`` / ``X_{j,-}``).

Example:
    >>> dm = BlockParityDataModule(d=32, r=3, k=3, p_A=0.125, seed=0)
    >>> b = dm.batch(torch.arange(400), "train")
    >>> tuple(b["x"].shape), sorted(set(b["y"].tolist())), tuple(dm.features.shape)
    ((400, 32), [-1.0, 1.0], (3, 32))
    >>> phi = b["x"].double() @ dm.basis.T  # the hidden vector back
    >>> blocks = phi[:, :9].reshape(-1, 3, 3).prod(2).sum(1).sign()
    >>> bool((blocks == b["y"]).all())
    True
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from featlearn.datamodules import rng
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.errors import ConfigError
from featlearn.validation import ClosedUnitInterval, PositiveInt, check_args

_Q_COMPONENT, _Q_SIGNS, _Q_BACKGROUND = 0, 1, 2  # the random quantities' streams within a split
_G_BASIS = 8


class BlockParityDataModule(SyntheticDataModule):
    """Structured parity with ``r`` blocks of ``k`` relevant coordinates (module docstring).

    Args:
        d: the input dimension (``d > rk``).
        r: the number of blocks, odd.
        k: the block size, odd.
        p_A: the weight of each structured component ``X_{j,+}``, ``X_{j,-}`` (``2 r p_A <= 1``).
        p_o: the probability of ``+1`` (and of ``-1``) of a background coordinate, at most 1/2 (default ``rk / (d -
            rk)``).
        basis: ``random`` (an orthonormal ``M`` drawn from the seed) or ``identity`` (``M = I``).
        batch_size: samples per step (default ``round(4 d^1.5)``, as for the XOR mixture).
        seed, mode, num_train, num_val, num_test, steps_per_epoch, shuffle: see
            :class:`~featlearn.datamodules.base.SyntheticDataModule`.
    """

    def __init__(self, d: PositiveInt = 64, r: PositiveInt = 1, k: PositiveInt = 5, p_A: ClosedUnitInterval = 0.25,
                 p_o: ClosedUnitInterval | None = None, basis: Literal["random", "identity"] = "random",
                 mode: Literal["fixed", "online"] = "online", batch_size: PositiveInt | None = None,
                 num_val: PositiveInt = 8192, num_test: PositiveInt = 20000, **synthetic):
        check_args("data", BlockParityDataModule.__init__, locals())
        for name, value in (("r", r), ("k", k)):
            if value % 2 == 0:
                raise ConfigError(f"data.{name}", "an odd integer (the label is the sign of a sum of r parities of "
                                                  "k bits each)", value)
        if r * k >= d:
            raise ConfigError("data.d", f"larger than r k = {r * k} (the relevant coordinates)", d)
        if 2 * r * p_A > 1:
            raise ConfigError("data.p_A", f"at most 1 / (2 r) = {1 / (2 * r):.4g} (the uniform component's weight "
                                          f"1 - 2 r p_A must be >= 0)", p_A)
        p_o = r * k / (d - r * k) if p_o is None else float(p_o)
        if p_o > 0.5:
            raise ConfigError("data.p_o", "at most 1/2 (the default r k / (d - r k) exceeds it: set p_o or raise d)",
                              p_o)
        batch_size = round(4 * d ** 1.5) if batch_size is None else batch_size
        super().__init__(mode=mode, batch_size=batch_size, num_val=num_val, num_test=num_test, **synthetic)
        self.d, self.r, self.k, self.p_A, self.p_o = d, r, k, float(p_A), p_o
        self.check_memory({"d": d}, train_values=2 * d + 2, eval_values=2 * d + 2, out_bytes=4, consts=8 * d * d)
        self.basis = (torch.eye(d, dtype=torch.float64) if basis == "identity"
                      else rng.global_orthonormal(self.seed, _G_BASIS, d, d).T)  # row l: the pattern M_l, x = phi @ basis

    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """``x [B, d]``, ``y [B]`` (+-1) and the mixture ``component [B]`` (module docstring)."""
        seed, st, r, k, rk = self.seed, self.stream, self.r, self.k, self.r * self.k
        u = rng.uniform(seed, st(split, _Q_COMPONENT), index, (), torch.float64)
        structured = (u / self.p_A).floor().long()  # 0..2r-1 inside the structured components' mass 2 r p_A
        component = torch.where(u < 2 * r * self.p_A, structured.clamp(max=2 * r - 1) + 1, 0)
        signs = rng.randint(seed, st(split, _Q_SIGNS), index, (rk,), 2) * 2 - 1  # X_U's uniform phi_A
        block = (component - 1).div(2, rounding_mode="floor")  # the structured component's block j (when > 0)
        sign = 1 - 2 * ((component - 1) % 2)  # +1 for X_{j,+}, -1 for X_{j,-}
        in_block = torch.arange(rk, device=index.device).div(k, rounding_mode="floor") == block.unsqueeze(1)
        phi_A = torch.where(component.unsqueeze(1) == 0, signs, in_block * sign.unsqueeze(1))
        v = rng.uniform(seed, st(split, _Q_BACKGROUND), index, (self.d - rk,), torch.float64)
        phi_rest = (v < self.p_o).long() - ((v >= self.p_o) & (v < 2 * self.p_o)).long()
        phi = torch.cat([phi_A, phi_rest], 1).to(torch.float64)
        y = phi_A.reshape(-1, r, k).prod(2).sum(1).sign().float()
        x = (phi @ self.basis.to(phi.device)).float()
        return {"x": x, "y": y, "component": component}

    @property
    def features(self) -> torch.Tensor:
        """The gradient features ``D_j = M 1_{A_j} / sqrt(k)``, one row per block ``[r, d]``."""
        blocks = self.basis[:self.r * self.k].reshape(self.r, self.k, self.d).sum(1) / math.sqrt(self.k)
        return blocks.float()

    @property
    def signal_norm(self) -> float:
        """How far along its feature direction a sample's signal lies: ``<D_j, x> = +-sqrt(k)`` in ``X_{j,+-}``."""
        return math.sqrt(self.k)

    def bias_scale(self, sigma_w: float) -> float:
        """The bias scale of the chapter's parity analysis without its constants, ``sqrt(r k) sigma_w`` (Lemma B.47
        has ``C_b sqrt(tau r k log d) sigma_w``; :class:`GradientFeatureNetwork`'s ``bias_mult`` multiplies it)."""
        return math.sqrt(self.r * self.k) * sigma_w
