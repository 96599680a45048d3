#!/usr/bin/env bash
# The race (gpu/race.py) on a bare, offline H200 machine: SGLang's Marlin route on the
# unconverted checkpoint against the plugin's W4A16 and W4A8 paths, per rank of EP16 and
# TP16/EP2, M = 1 ... 8192.
#
#   gpu/race_h200.sh start [SECONDS]  install, start the pipeline detached, wait up to SECONDS
#   gpu/race_h200.sh wait SECONDS     wait up to SECONDS, print the log tail, copy reports to $OUT;
#                                     exits 0 only when the race finished without errors
#
# The pipeline: `kimi-convert prebuild --out BUNDLE` (the plugin's W4A16 module, built here,
# in the background), `kimi-convert synth` + `kimi-convert` for each layout's rank (its
# experts only; no checkpoint travels), then `python3 -m gpu.race`, which starts with the
# Marlin arm and waits for the bundle before the W4A16 one.
#
# Inputs beside the repo (git-ignored, sent with `carry`; gpu/README.md says how to make them):
#   .fi/flashinfer-0.7.2.post1-sm90moe.tar.xz, .fi/apache_tvm_ffi-*.whl     gpu/pack_flashinfer.sh
#   .fi/prebuilt/fused_moe_90_kimi_w31_w4a8_humming.so.xz                   the W4A8 module
#   .whl/sglang-0.5.23-trim.tar.xz, .whl/*.whl, .whl/sgl_kernel-0.4.6-slim.tar.xz   gpu/pack_sglang.sh
# Environment: KIMI_W31_RACE_ARGS (extra gpu.race arguments, e.g. "--ms 1,8,64 --rounds 3"),
# KIMI_W31_W4A16_SO (a W4A16 library to load instead of building the bundle).
set -uo pipefail

WORK=${KIMI_W31_WORK:-/root/kimi-w31-race}
SITE=$WORK/site
PKG=$WORK/pkg
REPO=$WORK/repo
OUTD=$WORK/out
LOG=$OUTD/pipeline.log
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=$WORK/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1  # sgl_kernel 0.4.6: the one torch 2.11 loads
export PYTHONPATH=$SITE:$PKG:$REPO${PYTHONPATH:+:$PYTHONPATH}
kimi_convert() { python3 -m kimi_w31 "$@"; }

# shellcheck source=gpu/stack.sh
. "$(dirname "$0")/stack.sh"

setup() {
    install_stack || return 1
    xz -dc .fi/prebuilt/fused_moe_90_kimi_w31_w4a8_humming.so.xz > "$WORK/w4a8.so" || return 1
    lay_out_project
}

# Each layout's rank as a checkpoint of its own experts: EP16 rank 0 holds 56 experts at
# full N; a TP16/EP2 rank holds 448 experts at N 3072 / 8 (its moe-TP slice).
checkpoints() {
    local ck=$WORK/ck
    rm -rf "$ck" && mkdir -p "$ck" || return 1
    kimi_convert synth "$ck/ep16/src" --layers 1 --experts 56 --top-k 16 --real-dims \
        && kimi_convert "$ck/ep16/src" "$ck/ep16/conv" --manifest kimi-k3-any -q \
        && kimi_convert synth "$ck/moetp8/src" --layers 1 --experts 448 --top-k 16 --real-dims \
            --n 384 \
        && kimi_convert "$ck/moetp8/src" "$ck/moetp8/conv" --manifest kimi-k3-any -q
}

pipeline() {
    cd "$WORK" || exit 1
    echo "== pipeline start $(date -u +%FT%TZ)"
    local extra=() rc
    if [ -n "${KIMI_W31_W4A16_SO:-}" ]; then
        extra=(--w4a16-so "$KIMI_W31_W4A16_SO")
    else
        # The product's bundle, built here (nice: the race's Marlin arm runs meanwhile).
        (
            nice -n 5 python3 -m kimi_w31 prebuild --arch sm90 \
                --out "$WORK/bundle" --progress lines > "$OUTD/prebuild.log" 2>&1
            echo $? > "$WORK/bundle.rc"
        ) &
        export KIMI_W31_KERNELS=$WORK/bundle
        extra=(--wait-for "$WORK/bundle.rc")
    fi
    local t0=$SECONDS
    checkpoints > "$OUTD/checkpoints.log" 2>&1
    rc=$?
    echo "== checkpoints exit $rc in $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || { tail -20 "$OUTD/checkpoints.log"; echo "race 1" > "$WORK/done"; exit 1; }
    du -sh "$WORK"/ck/*/* | sed 's/^/   /'
    # shellcheck disable=SC2086  # KIMI_W31_RACE_ARGS is a list of words on purpose
    (cd "$WORK" && python3 -m gpu.race --root "$WORK/ck" --out "$OUTD" \
        --w4a8-so "$WORK/w4a8.so" "${extra[@]}" ${KIMI_W31_RACE_ARGS:-})
    rc=$?
    echo "== race exit $rc $(date -u +%FT%TZ)"
    wait
    echo "race $rc" > "$WORK/done"
}

collect() {
    [ -n "${OUT:-}" ] || return 0
    cp "$OUTD"/report-race.json "$OUTD"/report-race.md "$OUT"/ 2>/dev/null
    tail -c 4000000 "$OUTD/race.log" > "$OUT/race.log" 2>/dev/null
    cat "$LOG" "$OUTD/checkpoints.log" > "$OUT/pipeline.log" 2>/dev/null
    tail -c 2000000 "$OUTD/prebuild.log" > "$OUT/prebuild.log" 2>/dev/null
    cp "$WORK/bundle/manifest.json" "$OUT/bundle-manifest.json" 2>/dev/null
}

wait_done() {
    local deadline=$((SECONDS + ${1:-540})) finished=no
    while [ ! -f "$WORK/done" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
    [ -f "$WORK/done" ] && finished=yes
    echo "== finished: $finished $(cat "$WORK/done" 2>/dev/null)"
    grep -v "Warning\|warn(" "$LOG" | tail -15
    grep -v "Warning\|warn(" "$OUTD/race.log" 2>/dev/null | cut -c1-400 | tail -25
    tail -2 "$OUTD/prebuild.log" 2>/dev/null
    collect
    [ "$finished" = yes ] && [ "$(cat "$WORK/done")" = "race 0" ]
}

case "${1:-}" in
    start)
        rm -f "$WORK/done" "$WORK/bundle.rc"
        t=$SECONDS
        setup || { echo "SETUP FAILED"; exit 1; }
        echo "== setup $((SECONDS - t)) s"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        setsid nohup bash "$0" pipeline > "$LOG" 2>&1 < /dev/null &
        wait_done "${2:-30}"
        ;;
    pipeline)
        pipeline
        ;;
    wait)
        wait_done "${2:-540}"
        ;;
    *)
        echo "usage: $0 start [SECONDS] | wait SECONDS" >&2
        exit 2
        ;;
esac
