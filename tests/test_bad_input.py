"""Bad sources: a reason code naming file and tensor, exit 1, and no index written.

Every case runs the real CLI with `--json` and reads the problems it reports: the code says
why, `file`/`tensor`/`expected`/`found` say where and what.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from cli_helpers import run_cli
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.pipeline import ConvertOptions
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint

EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.3"


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
    """Run a conversion that must fail: (exit code, problems by code)."""
    out = tmp_path / "out"
    proc = run_cli([src, out, "--manifest", "kimi-k3-any", "--json", *extra])
    assert not (out / "model.safetensors.index.json").exists()
    assert not out.exists() or not any(out.iterdir())  # not even an empty state folder
    return proc.returncode, problems(proc)


def problems(proc) -> dict[Code, list[dict]]:
    assert "Traceback" not in proc.stderr
    found: dict[Code, list[dict]] = {}
    for p in proc.problems:
        found.setdefault(Code(p["code"]), []).append(p)
    return found


def test_wrong_expert_shape(source_copy, tmp_path):
    name = f"{EXPERT}.w1.weight_scale"

    def mutate(h):
        h[name]["shape"] = [32, 8]  # same byte count as [64, 4], wrong shape

    _rewrite_header(_shard_of(source_copy, name), mutate)
    code, found = _convert(source_copy, tmp_path)
    assert code == 1
    assert [(p["tensor"], p["expected"], p["found"]) for p in found[Code.EXPERT_SHAPE]] == [
        (name, "[64, 4]", "[32, 8]")
    ]


def test_wrong_dtype(source_copy, tmp_path):
    name = f"{EXPERT}.w2.weight_scale"
    _rewrite_header(_shard_of(source_copy, name), lambda h: h[name].update(dtype="I8"))
    code, found = _convert(source_copy, tmp_path)
    assert code == 1
    assert [(p["tensor"], p["expected"], p["found"]) for p in found[Code.EXPERT_DTYPE]] == [
        (name, "U8", "I8")
    ]


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
    code, found = _convert(source_copy, tmp_path)
    assert code == 1
    assert [p["tensor"] for p in found[Code.EXPERT_PARTNER_MISSING]] == [gone]
    assert [p["tensor"] for p in found[Code.EXPERT_DTYPE]] == [bad_dtype]  # every problem


@pytest.mark.parametrize(
    ("damage", "code"),
    [
        (lambda data: data[:-1000], Code.FILE_TRUNCATED),
        (lambda data: struct.pack("<Q", len(data) * 2) + data[8:], Code.HEADER_BEYOND_FILE),
        (lambda data: data[:9] + b"}" + data[10:], Code.HEADER_NOT_JSON),
    ],
)
def test_damaged_shard_is_named(source_copy, tmp_path, damage, code):
    shard = sorted(source_copy.glob("*.safetensors"))[1]
    shard.write_bytes(damage(shard.read_bytes()))
    exit_code, found = _convert(source_copy, tmp_path)
    assert exit_code == 1 and [p["file"] for p in found[code]] == [shard.name]


def test_shard_missing(source_copy, tmp_path):
    shard = sorted(source_copy.glob("*.safetensors"))[0]
    shard.unlink()
    code, found = _convert(source_copy, tmp_path)
    assert code == 1 and [p["file"] for p in found[Code.SHARD_MISSING]] == [shard.name]


def test_weight_map_path_traversal_and_absolute(source_copy, tmp_path):
    index_path = source_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    names = list(index["weight_map"])
    index["weight_map"][names[0]] = "../outside.safetensors"
    index["weight_map"][names[1]] = "/etc/passwd.safetensors"
    index_path.write_text(json.dumps(index))
    code, found = _convert(source_copy, tmp_path)
    assert code == 1
    assert sorted(p["tensor"] for p in found[Code.WEIGHT_MAP_ENTRY_UNSAFE]) == sorted(names[:2])


def test_pinned_manifest_mismatch_suggests_any(small_source, tmp_path):
    proc = run_cli([small_source, tmp_path / "out", "--json"])  # default: kimi-k3, pinned dims
    assert proc.returncode == 1
    found = problems(proc)
    assert ("num_experts", "896", "8") in {
        (p["what"].split()[2], p["expected"], p["found"]) for p in found[Code.PINNED_MISMATCH]
    }
    assert "--manifest kimi-k3-any" in proc.json["hint"]
    assert not (tmp_path / "out").exists()


def test_situ_parameters_must_match_manifest(tmp_path):
    src = tmp_path / "src"
    synth_checkpoint(src, SynthSpec(layers=2, experts=4, situ_beta=25.0, situ_linear_beta=4.0))
    code, found = _convert(src, tmp_path)
    assert code == 1 and len(found[Code.SITU_MISMATCH]) == 2


def test_source_without_quantization_config_is_refused(source_copy, tmp_path):
    cfg = json.loads((source_copy / "config.json").read_text())
    del cfg["text_config"]["quantization_config"]  # published: its only place
    (source_copy / "config.json").write_text(json.dumps(cfg))
    code, found = _convert(source_copy, tmp_path)
    assert code == 1 and Code.NO_QUANTIZATION_CONFIG in found


@pytest.mark.parametrize("mark", ["block", "wrapper"])
def test_source_already_carrying_our_markers_is_refused(source_copy, tmp_path, mark):
    cfg = json.loads((source_copy / "config.json").read_text())
    if mark == "block":
        cfg["text_config"]["kimi_w31"] = {"format_version": 1}
    else:
        cfg["text_config"]["quantization_config"] = {
            "quant_method": "kimi_w31",
            "base": cfg["text_config"]["quantization_config"],
        }
    (source_copy / "config.json").write_text(json.dumps(cfg))
    code, found = _convert(source_copy, tmp_path)
    assert code == 1 and Code.ALREADY_MARKED in found


def test_usage_errors_exit_2(small_source, tmp_path):
    for args in (
        ["--manifest", "nope"],
        ["--manifest", "no/such.json"],
        ["--max-shard-size", "lots"],
        ["--max-shard-size", "0"],
    ):
        proc = run_cli([small_source, tmp_path / "o", *args])
        assert proc.returncode == 2, (args, proc.stderr)
    assert run_cli([small_source, small_source / "inside"]).returncode == 2
    assert run_cli([small_source, tmp_path / "o", "--revision", "main"]).returncode == 2
    assert run_cli(["/definitely/not/here", tmp_path / "o"]).returncode == 1
    assert not (tmp_path / "o").exists()


@given(size=st.integers(max_value=0))
def test_options_no_run_can_use_are_refused_where_they_are_made(size):
    with pytest.raises(Fatal) as exc:
        ConvertOptions("src", Path("out"), max_shard_size=size)
    assert exc.value.codes == [Code.USAGE]
    assert ConvertOptions("src", Path("out"), max_shard_size=1 - size).max_shard_size >= 1


def test_non_empty_unrelated_output_is_never_cleared(small_source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"another model")
    for extra in ([], ["--force"]):
        proc = run_cli([small_source, out, "--manifest", "kimi-k3-any", "--json", *extra])
        assert proc.returncode == 1
        assert set(problems(proc)) == {Code.FOREIGN_OUTPUT if extra else Code.OUTPUT_NOT_EMPTY}
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "notes.txt",
    ]
    assert (out / "notes.txt").read_text() == "mine"


def test_messages_are_not_read_as_markup(source_copy, tmp_path):
    """Problem text is data: a name such as "[red]x" must be printed as it is."""
    index_path = source_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../[red]x.safetensors"
    index_path.write_text(json.dumps(index))
    proc = run_cli([source_copy, tmp_path / "out", "--manifest", "kimi-k3-any"])
    assert proc.returncode == 1 and "../[red]x.safetensors" in proc.stderr
