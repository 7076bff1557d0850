"""Closed-form theory of each paper: predictions, population dynamics and simulators, one file per method."""
