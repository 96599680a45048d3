#!/usr/bin/env bash
# Make .whl/ for gpu/sglang_h200.sh and gpu/race_h200.sh on a machine with network access:
# sglang 0.5.23 without multimodal_gen/, tests, benchmarks and its compiled extensions
# (none of which the MoE path imports), and the wheels SGLang's imports need that the H200
# machine's image lacks (found by importing the path and diffing against the image's list).
# Also a slim sgl_kernel 0.4.6 (the one that loads against the machine's torch 2.11; SGLang's
# Marlin MoE and server need it: gpu/slim_kernel.py says what it keeps) and the wheels the
# real server imports beyond the layer path. Without the slim kernel, gpu/sglang_layer.py
# stubs sgl_kernel (enough for the plugin's layer path).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dl() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$@"
}
dl "$tmp" sglang==0.5.23
(cd "$tmp" && unzip -q sglang-*.whl && tar -cJf sglang-0.5.23-trim.tar.xz \
    --exclude='sglang/multimodal_gen' --exclude='sglang/test' --exclude='sglang/benchmark' \
    --exclude='*.so' --exclude='__pycache__' sglang sglang-0.5.23.dist-info)
cp "$tmp/sglang-0.5.23-trim.tar.xz" .whl/
dl .whl annotated-doc==0.0.7 annotated-types==0.8.0 asttokens==3.0.2 click-default-group==1.2.4 \
    compressed-tensors==0.18.0 dill==0.4.1 distro==1.9.0 executing==2.3.0 fastapi==0.165.0 \
    gguf==0.19.0 ipython==9.18.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 jiter==0.19.0 \
    loguru==0.7.3 matplotlib-inline==0.2.2 msgspec==0.23.0 openai==2.8.0 \
    opentelemetry-api==1.45.2 orjson==3.13.0 parso==0.8.7 partial-json-parser==0.2.1.1.post7 \
    pexpect==4.9.0 prompt-toolkit==3.0.53 ptyprocess==0.7.0 pure-eval==0.2.4 pybase64==1.5.1 \
    pydantic==2.14.4 pydantic-core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 stack-data==0.6.3 \
    starlette==1.10.0 traitlets==5.16.1 truststore==0.10.5 typing-inspection==0.4.5 \
    uvicorn==0.54.0 wcwidth==0.9.4
# The server path (gpu/sglang_layer.py's stub is not enough there).
dl .whl cffi==2.1.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 pycparser==3.12 \
    python-multipart==0.0.34 referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 \
    soundfile==0.14.0 xgrammar==0.2.7
# SGLang's watchdog dumps a stuck scheduler's stacks with py-spy when it is on PATH.
dl .whl py-spy==0.4.3
dl "$tmp" sglang-kernel==0.4.6
python3 -m gpu.slim_kernel "$tmp"/sglang_kernel-0.4.6-*.whl .whl/sgl_kernel-0.4.6-slim.tar.xz
ls .whl/*.whl | wc -l | sed 's/^/wheels: /'
du -sh .whl
