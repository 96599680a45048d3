#!/usr/bin/env bash
# SGLang in the loop on a bare, offline H200 machine (two GPUs for the dist suites).
#
#   gpu/sglang_h200.sh start          install, smoke-test, launch the pipeline detached
#   gpu/sglang_h200.sh wait SECONDS   wait up to SECONDS, print the log tail, copy reports to $OUT
#   gpu/sglang_h200.sh pipeline       (internal) synth + convert + single + dist TP2 + dist EP2
#
# Inputs beside the repo (git-ignored, sent with `carry`; gpu/README.md says how to make them):
#   .fi/flashinfer-0.7.2.post1-sm90moe.tar.xz, .fi/apache_tvm_ffi-*.whl   (gpu/pack_flashinfer.sh)
#   .fi/prebuilt/fused_moe_90_kimi_w31_w4a16.so.xz    the trimmed W4A16 module, built earlier
#   .whl/sglang-0.5.23-trim.tar.xz     sglang 0.5.23 without multimodal_gen/test/benchmark/.so
#   .whl/*.whl                         the pure-Python/small deps the machine lacks
set -uo pipefail

WORK=${KIMI_W31_WORK:-/root/kimi-w31-sgl}
SITE=$WORK/site
PKG=$WORK/pkg
REPO=$WORK/repo
OUTD=$WORK/out
LOG=$OUTD/pipeline.log
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=$WORK/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export PYTHONPATH=$SITE:$PKG:$REPO${PYTHONPATH:+:$PYTHONPATH}
kimi_convert() { python3 -m kimi_w31 "$@"; }

setup() {
    mkdir -p "$SITE" "$OUTD"
    local want
    want=$(ls -l .whl .fi .fi/prebuilt | md5sum | cut -c1-16)  # reinstall when inputs change
    if [ "$(cat "$SITE/.installed" 2>/dev/null)" != "$want" ]; then
        rm -rf "$SITE" && mkdir -p "$SITE" || return 1
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl .fi/apache_tvm_ffi-*cp312*.whl || return 1
        tar -xJf .whl/sglang-0.5.23-trim.tar.xz -C "$SITE" || return 1
        tar -xJf .fi/flashinfer-0.7.2.post1-sm90moe.tar.xz -C "$SITE" || return 1
        xz -dc .fi/prebuilt/fused_moe_90_kimi_w31_w4a16.so.xz > "$WORK/prebuilt_moe.so" || return 1
        if [ -f .fi/prebuilt/fused_moe_90_kimi_w31_w4a8_humming.so.xz ]; then
            xz -dc .fi/prebuilt/fused_moe_90_kimi_w31_w4a8_humming.so.xz \
                > "$WORK/prebuilt_w4a8.so" || return 1
        fi
        echo "$want" > "$SITE/.installed"
    fi
    # The installed layout of pyproject.toml by hand, with the plugin's entry point, so that
    # SGLang's load_plugins() finds it exactly as after `pip install kimi-w31`.
    rm -rf "$PKG" "$REPO" && mkdir -p "$PKG/kimi_w31-0.1.0.dist-info" "$REPO" || return 1
    cp -r kimi_w31 "$PKG"/ && cp -r gpu "$REPO"/ || return 1
    for d in converter adapter manifests; do cp -r "$d" "$PKG/kimi_w31/$d" || return 1; done
    printf 'Metadata-Version: 2.1\nName: kimi-w31\nVersion: 0.1.0\n' \
        > "$PKG/kimi_w31-0.1.0.dist-info/METADATA"
    printf '[sglang.srt.plugins]\nkimi_w31 = kimi_w31.adapter.plugin:register\n' \
        > "$PKG/kimi_w31-0.1.0.dist-info/entry_points.txt"
}

smoke() {
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    (cd "$WORK" && python3 -) <<'EOF'
import time; t = time.time()
from gpu import sglang_layer as L
L.install_sgl_kernel_stub()
import torch, flashinfer, sglang, triton, transformers
from sglang.srt.layers.moe.fused_moe_triton import FusedMoE  # noqa: F401
from sglang.srt.models.kimi_k3 import KimiK3LinearForCausalLM  # noqa: F401
from kimi_w31.adapter.flashinfer_moe import check_situ_support
L.load_plugins_checked()
print("torch", torch.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
print("sglang", sglang.__version__, "flashinfer", flashinfer.__version__, "triton",
      triton.__version__, "transformers", transformers.__version__)
print("situ support:", check_situ_support(), f"imports {time.time() - t:.1f} s")
EOF
}

pipeline() {
    cd "$WORK" || exit 1
    local so=$WORK/prebuilt_moe.so
    echo "== pipeline start $(date -u +%FT%TZ)"
    rm -rf "$WORK/src" "$WORK/conv"
    time kimi_convert synth "$WORK/src" --layers 1 --experts 28 --top-k 16 --real-dims \
        || { echo "SYNTH FAILED"; touch "$WORK/done"; exit 1; }
    time kimi_convert "$WORK/src" "$WORK/conv" --manifest kimi-k3-any -q \
        || { echo "CONVERT FAILED"; touch "$WORK/done"; exit 1; }
    local args=(--source "$WORK/src" --converted "$WORK/conv" --out "$OUTD" --prebuilt "$so")
    if [ "${KIMI_W31_SUITES:-all}" = w4a8 ]; then  # the W4A8 module built earlier
        echo "== single-w4a8 $(date -u +%FT%TZ)"
        CUDA_VISIBLE_DEVICES=0 python3 -m gpu.sglang_run single-w4a8 --source "$WORK/src" \
            --converted "$WORK/conv" --out "$OUTD" --prebuilt "$WORK/prebuilt_w4a8.so"
        echo "== single-w4a8 exit $? $(date -u +%FT%TZ)"
        local margs=(--source "$WORK/src" --converted "$WORK/conv" --out "$OUTD" --autotune
                     --no-checks --ms 1,8,32,128,512,2048)
        # One GPU each when there are two (same data, same M, one tuned module per process).
        local second=0
        [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && second=1
        CUDA_VISIBLE_DEVICES=0 python3 -m gpu.w4a8 --module w4a8 \
            --prebuilt "$WORK/prebuilt_w4a8.so" "${margs[@]}" &
        local first_pid=$!
        [ "$second" = 0 ] && wait "$first_pid"
        CUDA_VISIBLE_DEVICES=$second FLASHINFER_WORKSPACE_BASE=$WORK/fiws-w4a16 python3 -m gpu.w4a8 \
            --module w4a16 --prebuilt "$WORK/prebuilt_moe.so" "${margs[@]}"
        wait "$first_pid"
        echo "== tuned timing done $(date -u +%FT%TZ)"
        touch "$WORK/done"
        exit 0
    fi
    echo "== single $(date -u +%FT%TZ)"
    CUDA_VISIBLE_DEVICES=0 python3 -m gpu.sglang_run single "${args[@]}"
    echo "== single exit $? $(date -u +%FT%TZ)"
    # The two-GPU suites need two GPUs (KIMI_W31_SUITES=single skips them).
    [ "${KIMI_W31_SUITES:-all}" = single ] && { touch "$WORK/done"; exit 0; }
    for ep in 1 2; do
        echo "== dist ep$ep $(date -u +%FT%TZ)"
        python3 -m gpu.sglang_run dist --ep "$ep" "${args[@]}"
        echo "== dist ep$ep exit $? $(date -u +%FT%TZ)"
    done
    touch "$WORK/done"
}

# Issue-16 pipeline: build the W4A8 (Humming) module in the background while the W4A16
# timing runs on the GPU, then the W4A8 checks and timing. The built library comes back in
# 15 MiB parts (.fi/prebuilt/ for reuse).
w4a8_pipeline() {
    cd "$WORK" || exit 1
    echo "== w4a8 pipeline start $(date -u +%FT%TZ)"
    (time nice -n 5 python3 -m gpu.trimmed_build --build --variant w4a8) > "$OUTD/build-w4a8.log" 2>&1 &
    local build_pid=$!
    if [ ! -d "$WORK/conv" ]; then
        kimi_convert synth "$WORK/src" --layers 1 --experts 28 --top-k 16 --real-dims >/dev/null
        kimi_convert "$WORK/src" "$WORK/conv" --manifest kimi-k3-any -q
    fi
    local args=(--source "$WORK/src" --converted "$WORK/conv" --out "$OUTD")
    # Its own FlashInfer workspace: FlashInfer regenerates kernel sources on spec creation,
    # which must not touch the files the W4A8 build is compiling.
    FLASHINFER_WORKSPACE_BASE=$WORK/fiws-w4a16 CUDA_VISIBLE_DEVICES=0 python3 -m gpu.w4a8 \
        --module w4a16 --prebuilt "$WORK/prebuilt_moe.so" "${args[@]}"
    echo "== w4a16 timing exit $? $(date -u +%FT%TZ)"
    if ! wait "$build_pid"; then
        echo "W4A8 BUILD FAILED"; tail -40 "$OUTD/build-w4a8.log"; touch "$WORK/done-w4a8"; exit 1
    fi
    tail -2 "$OUTD/build-w4a8.log"
    so=$(find "$FLASHINFER_WORKSPACE_BASE" -name 'fused_moe_90_kimi_w31_w4a8_humming*.so' | head -1)
    mkdir -p "$OUTD/so" && xz -T0 -6 -c "$so" | split -b 15M -d - "$OUTD/so/w4a8.so.xz.part-"
    CUDA_VISIBLE_DEVICES=0 python3 -m gpu.w4a8 --module w4a8 "${args[@]}"
    echo "== w4a8 exit $? $(date -u +%FT%TZ)"
    touch "$WORK/done-w4a8"
}

case "${1:-}" in
    w4a8-start)
        rm -f "$WORK/done-w4a8"
        setup || { echo "SETUP FAILED"; exit 1; }
        setsid nohup bash "$0" w4a8-pipeline > "$OUTD/w4a8-pipeline.log" 2>&1 < /dev/null &
        sleep 5
        ;;
    w4a8-pipeline)
        w4a8_pipeline
        ;;
    w4a8-wait)
        deadline=$((SECONDS + ${2:-540}))
        while [ ! -f "$WORK/done-w4a8" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
        echo "== done: $([ -f "$WORK/done-w4a8" ] && echo yes || echo no)"
        grep -v "Warning\|warn(" "$OUTD/w4a8-pipeline.log" | tail -30
        tail -3 "$OUTD/build-w4a8.log"
        ls "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops/*w4a8*/ 2>/dev/null \
            | grep -c '\.o$' | sed 's/^/w4a8 objects built: /'
        if [ -n "${OUT:-}" ]; then
            cp "$OUTD"/report-w4a8-*.json "$OUT"/ 2>/dev/null
            cat "$OUTD"/w4a8-*.log "$OUTD/build-w4a8.log" > "$OUT/w4a8-logs.txt" 2>/dev/null
            if [ -d "$OUTD/so" ]; then mkdir -p "$OUT/so" && cp "$OUTD"/so/* "$OUT/so/"; fi
        fi
        ;;
    start)
        rm -f "$WORK/done"
        setup || { echo "SETUP FAILED"; exit 1; }
        smoke || { echo "SMOKE FAILED"; exit 1; }
        setsid nohup bash "$0" pipeline > "$LOG" 2>&1 < /dev/null &
        sleep 15
        tail -5 "$LOG"
        ;;
    pipeline)
        pipeline
        ;;
    wait)
        deadline=$((SECONDS + ${2:-540}))
        while [ ! -f "$WORK/done" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
        echo "== done: $([ -f "$WORK/done" ] && echo yes || echo no)"
        grep -v "Warning\|warn(" "$LOG" | tail -40
        if [ -n "${OUT:-}" ]; then
            cp "$OUTD"/report-*.json "$OUTD"/report-*.md "$OUT"/ 2>/dev/null
            cat "$OUTD"/*.log > "$OUT/logs.txt" 2>/dev/null
        fi
        ;;
    *)
        echo "usage: $0 start | wait SECONDS" >&2
        exit 2
        ;;
esac
