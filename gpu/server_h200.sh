#!/usr/bin/env bash
# The real server on one bare, offline H200: `kimi-convert serve --kernels` on a converted
# whole model against stock SGLang's Marlin route on the same weights unconverted, each with
# CUDA graphs and eager, then the same requests to all four (gpu/server_compare.py).
#
#   gpu/server_h200.sh start [SECONDS]  install, start the pipeline detached, wait up to SECONDS
#   gpu/server_h200.sh wait SECONDS     wait up to SECONDS, print the log tails, copy reports
#                                       to $OUT; exits 0 only when the comparison passed
#
# The pipeline: `kimi-convert synth` (every Kimi-K3 layer kind, the published per-expert
# widths, peaked logits), `kimi-convert` and `kimi-convert verify --checksums --source`;
# `kimi-convert prebuild --out BUNDLE` in the background from the start; the Marlin servers
# (stock `python3 -m sglang.launch_server --moe-runner-backend marlin`, without the plugin on
# the path), then, once the bundle is built, the plugin's, launched as the README says:
#   kimi-convert serve CONV --kernels BUNDLE --text-only -- FLAGS
# One server starts at a time, the next when it answers /health or is gone: SGLang sizes its
# caches from the memory free while it starts, so servers starting together misjudge it (the
# first run's plugin-eager server computed -4.13 GB left). Each gets KIMI_W31_SERVER_MEM of the
# GPU's memory; the comparison times one server at a time. The Marlin route's first request
# builds SGLang's `moe_wna16_marlin` JIT module with ninja (more than 120 s on this machine
# beside the plugin's prebuild), so SGLang's watchdog gets 900 s; a server stuck longer is
# stopped by it, with its stacks dumped by py-spy (carried in .whl/).
# Inputs: gpu/stack.sh. Environment: KIMI_W31_SERVER_MODEL (synth arguments),
# KIMI_W31_SERVER_MODES ("graph eager"), KIMI_W31_COMPARE_ARGS (gpu.server_compare arguments).
set -uo pipefail

WORK=${KIMI_W31_WORK:-/root/kimi-w31-server}
SITE=$WORK/site
PKG=$WORK/pkg
REPO=$WORK/repo
OUTD=$WORK/out
LOG=$OUTD/pipeline.log
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=$WORK/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1  # sgl_kernel 0.4.6: the one torch 2.11 loads
export PATH=$SITE/bin:$PATH  # py-spy, for the watchdog's stack dumps
# shellcheck source=gpu/stack.sh
. "$(dirname "$0")/stack.sh"

MODEL_ARGS=${KIMI_W31_SERVER_MODEL:---layers 4 --experts 128 --top-k 16 --real-dims --peak 8}
MODES=${KIMI_W31_SERVER_MODES:-graph eager}
READY_S=${KIMI_W31_SERVER_READY_S:-900}
# What every server gets (the Marlin route and the plugin alike): the Triton attention
# backend (FA3's library is not carried), token ids in and out, a quarter of the GPU each.
COMMON=(--attention-backend triton --sampling-backend pytorch --skip-tokenizer-init
    --trust-remote-code --mem-fraction-static "${KIMI_W31_SERVER_MEM:-0.22}" --context-length 1024
    --max-running-requests 32 --watchdog-timeout 900
    --json-model-override-args '{"language_model_only": true}')
GRAPH=(--cuda-graph-bs-decode 1 2 4 8 16 32)
EAGER=(--disable-cuda-graph)

setup() {
    install_stack && lay_out_project
}

with_plugin() { PYTHONPATH=$SITE:$PKG:$REPO "$@"; }
stock() { PYTHONPATH=$SITE:$REPO "$@"; }  # no kimi_w31 on the path: SGLang as shipped

model() {
    local ck=$WORK/ck
    rm -rf "$ck" && mkdir -p "$ck" || return 1
    # shellcheck disable=SC2086  # MODEL_ARGS is a list of words on purpose
    with_plugin python3 -m kimi_w31 synth "$ck/src" $MODEL_ARGS \
        && with_plugin python3 -m kimi_w31 "$ck/src" "$ck/conv" --manifest kimi-k3-any -q \
        && with_plugin python3 -m kimi_w31 verify "$ck/conv" --checksums --source "$ck/src" -q
}

# launch NAME PORT ROUTE MODE: one server, detached, its log in $OUTD/server-NAME.log.
launch() {
    local name=$1 port=$2 route=$3 mode=$4 flags
    if [ "$mode" = graph ]; then flags=("${GRAPH[@]}"); else flags=("${EAGER[@]}"); fi
    date +%s.%N > "$OUTD/server-$name.started"
    if [ "$route" = marlin ]; then
        stock setsid nohup python3 -m sglang.launch_server --model-path "$WORK/ck/src" \
            --moe-runner-backend marlin --port "$port" "${COMMON[@]}" "${flags[@]}" \
            > "$OUTD/server-$name.log" 2>&1 < /dev/null &
    else
        with_plugin setsid nohup python3 -m kimi_w31 serve "$WORK/ck/conv" \
            --kernels "$WORK/bundle" --text-only -- --port "$port" "${COMMON[@]}" \
            "${flags[@]}" > "$OUTD/server-$name.log" 2>&1 < /dev/null &
    fi
    echo "$!" > "$OUTD/server-$name.pid"
}

# settle NAME PORT: wait until the server answers /health, exits, or READY_S pass.
settle() {
    local name=$1 port=$2 t0=$SECONDS
    while [ $((SECONDS - t0)) -lt "$READY_S" ]; do
        python3 - "$port" <<'PY' && { echo "== $name healthy after $((SECONDS - t0)) s"; return 0; }
import sys, urllib.request
try:
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=5)
except Exception:
    sys.exit(1)
PY
        kill -0 "$(cat "$OUTD/server-$name.pid")" 2>/dev/null \
            || { echo "== $name exited after $((SECONDS - t0)) s"; return 1; }
        sleep 3
    done
    echo "== $name not healthy after $READY_S s"
    return 1
}

pipeline() {
    cd "$WORK" || exit 1
    echo "== pipeline start $(date -u +%FT%TZ)"
    local t0=$SECONDS rc
    (
        with_plugin nice -n 5 python3 -m kimi_w31 prebuild --arch sm90 \
            --out "$WORK/bundle" --progress lines > "$OUTD/prebuild.log" 2>&1
        echo $? > "$WORK/bundle.rc"
    ) &
    model > "$OUTD/model.log" 2>&1
    rc=$?
    echo "== model exit $rc in $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || { tail -20 "$OUTD/model.log"; echo "server 1" > "$WORK/done"; exit 1; }
    du -sh "$WORK"/ck/* | sed 's/^/   /'
    local servers=() port=30001 mode
    for mode in $MODES; do
        launch "marlin-$mode" $port marlin "$mode"
        settle "marlin-$mode" $port
        servers+=(--server "marlin-$mode=$port")
        port=$((port + 1))
    done
    while [ ! -f "$WORK/bundle.rc" ]; do sleep 2; done
    echo "== prebuild exit $(cat "$WORK/bundle.rc") after $((SECONDS - t0)) s"
    for mode in $MODES; do
        launch "plugin-$mode" $port plugin "$mode"
        settle "plugin-$mode" $port
        servers+=(--server "plugin-$mode=$port")
        port=$((port + 1))
    done
    # shellcheck disable=SC2086  # KIMI_W31_COMPARE_ARGS is a list of words on purpose
    (cd "$REPO" && with_plugin python3 -m gpu.server_compare --out "$OUTD" "${servers[@]}" \
        --model "$WORK/ck/src" ${KIMI_W31_COMPARE_ARGS:-})
    rc=$?
    echo "== compare exit $rc $(date -u +%FT%TZ)"
    echo "server $rc" > "$WORK/done"
}

collect() {
    [ -n "${OUT:-}" ] || return 0
    cp "$OUTD"/report-server.json "$OUTD"/report-server.md "$OUT"/ 2>/dev/null
    for f in "$OUTD"/server-*.log "$OUTD"/prebuild.log "$OUTD"/model.log; do
        [ -f "$f" ] && tail -c 3000000 "$f" > "$OUT/$(basename "$f")"
    done
    cp "$LOG" "$OUT/pipeline.log" 2>/dev/null
    cp "$WORK/bundle/manifest.json" "$OUT/bundle-manifest.json" 2>/dev/null
}

stop_servers() {
    for p in "$OUTD"/server-*.pid; do
        [ -f "$p" ] && kill -- -"$(cat "$p")" 2>/dev/null
    done
}

wait_done() {
    local deadline=$((SECONDS + ${1:-540})) finished=no
    while [ ! -f "$WORK/done" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
    [ -f "$WORK/done" ] && finished=yes
    echo "== finished: $finished $(cat "$WORK/done" 2>/dev/null)"
    grep -v "Warning\|warn(" "$LOG" | cut -c1-300 | tail -30
    for f in "$OUTD"/server-*.log; do
        [ -f "$f" ] && { echo "-- $(basename "$f")"; grep -v "Warning\|warn(" "$f" | cut -c1-300 | tail -4; }
    done
    tail -2 "$OUTD/prebuild.log" 2>/dev/null
    collect
    [ "$finished" = yes ] && stop_servers
    [ "$finished" = yes ] && [ "$(cat "$WORK/done")" = "server 0" ]
}

case "${1:-}" in
    start)
        rm -f "$WORK/done" "$WORK/bundle.rc"
        t=$SECONDS
        setup || { echo "SETUP FAILED"; exit 1; }
        echo "== setup $((SECONDS - t)) s"
        mkdir -p "$OUTD"
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
    stop)
        stop_servers
        ;;
    *)
        echo "usage: $0 start [SECONDS] | wait SECONDS | stop" >&2
        exit 2
        ;;
esac
