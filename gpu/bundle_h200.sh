#!/usr/bin/env bash
# The kernel bundle on an H200, end to end: `prebuild --out` from an empty cache (derived
# sources in the plugin's cache, none in FlashInfer's folder), the start-up check timed both
# ways (recipe key, full regeneration), and one MoE forward whose module is loaded from the
# descriptor the check hashed (gpu.coldstart_probe through KIMI_W31_KERNELS).
#
#   gpu/bundle_h200.sh        (inputs: .fi/ as for gpu/coldstart_h200.sh; results in $OUT)
set -uo pipefail

WORK=${KIMI_W31_WORK:-/root/kimi-w31-bundle}
SITE=$WORK/site
PKG=$WORK/pkg
BUNDLE=$WORK/bundle
OUTD=${OUT:-$WORK/out}
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a XDG_CACHE_HOME=$WORK/xdg
export PYTHONPATH=$SITE:$PKG:$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$SITE" "$OUTD"

if [ ! -f "$SITE/.installed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" .fi/apache_tvm_ffi-*cp312*.whl || exit 1
    tar -xJf .fi/flashinfer-0.7.2.post1-sm90moe.tar.xz -C "$SITE" || exit 1
    touch "$SITE/.installed"
fi
rm -rf "$PKG" && mkdir -p "$PKG" && cp -r kimi_w31 "$PKG"/ || exit 1
for d in converter adapter manifests; do cp -r "$d" "$PKG/kimi_w31/$d" || exit 1; done

echo "== build $(date -u +%FT%TZ) cores $(nproc)"
rm -rf "$BUNDLE" "$WORK/fiws" "$XDG_CACHE_HOME"
FLASHINFER_WORKSPACE_BASE=$WORK/fiws python3 - "$BUNDLE" <<'EOF' 2>&1 | tail -5
import sys, time
from pathlib import Path
from kimi_w31.adapter.prebuild import prebuild
t0 = time.time()
r = prebuild(lambda p: None, arch="sm90", variants=["w4a16"], out=Path(sys.argv[1]), poll_s=10)
print(f"prebuild w4a16: {r.modules[0].sources} units, {time.time() - t0:.0f} s, {r.bundle}")
EOF
echo "== ours in FlashInfer's folders: $(find "$SITE/flashinfer" "$WORK/fiws" -name '*kimi_w31*' | wc -l)"
echo "== ours in the plugin's cache: $(find "$XDG_CACHE_HOME" -type f | wc -l) files"
ls -la "$BUNDLE" && cat "$BUNDLE/manifest.json"

echo "== start-up check of the bundle (fresh FlashInfer workspace per run)"
python3 tools/bundle_check_cost.py --variant w4a16 --runs 5 --bundle "$BUNDLE" 2>&1 | tail -4
python3 tools/bundle_check_cost.py --variant w4a16 --runs 5 2>&1 | tail -4

echo "== probe: first MoE forward, module from the bundle"
KIMI_W31_KERNELS=$BUNDLE FLASHINFER_WORKSPACE_BASE=$WORK/fiws-serve \
    python3 -m gpu.coldstart_probe --t0 "$(date +%s.%N)" --out "$OUTD/probe-bundle.json" \
    > "$OUTD/probe-bundle.log" 2>&1
echo "== probe rc $?: $(tail -2 "$OUTD/probe-bundle.log")"
