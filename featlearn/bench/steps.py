"""Step cases of ``featlearn bench step``: one full optimisation step of each method (forward, loss, backward,
optimizer step and the method's step-finishing work) through featlearn, against a plain PyTorch loop written
from the method's definition and ``torch.compile`` of that loop.

* ``featlearn``: the real LightningModule inside a real ``Trainer.fit`` (no logger, progress bar or
  checkpoints; the ``DivergenceGuard`` and the no-op profiler every CLI run has; the config's
  ``log_every_n_steps``, so theory metrics run on the steps they run on in the main job). A step is timed
  from the Trainer's ``on_train_batch_start`` to its ``on_train_batch_end``: ``training_step``, Lightning's
  closure, ``backward``, the optimizer step, ``finish_step`` and Lightning's per-step logging. The batch is made
  before that (sample generation, as the plain loops get their batch made too). A Trainer, rather than a
  hand-written loop calling ``training_step``, because that is what a run costs: the Trainer's per-step
  work is part of a featlearn step, and without a Trainer the modules compute their theory metrics on
  every step. The plain loops run one step each inside the same callback, so the three are interleaved.
* ``featlearn compiled``: the same with ``model.compile: true`` (the module's loss under ``torch.compile``),
  after the ``featlearn`` run; its note gives the compile time (its first step less a step) and the steps
  after which the compile has paid for itself against ``featlearn`` (a cold compile: torch's caches empty).
  On CUDA, ``featlearn reduce-overhead`` is the same in inductor's ``reduce-overhead`` mode (CUDA graphs of the
  loss and its backward), checked over three steps (a graph replayed) against the module's eager three.
* ``plain eager``: the method's step in ~30 lines of PyTorch (one GEMM per branch; the stop-gradient branch
  from the same product where the method allows), SGD by hand and the method's step-finishing work
  (:mod:`featlearn.bench.step_methods`, one :class:`~featlearn.bench.step_methods.Method` per method).
* ``plain compiled``: the same loop with its loss under ``torch.compile`` (AOTAutograd compiles its
  backward); the update, a few in-place ops on the weights (and the projection's SVD), stays eager.

Correctness first: from the same initial weights and batch, in float64, one step of each variant must give
the plain eager loop's weights (relative error <= 1e-10) or the variant is FAILED and not timed. The
featlearn variant of the check runs the module's own ``optimizer_step`` hook (the one the Trainer calls).

Sizes: ``tiny`` = each method's main job (MRP: configs/mrp/teacher_student.yaml + data_tiny.yaml;
contrastive: configs/contrastive/random_mask.yaml + data_tiny.yaml; non-contrastive population mode:
with_head_population.yaml at d = 100; non-contrastive sample mode: with_head.yaml's d = 100, P = 32 with a
fixed full batch of N = 1024 samples, a CPU-feasible size: the config's 4096 fresh samples per step cost ~8 s
of sampling per step on 2 cores; ViT: configs/vit/mae.yaml and cl.yaml with data_p256_pos.yaml, MAE on
its CPU default, the structured path; two-layer (Shi 2024, Ch. 2): a stage-3 step of configs/two_layer/network.yaml on
data_parity.yaml, B = 1000, d = 500, 2m = 600, through ``schedule: plain`` whose every step is a stage-3
step; universality (Ch. 7): configs/universality/universal.yaml + data_tiny.yaml),
``smoke`` = a few-second version of each for CI; ``gpu`` (CUDA only, :data:`GPU_METHODS`) = the
one-GPU sizes: MRP at its medium size (configs/mrp/teacher_student_medium.yaml + data_medium.yaml: k = 64,
m = 8, R = 512, d = 1024, P = 32, full batch N = 16384) and contrastive learning at its medium size
(d = 256, d1 = 2048, m = 1024, K = 1024 anchors, 4096 shared negatives), without the ``plain compiled``
variant (:data:`COMPILED_AT_GPU`: a compile of a loss and its backward costs ~20-40 s of the check's
5 minutes, and ``bench op --size gpu`` already holds torch.compile against the same GEMMs). A case
carries its model FLOPs (the step's GEMMs), so the tables give achieved TFLOP/s.

This module is the harness glue (the Trainer clock that interleaves the variants, the float64 one-step
check); the methods and their plain loops are in :mod:`featlearn.bench.step_methods`.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
import warnings

import lightning as L
import torch

from featlearn.bench.harness import COMPILED, EAGER, Case, Meter, Result, Variant, error_note
from featlearn.bench import step_methods, user_fit
from featlearn.bench.step_methods import METHODS, Method, method
from featlearn.callbacks import DivergenceGuard
from featlearn.cli import NoOpProfiler
from featlearn.datamodules.multiview import MultiViewDataModule
from featlearn.datamodules.seeds import SeedStackDataModule
from featlearn.datamodules.sparse_coding import SparseCodingDataModule
from featlearn.experiments.study import Run
from featlearn.lightning_modules.contrastive import ContrastiveModule
from featlearn.lightning_modules.mrp import TeacherStudentMRP
from featlearn.lightning_modules.seeds import SeedStack

__all__ = ["METHODS", "SIZES", "GPU_METHODS", "cases", "step_case"]
FEATLEARN = "featlearn"
FEATLEARN_COMPILED = "featlearn compiled"  # model.compile: true (the module's loss under torch.compile)
FEATLEARN_GRAPHS = "featlearn reduce-overhead"  # the same in inductor's reduce-overhead mode (CUDA graphs; CUDA only)
MODULE_COMPILES = {FEATLEARN_COMPILED: None, FEATLEARN_GRAPHS: "reduce-overhead"}  # variant: torch.compile mode
GRAPH_STEPS = 3  # the graphs row's check: a warm-up run, a recording, then a replay
FIT = "lightning fit"  # the step a user gets: the command in its own process (featlearn.bench.user_fit)
SIZES = (*step_methods.SIZES, "gpu")
GPU_METHODS = ("mrp", "contrastive")
COMPILED_AT_GPU = ()
# the gpu size: MRP's medium config, and contrastive learning's main job at its medium size (d = 256,
# d1 = 8d, m = width_mult d = 1024; the batch and the shared negatives of the paper's medium runs)
GPU_JOBS = {"mrp": ("mrp/teacher_student_medium.yaml", {}),
            "contrastive": ("contrastive/random_mask.yaml",
                            {"data.init_args.d": 256, "data.init_args.d1": 2048, "data.init_args.num_negatives": 4096,
                             "data.init_args.batch_size": 1024, "model.init_args.lr": 1.0})}


def gpu_method(name: str) -> tuple[Method, float]:
    """The ``gpu`` size of a method of :data:`GPU_METHODS` and its model FLOPs per step (its GEMMs)."""
    if name not in GPU_JOBS:
        raise ValueError(f"no gpu size for {name!r}: one of {', '.join(GPU_METHODS)}")
    config_file, overrides = GPU_JOBS[name]
    config = Run(config_file, f"gpu/{name}", overrides).resolved()
    d, model = dict(config["data"]["init_args"]), dict(config["model"]["init_args"])
    if name == "mrp":  # forward A = x W^T and dW (the teacher reads the same A): 4 N P d R, R = k m
        return (step_methods.MRP("mrp", torch.float32, 20, MultiViewDataModule, d, TeacherStudentMRP, model,
                                 ("weight",)),
                4 * d["num_pretrain"] * d["P"] * d["d"] * d["k"] * model["m"])
    # contrastive: the encoder on anchors, positives and negatives; grad_W on the anchors
    m, rows = int(model["width_mult"] * d["d"]), 2 * d["batch_size"] + d["num_negatives"]
    return (step_methods.Contrastive("contrastive", torch.float32, 25, SparseCodingDataModule, d, ContrastiveModule,
                                     model, ("w",)),
            2 * rows * d["d1"] * m + 2 * d["batch_size"] * d["d1"] * m)


class PlainLoopError(RuntimeError):  # a plain loop failed while stepping beside a featlearn variant's run
    pass


class PlainLoop:
    """The plain loop's state and its step (``compiled``: its loss under torch.compile)."""

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
        return tuple(self.state[k].detach() for k in self.spec.weights)


def module_step(model, batch, steps: int = 1) -> None:
    """``steps`` optimisation steps on ``batch`` through the module's own ``optimizer_step`` hook, as the Trainer
    calls it (without a Trainer the module's step count stays 0: compare several steps only with the module)."""
    optimizer = model.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    optimizer = optimizer[0] if isinstance(optimizer, (list, tuple)) else optimizer

    def closure():
        optimizer.zero_grad()
        loss = model.training_step(batch, 0)
        loss.backward()
        return loss

    with warnings.catch_warnings():  # without a Trainer, ``self.log`` warns that there is nowhere to log
        warnings.simplefilter("ignore")
        for _ in range(steps):
            model.optimizer_step(0, 0, optimizer, closure)


def featlearn_one_step(spec: Method, seed: int, device: torch.device, dtype: torch.dtype,
                       seeds: int = 1, compiled: bool | str = False, steps: int = 1) -> tuple[torch.Tensor, ...]:
    """One step through the module's own ``optimizer_step`` hook (the one the Trainer calls); with ``seeds`` > 1,
    of a :class:`~featlearn.lightning_modules.seeds.SeedStack` of seeds ``seed, seed + 1, ...``, whose first
    seed's weights are returned; ``compiled``: with the module's loss compiled (``model.compile: true``; a
    string: in that ``torch.compile`` mode); ``steps``: that many on the first batch (:func:`module_step`)."""
    if seeds == 1:
        model, dm = spec.build(seed, dtype, device)
        if compiled:
            model.compile_loss(mode=compiled if isinstance(compiled, str) else None)
        module_step(model, spec.first_batch(dm, device, dtype), steps)
        return tuple(getattr(model, k).detach() for k in spec.trained)
    stack, data = build_stack(spec, seed, seeds, dtype, device)
    module_step(stack, {"seeds": [spec.first_batch(dm, device, dtype) for dm in data.members]})
    return tuple(getattr(stack.members[0], k).detach() for k in spec.trained)


def build_stack(spec: Method, seed: int, seeds: int, dtype: torch.dtype, device: torch.device):
    """The method at seeds ``seed .. seed + seeds - 1`` as one :class:`SeedStack` and its DataModule."""
    built = [spec.build(seed + i, dtype, device) for i in range(seeds)]
    numbers = list(range(seed, seed + seeds))
    return (SeedStack([m for m, _ in built], numbers).to(device),
            SeedStackDataModule([dm for _, dm in built], numbers))


def plain_one_step(spec: Method, seed: int, device: torch.device, dtype: torch.dtype,
                   compiled: bool) -> tuple[torch.Tensor, ...]:
    model, dm = spec.build(seed, dtype, device)
    loop = PlainLoop(spec, spec.state(model), spec.first_batch(dm, device, dtype), compiled)
    loop()
    return loop.weights()


class _Clock(L.Callback):
    """Times each featlearn step inside the Trainer (``variant``: ``featlearn``, or ``featlearn xS`` for S seeds in
    one run, recorded per seed-step) and runs one step of every plain loop after it."""

    def __init__(self, spec: Method, results: dict[str, Result], device: torch.device, warmup: int,
                 variant: str = FEATLEARN, seeds: int = 1, loops: dict | None = None):
        self.spec, self.results, self.device, self.warmup = spec, results, device, warmup
        self.variant, self.seeds = variant, seeds
        self.first_step_s: float | None = None  # the first step's time (a compiled loss: its compile)
        self.loops: dict[str, PlainLoop] = {} if loops is None else loops  # a later clock goes on with the loops
        self.meter = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.loops:  # the plain loops start from the module's initial weights and its first batch
            module, first = (pl_module, batch) if self.seeds == 1 else (pl_module.members[0], batch["seeds"][0])
            for name in self.results:
                if not name.startswith(FEATLEARN) and name != FIT:
                    self.loops[name] = PlainLoop(self.spec, self.spec.state(module), first, name == COMPILED)
        self.meter = Meter(self.device).__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.meter.__exit__(None, None, None)
        if self.first_step_s is None:
            self.first_step_s = self.meter.seconds
        timed = trainer.global_step > self.warmup
        if timed and self.variant in self.results:
            self.results[self.variant].record(self.meter.seconds / self.seeds, self.meter.peak_bytes)
        for name, loop in self.loops.items():
            with Meter(self.device) as m:
                try:
                    loop()
                except Exception as error:  # not the module's: never taken for a failure of the timed variant
                    raise PlainLoopError(f"plain loop {name!r} failed") from error
            if timed:
                self.results[name].record(m.seconds, m.peak_bytes)


def _timer(spec: Method):
    def time_steps(case: Case, results: list[Result], device: torch.device, rounds: int, warmup: int, seed: int):
        passed = {r.variant: r for r in results if r.passed}
        model, dm = spec.build(seed, spec.dtype, device)
        if FEATLEARN not in passed:  # a failed featlearn step is not timed: the plain loops take turns alone
            # (and the S-seed variants, built on the same step, are left out with it)
            passed = {name: r for name, r in passed.items() if not name.startswith(FEATLEARN)}
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
        clock = _Clock(spec, passed, device, warmup)
        _fit(model, dm, clock, spec, device, warmup + rounds)
        for name in [n for n in MODULE_COMPILES if n in passed]:  # after S = 1; the compile is in the first step
            model, dm = spec.build(seed, spec.dtype, device)
            model.compile_loss(mode=MODULE_COMPILES[name])
            compiled = _Clock(spec, passed, device, max(warmup, 2), name, 1, clock.loops)
            try:
                with _cold_compile():
                    _fit(model, dm, compiled, spec, device, max(warmup, 2) + rounds)
            except Exception as error:  # CUDA graphs reuse their outputs' memory: a step that keeps one fails here
                if name != FEATLEARN_GRAPHS or isinstance(error, PlainLoopError):
                    raise
                passed[name].seconds.clear()
                passed[name].passed, passed[name].peak_bytes = False, None
                passed[name].note = f"failed while timed: {error_note(error, 160)}"
                continue
            passed[name].note = _repays(compiled.first_step_s, passed[FEATLEARN], passed[name])
        if FIT in passed:  # between the in-process variants: a run of its own, a sample per logged interval
            for seconds in user_fit.fit_step_seconds(user_fit.config_of(spec.name), spec.data_args, spec.model_args,
                                                     spec.log_every, torch.get_num_threads()):
                passed[FIT].record(seconds, None)
        for name in [n for n in passed if n.startswith(f"{FEATLEARN} x")]:  # S seeds in one run, after S = 1
            count = int(name.removeprefix(f"{FEATLEARN} x"))
            stack, data = build_stack(spec, seed, count, spec.dtype, device)
            # the plain loops go on stepping between the stack's steps (compiled once; more timed rounds)
            _fit(stack, data, _Clock(spec, passed, device, warmup, name, count, clock.loops), spec, device,
                 warmup + rounds)
    return time_steps


@contextlib.contextmanager
def _cold_compile():
    """A compile without torch's caches: dynamo's entries dropped, inductor's in-memory kernels and on-disk folders
    (its own, Triton's) fresh for it and restored after, so a second mode's compile pays in full too. A process's
    first compile pays a few seconds more (docs/performance.md: fresh-process times). No dynamo reset on the way
    out: the plain compiled loop, recompiled in this fit's warm-up, keeps its code."""
    from torch._inductor import utils as inductor_utils

    torch._dynamo.reset()
    fresh = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    with fresh():
        yield


def _repays(first_step_s: float, eager: Result, compiled: Result) -> str:
    """The cold compile time (the compiled run's first step less a step) and the steps after which it has paid.
    Later runs of the same shapes on the machine read the compiled code from torch's on-disk cache: less."""
    cost = first_step_s - compiled.median_ms / 1e3
    saved = (eager.median_ms - compiled.median_ms) / 1e3
    return f"compile {cost:.1f} s, " + (f"repaid after {cost / saved:.0f} steps" if saved > 0 else "never repaid")


def _fit(model, dm, clock: _Clock, spec: Method, device: torch.device, steps: int) -> None:
    """A quiet ``Trainer.fit`` of ``steps`` steps with the CLI's ``DivergenceGuard`` and profiler, and ``clock``."""
    chatter = logging.getLogger("lightning.pytorch")
    level = chatter.level
    chatter.setLevel(logging.WARNING)  # the Trainer's banner (accelerators, tips) between the progress lines
    scratch = tempfile.TemporaryDirectory()  # where a stack writes its seeds' checkpoints
    try:
        trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                            default_root_dir=scratch.name,
                            max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            limit_val_batches=0, log_every_n_steps=spec.log_every, profiler=NoOpProfiler(),
                            callbacks=[DivergenceGuard(), clock])
        with warnings.catch_warnings():  # Lightning's advice on dataloader workers and the like
            warnings.simplefilter("ignore")
            trainer.fit(model, datamodule=dm)
    finally:
        chatter.setLevel(level)
        scratch.cleanup()


def step_case(spec: Method, device: torch.device, compiled: bool = True, flops: float | None = None,
              seeds: tuple[int, ...] = (), fit: bool = False) -> Case:
    """The case of one method: featlearn, the plain loops, ``featlearn xS`` for each S of ``seeds`` (S seeds
    in one run; its times are per seed-step, so its speed-ups compare it with S separate plain loops) and, with
    ``fit``, ``lightning fit`` (its check is the featlearn step's: the same module)."""
    def variant(compiled: bool | None, count: int = 1, module_compiled: bool | str = False, steps: int = 1):
        def run(inputs):
            if compiled is None:
                return featlearn_one_step(spec, inputs["seed"], device, torch.float64, count, module_compiled, steps)
            return plain_one_step(spec, inputs["seed"], device, torch.float64, compiled)
        return run

    def reference(inputs):
        return plain_one_step(spec, inputs["seed"], device, torch.float64, False)

    precision = "fp64" if spec.dtype == torch.float64 else "ieee"  # timed in spec.dtype (checked in float64)

    return Case(spec.name, f"{spec.shape()}, {str(spec.dtype).removeprefix('torch.')}",
                [Variant(FEATLEARN, variant(None), precision),
                 *([Variant(FEATLEARN_COMPILED, variant(None, module_compiled=True), precision)]
                   if compiled and spec.model.compiled_loss is not None else []),
                 # graphs recorded, then replayed: against the module's eager steps (the featlearn row's check)
                 *([Variant(FEATLEARN_GRAPHS, variant(None, module_compiled="reduce-overhead", steps=GRAPH_STEPS),
                            precision, reference=variant(None, steps=GRAPH_STEPS))]
                   if compiled and spec.model.compiled_loss is not None and device.type == "cuda" else []),
                 *[Variant(f"{FEATLEARN} x{n}", variant(None, n), precision) for n in seeds if n > 1],
                 *([Variant(FIT, variant(None), precision)] if fit else []),
                 Variant(EAGER, variant(False), precision),
                 *([Variant(COMPILED, variant(True), precision)] if compiled else [])],
                lambda dtype, dev, seed: {"seed": seed}, reference, dtype=torch.float64, timer=_timer(spec),
                flops=flops)


def cases(methods: list[str], size: str, device: torch.device, seeds: tuple[int, ...] = (),
          fit: bool = False) -> list[Case]:
    if size == "gpu":
        return [step_case(spec, device, name in COMPILED_AT_GPU, flops, seeds)
                for name in methods for spec, flops in [gpu_method(name)]]
    return [step_case(spec, device, seeds=seeds, fit=fit) for name in methods for spec in method(name, size)]
