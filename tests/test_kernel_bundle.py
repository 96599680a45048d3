"""Kernel bundles (adapter/bundle.py): the manifest round trip, and every reason a serving
node refuses a bundle, by code, one field at a time. No torch, no FlashInfer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.adapter import bundle as B
from kimi_w31.converter.errors import Code

STACK = B.Stack(arch="sm90", flashinfer="0.7.2.post1", cuda="13.0", torch="2.11.0", python="3.12")
SOURCE_HASH = "5e" * 32


def write_bundle(root: Path, stack: B.Stack = STACK, variants=("w4a16",)) -> Path:
    """A bundle as `prebuild --out` writes it (library bytes are arbitrary here)."""
    root.mkdir(parents=True, exist_ok=True)
    modules = []
    for v in variants:
        lib = root / f"fused_moe_90_kimi_w31_{v}.so"
        lib.write_bytes(b"\x7fELF" + v.encode() * 100)
        modules.append(
            B.Module(v, lib.stem, lib.name, B.sha256_file(lib), lib.stat().st_size, SOURCE_HASH, 60)
        )
    B.write(root, B.Manifest(stack, tuple(modules), "0.1.0", "2026-12-01T00:00:00+00:00"))
    return root


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)


@given(
    stack=st.builds(B.Stack, _text, _text, _text, _text, _text),
    modules=st.lists(
        st.builds(
            B.Module,
            variant=_text,
            name=_text,
            file=st.from_regex(r"[A-Za-z0-9_]{1,20}\.so", fullmatch=True),
            sha256=_text,
            size=st.integers(0, 2**40),
            source_hash=_text,
            units=st.integers(0, 10**4),
            build_seconds=st.one_of(st.none(), st.floats(0, 1e6, allow_nan=False)),
        ),
        max_size=4,
    ),
    build=st.dictionaries(_text, st.integers(), max_size=3),
)
def test_manifest_round_trip(stack, modules, build) -> None:
    m = B.Manifest(stack, tuple(modules), "0.1.0", "2026-12-01T00:00:00+00:00", build)
    assert B.Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        "{}",
        json.dumps({"format": "kimi-w31-kernels/0"}),
        # a field missing, a module file that is a path, a module that is not a record
        json.dumps({"format": B.FORMAT, "stack": {}, "modules": []}),
        json.dumps(
            {
                "format": B.FORMAT,
                "stack": dataclasses.asdict(STACK),
                "modules": [{"file": "../x.so"}],
                "kimi_w31": "0.1.0",
                "created_utc": "",
            }
        ),
    ],
)
def test_a_bad_manifest_is_invalid(tmp_path, text) -> None:
    root = write_bundle(tmp_path / "b")
    (root / B.MANIFEST).write_text(text)
    with pytest.raises(B.BundleError) as err:
        B.check(root, "w4a16", STACK, SOURCE_HASH)
    assert err.value.codes == [Code.KERNEL_BUNDLE_INVALID]


def test_a_path_as_module_file_is_invalid(tmp_path) -> None:
    root = write_bundle(tmp_path / "b")
    data = json.loads((root / B.MANIFEST).read_text())
    data["modules"][0]["file"] = "../../elsewhere.so"
    (root / B.MANIFEST).write_text(json.dumps(data))
    with pytest.raises(B.BundleError) as err:
        B.check(root, "w4a16", STACK, SOURCE_HASH)
    assert err.value.codes == [Code.KERNEL_BUNDLE_INVALID]


def test_no_manifest_is_invalid(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(B.BundleError) as err:
        B.check(tmp_path / "empty", "w4a16", STACK, SOURCE_HASH)
    assert err.value.codes == [Code.KERNEL_BUNDLE_INVALID]


def test_a_matching_bundle_gives_its_library(tmp_path) -> None:
    root = write_bundle(tmp_path / "b", variants=("w4a16", "w4a8"))
    for v in ("w4a16", "w4a8"):
        manifest, lib = B.check(root, v, STACK, SOURCE_HASH)
        assert lib == root / f"fused_moe_90_kimi_w31_{v}.so" and manifest.stack == STACK
    assert B.check(root, "w4a16", STACK, None)[1].exists()  # hash unknown: not checked


FIELD_CODES = {
    "arch": Code.KERNEL_BUNDLE_ARCH,
    "flashinfer": Code.KERNEL_BUNDLE_FLASHINFER,
    "cuda": Code.KERNEL_BUNDLE_CUDA,
    "torch": Code.KERNEL_BUNDLE_TORCH,
    "python": Code.KERNEL_BUNDLE_PYTHON,
}


def test_every_stack_field_has_its_code() -> None:
    assert set(FIELD_CODES) == set(B.STACK_FIELDS) == {f.name for f in dataclasses.fields(B.Stack)}


@pytest.mark.parametrize("name", sorted(FIELD_CODES))
def test_each_stack_mismatch_is_refused_by_its_code(tmp_path, name) -> None:
    root = write_bundle(tmp_path / "b")
    running = dataclasses.replace(STACK, **{name: getattr(STACK, name) + "-other"})
    with pytest.raises(B.BundleError) as err:
        B.check(root, "w4a16", running, SOURCE_HASH)
    assert err.value.codes == [FIELD_CODES[name]]
    (problem,) = err.value.problems
    assert (problem.expected, problem.found) == (getattr(running, name), getattr(STACK, name))


@given(st.sets(st.sampled_from(sorted(FIELD_CODES))))
def test_every_differing_field_is_named_once(names) -> None:
    manifest = B.Manifest(STACK, (), "0.1.0", "")
    running = dataclasses.replace(STACK, **{n: getattr(STACK, n) + "x" for n in names})
    codes = [p.code for p in B.stack_problems(manifest, running)]
    assert sorted(codes) == sorted(FIELD_CODES[n] for n in names)


def test_a_missing_module_is_refused(tmp_path) -> None:
    root = write_bundle(tmp_path / "b", variants=("w4a16",))
    with pytest.raises(B.BundleError) as err:
        B.check(root, "w4a8", STACK, SOURCE_HASH)
    assert err.value.codes == [Code.KERNEL_BUNDLE_NO_MODULE]


def test_other_sources_or_flags_are_refused(tmp_path) -> None:
    root = write_bundle(tmp_path / "b")
    with pytest.raises(B.BundleError) as err:
        B.check(root, "w4a16", STACK, "00" * 32)
    assert err.value.codes == [Code.KERNEL_BUNDLE_SOURCES]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_library_is_refused(tmp_path, damage) -> None:
    root = write_bundle(tmp_path / "b")
    lib = root / "fused_moe_90_kimi_w31_w4a16.so"
    data = lib.read_bytes()
    if damage == "flip":
        lib.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "truncate":
        lib.write_bytes(data[:-1])
    else:
        lib.unlink()
    with pytest.raises(B.BundleError) as err:
        B.check(root, "w4a16", STACK, SOURCE_HASH)
    assert err.value.codes == [Code.KERNEL_BUNDLE_LIBRARY]


def test_a_stack_mismatch_is_refused_before_the_library_is_read(tmp_path) -> None:
    root = write_bundle(tmp_path / "b")
    (root / "fused_moe_90_kimi_w31_w4a16.so").unlink()
    running = dataclasses.replace(STACK, torch="2.12.0")
    with pytest.raises(B.BundleError) as err:
        B.check(root, "w4a16", running, SOURCE_HASH)
    assert err.value.codes == [Code.KERNEL_BUNDLE_TORCH]


def test_the_plugin_refuses_a_mismatched_bundle_and_loads_nothing(tmp_path, monkeypatch) -> None:
    """kernels.ensure with KIMI_W31_KERNELS: the refusal reaches the caller, nothing installs."""
    from kimi_w31.adapter import kernels as K

    root = write_bundle(tmp_path / "b")
    monkeypatch.setenv(K.ENV_BUNDLE, str(root))
    monkeypatch.setattr(B, "current_stack", lambda arch: dataclasses.replace(STACK, cuda="12.8"))
    monkeypatch.setattr(K, "recipe", lambda v, **_: v)
    monkeypatch.setattr(K, "jit_spec", lambda rec, write=True: None)
    monkeypatch.setattr(K, "source_hash", lambda rec, spec: SOURCE_HASH)
    installed = []
    monkeypatch.setattr(K, "install", lambda v, lib=None: installed.append((v, lib)))
    monkeypatch.setattr(K, "_installed", {})
    with pytest.raises(B.BundleError) as err:
        K.ensure("sm90")
    assert err.value.codes == [Code.KERNEL_BUNDLE_CUDA] and installed == []
    monkeypatch.setattr(B, "current_stack", lambda arch: STACK)
    assert K.ensure("sm90") is K.W4A16
    assert installed == [(K.W4A16, root / "fused_moe_90_kimi_w31_w4a16.so")]


def test_serve_points_every_process_at_the_bundle(tmp_path) -> None:
    """`serve --kernels DIR` sets KIMI_W31_KERNELS for the server; a directory without a
    valid manifest is refused before anything starts."""
    from cli_helpers import run_cli
    from kimi_w31.adapter.kernels import ENV_BUNDLE

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = {"hidden_act": "situ", "moe_intermediate_size": 3072}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    bundle = write_bundle(tmp_path / "kernels")
    base = ["serve", str(ckpt), "--unconverted", "--skip-checks", "--print"]
    ok = run_cli([*base, "--kernels", str(bundle)], inprocess=True)
    assert ok.returncode == 0, ok.output
    assert f"{ENV_BUNDLE}={bundle.resolve()}" in ok.output
    (bundle / B.MANIFEST).write_text("{}")
    bad = run_cli([*base, "--kernels", str(bundle)], inprocess=True)
    assert bad.returncode == 1 and Code.KERNEL_BUNDLE_INVALID.value in bad.output


def test_a_bundle_does_not_skip_the_checks_of_a_converted_checkpoint(tmp_path, monkeypatch):
    """--kernels adds a variable for the server; the structure verify still runs first."""
    from cli_helpers import run_cli
    from kimi_w31.adapter.sglang import launch
    from test_adapter_launch import ckpt

    verified = []
    monkeypatch.setattr(launch, "check_stack", lambda: [])
    monkeypatch.setattr(
        launch, "verify_structure", lambda root: verified.append(root) or ["index: missing"]
    )
    bundle = write_bundle(tmp_path / "kernels")
    args = [str(ckpt(tmp_path)), "--print", "--kernels", str(bundle)]
    refused = run_cli(args, inprocess=True, command=launch.serve)
    assert refused.returncode == 1 and "verify: index" in refused.output and verified
    monkeypatch.setattr(launch, "verify_structure", lambda root: [])
    ok = run_cli(args, inprocess=True, command=launch.serve)
    assert ok.returncode == 0, ok.output
    assert "KIMI_W31_KERNELS=" in ok.output


def _fake_core(monkeypatch):
    import functools
    import sys
    import types

    core = types.ModuleType("flashinfer.fused_moe.core")
    stock = {
        "gen_cutlass_fused_moe_sm90_module": lambda fast=False: "stock-90",
        "gen_cutlass_fused_moe_sm120_module": lambda fast=False: "stock-120",
        "gen_cutlass_fused_moe_sm100_module": lambda fast=False: "stock-100",
    }
    for name, fn in stock.items():
        setattr(core, name, fn)

    @functools.cache
    def get_cutlass_fused_moe_module(backend="100"):
        gen = {"90": "sm90", "120": "sm120", "100": "sm100"}[backend]
        return getattr(core, f"gen_cutlass_fused_moe_{gen}_module")(False)

    core.get_cutlass_fused_moe_module = get_cutlass_fused_moe_module
    fused = types.ModuleType("flashinfer.fused_moe")
    fused.core = core
    root = types.ModuleType("flashinfer")
    root.fused_moe = fused
    for mod in (root, fused, core):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return core, stock


def test_install_routes_only_the_served_architectures_module(tmp_path, monkeypatch) -> None:
    """The plugin replaces FlashInfer's fused-MoE generator of its own architecture only, and
    drops FlashInfer's cached module so the next lookup loads the plugin's."""
    from kimi_w31.adapter import kernels as K

    core, stock = _fake_core(monkeypatch)
    monkeypatch.setattr(K, "_installed", {})
    monkeypatch.delenv(K.ENV_BUNDLE, raising=False)
    assert core.get_cutlass_fused_moe_module("90") == "stock-90"  # cached before install
    lib = tmp_path / "m.so"
    K.install(K.W4A16, lib)
    spec = core.gen_cutlass_fused_moe_sm90_module(False)
    assert isinstance(spec, K._Library) and spec.library == lib
    assert isinstance(core.get_cutlass_fused_moe_module("90"), K._Library)  # cache dropped
    # SGLang's other FlashInfer MoE uses keep FlashInfer's own modules
    assert core.gen_cutlass_fused_moe_sm120_module is stock["gen_cutlass_fused_moe_sm120_module"]
    assert core.get_cutlass_fused_moe_module("100") == "stock-100"
    assert K.ensure("sm90") is K.W4A16 and K._installed["sm90"] == ("w4a16", lib)  # kept


def test_without_the_hook_point_flashinfer_keeps_its_module(monkeypatch, caplog) -> None:
    import sys
    import types

    from kimi_w31.adapter import flashinfer_moe as fm
    from kimi_w31.adapter import kernels as K

    fused = types.ModuleType("flashinfer.fused_moe")  # no .core: a layout we do not know
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", fused)
    monkeypatch.setattr(K, "_installed", {})
    with caplog.at_level("WARNING", logger="kimi_w31.adapter"):
        fm.use_plugin_kernels("sm90")
    assert K._installed == {} and "whole module" in caplog.text
