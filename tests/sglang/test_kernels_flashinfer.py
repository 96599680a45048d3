"""The plugin's FlashInfer modules against FlashInfer's real generator (flashinfer-python
0.7.2.post1 in the SGLang test environment; no GPU, nothing compiled): what each module
compiles, how the heavy units are split, the source hash, and `prebuild --arch` off-GPU in
a fresh process. Each check runs in its own interpreter: FlashInfer fixes its target
architecture when it is imported."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang
K_SPLIT = "kimi_w31_split"

_FACTS = """
import json, re, sys
from pathlib import Path
from kimi_w31.adapter import kernels as K
from flashinfer.jit import env as e

_INST = re.compile(r"^template\\s[^;]*;", re.M)
out = {}
for key in ("w4a16", "w4a16-all", "w4a8"):
    v = K.VARIANTS[key]
    name, stock, _ = K.stock_recipe(v.generator)
    rec = K.recipe(v)
    spec = K.jit_spec(rec, write=True)  # the derived files written where the plugin puts them
    gen = [p for p in stock if p.name.endswith(".generated.cu")]
    kept = [p for p in gen if v.trim.kernel_marker in p.read_text()]
    others = {o.trim.kernel_marker for o in K.VARIANTS.values()
              if o.trim and o.trim.kernel_marker != v.trim.kernel_marker}
    kernel_units = [u for u in rec.units if "gemm_grouped" in u.path.parent.parent.name
                    and "unbuilt" not in u.path.name]
    unbuilt = [u for u in rec.units if "unbuilt" in u.path.name]
    text = lambda u: u.text if u.text is not None else u.path.read_text()
    # write our split parts (they live in the tmp workspace) and ask FlashInfer again
    for u in kernel_units:
        if u.text is not None:
            u.path.parent.mkdir(parents=True, exist_ok=True)
            u.path.write_text(u.text)
    _, stock_after, _ = K.stock_recipe(v.generator)
    out[key] = {
        "stock_name": name,
        "stock_sources": len(stock),
        "units": [str(u.path) for u in rec.units],
        "derived": [str(u.path) for u in rec.units if u.text is not None],
        "stock": [str(p) for p in stock],
        "weights": [u.weight for u in rec.units],
        "kernel_weights": [u.weight for u in kernel_units],
        "want_instances": sorted(x for p in kept for x in _INST.findall(p.read_text())),
        "got_instances": sorted(x for u in kernel_units for x in _INST.findall(text(u))),
        "unbuilt": [u.text for u in unbuilt],
        "foreign": [str(u.path) for u in rec.units if any(m in text(u) for m in others)
                    and u.path.name.endswith(".cu") and "gemm_grouped" in str(u.path)],
        "stock_after_has_parts": any(K.SPLIT_TAG in p.name for p in stock_after),
        # FlashInfer's generator deletes what it did not write in its own tree: ours survive
        "parts_survive": all(u.path.exists() for u in kernel_units if u.text is not None),
        "derived_root": str(K.derived_root()),
        "flashinfer_dirs": [str(e.FLASHINFER_CSRC_DIR), str(e.FLASHINFER_GEN_SRC_DIR)],
        "ours_in_flashinfer": [str(p) for d in (e.FLASHINFER_CSRC_DIR, e.FLASHINFER_GEN_SRC_DIR)
                               for p in Path(d).rglob("*kimi_w31*")],
        "include_dirs": [str(p) for p in spec.extra_include_dirs or []],
        "hash": K.source_hash(rec, spec),
        "spec_sources": len(spec.sources),
        "cuda_flags": list(spec.extra_cuda_cflags),
    }
print(json.dumps(out))
"""


def _run(code: str, workspace: Path, *args: str, arch_list: str | None = "9.0a"):
    env = {k: v for k, v in os.environ.items() if k != "FLASHINFER_CUDA_ARCH_LIST"}
    env["FLASHINFER_WORKSPACE_BASE"] = str(workspace)
    env["XDG_CACHE_HOME"] = str(workspace / "xdg")  # the plugin's derived sources
    if arch_list:
        env["FLASHINFER_CUDA_ARCH_LIST"] = arch_list
    return subprocess.run(
        [sys.executable, *(["-c", code] if code else []), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    runs = []
    for i in range(2):  # two workspaces: the hash must not depend on where files live
        ws = tmp_path_factory.mktemp(f"fiws{i}")
        out = _run(textwrap.dedent(_FACTS), ws)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append((ws, json.loads(out.stdout.strip().splitlines()[-1])))
    return runs


_TILE = re.compile(r"Shape<cute::Int<(\d+)>, cute::Int<(\d+)>, cute::Int<(\d+)>>")
_KIND = re.compile(r"KernelTmaWarpSpecialized(Cooperative|Pingpong),")
_SINGLE = re.compile(r"SINGLE_WARPGROUP_(PREFILL|ROLLING)")


def _config(instance: str) -> tuple[str, str, str]:
    """(tile, schedule, cluster) of a launcher instantiation, as gpu/tactics.py names them."""
    (m, n, k), (a, b, c) = _TILE.findall(instance)[:2]
    single, kind = _SINGLE.search(instance), _KIND.search(instance)
    assert kind is not None, instance
    schedule = f"sw_{single.group(1).lower()}" if single else kind.group(1).lower()
    return f"{m}x{n}x{k}", schedule, f"{a}x{b}x{c}"


@pytest.mark.parametrize("key", ["w4a16", "w4a16-all", "w4a8"])
def test_each_module_compiles_exactly_the_launchers_its_tactics_select_once(facts, key) -> None:
    from gpu.tactics import candidate_configs

    f = facts[0][1][key]
    assert f["stock_name"] == "fused_moe_90" and f["stock_sources"] == 248
    got, want = f["got_instances"], f["want_instances"]
    assert got and len(set(got)) == len(got) and set(got) <= set(want)
    assert f["foreign"] == []  # no kernel of another dtype pair
    assert f["spec_sources"] == len(f["units"]) < f["stock_sources"]
    # exactly FlashInfer's tactic list (gpu/tactics.py restates it; the GPU run checks that
    # restatement against the counts the module reports), bf16 output only
    tactics = {
        (c["tile"], c["schedule"], c["cluster"])
        for c in candidate_configs(humming=key == "w4a8", finalize=False)
    }
    if key == "w4a16":  # the measured Kimi-K3 set: those of its launchers only, each once
        from kimi_w31.adapter import kernels as K

        shipped = {("x".join(map(str, t)), "x".join(map(str, c))) for t, c in K.KIMI_K3_W4A16}
        tactics = {t for t in tactics if (t[0], t[2]) in shipped}
        assert len(tactics) == len(shipped)
    assert sorted(_config(x) for x in got) == sorted(tactics)
    assert all("SafeFP4, __nv_bfloat16," in " ".join(x.split()) for x in got)
    # every other launcher of the runner is defined, once, to refuse: the module links
    (unbuilt,) = f["unbuilt"]
    assert unbuilt.count("template <>") == len(want) - len(got)
    assert unbuilt.count("TLLM_THROW(") == len(want) - len(got)


@pytest.mark.parametrize("key", ["w4a16", "w4a16-all", "w4a8"])
def test_units_are_flashinfers_files_or_derived_in_the_plugins_cache(facts, key) -> None:
    """Derived sources go to the plugin's own cache (`$XDG_CACHE_HOME/kimi-w31/...`), never
    into FlashInfer's package folder or its generated tree; the stock binding's folder is on
    the include path, so their relative includes resolve as beside it."""
    ws, f = facts[0][0], facts[0][1][key]
    stock = {Path(p) for p in f["stock"]}
    derived = {Path(p) for p in f["derived"]}
    root = Path(f["derived_root"])
    assert root.is_relative_to(ws / "xdg" / "kimi-w31")
    for unit in map(Path, f["units"]):
        assert unit in stock or (unit in derived and unit.is_relative_to(root)), unit
        if unit in derived:
            assert not unit.name.endswith(".generated.cu")
            assert not any(unit.is_relative_to(d) for d in f["flashinfer_dirs"])
            assert unit.exists()  # written by jit_spec(write=True)
    assert f["ours_in_flashinfer"] == []
    binding_dir = next(
        p.parent for p in stock if p.name == "flashinfer_cutlass_fused_moe_binding.cu"
    )
    assert str(binding_dir) in f["include_dirs"]
    assert not f["stock_after_has_parts"]  # FlashInfer's own module never picks ours up
    # ... and regenerating FlashInfer's sources (every process does) keeps ours, so a warm
    # cache is not recompiled in the next process
    assert f["parts_survive"] and any(K_SPLIT in str(u) for u in derived)


@pytest.mark.parametrize("key", ["w4a16", "w4a8"])
def test_heavy_units_are_split_and_start_first(facts, key) -> None:
    from kimi_w31.adapter import kernels as K

    f = facts[0][1][key]
    assert max(f["kernel_weights"]) <= K.DEFAULT_MAX_PART_WEIGHT
    assert f["weights"] == sorted(f["weights"], reverse=True)
    # FlashInfer's own SM90 flags
    assert "-gencode=arch=compute_90a,code=sm_90a" in f["cuda_flags"]


def test_the_source_hash_does_not_depend_on_the_workspace(facts) -> None:
    (_, a), (_, b) = facts
    for key in ("w4a16", "w4a16-all", "w4a8"):
        assert a[key]["hash"] == b[key]["hash"]
    assert len({a[key]["hash"] for key in ("w4a16", "w4a16-all", "w4a8")}) == 3


def test_prebuild_off_gpu_in_a_fresh_process(tmp_path) -> None:
    """No GPU, FLASHINFER_CUDA_ARCH_LIST unset: `prebuild --arch sm90` targets SM90 (its
    cache directory is the one a server on an H200 reads) instead of tripping FlashInfer's
    guard."""
    out = _run(
        "", tmp_path, "-m", "kimi_w31", "prebuild", "--arch", "sm90", "--list", arch_list=None
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fused_moe_90_kimi_w31_w4a16 (sm90 w4a16, " in out.stderr
    assert f"{tmp_path}/.cache/flashinfer/0.7.2.post1/90a/cached_ops/" in out.stderr


_LOAD = """
import os, sys
from pathlib import Path
import tvm_ffi
from kimi_w31.adapter.bundle import Library
from kimi_w31.adapter.kernels import _Library
real = Path(tvm_ffi.__file__).parent / "lib" / "libtvm_ffi_testing.so"
fd = os.open(real, os.O_RDONLY)
# named like a bundle's library: tvm_ffi picks its loader by the suffix of the path it gets
module = _Library(Library(Path("/b/fused_moe_90_kimi_w31_w4a16.so"), fd, "")).build_and_load()
print(type(module).__name__)
"""


def test_tvm_ffi_loads_a_library_through_its_checked_descriptor(tmp_path) -> None:
    """The loader FlashInfer uses (tvm_ffi.load_module) accepts the descriptor's link
    (`Library.loadable`). A library tvm_ffi already holds, so the load adds no second copy
    of its registrations."""
    out = _run(textwrap.dedent(_LOAD), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "Module"
