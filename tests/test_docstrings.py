"""The usage examples in docstrings run and print what they say."""
import doctest
import importlib

import pytest

MODULES = ["featlearn.kernels.registry", "featlearn.datamodules.modular_addition", "featlearn.theory.modular_addition",
           "featlearn.theory.looped_transformer", "featlearn.theory.icl_scale", "featlearn.datamodules.icl_regression",
           "featlearn.lightning_modules.icl_lsa", "featlearn.experiments.icl_scale", "featlearn.datamodules.parity_prompts",
           "featlearn.lightning_modules.icl_parity", "featlearn.experiments.icl_parity", "featlearn.datamodules.xor_mixture",
           "featlearn.datamodules.block_parity",
           "featlearn.datamodules.domain_shift", "featlearn.theory.erm_nu", "featlearn.lightning_modules.erm_nu",
           "featlearn.experiments.erm_nu", "featlearn.datamodules.kv_retrieval", "featlearn.lightning_modules.retrieval_decoder",
           "featlearn.experiments.gemfilter",
           "featlearn.theory.gradient_features", "featlearn.lightning_modules.gradient_features",
           "featlearn.experiments.gradient_features", "featlearn.metrics.spectrum",
           "featlearn.lightning_modules.modular_addition", "featlearn.lightning_modules.modular_transformer",
           "featlearn.lightning_modules.modular_base", "featlearn.lightning_modules.seed_schedules",
           "featlearn.kernels.modular_power_mlp", "featlearn.kernels.looped_linear_attention", "featlearn.kernels.token_selection",
           "featlearn.experiments.modular_addition", "featlearn.experiments.modular_addition_grokking",
           "featlearn.experiments.looped_transformer", "featlearn.experiments.looped_transformer_trained",
           "featlearn.datamodules.linear_prompts", "featlearn.lightning_modules.looped_transformer", "featlearn.bench.user_fit",
           "featlearn.experiments.common", "featlearn.experiments.mrp", "featlearn.datamodules.multiview",
           "featlearn.lightning_modules.mrp", "featlearn.lightning_modules.multiview_classifier",
           "featlearn.lightning_modules.multiview_encoder", "featlearn.errors",
           "featlearn.lightning_modules.contrastive", "featlearn.lightning_modules.noncontrastive",
           "featlearn.theory.contrastive", "featlearn.metrics.probes", "featlearn.metrics.features",
           "featlearn.datamodules.sparse_coding", "featlearn.experiments.contrastive",
           "featlearn.theory.noncontrastive", "featlearn.datamodules.two_feature_patches", "featlearn.theory.mrp",
           "featlearn.metrics", "featlearn.metrics.figures", "featlearn.lightning_modules.base",
           "featlearn.kernels.backend", "featlearn.kernels.activations", "featlearn.kernels.infonce", "featlearn.kernels.soft_threshold",
           "featlearn.kernels.patch_activation_sum", "featlearn.kernels.bn_cosine_loss",
           "featlearn.kernels.masked_attention", "featlearn.datamodules.global_local_patches", "featlearn.theory.vit",
           "featlearn.lightning_modules.vit_mae", "featlearn.lightning_modules.vit_cl",
           "featlearn.lightning_modules.vit_common", "featlearn.callbacks.profiling",
           "featlearn.callbacks.logged_values", "featlearn.kernels.smoothed_clamp", "featlearn.theory.two_layer",
           "featlearn.datamodules.structured_parity",
           "featlearn.lightning_modules.two_layer", "featlearn.lightning_modules.two_layer_baselines",
           "featlearn.lightning_modules.two_layer_parts", "featlearn.datamodules.hidden_representation",
           "featlearn.theory.universality", "featlearn.lightning_modules.universality",
           "featlearn.lightning_modules.contrastive_regularization", "featlearn.experiments.universality",
           "featlearn.experiments.sweep", "featlearn.experiments.vit", "featlearn.gpu.compile", "featlearn.gpu.cases",
           "featlearn.papers", "featlearn.bench.harness", "featlearn.bench.data", "featlearn.quiet",
           "featlearn.experiments.study", "featlearn.experiments.points", "featlearn.experiments.settings", "featlearn.experiments.sweep_file",
           "featlearn.experiments.vit_report", "featlearn.theory.universality_downstream",
           "featlearn.lightning_modules.seeds", "featlearn.datamodules.seeds", "featlearn.datamodules.rng",
           "featlearn.lightning_modules.hook_name"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, one_thread):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
