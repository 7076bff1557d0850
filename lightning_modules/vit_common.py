"""What the ViT methods of Huang et al. 2025 share: the ground truth they read from the data, the correlation and
attention metrics of its theorems, the running minimum of ``phi_local_to_global`` and the attention figures.

``ViTMAE`` (:mod:`featlearn.lightning_modules.vit_mae`) and ``ViTCL`` (:mod:`featlearn.lightning_modules.vit_cl`)
subclass :class:`GlobalLocalViT`; the only trainable parameter is ``Q`` (or, on the MAE structured path, its
exact reduction ``(Phi, Upsilon)``), initialised to 0.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from featlearn.datamodules.global_local_patches import GlobalLocalPatchDataModule
from featlearn.callbacks.divergence import check_guards
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.metrics import to_host
from featlearn.theory.vit import attention_diversity

FIGURE_EVERY = 4  # attention figures and histograms on every 4th logged step (and at the end of training)


def distributed() -> bool:
    """Whether this process is one of several DDP ranks."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def global_means(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{name: sum / count}`` over the samples of every rank: one ``all_reduce`` of the stacked sums and
    counts under DDP (so a metric is that of the global batch, whatever the device count), plain division
    in one process. Every rank must call it with the same names (a collective).

    Example:
        >>> global_means({"a": (torch.tensor(3.0), torch.tensor(2.0))})["a"]
        tensor(1.5000)
    """
    sums = torch.stack([torch.stack([s.detach().reshape(()), c.reshape(()).to(s.dtype)]) for s, c in pairs.values()])
    if distributed():
        dist.all_reduce(sums)
    means = sums[:, 0] / sums[:, 1].clamp_min(1.0)
    return dict(zip(pairs, means.unbind()))


def attention_sums(A: torch.Tensor, own: torch.Tensor, visible: torch.Tensor
                   ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The ``(sum, count)`` pairs behind :func:`attention_metrics` (to be reduced with other metrics'
    pairs in one :func:`global_means`)."""
    N = A.shape[-1] - 1
    own_attn = A.gather(-1, own.unsqueeze(-1)).squeeze(-1)
    local = own > 0
    other = A[..., 1:N].clone()
    other.scatter_(-1, (own - 1).clamp_min(0).unsqueeze(-1), 0.0)  # drop the own area (global queries: area 1's
    other_max = other.amax(-1) if N > 1 else torch.zeros_like(own_attn)  # slot is never read, they are not local)

    def part(values, where=None):
        if where is None:
            return values.sum(), values.new_tensor(values.numel())
        w = where.to(values.dtype)
        return (values * w).sum(), w.sum()

    return {"attn_own_local": part(own_attn, local), "attn_own_local_visible": part(own_attn, local & visible),
            "attn_own_global": part(own_attn, ~local), "attn_glob_from_local": part(A[..., 0], local),
            "attn_glob_all": part(A[..., 0]), "attn_to_masked": part(A[..., N]),
            "attn_other_local": part(other_max, local)}


def attention_metrics(A: torch.Tensor, own: torch.Tensor, visible: torch.Tensor) -> dict[str, torch.Tensor]:
    """Attention summaries from the area attention ``A [B, Pq, N + 1]`` (unmasked areas, then the
    masked keys), the area ``own [B, Pq]`` of each query (0 = global) and ``visible [B, Pq]`` (the query's own
    area has an unmasked patch, the event ``E_{k,n}`` of Lemma D.6). Device tensors, no host sync; under DDP
    means over every rank's queries (:func:`global_means`, a collective).

    ``attn_own_local`` / ``attn_own_global``: own-area attention of local / global queries
    (``attn_own_local_visible``: on the visible event only); ``attn_glob_from_local``: local queries'
    attention to the global area (``attn_glob_all``: every query's); ``attn_to_masked``;
    ``attn_other_local``: local queries' largest attention to another local area.

    Example:
        >>> A = torch.tensor([[[0.2, 0.7, 0.0, 0.1], [0.9, 0.0, 0.0, 0.1]]])
        >>> m = attention_metrics(A, torch.tensor([[1, 0]]), torch.tensor([[True, True]]))
        >>> round(float(m["attn_own_local"]), 3), round(float(m["attn_own_global"]), 3)
        (0.7, 0.9)
    """
    return global_means(attention_sums(A, own, visible))


def area_matrix(A: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Mean area attention by the query's area: ``[N, N + 1]`` (rows: query area, columns: key area, then
    masked keys), pooled over samples and clusters (area 0 is global in every cluster)."""
    N1 = A.shape[-1]
    sums = torch.zeros(N1 - 1, N1, dtype=A.dtype, device=A.device).index_add_(0, own.reshape(-1), A.reshape(-1, N1))
    counts = torch.bincount(own.reshape(-1), minlength=N1 - 1).to(A.dtype)
    return sums / counts.clamp_min(1.0).unsqueeze(-1)


class GlobalLocalViT(FeatureLearningModule):
    """Base of the ViT methods: reads the data once (:meth:`build_common`), computes the feature
    correlations ``Phi = E Q V^T`` metrics and tracks ``min_t phi_local_to_global`` on every step."""

    datamodule_class = GlobalLocalPatchDataModule
    heatmap_axes = ("position p (sorted by its area in cluster 0)", "feature v_{k,m} (k N + m)")
    # Both losses are bounded (attention outputs are convex combinations of bounded patches) and the MAE batch
    # loss is heavy-tailed near its floor (a batch with a fully masked area costs 1/2 z^2 per patch of it): the
    # loss is not watched. The weights start at 0, so their growth is measured against weight_norm_scale (set in
    # build_common): the shipped configs stay below 1.5x it (P = 256), while lr 1e6 (MAE) or 1e9 (CL) jumps to
    # ~1e4x it in one step and then sits in a saturated softmax that no longer learns.
    blowup_factors = {"loss": None, "weight_norm": 100.0}

    def build_common(self, dm: GlobalLocalPatchDataModule) -> None:
        self.P, self.K, self.d, self.n_areas = dm.P, dm.K, dm.d, dm.n_areas
        self.C_1, self.C_s, self.delta_eff = dm.C_1, dm.C_s, dm.delta_eff
        self.z_moments = dm.z_moments
        self.param_dtype = dm.dtype
        self.heatmap_scale = float(math.ceil(math.log(dm.P)))  # own-area correlations end near log(P / eps)
        # every one of the P query rows at that correlation: a softmax already close to one-hot
        self.weight_norm_scale = self.heatmap_scale * math.sqrt(dm.P)
        self.register_ground_truth("E", dm.E)
        self.register_ground_truth("V", dm.V)
        self.register_ground_truth("partition", dm.partition)
        # the flat positions of the local (cluster, position) pairs of phi_parts' [K, P] tensors, row-major:
        # indexing with them selects what the `local` mask does, in the same order, without the host sync
        # that a boolean-mask index makes on a GPU (it needs the mask's count) in the per-step tracking
        self.register_ground_truth("local_positions", (dm.partition > 0).flatten().nonzero().squeeze(1))
        # positions sorted by their area in cluster 0: the heat maps' row order
        self.register_ground_truth("row_order", torch.argsort(dm.partition[0], stable=True))
        # grid coordinates for the attention diversity of Huang et al. 2025, App. B (grid layout only)
        self.has_grid = dm.layout == "grid"
        if self.has_grid:
            self.register_ground_truth("grid_coords", dm.grid_coordinates())
        self.register_buffer("phi_l2g_min", torch.zeros((), dtype=torch.float64))
        self.register_buffer("phi_l2g_argmin", torch.zeros((), dtype=torch.float64))
        self.register_buffer("phi_local_own_step1", torch.zeros((), dtype=torch.float64))
        self._last_batch: dict | None = None
        self._final_eval: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None

    # --- correlations -----------------------------------------------------------------------------
    def query_rows(self) -> torch.Tensor:
        """``W = E Q`` ``[P, d]``: the rows a query at position p uses (``e_p^T Q``)."""
        raise NotImplementedError

    def correlations(self) -> torch.Tensor:
        """FP correlations ``Phi_{p -> v_{k,m}} = e_p^T Q v_{k,m}`` ``[P, K N]``."""
        return self.query_rows().detach() @ self.V.T

    def phi_parts(self, phi: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Own-area, to-global and other-area correlations of every (cluster, position): ``own``, ``glob``
        ``[K, P]``, ``local`` mask ``[K, P]``, ``other_absmax`` and ``local_features_absmean`` (the mean of
        ``|Phi_{p -> v_{k,m}}|`` over every position and local feature m > 0; scalars)."""
        phi = self.correlations() if phi is None else phi
        P, K, N = self.P, self.K, self.n_areas
        phi3 = phi.view(P, K, N).transpose(0, 1)                          # [K, P, N]
        own = phi3.gather(-1, self.partition.unsqueeze(-1)).squeeze(-1)
        keep = torch.ones_like(phi3, dtype=torch.bool)
        keep.scatter_(-1, self.partition.unsqueeze(-1), False)
        keep[..., 0] = False
        other = (phi3.abs() * keep).amax() if N > 1 else phi3.new_zeros(())
        local_abs = phi3[..., 1:].abs().mean() if N > 1 else phi3.new_zeros(())
        return {"own": own, "glob": phi3[..., 0], "local": self.partition > 0, "other_absmax": other,
                "local_features_absmean": local_abs}

    def phi_metrics(self) -> dict[str, torch.Tensor]:
        """The correlations of Huang et al. 2025, Thm 4.1-4.4: ``phi_global_own``, ``phi_local_own``,
        ``phi_local_to_global`` (with its running minimum and the step of that minimum), ``phi_other_absmax``,
        ``phi_local_features_absmean`` (device tensors)."""
        parts = self.phi_parts()
        local = parts["local"]
        return {"phi_global_own": parts["own"][~local].mean(), "phi_local_own": parts["own"][local].mean(),
                "phi_local_to_global": parts["glob"][local].mean(), "phi_other_absmax": parts["other_absmax"],
                "phi_local_features_absmean": parts["local_features_absmean"],
                "phi_local_to_global_min": self.phi_l2g_min, "phi_local_to_global_argmin_step": self.phi_l2g_argmin}

    @torch.no_grad()
    def track_phi(self, step: int) -> None:
        """Running minimum of ``phi_local_to_global`` and its step, on the device (no host sync)."""
        parts, local = self.phi_parts(), self.local_positions
        now = parts["glob"].flatten()[local].mean().to(torch.float64)
        lower = now < self.phi_l2g_min
        self.phi_l2g_min.copy_(torch.where(lower, now, self.phi_l2g_min))
        self.phi_l2g_argmin.copy_(torch.where(lower, torch.full_like(now, float(step)), self.phi_l2g_argmin))
        if step == 1:  # eta alpha^(0): how far the first step moved the local own-area correlation
            self.phi_local_own_step1.copy_(parts["own"].flatten()[local].mean())

    def heatmaps(self) -> dict[str, torch.Tensor]:
        return {"correlation": self.correlations()[self.row_order]}

    # --- the end of training ------------------------------------------------------------------------
    def evaluate(self, batch: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``(metrics of the global batch (device tensors), this rank's area attention A)`` of ``batch`` with
        the current parameters; collectives inside under DDP, so every rank calls it."""
        raise NotImplementedError

    def remember_batch(self, batch: dict) -> None:
        """Keep the last training batch for the end-of-training results (which it invalidates)."""
        self._last_batch, self._final_eval = batch, None

    def final_evaluation(self) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        """:meth:`evaluate` of the last training batch with the final parameters, computed once."""
        if self._final_eval is None and self._last_batch is not None:
            with torch.no_grad():
                self._final_eval = self.evaluate(self._last_batch)
        return self._final_eval

    def on_train_end(self) -> None:
        # Every rank evaluates the last batch here, before rank 0 alone draws and logs: the evaluation holds
        # collectives (the metrics' all_reduce, CL's all_gather of the negatives), which a call behind rank 0's
        # logger check would pair with another collective of rank 1 (a deadlock or garbage).
        final = self.final_evaluation()
        if final is not None and self.summary_writer() is not None:
            self._log_figures(self._last_batch, final[1])
        super().on_train_end()

    def _log_figures(self, batch: dict, A: torch.Tensor) -> None:
        raise NotImplementedError

    # --- logging ------------------------------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, torch.Tensor], prefix: str = "") -> None:
        """Log ``prefix + name`` for every metric (names ``train/...``, ``theory/...``, or ``prefix="val/"``).
        No ``sync_dist``: every value is already that of the global batch (:func:`global_means`' all_reduce)
        or a function of the parameters, the same on every rank."""
        host = to_host({k: v.detach().reshape(()) for k, v in metrics.items()})
        self.log_dict({prefix + k: float(v) for k, v in host.items()}, on_step=prefix != "val/",
                      on_epoch=prefix == "val/")

    def figures_due(self) -> bool:
        trainer = self._trainer
        return trainer is not None and (self.global_step // max(1, trainer.log_every_n_steps)) % FIGURE_EVERY == 0

    def figures_now(self) -> bool:
        """Whether this step draws the attention figures (rank 0 with TensorBoard, every few theory steps). On those
        steps every process first has the guard judge the kept steps (a read all processes make together), so
        diverged weights stop the run with its message rather than in a histogram of non-finite values."""
        if not self.figures_due():
            return False
        if self.seed_stack() is None:  # a stack judges its seeds after the step, never between two seeds' losses
            check_guards(self._trainer)
        return self.summary_writer() is not None

    def diversity(self, attn: torch.Tensor, masked: torch.Tensor) -> dict[str, torch.Tensor]:
        """The attention diversity of Huang et al. 2025, App. B (top-10,
        :func:`featlearn.theory.vit.attention_diversity`) of every query's attention ``attn [B, P, P]`` on the grid,
        averaged over the samples: with the masked keys (``masked [B, P]``) among the top-n (``diversity``) and
        without them (``diversity_unmasked``)."""
        top_n = min(10, self.P)
        keep = max(1, int((~masked).sum(1).min()))
        return {"diversity": attention_diversity(attn, self.grid_coords, top_n).mean(),
                "diversity_unmasked": attention_diversity(attn, self.grid_coords, min(top_n, keep), masked).mean()}

    def log_attention_figures(self, A: torch.Tensor, own: torch.Tensor, sample_map: torch.Tensor,
                              sample_vmax: float, maps: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The area-level attention matrix and one sample's query x key attention (sorted by area), with
        fixed colour scales, histograms of the own-area and to-global correlations and, on the grid layout,
        the attention diversity of ``maps = (attention of every query [b, P, P], masked keys [b, P])``."""
        writer = self.summary_writer()
        if writer is None:
            return
        step = self.global_step
        if maps is not None and self.has_grid:
            for name, value in self.diversity(*maps).items():
                writer.add_scalar(f"train/{name}", float(value), step)
        self.log_heatmap("attention/areas", area_matrix(A.detach(), own),
                         xlabel="key area (0 = global; last column: masked keys)", ylabel="query area (0 = global)",
                         vmax=1.0, diverging=False, title=f"mean area attention, step {step}")
        self.log_heatmap("attention/sample", sample_map, xlabel="key patch (sorted by area)",
                         ylabel="query patch (sorted by area)", vmax=sample_vmax, diverging=False,
                         title=f"attention of one sample, step {step}")
        parts = self.phi_parts()
        local = parts["local"]
        for name, values in (("phi/own_local", parts["own"][local]), ("phi/own_global", parts["own"][~local]),
                             ("phi/local_to_global", parts["glob"][local])):
            writer.add_histogram(name, values.detach().float().cpu(), step)

    @staticmethod
    def sorted_map(attn: torch.Tensor, area: torch.Tensor) -> torch.Tensor:
        """A ``[P, P]`` attention matrix of one sample with queries and keys sorted by area."""
        order = torch.argsort(area, stable=True)
        return attn[order][:, order]

    def final_common(self) -> dict[str, float]:
        host = to_host({"min": self.phi_l2g_min, "argmin": self.phi_l2g_argmin, "step1": self.phi_local_own_step1})
        return {"phi_local_to_global_min": float(host["min"]), "phi_local_to_global_argmin_step": float(host["argmin"]),
                "eta_alpha0_local": float(host["step1"]), "delta_eff": float(self.delta_eff)}
