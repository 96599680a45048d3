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
# The suites run on two workers (CI has two cores, and much of each suite waits on
# subprocesses, sockets and timeouts). Each test file goes whole to one worker
# (--dist loadfile), so a module's fixtures (a Ray runtime, a model build) are built once;
# files are handed out in collection order (not xdist's most-tests-first), which puts the
# longest ones early: tests/sglang/conftest.py orders that suite.
JOBS         ?= 2
PARALLEL     := -n $(JOBS) --dist loadfile --no-loadscope-reorder
# `make bench` and `make faults` write their reports here; UPDATE_DOCS=1 writes docs/.
REPORTS      := $(if $(UPDATE_DOCS),docs,.reports)

.PHONY: demo test test-floors lint bench faults test-sglang clean

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
	$(BIN)/python -m pytest -q $(PARALLEL)

# The tests that exercise each runtime dependency, in a second venv holding the lowest
# versions pyproject.toml declares (constraints-floors.txt): the declared ranges hold.
FLOORS       := .venv-floors
FLOORS_TESTS := \
	tests/test_hub_stream.py tests/test_progress.py \
	tests/test_fault_headers.py tests/test_format_spec.py tests/test_convert_e2e.py \
	tests/test_units.py tests/test_reference.py tests/test_verify.py \
	tests/test_cli_help.py tests/test_exit_codes.py tests/test_root_cause.py \
	tests/test_bad_input.py tests/test_dependency_floors.py
# huggingface_hub: hub_stream, progress. safetensors: fault_headers (the library's own
# reader), format_spec, convert_e2e, units. numpy: reference, verify (numerics). click and
# click-default-group: cli_help, exit_codes, root_cause, bad_input. rich: progress.

$(FLOORS)/.installed: pyproject.toml constraints-floors.txt
	rm -rf $(FLOORS)
	$(PY) -m venv $(FLOORS)
	$(FLOORS)/bin/pip install -q --constraint constraints-floors.txt -e . pytest hypothesis pytest-xdist
	touch $@

test-floors: $(FLOORS)/.installed
	KIMI_W31_EXPECT_FLOORS=constraints-floors.txt $(FLOORS)/bin/python -m pytest -q $(PARALLEL) $(FLOORS_TESTS)

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
	.venv-sglang/bin/python -m pytest -q -m sglang $(PARALLEL) tests/sglang

clean:
	rm -rf $(VENV) .venv-sglang $(FLOORS) $(DEMO) .bench .reports
