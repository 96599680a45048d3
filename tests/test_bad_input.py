"""Bad sources: a clear message naming file and tensor, exit 1, and no index written."""

from __future__ import annotations

import json
import struct

from cli_helpers import run_cli
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint

EXPERT = "language_model.model.layers.1.mlp.experts.3"


def _rewrite_header(path, mutate) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    mutate(header)
    body = json.dumps(header).encode()
    body += b" " * (-(len(body)) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + n :])


def _shard_of(src, tensor: str):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return src / index["weight_map"][tensor]


def _convert(src, tmp_path, *extra):
    out = tmp_path / "out"
    proc = run_cli(src, out, "--manifest", "kimi-k3-any", *extra)
    assert not (out / "model.safetensors.index.json").exists()
    assert not any(out.glob("*.safetensors")) if out.exists() else True
    return proc


def test_wrong_expert_shape(source_copy, tmp_path):
    name = f"{EXPERT}.w1.weight_scale"

    def mutate(h):
        h[name]["shape"] = [32, 8]  # same byte count as [64, 4], wrong shape

    _rewrite_header(_shard_of(source_copy, name), mutate)
    proc = _convert(source_copy, tmp_path)
    assert proc.returncode == 1
    assert name in proc.stderr and "wrong shape" in proc.stderr
    assert "expected [64, 4], found [32, 8]" in proc.stderr


def test_wrong_dtype(source_copy, tmp_path):
    name = f"{EXPERT}.w2.weight_scale"

    def mutate(h):
        h[name]["dtype"] = "I8"

    _rewrite_header(_shard_of(source_copy, name), mutate)
    proc = _convert(source_copy, tmp_path)
    assert proc.returncode == 1 and name in proc.stderr and "expected U8, found I8" in proc.stderr


def test_missing_w3_partner_and_all_problems_reported(source_copy, tmp_path):
    gone = f"{EXPERT}.w3.weight_packed"
    index_path = source_copy / "model.safetensors.index.json"
    shard = _shard_of(source_copy, gone)

    def drop(h):  # make it a differently named tensor so offsets stay valid
        h["unrelated.blob"] = h.pop(gone)

    _rewrite_header(shard, drop)
    index = json.loads(index_path.read_text())
    index["weight_map"]["unrelated.blob"] = index["weight_map"].pop(gone)
    index_path.write_text(json.dumps(index))
    bad_dtype = f"{EXPERT.replace('.3', '.5')}.w2.weight_scale"
    _rewrite_header(_shard_of(source_copy, bad_dtype), lambda h: h[bad_dtype].update(dtype="I8"))
    proc = _convert(source_copy, tmp_path)
    assert proc.returncode == 1
    assert gone in proc.stderr and "missing" in proc.stderr
    assert bad_dtype in proc.stderr  # every problem, not only the first


def test_truncated_shard(source_copy, tmp_path):
    shard = sorted(source_copy.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-1000])
    proc = _convert(source_copy, tmp_path)
    assert proc.returncode == 1 and shard.name in proc.stderr and "truncated" in proc.stderr


def test_shard_missing(source_copy, tmp_path):
    shard = sorted(source_copy.glob("*.safetensors"))[0]
    shard.unlink()
    proc = _convert(source_copy, tmp_path)
    assert proc.returncode == 1 and shard.name in proc.stderr and "missing" in proc.stderr


def test_weight_map_path_traversal_and_absolute(source_copy, tmp_path):
    index_path = source_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    names = list(index["weight_map"])
    index["weight_map"][names[0]] = "../outside.safetensors"
    index["weight_map"][names[1]] = "/etc/passwd.safetensors"
    index_path.write_text(json.dumps(index))
    proc = _convert(source_copy, tmp_path)
    assert proc.returncode == 1
    assert "contains '..'" in proc.stderr and names[0] in proc.stderr
    assert "absolute path" in proc.stderr and names[1] in proc.stderr


def test_header_length_larger_than_file(source_copy, tmp_path):
    shard = sorted(source_copy.glob("*.safetensors"))[2]
    data = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])
    proc = _convert(source_copy, tmp_path)
    assert proc.returncode == 1 and shard.name in proc.stderr
    assert "header length is larger than the file" in proc.stderr


def test_malformed_header_json(source_copy, tmp_path):
    shard = sorted(source_copy.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[9] = ord("}")  # break the JSON right after the opening brace
    shard.write_bytes(bytes(data))
    proc = _convert(source_copy, tmp_path)
    assert proc.returncode == 1 and shard.name in proc.stderr and "not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_pinned_manifest_mismatch_suggests_any(small_source, tmp_path):
    proc = run_cli(small_source, tmp_path / "out")  # default: kimi-k3, pinned real dims
    assert proc.returncode == 1
    assert "num_experts does not match manifest kimi-k3 (expected 896, found 8)" in proc.stderr
    assert "--manifest kimi-k3-any" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_situ_parameters_must_match_manifest(tmp_path):
    src = tmp_path / "src"
    synth_checkpoint(src, SynthSpec(layers=1, experts=4, situ_beta=25.0, situ_linear_beta=4.0))
    proc = _convert(src, tmp_path)
    assert proc.returncode == 1 and "activation_situ_beta does not match" in proc.stderr


def test_source_without_quantization_config_is_refused(source_copy, tmp_path):
    cfg = json.loads((source_copy / "config.json").read_text())
    del cfg["quantization_config"]
    (source_copy / "config.json").write_text(json.dumps(cfg))
    proc = _convert(source_copy, tmp_path)
    assert proc.returncode == 1 and "not an MXFP4 checkpoint" in proc.stderr


def test_usage_errors_exit_2(small_source, tmp_path):
    assert run_cli(small_source, tmp_path / "o", "--manifest", "nope").returncode == 2
    assert run_cli(small_source, tmp_path / "o", "--max-shard-size", "lots").returncode == 2
    assert run_cli(small_source, small_source / "inside").returncode == 2
    assert run_cli("/definitely/not/here", tmp_path / "o").returncode == 1


def test_non_empty_unrelated_output_refused_without_force(small_source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = run_cli(small_source, out, "--manifest", "kimi-k3-any")
    assert proc.returncode == 1 and "--force" in proc.stderr
    proc = run_cli(small_source, out, "--manifest", "kimi-k3-any", "--force", "-q")
    assert proc.returncode == 0, proc.stderr
    assert (out / "notes.txt").read_text() == "mine"  # --force only removes what it wrote


def test_messages_are_not_read_as_markup(source_copy, tmp_path):
    """Problem text is data: a name such as "[red]x" must be printed as it is."""
    index_path = source_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../[red]x.safetensors"
    index_path.write_text(json.dumps(index))
    proc = _convert(source_copy, tmp_path)
    assert proc.returncode == 1 and "../[red]x.safetensors" in proc.stderr
