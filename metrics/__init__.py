"""Metrics shared by every method: probes, feature-correlation statistics, figures for TensorBoard and PNGs."""
