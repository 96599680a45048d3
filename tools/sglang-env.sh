#!/usr/bin/env bash
# Creates the CPU-only environment in which the adapter's tests run against the real
# SGLang 0.5.23 and FlashInfer code: `bash tools/sglang-env.sh VENV`.
#
# Why it looks like this:
# - torch is pinned to the CPU build; an unpinned torch (or torchvision) pulls a CUDA torch
#   plus several GB of NVIDIA libraries.
# - sglang and flashinfer-python are installed with --no-deps (their own pins want CUDA
#   wheels); the list below is what importing SGLang's model, MoE and plugin code needs.
# - torchvision is not installed: the tests put an import stand-in in place
#   (tests/sglang/stubs.py). triton is, all the same (999 MB): xgrammar, which the server
#   path imports, requires it on Linux x86_64; the stand-in is used where it is missing.
# - uvloop ... python-multipart: what `python -m sglang.launch_server --device cpu` imports
#   (the whole-model test starts the real server).
# - Idempotent: a stamp holding this script's hash makes a second run instant.
set -euo pipefail

VENV="${1:?usage: tools/sglang-env.sh VENV}"
PY="${PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAMP="$VENV/.kimi-w31-sglang-env"
WANT="$(sha256sum "$HERE/tools/sglang-env.sh" "$HERE/pyproject.toml" | sha256sum | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    exit 0
fi

start=$SECONDS
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=(pip_quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# pip's report that sglang's own (CUDA) pins are unmet is expected here, and so are
# warnings about configured index locations that lack a package. Everything else is shown.
PIP_LOG="$(mktemp)"
trap 'rm -f "$PIP_LOG"' EXIT
pip_quiet() {
    local rc=0
    "$@" >"$PIP_LOG" 2>&1 || rc=$?
    grep -v -e "is ignored: it is neither a file nor a directory" \
        -e "which is not installed" -e "but you have" -e "dependency resolver does not" \
        "$PIP_LOG" || true
    return "$rc"
}

"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps sglang==0.5.23 flashinfer-python==0.7.2.post1
"${PIP[@]}" \
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic \
    pyzmq tqdm IPython aiohttp "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11" \
    "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf einops "openai==2.8.0" \
    partial_json_parser nvidia-ml-py uvicorn fastapi \
    uvloop setproctitle jsonschema xgrammar soundfile python-multipart \
    "torch==2.13.0" \
    pytest pytest-xdist hypothesis safetensors click click-default-group rich huggingface_hub
# The project itself, editable, so its entry point is visible to SGLang's plugin loader.
"${PIP[@]}" --no-deps -e "$HERE"

# Guard against a resolver having swapped in a CUDA torch.
"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, (
    f"expected the CPU build of torch 2.13.0, found {torch.__version__} (cuda {torch.version.cuda})"
)
PY
echo "$WANT" > "$STAMP"
echo "sglang test environment ready in $VENV ($((SECONDS - start)) s)"
