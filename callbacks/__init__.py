"""Callbacks every featlearn run gets from the CLI."""
from featlearn.callbacks.checkpoint import FinalCheckpoint
from featlearn.callbacks.divergence import DivergenceGuard
from featlearn.callbacks.heatmap import HeatmapLogger
from featlearn.callbacks.profiling import StepProfiler
from featlearn.callbacks.progress import StepProgressBar

__all__ = ["DivergenceGuard", "FinalCheckpoint", "HeatmapLogger", "StepProfiler", "StepProgressBar"]
