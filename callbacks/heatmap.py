"""Log a module's heat maps (e.g. the neuron x feature correlation matrix) to TensorBoard as figures."""
import lightning as L

from featlearn.metrics.figures import HeatmapFrames, tensorboard_writer


class HeatmapLogger(L.Callback):
    """Every ``every_n_steps`` training steps (and at the end of fit) log ``pl_module.heatmaps()``.

    Each matrix becomes a matplotlib figure under ``heatmap/<name>`` in TensorBoard's IMAGES tab, with the
    module's axis labels (``heatmap_axes``), its fixed colour scale (``heatmap_scale``) and a colour bar,
    redrawn on one laid-out figure per matrix (:class:`~featlearn.metrics.figures.HeatmapFrames`).

    Example:
        >>> trainer = L.Trainer(callbacks=[HeatmapLogger(every_n_steps=100)])  # doctest: +SKIP
    """

    def __init__(self, every_n_steps: int = 100):
        self.every_n_steps = every_n_steps
        self.frames = HeatmapFrames()

    def _log(self, trainer, pl_module) -> None:
        writer = tensorboard_writer(trainer)
        if writer is None:  # other ranks, or no TensorBoard logger: draw nothing
            return
        ylabel, xlabel = pl_module.heatmap_axes
        for name, matrix in pl_module.heatmaps().items():
            figure = self.frames.figure(name, matrix, xlabel=xlabel, ylabel=ylabel, vmax=pl_module.heatmap_scale,
                                        title=f"{name}, step {trainer.global_step}")
            writer.add_figure(f"heatmap/{name}", figure, trainer.global_step, close=False)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self._log(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._log(trainer, pl_module)
        self.frames.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.frames.close()
