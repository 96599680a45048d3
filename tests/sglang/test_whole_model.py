"""SGLang 0.5.23's whole Kimi-K3 model (KimiK3ForConditionalGeneration), built on CPU from
`kimi-convert synth` -> `kimi-convert` output and loaded through SGLang's own weight reader
and the model's own `load_weights`: every checkpoint tensor reaches a parameter and every
parameter is loaded, at TP1 and per rank at TP2 and EP2, pretending SM90 and SM120. The
unconverted synth source loads the same way through SGLang's stock path (no plugin), which
proves synth a real Kimi-K3 checkpoint. The measuring is whole_model_probe.py's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import kimi_convert
from safetensors import safe_open

pytestmark = pytest.mark.sglang

PROBE = Path(__file__).with_name("whole_model_probe.py")
ROUTED = re.compile(r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")  # a routed expert
# Two layers cover every layer kind: layer 0 KDA attention + dense MLP, layer 1 MLA
# attention + MoE. N 256 keeps N/2 a multiple of 128 (the MXFP4 CUTLASS tile) at TP2.
EXPERTS, N = 4, 256
ARCHS = ("sm90", "sm120")
# Parameters no checkpoint tensor is for. SGLang's MXFP4 MoE method allocates zero expert
# biases on every CUDA-like build (mxfp4.py create_weights: create_bias = with_bias or not
# _is_hip); Kimi-K3's experts have none, and the kimi_w31 method frees them after loading.
NO_CHECKPOINT_TENSOR = ("mlp.experts.w13_weight_bias", "mlp.experts.w2_weight_bias")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("whole")
    src, out = root / "src", root / "out"
    kimi_convert("synth", str(src), "--layers", "2", "--experts", str(EXPERTS), "--n", str(N))
    kimi_convert(str(src), str(out), "--manifest", "kimi-k3-any")
    kimi_convert("verify", str(out), "--checksums")  # as the README says: the plugin checks
    return src, out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _probe(model: Path, tmp: Path, world: int, configs: list[str], stock: bool = False) -> list:
    """Run the probe as `world` ranks at once; their reports, by rank."""
    env = {k: v for k, v in os.environ.items() if k != "KIMI_W31_SERVE_UNCONVERTED"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if stock:
        env["SGLANG_PLUGINS"] = "no_such_plugin"  # SGLang as shipped
    procs = []
    for rank in range(world):
        out = tmp / f"{model.name}-{world}-{rank}-{stock}.json"
        log = out.with_suffix(".log")
        cmd = [sys.executable, str(PROBE), str(model), str(out), str(rank), str(world)]
        cmd += [",".join(configs)] + (["--stock"] if stock else [])
        # output to files, not pipes: a rank blocked on a full pipe would stall the others
        with open(log, "w") as sink:
            procs.append(
                (subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT), out, log)
            )
    reports = []
    for proc, out, log in procs:
        proc.wait(timeout=600)
        assert proc.returncode == 0, log.read_text()[-4000:]
        reports.append(json.loads(out.read_text()))
    return reports


def _checkpoint_tensors(model: Path) -> set[str]:
    """Every tensor in the checkpoint's files, read with the safetensors library."""
    names: set[str] = set()
    for shard in model.glob("*.safetensors"):
        with safe_open(str(shard), "np") as f:
            names.update(f.keys())
    return names


def _assert_every_parameter_loaded(report: dict) -> None:
    params = report["params"]
    excused = {n for n in params if n.endswith(NO_CHECKPOINT_TENSOR)}
    assert excused, "the MoE method no longer allocates expert biases: update the exclusion"
    for name, p in params.items():
        if name in excused:
            assert p["unwritten"] == p["bytes"], f"{name}: a checkpoint tensor now loads it"
        else:
            assert p["unwritten"] == 0, f"{name}: {p['unwritten']} of {p['bytes']} bytes unloaded"


def _reached(report: dict) -> dict[str, list[str]]:
    return report["reached"]


@pytest.fixture(scope="module")
def converted_tp1(pair, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("probe")
    return _probe(pair[1], tmp, 1, [f"{a}:1:1" for a in ARCHS])[0]


@pytest.fixture(scope="module")
def converted_tp2_ep2(pair, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("probe")
    return _probe(pair[1], tmp, 2, [f"{a}:2:{ep}" for ep in (1, 2) for a in ARCHS])


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_tp1_every_tensor_reaches_a_parameter_every_parameter_loads(
    pair, converted_tp1, arch
):
    assert converted_tp1["plugin"] is True
    report = converted_tp1["configs"][f"{arch}:1:1"]
    assert report["model_class"] == "KimiK3ForConditionalGeneration"
    assert report["moe_methods"] == ["KimiW31SituMoEMethod"]
    # only the routed experts are quantized: everything else resolves to unquantized methods
    assert set(report["other_methods"]) <= {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}
    tensors = _checkpoint_tensors(pair[1])
    reached = _reached(report)
    assert set(reached) == tensors, "SGLang's reader did not stream exactly the checkpoint"
    assert [n for n, ps in reached.items() if not ps] == []
    assert all(p in report["params"] for ps in reached.values() for p in ps)
    _assert_every_parameter_loaded(report)


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_tp2_every_rank_loads_every_tensor(pair, converted_tp2_ep2, arch):
    tensors = _checkpoint_tensors(pair[1])
    for rank, ranked in enumerate(converted_tp2_ep2):
        report = ranked["configs"][f"{arch}:2:1"]
        assert report["moe_methods"] == ["KimiW31SituMoEMethod"]
        reached = _reached(report)
        assert set(reached) == tensors
        # TP shards every tensor: each rank takes its slice of each
        assert [n for n, ps in reached.items() if not ps] == [], rank
        _assert_every_parameter_loaded(report)


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_ep2_each_expert_on_its_rank_everything_else_everywhere(
    pair, converted_tp2_ep2, arch
):
    tensors = _checkpoint_tensors(pair[1])
    local = EXPERTS // 2
    for rank, ranked in enumerate(converted_tp2_ep2):
        report = ranked["configs"][f"{arch}:2:2"]
        reached = _reached(report)
        assert set(reached) == tensors
        for name, ps in reached.items():
            routed = ROUTED.search(name)  # the published spelling: block_sparse_moe
            if routed:
                expert = int(routed.group(1))
                assert bool(ps) == (expert // local == rank), (rank, name, ps)
            else:
                assert ps, (rank, name)
        _assert_every_parameter_loaded(report)


@pytest.fixture(scope="module")
def stock_source(pair, tmp_path_factory) -> dict:
    return _probe(pair[0], tmp_path_factory.mktemp("stock"), 1, ["sm90:1:1"], stock=True)[0]


def test_the_published_ignore_list_quantizes_no_non_expert_module(
    pair, stock_source, converted_tp1
):
    """The published ignore list does not name the router, the latent or the residual
    projections: SGLang still builds every non-expert module unquantized (it builds those
    without a quant config), for the source as shipped and for the converted checkpoint."""
    from kimi_w31.converter.synth import PUBLISHED_IGNORE

    config = json.loads((pair[0] / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["text_config"]["quantization_config"]["ignore"] == PUBLISHED_IGNORE
    unquantized = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}
    for report in (stock_source["configs"]["sm90:1:1"], converted_tp1["configs"]["sm90:1:1"]):
        methods = report["module_methods"]
        assert {n: m for n, m in methods.items() if m not in unquantized} == {}
        # the linear kinds the list does not name are among the modules held to it (the
        # router, MoEGate, is a plain parameter with no quant method at all)
        for kind in ("routed_expert_down_proj", "routed_expert_up_proj", "_res_proj"):
            assert any(name.endswith(kind) for name in methods), kind


def test_unconverted_source_loads_whole_through_stock_sglang(pair, stock_source):
    """No plugin: synth's source is a checkpoint SGLang's Kimi-K3 model loads as it ships."""
    report_all = stock_source
    assert report_all["plugin"] is False
    report = report_all["configs"]["sm90:1:1"]
    assert report["moe_methods"] == ["Mxfp4MoEMethod"]  # SGLang's own
    reached = _reached(report)
    assert set(reached) == _checkpoint_tensors(pair[0])
    assert [n for n, ps in reached.items() if not ps] == []
    _assert_every_parameter_loaded(report)
    # the source's w1 and w3 both land in the fused w13 parameters, as the w31 does
    for name, ps in reached.items():
        if ".block_sparse_moe.experts." in name and (".w1." in name or ".w3." in name):
            want = "w13_weight_scale" if name.endswith("weight_scale") else "w13_weight"
            assert [p.rsplit(".", 1)[1] for p in ps] == [want], name


# -- SGLang's real server on CPU --------------------------------------------------------------

SERVER_SITE = Path(__file__).with_name("server_site")
HOOKS = {
    "sglang.srt.models.kimi_k3.KimiK3LinearForCausalLM.load_weights": True,
    "sglang.srt.layers.quantization.mxfp4.Mxfp4Config.get_quant_method": True,
}


def _launch_server(model: Path, probe_dir: Path, log: Path, parallel: list[str]):
    """`python -m sglang.launch_server --device cpu`, with the stand-ins and the probe of
    server_site/sitecustomize.py in every process it starts."""
    cores = os.cpu_count() or 1
    env = {k: v for k, v in os.environ.items() if k != "KIMI_W31_SERVE_UNCONVERTED"}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(SERVER_SITE), env.get("PYTHONPATH")])),
        KIMI_W31_TEST_PROBE_DIR=str(probe_dir),
        KIMI_W31_TEST_PROBE_HOLD="600",
        # one core per rank (SGLang's CPU backend binds each rank's threads)
        SGLANG_CPU_OMP_THREADS_BIND=f"0|{min(1, cores - 1)}",
    )
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
        "--device", "cpu", "--port", str(_free_port()), "--skip-tokenizer-init",
        "--disable-radix-cache", "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch", "--grammar-backend", "none",
        # served as text: the checkpoint ships no image processor (the model class still
        # builds its vision tower)
        "--json-model-override-args", '{"language_model_only": true}',
        *parallel,
    ]  # fmt: skip
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server and every process it started (its own process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            continue
    proc.wait(timeout=20)


def test_real_server_builds_the_model_with_the_plugin_in_every_process(pair, tmp_path):
    """TP2 and DP2 at once: two processes each build SGLang's Kimi-K3 model class, and each
    has the kimi_w31 hooks applied when it does (written from inside that process)."""
    runs = {"tp2": ["--tp-size", "2"], "dp2": ["--dp-size", "2"]}
    procs = {}
    try:
        for name, parallel in runs.items():
            (tmp_path / name).mkdir()
            procs[name] = _launch_server(
                pair[1], tmp_path / name, tmp_path / f"{name}.log", parallel
            )
        deadline = time.monotonic() + 540
        while time.monotonic() < deadline:
            if all(len(list((tmp_path / n).glob("built-*.json"))) >= 2 for n in runs):
                break
            dead = [n for n, p in procs.items() if p.poll() is not None]
            assert not dead, (tmp_path / f"{dead[0]}.log").read_text()[-4000:]
            time.sleep(2)
    finally:
        for proc in procs.values():
            _stop(proc)
    for name in runs:
        reports = [json.loads(f.read_text()) for f in (tmp_path / name).glob("built-*.json")]
        log = (tmp_path / f"{name}.log").read_text()[-4000:]
        assert len(reports) == 2, log
        assert len({r["pid"] for r in reports}) == 2
        for r in reports:
            assert r["model_class"] == "KimiK3ForConditionalGeneration"
            assert r["hooks"] == HOOKS, (name, r)
        if name == "tp2":
            assert sorted((r["tp_rank"], r["tp_size"]) for r in reports) == [(0, 2), (1, 2)]
        else:
            assert [(r["tp_rank"], r["tp_size"]) for r in reports] == [(0, 1), (0, 1)]


def test_the_manifests_spellings_are_the_ones_sglang_maps_alike():
    """The kimi-k3 manifest's inventory aliases restate KimiK3ForConditionalGeneration's
    hf_to_sglang_mapper: every synth name, spelled the other way, maps to the same name."""
    from kimi_w31.converter.manifest import load_manifest
    from kimi_w31.converter.synth import SynthSpec, tensor_specs
    from sglang.srt.models.kimi_k3 import KimiK3ForConditionalGeneration

    mapper = KimiK3ForConditionalGeneration.hf_to_sglang_mapper
    aliases = load_manifest("kimi-k3").inventory.aliases  # (other spelling, canonical)
    names = [name for name, _, _ in tensor_specs(SynthSpec(layers=5, published=False))]
    others = []
    for name in names:
        for spelled, canonical in aliases:
            name = name.replace(canonical, spelled)
        others.append(name)
    assert sum(o != n for o, n in zip(others, names, strict=True)) > len(names) // 2
    mapped = [n for n, _ in mapper.apply((o, None) for o in others)]
    ours = []
    for name in others:
        for spelled, canonical in aliases:
            name = name.replace(spelled, canonical)
        ours.append(name)
    assert mapped == ours == names
