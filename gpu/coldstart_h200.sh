#!/usr/bin/env bash
# Cold start on a fresh, offline H200 machine: the product's prebuild from an empty cache,
# the bundle loaded in fresh processes, and the SGLang gate on the product's modules.
#
#   gpu/coldstart_h200.sh start          install, launch the pipeline detached
#   gpu/coldstart_h200.sh wait SECONDS   wait up to SECONDS, print the log tail, copy to $OUT
#   gpu/coldstart_h200.sh pipeline       (internal)
#
# Inputs beside the repo (as gpu/sglang_h200.sh): .fi/ (FlashInfer, tvm-ffi; prebuilt/ is
# optional: the W4A8 module for gate8 without build8, the libraries tactics16/8 study) and
# .whl/ (SGLang trimmed + wheels).
#
# Pipeline, in order (KIMI_W31_COLDSTART_STEPS to choose, default all):
#   build16  kimi-convert prebuild --arch sm90 --precision w4a16 --out BUNDLE, empty cache,
#            wall time, host memory sampled every second, ninja's per-unit log kept
#   probe    process start -> first MoE forward: bundle (fresh FlashInfer workspace), then
#            the plain FlashInfer-cache route (the workspace prebuild filled)
#   gate16   SGLang single-GPU suite, W4A16, module from the bundle (KIMI_W31_KERNELS)
#   gate8    SGLang single-GPU suite, W4A8: the bundle's module when build8 made one, else
#            the prebuilt W4A8 library, through the product
#   buildall kimi-convert prebuild --precision w4a16-all --out BUNDLE (every tactic), empty
#            cache (only when named: "all" leaves it and smokeall out)
#   build8   kimi-convert prebuild --precision w4a8 --out BUNDLE, empty cache
#   bundle16 the W4A16 bundle from the workspace a cache-route probe already compiled
#   smoke16, smoke8   (after the gates) every tactic FlashInfer's autotuner can
#            select, profiled once through the bundle's module (TP 8, M <= 64): none may fail;
#            smokeall the same for the w4a16-all module (KIMI_W31_TACTICS=all)
#   tactics16, tactics8   gpu/tactics.py on the prebuilt W4A16 / W4A8 module (every
#            launcher): every valid tactic of each GEMM timed in the whole forward at
#            Kimi-K3 per-rank shapes (TP 8, 2, 1; M 1..8192), the fewest launchers within
#            1 %, and the forward re-timed with that set against the full one (a smoke run
#            at TP 8, M <= 64 first, so a broken script stops in seconds)
set -uo pipefail

WORK=${KIMI_W31_WORK:-/root/kimi-w31-cold}
SITE=$WORK/site
PKG=$WORK/pkg
REPO=$WORK/repo
OUTD=$WORK/out
LOG=$OUTD/pipeline.log
BUNDLE=$WORK/bundle
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export PYTHONPATH=$SITE:$PKG:$REPO${PYTHONPATH:+:$PYTHONPATH}
JOBS=${KIMI_W31_JOBS:-}

setup() {
    mkdir -p "$SITE" "$OUTD"
    if [ ! -f "$SITE/.installed" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl .fi/apache_tvm_ffi-*cp312*.whl || return 1
        tar -xJf .whl/sglang-0.5.23-trim.tar.xz -C "$SITE" || return 1
        tar -xJf .fi/flashinfer-0.7.2.post1-sm90moe.tar.xz -C "$SITE" || return 1
        touch "$SITE/.installed"
    fi
    # The prebuilt libraries are optional: only gate8 (without build8) and tactics16/8 use
    # them, and those steps say so when theirs is missing.
    local v xz
    for v in w4a16 w4a8; do
        xz=.fi/prebuilt/fused_moe_90_kimi_w31_${v}.so.xz
        [ "$v" = w4a8 ] && xz=.fi/prebuilt/fused_moe_90_kimi_w31_w4a8_humming.so.xz
        if [ -f "$xz" ] && [ ! -f "$WORK/prebuilt_$v.so" ]; then
            xz -dc "$xz" > "$WORK/prebuilt_$v.so" || { rm -f "$WORK/prebuilt_$v.so"; return 1; }
        fi
    done
    rm -rf "$PKG" "$REPO" && mkdir -p "$PKG/kimi_w31-0.1.0.dist-info" "$REPO" || return 1
    cp -r kimi_w31 "$PKG"/ && cp -r gpu "$REPO"/ || return 1
    for d in converter adapter manifests; do cp -r "$d" "$PKG/kimi_w31/$d" || return 1; done
    printf 'Metadata-Version: 2.1\nName: kimi-w31\nVersion: 0.1.0\n' \
        > "$PKG/kimi_w31-0.1.0.dist-info/METADATA"
    printf '[sglang.srt.plugins]\nkimi_w31 = kimi_w31.adapter.sglang.plugin:register\n' \
        > "$PKG/kimi_w31-0.1.0.dist-info/entry_points.txt"
}

# Host memory in use (MemTotal - MemAvailable, GiB) every second into $OUTD/mem-<phase>.tsv.
sample_memory() {
    local phase=$1
    while [ -f "$WORK/sampling-$phase" ]; do
        awk -v t="$(date +%s)" '/MemTotal/{a=$2} /MemAvailable/{b=$2} END{printf "%s\t%.2f\n", t, (a-b)/1048576}' \
            /proc/meminfo >> "$OUTD/mem-$phase.tsv"
        sleep 1
    done
}

peak() { sort -t$'\t' -k2 -g "$OUTD/mem-$1.tsv" 2>/dev/null | tail -1 | cut -f2; }

build() {  # build VARIANT PHASE
    local variant=$1 phase=$2 ws=$WORK/fiws-$2
    rm -rf "$ws"
    touch "$WORK/sampling-$phase"
    sample_memory "$phase" &
    local t0 t1
    t0=$(date +%s.%N)
    FLASHINFER_WORKSPACE_BASE=$ws python3 -m kimi_w31 prebuild --arch sm90 --precision "$variant" \
        --out "$BUNDLE" ${JOBS:+--jobs "$JOBS"} --progress lines > "$OUTD/$phase.log" 2>&1
    local rc=$?
    t1=$(date +%s.%N)
    rm -f "$WORK/sampling-$phase"
    wait
    echo "== $phase rc $rc wall $(awk "BEGIN{printf \"%.1f\", $t1 - $t0}") s, host memory peak $(peak "$phase") GiB" \
        "(baseline $(head -1 "$OUTD/mem-$phase.tsv" | cut -f2) GiB)"
    tail -3 "$OUTD/$phase.log"
    find "$ws" -name .ninja_log -exec cp {} "$OUTD/ninja-$phase.log" \;
    return $rc
}

probe() {  # probe NAME [env...]
    local name=$1; shift
    env "$@" python3 -m gpu.coldstart_probe --t0 "$(date +%s.%N)" --out "$OUTD/probe-$name.json" \
        > "$OUTD/probe-$name.log" 2>&1
    echo "== probe $name rc $?: $(tail -1 "$OUTD/probe-$name.log")"
}

smoke() {  # smoke VARIANT PHASE: the bundle's module under FlashInfer's own autotuner
    echo "== $2 $(date -u +%FT%TZ)"
    KIMI_W31_KERNELS=$BUNDLE FLASHINFER_WORKSPACE_BASE=$WORK/fiws-$2 python3 -m gpu.tactics \
        --variant "$1" --method autotuner --out "$OUTD/$2" --tp 8 --max-tokens 64 --reps 3 --rounds 1 \
        > "$OUTD/$2.log" 2>&1
    echo "== $2 exit $? $(tail -1 "$OUTD/$2.log")"
}

has() { [ "${KIMI_W31_COLDSTART_STEPS:-all}" = all ] || named "$1"; }
named() { [[ ",${KIMI_W31_COLDSTART_STEPS:-}," == *",$1,"* ]]; }  # steps that "all" leaves out

pipeline() {
    cd "$WORK" || exit 1
    echo "== pipeline start $(date -u +%FT%TZ) cores $(nproc), $(awk '/MemTotal|MemAvailable/{printf "%s %.1f GiB ", $1, $2/1048576}' /proc/meminfo)"
    python3 -c "from kimi_w31.adapter.prebuild import default_jobs as d; print('default jobs', d(), 'used', '${JOBS:-default}')"
    if has build16; then build w4a16 build16; fi
    if has bundle16; then  # the bundle from the workspace the cache-route probe compiled
        FLASHINFER_WORKSPACE_BASE=$WORK/fiws-build16 python3 -m kimi_w31 prebuild --arch sm90 \
            --precision w4a16 --out "$BUNDLE" --progress lines > "$OUTD/bundle16.log" 2>&1
        echo "== bundle16 rc $? $(tail -1 "$OUTD/bundle16.log")"
    fi
    if has probe; then
        probe bundle KIMI_W31_KERNELS="$BUNDLE" FLASHINFER_WORKSPACE_BASE="$WORK/fiws-serve"
        probe cache FLASHINFER_WORKSPACE_BASE="$WORK/fiws-build16"
    fi
    if named buildall; then build w4a16-all buildall; fi
    if has build8; then build w4a8 build8; fi
    if has gate16 || has gate8; then
        rm -rf "$WORK/src" "$WORK/conv"
        python3 -m kimi_w31 synth "$WORK/src" --layers 1 --experts 28 --top-k 16 --real-dims >/dev/null
        python3 -m kimi_w31 "$WORK/src" "$WORK/conv" --manifest kimi-k3-any -q
    fi
    local args=(--source "$WORK/src" --converted "$WORK/conv" --out "$OUTD")
    if has gate16; then
        echo "== gate16 $(date -u +%FT%TZ)"
        KIMI_W31_KERNELS=$BUNDLE FLASHINFER_WORKSPACE_BASE=$WORK/fiws-gate16 \
            python3 -m gpu.sglang_run single "${args[@]}" > "$OUTD/gate16.log" 2>&1
        echo "== gate16 exit $? $(grep -h 'verdict' "$OUTD/gate16.log" | tail -1)"
    fi
    if has gate8; then
        echo "== gate8 $(date -u +%FT%TZ)"
        # the bundle's W4A8 module when build8 made one, else the prebuilt library
        local w4a8=(--prebuilt "$WORK/prebuilt_w4a8.so")
        if grep -q '"w4a8"' "$BUNDLE/manifest.json" 2>/dev/null; then w4a8=(); fi
        if [ "${#w4a8[@]}" -gt 0 ] && [ ! -f "$WORK/prebuilt_w4a8.so" ]; then
            echo "== gate8 NOT RUN: no W4A8 module (run build8, or put the prebuilt one in .fi/prebuilt/)"
        else
            KIMI_W31_KERNELS=$BUNDLE FLASHINFER_WORKSPACE_BASE=$WORK/fiws-gate8 \
                python3 -m gpu.sglang_run single-w4a8 "${args[@]}" "${w4a8[@]}" \
                > "$OUTD/gate8.log" 2>&1
            echo "== gate8 exit $? $(grep -h 'verdict' "$OUTD/gate8.log" | tail -1)"
        fi
    fi
    if has smoke16; then smoke w4a16 smoke16; fi
    if has smoke8; then smoke w4a8 smoke8; fi
    if named smokeall; then KIMI_W31_TACTICS=all smoke w4a16 smokeall; fi
    for v in w4a16 w4a8; do
        local step=tactics${v#w4a} so=$WORK/prebuilt_$v.so
        has "$step" || continue
        if [ ! -f "$so" ]; then
            echo "== $step NOT RUN: no prebuilt $v library in .fi/prebuilt/"
            continue
        fi
        echo "== $step $(date -u +%FT%TZ)"
        python3 -m gpu.tactics --variant "$v" --prebuilt "$so" --out "$OUTD/smoke" --tp 8 \
            --max-tokens 64 --reps 3 --rounds 1 > "$OUTD/$step-smoke.log" 2>&1 \
            || { echo "== $step smoke FAILED"; tail -20 "$OUTD/$step-smoke.log"; continue; }
        python3 -m gpu.tactics --variant "$v" --prebuilt "$so" --out "$OUTD" --tp 8,2,1 \
            > "$OUTD/$step.log" 2>&1
        echo "== $step exit $? $(tail -1 "$OUTD/$step.log")"
    done
    echo "== pipeline end $(date -u +%FT%TZ)"
    touch "$WORK/done"
}

case "${1:-}" in
    start)
        rm -f "$WORK/done"
        setup || { echo "SETUP FAILED"; exit 1; }
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
        nvcc --version | tail -1
        setsid nohup bash "$0" pipeline > "$LOG" 2>&1 < /dev/null &
        sleep 10
        tail -5 "$LOG"
        ;;
    pipeline)
        pipeline
        ;;
    wait)
        deadline=$((SECONDS + ${2:-540}))
        while [ ! -f "$WORK/done" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
        echo "== done: $([ -f "$WORK/done" ] && echo yes || echo no) $(date -u +%FT%TZ)"
        grep -v "Warning\|warn(" "$LOG" | tail -30
        for p in build16 build8; do
            [ -f "$OUTD/mem-$p.tsv" ] && echo "$p: memory peak so far $(peak "$p") GiB," \
                "$(find "$WORK/fiws-$p" -name '*.o' 2>/dev/null | wc -l) objects"
        done
        if [ -n "${OUT:-}" ]; then
            tar -czf "$OUT/coldstart.tgz" -C "$OUTD" . 2>/dev/null
            [ -f "$BUNDLE/manifest.json" ] && cp "$BUNDLE/manifest.json" "$OUT/"
        fi
        ;;
    *)
        echo "usage: $0 start | wait SECONDS" >&2
        exit 2
        ;;
esac
