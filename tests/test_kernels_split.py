"""adapter/kernels.py, the pure parts: splitting FlashInfer's generated grouped-GEMM files,
the trimmed source list and the build order. Against FlashInfer's real generator:
tests/sglang/test_kernels_flashinfer.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from kimi_w31.adapter import kernels as K

HEAD = (
    '#include "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/x.inl"\n'
    "namespace tensorrt_llm\n{\nnamespace kernels\n{\n\n\n"
)
TAIL = "\n\n} // namespace kernels\n} // namespace tensorrt_llm\n"


def instance(m: int, n: int, k: int, tag: int, dtype: str = "__nv_bfloat16") -> str:
    return (
        f"template void launcher<{dtype}, SafeFP4, __nv_bfloat16,\nEpilogue, "
        f"cute::Shape<cute::Int<{m}>, cute::Int<{n}>, cute::Int<{k}>>, "
        f"cute::Shape<cute::Int<1>, cute::Int<{tag}>, cute::Int<1>>> (\n"
        "GroupedGemmInput inputs, int sm_count_, size_t* workspace_size);\n"
    )


def generated(instances: list[str]) -> str:
    return HEAD + "\n\n".join(instances) + TAIL


_INST = re.compile(r"^template\s[^;]*;", re.M)
tiles = st.tuples(
    st.sampled_from([64, 128, 256]),
    st.sampled_from([16, 32, 64, 128, 256]),
    st.sampled_from([128, 256, 512]),
)


def _first_fit(weights, cap):
    count, acc = 0, 0.0
    for w in weights:
        if count == 0 or acc + w > cap:
            count, acc = count + 1, 0.0
        acc += w
    return count


@given(
    shapes=st.lists(tiles, min_size=1, max_size=12),
    max_weight=st.sampled_from([5.0, 10.0, 12.0, 15.0, 20.0, 30.0, 60.0, 1000.0]),
)
# A heavy instantiation last: balancing to an even target cut 3 parts where filling up to the
# bound gives 2.
@example(
    shapes=[(64, 16, 128), (64, 16, 128), (64, 32, 512), (64, 256, 512), (256, 256, 512)],
    max_weight=20.0,
)
def test_split_keeps_every_instantiation_once_in_order(shapes, max_weight) -> None:
    insts = [instance(m, n, k, i) for i, (m, n, k) in enumerate(shapes)]
    parts = K.partition_generated(generated(insts), max_weight)
    got = [x for p in parts for x in _INST.findall(p.text)]
    assert got == [x.rstrip("\n") for x in insts]  # nothing lost, nothing doubled, same order
    assert sum(p.instances for p in parts) == len(insts)
    weights = [K.instance_weight(x) for x in insts]
    for p in parts:
        assert p.text.startswith(HEAD) and p.text.endswith(TAIL)  # includes, namespaces
        assert p.weight <= max_weight + 1e-9 or p.instances == 1  # bounded, or one heavy one
    assert sum(p.weight for p in parts) == pytest.approx(
        sum(weights) + K.UNIT_OVERHEAD * len(parts)
    )
    # never more units (each costs an overhead) than filling parts up to the bound would give
    assert len(parts) <= _first_fit(weights, max_weight - K.UNIT_OVERHEAD) or len(parts) == len(
        insts
    )


def test_weight_grows_with_the_tile_volume() -> None:
    assert K.instance_weight(instance(256, 128, 128, 1)) == 3.0
    assert K.instance_weight(instance(128, 16, 512, 1)) == 1.5
    assert K.instance_weight("template void f<int>();") == 2.0  # unknown tile


@pytest.mark.parametrize(
    "text",
    [
        generated([instance(256, 256, 128, 1), instance(256, 256, 128, 2)]).replace(
            "\n\n\ntemplate void launcher", "\nint other;\ntemplate void launcher", 1
        )[::1],
        HEAD
        + instance(256, 256, 128, 1)
        + "static int x = 1;\n"
        + instance(256, 256, 128, 2)
        + TAIL,
    ],
)
def test_an_unknown_layout_stays_whole(text) -> None:
    parts = K.partition_generated(text, 1.0)
    assert len(parts) == 1 and parts[0].text == text


def test_parts_live_outside_flashinfers_generated_tree(tmp_path) -> None:
    gen = tmp_path / "generated"
    out_dir = gen / "cutlass_instantiations" / "90"  # FlashInfer deletes what it did not write
    src = out_dir / "gemm_grouped" / "90" / "k_sm90_M256_Mixed_group6.generated.cu"
    names = [K.part_path(src, i, 4) for i in range(1, 5)]
    assert len(set(names)) == 4
    assert all(p.is_relative_to(gen) and not p.is_relative_to(out_dir) for p in names)
    assert all(p.parent.name == src.parent.name for p in names)  # same object-name prefix
    # FlashInfer lists its kernel files with rglob("*.generated.cu"): ours must not match
    assert not any(p.name.endswith(".generated.cu") for p in names)
    assert names[0].name == "k_sm90_M256_Mixed_group6.kimi_w31_part1of4.cu"
    with pytest.raises(ValueError):
        K.part_path(Path("x.generated.cu"), 1, 2)


def _stock(tmp_path: Path) -> tuple[list[Path], dict[Path, str]]:
    d = tmp_path / "csrc"
    g = tmp_path / "gen" / "cutlass_instantiations" / "90" / "gemm_grouped" / "90"
    files = {
        d / "moe_gemm_kernels_fp8_fp8.cu": "",
        d / "moe_gemm_kernels_bf16_fp4.cu": "",
        d / "moe_gemm_kernels_fp8_fp4.cu": "",
        d / K.BINDING: (
            "a\n    // keep consistent with cpp/tensorrt_llm/plugins/mixtureOfExperts/x.cpp\n"
            "    if (x) {}\n    if (!mKernelRunner) {\n}\n"
        ),
        d / K.INSTANTIATION: (
            "template class CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>;\n"
            "template class CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, half, half, half, false,\n"
            "    Sm90Wfp4Afp8ScaleMode::kHummingPreMmaE8M0>;\n"
            "INSTANTIATE_FINALIZE_MOE_ROUTING(half, half, half);\n"
        ),
        g / "k_sm90_M256_Mixed_group6.generated.cu": generated(
            [instance(256, 256, 128, i) for i in range(8)]
        ),
        g / "k_sm90_M64_Mixed_group12.generated.cu": generated(
            [instance(64, 16, 128, i) for i in range(8)]
        ),
        g / "k_sm90_M128_Mixed_group42.generated.cu": generated(
            [instance(128, 128, 128, i, "__nv_fp8_e4m3") for i in range(8)]
        ),
        d / "logger.cpp": "",
    }
    return list(files), files


@pytest.mark.parametrize("variant", [K.W4A16, K.W4A8_HUMMING], ids=lambda v: v.key)
def test_units_hold_the_runner_its_kernels_split_and_costliest_first(tmp_path, variant) -> None:
    stock, files = _stock(tmp_path)
    trim = variant.trim
    units = K.order_units(K.build_units(stock, trim, read=lambda p: files[p], max_weight=30.0))
    names = [u.path.name for u in units]
    # the variant's derived instantiation and binding, its GEMM file, nobody else's
    for name in (trim.derived_prefix + K.INSTANTIATION, trim.derived_prefix + K.BINDING):
        assert name in names
    assert trim.gemm_source in names
    assert not any(n.startswith("moe_gemm_kernels_") and n != trim.gemm_source for n in names)
    assert K.BINDING not in names and K.INSTANTIATION not in names and "logger.cpp" in names
    kernels = [u for u in units if "_Mixed_group" in u.path.name]
    kept = {p for p in stock if p.name.endswith(".generated.cu") and trim.kernel_marker in files[p]}
    # every instantiation of the kept files is compiled exactly once, none of the others
    want = sorted(x for p in kept for x in _INST.findall(files[p]))
    got = sorted(x for u in kernels for x in _INST.findall(u.text or files[u.path]))
    assert got == want
    weights = [u.weight for u in units]
    assert weights == sorted(weights, reverse=True)  # costliest first
    assert all(u.weight <= 30.0 for u in kernels)
    assert units[-1].path.name == "logger.cpp"  # host-only sources last


# -- pruning: only the launchers a tactic can select --------------------------------------
COOP = "cutlass::gemm::KernelTmaWarpSpecializedCooperative"
PING = "cutlass::gemm::KernelTmaWarpSpecializedPingpong"


def launcher(tile, schedule, cluster=(1, 1, 1), act="__nv_bfloat16", out="__nv_bfloat16"):
    """A launcher instantiation as FlashInfer 0.7.2's generator writes it."""
    m, n, k = tile
    a, b, c = cluster
    return (
        f"template void sm90_generic_mixed_moe_gemm_kernelLauncher<{act}, SafeFP4, {out},\n"
        "tensorrt_llm::cutlass_extensions::EpilogueOpDefault, "
        f"cute::Shape<cute::Int<{m}>, cute::Int<{n}>, cute::Int<{k}>>, "
        f"cute::Shape<cute::Int<{a}>, cute::Int<{b}>, cute::Int<{c}>>, {schedule}, "
        "cutlass::epilogue::TmaWarpSpecializedCooperative, "
        "cutlass::WeightOnlyQuantOp::FINEGRAINED_SCALE_ONLY> (\n"
        f"GroupedGemmInput<{act}, SafeFP4, {out}, {out}>inputs, TmaWarpSpecializedGroupedGemmInput"
        " hopper_inputs, int sm_count_, size_t* workspace_size);\n"
    )


def test_selectable_is_flashinfers_candidate_list() -> None:
    """Every tile x schedule x cluster FlashInfer's generator writes, against the tactic list
    as gpu/tactics.py restates it (the GPU run checks that against the module's counts)."""
    from gpu.tactics import TILES_SM90, candidate_configs

    tactics = {(c["tile"], c["schedule"], c["cluster"]) for c in candidate_configs(False, False)}
    clusters = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)]
    for tile in TILES_SM90:
        # the generator: both schedules for M >= 128, ping-pong only for M = 64
        for schedule in (COOP, PING) if tile[0] >= 128 else (PING,):
            for cl in clusters:
                name = "cooperative" if schedule == COOP else "pingpong"
                key = ("x".join(map(str, tile)), name, "x".join(map(str, cl)))
                one = launcher(tile, schedule, cl)
                assert K.selectable(one, K.W4A16_ALL.trim) == (key in tactics), key
                # the shipped module: only the Kimi-K3 set's launchers of those
                assert K.selectable(one, K.W4A16.trim) == (
                    key in tactics and (tile, cl) in K.KIMI_K3_W4A16
                ), key
    # W4A8: only the bf16 output the plugin serves
    fp8 = "__nv_fp8_e4m3"
    assert K.selectable(launcher((128, 16, 128), COOP, act=fp8), K.W4A8_HUMMING.trim)
    assert not K.selectable(
        launcher((128, 16, 128), COOP, act=fp8, out="half"), K.W4A8_HUMMING.trim
    )


@given(
    picks=st.lists(
        st.tuples(tiles, st.sampled_from([COOP, PING]), st.sampled_from([1, 2])),
        min_size=1,
        max_size=10,
    )
)
def test_pruning_keeps_the_selectable_launchers_and_defines_the_rest_to_refuse(picks) -> None:
    found = [launcher(t, s, (c, 1, 1)) for t, s, c in picks]
    text = generated(found)
    kept, left = K.prune_generated(text, K.W4A16_ALL.trim)
    keep = [x for x in found if K.selectable(x, K.W4A16_ALL.trim)]
    assert _INST.findall(kept) == _INST.findall("".join(keep))
    assert left == [x for x in found if x not in keep] or len(set(found)) < len(found)
    assert (kept == "") == (not keep)
    if keep:
        assert kept.startswith(HEAD) and kept.endswith(TAIL)
    if left:
        stub = K.unbuilt_definitions(left)
        assert stub.count("template <>") == len(left) == stub.count("TLLM_THROW(")
        # the same template-id and parameters as each instantiation it replaces
        for x in left:
            signature = " ".join(x.removeprefix("template void ").rstrip(";\n ").split())
            assert signature.replace(" (", "(") in " ".join(stub.split()).replace(" (", "(")


def test_an_unknown_layout_is_neither_pruned_nor_split() -> None:
    text = generated([launcher((128, 16, 128), PING)]) + "int defined_here = 0;\n"
    assert K.prune_generated(text, K.W4A16.trim) == (text, [])
    with pytest.raises(ValueError):
        K.unbuilt_definitions(["int x;"])


def test_no_split_keeps_flashinfers_files(tmp_path) -> None:
    stock, files = _stock(tmp_path)
    units = K.build_units(stock, K.W4A16.trim, read=lambda p: files[p], split=False)
    kernels = [u for u in units if "_Mixed_group" in u.path.name]
    assert all(u.text is None and u.path.name.endswith(".generated.cu") for u in kernels)
    assert len(kernels) == 2


def test_variants_per_serving_path() -> None:
    assert K.variant_for("sm90") is K.W4A16
    assert K.variant_for("sm90", humming=True) is K.W4A8_HUMMING
    assert K.variant_for("sm120") is K.SM120 and K.SM120.trim is None
    assert len({v.module_name for v in K.VARIANTS.values()}) == len(K.VARIANTS)
    with pytest.raises(ValueError):
        K.variant_for("sm100")  # type: ignore[arg-type]
    # W4A16's full tactic set on request; W4A8 and SM120 have one module each
    assert K.variant_for("sm90", tactics="all") is K.W4A16_ALL
    assert K.variant_for("sm90", humming=True, tactics="all") is K.W4A8_HUMMING
    with pytest.raises(ValueError):
        K.variant_for("sm90", tactics="fast")
    # the two W4A16 modules never share a cache entry, a derived file or a split part
    a, b = K.W4A16, K.W4A16_ALL
    assert a.trim is not None and b.trim is not None and b.trim.launchers is None
    assert all(x != y for x, y in zip(
        (a.module_name, a.trim.derived_prefix, a.trim.split_dir),
        (b.module_name, b.trim.derived_prefix, b.trim.split_dir), strict=True
    ))  # fmt: skip


@pytest.mark.parametrize("value", ["", "kimi-k3", "all", "fast"])
def test_the_plugin_takes_its_w4a16_tactic_set_from_the_environment(monkeypatch, value) -> None:
    installed: list[str] = []
    monkeypatch.setattr(K, "install", lambda v, library=None: installed.append(v.key))
    monkeypatch.setattr(K, "_installed", {})
    monkeypatch.delenv(K.ENV_BUNDLE, raising=False)
    monkeypatch.setenv(K.ENV_TACTICS, value)
    if value == "fast":
        with pytest.raises(ValueError):
            K.ensure("sm90")
        return
    assert K.ensure("sm90").key == installed[-1] == ("w4a16-all" if value == "all" else "w4a16")
