"""docs/format.md holds to the code.

The spec's marked blocks (`<!-- spec-example: NAME -->` before a fenced block,
`<!-- spec-table: NAME -->` before a markdown table) are parsed out of the markdown. The worked
example's commands are run in-process (synth, then convert) and every example value is
compared with what the code wrote; the spec's tables (fields, name grammar, MoE-layer rule,
MXFP4 code tables) are compared with the code they describe; and the spec's structural
statements about the files are checked on the output with a reader written from the spec
alone (8-byte length, JSON header, data), not with the converter's own reader.

Example conventions (section 9 of the spec): a string `"<...>"` stands for a machine-specific
value and is accepted only where this test allows it (`HOLES_*`); a key `"..."` marks an
excerpt of an object, and any numbers in its text must add up to the entries left out.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import math
import os
import re
import shlex
import zlib
from pathlib import Path

import numpy as np
import pytest
from kimi_w31.converter import contract, reference
from kimi_w31.converter.cli.convert import convert_cmd
from kimi_w31.converter.cli.synth import synth
from kimi_w31.converter.contract import CHECKSUMS_FORMAT
from kimi_w31.converter.hashing import TENSOR_HASH
from kimi_w31.converter.manifest import load_manifest
from kimi_w31.converter.pipeline import ConvertOptions, convert
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.synth import EXTRA_FILES, SynthSpec, cli_spec, synth_checkpoint
from safetensors import safe_open

DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"
MD = DOC.read_text(encoding="utf-8")
ELIDED = "..."
PLACEHOLDER = re.compile(r"<[^<>]+>")
# Where the examples may show a placeholder instead of a value (paths are tuples; "*" is any
# key). Everything else in an example must be the exact value the code writes.
HOLES_BLOCK = {("kimi_w31", "source", "path")}
HOLES_CHECKSUMS = {
    ("files", "*", "sources", "*", 1),  # mtime_ns
    ("files", "*", "sources", "*", 2),  # ctime_ns
    ("files", "*", "sources", "*", 3),  # inode
    ("files", "config.json", "size"),  # config.json holds the source path
    ("files", "config.json", "sha256"),
    ("source", "sha256"),  # a hash of where the source was read from
}
ITEM_SIZE = {"U8": 1, "BF16": 2, "F16": 2, "F32": 4}  # the dtypes synth writes
SHARD_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


# -- reading the markdown ---------------------------------------------------------------------


def example(name: str) -> tuple[str, str]:
    """(language, body) of the fenced block after `<!-- spec-example: name -->`."""
    m = re.search(rf"<!-- spec-example: {re.escape(name)} -->\n```(\w*)\n(.*?)\n```", MD, re.S)
    assert m is not None, f"docs/format.md has no example block {name!r}"
    return m[1], m[2]


def example_json(name: str):
    lang, body = example(name)
    assert lang == "json", name
    return json.loads(body)


def table(name: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the markdown table after `<!-- spec-table: name -->`."""
    m = re.search(rf"<!-- spec-table: {re.escape(name)} -->\n((?:\|.*\n)+)", MD)
    assert m is not None, f"docs/format.md has no table {name!r}"
    lines = m[1].strip().splitlines()

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip()[1:-1].split("|")]

    header = cells(lines[0])
    assert set(lines[1].replace("|", "").replace(" ", "")) <= {"-"}, name
    rows = [cells(line) for line in lines[2:]]
    assert all(len(r) == len(header) for r in rows), name
    return header, rows


def unquote(cell: str) -> str:
    """A cell's text without its code quotes."""
    return cell[1:-1] if cell.startswith("`") and cell.endswith("`") else cell


def half_open(cell: str) -> tuple[int, int]:
    m = re.fullmatch(r"\[(\d+), (\d+)\)", cell)
    assert m is not None, cell
    return int(m[1]), int(m[2])


# -- comparing an example with what the code wrote ----------------------------------------------


def match(doc, actual, path: tuple = (), holes: list | None = None) -> list:
    """Assert `doc` (an example) shows `actual`; returns the placeholders as (path, actual)."""
    holes = [] if holes is None else holes
    where = "/".join(map(str, path)) or "<root>"
    if isinstance(doc, str) and PLACEHOLDER.fullmatch(doc):
        holes.append((path, actual))
        return holes
    if isinstance(doc, dict):
        assert isinstance(actual, dict), f"{where}: the code wrote {actual!r}"
        shown = {k: v for k, v in doc.items() if k != ELIDED}
        missing = sorted(set(shown) - set(actual))
        assert not missing, f"{where}: the code wrote no {missing}"
        if ELIDED in doc:
            left_out = len(actual) - len(shown)
            assert left_out > 0, f"{where}: '...' but nothing is left out"
            counts = [int(n) for n in re.findall(r"\d+", doc[ELIDED])]
            if counts:
                assert sum(counts) == left_out, (
                    f"{where}: the excerpt says {doc[ELIDED]!r}, "
                    f"but {left_out} entries are left out"
                )
        else:
            extra = sorted(set(actual) - set(doc))
            assert not extra, f"{where}: the code also wrote {extra}"
        for key, value in shown.items():
            match(value, actual[key], (*path, key), holes)
        return holes
    if isinstance(doc, list):
        assert isinstance(actual, list) and len(actual) == len(doc), f"{where}: {actual!r}"
        for i, (d, a) in enumerate(zip(doc, actual, strict=True)):
            match(d, a, (*path, i), holes)
        return holes
    assert type(doc) is type(actual) and doc == actual, (
        f"{where}: the spec says {doc!r}, the code wrote {actual!r}"
    )
    return holes


def allowed(path: tuple, patterns: set[tuple]) -> bool:
    return any(
        len(p) == len(path) and all(q == "*" or q == k for q, k in zip(p, path, strict=True))
        for p in patterns
    )


# -- reading safetensors files from the spec alone ------------------------------------------------


def read_shard(path: Path) -> tuple[int, dict, bytes]:
    """(H, header object, whole file) of a safetensors file."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")

    def no_duplicates(pairs):
        assert len({k for k, _ in pairs}) == len(pairs), f"{path.name}: duplicate key"
        return dict(pairs)

    header = json.loads(data[8 : 8 + length].decode("utf-8"), object_pairs_hook=no_duplicates)
    return length, header, data


def tensor_bytes(root: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, data bytes) of every tensor the index names."""
    index = json.loads((root / contract.INDEX_NAME).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        length, header, data = read_shard(root / shard)
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                out[name] = (
                    entry["dtype"],
                    entry["shape"],
                    data[8 + length + begin : 8 + length + end],
                )
    return out


# -- the worked example, run in-process ------------------------------------------------------------


def example_run_options(src: Path, out: Path) -> tuple[SynthSpec, ConvertOptions]:
    """The documented command lines as a SynthSpec and ConvertOptions (parsed by the CLI's own
    option parsers; the synth options mapped as `kimi-convert synth` maps them)."""
    lang, body = example("commands")
    assert lang == "bash"
    lines = [shlex.split(line) for line in body.splitlines() if line.strip()]
    assert len(lines) == 2, "the example is two commands: synth, then convert"
    synth_line, convert_line = lines
    assert synth_line[:2] == ["kimi-convert", "synth"]
    p = synth.make_context("synth", synth_line[2:]).params
    assert not p["real_dims"], "the worked example is a small checkpoint"
    spec = cli_spec(**{key: p[key] for key in inspect.signature(cli_spec).parameters})
    assert convert_line[0] == "kimi-convert" and convert_line[1] != "synth"
    c = convert_cmd.make_context("convert", convert_line[1:]).params
    assert Path(c["source"]) == Path(p["output"]), "convert reads what synth wrote"
    assert not (c["download"] or c["dry_run"] or c["force"]) and c["executor"] == "local"
    opts = ConvertOptions(
        str(src),
        out,
        manifest=c["manifest"],
        max_shard_size=c["max_shard_size"],
        check_scales=c["check_scales"],
    )
    names = (Path(p["output"]).name, Path(c["output"]).name)
    assert names == (src.name, out.name), f"the test runs the example as {src.name}/{out.name}"
    return spec, opts


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("format_spec")
    src, out = root / "src", root / "out"
    spec, opts = example_run_options(src, out)
    synth_checkpoint(src, spec)
    result = convert(opts)
    config = json.loads((out / contract.CONFIG_NAME).read_text())
    return {
        "src": src,
        "out": out,
        "spec": spec,
        "result": result,
        "config": config,
        "source_config": json.loads((src / contract.CONFIG_NAME).read_text()),
        "index": json.loads((out / contract.INDEX_NAME).read_text()),
        "checksums": json.loads((out / contract.CHECKSUMS_NAME).read_text()),
    }


def _file_of(cell: str, run: dict) -> Path:
    rel = Path(unquote(cell))
    assert rel.parts[0] in ("src", "out"), cell
    return run[rel.parts[0]].joinpath(*rel.parts[1:])


# -- section 9: the worked example --------------------------------------------------------------


def test_config_block_example(run):
    holes = match(example_json("config-block"), {"kimi_w31": run["config"]["kimi_w31"]})
    assert all(allowed(p, HOLES_BLOCK) for p, _ in holes), holes
    assert dict(holes) == {("kimi_w31", "source", "path"): run["src"].resolve().name}


def test_quantization_config_example(run):
    assert not match(
        example_json("quantization-config"),
        {"quantization_config": run["config"]["quantization_config"]},
    )


def test_index_example(run):
    assert not match(example_json("index-entry"), run["index"])


def test_w31_header_example(run):
    doc = example_json("w31-header-entry")
    w31 = [k for k in doc if ".w31." in k]
    assert len(w31) == 1
    shard = run["index"]["weight_map"][w31[0]]
    _, header, _ = read_shard(run["out"] / shard)
    assert not match(doc, header)


def test_shard_layout_table(run):
    header, rows = table("shard-layout")
    assert rows
    for file, length, start in rows:
        h, _, _ = read_shard(_file_of(file, run))
        assert (int(length), int(start)) == (h, 8 + h), file


def test_w31_bytes_table(run):
    """Each row's offsets are where the headers put the tensor; each half equals its source."""
    _, rows = table("w31-bytes")
    prefix = re.search(r"names starting\s+`([^`]+)`", MD)[1]
    spans: dict[str, tuple[Path, int, int]] = {}  # row -> (file, begin, end)
    sources: dict[str, str] = {}  # source tensor (short name) -> row
    whole = None
    for what, file, offsets, absolute, _ in rows:
        label = re.fullmatch(r"`([^`]+)`(.*)", what)
        name = prefix + label[1]
        path, (begin, end) = _file_of(file, run), half_open(absolute)
        length, hdr, _ = read_shard(path)
        if offsets:  # a whole tensor: its header entry gives the range
            assert json.loads(offsets) == hdr[name]["data_offsets"], what
            assert (begin, end) == tuple(8 + length + o for o in hdr[name]["data_offsets"])
            if label[1].startswith("w31."):
                whole = (begin, end)
            else:
                sources[label[1]] = what
        else:  # a half of the w31 tensor above: up is rows [0, N), gate rows [N, 2N)
            assert whole is not None and label[1].startswith("w31."), what
            n = hdr[name]["shape"][0] // 2
            half = re.search(r"rows (\d+)–(\d+) \((up|gate)\)", label[2])
            mid = (whole[0] + whole[1]) // 2
            if half[3] == "up":
                assert (int(half[1]), int(half[2]), begin, end) == (0, n - 1, whole[0], mid)
            else:
                assert (int(half[1]), int(half[2]), begin, end) == (n, 2 * n - 1, mid, whole[1])
        spans[what] = (path, begin, end)

    def read(row: str) -> bytes:
        path, begin, end = spans[row]
        return path.read_bytes()[begin:end]

    checked = 0
    for what, *_, equal in rows:
        if equal:
            parts = [unquote(part.strip()) for part in equal.split("‖")]
            rows_of = [
                next(
                    row
                    for short, row in sources.items()
                    if short == part or short.startswith(part + ".")
                )
                for part in parts
            ]
            assert read(what) == b"".join(map(read, rows_of)), f"{what} != {equal}"
            checked += 1
    assert checked == 3


def test_checksums_example(run):
    holes = match(example_json("checksums"), run["checksums"])
    bad = [p for p, _ in holes if not allowed(p, HOLES_CHECKSUMS)]
    assert not bad, f"placeholders where the value is not machine-specific: {bad}"
    for path, value in holes:
        assert type(value) is (str if path[-1] == "sha256" else int), path


def test_example_w31_crc_is_that_of_w3_then_w1(run):
    doc = example_json("checksums")
    ((_, entry),) = [(k, v) for k, v in doc["files"].items() if "tensors" in v]
    for name, crc in entry["tensors"].items():
        if name == ELIDED:
            continue
        up, gate = contract.source_halves(name)
        src = tensor_bytes(run["src"])
        assert f"{zlib.crc32(src[up][2] + src[gate][2]):08x}" == crc


def test_example_is_described_as_written(run):
    """The prose around the example: shard names, the dense layer, the split partners."""
    shards = sorted(run["index"]["weight_map"].values())
    count = len(set(shards))
    assert (
        f"`model-00001-of-{count:05d}.safetensors` … `model-{count:05d}-of-{count:05d}"
        f".safetensors`" in MD
    )
    assert run["spec"].moe_layers() == [1, 2] and run["spec"].experts == 8
    assert (run["spec"].k, run["spec"].n) == (128, 64)
    copied = [name for name in EXTRA_FILES if not name.startswith(".")]
    assert len(copied) == 15 and "the 15 other files of `src/`" in MD


# -- section 6: config.json -----------------------------------------------------------------------


def _at(obj, dotted: str):
    for key in dotted.split("."):
        obj = obj[key]
    return obj


_TYPES = {
    "integer": int,
    "string": str,
    "number": (int, float),
    "object": dict,
    "array of strings": list,
}


def test_block_field_table_is_the_block(run):
    block = run["config"]["kimi_w31"]
    header, rows = table("block-fields")
    assert header[:4] == ["field", "kind", "type", "allowed value"]
    fields = {unquote(r[0]): r for r in rows}
    assert [f for f in fields if "." not in f] == list(block), "the block, in the order written"
    contract_rows = [f for f, r in fields.items() if r[1] == "contract"]
    assert set(contract_rows) == set(contract.REQUIRED_FIELDS)
    assert set(list(block)[:8]) == set(contract_rows), "the eight contract fields come first"
    assert {f for f, r in fields.items() if r[1] == "informational"} == set(fields) - set(
        contract_rows
    )
    for name, (_, _, typ, value, _) in fields.items():
        actual = _at(block, name)
        assert isinstance(actual, _TYPES[typ]) and not isinstance(actual, bool), name
        if name == "fc1_order":
            assert all(isinstance(x, str) for x in actual)
        if value.startswith("`"):
            want = json.loads(unquote(value))
            code = (
                contract.FORMAT_VERSION if name == "format_version" else contract.FIXED_FIELDS[name]
            )
            assert want == code and type(want) is type(code), name
    for parent in {f.split(".")[0] for f in fields if "." in f}:
        assert {f.split(".", 1)[1] for f in fields if f.startswith(parent + ".")} == set(
            block[parent]
        ), f"the table lists exactly the keys of {parent}"
    assert set(block["dims"]) == set(load_manifest(block["manifest"]).dims)


def test_block_meanings(run):
    """What the table says each informational field holds."""
    block, src = run["config"]["kimi_w31"], run["src"]
    assert re.fullmatch(r"kimi-w31 \S+", block["converter"])
    manifest = load_manifest(block["manifest"])
    assert manifest.name == block["manifest"] and manifest.sha256 == block["manifest_sha256"]
    assert block["source"]["path"] == src.resolve().name  # no path of the converting machine
    for file, entry in block["source"]["files"].items():
        length, _, data = read_shard(src / file)
        assert entry["size"] == len(data)
        assert entry["header_sha256"] == hashlib.sha256(data[8 : 8 + length]).hexdigest(), (
            "source.files header_sha256 hashes the header JSON only (not the length prefix)"
        )
    text = run["source_config"]["text_config"]
    assert block["dims"] == {s: text[f] for s, f in manifest.dims.items()}
    assert block["situ_beta"] == text["activation_situ_beta"]
    assert block["situ_linear_beta"] == text["activation_situ_linear_beta"]


def test_config_has_exactly_two_changes(run):
    config, source = run["config"], run["source_config"]
    assert list(config) == [*source, "kimi_w31"], "key order kept, the block last"
    unwrapped = copy.deepcopy({k: v for k, v in config.items() if k != "kimi_w31"})
    wrapped = 0
    for holder in (unwrapped, unwrapped.get("text_config", {})):
        qc = holder.get("quantization_config")
        if qc is not None:
            assert set(qc) == {"quant_method", "base"} and qc["quant_method"] == "kimi_w31"
            assert qc["base"]["quant_method"] != "kimi_w31"
            holder["quantization_config"] = qc["base"]
            wrapped += 1
    assert wrapped >= 1
    assert unwrapped == source
    assert not contract.check_block(config) and not contract.check_wrapped(config)
    assert (run["out"] / contract.CONFIG_NAME).read_text(encoding="utf-8") == json.dumps(
        config, indent=2, ensure_ascii=False
    ) + "\n"


# -- section 5: files, shards, index ---------------------------------------------------------------


def test_output_files(run):
    src, out = run["src"], run["out"]
    shards = sorted(set(run["index"]["weight_map"].values()))
    written = sorted(
        str(p.relative_to(src))
        for p in src.rglob("*")
        if p.is_file()
        and not p.name.endswith(".safetensors")
        and p.name not in (contract.INDEX_NAME, contract.CONFIG_NAME)
    )
    assert written == sorted(EXTRA_FILES)
    extra = [name for name in written if not name.startswith(".")]  # hidden paths: 5.5
    folders = {str(Path(name).parent) for name in extra if "/" in name}
    want = {*shards, contract.INDEX_NAME, contract.CONFIG_NAME, contract.CHECKSUMS_NAME}
    want |= {*extra, *folders}
    assert {str(p.relative_to(out)) for p in out.rglob("*")} == want, "and no .kimi_w31/"
    for name in extra:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert all(SHARD_NAME.fullmatch(s) for s in shards)
    assert [SHARD_NAME.fullmatch(s).groups() for s in shards] == [
        (f"{i:05d}", f"{len(shards):05d}") for i in range(1, len(shards) + 1)
    ]


def test_shards_are_readable_safetensors(run):
    out = run["out"]
    for shard in sorted(set(run["index"]["weight_map"].values())):
        path = out / shard
        length, header, data = read_shard(path)
        assert length <= 100_000_000 and (8 + length) % 8 == 0
        assert data[8 : 8 + length].rstrip(b" ").endswith(b"}"), "JSON, then space padding"
        assert header.pop("__metadata__") == {"format": "pt"}
        spans = sorted(tuple(e["data_offsets"]) for e in header.values())
        assert spans[0][0] == 0 and all(
            a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)
        )
        assert 8 + length + spans[-1][1] == len(data), "no trailing bytes"
        for name, e in header.items():
            size = ITEM_SIZE[e["dtype"]] * math.prod(e["shape"])
            assert e["data_offsets"][1] - e["data_offsets"][0] == size, name
        with safe_open(str(path), framework="numpy") as fh:
            assert set(fh.keys()) == set(header)


def test_index_covers_every_tensor_once(run):
    index, out = run["index"], run["out"]
    assert set(index) == {"metadata", "weight_map"} and set(index["metadata"]) == {"total_size"}
    seen: dict[str, str] = {}
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        _, header, _ = read_shard(out / shard)
        for name, e in header.items():
            if name != "__metadata__":
                assert name not in seen, f"{name} in {seen.get(name)} and {shard}"
                seen[name] = shard
                total += e["data_offsets"][1] - e["data_offsets"][0]
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total


def test_one_shard_is_model_safetensors_with_an_index(run, tmp_path):
    out = tmp_path / "one"
    convert(ConvertOptions(str(run["src"]), out, manifest="kimi-k3-any"))
    index = json.loads((out / contract.INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {contract.SINGLE_NAME}
    assert sorted(p.name for p in out.glob("*.safetensors")) == [contract.SINGLE_NAME]


# -- section 4: tensors before and after ----------------------------------------------------------


def test_w31_is_w3_then_w1_and_everything_else_is_unchanged(run):
    src, out = tensor_bytes(run["src"]), tensor_bytes(run["out"])
    spec = run["spec"]
    n, k = spec.n, spec.k
    fused = set()
    for name, (dtype, shape, data) in out.items():
        parsed = contract.parse_expert_name(name)
        assert parsed is None or parsed.proj in ("w2", "w31"), f"{name} left in the output"
        if parsed is not None and parsed.proj == "w31":
            up, gate = contract.source_halves(name)
            assert dtype == "U8" and data == src[up][2] + src[gate][2], name
            cols = k // 2 if parsed.suffix == "weight_packed" else k // 32
            assert shape == [2 * n, cols] and src[up][1] == src[gate][1] == [n, cols]
            fused |= {up, gate}
        else:
            assert src[name] == (dtype, shape, data), name
    assert set(src) == (set(out) - {t for t in out if ".w31." in t}) | fused
    layers = {}
    for name in out:
        parsed = contract.parse_expert_name(name)
        if parsed is not None:
            layers.setdefault(contract.layer_of(parsed.prefix), set()).add(parsed.expert)
    assert layers == {i: set(range(spec.experts)) for i in spec.moe_layers()}


# -- section 7: the checksums file ----------------------------------------------------------------


def test_checksums_file(run):
    doc, out, src = run["checksums"], run["out"], run["src"]
    header, rows = table("checksums-fields")
    fields = [unquote(r[0]) for r in rows]
    assert [f for f in fields if "." not in f] == list(doc)
    assert doc["format_version"] == CHECKSUMS_FORMAT == 1
    assert doc["tensor_checksum"] == TENSOR_HASH == "crc32"
    assert re.fullmatch(r"[0-9a-f]{64}", doc["plan_fingerprint"])
    files = doc["files"]
    listed = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert set(files) == listed - {contract.CHECKSUMS_NAME}, "every file but itself"
    shard_keys = {f.split(".", 2)[2] for f in fields if f.startswith("files.<shard>.")}
    other_keys = {f.split(".", 2)[2] for f in fields if f.startswith("files.<other>.")}
    source_index = json.loads((src / contract.INDEX_NAME).read_text())["weight_map"]
    shards = set(run["index"]["weight_map"].values())
    for name, entry in files.items():
        data = (out / name).read_bytes()
        assert entry["size"] == len(data)
        if name not in shards:
            assert set(entry) == other_keys and "header_sha256" not in entry
            assert entry["sha256"] == hashlib.sha256(data).hexdigest()
            continue
        assert set(entry) == shard_keys
        length, header, _ = read_shard(out / name)
        assert entry["header_sha256"] == hashlib.sha256(data[: 8 + length]).hexdigest()
        start = 8 + length
        crcs = {}
        for t, e in header.items():
            if t != "__metadata__":
                begin, end = e["data_offsets"]
                crcs[t] = f"{zlib.crc32(data[start + begin : start + end]):08x}"
        assert entry["tensors"] == crcs
        read_from = set()
        for t in crcs:
            read_from |= {source_index[s] for s in (contract.source_halves(t) or (t,))}
        assert set(entry["sources"]) == read_from
        for file, identity in entry["sources"].items():
            st = os.stat(src / file)
            assert identity == [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino], (
                "a local source is recorded as [size, mtime_ns, ctime_ns, inode]"
            )
    assert (out / contract.CHECKSUMS_NAME).read_bytes().count(b"\n") == 1


# -- sections 1-3 and 8: the tables the code defines ----------------------------------------------


def test_terms_table_matches_the_official_manifest():
    manifest = load_manifest("kimi-k3")
    _, rows = table("terms")
    assert {r[0]: unquote(r[1]) for r in rows} == manifest.dims
    for symbol, field, value, _ in rows:
        assert manifest.pinned[unquote(field)] == int(value), symbol


def test_name_examples_follow_the_grammar():
    _, rows = table("name-examples")
    kinds = set()
    for name, reading in rows:
        name = unquote(name)
        split = contract.expert_prefix_and_tail(name)
        parsed = contract.parse_expert_name(name)
        m = re.fullmatch(r"expert (\d+), (\w+), (\w+)", reading)
        if m:
            assert parsed == (split[0], int(m[1]), m[2], m[3]), name
            kinds.add("expert")
        elif reading == "not a routed-expert tensor":
            assert split is None, name
            kinds.add("other")
        else:
            assert reading == "invalid" and split is not None and parsed is None, name
            kinds.add("invalid")
    assert kinds == {"expert", "other", "invalid"}


def test_moe_layer_examples_follow_the_rule():
    header, rows = table("moe-layers")
    keys = header[:4]
    for row in rows:
        cfg = {}
        for key, cell in zip(keys, row[:4], strict=True):
            if cell != "absent":
                cfg[key] = json.loads(cell)  # 4, 4.0, true, null: as JSON reads them
        layers, problems = contract.moe_layer_ids({"text_config": cfg})
        if row[4] == "invalid":
            assert problems and {p.code for p in problems} == {Code.CONFIG_FIELD}, row
        else:
            assert not problems and layers == [int(x) for x in row[4].split(", ")], row


def test_e2m1_table_is_the_reference_decoding():
    _, rows = table("e2m1")
    codes = {}
    for row in rows:
        for code, bits, value in (row[0:3], row[4:7]):
            codes[int(code, 16)] = (int(bits.replace(" ", ""), 2), float(value))
    assert sorted(codes) == list(range(16))
    for code, (from_bits, value) in codes.items():
        ref = reference.E2M1_VALUES[code]
        assert from_bits == code and value == ref
        assert math.copysign(1, value) == math.copysign(1, ref)
    packed = np.array([[0x21, 0xF7]], dtype=np.uint8)  # low nibble first
    assert reference.unpack_fp4(packed).tolist() == [[0.5, 1.0, 6.0, -6.0]]


def test_e8m0_table_is_the_reference_decoding():
    _, rows = table("e8m0")
    for byte, scale in rows:
        got = float(reference.e8m0_to_float(np.array([int(byte, 16)], dtype=np.uint8))[0])
        if scale.startswith("NaN"):
            assert math.isnan(got)
        else:
            m = re.fullmatch(r"2\^(-?\d+)", scale)
            assert got == (2.0 ** int(m[1]) if m else float(scale)), byte


def test_versions():
    assert re.search(r"\*\*format version (\d+)\*\*", MD)[1] == str(contract.FORMAT_VERSION)
    assert re.search(r"\*\*checksums\s+file version (\d+)\*\*", MD)[1] == str(CHECKSUMS_FORMAT)
    assert contract.FORMAT_VERSIONS == (contract.FORMAT_VERSION,)
    assert contract.GROUP_SIZE == 32 == reference.GROUP_SIZE


def test_spec_has_every_marked_block_once():
    names = re.findall(r"<!-- spec-(?:example|table): ([\w-]+) -->", MD)
    assert (
        sorted(names)
        == sorted(set(names))
        == sorted(
            {
                "terms",
                "name-examples",
                "moe-layers",
                "e2m1",
                "e8m0",
                "block-fields",
                "checksums-fields",
                "commands",
                "config-block",
                "quantization-config",
                "index-entry",
                "w31-header-entry",
                "shard-layout",
                "w31-bytes",
                "checksums",
                "decode-vectors",
                "expert-vector",
            }
        )
    )


# -- section 11: known-answer vectors ------------------------------------------------------------
#
# A decoder written here from the spec's words alone (sections 3 and 4.2), in fp64 Python,
# never from converter/reference/: the spec's vectors must be what it computes, and what
# the code's known answers (converter/reference/known_answers.py) hold.


def _spec_value(v) -> float:
    return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}[v] if isinstance(v, str) else v


def _same_values(got: list[float], want: list[float]) -> bool:
    """Equal as values: NaN where NaN, and the sign of zero kept."""
    return len(got) == len(want) and all(
        (math.isnan(g) and math.isnan(w)) or (g == w and math.copysign(1, g) == math.copysign(1, w))
        for g, w in zip(got, want, strict=True)
    )


def _e2m1_by_hand(code: int) -> float:
    """Section 3's bits (s e1 e0 m): e = 0 is subnormal (m × 0.5), else 2^(e-1) × (1 + m/2)."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    magnitude = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return -magnitude if sign else magnitude


def _decode_by_hand(
    packed_rows: list[str], scale_rows: list[str], swap: bool = False, bias: int = 127
) -> list[list[float]]:
    """MXFP4 rows to values as an fp32 decoder must give them (`swap`/`bias`: wrong ones)."""
    out = []
    for prow, srow in zip(packed_rows, scale_rows, strict=True):
        codes = [
            c for b in bytes.fromhex(prow) for c in ((b >> 4, b & 15) if swap else (b & 15, b >> 4))
        ]
        scales = bytes.fromhex(srow)
        row = []
        for i, code in enumerate(codes):
            e = scales[i // 32]
            v = _e2m1_by_hand(code) * (math.nan if e == 0xFF else math.ldexp(1.0, e - bias))
            # Every value has at most 2 significant bits, so fp32 holds it exactly unless its
            # magnitude is 2^128 or more: then the fp32 result is +-inf (section 3).
            row.append(math.copysign(math.inf, v) if abs(v) >= 2.0**128 else v)
        out.append(row)
    return out


def test_decode_vectors_are_the_spec_decoded_by_hand():
    vectors = example_json("decode-vectors")
    assert len(vectors) == 3
    for vector in vectors:
        want = [[_spec_value(v) for v in row] for row in vector["values"]]
        assert all(
            _same_values(g, w)
            for g, w in zip(_decode_by_hand(vector["packed"], vector["scale"]), want, strict=True)
        ), vector["what"]
    # the answers a wrong decoder cannot give: every vector under a bias of 126 or 128, the
    # first under swapped nibbles
    for bias in (126, 128):
        assert all(
            not _same_values(
                _decode_by_hand(v["packed"], v["scale"], bias=bias)[0],
                [_spec_value(x) for x in v["values"][0]],
            )
            for v in vectors
        )
    first = vectors[0]
    assert _decode_by_hand(first["packed"], first["scale"], swap=True)[0] != [
        _spec_value(x) for x in first["values"][0]
    ]
    _, rows = table("e8m0")
    assert {int(byte, 16) for byte, _ in rows} == {0x00, 0x01, 0x7E, 0x7F, 0x80, 0xFE, 0xFF}


def test_decode_vectors_are_the_code_s_known_answers():
    from kimi_w31.converter.reference import known_answers

    vectors = example_json("decode-vectors")
    assert len(vectors) == len(known_answers.DECODE)
    for doc, code in zip(vectors, known_answers.DECODE, strict=True):
        assert doc["what"] == code["what"]
        assert doc["packed"] == list(code["packed"]) and doc["scale"] == list(code["scale"])
        assert len(doc["values"]) == len(code["values"])
        for drow, crow in zip(doc["values"], code["values"], strict=True):
            assert _same_values([_spec_value(v) for v in drow], list(crow)), doc["what"]
    _, rows = table("e8m0")
    assert {int(byte, 16) for byte, _ in rows} == set(known_answers.E8M0)


def _expert_by_hand(e: dict, variant: str = "") -> tuple[list, list, list]:
    """(x·gateᵀ, x·upᵀ, y) in fp64 from the spec's words; `variant` names a wrong reading."""
    k, n = e["K"], e["N"]
    swap, bias = variant == "swapped nibbles", {"bias 126": 126, "bias 128": 128}.get(variant, 127)
    w31 = _decode_by_hand(e["w31.weight_packed"], e["w31.weight_scale"], swap, bias)
    down = _decode_by_hand(e["w2.weight_packed"], e["w2.weight_scale"], swap, bias)
    assert len(w31) == 2 * n and len(w31[0]) == k and len(down) == k and len(down[0]) == n
    up, gate = w31[:n], w31[n:]  # rows [0, N) up, [N, 2N) gate
    if variant == "swapped halves":
        up, gate = gate, up
    beta, lin = e["situ_beta"], e["situ_linear_beta"]
    if variant == "swapped betas":
        beta, lin = lin, beta
    x = e["x"]
    g = [[sum(a * b for a, b in zip(t, row, strict=True)) for row in gate] for t in x]
    u = [[sum(a * b for a, b in zip(t, row, strict=True)) for row in up] for t in x]

    def situ(gv: float, uv: float) -> float:
        capped = beta * math.tanh(gv / beta)
        sig = 1 / (1 + math.exp(-(capped if variant == "sigmoid of the capped gate" else gv)))
        return capped * sig * lin * math.tanh(uv / lin)

    h = [[situ(a, b) for a, b in zip(gr, ur, strict=True)] for gr, ur in zip(g, u, strict=True)]
    y = [[sum(a * b for a, b in zip(t, row, strict=True)) for row in down] for t in h]
    return g, u, y


def _relative_error(got: list[list[float]], want: list[list[float]]) -> float:
    flat = [(a, b) for ga, wa in zip(got, want, strict=True) for a, b in zip(ga, wa, strict=True)]
    return max(abs(a - b) for a, b in flat) / max(abs(b) for _, b in flat)


def test_expert_vector_is_the_spec_computed_by_hand():
    e = example_json("expert-vector")
    assert (e["K"], e["N"], e["fc1_order"]) == (32, 32, ["up", "gate"])
    g, u, y = _expert_by_hand(e)
    assert g == e["gate"] and u == e["up"], "x·gateᵀ and x·upᵀ are exact"
    assert len(y) == len(e["y"]) == 2 and all(len(r) == 32 for r in e["y"])
    err = _relative_error(y, e["y"])
    assert err <= 1e-6, f"fp64 lands within ~1e-7 of the fp32 answer (got {err:.3g})"
    # every y is written as the shortest decimal that reads back as its fp32 number
    assert all(float(str(np.float32(v))) == v for row in e["y"] for v in row)


@pytest.mark.parametrize(
    "variant",
    [
        "swapped nibbles",
        "bias 126",
        "bias 128",
        "swapped halves",
        "swapped betas",
        "sigmoid of the capped gate",
    ],
)
def test_expert_vector_catches_a_wrong_reading(variant):
    """What section 11.2 says: each of these readings is off by more than 1 %."""
    e = example_json("expert-vector")
    _, _, y = _expert_by_hand(e, variant)
    assert _relative_error(y, e["y"]) > 0.01, variant


def test_expert_vector_is_the_code_s_known_answer():
    from kimi_w31.converter.reference import known_answers

    doc, code = example_json("expert-vector"), known_answers.EXPERT
    assert set(doc) == set(code)
    for key, value in code.items():
        if key.endswith("weight_scale"):
            assert "".join(doc[key]) == "".join(value), key
        elif isinstance(value, tuple):
            assert doc[key] == [list(v) if isinstance(v, tuple) else v for v in value], key
        else:
            assert doc[key] == value, key


# -- what the spec settles: the wrapper's places, an optional plan_fingerprint ------------------


def test_only_the_top_level_and_text_config_quantization_configs_are_wrapped(run):
    """6.3 "Where": a quantization_config elsewhere (a vision tower's) is carried unchanged."""
    source = copy.deepcopy(run["source_config"])
    vision = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    source["vision_config"] = {"hidden_size": 8, "quantization_config": vision}
    source["text_config"]["quantization_config"] = copy.deepcopy(source["quantization_config"])
    converted = contract.converted_config(source, run["config"]["kimi_w31"])
    for holder in (converted, converted["text_config"]):
        assert holder["quantization_config"]["quant_method"] == contract.WRAPPER_METHOD
    assert converted["vision_config"] == source["vision_config"]
    assert not contract.check_wrapped(converted)
    assert contract.unwrap_config(converted) == source


@pytest.mark.parametrize("fingerprint", [None, "", "made by another converter", 7])
def test_verify_does_not_require_plan_fingerprint(run, tmp_path, fingerprint):
    """Section 7: optional and opaque; a checker MUST NOT require or interpret it."""
    import shutil

    from kimi_w31.converter.audit import verify

    out = tmp_path / "out"
    shutil.copytree(run["out"], out)
    doc = json.loads((out / contract.CHECKSUMS_NAME).read_text())
    if fingerprint is None:
        del doc["plan_fingerprint"]
    else:
        doc["plan_fingerprint"] = fingerprint
    (out / contract.CHECKSUMS_NAME).write_text(json.dumps(doc) + "\n")
    report = verify(out, checksums=True, source=str(run["src"]))
    assert report.ok, [p.code for c in report.checks for p in c.problems]
