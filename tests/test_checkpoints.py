"""Checkpoints hold finished steps: last.ckpt is the final state, and resuming from a periodic checkpoint
of each method (norm cap active, bias schedule running, EMA target on) ends bit-equal with an
uninterrupted run."""
import os
import signal

import lightning as L
import pytest
import torch

from featlearn.callbacks import DivergenceGuard, FinalCheckpoint
from featlearn.experiments.common import build
from featlearn.datamodules.modular_addition import ModularAdditionDataModule
from featlearn.datamodules.multiview import MultiViewDataModule
from featlearn.datamodules.sparse_coding import SparseCodingDataModule
from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
from featlearn.lightning_modules.contrastive import ContrastiveModule
from featlearn.lightning_modules.modular_addition import FourierMLP
from featlearn.lightning_modules.mrp import TeacherStudentMRP
from featlearn.lightning_modules.multiview_classifier import MultiViewClassifier
from featlearn.lightning_modules.noncontrastive import NonContrastiveModule


def mrp():
    dm = MultiViewDataModule(k=4, d=32, P=8, s=1.0, num_pretrain=200, seed=1)
    return TeacherStudentMRP(m=2, sigma0=0.3, lr=10.0, stop_after_capture=None, backend="torch"), dm


def contrastive():  # T1 (the bias reset) happens at step 63 at this size; the schedule runs after it
    dm = SparseCodingDataModule(d=16, d1=64, batch_size=32, num_negatives=32, seed=0)
    return ContrastiveModule(lr=0.5, backend="torch"), dm


def noncontrastive():
    dm = TwoFeaturePatchDataModule(dim=12, num_patches=8, num_feature_patches=2, batch_size=64, seed=5)
    return NonContrastiveModule(width=2, target="ema", ema_decay=0.9, lr=0.5, backend="torch"), dm


def modular_addition():  # configure_optimizers returns the dict form; the warm-up schedule runs across the save
    dm = ModularAdditionDataModule(k=3, p=5, batch_size=16, seed=2)
    return FourierMLP(width=12, warmup_steps=10, backend="torch"), dm


# (method, steps, periodic save step): each save falls where the step-finishing work is active
METHODS = {"mrp_norm_cap": (mrp, 12, 7), "contrastive_bias_schedule": (contrastive, 70, 66),
           "noncontrastive_ema": (noncontrastive, 12, 7), "modular_addition_warmup": (modular_addition, 12, 5)}


def fit(make, steps, root, every=0, ckpt_path=None):
    L.seed_everything(0)
    model, dm = make()
    callbacks = [DivergenceGuard()]
    if every:
        callbacks.append(FinalCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=every,
                                         save_top_k=-1, save_last=True, monitor=None))
    L.Trainer(max_steps=steps, max_epochs=-1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=bool(every), callbacks=callbacks,
              limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root).fit(model, dm, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("name", list(METHODS))
def test_resume_from_a_periodic_checkpoint_is_exact(tmp_path, name, one_thread):
    make, steps, save_at = METHODS[name]
    straight = fit(make, steps, tmp_path / "straight")
    fit(make, steps, tmp_path / "saved", every=save_at)
    periodic = tmp_path / "saved" / f"step={save_at}.ckpt"
    assert torch.load(periodic, weights_only=False)["global_step"] == save_at
    resumed = fit(make, steps, tmp_path / "resumed", ckpt_path=periodic)
    if name == "contrastive_bias_schedule":
        assert straight.T1 is not None and straight.T1 < save_at and resumed.bias.abs().max() > 0
    state, again = straight.state_dict(), resumed.state_dict()
    assert state.keys() == again.keys()
    for key in state:
        torch.testing.assert_close(again[key], state[key], rtol=0, atol=0, msg=key)


def test_periodic_checkpoint_respects_the_norm_cap(tmp_path, one_thread):
    model = fit(mrp, 12, tmp_path, every=7)
    saved = torch.load(tmp_path / "step=7.ckpt", weights_only=False)["state_dict"]["weight"]
    assert model.weight.norm(dim=1).max() <= 1.0 + 1e-6
    assert saved.norm(dim=1).max() <= 1.0 + 1e-6          # the projection is part of the saved step


def test_cli_last_checkpoint_is_the_final_state_and_fine_tunes_like_a_final_save(tmp_path, one_thread):
    cli = build("mrp/teacher_student.yaml", tmp_path, "pretrain", "--trainer.max_steps", "15",
                "--checkpoint.every_n_train_steps", "10", "--model.init_args.sigma0", "0.3",
                "--data.init_args.num_pretrain", "64", "--data.init_args.num_downstream", "64",
                "--data.init_args.num_test", "64")
    cli.trainer.fit(cli.model, cli.datamodule)
    cli.trainer.save_checkpoint(tmp_path / "pretrained.ckpt")      # what the MRP experiment used to fine-tune from
    last_path = cli.trainer.checkpoint_callback.last_model_path
    last = torch.load(last_path, weights_only=False)
    assert last["global_step"] == 15                               # not 10, the last periodic save
    assert last["state_dict"]["weight"].norm(dim=1).max() <= 1.0 + 1e-6
    data = MultiViewDataModule(num_downstream=64, num_test=64)
    encoders = [MultiViewClassifier(pretrained=str(path), m=cli.model.m).attach(data).weight.detach()
                for path in (last_path, tmp_path / "pretrained.ckpt")]
    torch.testing.assert_close(encoders[0], encoders[1], rtol=0, atol=0)
    torch.testing.assert_close(encoders[0], cli.model.weight.detach(), rtol=0, atol=0)


class _CtrlC(L.Callback):
    """Sends SIGINT to this process ``times`` times in the middle of step ``at`` (after its forward pass)."""

    def __init__(self, at: int, times: int):
        self.at, self.times = at, times

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step + 1 == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("times,kept", [(1, 13), (2, 10)])
def test_ctrl_c_saves_the_step_in_progress_and_a_second_one_keeps_the_last_save(tmp_path, capsys, times, kept,
                                                                               one_thread):
    """One Ctrl-C in step 13: the step finishes and last.ckpt holds it (Lightning alone: step 10, the
    periodic save). Two: the user will not wait, and a half-done step is no state to resume from, so
    last.ckpt stays at step 10 and the message says so."""
    model, dm = mrp()
    final = FinalCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=0, save_last=True, monitor=None)
    trainer = L.Trainer(max_steps=100, max_epochs=-1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[DivergenceGuard(), final, _CtrlC(13, times)],
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path)
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's own end of an interrupted fit
            trainer.fit(model, dm)
    finally:
        signal.signal(signal.SIGINT, before)  # Lightning leaves SIGINT ignored after an interrupt
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == kept
    said = capsys.readouterr().err
    assert f"holds step {kept}" in said and (times == 1) == (f"interrupted after step {kept}" in said), said


def test_a_lowered_lr_resumes_on_the_schedule(tmp_path, one_thread):
    # FourierMLP's step size is lr times a warm-up factor (step + 1) / 10: resuming the step-5 checkpoint with half
    # the lr must give half the uninterrupted run's step sizes from there on, schedule included
    def make(lr):
        return lambda: (FourierMLP(width=12, warmup_steps=10, lr=lr, backend="torch"),
                        ModularAdditionDataModule(k=3, p=5, batch_size=16, seed=2))

    rates = {}

    class Rates(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            rates.setdefault(trainer.ckpt_path is not None, []).append(trainer.optimizers[0].param_groups[0]["lr"])

    fit(make(4e-3), 5, tmp_path / "saved", every=5)
    for lr, ckpt in ((4e-3, None), (2e-3, tmp_path / "saved" / "step=5.ckpt")):
        L.seed_everything(0)
        model, dm = make(lr)()
        L.Trainer(max_steps=8, max_epochs=-1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                  callbacks=[Rates()], limit_val_batches=0, num_sanity_val_steps=0,
                  default_root_dir=tmp_path).fit(model, dm, ckpt_path=ckpt)
    straight, resumed = rates[False][5:], rates[True]
    assert straight == pytest.approx([4e-3 * (s + 1) / 10 for s in (5, 6, 7)], rel=1e-12)
    assert resumed == pytest.approx([r / 2 for r in straight], rel=1e-12)


class _TwoOptimizers(FourierMLP):
    """Two optimizers, only the second on a warm-up schedule: ``([plain, scheduled], [its schedule])``."""

    def configure_optimizers(self):
        plain = torch.optim.SGD([self.U], lr=self.hparams.lr)
        scheduled = torch.optim.AdamW([self.W], lr=self.hparams.lr)
        return [plain, scheduled], [torch.optim.lr_scheduler.LambdaLR(scheduled, lambda step: (step + 1) / 10)]


def test_resume_rebases_the_schedule_of_its_own_optimizer():
    dm = ModularAdditionDataModule(k=3, p=5, batch_size=16, seed=2)
    old = _TwoOptimizers(width=12, lr=4e-3).attach(dm)
    optimizers, schedules = old.configure_optimizers()
    for _ in range(4):  # four scheduled steps: the second optimizer's lr is 4e-3 * 5 / 10
        optimizers[1].step()
        schedules[0].step()
    checkpoint = {"optimizer_states": [o.state_dict() for o in optimizers],
                  "lr_schedulers": [s.state_dict() for s in schedules]}
    _TwoOptimizers(width=12, lr=2e-3).attach(dm).on_load_checkpoint(checkpoint)
    plain, scheduled = (state["param_groups"][0] for state in checkpoint["optimizer_states"])
    assert plain["lr"] == 2e-3  # no schedule: the config's lr as it is
    assert scheduled["lr"] == pytest.approx(2e-3 * 5 / 10, rel=1e-12) and scheduled["initial_lr"] == 2e-3
    assert checkpoint["lr_schedulers"][0]["base_lrs"] == [2e-3]
