"""Fused kernels of featlearn: one module per op (Triton kernels, autograd.Function, functional API, reference)."""
from featlearn.kernels.activations import Activation, smoothed_relu, smoothed_relu_derivative
from featlearn.kernels.backend import FLOAT_DTYPES, KernelInputError, check_float_inputs
from featlearn.kernels.infonce import infonce_grad_closed_form, infonce_reference, infonce_stopgrad
from featlearn.kernels.looped_linear_attention import looped_linear_attention, looped_linear_attention_reference
from featlearn.kernels.masked_attention import masked_attention, masked_attention_reference
from featlearn.kernels.modular_power_mlp import modular_power_mlp, modular_power_mlp_reference
from featlearn.kernels.bn_cosine_loss import bn_column_stats, bn_cosine_loss, bn_cosine_loss_reference
from featlearn.kernels.patch_activation_sum import PatchSums, patch_activation_sum, patch_activation_sum_reference
from featlearn.kernels.smoothed_clamp import (gaussian_smoothed_clamp, gaussian_smoothed_clamp_derivative,
                                              smoothed_clamp_layer, smoothed_clamp_reference)
from featlearn.kernels.soft_threshold import soft_threshold_layer, soft_threshold_reference, symmetric_relu
from featlearn.kernels.token_selection import (select_tokens, select_tokens_reference, selection_scores,
                                               selection_scores_reference)

__all__ = [
    "Activation",
    "bn_column_stats",
    "bn_cosine_loss",
    "bn_cosine_loss_reference",
    "check_float_inputs",
    "FLOAT_DTYPES",
    "infonce_grad_closed_form",
    "infonce_reference",
    "infonce_stopgrad",
    "KernelInputError",
    "looped_linear_attention",
    "looped_linear_attention_reference",
    "masked_attention",
    "masked_attention_reference",
    "modular_power_mlp",
    "modular_power_mlp_reference",
    "PatchSums",
    "patch_activation_sum",
    "patch_activation_sum_reference",
    "gaussian_smoothed_clamp",
    "gaussian_smoothed_clamp_derivative",
    "smoothed_clamp_layer",
    "smoothed_clamp_reference",
    "smoothed_relu",
    "smoothed_relu_derivative",
    "soft_threshold_layer",
    "soft_threshold_reference",
    "symmetric_relu",
    "select_tokens",
    "select_tokens_reference",
    "selection_scores",
    "selection_scores_reference",
]
