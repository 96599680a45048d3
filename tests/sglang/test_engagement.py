"""Which MoE method SGLang builds with the plugin loaded, and how unsupported setups fail."""

from __future__ import annotations

import logging

import pytest
from conftest import E, K, N
from harness import build_moe, sglang_process
from kimi_w31.adapter.layout import OPT_IN_ENV

pytestmark = pytest.mark.sglang


def _method(**kw):
    return build_moe(experts=E, hidden=K, inter=N, **kw)


@pytest.mark.parametrize("arch", ["sm90", "sm120"])
def test_converted_k3_on_sm90_sm120_gets_the_situ_method(plugins, converted_dir, arch):
    from kimi_w31.adapter.sglang.moe_method import KimiW31SituMoEMethod
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    with sglang_process(converted_dir, arch=arch):
        moe = _method()
    method = moe.quant_method
    assert isinstance(method, KimiW31SituMoEMethod)
    assert method.arch == arch and method._fi_kernel == f"cutlass_{arch}"
    assert (method.situ_beta, method.situ_linear_beta) == (4.0, 25.0)
    assert method.load_up_proj_weight_first is True
    # TopK is built from this flag (kimi_k3.py): the scaling factor is applied there, once.
    assert moe.should_fuse_routed_scaling_factor_in_topk is True
    assert moe.runner_backend == MoeRunnerBackend.FLASHINFER_MXFP4


@pytest.mark.parametrize(
    ("arch", "backend", "activation"),
    [
        ("sm100", "flashinfer_mxfp4", "situ"),  # SGLang's trtllm-gen path keeps its own
        ("sm90", "marlin", "situ"),
        ("sm120", "marlin", "situ"),
        ("sm90", "triton", "situ"),
        ("sm90", "flashinfer_mxfp4", "silu"),  # another MXFP4 MoE model
        ("sm120", "flashinfer_mxfp4", "silu"),
    ],
)
def test_everything_else_keeps_sglangs_method(plugins, converted_dir, arch, backend, activation):
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod

    with sglang_process(converted_dir, arch=arch, moe_runner_backend=backend):
        moe = _method(activation=activation)
    assert type(moe.quant_method) is Mxfp4MoEMethod


def test_unconverted_checkpoint_is_untouched_but_warned(plugins, source_dir, caplog, monkeypatch):
    from kimi_w31.adapter.sglang import hooks
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod

    monkeypatch.delenv(OPT_IN_ENV, raising=False)
    monkeypatch.setattr(hooks, "_logged", set())
    with (
        caplog.at_level(logging.WARNING, logger="kimi_w31.adapter"),
        sglang_process(source_dir, arch="sm90"),
    ):
        moe = _method()
    assert type(moe.quant_method) is Mxfp4MoEMethod
    assert OPT_IN_ENV in caplog.text and "SwiGLU" in caplog.text


@pytest.mark.parametrize("arch", ["sm90", "sm120"])
def test_unconverted_checkpoint_with_opt_in_gets_the_situ_method(
    plugins, source_dir, source_tensors, monkeypatch, arch
):
    import torch
    from harness import EXPERT_PREFIX, FakeK3Text, load_with_real_loader, process_hf_config
    from kimi_w31.adapter.sglang.moe_method import KimiW31SituMoEMethod

    monkeypatch.setenv(OPT_IN_ENV, "1")
    with sglang_process(source_dir, arch=arch):
        moes = [build_moe(experts=E, hidden=K, inter=N, layer_id=i) for i in range(2)]
        load_with_real_loader(FakeK3Text(process_hf_config().text_config, moes), source_tensors)
    assert isinstance(moes[0].quant_method, KimiW31SituMoEMethod)
    p = EXPERT_PREFIX.format(L=1, E=2)
    up_gate = torch.cat(
        [source_tensors[p + "w3.weight_packed"], source_tensors[p + "w1.weight_packed"]]
    )
    assert torch.equal(moes[1].w13_weight[2], up_gate)


def test_bad_opt_in_value_is_refused(plugins, source_dir, monkeypatch):
    from kimi_w31.adapter.layout import LayoutError

    monkeypatch.setenv(OPT_IN_ENV, "maybe")
    with sglang_process(source_dir, arch="sm90"), pytest.raises(LayoutError, match=OPT_IN_ENV):
        _method()


def test_humming_w4a8_on_sm90_engages_the_humming_method(plugins, converted_dir):
    with sglang_process(converted_dir, arch="sm90", flashinfer_mxfp4_moe_precision="fp8"):
        method = _method().quant_method
    assert type(method).__name__ == "KimiW31SituMoEMethod" and method.humming
    with sglang_process(converted_dir, arch="sm120", flashinfer_mxfp4_moe_precision="fp8"):
        assert not _method().quant_method.humming  # an SM90 knob: inert on SM120, as in SGLang
    with sglang_process(converted_dir, arch="sm90"):
        assert not _method().quant_method.humming


def test_humming_needs_flashinfers_humming_entry_points(plugins, converted_dir, monkeypatch):
    import flashinfer.fused_moe
    from kimi_w31.adapter.flashinfer_moe import SituUnsupportedError

    monkeypatch.delattr(flashinfer.fused_moe, "preprocess_moe_weights_for_sm90_mixed_gemm_humming")
    with (
        sglang_process(converted_dir, arch="sm90", flashinfer_mxfp4_moe_precision="fp8"),
        pytest.raises(SituUnsupportedError, match="preprocess_moe_weights_for_sm90"),
    ):
        _method()


def test_forced_k3_ar_fusion_fails_at_construction(plugins, converted_dir, monkeypatch):
    from kimi_w31.adapter.sglang.engage import UnsupportedCombinationError

    monkeypatch.setenv("SGLANG_K3_AR_FUSION", "1")
    with (
        sglang_process(converted_dir, arch="sm120"),
        pytest.raises(UnsupportedCombinationError, match="SGLANG_K3_AR_FUSION"),
    ):
        _method()


def test_moe_tp_size_that_breaks_128_alignment_fails(plugins, converted_dir):
    """N/moe_tp = 192 is not a multiple of 128: refuse instead of padding."""
    with sglang_process(converted_dir, arch="sm90"), pytest.raises(ValueError, match="128") as err:
        build_moe(experts=E, hidden=K, inter=192)
    assert "--moe-runner-backend marlin" in str(err.value)


def test_hot_weight_reload_is_refused(plugins, converted_dir):
    with sglang_process(converted_dir, arch="sm90"):
        moe = _method()
    with pytest.raises(NotImplementedError, match="restart"):
        moe.quant_method.restore_weights_before_loading(moe)


def _no_situ_cutlass_fused_moe(
    input,
    token_selected_experts,
    token_final_scales,
    fc1_expert_weights,
    fc2_expert_weights,
    output_dtype,
    quant_scales,
    activation_type=None,
):
    raise AssertionError("must not be called")


@pytest.mark.parametrize("arch", ["sm90", "sm120"])
def test_flashinfer_without_cutlass_situ_fails_at_construction(
    plugins, converted_dir, monkeypatch, arch
):
    """0.6.16-0.6.18 had ActivationType.Situ but no CUTLASS SiTU: the signature decides."""
    import flashinfer
    import flashinfer.fused_moe
    from kimi_w31.adapter.flashinfer_moe import SituUnsupportedError

    monkeypatch.setattr(flashinfer.fused_moe, "cutlass_fused_moe", _no_situ_cutlass_fused_moe)
    monkeypatch.setattr(flashinfer, "__version__", "0.6.18")
    with sglang_process(converted_dir, arch=arch), pytest.raises(SituUnsupportedError) as err:
        _method()
    msg = str(err.value)
    assert "0.6.18" in msg and "situ_beta" in msg
    assert "flashinfer-python" in msg and "--moe-runner-backend marlin" in msg


def test_flashinfer_check_also_runs_in_check_server_args(plugins, converted_dir, monkeypatch):
    """The main process fails before any worker is spawned."""
    import flashinfer.fused_moe
    from kimi_w31.adapter.flashinfer_moe import SituUnsupportedError
    from sglang.srt.runtime_context import get_server_args

    monkeypatch.setattr(flashinfer.fused_moe, "cutlass_fused_moe", _no_situ_cutlass_fused_moe)
    with sglang_process(converted_dir, arch="sm90"):
        server_args = get_server_args()
        assert hasattr(type(server_args).check_server_args, "__wrapped__")
        with pytest.raises(SituUnsupportedError):
            type(server_args).check_server_args(server_args)
