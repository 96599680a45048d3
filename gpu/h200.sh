#!/usr/bin/env bash
# Run the GPU proof on a fresh H200 machine (no network) from the repository root.
#
#   gpu/h200.sh start            install FlashInfer, sanity-check, launch the pipeline detached
#   gpu/h200.sh wait SECONDS     wait up to SECONDS for it, print the log tail, copy results
#   gpu/h200.sh pipeline         (internal) build + synth + convert + harness, in order
#
# Inputs beside the repo (see gpu/README.md for how to make them):
#   .fi/flashinfer-0.7.2.post1-sm90moe.tar.xz   flashinfer-python 0.7.2.post1, trimmed data
#   .fi/apache_tvm_ffi-*-cp312-*.whl            its compiled dependency
#   .fi/prebuilt/*.so.part-*  (optional)        the plugin's W4A16 module built earlier: no build
# Results: $WORK/out (report.json, report.md, harness.log, pipeline.log), copied to $OUT.
set -uo pipefail

WORK=${KIMI_W31_WORK:-/root/kimi-w31-gpu}
SITE=$WORK/site
REPO=$WORK/repo
LOG=$WORK/out/pipeline.log
export PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=$WORK/fiws
export FLASHINFER_CUDA_ARCH_LIST=9.0a
PKG=$WORK/pkg
export PYTHONPATH=$SITE:$PKG${PYTHONPATH:+:$PYTHONPATH}
kimi_convert() { python3 -m kimi_w31 "$@"; }

setup() {
    mkdir -p "$SITE" "$WORK/out"
    if [ ! -f "$SITE/.installed" ]; then
        tar -xJf .fi/flashinfer-0.7.2.post1-sm90moe.tar.xz -C "$SITE" || return 1
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$SITE" .fi/apache_tvm_ffi-*cp312*.whl || return 1
        touch "$SITE/.installed"
    fi
    # A copy the detached pipeline owns (the checkout may change while it runs), and
    # the installed package layout of pyproject.toml (kimi_w31.{converter,adapter,manifests})
    # built by hand: no pip, no build backend, nothing to resolve offline.
    rm -rf "$REPO" "$PKG" && mkdir -p "$REPO" "$PKG" || return 1
    cp -r gpu "$REPO"/ && cp -r kimi_w31 "$PKG"/ || return 1
    for d in converter adapter manifests; do cp -r "$d" "$PKG/kimi_w31/$d" || return 1; done
}

sanity() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nvcc --version | tail -1
    (cd "$WORK" && python3 -) <<'EOF'
import torch, flashinfer, tvm_ffi
from kimi_w31.adapter.flashinfer_moe import check_situ_support
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
      torch.cuda.get_device_capability(0))
print("flashinfer", flashinfer.__version__, "tvm_ffi", tvm_ffi.__version__)
print("situ support:", check_situ_support())
EOF
}

pipeline() {
    cd "$REPO" || exit 1
    local prebuilt=""
    if ls "$OLDPWD"/.fi/prebuilt/*.so.part-* >/dev/null 2>&1; then
        cat "$OLDPWD"/.fi/prebuilt/*.so.part-* > "$WORK/prebuilt_moe.so"
        prebuilt=$WORK/prebuilt_moe.so
    fi
    echo "== pipeline start $(date -u +%FT%TZ)"
    if [ -z "$prebuilt" ]; then
        echo "== the plugin's FlashInfer module: kimi-convert prebuild (detached from synth/convert)"
        (time kimi_convert prebuild --arch sm90 --progress lines) > "$WORK/out/build.log" 2>&1 &
        build_pid=$!
    fi
    echo "== synth + convert"
    rm -rf "$WORK/src" "$WORK/conv"
    time kimi_convert synth "$WORK/src" --layers 1 --experts 28 --top-k 16 --real-dims \
        || { echo "SYNTH FAILED"; touch "$WORK/done"; exit 1; }
    time kimi_convert "$WORK/src" "$WORK/conv" --manifest kimi-k3-any \
        || { echo "CONVERT FAILED"; touch "$WORK/done"; exit 1; }
    if [ -z "$prebuilt" ]; then
        echo "== waiting for the build"
        if ! wait "$build_pid"; then
            echo "BUILD FAILED"; tail -50 "$WORK/out/build.log"; touch "$WORK/done"; exit 1
        fi
        tail -3 "$WORK/out/build.log"
        so=$(find "$FLASHINFER_WORKSPACE_BASE" -name 'fused_moe_90_kimi_w31_w4a16*.so' | head -1)
        # Split into 15 MiB parts: easier to copy off the machine for reuse (.fi/prebuilt/).
        mkdir -p "$WORK/out/so" && split -b 15M -d "$so" "$WORK/out/so/moe.so.part-"
    else
        export KIMI_W31_PREBUILT_MOE_SO=$prebuilt
    fi
    echo "== harness $(date -u +%FT%TZ)"
    python3 -m gpu.harness --source "$WORK/src" --converted "$WORK/conv" --out "$WORK/out" \
        --trimmed-flashinfer
    echo "== harness exit $? $(date -u +%FT%TZ)"
    touch "$WORK/done"
}

case "${1:-}" in
    start)
        rm -f "$WORK/done"
        setup || { echo "SETUP FAILED"; exit 1; }
        sanity || { echo "SANITY FAILED"; exit 1; }
        setsid nohup bash "$0" pipeline > "$LOG" 2>&1 < /dev/null &
        sleep 20
        tail -5 "$LOG"
        ;;
    pipeline)
        pipeline
        ;;
    wait)
        deadline=$((SECONDS + ${2:-540}))
        while [ ! -f "$WORK/done" ] && [ $SECONDS -lt $deadline ]; do sleep 10; done
        echo "== done: $([ -f "$WORK/done" ] && echo yes || echo no)"
        tail -25 "$LOG"
        tail -4 "$WORK/out/build.log" 2>/dev/null
        ls "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops/*/ 2>/dev/null \
            | grep -c '\.o$' | sed 's/^/objects built: /'
        if [ -n "${OUT:-}" ]; then
            cp "$WORK"/out/*.json "$WORK"/out/*.md "$WORK"/out/*.log "$OUT"/ 2>/dev/null
            if [ -d "$WORK/out/so" ]; then mkdir -p "$OUT/so" && cp "$WORK"/out/so/* "$OUT/so/"; fi
        fi
        ;;
    *)
        echo "usage: $0 start | wait SECONDS" >&2
        exit 2
        ;;
esac
