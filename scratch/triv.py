import torch, time, cProfile, pstats, sys
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
def fit(n):
    tr = L.Trainer(max_steps=n, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    m = M(); t = time.perf_counter(); tr.fit(m); return (time.perf_counter() - t)
fit(100)
a, b = fit(200), fit(2200)
print("per step ms", (b - a) / 2000 * 1e3)
if len(sys.argv) > 1:
    cProfile.run("fit(3000)", "/tmp/prof/triv.prof")
    p = pstats.Stats("/tmp/prof/triv.prof"); p.sort_stats("tottime").print_stats(25)
