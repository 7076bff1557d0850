"""The one list of featlearn's fused ops: what the op template test checks, what `featlearn bench op` times
and what the docs list. Adding an op adds one entry here (docs/adding_an_op.md).

Example:
    >>> from featlearn.kernels.registry import OPS
    >>> [op.module for op in OPS if op.triton is None]
    ['infonce']
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class FusedOp:
    module: str
    """``featlearn.kernels.<module>``: the file holding the kernels, the autograd.Function, the functional
    API and the float64 reference (``<module>_reference``)."""
    function: str
    """The functional API."""
    autograd: str
    """Its ``torch.autograd.Function``."""
    triton: str | None
    """The name prefix of its Triton kernels; None for an op with a PyTorch path only."""
    batch_args: frozenset[str]
    """Kernel arguments that follow the batch (rows, flattened sample x patch rows, row blocks): never in an
    autotune key, so train, validation and test batches share one search."""
    bench: str
    """Its case name in ``featlearn bench op``."""


OPS = (
    FusedOp("patch_activation_sum", "patch_activation_sum", "PatchActivationSumFunction", "_patch_sum",
            frozenset({"B", "M"}), "patch_activation_sum"),
    FusedOp("soft_threshold", "soft_threshold_layer", "SoftThresholdFunction", "_soft_threshold", frozenset({"B"}),
            "soft_threshold"),
    FusedOp("bn_cosine_loss", "bn_cosine_loss", "BNCosineLossFunction", "_bn_cosine", frozenset({"N", "NPROG"}),
            "bn_cosine_loss"),
    FusedOp("infonce", "infonce_stopgrad", "InfoNCEStopGradFunction", None, frozenset(), "infonce_stopgrad"),
    # one grid column per sample: no kernel argument carries the batch
    FusedOp("masked_attention", "masked_attention", "MaskedAttentionFunction", "_masked_attn", frozenset(),
            "masked_attention"),
    FusedOp("smoothed_clamp", "smoothed_clamp_layer", "SmoothedClampFunction", "_smoothed_clamp", frozenset({"B"}),
            "smoothed_clamp"),
    FusedOp("modular_power_mlp", "modular_power_mlp", "ModularPowerMLPFunction", "_modpow", frozenset({"B"}),
            "modular_power_mlp"),
    FusedOp("looped_linear_attention", "looped_linear_attention", "LoopedLinearAttentionFunction", "_looped_attn",
            frozenset({"B"}), "looped_linear_attention"),
    # N, the prompt's length, changes from call to call like a batch: a search per length would never end
    FusedOp("token_selection", "select_tokens", "TokenSelectionFunction", "_token_sel", frozenset({"N"}),
            "token_selection"),
)
