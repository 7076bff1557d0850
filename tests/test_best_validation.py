"""KeepBestOnValidation: the state of the best validation score comes back at the end of the fit (ties: the
earliest step; a non-finite score never kept), and the final checkpoint stays the final state."""
import lightning as L
import pytest
import torch

from featlearn.callbacks import FinalCheckpoint, KeepBestOnValidation

# a validation score per global step, validated every 2 steps: the largest 0.5 at steps 2 and 6 (the earliest wins),
# the smallest 0.1 at 8, NaN at 4 (never kept)
SCORES = {2: 0.5, 4: float("nan"), 6: 0.5, 8: 0.1}


class Counter(L.LightningModule):
    """One weight that grows by exactly 1 per step (loss -p, SGD with step 1), so the weight names its step."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))

    def training_step(self, batch, batch_idx):
        return -self.p

    def validation_step(self, batch, batch_idx):
        self.log("val/acc", SCORES[self.global_step])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(100, 1), batch_size=1)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(1, 1), batch_size=1)


def fit(keep, tmp_path):
    model = Counter()
    # validation every 2 steps, the last at 8: FinalCheckpoint's end-of-training save writes last.ckpt at step 9
    trainer = L.Trainer(max_steps=9, val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[keep, FinalCheckpoint(
                            dirpath=tmp_path, save_last=True, every_n_train_steps=0, save_top_k=0)])
    trainer.fit(model)
    return model


@pytest.mark.parametrize("mode, step", [("max", 2), ("min", 8)])
def test_the_best_state_is_restored_at_the_end_of_the_fit(mode, step, tmp_path):
    keep = KeepBestOnValidation("val/acc", mode)
    model = fit(keep, tmp_path)
    assert keep.best_step == step and float(model.p) == step
    assert keep.best_score == pytest.approx(SCORES[step]) and sorted(keep.scores) == [2, 4, 6, 8]
    # the checkpoint written at the end is the final state (step 9), not the restored one
    assert float(torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]["p"]) == 9


def test_without_validation_nothing_changes(tmp_path):
    keep = KeepBestOnValidation("val/other")
    model = fit(keep, tmp_path)
    assert keep.best_step is None and float(model.p) == 9


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode: 'max' or 'min'"):
        KeepBestOnValidation(mode="best")
