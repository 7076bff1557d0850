"""Log a module's heat maps (e.g. the neuron x feature correlation matrix) to TensorBoard as images."""
import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger


def colorize(matrix: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Map a 2-D tensor to an RGB image ``[3, H, W]`` in [0, 1]: blue < 0 < red, white at 0.

    ``scale`` is the value shown at full colour (default: max |entry|).

    Example:
        >>> colorize(torch.tensor([[-1.0, 0.0, 1.0]])).shape
        torch.Size([3, 1, 3])
    """
    m = matrix.detach().float().cpu()
    scale = scale or float(m.abs().max().clamp_min(1e-12))
    v = (m / scale).clamp(-1, 1)
    pos, neg = v.clamp_min(0), (-v).clamp_min(0)
    return torch.stack([1 - neg, 1 - pos - neg, 1 - pos]).clamp(0, 1)


def upscale(image: torch.Tensor, min_side: int = 256) -> torch.Tensor:
    """Repeat pixels so a small matrix is readable in TensorBoard."""
    factor = max(1, min_side // max(1, min(image.shape[1:])))
    return image.repeat_interleave(factor, 1).repeat_interleave(factor, 2)


class HeatmapLogger(L.Callback):
    """Every ``every_n_steps`` training steps (and at the end of fit) log ``pl_module.heatmaps()``.

    Images go to ``heatmap/<name>`` in TensorBoard; rows are neurons, columns features.

    Example:
        >>> trainer = L.Trainer(callbacks=[HeatmapLogger(every_n_steps=100)])  # doctest: +SKIP
    """

    def __init__(self, every_n_steps: int = 100):
        self.every_n_steps = every_n_steps

    def _log(self, trainer, pl_module) -> None:
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers or trainer.global_rank != 0:
            return
        for name, matrix in pl_module.heatmaps().items():
            loggers[0].experiment.add_image(f"heatmap/{name}", upscale(colorize(matrix)), trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self._log(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._log(trainer, pl_module)
