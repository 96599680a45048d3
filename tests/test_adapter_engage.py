"""The engagement decision over every backend, arch and option (no SGLang needed)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from kimi_w31.adapter.sglang.engage import (
    Decision,
    MoeFacts,
    UnsupportedCombinationError,
    decide,
    unconverted_warning,
)

BASE = MoeFacts(
    activation="situ",
    mxfp4_serialized=True,
    runner_backend="flashinfer_mxfp4",
    a2a_backend="none",
    arch="sm90",
    converted=True,
    opt_in=False,
)


def facts(**kw) -> MoeFacts:
    return dataclasses.replace(BASE, **kw)


@pytest.mark.parametrize(
    ("arch", "backend", "activation"),
    list(
        itertools.product(
            ["sm90", "sm100", "sm120", "other"],
            ["flashinfer_mxfp4", "marlin", "triton", "triton_kernel", "deep_gemm", "auto"],
            ["situ", "silu", "swiglu"],
        )
    ),
)
def test_matrix(arch, backend, activation):
    want = (
        Decision.ADAPTER
        if (arch in ("sm90", "sm120") and backend == "flashinfer_mxfp4" and activation == "situ")
        else Decision.STOCK
    )
    assert decide(facts(arch=arch, runner_backend=backend, activation=activation)) is want


def test_unconverted_needs_the_opt_in():
    assert decide(facts(converted=False)) is Decision.STOCK
    assert decide(facts(converted=False, opt_in=True)) is Decision.ADAPTER


def test_dynamic_mxfp4_quantization_is_not_ours():
    assert decide(facts(mxfp4_serialized=False)) is Decision.STOCK


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ({"a2a_backend": "deepep"}, "--moe-a2a-backend deepep"),
        ({"a2a_backend": "megamoe"}, "--moe-a2a-backend megamoe"),
        ({"a2a_backend": "mooncake"}, "mooncake"),
        ({"paged_experts": True}, "paged-experts"),
        ({"ktransformers": True}, "kt-weight-path"),
        ({"ar_fusion_forced": True}, "SGLANG_K3_AR_FUSION"),
    ],
)
def test_unsupported_combinations_fail_with_a_way_out(override, fragment):
    with pytest.raises(UnsupportedCombinationError, match=fragment) as err:
        decide(facts(**override))
    assert err.value.reason == "unsupported-combination" and err.value.exit_code == 1


def test_sm90_w4a8_humming_is_served_by_the_adapter():
    # Validated with SiTU on an H200 (docs/gpu-validation.md); inert on SM120, as in SGLang.
    assert decide(facts(arch="sm90", sm90_precision="fp8")) is Decision.ADAPTER
    assert decide(facts(arch="sm120", sm90_precision="fp8")) is Decision.ADAPTER


def test_unsupported_options_do_not_matter_where_sglang_keeps_its_path():
    assert decide(facts(arch="sm100", a2a_backend="deepep")) is Decision.STOCK
    assert decide(facts(runner_backend="marlin", paged_experts=True)) is Decision.STOCK


def test_warning_only_for_the_silently_wrong_stock_path():
    assert unconverted_warning(facts(converted=False)) is not None
    assert unconverted_warning(facts()) is None
    assert unconverted_warning(facts(converted=False, opt_in=True)) is None
    assert unconverted_warning(facts(converted=False, runner_backend="marlin")) is None
