# bert-pretrain: every target sets up its own virtual environment first, so a fresh clone needs
# nothing but Python 3.10+ and `make`.  `make help` lists the targets.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build is pinned so that an unpinned install never drags in several GB of CUDA wheels;
# on a GPU machine set TORCH_SPEC to the build you want (e.g. TORCH_SPEC="torch==2.13.0").
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install test test-slow test-all demo bench clean

help: ## Show this help
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed ## Create .venv and install the project (torch pinned, then the rest)

test: install ## Set up and run the test suite (what CI runs first)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: install ## Run only the slow tests (CI runs these after `make test`)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: no slow test collected

test-all: install ## Run every test
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: install ## The main job: prepare the built-in corpus, train a small BERT on CPU, evaluate
	$(VENV)/bin/bert-prep corpus=builtin output_dir=prepared/builtin128 validation_fraction=0.05
	$(VENV)/bin/bert-train experiment=demo

bench: install ## Run the benchmarks (tables on stdout, JSON under bench/results/)
	$(PY) bench/bench_prep.py
	$(PY) bench/bench_model.py

clean: ## Remove build outputs (keeps .venv)
	rm -rf prepared runs outputs multirun bench/results .pytest_cache
