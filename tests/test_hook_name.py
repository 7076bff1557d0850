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
