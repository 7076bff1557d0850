import torch, time, statistics as st
import lightning as L
torch.set_num_threads(1)
class M(L.LightningModule):
    def __init__(self):
        super().__init__(); self.w = torch.nn.Parameter(torch.zeros(4))
    def training_step(self, batch, i):
        return (self.w * batch).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(100000, 4), batch_size=None)
class Fast(M):
    def __setattr__(self, name, value):
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)
def fit(cls, n):
    tr = L.Trainer(max_steps=n, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    m = cls(); t = time.perf_counter(); tr.fit(m); return (time.perf_counter() - t)
import logging; logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
fit(M, 100); fit(Fast, 100)
r = {"plain": [], "fast": []}
for i in range(5):
    for k, c in (("plain", M), ("fast", Fast)):
        r[k].append((fit(c, 2200) - fit(c, 200)) / 2000 * 1e3)
print({k: [round(x, 3) for x in v] for k, v in r.items()})
