"""The hook-name fast path: Lightning's per-hook bookkeeping skips nn.Module.__setattr__, nothing else does."""
import torch

from featlearn.datamodules.two_feature_patches import TwoFeaturePatchDataModule
from featlearn.lightning_modules.noncontrastive import NonContrastiveModule
from featlearn.lightning_modules.seeds import SeedStack


def _counting(monkeypatch) -> list:
    seen, plain = [], torch.nn.Module.__setattr__

    def counted(self, name, value):
        seen.append(name)
        plain(self, name, value)
    monkeypatch.setattr(torch.nn.Module, "__setattr__", counted)
    return seen


def test_hook_name_skips_module_setattr_and_the_rest_does_not(monkeypatch):
    data = [TwoFeaturePatchDataModule(seed=s, dim=8, batch_size=4) for s in (0, 1)]
    modules = [NonContrastiveModule().attach(data[0]),
               SeedStack([NonContrastiveModule().attach(d) for d in data], [0, 1])]
    seen = _counting(monkeypatch)
    for module in modules:
        module._current_fx_name = "training_step"
        assert module._current_fx_name == "training_step" and "_current_fx_name" not in module._parameters
        module.extra = torch.nn.Parameter(torch.ones(3))
        assert "extra" in dict(module.named_parameters())
    assert seen == ["extra", "extra"]


def test_lightning_still_names_its_hooks_through_the_fast_path(monkeypatch, tmp_path):
    """A one-step fit: Lightning's name for the running hook is still ``_current_fx_name`` (so the fast path
    is taken, not silently bypassed by a renamed attribute), and nn.Module.__setattr__ never sets it."""
    import lightning as L

    data = TwoFeaturePatchDataModule(dim=8, batch_size=4, mode="online")
    module, named = NonContrastiveModule().attach(data), []
    step = module.training_step
    monkeypatch.setattr(module, "training_step", lambda *a: (named.append(module._current_fx_name), step(*a))[1])
    seen = _counting(monkeypatch)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, limit_val_batches=0)
    trainer.fit(module, data)
    assert named == ["training_step"] and "_current_fx_name" not in seen
