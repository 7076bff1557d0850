"""Contrastive regularisation in the contrastive module of Wen & Li 2021: start from a reference checkpoint, stay in its
trust region."""
import lightning as L
import pytest
import torch

from featlearn.datamodules.sparse_coding import SparseCodingDataModule
from featlearn.errors import ConfigError
from featlearn.lightning_modules.contrastive import ContrastiveModule

pytestmark = pytest.mark.usefixtures("one_thread")


def _fit(model, steps, path=None):
    dm = SparseCodingDataModule(d=8, d1=32, batch_size=32, num_negatives=32, num_val=64, num_test=64, seed=1)
    trainer = L.Trainer(max_steps=steps, max_epochs=-1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    if path is not None:
        trainer.save_checkpoint(path)
    return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("cr") / "reference.ckpt"
    model = _fit(ContrastiveModule(width=16, lr=1.0, backend="torch"), 40, path)
    return path, model.w.detach().clone()


def test_trust_region_holds_and_binds(reference):
    path, w_star = reference
    gamma = 0.05 * float(w_star.norm())
    model = ContrastiveModule(width=16, lr=1.0, backend="torch", cr_reference=str(path), cr_gamma=gamma)
    _fit(model, 30)
    dist = float((model.w.detach() - w_star).norm())
    assert dist <= gamma * (1 + 1e-5)
    assert dist >= 0.99 * gamma  # the region binds: without it the weights move further
    free = _fit(ContrastiveModule(width=16, lr=1.0, backend="torch", cr_reference=str(path), cr_gamma=1e6), 30)
    assert float((free.w.detach() - w_star).norm()) > 2 * gamma
    assert torch.equal(free.cr.reference()["w"], w_star)  # the reference is the checkpoint's w, kept in the module


def test_bad_cr_settings_are_refused(reference, tmp_path):
    path, _ = reference
    with pytest.raises(ConfigError, match="model.cr_reference"):
        ContrastiveModule(cr_gamma=0.1)
    with pytest.raises(ConfigError, match="model.cr_gamma"):
        ContrastiveModule(cr_reference=str(path))
    dm = SparseCodingDataModule(d=8, d1=32, batch_size=32, num_negatives=32)
    with pytest.raises(ConfigError, match="model.cr_reference: .*shape"):
        ContrastiveModule(width=12, cr_reference=str(path), cr_gamma=0.1).attach(dm)
    with pytest.raises(ConfigError, match="model.cr_reference"):
        ContrastiveModule(width=16, cr_reference=str(tmp_path / "missing.ckpt"), cr_gamma=0.1).attach(dm)
