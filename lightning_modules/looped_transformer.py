"""A trainable looped linear transformer on in-context linear regression (Shi 2024, Ch. 8; the chapter builds
its weights by hand, :mod:`featlearn.theory.looped_transformer`, and trains nothing: training is our addition).

The network is the chapter's (Defs 8.6-8.7): the prompt ``Z = [[X, y], [q^T, alpha]]`` goes through ``loops``
loops of masked linear attention ``Z <- Z - eta_t (M o (Z Q Z^T)) Z P`` with weights ``Q, P`` ``(d+1) x (d+1)``
shared across loops; the output is ``-q``. The mask lets only the query row attend, and only to the n
examples, so only that row ``z = [q, alpha]`` changes, and a loop is ``z <- z (I - eta_t Q G P)`` with the
prompt's Gram matrix ``G = [X, y]^T [X, y]``: the module computes it so, ``O(d^2)`` per loop after ``G``, every
loop in one call of the fused op :func:`~featlearn.kernels.looped_linear_attention.looped_linear_attention`
(``tests/test_looped_transformer_module.py`` checks it against the definition's ``(n+1) x (n+1)`` form). With
Theorem 8.14's ``Q = I``, ``P = diag(I_d, 0)`` and ``eta_t = 1 / lambda_max(X^T X)`` the output is ``alpha``
times T steps of gradient descent.

What is learned (``init: random``): ``Q``, ``P`` and a step size per loop (``step_sizes: per_loop``) or one for
all (``shared``), by Adam over fresh prompts on the chapter's task, ``objective: inner``, ``E (<TF, theta*> -
alpha)^2`` (any ``q`` with ``<q, theta*> = alpha`` solves it: ``alpha theta*`` is one, ``alpha X^T y / ||y||^2``
another), or on ``objective: vector``, ``E ||TF - alpha theta*||^2`` (only ``alpha theta*``: the regression
gradient descent solves). Logged:

* ``train/loss``; at each validation, for each loop count L of ``eval_loops`` (default T, 2T, 4T: loops past
  the trained ones reuse the last loop's step size), the task's error ``val/error_loops<L>`` = mean
  ``|<TF, theta*> / alpha - 1|`` and the distance to gradient descent's target ``val/vector_error_loops<L>`` =
  mean ``||TF / alpha - theta*||``, each beside gradient descent's (``val/gd_error_loops<L>``,
  ``val/gd_vector_error_loops<L>``: the construction with ``eta = 1 / lambda_max`` of each prompt) and the bound
  ``theory/gd_bound_loops<L>`` = mean ``exp(-L / (2 kappa))`` (Theorem 8.16); ``val/cos_xty``, the mean cosine
  between ``TF`` and ``X^T y`` at T loops (1 for the ``X^T y / ||y||^2`` solution).
* Whether the construction is recovered, up to the model's symmetries (``Q, P -> cQ, P / c`` and a common sign
  change leave every output unchanged): ``theory/construction_cosine``, the cosine between the maps ``G -> Q G
  P`` learned and constructed, which is ``cos(Q, I) cos(P, diag(I, 0))``; ``theory/q_cosine``,
  ``theory/p_cosine``; heat maps of ``Q P`` (``heatmap/correlation``), ``Q`` and ``P``.

Example:
    >>> from featlearn.datamodules.linear_prompts import LinearPromptDataModule
    >>> dm = LinearPromptDataModule(d=3, n=8, batch_size=16)
    >>> model = LoopedLinearTransformer(loops=5, init="construction").attach(dm)
    >>> round(model.construction_cosine(), 6), tuple(model(dm.batch(torch.arange(16), "train")).shape)
    (1.0, (16, 3))
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from featlearn.datamodules.linear_prompts import LinearPromptDataModule
from featlearn.errors import ConfigError
from featlearn.kernels.backend import Backend, resolve_backend
from featlearn.kernels.looped_linear_attention import MAX_DIM, looped_linear_attention
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.theory.looped_transformer import condition_number, gd_construction, gradient_descent, step_size
from featlearn.validation import PositiveFloat, PositiveInt, check_args


class LoopedLinearTransformer(FeatureLearningModule):
    """The looped linear transformer (module docstring).

    Args:
        loops: loops T of one forward pass (weights shared across them).
        step_sizes: ``per_loop`` (a learned ``eta_t`` for each loop) or ``shared`` (one for all).
        objective: ``inner`` (the chapter's task) or ``vector`` (output ``alpha theta*``); module docstring.
        init: ``random`` (``Q, P`` with i.i.d. ``N(0, init_scale^2)`` entries) or ``construction`` (Theorem 8.14's).
            The step sizes start at ``1 / (sqrt(n) + sqrt(d))^2``, the typical ``1 / lambda_max(X^T X)``.
        init_scale: the entries' standard deviation of a random start.
        lr: Adam's step size; ``schedule: cosine`` anneals it to 0 over the run's steps (``constant``: kept).
        eval_loops: the loop counts evaluated at each validation (default ``[T, 2T, 4T]``).
        backend: the fused op's (``auto``: Triton on CUDA for ``d < 64``, PyTorch otherwise; ``triton`` needs
            ``d < 64``). Several seeds in one run step together through ``vmap`` on the PyTorch form only.
        seed: the random start's seed.
    """

    datamodule_class = LinearPromptDataModule
    heatmap_axes = ("row", "column")

    def __init__(self, loops: PositiveInt = 10, step_sizes: Literal["per_loop", "shared"] = "per_loop",
                 objective: Literal["inner", "vector"] = "inner", init: Literal["random", "construction"] = "random",
                 init_scale: PositiveFloat = 0.1, lr: PositiveFloat = 1e-2,
                 schedule: Literal["cosine", "constant"] = "cosine", eval_loops: list[PositiveInt] | None = None,
                 backend: Backend = "auto", seed: int = 0):
        check_args("model", LoopedLinearTransformer.__init__, locals())
        if eval_loops is not None and not eval_loops:
            raise ConfigError("model.eval_loops", "a non-empty list of loop counts, or null", eval_loops)
        super().__init__()
        self.save_hyperparameters()
        self.eval_loops = list(eval_loops) if eval_loops is not None else [loops, 2 * loops, 4 * loops]

    def build(self, dm: LinearPromptDataModule) -> None:
        hp, d = self.hparams, dm.d
        if hp.backend == "triton" and d + 1 > MAX_DIM:
            raise ConfigError("model.backend", f"'auto' or 'torch' for d >= {MAX_DIM} (the Triton loops hold "
                                               f"d + 1 <= {MAX_DIM})", hp.backend)
        self.d, self.n = d, dm.n
        construction = gd_construction(d, torch.float32)
        if hp.init == "construction":
            Q, P = construction
        else:
            gen = torch.Generator().manual_seed(hp.seed)
            Q, P = hp.init_scale * torch.randn(2, d + 1, d + 1, generator=gen)
        self.Q, self.P = torch.nn.Parameter(Q.clone()), torch.nn.Parameter(P.clone())
        eta0 = 1.0 / (math.sqrt(dm.n) + math.sqrt(d)) ** 2
        self.log_eta = torch.nn.Parameter(torch.full((hp.loops if hp.step_sizes == "per_loop" else 1,), math.log(eta0)))
        self.register_ground_truth("Q_star", construction[0])
        self.register_ground_truth("P_star", construction[1])

    # --- the network -------------------------------------------------------------------------------
    def step_sizes(self, loops: int) -> torch.Tensor:
        """``eta_0 .. eta_{loops-1}``; loops past the learned ones take the last learned step size."""
        eta = self.log_eta.exp()
        return eta[torch.arange(loops, device=eta.device).clamp_max(len(eta) - 1)]

    def forward(self, batch: dict, loops: int | None = None) -> torch.Tensor:
        """The output ``TF = -q`` ``[B, d]`` after ``loops`` loops (default T) on the batch's prompts."""
        loops = self.hparams.loops if loops is None else loops
        return self.outputs(batch, [loops])[loops]

    def op_backend(self) -> str:
        """The op's backend for this module's weights: ``auto`` resolved, PyTorch where Triton cannot take D."""
        if self.hparams.backend == "auto" and self.d + 1 > MAX_DIM:
            return "torch"
        return resolve_backend(self.hparams.backend, self.Q)

    @property
    def seeds_vmap(self) -> bool:
        """The loss is a pure function of the weights and the batch: several seeds run it in one vmap, on the
        op's PyTorch form (the Triton kernels have no vmap rule: each seed then steps in turn)."""
        return not self.built or self.op_backend() == "torch"

    def outputs(self, batch: dict, counts: list[int]) -> dict[int, torch.Tensor]:
        """``TF`` after each loop count of ``counts``, from one pass of ``max(counts)`` loops."""
        X, y, alpha = (batch[k].to(self.Q.dtype) for k in ("X", "y", "alpha"))
        examples = torch.cat([X, y.unsqueeze(-1)], dim=-1)                       # [B, n, d+1]
        z0 = torch.cat([torch.zeros_like(X[:, 0]), alpha.unsqueeze(-1)], dim=-1)  # [q, alpha], q = 0
        loops = max(counts)
        if loops == 0:
            return {0: -z0[:, :self.d]}
        Z = looped_linear_attention(examples.transpose(1, 2) @ examples, z0, self.Q, self.P, self.step_sizes(loops),
                                    backend=self.op_backend())  # [B, loops + 1, d+1]
        return {t: -Z[:, t, :self.d] for t in counts}

    def batch_loss(self, batch: dict, loops: int | None = None) -> torch.Tensor:
        """``mean (<TF, theta*> - alpha)^2`` (``objective: inner``) or ``mean ||TF - alpha theta*||^2`` (``vector``)."""
        return self.loss_of(self(batch, loops), batch)

    def loss_of(self, out: torch.Tensor, batch: dict) -> torch.Tensor:
        """:meth:`batch_loss` of the outputs ``out``."""
        theta, alpha = batch["theta"].to(self.Q.dtype), batch["alpha"].to(self.Q.dtype)
        if self.hparams.objective == "vector":
            return (out - alpha.unsqueeze(-1) * theta).square().sum(-1).mean()
        return ((out * theta).sum(-1) - alpha).square().mean()

    def seed_loss(self, batch: dict) -> torch.Tensor:
        return self.batch_loss(batch)

    def record_step(self, loss: torch.Tensor, batch: dict) -> torch.Tensor:
        if self._trainer is not None and self.theory_due():
            self.log("train/loss", loss, sync_dist=True)
        return loss

    def training_step(self, batch, batch_idx):
        return self.record_step(self.seed_loss(batch), batch)

    def configure_optimizers(self):
        return self.adam_cosine(self.hparams.lr, self.hparams.schedule)

    # --- evaluation --------------------------------------------------------------------------------
    def validation_step(self, batch, batch_idx):
        with torch.no_grad():
            for name, value in self.evaluate(batch).items():
                self.log(name, value, sync_dist=True, batch_size=len(batch["alpha"]))

    def evaluate(self, batch: dict) -> dict[str, float]:
        """Per loop count L: the model's and gradient descent's mean relative error and the bound (module
        docstring); the loss at T."""
        X = batch["X"].double()
        theta, alpha = batch["theta"].double(), batch["alpha"].double()
        eta, kappa = step_size(X), condition_number(X)
        gd = gradient_descent(X, batch["y"].double(), eta, max(self.eval_loops))
        xty = (X.transpose(1, 2) @ batch["y"].double().unsqueeze(-1)).squeeze(-1)
        T = self.hparams.loops
        tf = self.outputs(batch, [T, *self.eval_loops])  # one pass for every loop count
        out = {"val/loss": float(self.loss_of(tf[T], batch)),
               "val/cos_xty": float(torch.cosine_similarity(tf[T].double(), xty, dim=-1).mean())}
        for L in self.eval_loops:
            scaled = tf[L].double() / alpha.unsqueeze(-1)
            out[f"val/error_loops{L}"] = float(((scaled * theta).sum(-1) - 1).abs().mean())
            out[f"val/vector_error_loops{L}"] = float((scaled - theta).norm(dim=-1).mean())
            out[f"val/gd_error_loops{L}"] = float(((gd[L] * theta).sum(-1) - 1).abs().mean())
            out[f"val/gd_vector_error_loops{L}"] = float((gd[L] - theta).norm(dim=-1).mean())
            out[f"theory/gd_bound_loops{L}"] = float(torch.exp(-L / (2 * kappa)).mean())
        return out

    def construction_cosines(self) -> dict[str, float]:
        """``q_cosine = cos(Q, I)``, ``p_cosine = cos(P, diag(I, 0))`` and their product ``construction_cosine``,
        the cosine between the maps ``G -> Q G P`` (invariant to ``cQ, P / c`` and a common sign change)."""
        def cos(a, b):
            return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-30))
        q, p = cos(self.Q.detach(), self.Q_star), cos(self.P.detach(), self.P_star)
        return {"q_cosine": q, "p_cosine": p, "construction_cosine": q * p}

    def construction_cosine(self) -> float:
        return self.construction_cosines()["construction_cosine"]

    def on_validation_epoch_end(self) -> None:
        cosines = self.construction_cosines()
        for name, value in cosines.items():
            self.log(f"theory/{name}", value)
        self.log("theory/step_size_mean", float(self.log_eta.detach().exp().mean()))

    def correlations(self) -> torch.Tensor:
        """``Q P`` (the construction's is ``diag(I_d, 0)``, up to scale)."""
        return (self.Q @ self.P).detach()

    def heatmaps(self) -> dict[str, torch.Tensor]:
        return {"correlation": self.correlations(), "Q": self.Q.detach(), "P": self.P.detach()}

    def final_metrics(self) -> dict[str, float]:
        """The last validation's errors at every evaluated loop count, and the construction cosines."""
        out = self.construction_cosines()
        for L in self.eval_loops:
            for name in ["val/cos_xty", *(f"val/{kind}error_loops{L}" for kind in ("", "vector_", "gd_", "gd_vector_"))]:
                value = self.logged(name)
                if value is not None:
                    out[name.removeprefix("val/")] = float(value)
        return out
