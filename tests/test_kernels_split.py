"""adapter/kernels.py, the pure parts: splitting FlashInfer's generated grouped-GEMM files,
the trimmed source list and the build order. Against FlashInfer's real generator:
tests/sglang/test_kernels_flashinfer.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.adapter import kernels as K

HEAD = (
    '#include "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/x.inl"\n'
    "namespace tensorrt_llm\n{\nnamespace kernels\n{\n\n\n"
)
TAIL = "\n\n} // namespace kernels\n} // namespace tensorrt_llm\n"


def instance(m: int, n: int, k: int, tag: int, dtype: str = "__nv_bfloat16") -> str:
    return (
        f"template void launcher<{dtype}, SafeFP4, {dtype},\nEpilogue, "
        f"cute::Shape<cute::Int<{m}>, cute::Int<{n}>, cute::Int<{k}>>, "
        f"cute::Shape<cute::Int<1>, cute::Int<{tag}>, cute::Int<1>>> (\n"
        "GroupedGemmInput inputs, int sm_count_, size_t* workspace_size);\n"
    )


def generated(instances: list[str]) -> str:
    return HEAD + "\n\n".join(instances) + TAIL


_INST = re.compile(r"^template\s[^;]*;", re.M)
tiles = st.tuples(st.sampled_from([64, 128, 256]), st.sampled_from([16, 32, 64, 128, 256]))


@given(
    shapes=st.lists(tiles, min_size=1, max_size=12),
    max_weight=st.sampled_from([0.5, 1.0, 2.0, 4.0, 8.0, 100.0]),
)
def test_split_keeps_every_instantiation_once_in_order(shapes, max_weight) -> None:
    insts = [instance(m, n, 128, i) for i, (m, n) in enumerate(shapes)]
    parts = K.split_generated(generated(insts), max_weight)
    got = [x for p in parts for x in _INST.findall(p.text)]
    assert got == [x.rstrip("\n") for x in insts]  # nothing lost, nothing doubled, same order
    assert sum(p.instances for p in parts) == len(insts)
    for p in parts:
        assert p.text.startswith(HEAD) and p.text.endswith(TAIL)  # includes, namespaces
        assert p.weight <= max_weight or p.instances == 1  # bounded, or one heavy instance
    # greedy: no two neighbouring parts would have fitted into one
    for a, b in zip(parts, parts[1:], strict=False):
        assert a.weight + b.weight > max_weight


def test_weight_is_the_cta_tile_area() -> None:
    assert K.instance_weight(instance(256, 128, 128, 1)) == 2.0
    assert K.instance_weight(instance(64, 16, 512, 1)) == 0.0625
    assert K.instance_weight("template void f<int>();") == 1.0  # unknown tile: one unit


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
    parts = K.split_generated(text, 1.0)
    assert len(parts) == 1 and parts[0].text == text


def test_part_names_stay_outside_flashinfers_glob(tmp_path) -> None:
    src = tmp_path / "gemm_grouped" / "90" / "k_sm90_M256_Mixed_group6.generated.cu"
    names = [K.part_path(src, i, 4) for i in range(1, 5)]
    assert len(set(names)) == 4 and all(p.parent == src.parent for p in names)
    # FlashInfer lists its kernel files with rglob("*.generated.cu"): ours must not match
    assert not any(p.name.endswith(".generated.cu") for p in names)
    assert names[0].name == "k_sm90_M256_Mixed_group6.kimi_w31_part1of4.cu"


def _stock(tmp_path: Path) -> tuple[list[Path], dict[Path, str]]:
    d = tmp_path / "csrc"
    g = tmp_path / "gen" / "gemm_grouped" / "90"
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
    units = K.order_units(K.build_units(stock, trim, read=lambda p: files[p], max_weight=4.0))
    names = [u.path.name for u in units]
    # the variant's derived instantiation and binding, its GEMM file, nobody else's
    assert names[:3] == [
        trim.derived_prefix + K.INSTANTIATION,
        trim.derived_prefix + K.BINDING,
        trim.gemm_source,
    ]
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
    assert all(u.weight <= 4.0 for u in kernels)


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
