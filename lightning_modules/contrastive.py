"""Contrastive learning with and without RandomMask (Wen & Li 2021, Sec. 2.2-3, App. C-E).

Network: one hidden layer of ``m`` symmetrized-ReLU (soft-threshold) units
``h_i(x) = ReLU(<w_i,x> - b_i) - ReLU(-<w_i,x> - b_i)`` computed by
:func:`featlearn.kernels.soft_threshold.soft_threshold_layer` (fused Triton kernel on CUDA).

Objective (Wen & Li 2021, Def. 2.2; the gradient of App. A.1 with its sign corrected): per anchor
``L = -<f(x_a), sg f(x_q)> + tau * logsumexp_{x in {x_q} u Negatives} <f(x_a), sg f(x)> / tau``,
only the anchor receives gradient; SGD with ``lr = eta`` and ``weight_decay = lambda`` (penalty
``lambda/2 ||W||^2``, default ``lambda = d^-1.75``: the paper's range stalls stage III at small d).

Bias (Wen & Li 2021, Sec. 2.2 and App. D): ``bias_mode="schedule"`` (default) keeps ``b = 0`` until T1 (first step with
``min_i rho_i >= 1/2``; or a fixed ``bias_reset_step``, the same for every run), resets
``b_i = beta0 sqrt(2 log d / d) ||w_i||`` and then grows it by ``max(c_b eta/d, ||w_i^{t+1}||/||w_i^t|| - 1)``
per step, capped at ``kappa_b ||w_i||``; ``"zero"`` keeps ``b = 0`` (linear network: the linear control); ``"learned"`` trains ``b`` by
SGD (ablation of footnote 4; ``clamp_bias_nonneg`` optional). The bias update is part of
each optimisation step (``finish_step``), so checkpoints never hold a half-finished step.

Loss: :func:`featlearn.kernels.infonce.infonce_stopgrad`. Feature quantities (rho_i, singletons, coverage) and the
downstream probes: :mod:`featlearn.theory.contrastive`. Probes are fitted on one half of the validation split and
scored on the other after each validation epoch; ``trainer.test`` fits them on the validation split and scores
them on the test split, and :meth:`ContrastiveModule.summary` reports that.

Example:
    >>> from featlearn.datamodules.sparse_coding import SparseCodingDataModule
    >>> dm = SparseCodingDataModule(d=16, d1=64, batch_size=32, num_negatives=32)
    >>> model = ContrastiveModule().attach(dm)
    >>> loss = model.training_step(dm.batch(torch.arange(32), "train"), 0)
    >>> bool(torch.isfinite(loss))
    True
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from featlearn.datamodules.sparse_coding import SparseCodingDataModule, views_alike
from featlearn.errors import ConfigError
from featlearn.kernels.backend import Backend, Precision
from featlearn.kernels.infonce import infonce_stopgrad
from featlearn.kernels.soft_threshold import soft_threshold_layer
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.lightning_modules.contrastive_regularization import ContrastiveRegularization, start_from_checkpoint
from featlearn.metrics.probes import SplitBuffer, all_gather_cat
from featlearn.theory.contrastive import (EVAL_KEYS, advance_stages, downstream_metrics, feature_histograms,
                                          feature_metrics, feature_scalars, grown_bias, tags)
from featlearn.validation import NonNegativeFloat, PositiveFloat, PositiveInt, check_args, check_memory, int_at_least

__all__ = ["ContrastiveModule"]


class ContrastiveModule(FeatureLearningModule):
    """Soft-threshold network trained by stop-gradient InfoNCE on sparse-coding data.

    Args:
        width: number of neurons ``m`` (``None``: ``width_mult * d``).
        width_mult: ``m / d`` when ``width`` is None (default 4: the paper's ``m = d^1.01`` leaves few lucky
            neurons per atom at small d).
        lr: SGD step ``eta`` (the paper's ``1/poly(d)`` is impractical; 2 at d=32 and 1 above work).
        weight_decay: ``lambda`` (``None``: ``d^-1.75``).
        temperature: ``tau`` (``None``: ``log d``).
        init_scale: ``sigma0`` (``None``: ``1/(d sqrt(d1))``).
        bias_mode: ``"schedule"`` (paper), ``"zero"`` (linear network) or ``"learned"`` (ablation).
        bias_reset_mult: ``beta0`` of the reset at T1. bias_cap_ratio: ``kappa_b`` (``None``: ``log d/sqrt d``).
        bias_min_rate_mult: ``c_b`` in the minimum growth rate ``c_b eta / d``.
        bias_reset_step: reset the scheduled bias at this step instead of at T1. T1 (``min_i rho_i >= 1/2``)
            depends on the run: without augmentation and with large ``d1/d`` it never comes, so the bias
            stays 0; a fixed step puts runs with and without augmentation on the same bias clock.
        clamp_bias_nonneg: clamp a learned bias at 0 after each step.
        loss_chunk_size: negatives per block in the streamed loss (``None``: all at once).
        backend: soft-threshold layer backend (``auto``/``torch``/``triton``). input_precision: the Triton GEMMs'
            operand precision (``ieee`` default: stage-I signals are ~1e-2 relative; ``tf32``/``auto`` for speed).
        probe_ridge: relative ridge of the regression probes. probe_max_samples: cap on probe samples.
        seed: seed of the weight initialisation (independent of the data seed).
        compile: run the loss under ``torch.compile`` (``null``: when the run is long enough to repay it).
        cr_reference: contrastive regularisation (Shi 2024, Prop. F.9): a checkpoint of this module
            (same width and d1) whose ``w`` (and bias) start the run and stay its reference.
        cr_gamma: the trust-region radius: after every step ``||w - w*||_F <= cr_gamma``
            (:class:`~featlearn.lightning_modules.contrastive_regularization.ContrastiveRegularization`).
    """

    # normal runs: weight norm up to 17x over 20 steps (stage II from a tiny init), |loss| up to 1.9x
    blowup_factors = {"loss": 100.0, "weight_norm": 1000.0}
    datamodule_class = SparseCodingDataModule
    compiled_loss, representation_input = "contrastive_loss", "x"  # f(x), clean inputs: the logged spectrum

    def __init__(
        self,
        width: PositiveInt | None = None,
        width_mult: PositiveFloat = 4.0,
        lr: PositiveFloat = 2.0,
        weight_decay: NonNegativeFloat | None = None,
        temperature: PositiveFloat | None = None,
        init_scale: PositiveFloat | None = None,
        bias_mode: Literal["schedule", "zero", "learned"] = "schedule",
        bias_reset_mult: NonNegativeFloat = 1.0,
        bias_cap_ratio: PositiveFloat | None = None,
        bias_min_rate_mult: NonNegativeFloat = 1.0,
        bias_reset_step: PositiveInt | None = None,
        clamp_bias_nonneg: bool = False,
        loss_chunk_size: PositiveInt | None = None,
        backend: Backend = "auto", compile: bool | None = None, input_precision: Precision = "ieee",
        probe_ridge: NonNegativeFloat = 1e-4,
        probe_max_samples: int_at_least(2) = 8000,  # the probes standardise features over their samples
        seed: int = 0,
        cr_reference: str | None = None,
        cr_gamma: PositiveFloat | None = None,
    ):
        check_args("model", ContrastiveModule.__init__, locals())
        if (cr_reference is None) != (cr_gamma is None):
            missing = "cr_gamma" if cr_gamma is None else "cr_reference"
            raise ConfigError(f"model.{missing}", "set together with "
                              f"model.{'cr_reference' if missing == 'cr_gamma' else 'cr_gamma'}", None)
        super().__init__()
        self.save_hyperparameters()
        # the stage clocks T1, T2 on the device (-1: not yet): a step never waits for the host
        self.register_buffer("stage_steps", torch.full((2,), -1, dtype=torch.long), persistent=False)
        self._splits = SplitBuffer(EVAL_KEYS)
        self.val_metrics: dict[str, float] = {}
        self.test_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------
    def build(self, dm: SparseCodingDataModule) -> None:
        hp = self.hparams
        self.d, self.d1 = dm.d, dm.d1
        self.m = hp.width if hp.width is not None else max(1, int(round(hp.width_mult * dm.d)))
        # weights, gradient and initial copy; per step the anchors', positives' and negatives' activations
        # (pre-activation, output, gradient)
        anchors = dm.batch_size or dm.sizes["train"]
        keys = 2 * anchors + (anchors * dm.num_negatives if dm.negatives == "per_anchor" else dm.num_negatives)
        check_memory("model", ContrastiveModule.__init__,
                     {"width": hp.width} if hp.width is not None else {"width_mult": hp.width_mult},
                     4 * self.m * (3 * self.d1 + 3 * keys),
                     f"{self.m} neurons of dimension {self.d1} and their activations on {keys} inputs")
        self.lam = hp.weight_decay if hp.weight_decay is not None else dm.d ** -1.75
        self.tau = hp.temperature if hp.temperature is not None else math.log(dm.d)
        sigma0 = hp.init_scale if hp.init_scale is not None else 1.0 / (dm.d * math.sqrt(dm.d1))
        self.kappa_b = hp.bias_cap_ratio if hp.bias_cap_ratio is not None else math.log(dm.d) / math.sqrt(dm.d)
        gen = torch.Generator().manual_seed(hp.seed)
        self.w = torch.nn.Parameter(sigma0 * torch.randn(self.m, self.d1, generator=gen))
        zeros = torch.zeros(self.m)
        if hp.bias_mode == "learned":
            self.bias = torch.nn.Parameter(zeros)
        else:
            self.register_buffer("bias", zeros)
        self.register_ground_truth("M", dm.M)
        self.same_views = dm.augment == "none"  # x_q is x_a, which vmap's tensors cannot tell
        self.register_buffer("norm_T1", torch.zeros(self.m))
        self.register_buffer("rho_peak", torch.zeros(()), persistent=False)  # in the checkpoint's stage record
        self._prev_norm = None
        self.cr = None
        if hp.cr_reference is not None:
            start_from_checkpoint(self, "model.cr_reference", hp.cr_reference, ("w", "bias"))
            self.cr = ContrastiveRegularization(gamma=hp.cr_gamma).anchor({"w": self.w})

    def configure_optimizers(self):
        groups = [{"params": [self.w], "weight_decay": self.lam}]
        if self.hparams.bias_mode == "learned":
            groups.append({"params": [self.bias], "weight_decay": 0.0})
        return torch.optim.SGD(groups, lr=self.hparams.lr, momentum=0.0)

    # ------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, vmappable: bool = False) -> torch.Tensor:
        """Representation ``f(x) [.., m]`` of inputs ``[.., d1]`` (``vmappable``: the layer's form for vmap)."""
        shape = x.shape[:-1]
        h = soft_threshold_layer(x.reshape(-1, self.d1), self.w, self.bias, backend=self.hparams.backend,
                                 input_precision=self.hparams.input_precision, vmappable=vmappable)
        return h.reshape(*shape, self.m)

    def contrastive_loss(self, batch: dict, stats: bool = True) -> tuple[torch.Tensor, dict | None]:
        """The batch's mean loss and, with ``stats``, the logged batch statistics (else None: no extra passes)."""
        xa, xq, xn = batch["x_a"], batch["x_q"], batch["x_neg"]
        ha = self(xa)
        with torch.no_grad():
            hq = ha.detach() if views_alike(batch) else self(xq)
            hn = self(xn)
            if "neg_pool_size" in batch:
                hn = self._global_pool(hn, batch["index"], int(batch["neg_pool_size"]))
        loss, p_pos = infonce_stopgrad(ha, hq, hn, self.tau, self.hparams.loss_chunk_size)
        if not stats:
            return loss.mean(), None
        n_b = hn.shape[-2] + 1
        return loss.mean(), {
            "p_pos": p_pos.mean(), "uniform_dev": (p_pos - 1.0 / n_b).abs().mean(),
            "fire_anchor": (ha != 0).float().mean(), "fire_pos": (hq != 0).float().mean(),
            "fire_neg": (hn != 0).float().mean(), "active_per_sample": (ha != 0).float().sum(-1).mean(),
            "uniform": self.tau * math.log(n_b)}

    def _global_pool(self, h_owned: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
        """The shared pool of the global batch ``[size, m]`` from every device's own negatives ``[B, r, m]``.

        Representations (``m`` wide) are gathered rather than inputs (``d1`` wide), so each device
        encodes only its own ``B r ~ N / W`` negatives. They are gathered without gradient: the
        stop-gradient loss differentiates the anchor only. DDP then averages the per-device means over
        ``B`` anchors, which is the global mean because every device holds the same ``B``.
        """
        return self.datamodule_class.pool_negatives(all_gather_cat(h_owned), all_gather_cat(index), size)

    @property
    def seeds_vmap(self) -> bool:
        """Several seeds in one run step through one ``vmap`` of :meth:`seed_loss` on one process (several gather
        the negatives, which vmap cannot) unless the Triton kernels are asked for (they have no vmap rule); there
        the products follow torch's own float32 precision, not ``input_precision``."""
        return self.hparams.backend != "triton" and not (self._trainer is not None and self.trainer.world_size > 1)

    def seed_loss(self, batch: dict) -> torch.Tensor:
        """The step's mean loss from the two fused ops' vmappable PyTorch forms (:meth:`contrastive_loss`'s values;
        the gradient to rounding): a pure function of the weights and the batch, vmapped over a stack's seeds."""
        ha = self(batch["x_a"], vmappable=True)
        with torch.no_grad():
            hq = ha.detach() if self.same_views else self(batch["x_q"], vmappable=True)
            hn = self(batch["x_neg"], vmappable=True)
        return infonce_stopgrad(ha, hq, hn, self.tau, self.hparams.loss_chunk_size, vmappable=True)[0].mean()

    def record_step(self, loss: torch.Tensor, batch: dict) -> torch.Tensor:
        """A stacked seed's :meth:`training_step` after its vmapped loss (statistics: a forward without gradient)."""
        if "neg_pool_size" in batch or self.same_views != views_alike(batch):
            raise RuntimeError("ContrastiveModule.seed_loss: a batch of another datamodule (x_q is x_a: "
                               f"{not self.same_views}) or pooled on several processes")
        self._prev_norm = self.w.detach().norm(dim=1)
        if self._trainer is not None and self.theory_due():
            with torch.no_grad():
                self._log_step(loss, self.contrastive_loss(batch)[1])
        return loss

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self._prev_norm = self.w.detach().norm(dim=1)
        loss, st = self.contrastive_loss(batch, stats=self._trainer is not None and self.theory_due())
        if st is not None:  # only written steps: a self.log costs ~0.5 ms
            self._log_step(loss, st)
        return loss

    def _log_step(self, loss: torch.Tensor, st: dict) -> None:
        """A written step's loss and batch statistics (sync_dist: the global batch's means)."""
        self.log("train/loss", loss, sync_dist=True)
        self.log("train/loss_normalized", loss / st["uniform"], prog_bar=True, sync_dist=True)
        self.log("train/objective", loss.detach() + 0.5 * self.lam * (self.w.detach() ** 2).sum(), sync_dist=True)
        self.log_dict({"train/p_pos_mean": st["p_pos"], "train/uniform_dev": st["uniform_dev"],
                       "train/fire_rate_anchor": st["fire_anchor"], "train/fire_rate_pos": st["fire_pos"],
                       "train/fire_rate_neg": st["fire_neg"], "train/active_per_sample": st["active_per_sample"]},
                      sync_dist=True)

    # ------------------------------------------------------------------------------------------
    def finish_step(self, step: int) -> None:
        """Stage detection and bias update: part of each optimisation step."""
        hp = self.hparams
        w = self.w.detach()
        norm = w.norm(dim=1)
        rho = ((w @ self.M) ** 2).sum(1) / (norm ** 2).clamp_min(1e-30)
        torch.maximum(self.rho_peak, rho.mean(), out=self.rho_peak)
        at_t1 = advance_stages(self.stage_steps, self.norm_T1, rho, norm, self.d, step)
        if hp.bias_mode == "schedule":  # the reset at T1, else the growth (a no-op while b = 0, before the reset)
            grown = self.bias if self._prev_norm is None else grown_bias(
                self.bias, norm, self._prev_norm, hp.bias_min_rate_mult * hp.lr / self.d, self.kappa_b)
            reset = hp.bias_reset_mult * math.sqrt(2 * math.log(self.d) / self.d) * norm
            self.bias.copy_(torch.where(at_t1, reset, grown) if hp.bias_reset_step is None  # at T1, on the device
                            else reset if step == hp.bias_reset_step else grown)
        if hp.bias_mode == "learned" and hp.clamp_bias_nonneg:
            self.bias.clamp_(min=0.0)
        if self.cr is not None:
            self.cr.project_({"w": self.w})
        if self._trainer is not None and self.theory_due():
            self.log_dict(tags("theory", self.theory_metrics()), on_step=True, on_epoch=False)
            if self.global_step // self.trainer.log_every_n_steps % 4 == 0:  # every 4th theory step
                self._log_histograms()

    def _stage(self, i: int) -> int | None:
        return None if (step := int(self.stage_steps[i])) < 0 else step
    T1 = property(lambda self: self._stage(0), doc="The step at which stage II began, None before it (a host read).")
    T2 = property(lambda self: self._stage(1), doc="The step at which stage III began, None before it.")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["contrastive_stages"] = {"T1": self.T1, "T2": self.T2, "rho_peak": float(self.rho_peak)}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        st = checkpoint.get("contrastive_stages", {})
        self.stage_steps.copy_(torch.tensor([-1 if st.get(t) is None else st[t] for t in ("T1", "T2")]))
        self.rho_peak.fill_(st.get("rho_peak", 0.0))

    def _log_histograms(self) -> None:
        """TensorBoard histograms of rho_i, |alpha_ij| / ||w_i|| and |N_i|."""
        writer = self.summary_writer()
        if writer is not None:
            for tag, values in feature_histograms(self.w.detach(), self.bias.detach(), self.M, self.tau).items():
                writer.add_histogram(tag, values.cpu(), self.global_step)

    def theory_metrics(self) -> dict[str, float]:
        """The weight and feature quantities, the stages reached and the bias, moved to the host at once."""
        scalars = feature_scalars(feature_metrics(self.w.detach(), self.bias.detach(), self.M, self.tau))
        scalars["bias/mean"] = self.bias.detach().mean()
        values = torch.stack([v.float() for v in scalars.values()]).tolist()
        out = dict(zip(scalars, values))
        t1, t2 = self.T1, self.T2
        out["stage/id"] = 1.0 if t1 is None else (2.0 if t2 is None else 3.0)
        return {**out, **{f"stage/{name}": float(t) for name, t in (("T1", t1), ("T2", t2)) if t is not None}}

    # evaluation: probes and representation geometry on the fixed val/test splits, arriving as batches
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._splits.add("val", batch)

    def test_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._splits.add(("val", "test")[dataloader_idx], batch)  # SparseCodingDataModule.test_dataloader's order

    def on_validation_epoch_end(self) -> None:
        val = self._splits.take("val")
        half = len(val["x"]) // 2
        self.val_metrics = self.evaluate({k: v[:half] for k, v in val.items()}, {k: v[half:] for k, v in val.items()})
        self.log_dict(tags("val", self.val_metrics))

    def on_test_epoch_end(self) -> None:
        scored, theory = self.evaluate(self._splits.take("val"), self._splits.take("test")), self.theory_metrics()
        self.test_metrics = {**scored, **theory}
        self.log_dict({**tags("test", scored), **tags("theory", theory)}, add_dataloader_idx=False)

    def evaluate(self, train: dict, test: dict) -> dict[str, float]:
        """Probes fitted on ``train`` and scored on ``test`` (dicts of a split), plus geometry metrics."""
        return downstream_metrics(self, train, test, self.hparams.probe_ridge, self.hparams.probe_max_samples)

    def summary(self) -> dict[str, float]:
        """Final metrics for tables, after ``trainer.test``: feature metrics, stages, probes (fit on val, scored on test)."""
        if not self.test_metrics:
            raise RuntimeError("ContrastiveModule.summary: run trainer.test(model, datamodule=dm) first")
        return {**self.test_metrics, "stage/T1": float("nan") if self.T1 is None else float(self.T1),
                "stage/T2": float("nan") if self.T2 is None else float(self.T2),
                "weights/sparse_frac_peak": float(self.rho_peak), "m": float(self.m)}

    def final_metrics(self) -> dict[str, float]:
        """Coverage, singletons and sparse-energy fraction at the end of training, and the last validation
        probe's nMSE when a validation epoch ran."""
        theory = self.theory_metrics()
        keys = ("features/coverage", "features/singletons", "weights/sparse_frac_mean")
        return {**{k: theory[k] for k in keys},
                **{k: self.val_metrics[k] for k in ("probe/reg_nmse",) if k in self.val_metrics}}

    # ------------------------------------------------------------------------------------------
    def correlations(self) -> torch.Tensor:
        """Neuron x atom cosines ``<w_i, M_j> / ||w_i||`` ``[m, d]``."""
        w = self.w.detach()
        return (w @ self.M) / w.norm(dim=1, keepdim=True).clamp_min(1e-30)

    def heatmaps(self) -> dict[str, torch.Tensor]:
        """The correlations with rows sorted by the atom of largest ``|correlation|`` (the paper's feature picture)."""
        c = self.correlations()
        order = torch.argsort(c.abs().argmax(1) * 2.0 - c.abs().amax(1), stable=True)
        return {"correlation": c[order]}

