"""Each verify level catches its planted fault; a clean conversion passes every level."""

from __future__ import annotations

import json
import struct

import pytest
from cli_helpers import run_cli
from kimi_w31.converter.verify import verify

P = "language_model.model.layers.1.mlp.experts.2."


def _locate(out, tensor):
    """(shard path, absolute begin, end) of a tensor in a converted output."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    path = out / index["weight_map"][tensor]
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8 : 8 + n])[tensor]["data_offsets"]
    return path, 8 + n + begin, 8 + n + end


def _failed(report) -> dict[str, list[str]]:
    return {c.name: [p.render() for p in c.problems] for c in report.checks if c.ok is False}


def _rerecord_checksums(out, shard_name):
    """Make the corruption look intentional: rewrite the recorded digests for one shard."""
    from kimi_w31.converter.safetensors_format import read_header
    from kimi_w31.converter.streaming import HashPipe, hash_tensors

    header = read_header(out / shard_name)
    pipe = HashPipe()
    ranges = [(t.name, t.begin, t.end) for t in header.tensors.values()]
    digests, _ = hash_tensors(str(out / shard_name), ranges, pipe)
    pipe.close()
    record = json.loads((out / "kimi_w31.checksums.json").read_text())
    record["files"][shard_name]["tensors"] = digests
    (out / "kimi_w31.checksums.json").write_text(json.dumps(record))


def test_clean_conversion_passes_every_level(converted, small_source):
    report = verify(converted, checksums=True, source=str(small_source), numerics=True, sample=None)
    assert report.ok, _failed(report)
    assert [c.name for c in report.checks][-1].startswith("numerics")
    proc = run_cli("verify", converted, "--source", small_source, "--numerics", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"] is True


def test_flipped_scale_byte_fails_integrity(output_copy):
    path, begin, _ = _locate(output_copy, P + "w31.weight_scale")
    data = bytearray(path.read_bytes())
    data[begin + 3] ^= 0x01
    path.write_bytes(bytes(data))
    assert verify(output_copy).ok  # structure alone cannot see it
    failed = _failed(verify(output_copy, checksums=True))
    assert any(P + "w31.weight_scale" in p and "corrupt" in p for p in failed["checksums"])
    proc = run_cli("verify", output_copy, "--checksums")
    assert proc.returncode == 1 and P + "w31.weight_scale" in proc.stderr


def test_swapped_halves_with_rerecorded_checksums_fail_source_and_numerics(
    output_copy, small_source
):
    name = P + "w31.weight_packed"
    path, begin, end = _locate(output_copy, name)
    data = bytearray(path.read_bytes())
    half = (end - begin) // 2
    data[begin:end] = data[begin + half : end] + data[begin : begin + half]  # [gate; up]
    path.write_bytes(bytes(data))
    scale = P + "w31.weight_scale"
    _, sb, se = _locate(output_copy, scale)
    sh = (se - sb) // 2
    data[sb:se] = data[sb + sh : se] + data[sb : sb + sh]
    path.write_bytes(bytes(data))
    _rerecord_checksums(output_copy, path.name)
    report = verify(output_copy, checksums=True, source=str(small_source), numerics=True,
                    sample=None)  # fmt: skip
    failed = _failed(report)
    assert "checksums" not in failed  # the record was forged to match
    assert any("not concat([w3, w1])" in p and name in p for p in failed["matches source"])
    numerics = failed["numerics (source vs converted semantics)"]
    assert any(P + "w31" in p and "different function" in p for p in numerics)


def test_swapped_betas_in_block_fail_numerics(output_copy, small_source):
    cfg_path = output_copy / "config.json"
    cfg = json.loads(cfg_path.read_text())
    block = cfg["kimi_w31"]
    block["situ_beta"], block["situ_linear_beta"] = block["situ_linear_beta"], block["situ_beta"]
    cfg_path.write_text(json.dumps(cfg))
    report = verify(output_copy, source=str(small_source), numerics=True, sample=4)
    failed = _failed(report)
    assert any("situ_beta" in p for p in failed["config.json kimi_w31 block"])
    assert "different function" in failed["numerics (source vs converted semantics)"][0]


def _drop_tensor(out, tensor, rename_to):
    """Rename a tensor in its shard header and the index (offsets stay valid)."""
    path, _, _ = _locate(out, tensor)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header[rename_to] = header.pop(tensor)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + n :])
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][rename_to] = index["weight_map"].pop(tensor)
    index_path.write_text(json.dumps(index))


def test_missing_expert_fails_structure(output_copy):
    for suffix in ("w31.weight_packed", "w31.weight_scale", "w2.weight_packed", "w2.weight_scale"):
        _drop_tensor(output_copy, P + suffix, f"junk.{suffix}")
    failed = _failed(verify(output_copy))
    assert any("missing 1 of 8 experts" in p and "missing 2" in p
               for p in failed["expert tensors (as converted)"])  # fmt: skip


def test_leftover_w1_fails_structure(output_copy):
    _drop_tensor(output_copy, P + "w2.weight_scale", P + "w1.weight_scale")
    failed = _failed(verify(output_copy))
    assert any("w1/w3 expert tensor left" in p for p in failed["expert tensors (as converted)"])


def test_index_pointing_to_wrong_shard_fails_structure(output_copy):
    index_path = output_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    index_path.write_text(json.dumps(index))
    failed = _failed(verify(output_copy))
    assert any(name in p for p in failed["shards and index"])


def test_truncated_shard_fails_structure(output_copy):
    shard = sorted(output_copy.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    failed = _failed(verify(output_copy))
    assert any(shard.name in p and "truncated" in p for p in failed["shards and index"])
    assert run_cli("verify", output_copy).returncode == 1


def test_nan_scale_fails_integrity_with_location(output_copy):
    name = P + "w2.weight_scale"
    path, begin, _ = _locate(output_copy, name)
    data = bytearray(path.read_bytes())
    data[begin + 5] = 0xFF
    path.write_bytes(bytes(data))
    _rerecord_checksums(output_copy, path.name)
    failed = _failed(verify(output_copy, checksums=True))
    assert any(name in p and "0xFF" in p and "byte 5" in p for p in failed["checksums"])


def test_incomplete_output_says_so(output_copy):
    (output_copy / "model.safetensors.index.json").unlink()
    proc = run_cli("verify", output_copy)
    assert proc.returncode == 1 and "conversion incomplete" in proc.stderr


@pytest.mark.parametrize("args", [["--numerics"], ["--experts", "0"]])
def test_verify_usage_errors(converted, args):
    assert run_cli("verify", converted, *args).returncode == 2


def test_unknown_checksum_algorithm_is_reported_not_misread(output_copy):
    record_path = output_copy / "kimi_w31.checksums.json"
    record = json.loads(record_path.read_text())
    record["tensor_checksum"] = "md4"
    record_path.write_text(json.dumps(record))
    failed = _failed(verify(output_copy, checksums=True))
    assert any("unknown tensor checksum" in p and "md4" in p for p in failed["checksums"])
