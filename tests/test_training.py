"""Runs through Lightning: small-config capture, exact resume, divergence stop, the CLI's config errors."""
from pathlib import Path

import lightning as L
import pytest
import torch

from featlearn.callbacks import DivergenceGuard, FinalCheckpoint
from featlearn.cli import main
from featlearn.datamodules.multiview import MultiViewDataModule
from featlearn.errors import DivergenceError
from featlearn.lightning_modules.mrp import TeacherStudentMRP


def small_data(**kw):
    args = dict(k=4, d=32, P=8, s=1.0, num_pretrain=200, seed=1)
    return MultiViewDataModule(**{**args, **kw})


def trainer(tmp_path, max_steps, **kw):
    return L.Trainer(max_steps=max_steps, max_epochs=-1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, **kw)


def test_small_pretraining_captures_every_feature(tmp_path):
    L.seed_everything(0)
    dm = small_data()
    model = TeacherStudentMRP(m=5, sigma0=0.02, lr=10.0, stop_after_capture=30, backend="torch")
    trainer(tmp_path, 1500, enable_checkpointing=False, callbacks=[DivergenceGuard()]).fit(model, dm)
    stats = model.final_metrics()
    assert stats["frac_captured"] == 1.0                            # Theorem 1 (a): every feature
    capturing = stats["kernels/pure"] + stats["kernels/sameclass"] + stats["kernels/crossclass"]
    assert stats["kernels/crossclass"] <= 0.1 * capturing           # a kernel holds one class at most
    assert stats["winner_in_m0_frac"] >= 0.5                        # lottery winners mostly from M0
    assert (model.first_capture_step >= 0).all()
    assert model.trainer.global_step < 1500                         # the stop rule ended the run
    assert model.weight.norm(dim=1).max() <= 1.0 + 1e-5             # projected GD


@pytest.mark.parametrize("mode", ["fixed", "online"])
def test_resume_continues_exactly(tmp_path, mode):
    def run(steps, ckpt=None, save=None):
        L.seed_everything(0)
        dm = small_data(mode=mode, batch_size=16, num_pretrain=48, steps_per_epoch=3)
        model = TeacherStudentMRP(m=2, sigma0=0.05, lr=20.0, loss="mc", stop_after_capture=None, backend="torch")
        t = trainer(tmp_path, steps, enable_checkpointing=False)
        t.fit(model, dm, ckpt_path=ckpt)
        if save:
            t.save_checkpoint(save)
        return model.weight.detach().clone()
    straight = run(12)
    run(6, save=tmp_path / "half.ckpt")
    resumed = run(12, ckpt=tmp_path / "half.ckpt")
    assert not torch.equal(straight, run(6))                      # the second half does change weights
    torch.testing.assert_close(resumed, straight, rtol=0, atol=0)


def test_resumed_run_stops_at_the_same_step_after_capture(tmp_path):
    def run(max_steps, ckpt=None, save=None):
        L.seed_everything(0)
        model = TeacherStudentMRP(m=5, sigma0=0.02, lr=10.0, stop_after_capture=10, backend="torch")
        t = trainer(tmp_path, max_steps, enable_checkpointing=False)
        t.fit(model, small_data(), ckpt_path=ckpt)
        if save:
            t.save_checkpoint(save)
        return t.global_step, int(model.first_capture_step.max())
    end, captured = run(1000)
    assert end == captured + 10                                     # stopped by the rule, not by max_steps
    run(captured + 3, save=tmp_path / "after_capture.ckpt")          # interrupted between capture and stop
    assert run(1000, ckpt=tmp_path / "after_capture.ckpt") == (end, captured)


@pytest.mark.parametrize("after, every", [(0, 1), (1, 7), (4, 50), (12, 5)])
def test_stop_after_capture_is_exact_without_a_read_per_step(tmp_path, after, every):
    """The stop comes exactly ``after`` steps after the last capture, with the capture steps read on the host
    at the multiples of min(log_every_n_steps, after + 1), not every step."""
    reads = []

    class Counting(TeacherStudentMRP):
        def capture_stop_due(self, step):
            due = super().capture_stop_due(step)
            if self._capture_read_at == step:
                reads.append(step)
            return due

    L.seed_everything(0)
    model = Counting(m=5, sigma0=0.02, lr=10.0, stop_after_capture=after, backend="torch")
    t = trainer(tmp_path, 1000, enable_checkpointing=False, log_every_n_steps=every)
    t.fit(model, small_data())
    captured = int(model.first_capture_step.max())
    assert t.global_step == captured + after                         # the exact step, not a read later
    spacing = min(every, after + 1)
    assert reads[0] == 1 and all(r % spacing == 0 for r in reads[1:])  # the first step, then the multiples
    assert len(reads) <= captured // spacing + 2


def test_nan_loss_stops_before_the_step_and_keeps_last_good_checkpoint(tmp_path):
    L.seed_everything(0)
    model = TeacherStudentMRP(m=2, sigma0=0.5, lr=1e6, norm_cap=None, backend="torch")
    ckpt = FinalCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1, save_top_k=0, monitor=None)
    guard = DivergenceGuard(weight_growth=float("inf"))  # growth unwatched: the non-finite checks stop it
    with pytest.raises(DivergenceError, match=r"global step \d+.*(train loss|parameter 'weight'|metric) .*(nan|inf)"):
        trainer(tmp_path, 100, callbacks=[guard, ckpt]).fit(model, small_data())
    last = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert torch.isfinite(last["state_dict"]["weight"]).all()
    assert last["global_step"] >= 1


CONFIG = "configs/mrp/teacher_student.yaml"


@pytest.mark.parametrize("override,needle", [
    (["--model.init_args.theta", "1.5"], "model.theta: must be a keep probability in (0, 1), got 1.5"),
    (["--model.init_args.q", "2"], "model.q: must be"),
    (["--data.init_args.d", "12"], "data.d: must be at least 2k = 20"),
    (["--data.init_args.P", "6"], "data.P: must be at least C_p (2 + 4 s) = 10"),
    (["--model.init_args.backend", "cuda"], "model.backend: must be one of ('auto', 'torch', 'triton')"),
])
def test_cli_refuses_bad_config_before_training(tmp_path, capsys, override, needle):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", CONFIG, "--trainer.default_root_dir", str(tmp_path), *override])
    assert exit_info.value.code not in (0, None)
    assert needle in capsys.readouterr().err + str(exit_info.value.code)
    assert not list(tmp_path.rglob("*.ckpt"))


def test_cli_print_config_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", CONFIG, "--print_config"])
    printed = capsys.readouterr().out
    for needle in ("norm_cap: 1.0", "c_tau: 0.0", "sigma_p: 0.005", "every_n_steps: 50", "save_last: true", "TensorBoardLogger"):
        assert needle in printed


# data_*.yaml are data blocks, experiment.yaml the settings of an experiment command and configs/large_k/
# sweep files (tests/test_sweep.py resolves each against its base config), not runs
@pytest.mark.parametrize("config", sorted(str(p) for p in Path("configs").rglob("*.yaml")
                                          if not p.name.startswith(("data_", "experiment"))
                                          and p.parent.name != "large_k"))
def test_every_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", config, "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "class_path: featlearn.lightning_modules." in capsys.readouterr().out
