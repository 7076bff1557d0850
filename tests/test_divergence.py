"""DivergenceGuard: blow-ups stop at once with the step, the quantity and the fix; the checkpoint kept
predates the blow-up; resuming it with a smaller learning rate uses that learning rate."""
import lightning as L
import pytest
import torch

from featlearn.callbacks import DivergenceGuard, FinalCheckpoint
from featlearn.cli import main
from featlearn.datamodules.multiview import MultiViewDataModule
from featlearn.datamodules.sparse_coding import SparseCodingDataModule
from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
from featlearn.errors import DivergenceError
from featlearn.lightning_modules.contrastive import ContrastiveModule
from featlearn.lightning_modules.mrp import TeacherStudentMRP
from featlearn.lightning_modules.multiview_classifier import MultiViewClassifier
from featlearn.lightning_modules.noncontrastive import NonContrastiveModule

# the cases: each ran on (to |w| ~ 1e18-6e28) before the guard watched growth
BLOWUPS = {
    "mrp_literal_lr1e8": lambda: (TeacherStudentMRP(m=2, lr=1e8, norm_cap=None, backend="torch"),
                                  MultiViewDataModule(k=4, d=32, P=8, s=1.0, num_pretrain=64, seed=1)),
    "supervised_lr1e8": lambda: (MultiViewClassifier(m=2, lr=1e8, backend="torch"),
                                 MultiViewDataModule(k=4, d=32, P=8, s=1.0, num_downstream=64, seed=1)),
    "contrastive_lr1e12": lambda: (ContrastiveModule(lr=1e12, backend="torch"),
                                   SparseCodingDataModule(d=16, d1=64, batch_size=32, num_negatives=32)),
    "noncontrastive_population_lr1e30": lambda: (
        NonContrastiveModule(width=2, lr=1e30, gradient="population", backend="torch"),
        TwoFeaturePatchDataModule(dim=12, num_patches=8, num_feature_patches=2, batch_size=2)),
}


def fit(model, dm, steps, callbacks, root):
    L.Trainer(max_steps=steps, max_epochs=-1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=callbacks, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root,
              enable_checkpointing=any(isinstance(c, FinalCheckpoint) for c in callbacks)).fit(model, dm)


@pytest.mark.parametrize("case", list(BLOWUPS))
def test_blowup_stops_at_once_naming_step_quantity_and_fix(tmp_path, case, one_thread):
    L.seed_everything(0)
    model, dm = BLOWUPS[case]()
    with pytest.raises(DivergenceError) as err:
        fit(model, dm, 50, [DivergenceGuard()], tmp_path)
    message = str(err.value)
    assert "global step 1 " in message or "global step 2 " in message, message
    assert ("weight norm" in message or "loss" in message) and "limit" in message and "learning rate" in message


def test_normal_runs_are_not_stopped(tmp_path, one_thread):
    for make in (lambda: (TeacherStudentMRP(m=2, backend="torch", stop_after_capture=None),
                          MultiViewDataModule(k=4, d=32, P=8, s=1.0, num_pretrain=64, seed=1)),
                 lambda: (NonContrastiveModule(width=2, gradient="population", backend="torch"),
                          TwoFeaturePatchDataModule(dim=12, num_patches=8, num_feature_patches=2, batch_size=2))):
        model, dm = make()
        fit(model, dm, 60, [DivergenceGuard()], tmp_path)
        assert model.trainer.global_step == 60


def test_factor_comes_from_the_method_unless_set():
    assert DivergenceGuard().factors(TeacherStudentMRP()) == {"weight_norm": 10.0}
    assert DivergenceGuard().factors(ContrastiveModule()) == {"loss": 100.0, "weight_norm": 1000.0}
    assert DivergenceGuard(weight_growth=3.0).factors(TeacherStudentMRP()) == {"weight_norm": 3.0}


def test_kept_checkpoint_predates_the_blowup_and_resumes_with_a_new_lr(tmp_path, capsys):
    # the literal teacher-student dynamics (no norm cap) blow up after ~80 steps at lr 5, growing
    # steadily: a checkpoint every step would keep a state deep into the growth without the guard
    tiny = ["--data.init_args.num_pretrain", "64", "--trainer.enable_progress_bar", "false",
            "--trainer.logger", "false", "--checkpoint.dirpath", str(tmp_path), "--checkpoint.every_n_train_steps", "1"]
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", "configs/mrp/teacher_student.yaml", "--model.init_args.norm_cap", "null", *tiny,
              "--trainer.default_root_dir", str(tmp_path / "first")])
    message = str(stop.value.code)
    assert "diverged at global step" in message and "weight norm" in message and "--ckpt_path" in message
    diverged_at = int(message.split("global step ")[1].split()[0])
    kept = torch.load(tmp_path / "last.ckpt", weights_only=False)
    history = kept["callbacks"]["DivergenceGuard"]["history"]
    smallest = min(v["weight_norm"] for _, v in history)
    kept_norm = kept["state_dict"]["weight"].norm().item()
    assert kept["global_step"] < diverged_at - 1                      # saves were held back during the growth
    assert kept_norm <= 10 ** 0.5 * smallest + 1e-9                   # below the watch level at the save
    # resume with a smaller learning rate: the config's lr replaces the checkpoint's optimizer lr
    resumed_steps = kept["global_step"] + 20
    main(["fit", "--config", "configs/mrp/teacher_student.yaml", "--model.init_args.norm_cap", "null",
          "--model.init_args.lr", "0.05", "--ckpt_path", str(tmp_path / "last.ckpt"),
          "--trainer.max_steps", str(resumed_steps), *tiny, "--trainer.default_root_dir", str(tmp_path / "resumed")])
    final = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert final["global_step"] == resumed_steps > diverged_at        # went on past the old blow-up step
    assert final["optimizer_states"][0]["param_groups"][0]["lr"] == 0.05
