# bert-pretrain: every target sets up its own virtual environment first, so a fresh clone needs
# nothing but Python 3.10+ and `make`.  `make help` lists the targets.
SHELL := /bin/bash
# A literal comma inside a $(if ...):
comma := ,
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first, on its own, so that `pip install -e .` keeps the build chosen here.
# TORCH_SPEC: the version.  TORCH_INDEX: where pip looks for it; empty = pip's configured index.
# On the default PyPI index `torch==2.13.0` is the Linux CUDA build (several GB of nvidia-*
# wheels); for the CPU build pass PyTorch's CPU index:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (Our CI machines' pip is configured with a local wheel directory holding the CPU build, so
# they need neither.)  Changing them later: `make clean-venv`, then any target.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
# The test targets run pytest in this many processes (pytest-xdist): 2 nearly halves a 2-core
# machine's suite (a 2-core CPU without bf16 units, clean clones: the default suite 26.4 minutes
# in one process, 14.4 in two; the whole of .ci/run 47 minutes in two, where CI's serial run
# had taken 73 of its 90).  More than 2 is for machines with
# the cores and memory for it (each worker imports torch and its tests start processes of their
# own); 0 = one process, no xdist (a debugger, `pytest -x` ordering).
TEST_WORKERS ?= 2
TEST_XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS))
# The demo's data: the README's prep command is this one.
DEMO_DATA := prepared/builtin64
# DEMO_STEPS=N trains N steps instead of 3 minutes of wall clock: on a busy or slow machine the
# 3 minutes give few steps (658 at load 5-9 on 2 cores) and answers the README does not show;
# 3700 is what the quiet development machine trained in 3 minutes (the README's run; another
# 2-core machine of its kind gave 2,083).  It is a run of its own
# (runs/demo-N-steps), so the 3-minute run is kept.
DEMO_STEPS ?=
DEMO_NAME = $(if $(DEMO_STEPS),demo-$(DEMO_STEPS)-steps,demo)
DEMO_RUN = runs/$(DEMO_NAME)
DEMO_TRAIN_ARGS = $(if $(DEMO_STEPS),name=$(DEMO_NAME) trainer.budget_hours=null trainer.max_steps=$(DEMO_STEPS))
# The demo's last step: two of the sentences bench/demo_check.py asks (README, "What the demo
# learns", shows all five).
DEMO_SENTENCES := 'Extra keyword [MASK] are passed to the constructor.' 'New in [MASK] 3.2.'

.DEFAULT_GOAL := help
.PHONY: help install install-test test test-slow test-all test-cuda demo demo-readme demo-clean bench gpu-check clean clean-venv

help: ## Show this help
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'
	@echo "  Variables: TORCH_SPEC=$(TORCH_SPEC) TORCH_INDEX=$(or $(TORCH_INDEX),<pip's configured index>) DEMO_STEPS=N TEST_WORKERS=$(TEST_WORKERS) PYTEST_ARGS=..."

# What the first run installs (measured in a CPU-build .venv): torch, a 190 MB download for the
# CPU build (PyPI's CUDA build on Linux: ~3 GB with its nvidia-* wheels), 760 MB installed; the
# project's other dependencies, ~1.0 GB installed; the test extras, ~130 MB.  pip is not quiet
# for these: it names each package it downloads, with its size.
$(VENV)/.installed: pyproject.toml
	@echo "make: setting up $(VENV) for the project (once; make clean-venv starts again): torch, then the project's dependencies: ~1.8 GB installed with torch's CPU build$(if $(TORCH_INDEX),,; on Linux PyPI's default CUDA build adds several GB (README$(comma) Install))"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "make: installing $(TORCH_SPEC) from $(or $(TORCH_INDEX),pip's configured index): the CPU build is a 190 MB download, 760 MB installed; on Linux PyPI's default is the CUDA build, ~3 GB (README, Install)"
	$(PY) -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	@echo "make: installing the project and its dependencies (datasets, tokenizers, hydra-core, accelerate, wandb, scipy, scikit-learn, matplotlib, ...: ~1.0 GB installed)"
	$(PY) -m pip install -e .
	touch $@

# The test extras (pyproject.toml: transformers, pytest, hypothesis, ...) only for the targets
# that need them; made again whenever the base install is.
$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	@echo "make: adding the test extras to $(VENV) (transformers, pytest, pytest-timeout, pytest-xdist, hypothesis, psutil: ~130 MB installed)"
	$(PY) -m pip install -e ".[test]"
	touch $@

install: $(VENV)/.installed ## Create .venv with torch (TORCH_SPEC/TORCH_INDEX) and the project: what `make demo` needs

install-test: $(VENV)/.installed-test ## `make install` plus the test extras (transformers, pytest, hypothesis): what the test targets need

test: install-test ## Set up and run the test suite (what CI runs first)
	$(PY) -m pytest -q -m "not slow" $(TEST_XDIST) $(PYTEST_ARGS)

test-slow: install-test ## Run only the slow tests (CI runs these after `make test`)
	$(PY) -m pytest -q -m slow $(TEST_XDIST) $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: no slow test collected

test-all: install-test ## Run every test
	$(PY) -m pytest -q $(TEST_XDIST) $(PYTEST_ARGS)

# Without a GPU every test it selects would be skipped and pytest would exit 0, which reads as a
# pass: it fails instead, saying that nothing ran.
test-cuda: install-test ## Run the GPU tests (tests/test_cuda.py; needs CUDA: without it, fails saying nothing ran)
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || { \
	  echo "make test-cuda: torch sees no CUDA device here, so no GPU test ran (this is not a pass);" \
	    "run it on a GPU machine with a CUDA build of torch (make gpu-check runs these and more)" >&2; \
	  exit 1; }
	$(PY) -m pytest -q --cuda -m cuda $(PYTEST_ARGS)

demo: install ## Prepare the built-in corpus, train a small BERT for 3 minutes on CPU (DEMO_STEPS=N: N steps), evaluate it, fill in two [MASK]s (the first run installs .venv first)
	$(VENV)/bin/bert-prep corpus=builtin output_dir=$(DEMO_DATA) validation_fraction=0.05 max_seq_length=64 max_predictions_per_seq=10 tokenizer.vocab_size=8192
	$(VENV)/bin/bert-train experiment=demo $(DEMO_TRAIN_ARGS)
	@echo "make: the demo model fills in two [MASK]s$(if $(DEMO_STEPS),,; on a busy machine 3 minutes give fewer steps and worse answers: make demo DEMO_STEPS=3700 trains the steps of the README's run)"
	$(VENV)/bin/bert-predict fill-mask $(DEMO_RUN) $(DEMO_SENTENCES) --top-k 3

demo-readme: demo ## Rewrite README.md's demo output block from the demo run (bench/demo_check.py)
	$(PY) bench/demo_check.py $(DEMO_RUN) --data $(DEMO_DATA) --readme README.md

demo-clean: ## Remove the demo's prepared data and runs (the next `make demo` starts afresh)
	rm -rf $(DEMO_DATA) runs/demo runs/demo-*-steps

bench: install-test ## Run the benchmarks (tables on stdout, JSON under bench/results/)
	$(PY) bench/bench_prep.py
	$(PY) bench/bench_model.py
	$(PY) bench/bench_fsdp_memory.py

# For the GPU machine only, which has its own Python (no venv, no internet): this target
# installs into GPU_PYTHON (python3 on PATH, not .venv): the project, editable and without its
# dependencies, and the packages that Python lacks, staged here first with
# ../shared/gpu/stage_wheels.sh (into .whl/) and installed into /tmp/site.  On another machine
# it would change whatever python3 is first on PATH.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check: ## GPU machine only: GPU tests, bench, train, SST-2, suite (bench/gpu_check.py, docs/gpu.md); installs the project (pip -e, no deps) and .whl/ wheels into GPU_PYTHON (python3 on PATH), not .venv
	@if [ -d .whl ]; then \
	  echo "gpu-check: installing the staged wheels (.whl/) into /tmp/site"; \
	  $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade \
	    --target /tmp/site .whl/*.whl; fi
	@# the console scripts (bert-train, ...) for the tests that run them, without a venv
	-PYTHONPATH=/tmp/site$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m pip install -q \
	  --no-index --no-deps --no-build-isolation -e .
	PYTHONPATH=/tmp/site$${PYTHONPATH:+:$$PYTHONPATH} WANDB_MODE=disabled HF_HUB_OFFLINE=1 \
	  $(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean: ## Remove everything the commands wrote (prepared data, runs, sweeps, results); keeps .venv
	rm -rf prepared runs outputs multirun exported finetune glue reports maps.png bench/results gpu-check .pytest_cache

clean-venv: ## Remove .venv (then any target reinstalls, e.g. with another TORCH_INDEX)
	rm -rf $(VENV)
