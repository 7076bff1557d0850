"""Matplotlib figures for TensorBoard (``add_figure``) and for the PNGs every experiment writes.

Every figure has labelled axes; heat maps have a fixed colour scale (``vmax``, the same at every step so
frames can be compared) and a colour bar. The Agg backend is used, so no display is needed.

Example:
    >>> import torch
    >>> fig = heatmap_figure(torch.eye(3), xlabel="feature", ylabel="neuron", vmax=1.0)
    >>> [ax.get_xlabel() for ax in fig.axes][:1]
    ['feature']
    >>> fig = curves_figure([0, 1, 2], {"run": [0.0, 0.5, 1.0]}, xlabel="step", ylabel="captured")
    >>> fig = bars_figure({"MRP+FT": {"single": 1.0}, "SL": {"single": 0.9}}, ylabel="accuracy")
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # before pyplot: figures are rendered to files and TensorBoard, never to a screen
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

__all__ = ["heatmap_figure", "HeatmapFrames", "curves_figure", "bars_figure", "save_png", "tensorboard_writer"]


def _array(values):
    return values.detach().cpu().double().numpy() if torch.is_tensor(values) else values


def heatmap_figure(matrix, *, xlabel: str, ylabel: str, vmax: float, title: str = "",
                   diverging: bool = True) -> plt.Figure:
    """A 2-D matrix (rows on the y axis) with a colour bar; ``vmax`` fixes the scale.

    ``diverging``: blue < 0 < red on ``[-vmax, vmax]`` (correlations); otherwise ``[0, vmax]`` (attention).
    """
    data = _array(matrix)
    rows, cols = data.shape
    fig, ax = plt.subplots(figsize=(min(12.0, 2.0 + 0.25 * cols), min(10.0, 1.5 + 0.2 * rows)),
                           constrained_layout=True)
    limits = dict(vmin=-vmax, vmax=vmax, cmap="RdBu_r") if diverging else dict(vmin=0.0, vmax=vmax, cmap="viridis")
    image = ax.imshow(data, aspect="auto", interpolation="nearest", **limits)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    fig.colorbar(image, ax=ax)
    return fig


class HeatmapFrames:
    """Heat-map figures kept by tag, laid out once and redrawn with each frame's matrix: a new figure per
    frame cost ~0.23 s against ~0.08 s for the redraw (60 x 10 matrix; 0.39 / 0.17 s at 256 x 256), which
    at a frame every 50 steps is several percent of a run. A frame whose shape changed gets a new figure.

    Example:
        >>> frames = HeatmapFrames()
        >>> a = frames.figure("c", torch.eye(2), xlabel="f", ylabel="n", vmax=1.0, title="step 1")
        >>> frames.figure("c", -torch.eye(2), xlabel="f", ylabel="n", vmax=1.0, title="step 2") is a
        True
        >>> frames.close()
    """

    def __init__(self):
        self._figures: dict = {}  # tag -> (figure, image)

    def figure(self, tag: str, matrix, *, xlabel: str, ylabel: str, vmax: float, title: str = "",
               diverging: bool = True) -> plt.Figure:
        """The figure of ``tag`` showing ``matrix`` (:func:`heatmap_figure`'s arguments); keep it open."""
        data = _array(matrix)
        figure, image = self._figures.get(tag, (None, None))
        if figure is not None and image.get_array().shape == data.shape:
            image.set_data(data)
            figure.axes[0].set_title(title)
            return figure
        if figure is not None:
            plt.close(figure)
        figure = heatmap_figure(data, xlabel=xlabel, ylabel=ylabel, vmax=vmax, title=title, diverging=diverging)
        figure.canvas.draw()                # lay out once (constrained layout), then keep the positions
        figure.set_layout_engine("none")
        self._figures[tag] = (figure, figure.axes[0].images[0])
        return figure

    def close(self) -> None:
        """Close every kept figure (end of a fit)."""
        for figure, _ in self._figures.values():
            plt.close(figure)
        self._figures.clear()


def _runs(values) -> list:
    """A curve, or a list of curves (one per run), as a list of curves."""
    first = values[0] if len(values) else None
    return list(values) if first is not None and hasattr(first, "__len__") else [values]


def curves_figure(x, series: Mapping[str, Sequence], *, xlabel: str, ylabel: str, title: str = "",
                  logx: bool = False) -> plt.Figure:
    """One colour per name; a name maps to one curve or to a list of curves (one per run).

    ``x`` is shared by every curve, or a mapping from the names to their x values (one per run, or shared).
    """
    fig, ax = plt.subplots(figsize=(6.4, 4.0), constrained_layout=True)
    for i, (name, values) in enumerate(series.items()):
        runs = _runs(values)
        xs = _runs(x[name]) if isinstance(x, Mapping) else [x]
        for j, run in enumerate(runs):
            ax.plot(_array(xs[j if len(xs) > 1 else 0]), _array(run), color=f"C{i}",
                    alpha=0.9 if len(runs) == 1 else 0.5, label=name if j == 0 else None)
    if logx:
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend()
    return fig


def bars_figure(groups: Mapping[str, Mapping[str, float]], *, ylabel: str, title: str = "",
                errors: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
                zoom: bool = False) -> plt.Figure:
    """Grouped bars: one group per key of ``groups`` (e.g. a method), one bar per inner key (e.g. a view).

    ``errors`` gives ``(low, high)`` per bar, drawn as an error bar (e.g. the min-max range over seeds).
    ``zoom``: the y axis spans the values (with their error bars) instead of starting at 0, and each bar is
    labelled with its value, for comparisons whose differences are small next to the values (an accuracy
    of 1.000 against 0.993). The legend sits outside the axes, never over a bar.

    Example:
        >>> fig = bars_figure({"MRP": {"multi": 1.0, "single": 0.99}, "SL": {"multi": 1.0, "single": 0.95}},
        ...                   ylabel="test accuracy", zoom=True)
        >>> low, high = fig.axes[0].get_ylim(); bool(0.9 < low < 0.95 and high > 1.0)
        True
    """
    labels = list(dict.fromkeys(k for inner in groups.values() for k in inner))
    width = 0.8 / max(1, len(groups))
    # room for each group of bars and for its (possibly multi-line) label
    fig, ax = plt.subplots(figsize=(max(4.0, len(labels) * max(1.9, 0.7 * len(groups))) + 2.0, 4.5),
                           constrained_layout=True)
    lows, highs = [], []
    for i, (name, inner) in enumerate(groups.items()):
        xs = [labels.index(k) + (i - (len(groups) - 1) / 2) * width for k in inner]
        heights = [inner[k] for k in inner]
        yerr = None
        if errors and name in errors:
            yerr = [[inner[k] - errors[name][k][0] for k in inner], [errors[name][k][1] - inner[k] for k in inner]]
        bars = ax.bar(xs, heights, width, yerr=yerr, capsize=3, label=name, color=f"C{i}")
        lows += [errors[name][k][0] if yerr else inner[k] for k in inner]
        highs += [errors[name][k][1] if yerr else inner[k] for k in inner]
        if zoom:
            ax.bar_label(bars, fmt="%.3f", padding=2, fontsize=8)
    if zoom and lows:
        span = max(max(highs) - min(lows), 1e-3)
        ax.set_ylim(min(lows) - 0.5 * span, max(highs) + 0.25 * span)
    ax.set_xticks(range(len(labels)), labels)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return fig


def save_png(fig: plt.Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG and release it (figures are not garbage-collected by pyplot otherwise)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def tensorboard_writer(trainer):
    """The TensorBoard ``SummaryWriter`` of ``trainer`` on rank 0, else ``None`` (the one logger lookup)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    if trainer is None or trainer.global_rank != 0:
        return None
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def log_results(trainer, params: Mapping, results: Mapping[str, float]) -> None:
    """A run's hyperparameters and results (``hp/<name>`` scalars at the final step) for TensorBoard's
    HPARAMS tab, on rank 0, in a form that lets runs of different methods share the table.

    Each run writes only its session (hyperparameters in, status out), not an experiment summary: with
    one in every run TensorBoard shows the columns of the first run it finds and blank cells for every
    other method; without, it takes the hyperparameters of all runs and every scalar as a metric column.
    Every logger also gets the hyperparameters (``hparams.yaml``) and the results as metrics."""
    if trainer is None or trainer.global_rank != 0:
        return
    for logger in trainer.loggers:
        logger.log_hyperparams(dict(params))  # no metrics: hparams.yaml only, no experiment summary
        logger.log_metrics(dict(results), step=trainer.global_step)
    writer = tensorboard_writer(trainer)
    if writer is not None:
        write_hparams(writer, params, results, trainer.global_step)


def write_hparams(writer, params: Mapping, results: Mapping[str, float], step: int) -> None:
    """One run's session of TensorBoard's HPARAMS tab (see :func:`log_results`) into ``writer``."""
    from torch.utils.tensorboard.summary import hparams

    _, start, end = hparams(_plain(params), dict(results))
    for summary in (start, end):
        writer.file_writer.add_summary(summary, step)
    writer.flush()


def seed_writer(trainer, seed: int):
    """The ``SummaryWriter`` of one seed's run, ``<log_dir>/seed_<seed>``, of a run that trains several seeds
    (:mod:`featlearn.lightning_modules.seeds`), on rank 0 with TensorBoard, else ``None``; closed with
    :func:`close_seed_writers`."""
    if tensorboard_writer(trainer) is None:
        return None
    writers = trainer.__dict__.setdefault("_featlearn_seed_writers", {})
    if seed not in writers:
        from torch.utils.tensorboard import SummaryWriter

        writers[seed] = SummaryWriter(f"{run_folder(trainer)}/seed_{seed}")
    return writers[seed]


def run_folder(trainer) -> str:
    """``trainer.log_dir`` without its broadcast (which would wait forever for ranks that do not ask): the first
    logger's folder, else the Trainer's root folder."""
    for logger in trainer.loggers:
        folder = logger.log_dir or logger.save_dir
        if folder:
            return str(folder)
    return str(trainer.default_root_dir)


def close_seed_writers(trainer) -> None:
    for writer in trainer.__dict__.pop("_featlearn_seed_writers", {}).values():
        writer.close()


def _plain(params: Mapping, prefix: str = "") -> dict:
    """Flat ``{name: int | float | str | bool}`` (nested dicts as ``a/b``, anything else as its text)."""
    flat = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            flat.update(_plain(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return flat

