"""Two CPU processes (gloo) train the same weights as one process on the same global batch."""
import lightning as L
import torch

from featlearn.datamodules.multiview import MultiViewDataModule
from featlearn.lightning_modules.mrp import TeacherStudentMRP


def fit(tmp_path, devices, batch_size):
    L.seed_everything(0)
    dm = MultiViewDataModule(k=4, d=32, P=8, s=1.0, num_pretrain=64, seed=1, batch_size=batch_size)
    model = TeacherStudentMRP(m=2, sigma0=0.05, lr=20.0, loss="mc", stop_after_capture=None, backend="torch")
    model.attach(dm)  # build in this process: ddp_spawn copies the trained weights back into these parameters
    strategy = "ddp_spawn" if devices > 1 else "auto"
    L.Trainer(max_steps=6, max_epochs=-1, accelerator="cpu", devices=devices, strategy=strategy, logger=False,
              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
              default_root_dir=tmp_path).fit(model, dm)
    return model.weight.detach()


def test_two_processes_match_one_on_the_same_global_batch(tmp_path):
    single = fit(tmp_path, devices=1, batch_size=16)
    double = fit(tmp_path, devices=2, batch_size=8)                 # same global batch of 16, 2 epochs of 4 steps
    assert not torch.allclose(single, fit(tmp_path, devices=1, batch_size=8))  # the batch split matters
    torch.testing.assert_close(double, single, rtol=1e-5, atol=1e-6)
