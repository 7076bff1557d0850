"""Downstream classification of multi-view data: MRP fine-tuning and the supervised baseline (Pan et al. 2023,
Sec. 3.2 and App. G; Lemma 1).

One module, two protocols:

* fine-tuning: ``pretrained`` points to a pretraining checkpoint; the encoder starts from its kernels,
  a new linear head ``U`` starts at 0, both trained by gradient descent (``lr`` for the encoder
  ``eta_1``, ``lr_head`` for the head ``eta_2``);
* supervised learning from scratch (Lemma 1): ``pretrained: null``, encoder ``W(0) ~ N(0, sigma0^2)``,
  head ``fixed`` (kernel block ``i`` of ``m`` kernels sums into logit ``i``, Allen-Zhu & Li 2023) or ``linear``.

Validation/test accuracy is logged separately on multi-view and single-view samples
(``<stage>/acc/{all,multi,single}``) with torchmetrics, with the mean classification margin
``F_y - max_{j != y} F_j`` (``<stage>/margin_mean/<view>``) and, at test, its histogram
(``test/margin/<view>``).

Example:
    >>> from featlearn.datamodules.multiview import MultiViewDataModule
    >>> dm = MultiViewDataModule(k=4, d=16, P=10, s=1, num_downstream=16)
    >>> model = MultiViewClassifier(m=2, head="fixed").attach(dm)   # trains on the downstream set
    >>> model(dm.full("train")["x"]).shape
    torch.Size([16, 4])
"""
from typing import Literal

import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from featlearn.checkpoints import read_checkpoint
from featlearn.errors import ConfigError
from featlearn.lightning_modules.multiview_encoder import MultiViewEncoder
from featlearn.validation import PositiveFloat, check_args

VIEWS = ("all", "multi", "single")


def classification_margin(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``F_y(X) - max_{j != y} F_j(X)`` per sample: negative exactly when the sample is misclassified
    (Lemma 1: about half of SL's single-view samples; Theorem 2: none after MRP + fine-tuning).

    Example:
        >>> classification_margin(torch.tensor([[2.0, 0.5, 1.0]]), torch.tensor([2])).tolist()
        [-1.0]
    """
    own = logits.gather(1, y[:, None]).squeeze(1)
    others = logits.scatter(1, y[:, None], float("-inf")).max(1).values
    return own - others


class MultiViewClassifier(MultiViewEncoder):
    """Cross-entropy classifier ``F_i(X) = sum_r u_{i,r} h_r(X)`` on the smoothed-ReLU encoder.

    Args:
        pretrained: checkpoint of a pretraining run whose kernels initialise the encoder (fine-tuning),
            or ``null`` to train from scratch (supervised baseline).
        head: ``linear`` (trainable ``U``, starts at 0) or ``fixed`` (per-class blocks, Allen-Zhu & Li 2023).
        lr_head: head step size ``eta_2`` (linear head only). lr: encoder step size ``eta_1``.
        freeze_encoder: train the head only (linear probe).
        ``**encoder``: m, q, rho, sigma0, capture_threshold, backend (see :class:`MultiViewEncoder`).
    """

    train_set = "downstream"
    # supervised learning at lr 100 grows the weight norm up to 15x over 20 steps early on
    blowup_factors = {"loss": None, "weight_norm": 1000.0}

    def __init__(self, pretrained: str | None = None, head: Literal["linear", "fixed"] = "linear",
                 lr_head: PositiveFloat = 10.0, freeze_encoder: bool = False, lr: PositiveFloat = 0.1, **encoder):
        check_args("model", MultiViewClassifier.__init__, locals())
        super().__init__(lr=lr, **encoder)
        if head == "fixed" and pretrained is not None:
            raise ConfigError("model.head", "'linear' when fine-tuning from a checkpoint", head)
        self._pretrained_state = None
        if pretrained is not None:
            # read now, so a missing, corrupt or foreign file is refused before any work
            state = read_checkpoint("model.pretrained", pretrained)["state_dict"]
            if not {"weight", "initial_weight"} <= set(state):
                raise ConfigError("model.pretrained", "a checkpoint of a pretraining run (TeacherStudentMRP or "
                                                      f"MaskedAutoencoderMRP; this one holds {', '.join(state)})",
                                  pretrained)
            self._pretrained_state = {k: state[k] for k in ("weight", "initial_weight")}
        self.pretrained, self.lr_head = pretrained, lr_head
        self.freeze_encoder = freeze_encoder
        self.metrics = torch.nn.ModuleDict()

    def build(self, dm) -> None:
        super().build(dm)
        if self.pretrained is not None:
            state, self._pretrained_state = self._pretrained_state, None
            if state["weight"].shape != self.weight.shape:
                raise ConfigError("model.pretrained", f"a checkpoint with kernels of shape {tuple(self.weight.shape)}",
                                  f"{self.pretrained} with {tuple(state['weight'].shape)}")
            self.weight.data.copy_(state["weight"])
            self.initial_weight.copy_(state["initial_weight"])
        if self.hparams.head == "linear":
            self.head = torch.nn.Parameter(torch.zeros(dm.k, dm.k * self.m))
        self.weight.requires_grad_(not self.freeze_encoder)
        for stage in ("val", "test"):
            for view in VIEWS:
                self.metrics[f"{stage}_{view}"] = MulticlassAccuracy(dm.k, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encode(x).student
        if self.hparams.head == "linear":
            return h @ self.head.T
        return h.view(h.shape[0], self.k, self.m).sum(-1)

    def training_step(self, batch, batch_idx):
        logits = self(batch["x"])
        loss = F.cross_entropy(logits, batch["y"])
        if self.theory_due():  # each self.log costs ~0.5 ms; Lightning writes only these steps anyway
            self.log("train/loss", loss, sync_dist=True)  # rank means -> the global batch's
            self.log("train/acc", (logits.argmax(1) == batch["y"]).float().mean(), sync_dist=True)
        return loss

    def finish_step(self, step: int) -> None:
        self.record_capture(step)
        self.log_theory()

    def _evaluate(self, batch, stage: str) -> None:
        logits, y, single = self(batch["x"]), batch["y"], batch["single_view"]
        pred, margin = logits.argmax(1), classification_margin(logits, y)
        writer = self.summary_writer() if stage == "test" else None
        for view, keep in (("all", torch.ones_like(single)), ("multi", ~single), ("single", single)):
            if keep.any():
                metric = self.metrics[f"{stage}_{view}"]
                metric.update(pred[keep], y[keep])
                self.log(f"{stage}/acc/{view}", metric, on_epoch=True, prog_bar=view == "single")
                self.log(f"{stage}/margin_mean/{view}", margin[keep].mean(), on_epoch=True, sync_dist=True)
                if writer is not None:
                    writer.add_histogram(f"test/margin/{view}", margin[keep], self.global_step)

    def validation_step(self, batch, batch_idx) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch, batch_idx):
        return self(batch["x"]).argmax(1)

    def configure_optimizers(self):
        groups = [{"params": [self.weight], "lr": self.lr}] if not self.freeze_encoder else []
        if self.hparams.head == "linear":
            groups.append({"params": [self.head], "lr": self.lr_head})
        return torch.optim.SGD(groups, lr=self.lr)
