# Two commands are all a newcomer needs: `make demo` and `make test`.
# Every target sets up the local virtualenv on first use.

PY           ?= python3
VENV         := .venv
BIN          := $(VENV)/bin
STAMP        := $(VENV)/.installed
# `make demo` needs the converter alone: no development tools, no Ray, no torch.
DEMO_STAMP   := $(VENV)/.converter
TORCH_STAMP  := $(VENV)/.torch
DEMO         := demo
# torch is needed only by the adapter's CPU tests, and as the CPU build: on Linux the plain
# package index serves a CUDA build of several GB. Where this index cannot be reached, pip
# falls back to whatever other index or local wheel it is configured with.
TORCH_INDEX  ?= https://download.pytorch.org/whl/cpu
TORCH        ?= torch==2.13.0
# `make bench` and `make faults` write their reports here; UPDATE_DOCS=1 writes docs/.
REPORTS      := $(if $(UPDATE_DOCS),docs,.reports)

.PHONY: demo test lint bench faults test-sglang clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,ray]'
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $(DEMO_STAMP)

$(TORCH_STAMP): $(STAMP)
	$(BIN)/pip install -q --retries 1 --index-url $(TORCH_INDEX) '$(TORCH)'
	touch $(TORCH_STAMP)

demo: $(DEMO_STAMP)
	rm -rf $(DEMO)
	$(BIN)/kimi-convert synth $(DEMO)/src --layers 4 --experts 8
	$(BIN)/kimi-convert $(DEMO)/src $(DEMO)/out --manifest kimi-k3-any --max-shard-size 1MB
	$(BIN)/kimi-convert verify $(DEMO)/out --checksums --source $(DEMO)/src --numerics

test: $(TORCH_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python tools/bench.py --out $(REPORTS)

faults: $(STAMP)
	$(BIN)/python tools/fault_table.py --out $(REPORTS)/reliability.md

# The adapter's tests against the real SGLang 0.5.23 code, in their own (~3 GB) environment.
test-sglang:
	bash tools/sglang-env.sh .venv-sglang
	.venv-sglang/bin/python -m pytest -q -m sglang tests/sglang

clean:
	rm -rf $(VENV) .venv-sglang $(DEMO) .bench .reports
