"""Callbacks every featlearn run gets from the CLI, and the ones a run or an experiment adds (the step profiler,
keeping the best state on validation)."""
from featlearn.callbacks.best_validation import KeepBestOnValidation
from featlearn.callbacks.checkpoint import FinalCheckpoint
from featlearn.callbacks.divergence import DivergenceGuard
from featlearn.callbacks.heatmap import HeatmapLogger
from featlearn.callbacks.profiling import StepProfiler
from featlearn.callbacks.progress import StepProgressBar
from featlearn.callbacks.spectrum import RepresentationSpectrum

__all__ = ["DivergenceGuard", "FinalCheckpoint", "HeatmapLogger", "KeepBestOnValidation", "RepresentationSpectrum",
           "StepProfiler", "StepProgressBar"]
