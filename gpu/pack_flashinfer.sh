#!/usr/bin/env bash
# Make .fi/ for gpu/h200.sh on a machine with network access (any OS with python3 + pip):
# flashinfer-python 0.7.2.post1 packed with only what its SM90 fused-MoE build needs
# (~12 MB instead of the ~400 MB unpacked wheel) and the apache-tvm-ffi cp312 wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$tmp" \
    flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2
cp "$tmp"/apache_tvm_ffi-*.whl .fi/
(cd "$tmp" && unzip -q flashinfer_python-*.whl)
# The Python package without its data, plus only the C++ trees the fused-MoE JIT includes.
(
    cd "$tmp"
    find flashinfer b12x flashinfer_python-0.7.2.post1.dist-info -path flashinfer/data -prune \
        -o -type f -print
    find flashinfer/data/csrc -maxdepth 1 -type f
    printf '%s\n' flashinfer/data/csrc/nv_internal flashinfer/data/csrc/fused_moe/cutlass_backend \
        flashinfer/data/include flashinfer/data/cutlass/include \
        flashinfer/data/cutlass/tools/util/include flashinfer/data/cccl/cub \
        flashinfer/data/cccl/thrust flashinfer/data/cccl/libcudacxx/include \
        flashinfer/data/spdlog/include
) > "$tmp/files"
tar -C "$tmp" -cJf .fi/flashinfer-0.7.2.post1-sm90moe.tar.xz -T "$tmp/files"
ls -la .fi
