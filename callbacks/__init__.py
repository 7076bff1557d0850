"""Lightning callbacks shared by every method."""
from featlearn.callbacks.checkpoint import FinalCheckpoint
from featlearn.callbacks.divergence import DivergenceGuard
from featlearn.callbacks.heatmap import HeatmapLogger, colorize

__all__ = ["DivergenceGuard", "FinalCheckpoint", "HeatmapLogger", "colorize"]
