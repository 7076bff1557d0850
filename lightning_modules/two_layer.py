"""Two-layer network with the truncated ReLU learning the F_Xi data (Shi 2024, Ch. 2, Sec. 2.3;
Shi, Wei & Liang 2022), and its fixed-feature baselines as modes of the same module.

``g(x) = sum_{i <= 2m} a_i sigma(<w_i, x> + b_i)``, ``sigma(z) = min(1, max(z, 0))``; in steps 1-2 the
activation is smoothed by Gaussian noise of std ``sigma_xi`` in closed form (the fused op
:func:`featlearn.kernels.smoothed_clamp.smoothed_clamp_layer`). Mirrored initialisation: for ``i <= m``,
``w_i ~ N(0, sigma_w^2 I)``, ``b_i ~ N(0, sigma_b^2)``, ``a_i ~ N(0, sigma_a^2)`` and
``(w_{m+i}, b_{m+i}, a_{m+i}) = (w_i, b_i, -a_i)``, so ``g = 0`` at init (``sigma_w = 1/k``,
``sigma_b = 1/k^2``, ``sigma_a = sigma~^2/(gamma k^2)``).

Loss: the hinge ``max(1 - y g, 0)`` (class-weighted by ``1/(2 Pr[y])`` in steps 1-2 with
``class_weighted``), plus ``lambda_a sum a_i^2 + lambda_w sum ||w_i||^2`` (b not regularised), minimised by
plain gradient steps ``theta <- (1 - 2 eta lambda) theta - eta grad L`` on the three-stage schedule of
Theorem A.20 (:func:`featlearn.theory.two_layer.theory_schedule`): step 1 full batch, erasing ``w``
(``lambda_w = 1/(2 eta)``: ``w <- -eta grad_w L``, applied as exactly that, not as a cancellation);
step 2 full batch, ``a, w <- -grad L``; steps 3..T minibatches, no smoothing. The data serves the
full-batch steps (:meth:`StructuredParityDataModule.use_full_batch_steps`). ``schedule: plain`` skips the
feature-learning steps (every step a stage-3 step): the "typical practice" training of the
mixture-of-Gaussians runs (Shi 2024, App. A.7.3), whose labelling has gamma = 0 (give ``sigma_a`` then).

``mode`` picks what is trained, every mode for the same T steps on the same batches, with the stage-3
step size ``lr3`` (tuned on the same grid for every mode by the experiment):

* ``network``: everything, on the schedule above;
* ``ntk``: the network linearised at its initialisation (Shi 2024, App. A.7.1),
  ``f(x) = sum_i da_i sigma(z_i) + sum_i a_i^(0) sigma'(z_i) (<dw_i, x> + db_i)`` with
  ``z_i = <w_i^(0), x> + b_i^(0)``: two GEMMs per batch, never the kernel matrix;
* ``rf``: the second layer only, first layer frozen at init (random features);
* ``one_step`` / ``two_step``: steps 1 (and 2) of the schedule, then the first layer frozen and "the best
  classifier" on the hidden layer (App. A.7.1; ``readout: best``): at the next step, a full-batch one, the
  second layer is set to :func:`~featlearn.theory.two_layer.best_linear_classifier` of the whole training
  split, and the remaining steps change nothing. ``readout: schedule`` trains it with the stage-3 steps
  instead, which at the theory's step size stops at the threshold rule (README, chapter 2).

The network without input structure is ``mode: network`` on ``data.structure: false``; its
hyperparameters (sigma_a, eta^(1)) use gamma of the structured distribution (F_Xi0 has gamma = 0).

Theory metrics: ``CosSim = max_i cos(w_i, sum_{j in A} M_j)`` at init and after steps 1, 2 and T (for
``ntk``, of ``w^(0) + dw``), the accuracy on the validation split, and an MDS picture of the neuron
directions after init, step 1 and step 2 (TensorBoard ``neurons/mds`` and :meth:`neuron_figure`). On the
Gaussian mixture also ``cos_centres_min`` / ``_mean``: over the 2^k cluster centres, the best neuron's
cosine with each (:func:`~featlearn.theory.two_layer.centre_coverage`).

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
from featlearn.kernels.smoothed_clamp import (gaussian_smoothed_clamp, gaussian_smoothed_clamp_derivative,
                                              smoothed_clamp_layer)
from featlearn.lightning_modules.base import FeatureLearningModule
from featlearn.metrics.figures import plt
from featlearn.theory.two_layer import (best_linear_classifier, centre_coverage, cos_sim, data_constants, hinge,
                                        mds_embedding, theory_schedule)
from featlearn.validation import NonNegativeFloat, PositiveFloat, PositiveInt, check_args, check_memory

MODES = ("network", "ntk", "rf", "one_step", "two_step")
_FROZEN_AFTER = {"rf": 0, "one_step": 1, "two_step": 2}  # steps of the schedule before the first layer freezes


class ScheduledGD(torch.optim.Optimizer):
    """Plain gradient steps ``p <- decay * p - lr * grad`` per parameter group; the module sets ``lr`` and
    ``decay = 1 - 2 lr lambda`` of every group before each step (the schedule), so ``decay = 0`` erases
    a parameter exactly instead of through the cancellation ``p - lr (grad + p / lr)``."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0, "decay": 1.0})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or not p.requires_grad:
                    continue
                if group["decay"] == 0:
                    torch.mul(p.grad, -group["lr"], out=p)
                else:
                    p.mul_(group["decay"]).add_(p.grad, alpha=-group["lr"])
        return loss


class TwoLayerNetwork(FeatureLearningModule):
    """Two-layer truncated-ReLU network and its baselines (module docstring).

    Args:
        width: m; the network has 2m neurons (mirrored pairs). Paper: 300 (parity), 100 (interval).
        mode: ``network``, ``ntk``, ``rf``, ``one_step`` or ``two_step``.
        schedule: ``A20`` (Theorem A.20, default), ``A17`` (Lemma A.17), ``A28`` (Theorem A.28) or
            ``plain`` (stage-3 steps from the first, no feature-learning steps; network, ntk, rf only).
        lr1_mult, smoothing_mult, lr3_mult, reg3_mult: multipliers of eta^(1), sigma_xi^(1,2), eta^(3..T)
            and lambda^(3..T) against the theory's formulas (the paper does not print its values).
        steps: T, the schedule's total number of steps (None: ``trainer.max_steps``).
        sigma_w, sigma_b, sigma_a: init stds (None: 1/k, 1/k^2, sigma~^2/(gamma k^2)).
        class_weighted: weight the hinge by 1/(2 Pr[y = v]) in steps 1-2 (the general setting, App. A.8).
        readout: ``best`` (the probes' second layer solved exactly, default) or ``schedule`` (stage-3 steps).
        readout_ridge: the ridge of the exact readout (a tiny one: the near-max-margin separator).
        init_seed: seed of the initialisation (None: the data seed).
        backend: the op's backend (``auto``: Triton on CUDA).
        input_precision: the op's GEMM precision on a GPU (``ieee`` default: w^(1) is ~1e-8 of b).
    """

    datamodule_class = StructuredParityDataModule
    heatmap_axes = ("neuron", "relevant pattern")
    # steps 1-2 replace the weights by gradients: the norm changes by orders of magnitude by design
    blowup_factors = {"loss": None, "weight_norm": None}

    def __init__(
        self,
        width: PositiveInt = 300,
        mode: Literal["network", "ntk", "rf", "one_step", "two_step"] = "network",
        schedule: Literal["A20", "A17", "A28", "plain"] = "A20",
        lr1_mult: PositiveFloat = 1.0,
        smoothing_mult: NonNegativeFloat = 1.0,
        lr3_mult: PositiveFloat = 1.0,
        reg3_mult: NonNegativeFloat = 1.0,
        steps: PositiveInt | None = None,
        sigma_w: PositiveFloat | None = None,
        sigma_b: NonNegativeFloat | None = None,
        sigma_a: PositiveFloat | None = None,
        class_weighted: bool = False,
        readout: Literal["best", "schedule"] = "best",
        readout_ridge: PositiveFloat = 1e-8,
        init_seed: int | None = None,
        backend: Backend = "auto",
        input_precision: Precision = "ieee",
    ):
        check_args("model", TwoLayerNetwork.__init__, locals())
        if schedule == "plain" and mode in ("one_step", "two_step"):
            raise ConfigError("model.schedule", f"a three-stage schedule (A20, A17, A28) for mode {mode} (its "
                                                f"features are those of steps 1-2)", schedule)
        super().__init__()
        self.save_hyperparameters()
        self.width, self.mode = width, mode
        self.mults = {"lr1_mult": float(lr1_mult), "smoothing_mult": float(smoothing_mult),
                      "lr3_mult": float(lr3_mult), "reg3_mult": float(reg3_mult)}
        self.steps, self.class_weighted, self.init_seed = steps, class_weighted, init_seed
        self.readout, self.readout_ridge = readout, float(readout_ridge)
        self.init_std = (sigma_w, sigma_b, sigma_a)
        self.backend = backend
        self.snapshots: dict[str, torch.Tensor] = {}
        # torchmetrics reduces sums and counts over ranks: the accuracy of the whole split under DDP
        self.split_accuracy = torch.nn.ModuleDict({"val": MeanMetric(), "test": MeanMetric()})
        self.automatic_optimization = True

    # --- parameters ---------------------------------------------------------------------------
    def build(self, dm: StructuredParityDataModule) -> None:
        m, d, k, dtype = self.width, dm.dim, dm.k, dm.dtype
        # W, its gradient, the init copy (ntk) and three MDS snapshots
        check_memory("model", TwoLayerNetwork.__init__, {"width": m}, 6 * dtype.itemsize * 2 * m * (d + 2),
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
        if self.mode == "ntk":
            self.register_buffer("w0", w)
            self.register_buffer("b0", b)
            self.register_buffer("a0", a)
            self.w = torch.nn.Parameter(torch.zeros_like(w))  # dw, db, da: the linearisation's parameters
            self.b = torch.nn.Parameter(torch.zeros_like(b))
            self.a = torch.nn.Parameter(torch.zeros_like(a))
        else:
            self.w, self.b, self.a = torch.nn.Parameter(w), torch.nn.Parameter(b), torch.nn.Parameter(a)
        self.register_ground_truth("features", dm.features)
        self.register_ground_truth("direction", dm.target_direction.to(dtype))
        if dm.centres is not None:
            self.register_ground_truth("centres", dm.centres.to(dtype))
        self.register_buffer("cos_stages", torch.full((4,), float("nan"), dtype=torch.float64))
        self.register_buffer("val_acc", torch.full((), float("nan"), dtype=torch.float64))
        self.cos_stages[0] = cos_sim(w.double(), dm.target_direction)
        self.snapshots["init"] = w[: min(m, 150)].clone()
        # every mode takes the same batches: steps 1-2 full batch (the schedule's), then minibatches; an
        # exact readout reads the whole training split at its step
        readout = self.readout_step()
        dm.use_full_batch_steps(0 if self.hparams.schedule == "plain" else max(2, readout or 0))

    def first_layer(self) -> torch.Tensor:
        """The first-layer weights ``[2m, d]`` (for ``ntk``, ``w^(0) + dw``)."""
        return (self.w0 + self.w if self.mode == "ntk" else self.w).detach()

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
        """The step at which the probes' second layer is solved exactly (the one after the first layer
        freezes), None where every step is a gradient step."""
        if self.readout != "best" or self.mode not in ("one_step", "two_step"):
            return None
        return _FROZEN_AFTER[self.mode] + 1

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
        frozen = _FROZEN_AFTER.get(self.mode)
        stage = 3 if self.mode in ("ntk", "rf") or self.hparams.schedule == "plain" else min(step, 3)
        if frozen is not None and step > frozen:
            stage = 3
        decay3 = 1 - 2 * th["lr3"] * th["reg3"]
        if stage == 1:
            groups = {"a": (th["lr1"], 1.0), "w": (th["lr1"], 0.0), "b": (th["lr1"], 1.0)}
        elif stage == 2:
            groups = {"a": (1.0, 0.0), "w": (1.0, 0.0), "b": (1.0, 1.0)}
        else:
            groups = {"a": (th["lr3"], decay3), "w": (th["lr3"], decay3), "b": (th["lr3"], 1.0)}
        if frozen is not None and step > frozen:
            groups["w"] = groups["b"] = (0.0, 1.0)
        readout = self.readout_step()
        if readout is not None and step >= readout:
            groups["a"] = (0.0, 1.0)  # solved at the readout step, not stepped
        smoothing = th["smoothing1"] if stage == 1 else th["smoothing2"] if stage == 2 else 0.0
        return {"stage": stage, "smoothing": smoothing, "groups": groups}

    # --- model ----------------------------------------------------------------------------------
    def hidden(self, x: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
        """``sigma_s(x W^T + b)`` ``[B, 2m]`` through the fused op (not for ``ntk``)."""
        return smoothed_clamp_layer(x, self.w, self.b, smoothing, backend=self.backend,
                                    input_precision=self.hparams.input_precision)

    def forward(self, x: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
        if self.mode == "ntk":
            return self.linearised(x, smoothing)
        h, m = self.hidden(x, smoothing), self.width
        # the two halves apart: the mirrored pairs then cancel exactly at init (one sum would round)
        return h[:, :m] @ self.a[:m] + h[:, m:] @ self.a[m:]

    def linearised(self, x: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
        """``f(x) = sigma(z0) da + (sigma'(z0) * (x dW^T + db)) a0``, ``z0 = x W0^T + b0`` (the NTK baseline)."""
        with torch.no_grad():
            z0 = torch.addmm(self.b0, x, self.w0.T)
            act0 = gaussian_smoothed_clamp(z0, smoothing)
            slope0 = gaussian_smoothed_clamp_derivative(z0, smoothing) * self.a0
        return act0 @ self.a + (slope0 * torch.addmm(self.b, x, self.w.T)).sum(1)

    def batch_loss(self, batch: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        sched = self.schedule_at(step)
        y = batch["y"]
        g = self(batch["x"], sched["smoothing"])
        weight = None
        if self.class_weighted and sched["stage"] < 3:
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

    def neuron_figure(self):
        """MDS of the neuron directions (the first 150 neurons) after init and the two
        :meth:`snapshot_steps`, coloured by cos(w_i, sum_A M_j), or on the Gaussian mixture by the best
        centre cosine with the 2^k centres drawn among them (red: y = +1, orange: y = -1; as Fig. A.12);
        None before the last snapshot or for modes that do not take those steps."""
        names = ["init", *(f"step{t}" for t in self.snapshot_steps())]
        if not set(names) <= set(self.snapshots):
            return None
        fig, axes = plt.subplots(1, 3, figsize=(12, 4), constrained_layout=True)
        mog = hasattr(self, "centres")
        for ax, name in zip(axes, names):
            w = self.snapshots[name].double().cpu()
            if mog:
                centres = self.centres.double().cpu()
                xy = mds_embedding(torch.cat([w, centres]))
                cos = centre_coverage(centres, w)  # per neuron: its best centre
                image = ax.scatter(xy[: len(w), 0], xy[: len(w), 1], c=cos, cmap="Blues", vmin=0, vmax=1, s=12)
                bits = (torch.arange(len(centres))[:, None] >> torch.arange(self.k)) & 1
                positive = (self.k - bits.sum(1)) % 2 == 0
                ax.scatter(xy[len(w):, 0], xy[len(w):, 1], marker="*", s=90, edgecolors="k", linewidths=0.5,
                           c=["red" if p else "orange" for p in positive.tolist()])
                title = f"{name}: mean coverage {float(centre_coverage(w, centres).mean()):.3f}"
            else:
                v = self.direction.double().cpu()
                xy = mds_embedding(w)
                cos = (w @ v) / (w.norm(dim=1) * v.norm()).clamp_min(1e-300)
                image = ax.scatter(xy[:, 0], xy[:, 1], c=cos, cmap="RdBu_r", vmin=-1, vmax=1, s=12)
                title = f"{name}: max cos {float(cos.max()):.3f}"
            ax.set(title=title, xlabel="MDS 1", ylabel="MDS 2")
        fig.colorbar(image, ax=axes, label="max_c cos(w_i, centre c)" if mog else "cos(w_i, sum_A M_j)")
        return fig

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
        trainer = self.trainer
        strategy = trainer.strategy
        if (self.mode in _FROZEN_AFTER and trainer.world_size > 1 and hasattr(strategy, "_ddp_kwargs")
                and not strategy._ddp_kwargs.get("find_unused_parameters", False)):
            # DDP waits for a gradient of every parameter it was built with; a layer frozen mid-run sends none
            raise ConfigError("trainer.strategy", f"ddp_find_unused_parameters_true for mode {self.mode} on "
                                                  f"several processes (its first layer freezes after step "
                                                  f"{_FROZEN_AFTER[self.mode]}, and plain DDP then waits for "
                                                  f"its gradients)", strategy.__class__.__name__)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        # the schedule's step sizes and decays, set before the closure runs the forward: a frozen layer's
        # requires_grad is off, so its backward GEMM is skipped
        for group in optimizer.param_groups:
            group["lr"], group["decay"] = self.schedule_at(self.global_step + 1)["groups"][group["name"]]
            for p in group["params"]:
                p.requires_grad_(group["lr"] != 0 or group["decay"] != 1)
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def training_step(self, batch, batch_idx):
        step = self.global_step + 1
        sched = self.schedule_at(step)
        readout = self.readout_step()
        if readout is not None and step >= readout:
            return self.readout_training_step(batch, step == readout)
        loss = self.batch_loss(batch, step)
        if self.theory_due() or step <= 2:
            self.log_dict({"train/loss": loss.detach(), "train/stage": float(sched["stage"]),
                           "theory/cos_sim": self.cos()}, on_step=True, on_epoch=False)
        return loss

    @torch.no_grad()
    def fit_readout(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Set the second layer to the best linear classifier of the hidden layer on ``(x, y)`` (every
        rank's share gathered first, so all ranks solve the same problem)."""
        h = self.hidden(x)
        trainer = self._trainer
        if trainer is not None and trainer.world_size > 1:
            h, y = self.all_gather(h).flatten(0, 1), self.all_gather(y).flatten(0, 1)
        self.a.copy_(best_linear_classifier(h, y, self.readout_ridge).to(self.a.dtype))

    def readout_training_step(self, batch, solve: bool) -> torch.Tensor:
        """A probe's steps from the readout on: the solve at the readout step (a full batch), then nothing
        to do; the loss returned is a zero that keeps Lightning's step count (and DDP) going."""
        if solve:
            self.fit_readout(batch["x"], batch["y"])
        if solve or self.theory_due():
            with torch.no_grad():
                loss = hinge(batch["y"] * self(batch["x"]))
            self.log_dict({"train/loss": loss, "train/stage": 3.0, "theory/cos_sim": self.cos()},
                          on_step=True, on_epoch=False)
        self.a.requires_grad_(True)
        return self.a.sum() * 0.0

    def finish_step(self, step: int) -> None:
        """Record CosSim after steps 1 and 2 (the final one is :meth:`final_metrics`'), and the MDS snapshots."""
        if step in (1, 2) and self.mode != "ntk" and self.hparams.schedule != "plain":
            self.cos_stages[step] = self.cos()
        snaps = self.snapshot_steps()
        if step in snaps and (self.mode == "network" or _FROZEN_AFTER.get(self.mode, 0) >= step):
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
        value = self.trainer.callback_metrics.get("val/acc")
        if value is not None:
            self.val_acc.fill_(float(value))

    def test_step(self, batch, batch_idx):
        self._log_accuracy(batch, "test")

    def configure_optimizers(self):
        return ScheduledGD([{"params": [self.a], "name": "a"}, {"params": [self.w], "name": "w"},
                            {"params": [self.b], "name": "b"}])
