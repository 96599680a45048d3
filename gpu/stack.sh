# Sourced by the device scripts (gpu/race_h200.sh, gpu/server_h200.sh): the offline server
# stack unpacked into $SITE, and the project laid out in $PKG as `pip install .` would
# (with the plugin's entry point, so SGLang's load_plugins() finds it) and in $REPO (gpu/).
# Inputs beside the repo (git-ignored, sent with `carry`; gpu/README.md says how to make them):
#   .fi/flashinfer-0.7.2.post1-sm90moe.tar.xz, .fi/apache_tvm_ffi-*.whl     gpu/pack_flashinfer.sh
#   .whl/sglang-0.5.23-trim.tar.xz, .whl/*.whl, .whl/sgl_kernel-0.4.6-slim.tar.xz   gpu/pack_sglang.sh

# install_stack: unpack the wheels and tarballs into $SITE, again only when they changed.
install_stack() {
    mkdir -p "$SITE" || return 1
    local want
    want=$(ls -l .whl .fi .fi/prebuilt 2>/dev/null | md5sum | cut -c1-16)
    [ "$(cat "$SITE/.installed" 2>/dev/null)" = "$want" ] && return 0
    rm -rf "$SITE" && mkdir -p "$SITE" || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl .fi/apache_tvm_ffi-*cp312*.whl || return 1
    tar -xJf .whl/sglang-0.5.23-trim.tar.xz -C "$SITE" || return 1
    tar -xJf .whl/sgl_kernel-0.4.6-slim.tar.xz -C "$SITE" || return 1
    tar -xJf .fi/flashinfer-0.7.2.post1-sm90moe.tar.xz -C "$SITE" || return 1
    echo "$want" > "$SITE/.installed"
}

# lay_out_project: the installed layout of pyproject.toml in $PKG, gpu/ in $REPO.
lay_out_project() {
    rm -rf "$PKG" "$REPO" && mkdir -p "$PKG/kimi_w31-0.1.0.dist-info" "$REPO" || return 1
    cp -r kimi_w31 "$PKG"/ && cp -r gpu "$REPO"/ || return 1
    for d in converter adapter manifests; do cp -r "$d" "$PKG/kimi_w31/$d" || return 1; done
    printf 'Metadata-Version: 2.1\nName: kimi-w31\nVersion: 0.1.0\n' \
        > "$PKG/kimi_w31-0.1.0.dist-info/METADATA"
    printf '[sglang.srt.plugins]\nkimi_w31 = kimi_w31.adapter.sglang.plugin:register\n' \
        > "$PKG/kimi_w31-0.1.0.dist-info/entry_points.txt"
}
