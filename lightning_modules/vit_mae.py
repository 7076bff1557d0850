"""Masked autoencoding with a one-layer softmax ViT (Huang et al. 2025, Def. 2.4, 2.5, eq. 2.8).

The masked input ``M(X)`` (exactly ``round(gamma P)`` patches replaced by 0) plus the fixed positional
encodings, ``X~ = M(X) + E``, gives keys and queries; the values are ``M(X)`` (no E). One trainable matrix
``Q`` (``W_Q^T W_K``), initialised to 0, no ``1/sqrt(d)`` scale; every key (masked ones too, value 0) takes
part in the softmax. The loss reconstructs the masked patches only::

    L = 1/2 mean_b sum_{p in M} || sum_q softmax_q(X~_p^T Q X~_q) M(X)_q - X_p ||^2

trained by plain SGD (``lr = eta``, no momentum) on fresh samples every step. A masked query is ``e_p``,
so only the positional rows ``E Q`` ever change, and the logits are exactly
``s_pq = 1{q in U} z_q Phi[p, f(q)] + Upsilon[p, q]`` with ``Phi = E Q V^T``, ``Upsilon = E Q E^T``.

Two paths (``path``):

* ``structured`` (default, the CPU path and the oracle): the parameters are ``Phi [P, K N]`` and
  ``Upsilon [P, P]`` themselves; cost ``O(B gamma P^2)`` (gathers by area and a scatter-add), no ``d``.
  SGD on them is SGD on ``Q`` exactly (the gradient of ``Q`` lies in their span and the bases are
  orthonormal), so both paths follow the same trajectory; noiseless data only.
* ``dense``: ``Q [d, d]``, shared query rows ``Y = E Q`` and the fused op
  :func:`featlearn.kernels.masked_attention.masked_attention` with the masked positions as ``query_index``.

Metrics (the quantities of Thm 4.1/4.2) every ``trainer.log_every_n_steps`` steps: the masked queries' area attention,
the correlations ``Phi`` and ``Upsilon``, the loss split into local and global masked patches against the batch's
own floor ``loss_floor*`` (:func:`featlearn.theory.vit.batch_loss_floor`, a bound of that batch's loss) and the
expected one ``theory/loss_floor*`` (:func:`featlearn.theory.vit.loss_floor`); figures every 4th logged step.

Example:
    >>> from featlearn.datamodules.global_local_patches import GlobalLocalPatchDataModule
    >>> dm = GlobalLocalPatchDataModule(P=64, K=2, kappa_c=0.75, kappa_s=0.5, batch_size=8)
    >>> model = ViTMAE(gamma=0.5).attach(dm)
    >>> loss = model.batch_loss(dm.batch(torch.arange(8), "train"))[0]
    >>> loss.backward(); float(model.phi.grad.abs().sum()) > 0
    True
"""
from __future__ import annotations

from typing import Literal

import torch

from featlearn.errors import ConfigError
from featlearn.kernels.backend import Backend, Precision
from featlearn.kernels.masked_attention import masked_attention
from featlearn.lightning_modules.vit_common import GlobalLocalViT, attention_sums, global_means
from featlearn.metrics import to_host
from featlearn.theory.vit import (area_loss, batch_loss_floor, eta_mae, init_loss, init_values, loss_floor,
                                  patch_vectors)
from featlearn.validation import OpenUnitInterval, PositiveFloat, check_args, check_memory

__all__ = ["ViTMAE"]


class ViTMAE(GlobalLocalViT):
    """One-layer softmax ViT trained by masked autoencoding (module docstring).

    Args:
        gamma: masking ratio (``round(gamma P)`` masked patches per sample).
        lr: SGD step ``eta`` (``null``: our rule ``0.02 K P / (gamma (1 - gamma) C_s E[z^3])``,
            :func:`featlearn.theory.vit.eta_mae`).
        path: ``structured`` (exact reduced parameters, CPU default) or ``dense`` (``Q [d, d]``, fused op).
        masked_keys: ``include`` (the paper) or ``exclude`` (ablation: masked keys leave the softmax).
        backend: backend of the fused op on the dense path (``auto``: Triton on CUDA).
        compile: run the loss under ``torch.compile`` (``null``: when the run is long enough to repay it).
        input_precision: its Triton dot precision (``ieee`` default: the correlations must match the
            structured path; ``tf32`` for speed).
    """
    compiled_loss = "batch_loss"

    GEMM_MAX_AREAS = 32  # the structured path's form: GEMMs up to this many areas, gather/scatter above

    def __init__(
        self,
        gamma: OpenUnitInterval = 0.75,
        lr: PositiveFloat | None = None,
        path: Literal["structured", "dense"] = "structured",
        masked_keys: Literal["include", "exclude"] = "include",
        backend: Backend = "auto",
        compile: bool | None = None,
        input_precision: Precision = "ieee",
    ):
        check_args("model", ViTMAE.__init__, locals())
        super().__init__()
        self.save_hyperparameters()
        self.gamma, self.path, self.masked_keys = float(gamma), path, masked_keys
        self.backend, self.input_precision = backend, input_precision

    # --- parameters ---------------------------------------------------------------------------
    def build(self, dm) -> None:
        if self.path == "structured" and dm.noise_var_arg:
            raise ConfigError("model.path", "'dense' with noisy data (data.noise_var > 0): the structured "
                                            "parametrisation is exact for noiseless data only", self.path)
        dm.use_mae_masks(self.gamma)
        self.build_common(dm)
        self.n_masked = dm.n_masked
        same = torch.zeros(dm.P, dm.P, dtype=torch.bool)
        for part in dm.partition:  # one cluster at a time: no (K, P, P) tensor
            same |= part.unsqueeze(-1) == part.unsqueeze(0)
        self.register_ground_truth("same_area", same)  # pairs in one area of some cluster (Upsilon summaries)
        P, KN, d = dm.P, dm.K * dm.n_areas, dm.d
        B = dm.batch_size or dm.sizes["train"]
        item = dm.dtype.itemsize
        if self.path == "structured":
            # parameters and gradients, per step the (B, Pq, P) logits, probabilities and their gradients
            needed = item * (2 * (P * KN + P * P) + 6 * B * self.n_masked * P)
            what = "Phi, Upsilon and one step's (B, Pq, P) attention"
        else:
            # Q and its gradient, per step x, the keys and the masked input (B, P, d) and the outputs (B, Pq, d)
            needed = item * (2 * d * d + 3 * B * P * d + 3 * B * self.n_masked * d)
            what = f"Q ({d} x {d}) and one step's (B, P, d) patches"
        check_memory("data", type(dm), {"batch_size": B, "P": P}, needed, what)
        if self.path == "structured":
            self.phi = torch.nn.Parameter(torch.zeros(P, KN, dtype=dm.dtype))
            self.upsilon = torch.nn.Parameter(torch.zeros(P, P, dtype=dm.dtype))
        else:
            self.Q = torch.nn.Parameter(torch.zeros(d, d, dtype=dm.dtype))
        self.lr = self.hparams.lr if self.hparams.lr is not None else eta_mae(
            dm.P, dm.K, dm.C_s, self.gamma, self.z_moments[2])
        # masked keys out of the softmax: a fully masked area costs more than 1/2 z^2 (theory.loss_floor)
        self.z_min = (dm.z_low if dm.z_law == "uniform" else 1.0) if self.masked_keys == "exclude" else None
        self.floor = loss_floor(dm.P, dm.C_1, dm.C_s, dm.n_local, self.n_masked, self.z_moments[1], self.z_min)
        self.init = init_values(dm.P, dm.C_1, dm.C_s, self.n_masked, masked_query=True)
        self.init_loss = init_loss(dm.P, dm.C_1, dm.C_s, dm.n_local, self.n_masked, self.z_moments[1])
        # colour scale of the one-sample attention map: twice what a query gives each unmasked patch of its
        # own local area once it attends to that area only
        self.sample_vmax = min(1.0, 2.0 / max(1.0, (1 - self.gamma) * dm.C_s))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.0, weight_decay=0.0)

    def query_rows(self) -> torch.Tensor:
        if self.path == "dense":
            return self.E @ self.Q
        return self.upsilon @ self.E + self.phi @ self.V

    def Q_matrix(self) -> torch.Tensor:
        """The ``d x d`` matrix of either path: ``E^T (E Q)`` (the content rows of Q are 0 on both)."""
        return self.E.T @ self.query_rows()

    def correlations(self) -> torch.Tensor:
        return self.phi.detach().clone() if self.path == "structured" else super().correlations()

    def pp_correlations(self) -> torch.Tensor:
        """PP correlations ``Upsilon = E Q E^T`` ``[P, P]``."""
        return self.upsilon.detach().clone() if self.path == "structured" else self.query_rows().detach() @ self.E.T

    def heatmaps(self) -> dict[str, torch.Tensor]:
        order = self.row_order
        return {"correlation": self.correlations()[order], "upsilon": self.pp_correlations()[order][:, order]}

    # --- the model ------------------------------------------------------------------------------
    def structured_attention(self, batch: dict, query_pos: torch.Tensor, with_areas: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(attention [B, Pq, P], area sums [B, Pq, N + 1] or None)`` of the queries at ``query_pos [B, Pq]``
        from the reduced logits ``s_pq = 1{q in U} z_q Phi[p, f(q)] + Upsilon[p, q]`` (exact: only
        the positional rows of Q move, Lemma D.1).

        Two exact forms of the same numbers (up to float rounding), chosen by the area count N: up to
        ``GEMM_MAX_AREAS`` areas a batched GEMM of the queries' ``Phi`` rows with the keys' latent-weighted area
        one-hot (O(B Pq P N), BLAS speed), and a GEMM with the one-hot for the area sums; above it the
        O(B Pq P) gather of ``Phi`` by the key's area and a ``scatter_add`` for the sums. On one CPU thread the
        GEMM form is 1.3x faster at N = 9 and 17 and 1.1-1.4x slower at N = 63 and 129."""
        N = self.n_areas
        groups = self.key_groups(batch)
        phi_sel = self.phi.view(self.P, self.K, N)[query_pos, batch["cluster"].unsqueeze(-1)]   # [B, Pq, N]
        base = torch.nn.functional.embedding(query_pos, self.upsilon)                           # [B, Pq, P]
        keys = None
        if N <= self.GEMM_MAX_AREAS:
            keys = torch.nn.functional.one_hot(groups, N + 1).to(phi_sel.dtype)                   # [B, P, N + 1]
            weighted = keys[..., :N] * batch["z"].to(keys.dtype).unsqueeze(-1)
            s = torch.baddbmm(base, phi_sel, weighted.transpose(1, 2))
        else:
            phi_key = phi_sel.gather(2, batch["area"].unsqueeze(1).expand(-1, query_pos.shape[1], -1))
            s = base + phi_key * (batch["z"] * ~batch["mask"]).to(phi_sel.dtype).unsqueeze(1)
        if self.masked_keys == "exclude":
            s = s.masked_fill(batch["mask"].unsqueeze(1), float("-inf"))
        attn = torch.softmax(s, dim=-1)
        if not with_areas:
            return attn, None
        if keys is not None:
            return attn, attn @ keys
        return attn, attn.new_zeros(*attn.shape[:2], N + 1).scatter_add(2, groups.unsqueeze(1).expand_as(attn), attn)

    def key_groups(self, batch: dict) -> torch.Tensor:
        """``[B, P]`` area of every unmasked key, ``N`` for masked keys (the op's ``key_groups``)."""
        return torch.where(batch["mask"], self.n_areas, batch["area"])

    def batch_loss(self, batch: dict, with_areas: bool = False) -> tuple[torch.Tensor, torch.Tensor,
                                                                        torch.Tensor | None]:
        """``(L, per-query loss [B, Pq], area attention [B, Pq, N + 1] or None)`` of one batch; the area
        attention always on the structured path (it carries the loss), on the dense path when asked."""
        query_pos = batch["masked_idx"]
        own = batch["area"].gather(1, query_pos)
        if self.path == "structured":
            _, A = self.structured_attention(batch, query_pos, with_areas=True)
            per_query = area_loss(A, batch["z_area"], own)
        else:
            x = patch_vectors(batch["feat_id"], batch["z"], self.V)
            if "noise" in batch:
                x = x + batch["noise"]
            masked_x = x.masked_fill(batch["mask"].unsqueeze(-1), 0.0)
            out, A = masked_attention(
                self.E @ self.Q, masked_x + self.E, masked_x, query_index=query_pos,
                key_padding_mask=batch["mask"] if self.masked_keys == "exclude" else None,
                key_groups=self.key_groups(batch) if with_areas else None, n_groups=self.n_areas + 1 if with_areas else 0,
                backend=self.backend, input_precision=self.input_precision,
                check_values=self.global_step == 0)  # the sampler's indices: checked once, no per-step host sync
            target = x.gather(1, query_pos.unsqueeze(-1).expand(-1, -1, self.d))
            per_query = 0.5 * (out - target).square().sum(-1)
        return per_query.sum(1).mean(), per_query, A

    def metrics(self, batch: dict, per_query: torch.Tensor, A: torch.Tensor) -> dict[str, torch.Tensor]:
        """Attention and loss metrics of one batch (device tensors): ``loss`` (the objective), the per masked
        patch ``loss_per_patch``, ``loss_local``, ``loss_global`` and :func:`attention_sums`' summaries; under
        DDP those of the global batch (one all_reduce, so every rank calls it)."""
        query_pos, mask, area = batch["masked_idx"], batch["mask"], batch["area"]
        own = area.gather(1, query_pos)
        unmasked_count = torch.zeros(area.shape[0], self.n_areas, dtype=torch.int64, device=area.device)
        unmasked_count.scatter_add_(1, area, (~mask).long())
        visible = unmasked_count.gather(1, own) > 0
        local = (own > 0).to(per_query.dtype)
        pq = per_query.detach()
        # this batch's own bound: the expected one (self.floor) is not a bound of one batch's loss
        bound = batch_loss_floor(batch["z_area"].gather(1, own).to(pq.dtype), ~visible, self.n_areas - 1, self.z_min)
        pairs = attention_sums(A.detach(), own, visible)
        pairs.update({"loss": (pq.sum(), pq.new_tensor(pq.shape[0])),
                      "loss_per_patch": (pq.sum(), pq.new_tensor(pq.numel())),
                      "loss_local": ((pq * local).sum(), local.sum()),
                      "loss_global": ((pq * (1 - local)).sum(), (1 - local).sum()),
                      "loss_floor": (bound.sum(), pq.new_tensor(pq.numel())),
                      "loss_floor_local": ((bound * local).sum(), local.sum()),
                      "loss_floor_global": ((bound * (1 - local)).sum(), (1 - local).sum())})
        met = global_means(pairs)
        met["loss_ratio_init"] = met["loss_per_patch"] / self.init_loss["loss"]   # against the Q = 0 loss
        return met

    def upsilon_metrics(self) -> dict[str, torch.Tensor]:
        """Position-position summaries of ``|Upsilon|``: over the same-area pairs of each cluster (means averaged
        over the clusters, the max over them; ``same_local``: pairs in one local area), the diagonal and the
        pairs that share an area in no cluster (``other``). Device tensors, no host sync."""
        ups = self.pp_correlations().abs()
        diag = torch.eye(self.P, dtype=torch.bool, device=ups.device)

        def mean_max(where):
            w = where.to(ups.dtype)
            return (ups * w).sum() / w.sum().clamp_min(1.0), (ups * w).amax()   # |Upsilon| >= 0: 0 off `where`

        per_cluster = []
        for part in self.partition:  # one cluster at a time: no (K, P, P) tensor
            same = (part.unsqueeze(-1) == part.unsqueeze(0)) & ~diag
            per_cluster.append((*mean_max(same), mean_max(same & (part > 0).unsqueeze(-1))[0]))
        means, maxes, local_means = (torch.stack(v) for v in zip(*per_cluster))
        out = {"upsilon_same_area_absmean": means.mean(), "upsilon_same_area_absmax": maxes.amax(),
               "upsilon_same_local_absmean": local_means.mean()}
        for name, where in (("diag", diag), ("other", ~(self.same_area | diag))):
            out[f"upsilon_{name}_absmean"], out[f"upsilon_{name}_absmax"] = mean_max(where)
        return out

    # --- Lightning hooks ------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        due = self.theory_due()
        loss, per_query, A = self.batch_loss(batch, with_areas=due)
        self.remember_batch(batch)
        if due and self._trainer is not None:
            met = {f"train/{k}": v for k, v in self.metrics(batch, per_query, A).items()}
            # the floors beside the loss curves: theory/loss_floor, theory/loss_floor_local, theory/loss_floor_global
            met.update({f"theory/loss_{k}": torch.tensor(v) for k, v in self.floor.items()})
            self.log_metrics(met)
            if self.figures_now():
                self._log_figures(batch, A)
        return loss

    def finish_step(self, step: int) -> None:
        self.track_phi(step)
        if self._trainer is not None and self.theory_due():
            self.log_metrics({f"theory/{k}": v for k, v in {**self.phi_metrics(), **self.upsilon_metrics()}.items()})

    def validation_step(self, batch, batch_idx):
        loss, per_query, A = self.batch_loss(batch, with_areas=True)
        self.log_metrics(self.metrics(batch, per_query, A), prefix="val/")

    def evaluate(self, batch: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        _, per_query, A = self.batch_loss(batch, with_areas=True)
        return {**self.metrics(batch, per_query, A), **self.phi_metrics()}, A

    @torch.no_grad()
    def _log_figures(self, batch: dict, A: torch.Tensor) -> None:
        few = {k: v[:4] for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 1}
        attn = self.attention_of_all_queries(few)                                   # [<= 4, P, P]
        own = batch["area"].gather(1, batch["masked_idx"])
        self.log_attention_figures(A, own, self.sorted_map(attn[0], few["area"][0]), self.sample_vmax,
                                   maps=(attn, few["mask"]))

    @torch.no_grad()
    def attention_of_all_queries(self, batch: dict) -> torch.Tensor:
        """``[B, P, P]`` attention of every position as a query on the masked input (an unmasked query has
        the masked one's logits: the content rows of Q stay 0); for figures of a few samples."""
        B = batch["area"].shape[0]
        every = torch.arange(self.P, device=self.E.device).expand(B, -1)
        if self.path == "structured":
            return self.structured_attention(batch, every)[0]
        x = patch_vectors(batch["feat_id"], batch["z"], self.V).masked_fill(batch["mask"].unsqueeze(-1), 0.0)
        s = (self.E @ self.Q) @ (x + self.E).transpose(1, 2)
        if self.masked_keys == "exclude":
            s = s.masked_fill(batch["mask"].unsqueeze(1), float("-inf"))
        return torch.softmax(s, dim=-1)

    def final_metrics(self) -> dict[str, float]:
        """Own-area attention of local and global masked queries, local queries' attention to the global
        area, the final loss and the floor (per masked patch), the dip of ``phi_local_to_global`` and the
        init references, on the last training batch with the final parameters."""
        final = self.final_evaluation()
        if final is None:
            return {}
        met = final[0]
        host = {k: float(v) for k, v in to_host(met).items()}
        return {"own_area_local": host["attn_own_local_visible"], "own_area_local_all": host["attn_own_local"],
                "own_area_global": host["attn_own_global"], "attn_global": host["attn_glob_from_local"],
                "attn_to_masked": host["attn_to_masked"], "attn_other_local": host["attn_other_local"],
                "final_loss": host["loss_per_patch"], "loss_ratio_init": host["loss_ratio_init"],
                "loss_local": host["loss_local"], "loss_global": host["loss_global"],
                **{f"loss_floor{k}": host[f"loss_floor{k}"] for k in ("", "_local", "_global")},
                **{f"loss_floor{k}_expected": self.floor[f"floor{k}"] for k in ("", "_local", "_global")},
                "phi_local_own": host["phi_local_own"], "phi_global_own": host["phi_global_own"],
                "phi_local_to_global": host["phi_local_to_global"], "phi_other_absmax": host["phi_other_absmax"],
                "phi_local_features_absmean": host["phi_local_features_absmean"],
                "init_attn_own_local": self.init["attn_own_local"], "init_attn_own_global": self.init["attn_own_global"],
                "lr": float(self.lr), **self.final_common()}

