# Set-up and the main jobs. Every target creates (or reuses) .venv and installs what it needs.
# On a machine without an NVIDIA GPU, PyTorch is pinned to the CPU build torch==2.13.0 before anything
# else is installed, so no CUDA wheels are downloaded; with a GPU the normal CUDA build is installed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
# PyTorch's own index of CPU wheels, used only when no local CPU wheel is found (pip's find-links).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ifeq ($(HAS_GPU),1)
INSTALL_TORCH := $(PY) -m pip install -q torch==2.13.0
else
INSTALL_TORCH := $(PY) -m pip install -q torch==2.13.0+cpu || $(PY) -m pip install -q torch==2.13.0+cpu --index-url $(TORCH_CPU_INDEX)
endif

.PHONY: experiment test test-all contrastive noncontrastive vit two-layer universality large-k profile bench tensorboard clean

experiment: $(STAMP)  ## the main job: MRP pretrain -> fine-tune vs supervised learning (seed 000)
	$(PY) -m featlearn.experiments.mrp --grid --out runs/mrp

test: $(STAMP)  ## the default test suite (< 15 minutes on 2 cores)
	$(PY) -m pytest -q

test-all: $(STAMP)  ## also the long statistical checks
	$(PY) -m pytest -q -m "slow or not slow"

contrastive: $(STAMP)  ## seed 001: contrastive learning with vs without RandomMask
	$(PY) -m featlearn.experiments.contrastive

noncontrastive: $(STAMP)  ## seed 004: prediction head vs no head
	$(PY) -m featlearn.experiments.noncontrastive

vit: $(STAMP)  ## seed 002: one-layer softmax ViT, MAE vs contrastive learning across Delta (~5 min on one CPU thread)
	$(PY) -m featlearn.experiments.vit --out runs/vit

two-layer: $(STAMP)  ## seed 003 ch. 2: Table A.1 (parity, d = 500), network vs NTK / RF / One Step / Two Step
	$(PY) -m featlearn.experiments.two_layer --seed 0 --out runs/two_layer

universality: $(STAMP)  ## seed 003 ch. 7: universality vs label efficiency, contrastive regularisation
	$(PY) -m featlearn.experiments.universality --seed 0 1 2 --out runs/universality

large-k: $(STAMP)  ## MRP over k on one CPU thread (configs/large_k/mrp_k_cpu.yaml), resumable
	$(PY) -m featlearn.experiments.sweep --config configs/large_k/mrp_k_cpu.yaml --seed 0 --out runs/large_k/mrp_k_cpu

profile: $(STAMP)  ## a torch.profiler trace of 10 MRP steps (runs/profile; tensorboard --logdir runs/profile)
	$(VENV)/bin/featlearn profile --config configs/mrp/teacher_student.yaml --steps 10 --out runs/profile

bench: $(STAMP)  ## op and training-step benchmarks at the CPU sizes (benchmarks/results/bench/)
	$(VENV)/bin/featlearn bench op --size tiny --threads 1 --repeats 30 --out benchmarks/results/bench
	$(VENV)/bin/featlearn bench step --size tiny --threads 1 --repeats 30 --out benchmarks/results/bench

tensorboard: $(STAMP)
	$(VENV)/bin/tensorboard --logdir runs

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(INSTALL_TORCH)
	$(PY) -c "import torch, sys; sys.exit('expected a CPU build of torch' if '$(HAS_GPU)' != '1' and torch.version.cuda else 0)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs lightning_logs
