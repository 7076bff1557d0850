"""Stop a run whose loss or weights become NaN/inf, naming the step and the quantity."""
import math

import lightning as L
import torch

from featlearn.errors import DivergenceError


class DivergenceGuard(L.Callback):
    """Raise :class:`~featlearn.errors.DivergenceError` as soon as training diverges.

    The loss is checked before backward, so the diverged step never reaches the weights; logged
    metrics and parameters are checked after each step. Checkpoints already written (ModelCheckpoint
    ``save_last``) are left as they are: the last one is the last good state.

    Example:
        >>> trainer = L.Trainer(callbacks=[DivergenceGuard()])  # doctest: +SKIP
    """

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if not torch.isfinite(loss).all():
            self._stop(trainer, "train loss", loss)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for name, value in trainer.callback_metrics.items():
            if torch.is_tensor(value) and value.numel() == 1 and not math.isfinite(value.item()):
                self._stop(trainer, f"metric '{name}'", value)
        params = dict(pl_module.named_parameters())
        if params and not bool(torch.stack([torch.isfinite(p).all() for p in params.values()]).all()):
            name = next(n for n, p in params.items() if not torch.isfinite(p).all())
            self._stop(trainer, f"parameter '{name}'", params[name])

    @staticmethod
    def _stop(trainer, quantity: str, value: torch.Tensor) -> None:
        bad = value[~torch.isfinite(value)].flatten()[0].item()
        raise DivergenceError(
            f"training diverged at global step {trainer.global_step} (epoch {trainer.current_epoch}): "
            f"{quantity} is {bad}; the last good checkpoint is the last one saved before this step"
        )
