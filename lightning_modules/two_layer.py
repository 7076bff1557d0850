"""Two-layer network with the truncated ReLU learning the F_Xi data (Shi 2024, Ch. 2, Sec. 2.3; Shi, Wei &
Liang 2022): :class:`TwoLayerNetwork` over :class:`TwoLayerBase`, the base its baselines share too (one class
per method, in :mod:`~featlearn.lightning_modules.two_layer_baselines`; the configs name it as ``class_path``).

``g(x) = sum_{i <= 2m} a_i sigma(<w_i, x> + b_i)``, ``sigma(z) = min(1, max(z, 0))``; in steps 1-2 the
activation is smoothed by Gaussian noise of std ``sigma_xi`` in closed form (the fused op
:func:`featlearn.kernels.smoothed_clamp.smoothed_clamp_layer`). Mirrored initialisation: for ``i <= m``,
``w_i ~ N(0, sigma_w^2 I)``, ``b_i ~ N(0, sigma_b^2)``, ``a_i ~ N(0, sigma_a^2)`` and
``(w_{m+i}, b_{m+i}, a_{m+i}) = (w_i, b_i, -a_i)``, so ``g = 0`` at init (``sigma_w = 1/k``, ``sigma_b = 1/k^2``,
``sigma_a = sigma~^2/(gamma k^2)``).

Loss: the hinge ``max(1 - y g, 0)`` (class-weighted by ``1/(2 Pr[y])`` in steps 1-2 with
``class_weighted``), plus ``lambda_a sum a_i^2 + lambda_w sum ||w_i||^2`` (b not regularised), minimised by
plain gradient steps ``theta <- (1 - 2 eta lambda) theta - eta grad L`` on the three-stage schedule of
Theorem A.20 (:func:`featlearn.theory.two_layer.theory_schedule`): step 1 full batch, erasing ``w``
(``lambda_w = 1/(2 eta)``: ``w <- -eta grad_w L``, applied as exactly that, not as a cancellation);
step 2 full batch, ``a, w <- -grad L``; steps 3..T minibatches, no smoothing. The data serves the
full-batch steps (:meth:`StructuredParityDataModule.use_full_batch_steps`). ``schedule: plain`` skips the
feature-learning steps (every step a stage-3 step): the "typical practice" training of the
mixture-of-Gaussians runs (Shi 2024, App. A.7.3), whose labelling has gamma = 0 (give ``sigma_a`` then).
The network without input structure is :class:`TwoLayerNetwork` on ``data.structure: false`` (its sigma_a and
eta^(1) use gamma of the structured distribution; F_Xi0 has gamma = 0).

Theory metrics: ``CosSim = max_i cos(w_i, sum_{j in A} M_j)`` at init and after steps 1, 2 and T, the
validation accuracy, and an MDS picture of the neuron directions after init, step 1 and step 2 (TensorBoard
``neurons/mds``; :meth:`~TwoLayerBase.neuron_picture`); on the Gaussian mixture also ``cos_centres_min`` /
``_mean``: over the 2^k cluster centres, the best neuron's cosine with each (``centre_coverage``).

Example:
    >>> from featlearn.datamodules.structured_parity import StructuredParityDataModule
    >>> dm = StructuredParityDataModule(dim=30, num_patterns=12, k=3, num_train=64, batch_size=16)
    >>> model = TwoLayerNetwork(width=8, steps=10).attach(dm)
    >>> batch = dm.sample(torch.arange(5), "train")
    >>> float(model(batch["x"]).detach().abs().max())   # mirrored init: g = 0
    0.0
    >>> model.schedule_at(1)["smoothing"], model.schedule_at(3)["smoothing"]
    (0.1111111111111111, 0.0)
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torchmetrics import MeanMetric

from featlearn.datamodules.structured_parity import StructuredParityDataModule
from featlearn.errors import ConfigError
from featlearn.kernels.backend import Backend, Precision
from featlearn.kernels.smoothed_clamp import smoothed_clamp_layer
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.lightning_modules.two_layer_parts import ScheduledGD, check_stage3_decay, draw_neurons, neuron_picture
from featlearn.theory.two_layer import centre_coverage, cos_sim, data_constants, hinge, theory_schedule
from featlearn.validation import NonNegativeFloat, PositiveFloat, PositiveInt, check_args, check_memory


class TwoLayerBase(FeatureLearningModule):
    """What every two-layer method shares (module docstring): the mirrored init, the schedule, the hinge
    loss, the metrics and the hooks. A method says what it trains: :meth:`init_parameters` (the trained
    tensors), ``feature_learning`` (False: every step a stage-3 step and no CosSim after steps 1-2, the
    NTK's) and ``frozen_after`` (the schedule steps before the first layer freezes, None: never).

    Args:
        width: m; the network has 2m neurons (mirrored pairs). Paper: 300 (parity), 100 (interval).
        schedule: ``A20`` (Theorem A.20, default), ``A17`` (Lemma A.17), ``A28`` (Theorem A.28) or
            ``plain`` (stage-3 steps from the first, no feature-learning steps; not for the probes).
        lr1_mult, smoothing_mult, lr3_mult, reg3_mult: multipliers of eta^(1), sigma_xi^(1,2), eta^(3..T)
            and lambda^(3..T) against the theory's formulas (the paper does not print its values).
        lr3a_mult: the second layer's own stage-3 multiplier (None: ``lr3_mult``, which alone at 0 freezes w, b).
        steps: T, the schedule's total number of steps (None: ``trainer.max_steps``).
        sigma_w, sigma_b, sigma_a: init stds (None: 1/k, 1/k^2, sigma~^2/(gamma k^2)).
        class_weighted: weight the hinge by 1/(2 Pr[y = v]) in steps 1-2 (the general setting, App. A.8).
        init_seed: seed of the initialisation (None: the data seed). backend: the op's (``auto``: Triton on CUDA).
        compile: run the loss under ``torch.compile`` (``null``: when the run is long enough to repay it).
        input_precision: the op's GEMM precision on a GPU (``ieee`` default: w^(1) is ~1e-8 of b).
    """

    datamodule_class = StructuredParityDataModule
    compiled_loss = "stage_loss"
    heatmap_axes = ("neuron", "relevant pattern")
    # steps 1-2 replace the weights by gradients: the norm changes by orders of magnitude by design
    blowup_factors = {"loss": None, "weight_norm": None}
    step_size_fields = ("lr1_mult", "lr3_mult", "lr3a_mult")
    feature_learning = True
    frozen_after: int | None = None

    def __init__(
        self,
        width: PositiveInt = 300,
        schedule: Literal["A20", "A17", "A28", "plain"] = "A20",
        lr1_mult: PositiveFloat = 1.0, smoothing_mult: NonNegativeFloat = 1.0,
        lr3_mult: NonNegativeFloat = 1.0, reg3_mult: NonNegativeFloat = 1.0,
        lr3a_mult: PositiveFloat | None = None,
        steps: PositiveInt | None = None,
        sigma_w: PositiveFloat | None = None, sigma_b: NonNegativeFloat | None = None, sigma_a: PositiveFloat | None = None,
        class_weighted: bool = False,
        init_seed: int | None = None,
        backend: Backend = "auto", compile: bool | None = None, input_precision: Precision = "ieee",
    ):
        check_args("model", TwoLayerBase.__init__, locals())
        super().__init__()
        self.save_hyperparameters()
        self.width, self.backend = width, backend
        self.mults = {"lr1_mult": float(lr1_mult), "smoothing_mult": float(smoothing_mult),
                      "lr3_mult": float(lr3_mult), "reg3_mult": float(reg3_mult),
                      "lr3a_mult": None if lr3a_mult is None else float(lr3a_mult)}
        self.steps, self.class_weighted, self.init_seed = steps, class_weighted, init_seed
        self.init_std = (sigma_w, sigma_b, sigma_a)
        self.snapshots: dict[str, torch.Tensor] = {}
        # torchmetrics reduces sums and counts over ranks: the accuracy of the whole split under DDP
        self.split_accuracy = torch.nn.ModuleDict({"val": MeanMetric(), "test": MeanMetric()})

    # --- parameters ---------------------------------------------------------------------------
    def build(self, dm: StructuredParityDataModule) -> None:
        m, d, k, dtype = self.width, dm.dim, dm.k, dm.dtype
        # W, its gradient, the init copy (ntk) and three MDS snapshots
        check_memory("model", TwoLayerBase.__init__, {"width": m}, 6 * dtype.itemsize * 2 * m * (d + 2),
                     f"{2 * m} neurons of dimension {d}", device="cpu")
        # the hyperparameters come from the structured distribution: F_Xi0 has gamma = 0
        design = data_constants(dm.labeling, k, dm.num_patterns, dm.p_o, True, dm.relevant_prob, *dm.interval,
                                dm.neg_fraction, dm.mog_noise, d)
        self.k, self.gamma, self.sigma_tilde = k, design["gamma"], math.sqrt(design["sigma2"])
        self.p_min = dm.constants["p_min"]
        self.class_weights = (1 / (2 * dm.constants["prob_pos"]), 1 / (2 * (1 - dm.constants["prob_pos"])))
        sw, sb, sa = self.init_std
        if self.gamma <= 0 and self.hparams.schedule != "plain":
            raise ConfigError("data.labeling", "a labelling with label correlation gamma > 0 on A (the init scale "
                                               "sigma_a and eta^(1) divide by it; schedule: plain has no eta^(1))",
                              dm.labeling)
        if self.gamma <= 0 and sa is None:
            raise ConfigError("model.sigma_a", "set when the labelling has gamma = 0 (its default "
                                               "sigma~^2/(gamma k^2) divides by gamma)", sa)
        sw = 1 / k if sw is None else sw
        sb = 1 / k ** 2 if sb is None else sb
        sa = self.sigma_tilde ** 2 / (self.gamma * k ** 2) if sa is None else sa
        self.init_values = {"sigma_w": sw, "sigma_b": sb, "sigma_a": sa}
        w = dm.initial_normals((m, d), self.init_seed, 0) * sw
        b = dm.initial_normals((m,), self.init_seed, 1) * sb
        a = dm.initial_normals((m,), self.init_seed, 2) * sa
        w, b, a = torch.cat([w, w]).to(dtype), torch.cat([b, b]).to(dtype), torch.cat([a, -a]).to(dtype)
        self.init_parameters(w, b, a)
        self.register_ground_truth("features", dm.features)
        self.register_ground_truth("direction", dm.target_direction.to(dtype))
        if dm.centres is not None:
            self.register_ground_truth("centres", dm.centres.to(dtype))
        self.register_buffer("cos_stages", torch.full((4,), float("nan"), dtype=torch.float64))
        self.register_buffer("val_acc", torch.full((), float("nan"), dtype=torch.float64))
        self.cos_stages[0] = cos_sim(w.double(), dm.target_direction)
        self.snapshots["init"] = w[: min(m, 150)].clone()
        # every method takes the same batches: steps 1-2 full batch (the schedule's), then minibatches; an
        # exact readout reads the whole training split at its step
        readout = self.readout_step()
        dm.use_full_batch_steps(0 if self.hparams.schedule == "plain" else max(2, readout or 0))

    def init_parameters(self, w: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> None:
        """Register the trained tensors from the mirrored init ``(w, b, a)``: here the network's own."""
        self.w, self.b, self.a = torch.nn.Parameter(w), torch.nn.Parameter(b), torch.nn.Parameter(a)

    def trained(self) -> dict[str, torch.nn.Parameter]:
        return {"a": self.a, "w": self.w, "b": self.b}  # the optimiser's groups, set by the schedule

    def first_layer(self) -> torch.Tensor:
        """The first-layer weights ``[2m, d]``."""
        return self.w.detach()

    # --- schedule -------------------------------------------------------------------------------
    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        trainer = self._trainer
        if trainer is None or trainer.max_steps is None or trainer.max_steps < 1:
            raise ConfigError("model.steps", "set, or trainer.max_steps >= 1 (the schedule's T)",
                              None if trainer is None else trainer.max_steps)
        return trainer.max_steps

    def readout_step(self) -> int | None:
        return None  # the step at which a probe's second layer is solved exactly (none: every step a GD step)

    @property
    def tunes_lr3(self) -> bool:
        """Whether the stage-3 step size changes anything (not for a probe solved exactly)."""
        return self.readout_step() is None

    def theory_values(self) -> dict[str, float]:
        return theory_schedule(self.k, self.width, self.gamma, self.sigma_tilde, self.total_steps(),
                               self.hparams.schedule, self.p_min, **self.mults)

    def schedule_at(self, step: int) -> dict:
        """Step ``step`` (1 for the first): its stage, smoothing, and per group (a, w, b) ``(lr, decay)``."""
        th = self.theory_values()
        frozen = self.frozen_after
        stage = 3 if not self.feature_learning or self.hparams.schedule == "plain" else min(step, 3)
        if frozen is not None and step > frozen:
            stage = 3
        decay3, decay3a = (1 - 2 * th[lr] * th["reg3"] for lr in ("lr3", "lr3a"))
        if stage == 1:
            groups = {"a": (th["lr1"], 1.0), "w": (th["lr1"], 0.0), "b": (th["lr1"], 1.0)}
        elif stage == 2:
            groups = {"a": (1.0, 0.0), "w": (1.0, 0.0), "b": (1.0, 1.0)}
        else:
            groups = {"a": (th["lr3a"], decay3a), "w": (th["lr3"], decay3), "b": (th["lr3"], 1.0)}
        if frozen is not None and step > frozen:
            groups["w"] = groups["b"] = (0.0, 1.0)
        readout = self.readout_step()
        if readout is not None and step >= readout:
            groups["a"] = (0.0, 1.0)  # solved at the readout step, not stepped
        smoothing = th["smoothing1"] if stage == 1 else th["smoothing2"] if stage == 2 else 0.0
        return {"stage": stage, "smoothing": smoothing, "groups": groups}

    # --- model ----------------------------------------------------------------------------------
    def hidden(self, x: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
        """``sigma_s(x W^T + b)`` ``[B, 2m]`` through the fused op."""
        return smoothed_clamp_layer(x, self.w, self.b, smoothing, backend=self.backend,
                                    input_precision=self.hparams.input_precision)

    def forward(self, x: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
        h, m = self.hidden(x, smoothing), self.width
        # the two halves apart: the mirrored pairs then cancel exactly at init (one sum would round)
        return h[:, :m] @ self.a[:m] + h[:, m:] @ self.a[m:]

    def batch_loss(self, batch: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        sched = self.schedule_at(step)
        return self.stage_loss(batch, sched["smoothing"], self.class_weighted and sched["stage"] < 3)

    def stage_loss(self, batch: dict[str, torch.Tensor], smoothing: float, weighted: bool) -> torch.Tensor:
        """The hinge loss at one stage's smoothing and class weighting (:attr:`compiled_loss`: a few values)."""
        y = batch["y"]
        g = self(batch["x"], smoothing)
        weight = None
        if weighted:
            pos, neg = self.class_weights
            weight = torch.where(y > 0, torch.full_like(y, pos), torch.full_like(y, neg))
        return hinge(y * g, weight)

    def correct(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``[B]`` whether ``sign(g(x)) == y`` (g = 0 counts as wrong: the mirrored init's g is 0 everywhere)."""
        return (self(x) * y) > 0

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor, chunk: int = 10000) -> float:
        """Fraction of :meth:`correct` samples, in chunks of ``chunk`` samples."""
        right = sum(int(self.correct(x[i:i + chunk], y[i:i + chunk]).sum()) for i in range(0, len(x), chunk))
        return right / len(x)

    # --- metrics --------------------------------------------------------------------------------
    def cos(self) -> float:
        return float(cos_sim(self.first_layer().double(), self.direction.double()))

    def correlations(self) -> torch.Tensor:
        """cos(w_i, M_j) for j in A: neuron x relevant pattern ``[2m, k]``."""
        w = self.first_layer()
        return (w @ self.features.T) / w.norm(dim=1, keepdim=True).clamp_min(1e-30)

    def snapshot_steps(self) -> tuple[int, int]:
        """The steps after init whose neuron directions the MDS picture shows: 1 and 2 (feature learning),
        or for the plain schedule 5/8 of the way and the end (the paper's epochs 50 and 80 of 80, Fig. A.12)."""
        if self.hparams.schedule == "plain":
            T = self.total_steps()
            return max(1, min(T - 1, round(5 * T / 8))), T
        return 1, 2

    def keeps_snapshot(self, step: int) -> bool:
        return True  # whether the first layer after ``step`` is one of the method's pictures (the network's: all)

    def neuron_picture(self) -> dict | None:
        """:func:`.neuron_picture` of the first 150 neurons after init and the two :meth:`snapshot_steps`
        (JSON-able; :func:`.draw_neurons` draws it); None before the last snapshot or for methods without them."""
        names = ["init", *(f"step{t}" for t in self.snapshot_steps())]
        if not set(names) <= set(self.snapshots):
            return None
        return neuron_picture({n: self.snapshots[n] for n in names}, self.direction, getattr(self, "centres", None),
                              self.k)

    def neuron_figure(self):  # None where neuron_picture is None
        return draw_neurons(self.neuron_picture())

    def final_metrics(self) -> dict[str, float]:
        """CosSim at init, after steps 1 and 2 and at the end, the last validation accuracy, and on the
        Gaussian mixture the worst and mean centre coverage of the final first layer."""
        names = ("cos_init", "cos_step1", "cos_step2", "cos_final")
        self.cos_stages[3] = self.cos()  # the weights now: a run may end before its last scheduled step
        out = {n: float(v) for n, v in zip(names, self.cos_stages.tolist()) if not math.isnan(v)}
        if hasattr(self, "centres"):
            cover = centre_coverage(self.first_layer().double(), self.centres.double())
            out["cos_centres_min"], out["cos_centres_mean"] = float(cover.min()), float(cover.mean())
        if not math.isnan(float(self.val_acc)):
            out["val_acc"] = float(self.val_acc)
        return out

    # --- Lightning hooks ------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        self.total_steps()  # refuse a schedule without T before the first step

    def prepare_step(self, optimizer) -> None:
        # the schedule's step sizes and decays, set before the closure runs the forward: a frozen layer's
        # requires_grad is off, so its backward GEMM is skipped
        for group in optimizer.param_groups:
            group["lr"], group["decay"] = self.schedule_at(self.global_step + 1)["groups"][group["name"]]
            for p in group["params"]:
                p.requires_grad_(group["lr"] != 0 or group["decay"] != 1)

    def log_step(self, loss: torch.Tensor, stage: int) -> None:
        """The training scalars: the batch's loss (averaged over ranks), the stage and CosSim."""
        self.log_dict({"train/loss": loss, "train/stage": float(stage), "theory/cos_sim": self.cos()},
                      on_step=True, on_epoch=False, sync_dist=True)

    def training_step(self, batch, batch_idx):
        step = self.global_step + 1
        sched = self.schedule_at(step)
        loss = self.batch_loss(batch, step)
        if self.theory_due() or step <= 2:
            self.log_step(loss.detach(), sched["stage"])
        return loss

    def finish_step(self, step: int) -> None:
        """Record CosSim after steps 1 and 2 (the final one is :meth:`final_metrics`'), and the MDS snapshots."""
        if step in (1, 2) and self.feature_learning and self.hparams.schedule != "plain":
            self.cos_stages[step] = self.cos()
        snaps = self.snapshot_steps()
        if step in snaps and self.keeps_snapshot(step):
            self.snapshots[f"step{step}"] = self.w.detach()[: min(self.width, 150)].clone()
            if step == snaps[1]:
                figure = self.neuron_figure()
                if figure is not None:
                    self.log_figure("neurons/mds", figure)

    def _log_accuracy(self, batch, split: str) -> None:
        metric = self.split_accuracy[split]
        metric.update(self.correct(batch["x"], batch["y"]).double())
        self.log(f"{split}/acc", metric, on_epoch=True, on_step=False)

    def validation_step(self, batch, batch_idx):
        self._log_accuracy(batch, "val")

    def on_validation_epoch_end(self) -> None:
        value = self.logged("val/acc")
        if value is not None:
            self.val_acc.fill_(float(value))

    def test_step(self, batch, batch_idx):
        self._log_accuracy(batch, "test")

    def configure_optimizers(self):
        check_stage3_decay(self.theory_values(), self.mults["reg3_mult"])  # before the first step
        return ScheduledGD([{"params": [p], "name": name} for name, p in self.trained().items()])


class TwoLayerNetwork(TwoLayerBase):
    """The two-layer network, all of it trained on the schedule (arguments: :class:`TwoLayerBase`)."""

