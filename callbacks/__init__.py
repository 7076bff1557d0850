"""Lightning callbacks shared by every method."""
from featlearn.callbacks.divergence import DivergenceGuard
from featlearn.callbacks.heatmap import HeatmapLogger, colorize

__all__ = ["DivergenceGuard", "HeatmapLogger", "colorize"]
