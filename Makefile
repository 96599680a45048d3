# Two commands are all a newcomer needs: `make demo` and `make test`.
# Every target sets up the local virtualenv on first use.

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEMO    := demo

.PHONY: demo test lint bench faults test-sglang clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is the CPU build; an unpinned torch would pull several GB of CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,ray]'
	touch $(STAMP)

demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/kimi-convert synth $(DEMO)/src --layers 3 --experts 8
	$(BIN)/kimi-convert $(DEMO)/src $(DEMO)/out --manifest kimi-k3-any --max-shard-size 1MB
	$(BIN)/kimi-convert verify $(DEMO)/out --checksums --source $(DEMO)/src --numerics

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check converter adapter tests

bench: $(STAMP)
	$(BIN)/python tools/bench.py --out docs

faults: $(STAMP)
	$(BIN)/python tools/fault_table.py --out docs/reliability.md

# The adapter's tests against the real SGLang 0.5.23 code, in their own (~3 GB) environment.
test-sglang:
	bash tools/sglang-env.sh .venv-sglang
	.venv-sglang/bin/python -m pytest -q -m sglang tests/sglang

clean:
	rm -rf $(VENV) .venv-sglang $(DEMO) .bench
