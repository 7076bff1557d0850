"""Fused kernels of featlearn: one module per op (Triton kernels, autograd.Function, functional API, reference)."""
from featlearn.kernels.activations import Activation, smoothed_relu, smoothed_relu_derivative
from featlearn.kernels.patch_activation_sum import PatchSums, patch_activation_sum, patch_activation_sum_reference

__all__ = [
    "Activation",
    "PatchSums",
    "patch_activation_sum",
    "patch_activation_sum_reference",
    "smoothed_relu",
    "smoothed_relu_derivative",
]
