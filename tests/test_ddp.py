"""Every method trained through the CLI's ``ddp`` path on two CPU processes (gloo) ends with the weights
of one process on the same global batch: ``devices=2, batch_size=B`` against ``devices=1, batch_size=2B``
(or both full batch), compared from their ``last.ckpt``. A third run, one process with batch ``B``,
shows that the split matters, so a DDP step that saw only its own half would fail the comparison (a property
of the case's config: under ``-m slow``).

Each case is two CLI runs of a few seconds (~10 s a case on 2 cores); the default suite keeps one
config per method and mode (full batch, minibatch, population gradient; the classifier that fine-tunes
and trains SL; contrastive learning online only, its full-batch pool checked in process), the rest is
``-m slow``. Contrastive learning matches only because its shared negative pool is built from
the global batch (``SparseCodingDataModule.negatives_per_anchor``, ``ContrastiveModule._global_pool``);
the in-process test below checks that pool without launching anything.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddp_cases import CASES, DEFAULT
from featlearn.datamodules.sparse_coding import SparseCodingDataModule, pool_negatives

ROOT = Path(__file__).resolve().parents[1]
CLI = Path(sys.executable).parent / "lightning"
STEPS = 6

# Every run: CPU, no logger/validation, last.ckpt written at the final step; the blow-up guard is off
# because tiny initial weights legitimately grow more than its factor within these few steps, and a
# suspect run postpones its checkpoint.
COMMON = ["--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.max_steps", str(STEPS),
          "--trainer.max_epochs", "-1", "--trainer.logger", "false", "--trainer.limit_val_batches", "0",
          "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
          "--trainer.enable_model_summary", "false", "--checkpoint.every_n_train_steps", str(STEPS),
          "--divergence.loss_growth", "1e30", "--divergence.weight_growth", "1e30"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit(tmp_path: Path, name: str, devices: int, batch_size: int | None, extra: tuple = ()) -> dict:
    """One CLI run; returns the checkpoint's state dict."""
    config, overrides = CASES[name][:2]
    out = tmp_path / f"{name}_{devices}x{batch_size}{'_'.join(('', *extra))}"
    cmd = [str(CLI), "fit", "--config", str(ROOT / "configs" / config), *COMMON, *overrides, *extra,
           "--trainer.devices", str(devices), "--trainer.default_root_dir", str(out),
           "--checkpoint.dirpath", str(out / "ckpt")]
    if batch_size is not None:
        cmd += ["--data.batch_size", str(batch_size)]
    # A fresh port per run: the launcher re-runs this command line for rank 1, which meets rank 0 there.
    env = {**os.environ, "MASTER_PORT": str(_free_port()), "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)  # an enclosing distributed run's rank would make this one join it
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    ckpt = torch.load(out / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == STEPS
    return ckpt["state_dict"]


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


def _check(tmp_path, name, extra: tuple = (), split_matters: bool = True):
    """Two processes end where one process with the doubled batch ends; with ``split_matters``, a third run (one
    process, half the batch) shows that the comparison can fail for this case."""
    _, _, batch, split, dtype = CASES[name]
    double = fit(tmp_path, name, devices=2, batch_size=batch, extra=extra)
    single = fit(tmp_path, name, devices=1, batch_size=None if batch is None else 2 * batch, extra=extra)
    assert double.keys() == single.keys()
    # float32: a few ulps from reordered sums (over ranks, over gathered rows); float64: ~1e-15
    rtol, atol_rel = (1e-5, 1e-6) if dtype == torch.float32 else (1e-10, 1e-12)
    for key, value in single.items():
        assert value.dtype == double[key].dtype, key
        if value.is_floating_point():
            # NaN marks a clock that has not fired (e.g. a stage not reached): it must match too
            atol = atol_rel * max(float(value.abs().nan_to_num().max()), 1e-30)
            torch.testing.assert_close(double[key], value, rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m: f"{key}: {m}")
        else:
            assert torch.equal(double[key], value), key
    if split is not None and split_matters:
        apart = fit(tmp_path, name, devices=1, batch_size=split, extra=extra)
        assert max_diff(apart, single) > 100 * max_diff(double, single), "the batch split does not matter"


@pytest.mark.parametrize("mode,batch,num_negatives", [("online", 4, 20), ("online", 4, 3), ("fixed", 4, 12),
                                                      ("fixed", None, 10), ("fixed", None, 40)])
def test_negative_pool_gathered_from_ranks_is_the_one_device_pool(mode, batch, num_negatives):
    """In process, no launcher: each rank's batch (its anchors' own negatives), concatenated over ranks and
    pooled as ContrastiveModule does after its all_gather, is the pool of one device with the global batch."""
    world, kw = 2, dict(d=8, d1=24, num_negatives=num_negatives, mode=mode, num_train=16, seed=3)

    def batch_on(rank, devices, step, batch_size):
        dm = SparseCodingDataModule(batch_size=batch_size, **kw)
        dm.trainer = SimpleNamespace(global_step=step, global_rank=rank, world_size=devices, accumulate_grad_batches=1)
        local = torch.arange(batch_size or kw["num_train"] // devices)
        return dm.batch(dm._train_index(local), "train")

    for step in (0, 3, 5):  # fixed minibatches: steps 3 and 5 are in reshuffled epochs
        one = batch_on(0, 1, step, None if batch is None else world * batch)
        parts = [batch_on(rank, world, step, batch) for rank in range(world)]
        assert all(p["neg_pool_size"] == num_negatives for p in parts)
        index = torch.cat([p["index"] for p in parts])
        assert torch.equal(index.sort().values, one["index"].sort().values)  # the same global batch
        pool = pool_negatives(torch.cat([p["x_neg"] for p in parts]), index, num_negatives)
        assert one["x_neg"].shape == (num_negatives, kw["d1"])
        assert torch.equal(pool, one["x_neg"])
        assert torch.equal(torch.cat([p["x_a"] for p in parts])[index.argsort()], one["x_a"][one["index"].argsort()])


@pytest.mark.parametrize("name", DEFAULT)
def test_two_processes_match_one(tmp_path, name):
    _check(tmp_path, name, split_matters=False)  # the third run, a property of the case's config: -m slow below


@pytest.mark.slow
@pytest.mark.parametrize("name", DEFAULT)
def test_two_processes_match_one_and_the_split_matters(tmp_path, name):
    _check(tmp_path, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["noncontrastive_sample", "noncontrastive_population", "universality", "contrastive"])
def test_several_seeds_in_one_run_on_two_processes_match_one(tmp_path, name):
    """``--seeds``: each rank runs every seed on its half of each seed's batch (universality's loss gathers the
    global batch, so its vmap is off on several processes; the population loss reads no batch and stays vmapped)."""
    _check(tmp_path, name, ("--seeds", "[4, 7]"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(CASES) - set(DEFAULT)))
def test_two_processes_match_one_slow(tmp_path, name):
    _check(tmp_path, name)


def _ddp_env() -> dict:
    """A CLI subprocess's environment for a fresh 2-process CPU run: its own port, no inherited rank."""
    env = {**os.environ, "MASTER_PORT": str(_free_port()), "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return env


def _fit_logged(tmp_path: Path, config: str, overrides: list, devices: int, batch_size: int | None,
                prefix: str = "hp/") -> dict[str, float]:
    """One CLI run with the TensorBoard logger on and every step logged (theory metrics, figures, the
    end-of-training figures and ``hp/`` results); returns the last value of its scalars whose tag starts with
    ``prefix``. A deadlock fails by timeout."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / f"logged_{devices}x{batch_size}"
    common = list(COMMON)
    del common[common.index("--trainer.logger"):common.index("--trainer.logger") + 2]
    common[common.index("--trainer.max_steps") + 1] = "2"
    common[common.index("--checkpoint.every_n_train_steps") + 1] = "2"
    cmd = [str(CLI), "fit", "--config", str(ROOT / "configs" / config), *common, *overrides,
           "--trainer.log_every_n_steps", "1", "--trainer.logger.init_args.save_dir", str(out),
           "--trainer.devices", str(devices), "--trainer.default_root_dir", str(out),
           "--checkpoint.dirpath", str(out / "ckpt"), "--data.batch_size", str(batch_size or "null")]
    env = _ddp_env()
    # its own process group, so that a hung rank 1 (launched by rank 0) is ended with it
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        pytest.fail(f"{' '.join(cmd)}: no end after 150 s (ranks waiting in mismatched collectives)")
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    events = EventAccumulator(str(next(out.rglob("hparams.yaml")).parent), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"] if tag.startswith(prefix)}


@pytest.mark.parametrize("name", ["vit_cl", pytest.param("vit_mae", marks=pytest.mark.slow)])  # CL: gathers, MAE not
def test_vit_logged_run_ends_on_two_processes_with_the_one_process_results(tmp_path, name):
    """With a logger, the end of training evaluates the last batch (CL: an all_gather of the negatives;
    both: the metrics' all_reduce) on every rank before rank 0 draws; the ``hp/`` results are those of the
    global batch, the same on one process with the doubled batch."""
    config, overrides = CASES[name][:2]
    double = _fit_logged(tmp_path, config, overrides, devices=2, batch_size=4)
    single = _fit_logged(tmp_path, config, overrides, devices=1, batch_size=8)
    assert "hp/final_loss" in double and double.keys() == single.keys()
    for tag, value in single.items():
        assert double[tag] == pytest.approx(value, rel=1e-4, abs=1e-6), tag


@pytest.mark.parametrize("name, prefix", [("contrastive", ""),
                                          pytest.param("mrp_teacher_student", "", marks=pytest.mark.slow),
                                          pytest.param("erm_nu", "", marks=pytest.mark.slow)])
def test_logged_batch_metrics_are_the_global_batchs(tmp_path, name, prefix):
    """Batch-mean training metrics (losses, firing rates, positive-pair probabilities) logged on two processes
    are those of the global batch, as one process with the doubled batch logs them: each rank's mean over its
    own half is averaged over the ranks (``sync_dist``), not rank 0's half alone."""
    config, overrides, batch = CASES[name][:3]
    double = _fit_logged(tmp_path, config, overrides, devices=2, batch_size=batch, prefix=prefix)
    single = _fit_logged(tmp_path, config, overrides, devices=1, batch_size=2 * batch if batch else None,
                         prefix=prefix)
    batch_tags = [t for t in single if t.startswith("train/")]
    assert len(batch_tags) >= 3 if name == "contrastive" else batch_tags, sorted(single)
    for tag in batch_tags:
        assert double[tag] == pytest.approx(single[tag], rel=1e-4, abs=1e-6), tag


def test_two_layer_validation_accuracy_is_the_whole_splits(tmp_path):
    """The ch. 2 network's validation accuracy on two processes (each scoring its half of the split) is the
    accuracy of the whole split, as one process logs it: correct counts and totals are reduced over ranks
    (torchmetrics), not rank 0's half alone."""
    config, overrides, batch = CASES["two_layer"][:3]
    overrides = [o for o in overrides if o not in ("--trainer.check_val_every_n_epoch", "1000")]
    overrides += ["--trainer.limit_val_batches", "1.0", "--trainer.val_check_interval", "2",
                  "--trainer.check_val_every_n_epoch", "null", "--data.num_val", "40", "--model.lr3_mult", "100"]
    double = _fit_logged(tmp_path, config, overrides, devices=2, batch_size=batch, prefix="val/")
    single = _fit_logged(tmp_path, config, overrides, devices=1, batch_size=2 * batch, prefix="val/")
    assert "val/acc" in single, sorted(single)
    assert double["val/acc"] == pytest.approx(single["val/acc"], abs=1e-6)


def test_two_layer_probe_needs_find_unused_parameters_and_then_matches_one_process(tmp_path, monkeypatch):
    """Two Step freezes its first layer after step 2 and solves its readout on the gathered hidden layer of
    every rank at step 3: under plain DDP (which waits for the frozen layer's gradients) the run is refused
    before the first step, naming trainer.strategy; with ddp_find_unused_parameters_true it ends with the
    one-process weights (the readout, an L2-SVM solved at ridge 1e-8, amplifies float32 rounding of the
    hidden layer to ~1e-4 of its scale; the first layer agrees to float32 rounding)."""
    overrides = CASES["two_layer"][1]
    monkeypatch.setitem(CASES, "two_step", ("two_layer/two_step.yaml", overrides, 16, 16, torch.float32))
    with pytest.raises(AssertionError, match="error: trainer.strategy: must be ddp_find_unused_parameters_true"):
        fit(tmp_path / "plain", "two_step", devices=2, batch_size=16)
    monkeypatch.setattr(sys.modules[__name__], "COMMON",
                        [("ddp_find_unused_parameters_true" if c == "ddp" else c) for c in COMMON])
    double = fit(tmp_path, "two_step", devices=2, batch_size=16)
    single = fit(tmp_path, "two_step", devices=1, batch_size=32)
    for key, rtol in (("w", 1e-5), ("b", 1e-5), ("a", 1e-3)):
        atol = rtol * float(single[key].abs().max())
        torch.testing.assert_close(double[key], single[key], rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
    assert not torch.equal(single["a"], torch.zeros_like(single["a"]))


@pytest.mark.parametrize("killed", [1, pytest.param(0, marks=pytest.mark.slow)])  # rank 0 lost: -m slow
def test_a_lost_rank_is_one_line_naming_it_and_the_last_checkpoint(tmp_path, killed):
    """``kill -9`` of one rank mid-run (issue 22): the other exits non-zero with one line saying which rank was
    lost and which step ``last.ckpt`` holds, not gloo's "Connection reset by peer" traceback."""
    import re
    import signal
    import time

    tiny = ["--data.k", "4", "--data.d", "16", "--data.P", "10", "--data.s", "1", "--data.num_pretrain", "16",
            "--model.m", "2", "--model.backend", "torch"]
    common = list(COMMON)
    common[common.index("--trainer.max_steps") + 1] = "1000000"
    common[common.index("--checkpoint.every_n_train_steps") + 1] = "20"
    cmd = [str(CLI), "fit", "--config", str(ROOT / "configs/mrp/teacher_student.yaml"), *common, *tiny,
           "--trainer.devices", "2", "--trainer.default_root_dir", str(tmp_path)]
    env = _ddp_env()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    last = tmp_path / "checkpoints" / "last.ckpt"
    try:
        deadline = time.monotonic() + 180
        while not last.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        time.sleep(1.0)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1, children           # rank 0 is the command; it launched rank 1
        os.kill(int(children[0]) if killed == 1 else proc.pid, signal.SIGKILL)
        text = proc.communicate(timeout=150)[0]       # the pipe stays open until the surviving rank exits
    finally:
        if proc.poll() is None or killed == 0:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    survivor = 1 - killed
    if killed == 1:
        assert proc.returncode not in (0, None), text[-3000:]
    assert "Traceback" not in text and "Connection reset" not in text, text[-3000:]
    said = re.search(rf"^error: rank {survivor}: lost rank {killed} of 2 during step \d+; (\S+) holds step (\d+)$",
                     text, re.MULTILINE)
    assert said, text[-3000:]
    assert torch.load(last, weights_only=False)["global_step"] == int(said.group(2))

