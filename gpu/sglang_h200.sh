#!/usr/bin/env bash
# SGLang in the loop on a bare, offline H200 machine (two GPUs for the dist suites).
#
#   gpu/sglang_h200.sh start          install, smoke-test, launch the pipeline detached
#   gpu/sglang_h200.sh wait SECONDS   wait up to SECONDS, print the log tail, copy reports to $OUT;
#                                     exits 0 only if every planned suite ran and passed
#   gpu/sglang_h200.sh pipeline       (internal) synth + convert + the suites of KIMI_W31_SUITES:
#       all (default)  single, dist-ep1 (TP2), dist-ep2 (EP2)   [the dist suites need 2 GPUs]
#       single         single
#       w4a8           single-w4a8, then the tuned W4A8/W4A16 timing
#       w4a8-check     single-w4a8, gpu/w4a8.py's checks (no timing), the preparation memory
#       dist-w4a8      dist-w4a8-ep1, dist-w4a8-ep2 (W4A8 over two GPUs)
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
    printf '[sglang.srt.plugins]\nkimi_w31 = kimi_w31.adapter.sglang.plugin:register\n' \
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

# Each suite's outcome goes to $STATUS ("plan NAME..." first, then "NAME RC" or
# "NAME not-run WHY"); `wait` summarizes it (gpu/sglang_cases.py) and exits non-zero when
# any planned suite failed, could not run or did not finish.
STATUS=$WORK/suites.status
record() { echo "$*" >> "$STATUS"; }

# run_suite NAME GPUS COMMAND...: run it when the machine has GPUS GPUs, record the outcome.
run_suite() {
    local name=$1 need=$2 have rc
    shift 2
    have=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [ "$have" -lt "$need" ]; then
        echo "== $name NOT RUN: needs $need GPUs, this machine has $have"
        record "$name not-run needs $need GPUs, found $have"
        return 1
    fi
    echo "== $name $(date -u +%FT%TZ)"
    "$@"
    rc=$?
    echo "== $name exit $rc $(date -u +%FT%TZ)"
    record "$name $rc"
    return "$rc"
}

suites_of() {
    case "$1" in
        all) echo "single dist-ep1 dist-ep2" ;;
        single) echo "single" ;;
        w4a8) echo "single-w4a8 w4a8-tuned-timing" ;;
        w4a8-check) echo "single-w4a8 w4a8-checks w4a8-prep-memory" ;;
        dist-w4a8) echo "dist-w4a8-ep1 dist-w4a8-ep2" ;;
        *) return 1 ;;
    esac
}

pipeline() {
    cd "$WORK" || exit 1
    local so=$WORK/prebuilt_moe.so w8=$WORK/prebuilt_w4a8.so which=${KIMI_W31_SUITES:-all}
    local plan
    : > "$STATUS"
    if ! plan=$(suites_of "$which"); then
        record "plan $which"
        record "$which not-run unknown KIMI_W31_SUITES value (all, single, w4a8, w4a8-check, dist-w4a8)"
        touch "$WORK/done"
        exit 2
    fi
    record "plan $plan"
    echo "== pipeline start $(date -u +%FT%TZ): $plan"
    rm -rf "$WORK/src" "$WORK/conv"
    local rc
    time kimi_convert synth "$WORK/src" --layers 1 --experts 28 --top-k 16 --real-dims
    rc=$?
    [ "$rc" = 0 ] || { echo "SYNTH FAILED"; record "synth $rc"; touch "$WORK/done"; exit 1; }
    time kimi_convert "$WORK/src" "$WORK/conv" --manifest kimi-k3-any -q
    rc=$?
    [ "$rc" = 0 ] || { echo "CONVERT FAILED"; record "convert $rc"; touch "$WORK/done"; exit 1; }
    local data=(--source "$WORK/src" --converted "$WORK/conv" --out "$OUTD")
    local suite
    for suite in $plan; do
        case "$suite" in
            single)
                run_suite single 1 env CUDA_VISIBLE_DEVICES=0 \
                    python3 -m gpu.sglang_run single "${data[@]}" --prebuilt "$so" ;;
            dist-ep1 | dist-ep2)
                run_suite "$suite" 2 python3 -m gpu.sglang_run dist --ep "${suite#dist-ep}" \
                    "${data[@]}" --prebuilt "$so" ;;
            dist-w4a8-ep1 | dist-w4a8-ep2)
                run_suite "$suite" 2 python3 -m gpu.sglang_run dist --ep "${suite#dist-w4a8-ep}" \
                    --precision fp8 "${data[@]}" --prebuilt "$w8" ;;
            single-w4a8)
                run_suite single-w4a8 1 env CUDA_VISIBLE_DEVICES=0 \
                    python3 -m gpu.sglang_run single-w4a8 "${data[@]}" --prebuilt "$w8" ;;
            w4a8-checks)  # gpu/w4a8.py's gate and negative controls, no timing
                run_suite w4a8-checks 1 env CUDA_VISIBLE_DEVICES=0 \
                    python3 -m gpu.w4a8 --module w4a8 --no-timing "${data[@]}" --prebuilt "$w8" ;;
            w4a8-prep-memory)
                run_suite w4a8-prep-memory 1 env CUDA_VISIBLE_DEVICES=0 \
                    python3 -m gpu.w4a8 --module w4a8 --memory --out "$OUTD" --prebuilt "$w8" ;;
            w4a8-tuned-timing)
                run_suite w4a8-tuned-timing 1 tuned_timing ;;
        esac
    done
    touch "$WORK/done"
}

# The W4A8 and W4A16 tuned timing (one GPU each when there are two: same data, same M,
# one tuned module per process).
tuned_timing() {
    local margs=(--source "$WORK/src" --converted "$WORK/conv" --out "$OUTD" --autotune
                 --no-checks --ms 1,8,32,128,512,2048)
    local second=0 rc=0
    [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && second=1
    CUDA_VISIBLE_DEVICES=0 python3 -m gpu.w4a8 --module w4a8 \
        --prebuilt "$WORK/prebuilt_w4a8.so" "${margs[@]}" &
    local first_pid=$!
    if [ "$second" = 0 ]; then wait "$first_pid" || rc=1; fi
    CUDA_VISIBLE_DEVICES=$second FLASHINFER_WORKSPACE_BASE=$WORK/fiws-w4a16 python3 -m gpu.w4a8 \
        --module w4a16 --prebuilt "$WORK/prebuilt_moe.so" "${margs[@]}" || rc=1
    if [ "$second" = 1 ]; then wait "$first_pid" || rc=1; fi
    return "$rc"
}

# Issue-16 pipeline: build the W4A8 (Humming) module in the background while the W4A16
# timing runs on the GPU, then the W4A8 checks and timing. The built library comes back in
# 15 MiB parts (.fi/prebuilt/ for reuse).
w4a8_pipeline() {
    cd "$WORK" || exit 1
    STATUS=$WORK/w4a8.status
    : > "$STATUS"
    record "plan w4a8-build w4a16-timing w4a8-checks-and-timing"
    echo "== w4a8 pipeline start $(date -u +%FT%TZ)"
    (time nice -n 5 python3 -m gpu.trimmed_build --build --variant w4a8) > "$OUTD/build-w4a8.log" 2>&1 &
    local build_pid=$!
    if [ ! -d "$WORK/conv" ]; then
        kimi_convert synth "$WORK/src" --layers 1 --experts 28 --top-k 16 --real-dims >/dev/null \
            && kimi_convert "$WORK/src" "$WORK/conv" --manifest kimi-k3-any -q \
            || { record "synth-convert 1"; wait "$build_pid"; touch "$WORK/done-w4a8"; exit 1; }
    fi
    local args=(--source "$WORK/src" --converted "$WORK/conv" --out "$OUTD")
    # Its own FlashInfer workspace: FlashInfer regenerates kernel sources on spec creation,
    # which must not touch the files the W4A8 build is compiling.
    run_suite w4a16-timing 1 env FLASHINFER_WORKSPACE_BASE="$WORK/fiws-w4a16" \
        CUDA_VISIBLE_DEVICES=0 python3 -m gpu.w4a8 --module w4a16 \
        --prebuilt "$WORK/prebuilt_moe.so" "${args[@]}"
    if ! wait "$build_pid"; then
        echo "W4A8 BUILD FAILED"; tail -40 "$OUTD/build-w4a8.log"
        record "w4a8-build 1"; touch "$WORK/done-w4a8"; exit 1
    fi
    record "w4a8-build 0"
    tail -2 "$OUTD/build-w4a8.log"
    so=$(find "$FLASHINFER_WORKSPACE_BASE" -name 'fused_moe_90_kimi_w31_w4a8_humming*.so' | head -1)
    mkdir -p "$OUTD/so" && xz -T0 -6 -c "$so" | split -b 15M -d - "$OUTD/so/w4a8.so.xz.part-"
    run_suite w4a8-checks-and-timing 1 env CUDA_VISIBLE_DEVICES=0 \
        python3 -m gpu.w4a8 --module w4a8 "${args[@]}"
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
        finished=no
        [ -f "$WORK/done-w4a8" ] && finished=yes
        echo "== w4a8 pipeline finished: $finished"
        grep -v "Warning\|warn(" "$OUTD/w4a8-pipeline.log" | tail -30
        tail -3 "$OUTD/build-w4a8.log"
        ls "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops/*w4a8*/ 2>/dev/null \
            | grep -c '\.o$' | sed 's/^/w4a8 objects built: /'
        if [ -n "${OUT:-}" ]; then
            cp "$OUTD"/report-w4a8-*.json "$OUT"/ 2>/dev/null
            cat "$OUTD"/w4a8-*.log "$OUTD/build-w4a8.log" > "$OUT/w4a8-logs.txt" 2>/dev/null
            if [ -d "$OUTD/so" ]; then mkdir -p "$OUT/so" && cp "$OUTD"/so/* "$OUT/so/"; fi
        fi
        (cd "$REPO" && python3 -m gpu.sglang_cases status "$WORK/w4a8.status" --finished "$finished")
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
        finished=no
        [ -f "$WORK/done" ] && finished=yes
        echo "== pipeline finished: $finished"
        grep -v "Warning\|warn(" "$LOG" | tail -40
        if [ -n "${OUT:-}" ]; then
            cp "$OUTD"/report-*.json "$OUTD"/report-*.md "$OUT"/ 2>/dev/null
            cat "$OUTD"/*.log > "$OUT/logs.txt" 2>/dev/null
            cp "$STATUS" "$OUT/suites.status" 2>/dev/null
        fi
        # Exit 0 only when every planned suite ran and passed; says which did not.
        (cd "$REPO" && python3 -m gpu.sglang_cases status "$STATUS" --finished "$finished")
        ;;
    *)
        echo "usage: $0 start | wait SECONDS" >&2
        exit 2
        ;;
esac
