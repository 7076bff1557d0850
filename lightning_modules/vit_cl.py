"""Contrastive learning with a one-layer softmax ViT (Huang et al. 2025, Def. 2.6, 2.7, eq. 2.11).

Queries are positional only, keys and values content only, and the output is mean-pooled over all P
queries::

    F(X) = 1/P sum_p sum_q softmax_q(e_p^T Q X_q) X_q                 (a masked key has X_q = 0: logit 0)

computed by :func:`featlearn.kernels.masked_attention.masked_attention` with the shared query rows
``W = E Q`` (``out.mean(1)``), or, on the PyTorch backend (``pooling="auto"`` on CPU), by the pooled form
``F = abar X`` with ``abar = 1/P 1^T softmax(W X^T)``: the same function with half the GEMMs,
as the op's output rows are never needed one by one. The pooled form takes the logits of all three views
from one product ``W X^T`` of the unmasked sample: a masked key is a zero patch, whose logit is exactly 0
and whose value adds nothing, so a view's logits are that product with its masked columns set to 0 (the
same numbers, bit for bit, as the product with the masked view; one GEMM instead of three). In the
canonical basis ``W = E Q`` is the first P rows of Q (``E = [I_P 0]``; again bit for bit).

The loss is InfoNCE on the raw inner product with stop-gradient candidates (eq. 2.3, 2.11): for anchor ``X_i^+``
(one masking of the noisy sample ``X_i``), the positive ``X_i^{++}`` (another masking of the same ``X_i``,
same noise) and the negatives, the unaugmented ``X_j`` of every other sample of the global batch
(``N_c = B - 1``)::

    L = mean_i  -tau log( exp(<F(X_i^+), sg F(X_i^{++})>/tau) / sum_{X' in {X_i^{++}} u {X_j}_{j != i}} exp(<F(X_i^+), sg F(X')>/tau) )
        + lambda/2 ||Q||_F^2

``tau = 1/ln d`` and ``lambda = 0`` by default; plain SGD (``lr = eta``). Only the anchor carries gradient,
so under DDP the negatives' representations are gathered from every rank without it, and a step on two
ranks equals one process's step on the global batch. Needs ``K (1 - gamma0) > 1`` for the collapse onto
the global area (our finding: same-cluster negatives are unmasked while the positive is masked, so the
global correlation's initial gradient goes as ``(1 - gamma0) - 1/K``, a term Lemma J.7 drops): a warning below 1.5.

Example:
    >>> from featlearn.datamodules.global_local_patches import GlobalLocalPatchDataModule
    >>> dm = GlobalLocalPatchDataModule(P=64, K=8, kappa_c=0.75, kappa_s=0.5, batch_size=8)
    >>> model = ViTCL().attach(dm)
    >>> loss = model.batch_loss(dm.batch(torch.arange(8), "train"))["loss"]
    >>> loss.backward(); float(model.Q.grad[:64].abs().sum()) > 0, float(model.Q.grad[64:].abs().sum())
    (True, 0.0)
"""
from __future__ import annotations

import math
import warnings
from typing import Literal

import torch
import torch.distributed as dist

from featlearn.errors import ConfigError
from featlearn.kernels.backend import Backend, Precision, resolve_backend
from featlearn.kernels.masked_attention import masked_attention
from featlearn.lightning_modules.vit_common import GlobalLocalViT, attention_sums, distributed, global_means
from featlearn.metrics import to_host
from featlearn.metrics.probes import all_gather_cat
from featlearn.papers import cite
from featlearn.theory.vit import cl_loss_floor, init_values, patch_vectors
from featlearn.validation import NonNegativeFloat, OpenUnitInterval, PositiveFloat, check_args, check_memory

__all__ = ["ViTCL", "infonce_in_batch"]


def infonce_in_batch(anchor: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor, own: torch.Tensor,
                     tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-anchor stop-gradient InfoNCE with in-batch negatives: ``(loss [B], positive probability [B])``.

    ``anchor [B, d]`` (differentiated), ``positive [B, d]``, ``negatives [M, d]`` (every sample of the global
    batch; detached here), ``own [B]`` the row of each anchor's own sample in ``negatives`` (left out).
    ``loss_i = tau (logsumexp_j s_ij / tau - s_i+ / tau)`` over the positive and ``j != own_i``.

    Example:
        >>> a, x = torch.eye(2), torch.eye(2)
        >>> loss, p = infonce_in_batch(a, x, x, torch.arange(2), 1.0)
        >>> [round(v, 4) for v in p.tolist()]      # e^1 / (e^1 + e^0)
        [0.7311, 0.7311]
    """
    pos = (anchor * positive.detach()).sum(-1, keepdim=True)
    neg = anchor @ negatives.detach().T
    neg = neg.scatter(1, own.unsqueeze(-1), float("-inf"))
    logits = torch.cat([pos, neg], 1) / tau
    lse = torch.logsumexp(logits, 1)
    loss = tau * (lse - logits[:, 0])
    return loss, torch.exp(logits[:, 0] - lse).detach()


class ViTCL(GlobalLocalViT):
    """One-layer softmax ViT trained by contrastive learning (module docstring).

    Args:
        gamma0: masking ratio of each augmented view (``round(gamma0 P)`` masked patches).
        lr: SGD step ``eta`` (``10^3 .. 10^4`` at P = 256: the gradients are tiny).
        temperature: ``tau`` (``null``: ``1 / ln d``).
        weight_decay: ``lambda`` of the ``lambda/2 ||Q||^2`` penalty (0 by default: the paper gives two
            conflicting values).
        pooling: ``op`` (the fused op, then the mean over queries), ``pooled`` (the column-mean form in
            PyTorch) or ``auto`` (``op`` when the op runs on Triton, else ``pooled``).
        backend: backend of the fused op (``auto``: Triton on CUDA).
        compile: run the loss under ``torch.compile`` (``null``: when the run is long enough to repay it).
        input_precision: its Triton dot precision (``ieee`` default; ``tf32`` for speed).
    """
    compiled_loss = "batch_loss"
    compile_pays_after = 3000  # 2x the measured break-even (docs/performance.md)

    def __init__(
        self,
        gamma0: OpenUnitInterval = 0.5,
        lr: PositiveFloat = 5000.0,
        temperature: PositiveFloat | None = None,
        weight_decay: NonNegativeFloat = 0.0,
        pooling: Literal["auto", "op", "pooled"] = "auto",
        backend: Backend = "auto",
        compile: bool | None = None,
        input_precision: Precision = "ieee",
    ):
        check_args("model", ViTCL.__init__, locals())
        super().__init__()
        self.save_hyperparameters()
        self.gamma0, self.lr = float(gamma0), float(lr)
        self.pooling, self.backend, self.input_precision = pooling, backend, input_precision

    def build(self, dm) -> None:
        dm.use_cl_views(self.gamma0)
        self.build_common(dm)
        B = dm.batch_size or dm.sizes["train"]
        if B < 2:
            raise ConfigError("data.batch_size", "at least 2 (the other samples of the batch are the negatives)", B)
        if dm.K * (1 - self.gamma0) <= 1.5:
            warnings.warn(f"model.gamma0 = {self.gamma0} with data.K = {dm.K}: K (1 - gamma0) = "
                          f"{dm.K * (1 - self.gamma0):.2f} <= 1.5; contrastive learning collapses onto the global "
                          f"area only if K (1 - gamma0) > 1 (the global correlation's initial gradient goes as "
                          f"(1 - gamma0) - 1/K, a term {cite('vit', 'Lemma J.7')} drops), and slowly near it",
                          stacklevel=2)
        P, d = dm.P, dm.d
        item = dm.dtype.itemsize
        # Q, its gradient; per step x, two views, noise (B, P, d), one view's (B, P, P) attention and its gradient
        check_memory("data", type(dm), {"batch_size": B, "P": P, "d": d},
                     item * (2 * d * d + 5 * B * P * d + 3 * B * P * P), "Q and one step's patches and attention")
        self.n_masked = dm.n_masked
        self.canonical = dm.basis == "canonical"  # E = [I_P 0]: E Q is Q's first P rows
        self.tau = self.hparams.temperature if self.hparams.temperature is not None else 1.0 / math.log(d)
        self.Q = torch.nn.Parameter(torch.zeros(d, d, dtype=dm.dtype))
        self.init = init_values(P, dm.C_1, dm.C_s, self.n_masked)
        self.sample_vmax = min(1.0, 4.0 / P)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.0, weight_decay=self.hparams.weight_decay)

    def query_rows(self) -> torch.Tensor:
        return self.Q[: self.P] if self.canonical else self.E @ self.Q

    # --- the model ------------------------------------------------------------------------------
    def use_op(self, rows: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether the views go through the fused op (``pooling``; ``auto``: when it runs on Triton)."""
        return self.pooling == "op" or (self.pooling == "auto" and resolve_backend(self.backend, rows, x) == "triton")

    def pooled(self, rows: torch.Tensor, x: torch.Tensor, groups: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(F [B, d], area attention [B, P, N + 1] or None)``: every position queries ``x`` with its row."""
        n_groups = self.n_areas + 1 if groups is not None else 0
        if self.use_op(rows, x):
            out, A = masked_attention(rows, x, x, key_groups=groups, n_groups=n_groups, backend=self.backend,
                                      input_precision=self.input_precision, check_values=self.global_step == 0)
            return out.mean(1), A
        return self.pooled_from_logits(rows @ x.transpose(1, 2), x, None, groups)

    def representation(self, batch: dict) -> torch.Tensor:
        """The pooled representation ``F [B, d]`` of the unmasked view, whose spectrum
        :class:`~featlearn.callbacks.RepresentationSpectrum` logs (CL's collapse shows there first)."""
        return self.pooled(self.query_rows(), self.sample_patches(batch))[0]

    def pooled_from_logits(self, logits: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None = None,
                           groups: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pooled form from the logits ``[B, P, P]`` of the view of ``x`` whose keys ``mask [B, P]`` are
        masked (zero patches: their logits must be 0 already; their values are dropped here)."""
        attn = torch.softmax(logits, dim=-1)                                     # [B, P, P]
        A = None
        if groups is not None:
            A = torch.zeros(*attn.shape[:2], self.n_areas + 1, dtype=attn.dtype, device=attn.device)
            A.scatter_add_(2, groups.unsqueeze(1).expand_as(attn), attn.detach())
        abar = attn.mean(1)
        if mask is not None:
            abar = abar.masked_fill(mask, 0.0)
        return (abar.unsqueeze(1) @ x).squeeze(1), A

    def sample_patches(self, batch: dict) -> torch.Tensor:
        """The noisy sample ``X = (z_p v_{f(p)})_p + noise`` ``[B, P, d]``. In the canonical basis ``v_{k,j}`` is
        coordinate ``P + k N + j``: the noise with ``z_p`` added there (the same numbers as the dense sum)."""
        if not self.canonical:
            return patch_vectors(batch["feat_id"], batch["z"], self.V) + batch["noise"]
        x = batch["noise"].clone()
        return x.scatter_add_(-1, (self.P + batch["feat_id"]).unsqueeze(-1), batch["z"].to(x.dtype).unsqueeze(-1))

    def batch_loss(self, batch: dict, with_areas: bool = False) -> dict[str, torch.Tensor]:
        """The loss of one batch and what the metrics read: ``loss``, ``per_anchor``, ``p_pos``, the anchors'
        representations ``F1`` and their area attention ``A`` (when asked)."""
        x = self.sample_patches(batch)
        m1, m2 = batch["mask1"], batch["mask2"]
        rows = self.query_rows()
        groups = torch.where(m1, self.n_areas, batch["area"]) if with_areas else None
        if self.use_op(rows, x):
            f1, A = self.pooled(rows, x.masked_fill(m1.unsqueeze(-1), 0.0), groups)
            with torch.no_grad():
                f2 = self.pooled(rows.detach(), x.masked_fill(m2.unsqueeze(-1), 0.0))[0]
                fx = self.pooled(rows.detach(), x)[0]
        else:  # one product for the three views: a masked key's logit is 0 (module docstring)
            logits = (rows @ x.transpose(1, 2)).contiguous()  # [B, P, P]; one layout for the three softmaxes
            f1, A = self.pooled_from_logits(logits.masked_fill(m1.unsqueeze(1), 0.0), x, m1, groups)
            with torch.no_grad():  # the anchor's graph saves no logits: the positive's view may overwrite them
                logits = logits.detach()
                fx = self.pooled_from_logits(logits, x)[0]
                f2 = self.pooled_from_logits(logits.masked_fill_(m2.unsqueeze(1), 0.0), x, m2)[0]
        own = torch.arange(x.shape[0], device=x.device)
        if distributed():
            own = own + dist.get_rank() * x.shape[0]  # every rank holds the same B (SyntheticDataModule)
            fx = all_gather_cat(fx)
        per_anchor, p_pos = infonce_in_batch(f1, f2, fx, own, self.tau)
        return {"loss": per_anchor.mean(), "per_anchor": per_anchor.detach(), "p_pos": p_pos, "F1": f1.detach(),
                "A": A, "n_neg": fx.shape[0] - 1}

    def metrics(self, batch: dict, out: dict) -> dict[str, torch.Tensor]:
        """The loss, the attention of every query of the anchor view, the positive probability, ``||Q||_F``,
        the noise picked up by the query rows and what the representation holds (device tensors); under DDP
        those of the global batch (one all_reduce over the anchors of every rank, so every rank calls it)."""
        area, m1 = batch["area"], batch["mask1"]
        unmasked_count = torch.zeros(area.shape[0], self.n_areas, dtype=torch.int64, device=area.device)
        unmasked_count.scatter_add_(1, area, (~m1).long())
        pairs = attention_sums(out["A"], area, unmasked_count.gather(1, area) > 0)
        content = (out["F1"] @ self.V.T).view(-1, self.K, self.n_areas)
        content = content[torch.arange(content.shape[0], device=content.device), batch["cluster"]].abs()
        B = out["per_anchor"].new_tensor(out["per_anchor"].shape[0])
        pairs.update({"loss": (out["per_anchor"].sum(), B), "p_pos": (out["p_pos"].sum(), B),
                      "repr_global": (content[:, 0].sum(), B),
                      "repr_local": (content[:, 1:].sum(), B * (self.n_areas - 1))})
        met = global_means(pairs)
        rows = self.query_rows().detach()
        residual = rows - (rows @ self.E.T) @ self.E - (rows @ self.V.T) @ self.V  # off span{e, v}: noise
        met.update({"q_fro": self.Q.detach().norm(), "noise_pickup": residual.norm(dim=1).mean()})
        return met

    # --- Lightning hooks ------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        due = self.theory_due()
        out = self.batch_loss(batch, with_areas=due)
        self.remember_batch(batch)
        if due and self._trainer is not None:
            met = {f"train/{k}": v for k, v in self.metrics(batch, out).items()}
            decay = 0.5 * self.hparams.weight_decay * self.Q.detach().square().sum()
            met["train/objective"] = met["train/loss"] + decay
            self.log_metrics(met)
            if self.figures_now():
                self._log_figures(batch, out["A"])
        return out["loss"]

    def finish_step(self, step: int) -> None:
        self.track_phi(step)
        if self._trainer is not None and self.theory_due():
            self.log_metrics({f"theory/{k}": v for k, v in self.phi_metrics().items()})

    def validation_step(self, batch, batch_idx):
        # the negatives of a validation anchor are the other samples of the global validation batch (gathered
        # from the ranks), and the means run over every rank's anchors: the values of one process that holds
        # the whole global batch
        self.log_metrics(self.metrics(batch, self.batch_loss(batch, with_areas=True)), prefix="val/")

    def evaluate(self, batch: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        out = self.batch_loss(batch, with_areas=True)
        met = {**self.metrics(batch, out), **self.phi_metrics(), "n_neg": torch.tensor(float(out["n_neg"]))}
        return met, out["A"]

    @torch.no_grad()
    def _log_figures(self, batch: dict, A: torch.Tensor) -> None:
        x = patch_vectors(batch["feat_id"][:4], batch["z"][:4], self.V) + batch["noise"][:4]
        x = x.masked_fill(batch["mask1"][:4].unsqueeze(-1), 0.0)
        attn = torch.softmax(self.query_rows() @ x.transpose(1, 2), dim=-1)          # [<= 4, P, P] on X+
        self.log_attention_figures(A, batch["area"], self.sorted_map(attn[0], batch["area"][0]), self.sample_vmax,
                                   maps=(attn, batch["mask1"][:4]))

    def final_metrics(self) -> dict[str, float]:
        """Own-area attention of local and global queries, local queries' attention to the global area (the
        collapse), the final loss against the cluster-only optimum, the positive probability and the
        correlations, on the last training batch with the final parameters."""
        final = self.final_evaluation()
        if final is None:
            return {}
        met = final[0]
        host = {k: float(v) for k, v in to_host(met).items()}
        return {"own_area_local": host["attn_own_local_visible"], "own_area_local_all": host["attn_own_local"],
                "own_area_global": host["attn_own_global"], "attn_global": host["attn_glob_from_local"],
                "attn_glob_all": host["attn_glob_all"], "attn_to_masked": host["attn_to_masked"],
                "attn_other_local": host["attn_other_local"], "final_loss": host["loss"],
                "loss_floor": cl_loss_floor(int(host["n_neg"]), self.K, self.tau), "p_pos": host["p_pos"],
                "phi_local_own": host["phi_local_own"], "phi_global_own": host["phi_global_own"],
                "phi_local_to_global": host["phi_local_to_global"], "phi_other_absmax": host["phi_other_absmax"],
                "phi_local_features_absmean": host["phi_local_features_absmean"],
                "noise_pickup": host["noise_pickup"], "q_fro": host["q_fro"],
                "init_attn_own_local": self.init["attn_own_local"],
                "init_attn_glob_from_local": self.init["attn_glob_from_local"], **self.final_common()}
