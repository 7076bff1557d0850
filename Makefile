# Set-up and the main jobs. Every target creates (or reuses) .venv and installs what it needs.
# On a machine without an NVIDIA GPU, PyTorch is pinned to the CPU build torch==2.13.0 before anything
# else is installed, so no CUDA wheels are downloaded; with a GPU the normal CUDA build is installed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VENV36 := .venv-triton36
COMPILE_OUT ?= runs/gpu-compile
KERNEL_TESTS := tests/test_soft_threshold.py tests/test_smoothed_clamp.py tests/test_patch_activation_sum.py \
	tests/test_masked_attention.py tests/test_bn_cosine_loss.py tests/test_activations.py tests/test_kernel_template.py \
	tests/test_gpu_compile.py tests/test_int32_offsets.py tests/test_modular_power_mlp.py tests/test_looped_linear_attention.py \
	tests/test_token_selection.py
# make test-fast: a first check in under 2 minutes (the CLI and config contract, refusals, determinism of the
# sampler, checkpoints that resume bit-equal, one kernel against its float64 reference, one paper's headline)
FAST_TESTS := tests/test_interfaces.py tests/test_rng.py tests/test_checkpoints.py tests/test_soft_threshold.py \
	tests/test_headline_noncontrastive.py
DOCS_STAMP := $(VENV)/.installed-docs
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
# PyTorch's own index of CPU wheels, used only when no local CPU wheel is found (pip's find-links).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ifeq ($(HAS_GPU),1)
INSTALL_TORCH := $(PY) -m pip install -q torch==2.13.0
else
INSTALL_TORCH := $(PY) -m pip install -q torch==2.13.0+cpu || $(PY) -m pip install -q torch==2.13.0+cpu --index-url $(TORCH_CPU_INDEX)
endif

.PHONY: experiment test test-fast test-all docs compile-check triton36-check gpu-tests-dry contrastive noncontrastive vit two-layer universality modular-addition looped-transformer icl-scale gradient-features erm-nu gemfilter large-k profile bench tensorboard clean

experiment: $(STAMP)  ## the main job: MRP pretrain -> fine-tune vs supervised learning, seed 0 only, lr grid
	$(PY) -m featlearn.experiments.mrp --grid --out runs/mrp

test: $(STAMP)  ## the default test suite on two pytest-xdist workers (809 s on the 2-core CI machine for 2471 tests, 2026-11-28; 798 s for 2452 earlier that day)
	$(PY) -m pytest -q -n 2

test-fast: $(STAMP)  ## a first check: 5 quick test files in one process (102 s on the 2-core dev machine)
	$(PY) -m pytest -q $(FAST_TESTS)

test-all: $(STAMP)  ## also the long statistical checks
	$(PY) -m pytest -q -n 2 -m "slow or not slow"

compile-check: $(STAMP)  ## every Triton kernel built offline for sm_90 (no GPU): registers, spills, shared memory
	$(VENV)/bin/featlearn gpu compile --out $(COMPILE_OUT)

# The GPU machines run triton 3.6: a second environment (torch 2.13 CPU, triton 3.6.0) builds every kernel
# for sm_90 with it and runs the kernels' interpreter tests under it.
triton36-check: $(VENV36)/.installed  ## the sm_90 compile check and the kernel tests under triton 3.6.0
	$(VENV36)/bin/featlearn gpu compile --out $(COMPILE_OUT)
	$(VENV36)/bin/python -m pytest -q -n 2 $(KERNEL_TESTS)

gpu-tests-dry: $(STAMP)  ## the GPU tests (tests/gpu) on the CPU through the interpreter at tiny sizes
	FEATLEARN_GPU_DRY=1 $(PY) -m pytest -q -m gpu tests/gpu

contrastive: $(STAMP)  ## Wen & Li (ICML 2021): contrastive learning with vs without RandomMask
	$(PY) -m featlearn.experiments.contrastive

noncontrastive: $(STAMP)  ## Wen & Li (NeurIPS 2022): prediction head vs no head
	$(PY) -m featlearn.experiments.noncontrastive

vit: $(STAMP)  ## Huang et al. (ICLR 2025): one-layer softmax ViT, MAE vs contrastive learning, seeds 0-4 (1363 s on one thread of a busy 2-core machine)
	$(PY) -m featlearn.experiments.vit --out runs/vit

two-layer: $(STAMP)  ## Shi's dissertation ch. 2: Table A.1 (parity, d = 500), network vs NTK / RF / One Step / Two Step
	$(PY) -m featlearn.experiments.two_layer --seed 0 --out runs/two_layer

universality: $(STAMP)  ## Shi's dissertation ch. 7: universality vs label efficiency, contrastive regularisation
	$(PY) -m featlearn.experiments.universality --seed 0 1 2 --out runs/universality

modular-addition: $(STAMP)  ## Shi's dissertation ch. 4: Fourier neurons of the k-input MLP (k = 3, p = 23), grokking against k
	$(PY) -m featlearn.experiments.modular_addition --seed 0 1 2 --out runs/modular_addition

looped-transformer: $(STAMP)  ## Shi's dissertation ch. 8: Fig. 8.1 (the hand-built loop) and a looped transformer trained from scratch
	$(PY) -m featlearn.experiments.looped_transformer --seed 0 1 2 --out runs/looped_transformer
	$(PY) -m featlearn.experiments.looped_transformer_trained --seed 0 1 2 --out runs/looped_transformer_trained

gradient-features: $(STAMP)  ## Shi's dissertation ch. 3: the network vs random features and the NTK on the XOR mixture (d = 32..256) and structured parity
	$(PY) -m featlearn.experiments.gradient_features --seed 0 1 2 --out runs/gradient_features
	$(PY) -m featlearn.experiments.gradient_features --task parity --seed 0 1 2 --out runs/gradient_features_parity

erm-nu: $(STAMP)  ## Shi's dissertation ch. 6: ERM vs l2 vs nuclear norm vs rank on the 2-D toy and the D_gamma model
	$(PY) -m featlearn.experiments.erm_nu --seed 0 1 2 --out runs/erm_nu

gemfilter: $(STAMP)  ## Shi's dissertation ch. 9: GemFilter's token selection on a trained 4-layer decoder, needle retrieval at 512 tokens
	$(PY) -m featlearn.experiments.gemfilter --seed 0 1 2 --out runs/gemfilter

icl-scale: $(STAMP)  ## Shi's dissertation ch. 5: rank-r linear attention trained for in-context regression, noise sensitivity
	$(PY) -m featlearn.experiments.icl_scale --seed 0 1 2 --out runs/icl_scale
	$(PY) -m featlearn.experiments.icl_parity --seed 0 1 2 --out runs/icl_parity

large-k: $(STAMP)  ## MRP over k on one CPU thread (configs/large_k/mrp_k_cpu.yaml), resumable
	$(PY) -m featlearn.experiments.sweep --config configs/large_k/mrp_k_cpu.yaml --seed 0 --out runs/large_k/mrp_k_cpu

profile: $(STAMP)  ## a torch.profiler trace of 10 MRP steps (runs/profile; tensorboard --logdir runs/profile)
	$(VENV)/bin/featlearn profile --config configs/mrp/teacher_student.yaml --steps 10 --out runs/profile

bench: $(STAMP)  ## op and training-step benchmarks at the CPU sizes (benchmarks/results/bench/)
	$(VENV)/bin/featlearn bench op --size tiny --threads 1 --repeats 30 --out benchmarks/results/bench
	$(VENV)/bin/featlearn bench step --size tiny --threads 1 --repeats 30 --seeds 8 32 --out benchmarks/results/bench

tensorboard: $(STAMP)
	$(VENV)/bin/tensorboard --logdir runs

# The API pages read the package as installed (featlearn.kernels = kernels/, ...): staged as symlinks first.
DOCS_API := build/docs-api
docs: $(DOCS_STAMP)  ## the documentation site (mkdocs-material + mkdocstrings) into site/, warnings are errors
	rm -rf $(DOCS_API) && mkdir -p $(DOCS_API)
	$(PY) -c "import pathlib, featlearn.gpu.wheels as w; w.stage(pathlib.Path('$(DOCS_API)').resolve())"
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[test,docs]"
	touch $@

$(VENV36)/.installed: pyproject.toml
	test -x $(VENV36)/bin/python || $(PYTHON) -m venv $(VENV36)
	$(VENV36)/bin/python -m pip install -q --upgrade pip
	$(VENV36)/bin/python -m pip install -q torch==2.13.0+cpu || $(VENV36)/bin/python -m pip install -q torch==2.13.0+cpu --index-url $(TORCH_CPU_INDEX)
	$(VENV36)/bin/python -m pip install -q triton==3.6.0 -e ".[test]"
	$(VENV36)/bin/python -c "import triton, sys; sys.exit(0 if triton.__version__ == '3.6.0' else 'expected triton 3.6.0')"
	touch $@

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(INSTALL_TORCH)
	$(PY) -c "import torch, sys; sys.exit('expected a CPU build of torch' if '$(HAS_GPU)' != '1' and torch.version.cuda else 0)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) $(VENV36) runs lightning_logs site build/docs-api

# ------------------------------------------------------------------------------------------------
# GPU readiness (docs/gpu.md). gpu-wheels runs where the package registry is; gpu-check-install and
# gpu-check run on the lent GPU machine with its own python3 (override: PYTHON=...), no .venv, no registry.
GPU_SITE ?= /tmp/featlearn-gpu/site
PART ?= 1
OUT ?= runs/gpu-check
.PHONY: gpu-wheels gpu-check-install gpu-check gpu-check-dry

gpu-wheels: $(STAMP)  ## (registry) the wheels the GPU machine lacks (jsonargparse[signatures]) into .whl/
	$(PY) -m featlearn.gpu wheels

gpu-check-install: PYTHON = python3
gpu-check-install:  ## (GPU machine) .whl/*.whl and featlearn (symlinks to the tree) into $(GPU_SITE)
	$(PYTHON) featlearn/gpu/wheels.py --install $(GPU_SITE)

gpu-check: PYTHON = python3
gpu-check: gpu-check-install  ## (GPU machine) part PART (1 or 2) of the prepared check into OUT, <= 5 minutes
	PYTHONPATH=$(GPU_SITE) PYTHONSAFEPATH=1 $(PYTHON) -m featlearn.gpu check $(OUT) --part $(PART)

gpu-check-dry: $(STAMP)  ## the check's CPU dry mode: both parts, stand-ins for CUDA (~2-3 min on 2 cores)
	rm -rf runs/gpu-check-dry && $(PY) -m featlearn.gpu check runs/gpu-check-dry --dry
