"""A linear self-attention of rank r learning linear regression in context (Shi 2024, Ch. 5 = Shi, Wei, Xu, Liang,
"Why Larger Language Models Do In-context Learning Differently?", ICML 2024, arXiv:2405.19592, Section 5.4).

One layer of linear self-attention (Eq. 5.1) predicts the query's label from a prompt of n examples as ``y_hat =
(u / rho) sum_i y_i x_i^T U x_q`` with ``rho = n`` (N in training, M at evaluation). Only ``Gamma = u U`` matters;
the model's scale is the rank of ``U = W_K^T W_Q`` with ``W_K, W_Q`` ``r x d``. Theorem 5.4.1 gives the best
rank-r model in closed form: ``Gamma* = Q diag(v*) Q^T``, the top r eigen-directions of the input covariance
``Lambda = Q D Q^T`` scaled by ``v_i* = N / ((N+1) lambda_i + tr D)``. The chapter analyses the optimum only;
here it is learned, by Adam on fresh prompts (``gradient: sample``) or on the exact population loss
(``population``), from a random start. Logged:

* ``train/loss``; ``val/loss``, the squared error on the validation prompts (``data.eval_examples`` examples with
  label noise ``data.eval_noise``), beside its exact value for the current ``Gamma``, ``theory/val_loss``
  (:func:`~featlearn.theory.icl_scale.expected_loss`).
* How close the model is to Theorem 5.4.1: ``theory/population_loss`` (the training objective's exact value),
  ``theory/oracle_loss`` (the rank-r optimum's), ``theory/excess_loss`` (their relative gap) and
  ``theory/gamma_error`` ``= ||Gamma - Gamma*|| / ||Gamma*||``.
* The noise sensitivity the chapter is about: ``theory/noise_coefficient``, ``d loss / d sigma^2 = tr(Lambda
  Gamma^T Lambda Gamma) / M`` (Theorem 5.4.2's ``tr(V^2 D^2) / M``), beside the optimum's
  ``theory/noise_coefficient_optimum``; a larger rank has a larger one (Theorem 5.4.3).
* The heat map ``Q^T Gamma Q`` (``heatmap/correlation``): ``Gamma`` in the eigenbasis, diagonal at the optimum.

Example:
    >>> from featlearn.datamodules.icl_regression import ICLRegressionDataModule
    >>> dm = ICLRegressionDataModule(d=4, N=8, batch_size=16)
    >>> model = LowRankLinearAttention(rank=2).attach(dm)
    >>> tuple(model.Gamma().shape), tuple(model(dm.batch(torch.arange(16), "train")).shape)
    ((4, 4), (16,))
"""
from __future__ import annotations

from typing import Literal

import torch

from featlearn.datamodules.icl_regression import ICLRegressionDataModule
from featlearn.errors import ConfigError
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.theory.icl_scale import expected_loss, optimal_scales, population_loss
from featlearn.validation import PositiveFloat, PositiveInt, check_args


class LowRankLinearAttention(FeatureLearningModule):
    """Rank-r linear self-attention for in-context regression (module docstring).

    Args:
        rank: ``r``, the rows of ``W_K`` and ``W_Q`` (at most the data's ``d``).
        gradient: ``sample`` (the squared error on a batch of fresh prompts) or ``population`` (the exact loss
            over the prompt distribution, :func:`~featlearn.theory.icl_scale.population_loss`; no samples drawn).
        init_scale: the standard deviation of ``W_K``'s and ``W_Q``'s i.i.d. Gaussian entries; ``u`` starts at 1.
        lr: Adam's step size; ``schedule: cosine`` anneals it to 0 over the run's steps (``constant``: kept).
        seed: the start's seed.
    """

    datamodule_class = ICLRegressionDataModule
    heatmap_axes = ("eigen-direction", "eigen-direction")
    seeds_vmap = True  # the loss is a pure function of the weights and the batch: several seeds, one vmap

    def __init__(self, rank: PositiveInt = 4, gradient: Literal["sample", "population"] = "sample",
                 init_scale: PositiveFloat = 0.1, lr: PositiveFloat = 1e-2,
                 schedule: Literal["cosine", "constant"] = "cosine", seed: int = 0):
        check_args("model", LowRankLinearAttention.__init__, locals())
        super().__init__()
        self.save_hyperparameters()
        self.gradient = gradient

    @property
    def samples_needed(self) -> bool:
        return self.gradient == "sample"

    def build(self, dm: ICLRegressionDataModule) -> None:
        hp, d = self.hparams, dm.d
        if hp.rank > d:
            raise ConfigError("model.rank", f"a rank in [1, d] = [1, {d}] (data.d)", hp.rank)
        self.d, self.N, self.M, self.sigma = d, dm.N, dm.M, dm.sigma
        gen = torch.Generator().manual_seed(hp.seed)
        W_K, W_Q = hp.init_scale * torch.randn(2, hp.rank, d, generator=gen)
        self.W_K, self.W_Q = torch.nn.Parameter(W_K), torch.nn.Parameter(W_Q)
        self.u = torch.nn.Parameter(torch.ones(()))
        v = optimal_scales(dm.eigenvalues, dm.N, hp.rank)
        # one colour scale for every rank of these data: the full-rank optimum's largest entry
        self.heatmap_scale = float(optimal_scales(dm.eigenvalues, dm.N, d).max())
        self.register_ground_truth("covariance", dm.covariance.float())
        self.register_ground_truth("basis", dm.basis.float())
        G_star = dm.basis @ torch.diag(v) @ dm.basis.T
        self.register_ground_truth("Gamma_star", G_star.float())
        self.oracle_loss = float(population_loss(G_star, dm.covariance, dm.N))  # float64, unrounded

    # --- the network -------------------------------------------------------------------------------
    def Gamma(self) -> torch.Tensor:
        """``u W_K^T W_Q`` ``[d, d]``, the only combination of the weights the prediction depends on."""
        return self.u * self.W_K.T @ self.W_Q

    def forward(self, batch: dict) -> torch.Tensor:
        """``y_hat [B] = (u / n) sum_i y_i x_i^T U x_q`` over each prompt's n examples."""
        X, y = batch["X"], batch["y"]
        h = torch.einsum("bn,bnd->bd", y, X) / X.shape[1]
        return torch.einsum("bd,de,be->b", h, self.Gamma(), batch["x_q"])

    def seed_loss(self, batch) -> torch.Tensor:
        if self.gradient == "population":
            return population_loss(self.Gamma(), self.covariance, self.N)
        return (self(batch) - batch["y_q"]).square().mean()

    def training_step(self, batch, batch_idx):
        return self.record_step(self.seed_loss(batch), batch)

    def record_step(self, loss: torch.Tensor, batch) -> torch.Tensor:
        if self._trainer is not None and self.theory_due():
            self.log("train/loss", loss, sync_dist=self.gradient == "sample")
        return loss

    def configure_optimizers(self):
        return self.adam_cosine(self.hparams.lr, self.hparams.schedule)

    # --- evaluation --------------------------------------------------------------------------------
    def validation_step(self, batch, batch_idx):
        with torch.no_grad():
            loss = (self(batch) - batch["y_q"]).square().mean()
        self.log("val/loss", loss, sync_dist=True, batch_size=len(batch["y_q"]))

    def theory(self) -> dict[str, float]:
        """The exact quantities of the current ``Gamma`` against Theorem 5.4.1's optimum (module docstring)."""
        G, G_star, Lam = self.Gamma().detach().double(), self.Gamma_star.double(), self.covariance.double()
        loss, oracle = float(population_loss(G, Lam, self.N)), self.oracle_loss
        return {"population_loss": loss, "oracle_loss": oracle, "excess_loss": (loss - oracle) / oracle,
                "gamma_error": float((G - G_star).norm() / G_star.norm()),
                "val_loss": float(expected_loss(G, Lam, self.M, self.sigma)),
                "noise_coefficient": float(torch.trace(Lam @ G.T @ Lam @ G)) / self.M,
                "noise_coefficient_optimum": float(torch.trace(Lam @ G_star.T @ Lam @ G_star)) / self.M}

    def on_validation_epoch_end(self) -> None:
        for name, value in self.theory().items():
            self.log(f"theory/{name}", value)

    def correlations(self) -> torch.Tensor:
        """``Q^T Gamma Q``: ``Gamma`` in the covariance's eigenbasis (diagonal at the optimum)."""
        return (self.basis.T @ self.Gamma().detach() @ self.basis).detach()

    def final_metrics(self) -> dict[str, float]:
        """The exact quantities at the end (:meth:`theory`) and the last validation loss."""
        out = self.theory()
        value = self.logged("val/loss")
        if value is not None:
            out["val_loss_measured"] = float(value)
        return out
