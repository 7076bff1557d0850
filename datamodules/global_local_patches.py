"""K-cluster patch data with global and local areas, for one-layer softmax ViTs (Huang et al. 2025,
Def. 2.1-2.7).

A sample ``X (P, d)`` of cluster ``k ~ Uniform[K]`` carries, on every patch p of area ``j`` of cluster k's
partition, the vector ``z_j v_{k,j}`` (``z_j ~ Uniform[z_low, z_high]`` per sample and area, or 1). Area 0
is the global area (``C_1 = Theta(P^kappa_c)`` patches), areas ``1 .. N-1`` the local ones
(``C_s = Theta(P^kappa_s)`` each), sized by our rounding rule (:func:`featlearn.theory.vit.area_sizes`).
Positional encodings ``e_p`` and features ``v_{k,j}`` are orthonormal and mutually orthogonal:
``basis="canonical"`` puts ``e_p`` on coordinate ``p`` and ``v_{k,j}`` on ``P + k N + j``; ``"haar"``
rotates all of them by one Haar-random orthogonal matrix. ``d`` defaults to ``roundup(P + K N, 64)``.

Partitions are fixed for the run (a function of the seed): ``layout="random"`` gives each cluster a random
permutation of the positions, the first ``C_1`` global, the rest cut into local areas of ``C_s``;
``"grid"`` tiles the ``sqrt(P) x sqrt(P)`` grid into ``h x w = C_s`` tiles (shifted per cluster by its own
offset in ``[0, h) x [0, w)``, tiles wrapping around the edges, so clusters never share a local area; hence
``K <= C_s``) and makes a random block of ``C_1 / C_s`` tiles the global area (our layout for
the figures and the attention diversity; the paper allows any partition).

Batches are structured (the model builds dense ``x`` only where it needs it)::

    cluster   [B]        int64      area      [B, P]  int64 (0 = global)   z_area [B, N]  latents
    feat_id   [B, P]     int64 row of ``V`` (= k N + area)  z [B, P] latent of each patch  is_global [B, P] bool

What a method adds (asked for in its ``build``):

* :meth:`use_mae_masks` ``(gamma)``: ``mask [B, P]`` bool (True = masked) with exactly ``round(gamma P)``
  masked patches drawn uniformly without replacement, and their sorted positions ``masked_idx [B, Pq]``;
* :meth:`use_cl_views` ``(gamma0)``: two independent maskings ``mask1``, ``mask2`` (``round(gamma0 P)``
  each) and the Gaussian noise ``noise [B, P, d]`` (variance ``noise_var``, default ``1/d``), which both
  views share (Assumption 4.3, Def. 2.7). Negatives are the other samples of the batch, unaugmented.

Every value is a function of (seed, split, sample index) through :mod:`featlearn.datamodules.rng`; in
fixed mode a training sample's masks also depend on the step (fresh masks every step, the same sample).

Example:
    >>> dm = GlobalLocalPatchDataModule(P=64, K=2, kappa_c=0.75, kappa_s=0.5, batch_size=4)
    >>> dm.C_1, dm.C_s, dm.n_areas, dm.d
    (24, 8, 6, 128)
    >>> dm.use_mae_masks(0.75)
    >>> b = dm.batch(torch.arange(4), "train")
    >>> b["masked_idx"].shape, int(b["mask"].sum(1)[0]), dm.features.shape
    (torch.Size([4, 48]), 48, torch.Size([12, 128]))
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from featlearn.datamodules import rng
from featlearn.datamodules.base import SyntheticDataModule
from featlearn.errors import ConfigError
from featlearn.papers import cite
from featlearn.theory.vit import area_sizes, embedding_dim, masked_count, patch_vectors, z_moments
from featlearn.validation import (LeftOpenUnitInterval, NonNegativeFloat, PositiveFloat, PositiveInt,
                                  RightOpenUnitInterval, check_args, int_at_least)

_DTYPES = {"float32": torch.float32, "float64": torch.float64}

# per-split quantities (SyntheticDataModule.stream(split, q))
_Q_CLUSTER, _Q_Z, _Q_MASK, _Q_MASK2, _Q_NOISE = 1, 2, 3, 4, 5
# global quantities
_G_PARTITION, _G_BASIS, _G_TILES = 11, 12, 13


class GlobalLocalPatchDataModule(SyntheticDataModule):
    """The patch distribution of Huang et al. 2025, Def. 2.1 (module docstring).

    Args:
        P: patches per sample. K: clusters.
        kappa_c, kappa_s: exponents of the global / local area sizes (``C = round(c P^kappa)``).
        C_1, C_s: explicit sizes instead (``null``: from the exponents); leftover patches join the global area.
        c_c, c_s: constants of the size rule.
        layout: ``random`` partitions per cluster, or ``grid`` tiles (``P`` a square, ``C_s`` a tile).
        basis: ``canonical`` coordinates or a ``haar`` rotation of them.
        d: patch dimension (``null``: ``roundup(P + K N, 64)``); at least ``P + K N``.
        z_law: ``uniform`` on ``[z_low, z_high]`` or ``const`` (every z = 1).
        noise_var: ``sigma_0^2`` of the contrastive noise (``null``: ``1/d``); the MAE data has none unless set.
        dtype: ``float32`` or ``float64`` for every float the data produces.
        seed, mode, batch_size, num_train, num_val, num_test, steps_per_epoch, shuffle: see
            :class:`~featlearn.datamodules.base.SyntheticDataModule`.
    """

    def __init__(
        self,
        P: int_at_least(4) = 256,
        K: PositiveInt = 4,
        kappa_c: LeftOpenUnitInterval | None = 0.875,
        kappa_s: RightOpenUnitInterval | None = 0.5,
        C_1: PositiveInt | None = None,
        C_s: PositiveInt | None = None,
        c_c: PositiveFloat = 1.0,
        c_s: PositiveFloat = 1.0,
        layout: Literal["random", "grid"] = "random",
        basis: Literal["canonical", "haar"] = "canonical",
        d: PositiveInt | None = None,
        z_law: Literal["uniform", "const"] = "uniform",
        z_low: PositiveFloat = 0.9,
        z_high: PositiveFloat = 1.1,
        noise_var: NonNegativeFloat | None = None,
        dtype: Literal["float32", "float64"] = "float32",
        mode: Literal["fixed", "online"] = "online",
        batch_size: PositiveInt | None = 32,
        num_val: PositiveInt = 256,
        num_test: PositiveInt = 256,
        **synthetic,
    ):
        check_args("data", GlobalLocalPatchDataModule.__init__, locals())
        if z_law == "uniform" and z_high <= z_low:
            raise ConfigError("data.z_high", f"a number > z_low = {z_low} (the latent law is uniform on "
                                             f"[z_low, z_high])", z_high)
        sizes = area_sizes(P, kappa_c, kappa_s, C_1, C_s, c_c, c_s)
        n_areas = sizes["n_areas"]
        need = P + K * n_areas
        given = {"P": P, "K": K} if d is None else {"P": P, "K": K, "d": d}  # a derived d is P's and K's doing
        if d is None:
            d = embedding_dim(P, K * n_areas)
        elif d < need:
            raise ConfigError("data.d", f"at least P + K N = {P} + {K} x {n_areas} = {need} (positions and "
                                        f"features are orthonormal)", d)
        tile = _tile_shape(P, sizes["C_s"]) if layout == "grid" else None
        if tile is not None and K > tile[0] * tile[1]:
            raise ConfigError("data.K", f"at most C_s = {tile[0] * tile[1]} with layout 'grid' (each cluster tiles the "
                                        f"grid with its own offset of the {tile[0]} x {tile[1]} tiles; "
                                        f"{cite('vit', 'Def. 2.1')}: clusters never share a partition)", K)
        super().__init__(mode=mode, batch_size=batch_size, num_val=num_val, num_test=num_test, **synthetic)
        self.P, self.K, self.d, self.layout, self.basis = P, K, d, layout, basis
        self.C_1, self.C_s, self.n_local, self.n_areas = sizes["C_1"], sizes["C_s"], sizes["n_local"], n_areas
        self.kappa_c_eff, self.kappa_s_eff = sizes["kappa_c_eff"], sizes["kappa_s_eff"]
        self.delta, self.delta_eff = sizes["delta"], sizes["delta_eff"]
        self.tile = tile
        self.z_law, self.z_low, self.z_high = z_law, float(z_low), float(z_high)
        self.z_moments = z_moments(z_law, self.z_low, self.z_high)
        self.noise_var_arg = noise_var
        self.dtype = _DTYPES[dtype]
        self.method: str | None = None
        self.ratio: float | None = None
        self.n_masked: int | None = None
        # a structured sample: cluster, N latents and P ids, latents and flags
        self.check_memory(given, train_values=4 * P + n_areas, eval_values=4 * P + n_areas,
                          out_bytes=8, consts=8 * (d * d + K * P))
        self._consts: dict[str, dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------------------------------
    # what a method asks for
    # ------------------------------------------------------------------------------------------
    def use_mae_masks(self, gamma: float) -> None:
        """Add ``mask`` and ``masked_idx`` (exactly ``round(gamma P)`` masked patches) to every batch."""
        self.method, self.ratio, self.n_masked = "mae", float(gamma), self._count(gamma, "model.gamma")

    def use_cl_views(self, gamma0: float) -> None:
        """Add two independent maskings ``mask1``, ``mask2`` (``round(gamma0 P)`` each) and the shared noise
        ``noise [B, P, d]`` to every batch."""
        n = self._count(gamma0, "model.gamma0")
        per = self.P * self.d  # the noise dominates: the memory check of __init__ did not count it
        self.check_memory({"P": self.P, "d": self.d}, train_values=per, eval_values=per,
                          out_bytes=self.dtype.itemsize, consts=8 * self.d * self.d)
        self.method, self.ratio, self.n_masked = "cl", float(gamma0), n

    def _count(self, ratio: float, field: str) -> int:
        n = masked_count(self.P, ratio)
        if not 1 <= n <= self.P - 1:
            raise ConfigError(field, f"a ratio that masks between 1 and P - 1 = {self.P - 1} of the P = {self.P} "
                                     f"patches (round(ratio P) = {n})", ratio)
        return n

    @property
    def noise_var(self) -> float:
        """``sigma_0^2``: the configured value, else ``1/d`` for contrastive views and 0 otherwise."""
        if self.noise_var_arg is not None:
            return float(self.noise_var_arg)
        return 1.0 / self.d if self.method == "cl" else 0.0

    # ------------------------------------------------------------------------------------------
    # ground truth
    # ------------------------------------------------------------------------------------------
    def _build(self, name: str) -> torch.Tensor:
        P, K, N, d = self.P, self.K, self.n_areas, self.d
        if name == "partition":
            return self._partition()
        if name == "area_sizes":
            sizes = torch.full((K, N), self.C_s, dtype=torch.int64)
            sizes[:, 0] = self.C_1
            return sizes
        if self.basis == "canonical":  # coordinate vectors, without a d x d identity
            rows = torch.arange(P) if name == "E" else P + torch.arange(K * N)
            return torch.zeros(len(rows), d, dtype=self.dtype).scatter_(1, rows.unsqueeze(1), 1.0)
        if "basis" not in self._consts.setdefault("cpu", {}):
            self._consts["cpu"]["basis"] = rng.global_orthonormal(self.seed, _G_BASIS, d, d).T  # rows: rotated axes
        basis = self._consts["cpu"]["basis"]
        return (basis[:P] if name == "E" else basis[P:P + K * N]).to(self.dtype).contiguous()

    def _partition(self) -> torch.Tensor:
        """``[K, P]`` area id of every position in every cluster (0 = global)."""
        P, K, C_1, C_s = self.P, self.K, self.C_1, self.C_s
        clusters = torch.arange(K)
        if self.layout == "random":
            perm = rng.permutation(self.seed, _G_PARTITION, clusters, P)                      # [K, P]
            rank_area = torch.cat([torch.zeros(C_1, dtype=torch.int64),
                                   1 + torch.arange(P - C_1, dtype=torch.int64) // C_s])
            partition = torch.empty(K, P, dtype=torch.int64)
            partition.scatter_(1, perm, rank_area.expand(K, P).contiguous())
            return partition
        side, (h, w) = math.isqrt(P), self.tile
        # distinct tilings: cluster k's tile corners sit at offset (dr, dc) in [0, h) x [0, w), the offsets
        # a random permutation of the h w possible ones (K <= h w, checked in __init__), so no two clusters
        # share a local area
        offsets = rng.permutation(self.seed, _G_PARTITION, torch.zeros((), dtype=torch.int64), h * w)[:K]
        dr, dc = (offsets // w).view(K, 1, 1), (offsets % w).view(K, 1, 1)
        rows, cols = torch.arange(side).view(1, side, 1), torch.arange(side).view(1, 1, side)
        t_rows, t_cols = side // h, side // w                                               # the grid of tiles
        tile_r, tile_c = ((rows - dr) % side) // h, ((cols - dc) % side) // w                # [K, side, side]
        # the global area: a random block of C_1 / C_s tiles (bh x bw, as square as fits the tile grid; a
        # row-major run of tiles if no rectangle does), its corner tile uniform on the torus of tiles
        n_global = C_1 // C_s
        blocks = [(bh, n_global // bh) for bh in range(1, t_rows + 1)
                  if n_global % bh == 0 and n_global // bh <= t_cols]
        corner = rng.randint(self.seed, _G_TILES, clusters, (2,), t_rows * t_cols)           # [K, 2]
        c_r, c_c = (corner[:, 0] % t_rows).view(K, 1, 1), (corner[:, 1] % t_cols).view(K, 1, 1)
        rel_r, rel_c = (tile_r - c_r) % t_rows, (tile_c - c_c) % t_cols
        if blocks:
            bh, bw = min(blocks, key=lambda b: abs(b[0] - b[1]))
            is_global = (rel_r < bh) & (rel_c < bw)
        else:
            is_global = rel_r * t_cols + rel_c < n_global
        tile = tile_r * t_cols + tile_c                                                      # [K, side, side]
        # local areas: the other tiles, numbered in a random order per cluster
        order = rng.permutation(self.seed, _G_TILES + 100, clusters, t_rows * t_cols)        # [K, tiles]
        tile_global = torch.zeros(K, t_rows * t_cols, dtype=torch.bool).scatter_(
            1, tile.reshape(K, P), is_global.reshape(K, P))
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(t_rows * t_cols).expand(K, -1).contiguous())
        rank = rank.masked_fill(tile_global, -1)            # global tiles first, then the others in random order
        area_of_tile = torch.argsort(torch.argsort(rank, dim=1, stable=True), dim=1, stable=True) - n_global + 1
        area_of_tile = area_of_tile.clamp_min(0)
        return area_of_tile.gather(1, tile.reshape(K, P))

    def _const(self, name: str, device) -> torch.Tensor:
        """A ground-truth tensor on ``device``, built once (on the CPU) when first asked for."""
        cpu = self._consts.setdefault("cpu", {})
        if name not in cpu:
            cpu[name] = self._build(name)
        key = str(torch.device(device))
        on_device = self._consts.setdefault(key, {})
        if name not in on_device:
            on_device[name] = cpu[name].to(device)
        return on_device[name]

    @property
    def E(self) -> torch.Tensor:
        """Positional encodings ``[P, d]`` (rows ``e_p``)."""
        return self._const("E", "cpu")

    @property
    def V(self) -> torch.Tensor:
        """Features ``[K N, d]``: row ``k N + j`` is ``v_{k,j}`` (j = 0 global)."""
        return self._const("V", "cpu")

    @property
    def features(self) -> torch.Tensor:
        """The ground-truth features ``V`` ``[K N, d]``."""
        return self.V

    @property
    def partition(self) -> torch.Tensor:
        """``[K, P]`` area of every position in every cluster (0 = global)."""
        return self._const("partition", "cpu")

    @property
    def area_sizes(self) -> torch.Tensor:
        """``[K, N]`` sizes ``C_{k,j}`` (``C_1`` for j = 0, ``C_s`` otherwise)."""
        return self._const("area_sizes", "cpu")

    def grid_coordinates(self) -> torch.Tensor:
        """``[P, 2]`` (row, column) of every position on the ``sqrt(P) x sqrt(P)`` grid (row-major)."""
        side = math.isqrt(self.P)
        p = torch.arange(self.P)
        return torch.stack([p // side, p % side], 1)

    # ------------------------------------------------------------------------------------------
    # sampling
    # ------------------------------------------------------------------------------------------
    def sample(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """Clean structured samples (cluster, latents and the ids of every patch) on ``index.device``."""
        device = index.device
        cluster = rng.randint(self.seed, self.stream(split, _Q_CLUSTER), index, (), self.K)
        if self.z_law == "uniform":
            u = rng.uniform(self.seed, self.stream(split, _Q_Z), index, (self.n_areas,), torch.float64)
            z_area = (self.z_low + (self.z_high - self.z_low) * u).to(self.dtype)
        else:
            z_area = torch.ones(*index.shape, self.n_areas, dtype=self.dtype, device=device)
        area = self._const("partition", device)[cluster]
        return {"cluster": cluster, "z_area": z_area, "area": area, "feat_id": cluster.unsqueeze(-1) * self.n_areas + area,
                "z": z_area.gather(-1, area), "is_global": area == 0}

    def batch(self, index: torch.Tensor, split: str) -> dict[str, torch.Tensor]:
        """As the base class, then the method's masks (and the contrastive noise) for these samples."""
        out = dict(super().batch(index, split))
        if self.method is None:
            return out
        key = index
        if split == "train" and self.mode == "fixed":  # the same samples every epoch: masks follow the step
            key = index + self.sizes["train"] * self._world()[0]
        if self.method == "mae":
            out["mask"], out["masked_idx"] = self.masks(key, split, _Q_MASK)
        else:
            out["mask1"] = self.masks(key, split, _Q_MASK)[0]
            out["mask2"] = self.masks(key, split, _Q_MASK2)[0]
            out["noise"] = self.noise(index, split)
        return out

    def masks(self, key: torch.Tensor, split: str, quantity: int = _Q_MASK) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mask [B, P] bool, masked_idx [B, n] sorted)``: exactly ``n = round(ratio P)`` patches per sample,
        uniformly without replacement."""
        perm = rng.permutation(self.seed, self.stream(split, quantity), key, self.P)
        idx = perm[..., : self.n_masked].sort(-1).values
        mask = torch.zeros(*key.shape, self.P, dtype=torch.bool, device=key.device).scatter_(-1, idx, True)
        return mask, idx

    def noise(self, index: torch.Tensor, split: str) -> torch.Tensor:
        """The sample's noise ``zeta [B, P, d]``, i.i.d. ``N(0, noise_var)`` (part of the sample X: one draw)."""
        std = math.sqrt(self.noise_var)
        z = rng.normal(self.seed, self.stream(split, _Q_NOISE), index, (self.P, self.d), self.dtype)
        return z.mul_(std)

    def dense(self, batch: dict[str, torch.Tensor], view: Literal["x", "mae", "view1", "view2"] = "x") -> torch.Tensor:
        """Dense patches ``[B, P, d]`` of a batch (for inspection and tests; the models build their own):
        ``x`` the sample (with its noise, if any), ``mae`` the masked input ``M(X)``, ``view1`` / ``view2``
        the contrastive views ``X^+`` / ``X^{++}``."""
        x = patch_vectors(batch["feat_id"], batch["z"], self._const("V", batch["z"].device))
        if "noise" in batch:
            x = x + batch["noise"]
        mask = {"x": None, "mae": "mask", "view1": "mask1", "view2": "mask2"}[view]
        return x if mask is None else x.masked_fill(batch[mask].unsqueeze(-1), 0.0)


def _tile_shape(P: int, C_s: int) -> tuple[int, int]:
    """``(h, w)`` tiles of ``C_s`` patches that tile the ``sqrt(P) x sqrt(P)`` grid, as square as possible."""
    side = math.isqrt(P)
    if side * side != P:
        raise ConfigError("data.layout", f"'random' unless P is a perfect square (grid layout, P = {P})", "grid")
    shapes = [(h, C_s // h) for h in range(1, C_s + 1) if C_s % h == 0 and side % h == 0 and side % (C_s // h) == 0]
    if not shapes:
        raise ConfigError("data.layout", f"'random' unless the local area size C_s = {C_s} is an h x w tile "
                                         f"with h and w dividing the grid side {side}", "grid")
    return min(shapes, key=lambda s: abs(s[0] - s[1]))
