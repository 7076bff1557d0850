"""Step cases of ``featlearn bench step``: one full optimisation step of each method (forward, loss, backward,
optimizer step and the method's step-finishing work) through featlearn, against a plain PyTorch loop written
from the method's spec and ``torch.compile`` of that loop.

* ``featlearn``: the real LightningModule inside a real ``Trainer.fit`` (no logger, progress bar or
  checkpoints; the ``DivergenceGuard`` every CLI run has; the config's ``log_every_n_steps``, so theory
  metrics run on the steps they run on in the main job). A step is timed from the Trainer's
  ``on_train_batch_start`` to its ``on_train_batch_end``: ``training_step``, Lightning's closure,
  ``backward``, the optimizer step, ``finish_step`` and Lightning's per-step logging. The batch is made
  before that (sample generation, as the plain loops get their batch made too). A Trainer, rather than a
  hand-written loop calling ``training_step``, because that is what a run costs: the Trainer's per-step
  work is part of a featlearn step, and without a Trainer the modules compute their theory metrics on
  every step. The plain loops run one step each inside the same callback, so the three are interleaved.
* ``plain eager``: the spec's step in ~30 lines of PyTorch (one GEMM per branch; the stop-gradient branch
  from the same product where the spec allows), SGD by hand and the method's step-finishing work.
* ``plain compiled``: the same loop with its loss and its update under ``torch.compile``.

Correctness first: from the same initial weights and batch, in float64, one step of each variant must give
the plain eager loop's weights (relative error <= 1e-10) or the variant is FAILED and not timed. The
featlearn variant of the check runs the module's own ``optimizer_step`` hook (the one the Trainer calls).

Sizes: ``tiny`` = each method's main job (MRP: configs/mrp/teacher_student.yaml + data_tiny.yaml;
contrastive: configs/contrastive/random_mask.yaml + data_tiny.yaml; non-contrastive population mode:
with_head_population.yaml at d = 100; non-contrastive sample mode: with_head.yaml's d = 100, P = 32 with a
fixed full batch of N = 1024 samples, a CPU-feasible size: the config's 4096 fresh samples per step cost ~8 s
of sampling per step on 2 cores), ``smoke`` = a few-second version of each for CI.

Length (~380 lines): three plain loops written from three specs, beside the Trainer clock that interleaves them.
"""
from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F

from featlearn.bench.harness import COMPILED, EAGER, Case, Meter, Result, Variant
from featlearn.callbacks import DivergenceGuard
from featlearn.kernels import smoothed_relu
from featlearn.datamodules.multiview import MultiViewDataModule
from featlearn.datamodules.sparse_coding import SparseCodingDataModule
from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
from featlearn.lightning_modules.contrastive import ContrastiveModule
from featlearn.lightning_modules.mrp import TeacherStudentMRP
from featlearn.lightning_modules.noncontrastive import NonContrastiveModule
from featlearn.theory.contrastive import grown_bias
from featlearn.theory.noncontrastive import population_loss

METHODS = ("mrp", "contrastive", "noncontrastive")
SIZES = ("smoke", "tiny")
FEATLEARN = "featlearn"


@dataclass
class Method:
    """One method's step: how featlearn builds it and the plain loop written from its spec."""
    name: str
    dtype: torch.dtype
    log_every: int
    data: type
    data_args: dict
    model: type
    model_args: dict
    trained: tuple[str, ...]
    """The module's trained tensors, in the order the plain loop returns them."""

    def build(self, seed: int, dtype: torch.dtype, device: torch.device):
        torch.manual_seed(seed)
        dm = self.data(**{**self.data_args, "seed": seed})
        model = self.model(**self.model_args).attach(dm).to(device=device, dtype=dtype)
        return model, dm

    def first_batch(self, dm, device: torch.device, dtype: torch.dtype) -> dict:
        """The first training batch the Trainer would make (step 0, one device)."""
        n = dm.batch_size or dm.sizes["train"]
        batch = dm.batch(torch.arange(n, device=device), "train")
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}

    def state(self, model) -> dict:
        """The plain loop's state: copies of the trained tensors and the constants the spec's step reads."""
        raise NotImplementedError

    def loss(self, state: dict, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def update(self, state: dict, step: int) -> None:
        """SGD on ``state`` from its gradients, then the step-finishing work of the spec."""
        raise NotImplementedError


def _sgd(params: list[torch.Tensor], lrs: list[float], decay: float = 0.0) -> None:
    for p, lr in zip(params, lrs):
        p.sub_(lr * (p.grad + decay * p))
        p.grad = None


# ------------------------------------------------------------------------------------------------
# seed 000: teacher-student MRP, mask-expected loss, full batch, norm cap (spec 000 2.3, 3.1, 8)
# ------------------------------------------------------------------------------------------------
class MRP(Method):
    def state(self, model):
        tau = 1 + (1 - model.theta) / (model.C_p * model.theta)  # c_tau = 0: constant teacher scale
        return {"w": model.weight.detach().clone().requires_grad_(True), "tau": tau, "theta": model.theta,
                "q": model.q, "rho": model.rho, "lr": model.lr, "cap": model.norm_cap}

    @staticmethod
    def _forward(w, x, tau: float, theta: float, q: int, rho: float):
        def f(a):
            return smoothed_relu(a, q, rho)

        a = x @ w.T  # [N, P, R]: the one GEMM; the teacher tau w reads the same product
        y = f(a)
        teacher = f(tau * a.detach()).sum(1)
        return 0.5 * ((teacher - y.sum(1)) ** 2).sum(1).mean() + 0.5 * (1 / theta - 1) * (y * y).sum((1, 2)).mean()

    def loss(self, state, batch, forward=None):
        return (forward or self._forward)(state["w"], batch["x"], state["tau"], state["theta"], state["q"],
                                          state["rho"])

    @staticmethod
    def _update(w, lr: float, cap: float):
        w.sub_(lr * w.grad)
        w.mul_((cap / w.norm(dim=1, keepdim=True)).clamp(max=1.0))

    def update(self, state, step):
        self._update(state["w"], state["lr"], state["cap"])
        state["w"].grad = None


# ------------------------------------------------------------------------------------------------
# seed 001: soft-threshold network, stop-gradient InfoNCE, SGD + weight decay, bias schedule (spec 001 3-4)
# ------------------------------------------------------------------------------------------------
class Contrastive(Method):
    def state(self, model):
        return {"w": model.w.detach().clone().requires_grad_(True), "b": model.bias.detach().clone(),
                "M": model.M, "tau": model.tau, "lr": model.hp.lr, "lam": model.lam, "d": model.d,
                "beta0": model.hp.bias_reset_mult, "c_b": model.hp.bias_min_rate_mult, "kappa": model.kappa_b,
                "T1": None}

    @staticmethod
    def _forward(w, b, xa, xq, xn, tau: float):
        def f(x):
            u = x @ w.T
            return torch.relu(u - b) - torch.relu(-u - b)

        ha = f(xa)
        with torch.no_grad():
            hq, hn = f(xq), f(xn)
        logits = torch.cat([(ha * hq).sum(-1, keepdim=True), ha @ hn.T], -1) / tau
        target = torch.zeros(len(ha), dtype=torch.long, device=ha.device)
        return tau * F.cross_entropy(logits, target)

    def loss(self, state, batch, forward=None):
        return (forward or self._forward)(state["w"], state["b"], batch["x_a"], batch["x_q"], batch["x_neg"],
                                          state["tau"])

    @staticmethod
    def _update(w, lr: float, lam: float, M):
        w.sub_(lr * (w.grad + lam * w))
        norm = w.norm(dim=1)
        return norm, ((w @ M) ** 2).sum(1) / norm ** 2

    def update(self, state, step):
        w = state["w"]
        with torch.no_grad():
            prev = w.norm(dim=1)
            norm, rho = self._update(w, state["lr"], state["lam"], state["M"])
            w.grad = None
            d = state["d"]
            if state["T1"] is None and float(rho.min()) >= 0.5:  # T1: reset the bias
                state["T1"] = step
                state["b"] = state["beta0"] * math.sqrt(2 * math.log(d) / d) * norm
            elif state["T1"] is not None:
                state["b"] = grown_bias(state["b"], norm, prev, state["c_b"] * state["lr"] / d, state["kappa"])


# ------------------------------------------------------------------------------------------------
# seed 004: cubic patch encoder, identity-initialised head with frozen diagonal, BN cosine loss (spec 004 4.1)
# ------------------------------------------------------------------------------------------------
class NonContrastive(Method):
    def state(self, model):
        return {"w": model.w.detach().clone().requires_grad_(True),
                "E": model.head.detach().clone().requires_grad_(True), "lr": model.lr, "head_lr": model.head_lr,
                "pop": (model.features, model.alphas, model.probs, model.num_patches, model.num_feature_patches,
                        model.noise_std) if model.gradient == "population" else None}

    @staticmethod
    def _forward(w, E, x, m1):
        a3 = (x @ w.T) ** 3  # [N, P, m]: one GEMM; the stop-gradient view 2 reads the same product
        f = (a3 * m1[..., None]).sum(1)
        g = (a3.detach() * (1 - m1)[..., None]).sum(1)

        def bn(t):
            c = t - t.mean(0)
            return c / (c * c).mean(0).sqrt()

        return ((bn(f @ E.T) - bn(g)) ** 2).sum(1).mean() / w.shape[0]

    def loss(self, state, batch, forward=None):
        if state["pop"] is not None:  # the spec's N = infinity closed form (theory.noncontrastive, spec 5.6)
            return population_loss(state["w"], state["E"], *state["pop"])
        return (forward or self._forward)(state["w"], state["E"], batch["x"], batch["view1"].to(batch["x"].dtype))

    @staticmethod
    def _update(w, E, lr: float, head_lr: float):
        _sgd([w, E], [lr, head_lr])
        E.diagonal().fill_(1.0)  # Algorithm 1 line 6

    def update(self, state, step):
        self._update(state["w"], state["E"], state["lr"], state["head_lr"])


_MRP_TINY = dict(k=10, d=256, P=16, C_p=1, s=2.0, mu=0.02, rho=0.1, sigma_p=0.005, gamma=0.002, num_pretrain=1000,
                 num_downstream=500, num_test=10000)
_MRP_MODEL = dict(theta=0.5, loss="expected", q=3, rho=0.25, sigma0=0.02, m=6, lr=5.0, norm_cap=1.0,
                  stop_after_capture=200, backend="auto")
_CON_TINY = dict(d=32, d1=256, dictionary="random", augment="random_mask", num_negatives=256, negatives="shared",
                 mode="online", batch_size=256, num_val=8000, num_test=4000)
_CON_MODEL = dict(width_mult=4.0, lr=2.0, bias_mode="schedule", seed=0, backend="auto")
_NC_TINY = dict(dim=100, num_patches=32, num_feature_patches=8, alphas=[4.0, 2.7], noise_std=1.0, dtype="float64")
_NC_MODEL = dict(width=2, head="offdiag", target="shared_sg", lr=0.05, head_lr=0.05, out_norm="bn", backend="auto")


def method(name: str, size: str) -> list[Method]:
    smoke = size == "smoke"
    if name == "mrp":
        data = dict(_MRP_TINY, k=4, d=16, P=10, num_pretrain=32, num_downstream=16, num_test=16) if smoke else _MRP_TINY
        return [MRP("mrp", torch.float32, 10, MultiViewDataModule, data, TeacherStudentMRP,
                    dict(_MRP_MODEL, m=2) if smoke else _MRP_MODEL, ("weight",))]
    if name == "contrastive":
        data = dict(_CON_TINY, d=8, d1=32, num_negatives=16, batch_size=16, num_val=16, num_test=16) if smoke \
            else _CON_TINY
        return [Contrastive("contrastive", torch.float32, 25, SparseCodingDataModule, data, ContrastiveModule,
                            _CON_MODEL, ("w",))]
    shape = dict(_NC_TINY, dim=12, num_patches=8, num_feature_patches=2) if smoke else _NC_TINY
    sample = dict(shape, mode="fixed", batch_size=None, num_train=64 if smoke else 1024, num_val=8, num_test=8)
    population = dict(shape, mode="online", batch_size=2, num_val=8, num_test=8)
    return [NonContrastive("noncontrastive sample", torch.float64, 500, TwoFeaturePatchDataModule, sample,
                           NonContrastiveModule, _NC_MODEL, ("w", "head")),
            NonContrastive("noncontrastive population", torch.float64, 500, TwoFeaturePatchDataModule, population,
                           NonContrastiveModule, dict(_NC_MODEL, gradient="population"), ("w", "head"))]


# ------------------------------------------------------------------------------------------------
# variants
# ------------------------------------------------------------------------------------------------
class PlainLoop:
    """The plain loop's state and its step (``compiled``: loss and update under torch.compile)."""

    def __init__(self, spec: Method, state: dict, batch: dict, compiled: bool):
        self.spec, self.state, self.batch, self.step = spec, state, batch, 0
        # the loss under torch.compile (AOTAutograd compiles its backward); the update, a few in-place
        # elementwise ops that mutate the weights and their .grad, stays eager
        self.forward = torch.compile(spec._forward, dynamic=False) if compiled else None

    def __call__(self) -> None:
        self.step += 1
        self.spec.loss(self.state, self.batch, forward=self.forward).backward()
        with torch.no_grad():
            self.spec.update(self.state, self.step)

    def weights(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.state[k].detach() for k in ("w", "E") if k in self.state)


def featlearn_one_step(spec: Method, seed: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One step through the module's own ``optimizer_step`` hook (the one the Trainer calls)."""
    model, dm = spec.build(seed, dtype, device)
    batch = spec.first_batch(dm, device, dtype)
    optimizer = model.configure_optimizers()

    def closure():
        optimizer.zero_grad()
        loss = model.training_step(batch, 0)
        loss.backward()
        return loss

    with warnings.catch_warnings():  # without a Trainer, ``self.log`` warns that there is nowhere to log
        warnings.simplefilter("ignore")
        model.optimizer_step(0, 0, optimizer, closure)
    return tuple(getattr(model, k).detach() for k in spec.trained)


def plain_one_step(spec: Method, seed: int, device: torch.device, dtype: torch.dtype,
                   compiled: bool) -> tuple[torch.Tensor, ...]:
    model, dm = spec.build(seed, dtype, device)
    loop = PlainLoop(spec, spec.state(model), spec.first_batch(dm, device, dtype), compiled)
    loop()
    return loop.weights()


class _Clock(L.Callback):
    """Times each featlearn step inside the Trainer and runs one step of every plain loop after it."""

    def __init__(self, spec: Method, results: dict[str, Result], device: torch.device, warmup: int):
        self.spec, self.results, self.device, self.warmup = spec, results, device, warmup
        self.loops: dict[str, PlainLoop] = {}
        self.meter = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.loops:  # the plain loops start from the module's initial weights and its first batch
            for name in self.results:
                if name != FEATLEARN:
                    self.loops[name] = PlainLoop(self.spec, self.spec.state(pl_module), batch, name == COMPILED)
        self.meter = Meter(self.device).__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.meter.__exit__(None, None, None)
        timed = trainer.global_step > self.warmup
        if timed and FEATLEARN in self.results:
            self.results[FEATLEARN].record(self.meter.seconds, self.meter.peak_bytes)
        for name, loop in self.loops.items():
            with Meter(self.device) as m:
                loop()
            if timed:
                self.results[name].record(m.seconds, m.peak_bytes)


def _timer(spec: Method):
    def time_steps(case: Case, results: list[Result], device: torch.device, rounds: int, warmup: int, seed: int):
        passed = {r.variant: r for r in results if r.passed}
        model, dm = spec.build(seed, spec.dtype, device)
        if FEATLEARN not in passed:  # a failed featlearn step is not timed: the plain loops take turns alone
            batch, state = spec.first_batch(dm, device, spec.dtype), spec.state(model)
            loops = {name: PlainLoop(spec, dict(state, **{k: v.detach().clone().requires_grad_(v.requires_grad)
                                                           for k, v in state.items() if isinstance(v, torch.Tensor)}),
                                     batch, name == COMPILED) for name in passed}
            for i in range(warmup + rounds):
                for name, loop in loops.items():
                    with Meter(device) as m:
                        loop()
                    if i >= warmup:
                        passed[name].record(m.seconds, m.peak_bytes)
            return
        chatter = logging.getLogger("lightning.pytorch")
        level = chatter.level
        chatter.setLevel(logging.WARNING)  # the Trainer's banner (accelerators, tips) between the progress lines
        try:
            trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                                max_steps=warmup + rounds, max_epochs=-1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                limit_val_batches=0, log_every_n_steps=spec.log_every,
                                callbacks=[DivergenceGuard(), _Clock(spec, passed, device, warmup)])
            with warnings.catch_warnings():  # Lightning's advice on dataloader workers and the like
                warnings.simplefilter("ignore")
                trainer.fit(model, datamodule=dm)
        finally:
            chatter.setLevel(level)
    return time_steps


def step_case(spec: Method, device: torch.device) -> Case:
    def variant(compiled: bool | None):
        def run(inputs):
            if compiled is None:
                return featlearn_one_step(spec, inputs["seed"], device, torch.float64)
            return plain_one_step(spec, inputs["seed"], device, torch.float64, compiled)
        return run

    def reference(inputs):
        return plain_one_step(spec, inputs["seed"], device, torch.float64, False)

    data = spec.data_args
    shape = ", ".join(f"{k}={data[k]}" for k in ("k", "d", "P", "num_pretrain", "d1", "batch_size", "num_negatives",
                                                "dim", "num_patches", "num_train") if k in data)
    return Case(spec.name, f"{shape}, {str(spec.dtype).removeprefix('torch.')}",
                [Variant(FEATLEARN, variant(None)), Variant(EAGER, variant(False)), Variant(COMPILED, variant(True))],
                lambda dtype, dev, seed: {"seed": seed}, reference, dtype=torch.float64, timer=_timer(spec))


def cases(methods: list[str], size: str, device: torch.device) -> list[Case]:
    return [step_case(spec, device) for name in methods for spec in method(name, size)]
