"""Each method's training step on the GPU equals its CPU float64 step; a 1-rank DDP run equals the plain run;
``bn_cosine_loss(sync=True)`` under a 1-rank process group equals ``sync=False``.

* Step: the module and its DataModule come from the method's run config (``featlearn.cli.make_cli``, as
  ``lightning fit --config`` builds them; dry mode adds tiny data overrides). One optimisation step through the
  module's own ``optimizer_step`` hook (``training_step``, backward, the update and ``finish_step``; what
  ``featlearn bench step`` checks), once on the CPU in float64 (backend ``auto``: PyTorch) and once on the GPU
  (backend ``auto``: Triton) in the method's dtype: float32 with IEEE products, float64 for the non-contrastive
  methods (Wen & Li 2022), whose data is float64. Both start from the same state and batch (the Trainer's
  first), rounded to the GPU run's dtype; every floating tensor of the state dict is compared after the step.
  In dry mode the "GPU" run is the CPU in float32 with ``backend="triton"`` (the interpreter): the plumbing of
  the path a GPU run takes.
  The end-of-run metrics (``final_metrics``) are then computed on the device: same keys as the CPU run's, finite.
* DDP: two steps of ``Trainer.fit`` with ``strategy=ddp`` on one device (nccl; gloo in dry mode) against the
  same fit without a strategy, from the same module (``DDP_METHODS``).
* bn sync: the loss and its gradient with ``sync=True`` under a 1-rank group (the statistics gathered and
  merged; ``bn_column_stats`` shares that path).
"""
import copy
import importlib
import math
import os
import socket
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from featlearn.bench.steps import module_step
from featlearn.cli import make_cli
from featlearn.experiments.study import Run
from featlearn.kernels import bn_cosine_loss

from tiny_sizes import BLOCK_PARITY, ERM_NU, GEMFILTER, HIDDEN, ICL, ICL_PARITY, LOOPED, XOR, MODADD, MRP, PARITY, PATCHES, SPARSE, TRANSFORMER, VIT, over

pytestmark = pytest.mark.gpu
CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# error relative to the step's parameter change: float32 rounding through a few products and reductions
# (CPU float32 against float64, dry and config sizes: <= 3e-6 of the change; the GPU's sequential FMA sums
# may add ~10x); 1e-4 leaves that margin and sits under a TF32 GEMM's ~3e-4. float64: 1e-9 (~1e-14 expected).
STEP_RTOL = {torch.float32: 1e-4, torch.float64: 1e-9}
# ch. 2's NTK step at its config size (10k samples x 300 neurons, smoothing 0 in stage 3): sigma' is a step
# at z0 = +-1, so the few z0 that float32 rounding puts on the other side flip their slope. Measured on an
# H100 (torch 2.11): 1.2e-4 of b's change; the CPU reproduces it exactly with z0 summed in sequence (3.12e-6
# against a change of 2.69e-2), and gets 1e-7 with MKL's order. A float32 rounding effect, not a bug: 1e-3.
# ch. 9's decoder at its start: the answer's gradient is a sum with heavy cancellation (median |g| 1e-6 to 1e-5 of
# weights ~0.3), so float32 gets it to 2-4e-4 relative on the CPU, and AdamW's first step (lr g / |g|) passes that
# on to elements near 0: 1.1e-3 to 4.6e-3 of the change, measured on the CPU in dry mode (2026-11-28).
STEP_RTOL_OF = {"two_layer_ntk": {torch.float32: 1e-3}, "gemfilter": {torch.float32: 1e-2}}
# plus rounding of the stored values: a few ulps of the tensor's norm (the update may be far smaller)
ULPS = 8
T = dict(steps=600)  # the schedule's T: the config's trainer.max_steps (no Trainer here)

# name: (run config, dry-mode overrides[, CUDA overrides]). On CUDA the config's own sizes (its main job's).
METHODS = {
    "mrp_teacher_student": ("mrp/teacher_student.yaml", MRP),
    "mrp_teacher_student_mc": ("mrp/teacher_student_mc.yaml", MRP),
    "mrp_mae": ("mrp/mae.yaml", MRP),
    "mrp_supervised": ("mrp/supervised.yaml", MRP),
    "contrastive": ("contrastive/random_mask.yaml", SPARSE),
    "contrastive_learned_bias": ("contrastive/learned_bias.yaml", SPARSE),
    "noncontrastive_sample": ("noncontrastive/with_head.yaml", PATCHES),
    "noncontrastive_population": ("noncontrastive/with_head_population.yaml", PATCHES),
    "noncontrastive_ema": ("noncontrastive/ema_target.yaml", PATCHES),
    "vit_mae": ("vit/mae.yaml", over(dict(VIT, K=2))),
    "vit_mae_dense": ("vit/mae_dense.yaml", over(dict(VIT, K=2))),
    "vit_cl": ("vit/cl.yaml", over(dict(VIT, K=4, d=None))),  # K (1 - gamma0) > 1.5: no collapse warning
    # ch. 2's steps 1-2 are full-batch: on CUDA 10k of the 50k samples keep the CPU float64 step short
    "two_layer": ("two_layer/network.yaml", over(PARITY, dict(width=8, **T)), over(dict(num_train=10000), T)),
    "two_layer_ntk": ("two_layer/ntk.yaml", over(PARITY, dict(width=8, **T)), over(dict(num_train=10000), T)),
    "universality": ("universality/universal.yaml", HIDDEN),
    "universality_infonce": ("universality/infonce.yaml", HIDDEN),
    "contrastive_regularization": ("universality/cr.yaml", HIDDEN),
    "modular_addition": ("modular_addition/mlp.yaml", MODADD),  # the embedding gradient adds with atomics
    # SDPA's CUDA kernels; dropout off on CUDA too (the CPU and GPU generators draw different masks)
    "modular_transformer": ("modular_addition/transformer.yaml", TRANSFORMER, over(model=dict(dropout=0.0))),
    "looped_transformer": ("looped_transformer/trained.yaml", LOOPED),  # ch. 8: batched (d+1)^2 GEMMs, loops
    "icl_lsa": ("icl_scale/regression.yaml", ICL),  # ch. 5: two einsums per prompt
    "icl_parity": ("icl_scale/parity.yaml", ICL_PARITY),  # ch. 5: heads, ReLU, hinge
    "gradient_features": ("gradient_features/xor.yaml", XOR),  # ch. 3: two GEMMs, ReLU, step 1's exact reset
    "gradient_features_parity": ("gradient_features/parity.yaml", BLOCK_PARITY),  # the same on structured parity
    "erm_nu": ("erm_nu/theory.yaml", ERM_NU),
    "gemfilter": ("gemfilter/retrieval.yaml", GEMFILTER),  # ch. 9: a small decoder (SDPA, RoPE, depthwise conv)  # ch. 6: the nuclear norm of the batch features (an SVD)
}
# the methods with a compiled loss (``model.compile: true``), one config of each class (the sampled and population
# non-contrastive steps are two losses of one class)
COMPILED = ("mrp_teacher_student", "mrp_mae", "contrastive", "noncontrastive_sample", "noncontrastive_population",
            "vit_mae", "vit_cl", "two_layer", "two_layer_ntk", "universality", "modular_addition",
            "modular_transformer")
# the 1-rank DDP run: at one rank the methods skip their own collectives (world size 1), so what it checks
# is DDP itself on nccl around the fused ops: the initial broadcast of parameters and buffers and the
# gradient all-reduce, in float32 (contrastive: soft threshold; vit_cl: attention) and float64
# (noncontrastive: patch sums, bn loss)
DDP_METHODS = ("contrastive", "noncontrastive_sample", "vit_cl")


def build(name: str, device: torch.device, extra=()):
    """The module (built) and DataModule of a method's run config, as ``lightning fit --config`` makes them."""
    config, tiny, *cuda = METHODS[name]
    args = ["--config", str(CONFIGS / config), "--trainer.logger", "false", "--trainer.accelerator", "cpu",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            *(tiny if device.type == "cpu" else cuda[0] if cuda else []), *extra]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = make_cli(args, run=False)
    return cli.model.attach(cli.datamodule), cli.datamodule


def _floats(batch: dict, device, dtype, via) -> dict:
    """The batch on ``device``, floating tensors rounded to ``via`` first (the GPU run's dtype) then ``dtype``."""
    return {k: v.to(via).to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in batch.items()}


def compare_states(got: dict, want: dict, before: dict, dtype: torch.dtype, label: str) -> dict:
    """Each floating tensor within ``STEP_RTOL`` of the reference's change plus ``ULPS`` of its norm; NaN where
    the reference has NaN (a clock not yet fired); the rest equal. Returns the failures."""
    bad, used = {}, {}
    for key, ref in want.items():
        value = got[key].detach().cpu()
        if not ref.is_floating_point():
            if not torch.equal(value, ref):
                bad[key] = "differs"
            continue
        value, ref, init = value.double(), ref.detach().double(), before[key].double()
        nan = torch.isnan(ref)
        if not torch.equal(torch.isnan(value), nan) or not torch.isfinite(value[~nan]).all():
            bad[key] = "NaN/inf where the float64 step has none (or none where it has)"
            continue
        value, ref, init = value[~nan], ref[~nan], init[~nan].nan_to_num(0.0)  # a clock that fired: all change
        err, change = float((value - ref).norm()), float((ref - init).norm())
        rtol = STEP_RTOL_OF.get(label.split()[0], {}).get(dtype, STEP_RTOL[dtype])  # "<method> compiled": its own
        allowed = rtol * change + ULPS * torch.finfo(dtype).eps * float(ref.norm())
        used[key] = f"{err / allowed:.1e}" if allowed > 0 else f"{err:.1e}"
        if not err <= allowed:
            bad[key] = f"error {err:.2e} > {allowed:.2e} (change {change:.2e}, norm {float(ref.norm()):.2e})"
    print(label, "error / allowed:", used)  # pytest -rP shows them
    return bad


def _state(model) -> dict:
    return {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(METHODS))
def test_step_matches_cpu_float64(gpu_device, name):
    """The step, and for a method in :data:`COMPILED` the step with ``model.compile: true`` too (its loss traced
    by dynamo and AOTAutograd, ``aot_eager``: inductor's kernels are torch's to test, and its compiles would
    cost the check minutes), against one CPU float64 step. The compiled non-contrastive sampled step failed
    here on torch 2.11 CUDA (gradient 0) while the CPU (torch 2.13) agreed."""
    model, dm = build(name, gpu_device)
    dtype = next(model.parameters()).dtype  # the method's dtype (float64 data: float64 parameters)
    # the Trainer's first batch: the loader's indices, generated by the DataModule's hook (masks included)
    batch = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
    before = _state(model)  # the GPU run's state; the float64 one holds the same values

    ref = copy.deepcopy(model).to(dtype=torch.float64)
    module_step(ref, _floats(batch, "cpu", torch.float64, dtype))
    want = _state(ref)
    assert any(not torch.equal(want[k].double(), before[k].double()) for k, _ in ref.named_parameters()), \
        "the step changed no parameter: nothing to compare"
    eager = None
    for compiled in (False, True)[:1 + (name in COMPILED)]:
        run = copy.deepcopy(model)
        if gpu_device.type == "cpu" and "backend" in model.hparams and not compiled:
            # dry mode: the path the GPU run takes (backend auto is Triton on CUDA), through the interpreter
            run = build(name, gpu_device, ["--model.init_args.backend", "triton"])[0]
            run.load_state_dict(model.state_dict())
        if compiled:
            run.compile_loss("aot_eager")
        module_step(run.to(gpu_device), _floats(batch, gpu_device, dtype, dtype))
        label = f"{name}{' compiled' * compiled}"
        got = _state(run)
        assert got.keys() == want.keys()
        bad = compare_states(got, want, before, dtype, label)
        assert not bad, f"{label} ({dtype}) on {gpu_device} vs CPU float64: {bad}"
        eager = eager or run
    # the end-of-run metrics (hp/* and the experiments' tables) on the device: a CPU-made tensor meeting a
    # CUDA one fails only here (universality's ridge fit did, 2026-11-27)
    final, final_ref = eager.final_metrics(), ref.final_metrics()
    assert final.keys() == final_ref.keys()
    assert all(math.isfinite(v) for v in final.values()), f"{name}: non-finite final metrics {final}"


def test_every_compiled_loss_has_a_compiled_step(gpu_device):
    """Each module class with a compiled loss (``compiled_loss``) among :data:`METHODS` has a config in
    :data:`COMPILED` (its classes read from the configs, as ``lightning fit`` resolves them)."""
    classes = {}
    for name, (config, *_) in METHODS.items():
        module, _, cls = Run(config, name).resolved()["model"]["class_path"].rpartition(".")
        if getattr(importlib.import_module(module), cls).compiled_loss is not None:
            classes.setdefault(cls, set()).add(name)
    missing = {cls: sorted(names) for cls, names in classes.items() if not names & set(COMPILED)}
    assert not missing, f"add one config of each to COMPILED: {missing}"


# ---------------------------------------------------------------------------------------------------
# one-rank DDP and synced statistics
# ---------------------------------------------------------------------------------------------------
def _backend(device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean_process_state():
    """Lightning's DDP sets the rank variables in ``os.environ`` and leaves its process group up: undone after."""
    environ = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


def _fit(model, dm, device, strategy, steps: int):
    trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, strategy=strategy,
                        max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == steps
    return _state(model)


@pytest.mark.parametrize("name", DDP_METHODS)
def test_one_rank_ddp_matches_plain_run(gpu_device, clean_process_state, name):
    model, dm = build(name, gpu_device)
    before = _state(model)
    plain = _fit(copy.deepcopy(model), copy.deepcopy(dm), gpu_device, "auto", 2)
    ddp = _fit(copy.deepcopy(model), copy.deepcopy(dm), gpu_device,
               DDPStrategy(process_group_backend=_backend(gpu_device)), 2)
    assert ddp.keys() == plain.keys()
    dtype = next(model.parameters()).dtype
    bad = compare_states(ddp, plain, before, dtype, name)  # the same device and dtype: ~atomics' reordering at most
    assert not bad, f"{name}: 1-rank {_backend(gpu_device)} DDP vs plain run: {bad}"


# the synced path gathers float64 statistics (bn) or sums (l2) whatever the inputs' dtype: one dtype each,
# noncontrastive's float64 for bn
@pytest.mark.parametrize("out_norm,dtype", [("bn", torch.float64), ("l2", torch.float32)], ids=["bn-fp64", "l2-fp32"])
def test_bn_cosine_sync_on_one_rank_matches_unsynced(gpu_device, pick, clean_process_state, out_norm, dtype):
    dist.init_process_group(_backend(gpu_device), init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    n, m = pick((4096, 512), (19, 6))
    gen = torch.Generator(device=gpu_device).manual_seed(5)
    p = torch.randn(n, m, generator=gen, device=gpu_device, dtype=dtype) * 3 + 1
    z = 0.5 * p + torch.randn(n, m, generator=gen, device=gpu_device, dtype=dtype)
    results = []
    for sync in (True, False):
        pr = p.clone().requires_grad_()
        loss = bn_cosine_loss(pr, z, out_norm=out_norm, eps=0.01, sync=sync, backend="triton")
        (grad,) = torch.autograd.grad(loss, (pr,))
        results.append({"loss": loss.detach(), "grad": grad})
    synced, alone = results
    tol = 1e-6 if dtype == torch.float32 else 1e-12  # one rank's merge: a division by its own count at most
    for key, want in alone.items():
        got = synced[key].to(want.dtype)
        assert torch.isfinite(got).all(), key
        err = float((got - want).double().norm()) / max(float(want.double().norm()), 1e-300)
        assert err <= tol, f"{key}: sync=True differs from sync=False by {err:.2e}"
