"""`verify`'s structure level on damaged and hostile outputs: one mutation per reason code.

Each row plants one fault in a copy of a clean conversion (index, headers and checksums
kept consistent where the row says so, so that only the planted fault remains) and names
the codes verify must report. `exact` rows must report those codes and nothing else; the
others (a shard that cannot be read hides its tensors too) must report at least them.
Verify must never crash, never follow a name out of the output, and never write.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_helpers import run_cli
from kimi_w31.converter.audit import verify
from kimi_w31.converter.cli.verify import verify as command
from kimi_w31.converter.contract import STATE_DIR
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.output import verified
from kimi_w31.converter.output.directory import OutputDir
from kimi_w31.converter.reasons import Code
from verify_mutations import CONFIG, INDEX, Model, edit_json, read_shard, rerecord


def _qc(config: dict) -> dict:
    """The one quantization_config of a published-layout config: inside text_config."""
    return config["text_config"]["quantization_config"]


L1 = "language_model.model.layers.1.block_sparse_moe."
L2 = "language_model.model.layers.2.block_sparse_moe."
EXPERT = L1 + "experts.3."


@dataclass(frozen=True)
class Row:
    mutate: Callable[[Path], None]
    codes: set[Code]
    exact: bool = True
    manifest: str | None = None


def model_edit(fn: Callable[[Model], None]) -> Callable[[Path], None]:
    """Edit tensors, then write shards, index and checksums back consistently."""

    def mutate(out: Path) -> None:
        model = Model(out)
        fn(model)
        model.write()

    return mutate


def copy_layer(src: str, dst: str) -> Callable[[Model], None]:
    """Every routed-expert tensor of one prefix, again under another prefix."""

    def fn(model: Model) -> None:
        for name in [n for n in model.names() if n.startswith(src + "experts.")]:
            model.add(dst + name[len(src) :], model.get(name))

    return fn


def rename_experts(prefix: str) -> Callable[[Model], None]:
    """Routed experts named like a dense MLP (gate_proj/up_proj/down_proj)."""
    table = {".w31.": ".gate_proj.", ".w2.": ".down_proj."}

    def fn(model: Model) -> None:
        def new(name: str) -> str:
            if name.startswith(prefix) and ".experts." in name:
                for old, repl in table.items():
                    name = name.replace(old, repl)
            return name

        model.rename(new)

    return fn


def add_copy(name: str, like: str) -> Callable[[Model], None]:
    return lambda model: model.add(name, model.get(like))


def retype(name: str, dtype: str | None = None, shape: tuple | None = None):
    def fn(model: Model) -> None:
        t = model.get(name)
        if dtype:
            t.dtype = dtype
        if shape:
            t.shape = shape

    return fn


def config_edit(fn) -> Callable[[Path], None]:
    return lambda out: edit_json(out / CONFIG, fn)


def index_edit(fn) -> Callable[[Path], None]:
    return lambda out: edit_json(out / INDEX, fn)


def first_shard(out: Path) -> str:
    return json.loads((out / INDEX).read_text())["weight_map"][EXPERT + "w2.weight_scale"]


def map_shard(value) -> Callable[[Path], None]:
    """Point every index entry of one shard at `value`."""

    def mutate(out: Path) -> None:
        shard = first_shard(out)
        edit_json(
            out / INDEX,
            lambda ix: ix["weight_map"].update(
                {t: value for t, f in ix["weight_map"].items() if f == shard}
            ),
        )

    return mutate


def shard_bytes(fn: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def mutate(out: Path) -> None:
        path = out / first_shard(out)
        path.write_bytes(fn(path.read_bytes()))

    return mutate


def header_text(fn: Callable[[str], str]) -> Callable[[Path], None]:
    """Rewrite one shard's header JSON text (kept at its length when possible)."""

    def mutate(out: Path) -> None:
        path = out / first_shard(out)
        _, raw, start = read_shard(path)
        text = fn(raw[8:start].decode())
        body = text.encode()
        path.write_bytes(len(body).to_bytes(8, "little") + body + raw[start:])

    return mutate


def dup_key(text: str) -> str:
    header = json.loads(text)
    name, entry = next((k, v) for k, v in header.items() if k != "__metadata__")
    return text.rstrip()[:-1] + f",{json.dumps(name)}:{json.dumps(entry)}}}"


def write(rel: str, data: bytes = b"x") -> Callable[[Path], None]:
    def mutate(out: Path) -> None:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)

    return mutate


def deep_block_edit(key: str, value) -> Callable[[Path], None]:
    return config_edit(lambda c: c["kimi_w31"].__setitem__(key, value))


ROWS: dict[str, Row] = {
    # -- routed experts, derived from the config ---------------------------------------
    "a MoE layer's experts deleted (index and headers agree)": Row(
        model_edit(lambda m: m.remove(lambda n: n.startswith(L2 + "experts."))),
        {Code.LAYER_MISSING},
    ),
    "one expert deleted": Row(
        model_edit(lambda m: m.remove(lambda n: n.startswith(EXPERT))), {Code.LAYER_INCOMPLETE}
    ),
    "one expert tensor deleted": Row(
        model_edit(lambda m: m.remove(lambda n: n == EXPERT + "w2.weight_scale")),
        {Code.EXPERT_PARTNER_MISSING},
    ),
    "experts under a layer beyond num_hidden_layers": Row(
        model_edit(copy_layer(L1, "language_model.model.layers.7.block_sparse_moe.")),
        {Code.LAYER_UNEXPECTED},
    ),
    "experts in the dense layer 0": Row(
        model_edit(copy_layer(L1, "language_model.model.layers.0.block_sparse_moe.")),
        {Code.LAYER_UNEXPECTED},
    ),
    "one layer's experts under two prefixes": Row(
        model_edit(copy_layer(L1, "language_model.model.layers.1.moe.")), {Code.LAYER_DUPLICATED}
    ),
    "experts outside any layers.<i>.": Row(
        model_edit(copy_layer(L1, "language_model.model.mtp.block_sparse_moe.")),
        {Code.EXPERT_OUTSIDE_LAYER},
    ),
    "experts of one layer named gate_proj/down_proj": Row(
        model_edit(rename_experts(L1)), {Code.EXPERT_NAME, Code.LAYER_MISSING}
    ),
    "every expert named gate_proj/down_proj (zero experts)": Row(
        model_edit(rename_experts("language_model.")),
        {Code.EXPERT_NAME, Code.LAYER_MISSING, Code.NO_EXPERTS},
    ),
    "no routed expert at all": Row(
        model_edit(lambda m: m.remove(lambda n: ".experts." in n)),
        {Code.LAYER_MISSING, Code.NO_EXPERTS},
    ),
    "a w1 left beside the w31": Row(
        model_edit(add_copy(EXPERT + "w1.weight_packed", EXPERT + "w2.weight_packed")),
        # the w1 and the w31's gate half reach one parameter: counted as a consequence
        {Code.EXPERT_TENSOR_UNEXPECTED, Code.NAME_COLLISION},
    ),
    "a w31 split back into w1 and w3": Row(
        model_edit(
            lambda m: m.rename(
                lambda n: n.replace(EXPERT + "w31.weight_scale", EXPERT + "w3.weight_scale")
            )
        ),
        {Code.EXPERT_TENSOR_UNEXPECTED, Code.EXPERT_PARTNER_MISSING},
    ),
    "an expert id beyond num_experts": Row(
        model_edit(
            lambda m: [
                m.add(EXPERT.replace(".3.", ".8.") + r, m.get(EXPERT + r))
                for r in (
                    "w31.weight_packed",
                    "w31.weight_scale",
                    "w2.weight_packed",
                    "w2.weight_scale",
                )
            ]
        ),
        {Code.EXPERT_ID_RANGE},
    ),
    "an expert id with a leading zero": Row(
        model_edit(add_copy(L1 + "experts.03.w2.weight_scale", EXPERT + "w2.weight_scale")),
        {Code.EXPERT_NAME},
    ),
    "an expert name with a trailing newline": Row(
        model_edit(add_copy(EXPERT + "w2.weight_scale\n", EXPERT + "w2.weight_scale")),
        {Code.EXPERT_NAME},
    ),
    "an expert name with a unicode digit": Row(
        model_edit(add_copy(L1 + "experts.\u0663.w2.weight_scale", EXPERT + "w2.weight_scale")),
        {Code.EXPERT_NAME},
    ),
    "an expert tensor of the wrong dtype": Row(
        model_edit(retype(EXPERT + "w2.weight_scale", dtype="I8")), {Code.EXPERT_DTYPE}
    ),
    "an expert tensor of the wrong shape": Row(
        model_edit(
            lambda m: retype(
                EXPERT + "w31.weight_packed",
                shape=tuple(reversed(m.get(EXPERT + "w31.weight_packed").shape)),
            )(m)
        ),
        {Code.EXPERT_SHAPE},
    ),
    "config: one more layer than the experts cover": Row(
        config_edit(lambda c: c["text_config"].update(num_hidden_layers=4)), {Code.LAYER_MISSING}
    ),
    "config: a longer dense prefix": Row(
        config_edit(lambda c: c["text_config"].update(first_k_dense_replace=2)),
        {Code.LAYER_UNEXPECTED},
    ),
    "config: num_experts missing": Row(
        config_edit(lambda c: c["text_config"].pop("num_experts")), {Code.CONFIG_FIELD}
    ),
    # -- the config block ------------------------------------------------------------------
    "block removed": Row(config_edit(lambda c: c.pop("kimi_w31")), {Code.BLOCK_MISSING}),
    "block fc1_order reversed": Row(
        deep_block_edit("fc1_order", ["gate", "up"]), {Code.BLOCK_FIELD}
    ),
    "block format_version unknown": Row(deep_block_edit("format_version", 2), {Code.BLOCK_FIELD}),
    "block situ_beta edited": Row(deep_block_edit("situ_beta", 5.0), {Code.BLOCK_MISMATCH}),
    "quantization_config unwrapped": Row(
        config_edit(lambda c: c["text_config"].update(quantization_config=_qc(c)["base"])),
        {Code.NOT_WRAPPED},
    ),
    "quantization_config removed": Row(
        config_edit(lambda c: c["text_config"].pop("quantization_config")),
        {Code.NO_QUANTIZATION_CONFIG},
    ),
    "SiTU betas other than the manifest's": Row(
        config_edit(
            lambda c: (
                c["text_config"].update(activation_situ_beta=5.0),
                c["kimi_w31"].update(situ_beta=5.0),
            )
        ),
        {Code.SITU_MISMATCH, Code.BLOCK_MISMATCH},
    ),
    "dims other than the pinned manifest's": Row(
        lambda out: None, {Code.PINNED_MISMATCH}, manifest="kimi-k3"
    ),
    "config not JSON": Row(write(CONFIG, b"{"), {Code.JSON_INVALID}),
    "config missing": Row(lambda out: (out / CONFIG).unlink(), {Code.FILE_MISSING}),
    # -- the index -------------------------------------------------------------------------
    "index entry dropped": Row(
        index_edit(lambda ix: ix["weight_map"].pop(EXPERT + "w2.weight_scale")),
        {Code.INDEX_TENSOR_MISSING},
    ),
    "index names the wrong shard": Row(
        index_edit(
            lambda ix: ix["weight_map"].update(
                {EXPERT + "w2.weight_scale": sorted(set(ix["weight_map"].values()))[0]}
            )
        ),
        {Code.INDEX_WRONG_SHARD, Code.INDEX_TENSOR_NOT_IN_SHARD},
    ),
    "index names a tensor no shard has": Row(
        index_edit(
            lambda ix: ix["weight_map"].update(
                {"ghost.weight": sorted(set(ix["weight_map"].values()))[0]}
            )
        ),
        {Code.INDEX_TENSOR_NOT_IN_SHARD},
    ),
    "index total_size wrong": Row(
        index_edit(lambda ix: ix["metadata"].update(total_size=ix["metadata"]["total_size"] + 1)),
        {Code.INDEX_TOTAL_SIZE},
    ),
    "index without weight_map": Row(
        index_edit(lambda ix: ix.pop("weight_map")), {Code.INDEX_INVALID}
    ),
    "index not JSON": Row(write(INDEX, b"{not json"), {Code.JSON_INVALID}),
    "index entry absolute": Row(
        map_shard("/etc/passwd.safetensors"), {Code.WEIGHT_MAP_ENTRY_UNSAFE}, exact=False
    ),
    "index entry with ..": Row(
        map_shard("../out/x.safetensors"), {Code.WEIGHT_MAP_ENTRY_UNSAFE}, exact=False
    ),
    "index entry not .safetensors": Row(
        map_shard(CONFIG), {Code.WEIGHT_MAP_ENTRY_UNSAFE}, exact=False
    ),
    "index entry not a string": Row(map_shard(17), {Code.WEIGHT_MAP_ENTRY_UNSAFE}, exact=False),
    "index entry a list": Row(map_shard(["a"]), {Code.WEIGHT_MAP_ENTRY_UNSAFE}, exact=False),
    "index entry with a NUL byte": Row(
        map_shard("a\x00.safetensors"), {Code.WEIGHT_MAP_ENTRY_UNSAFE}, exact=False
    ),
    "index entry in the state folder": Row(
        map_shard(".kimi_w31/tmp/x.safetensors"), {Code.WEIGHT_MAP_ENTRY_UNSAFE}, exact=False
    ),
    "index entry ./x": Row(
        map_shard("./x.safetensors"), {Code.WEIGHT_MAP_ENTRY_UNSAFE}, exact=False
    ),
    "shard missing": Row(
        lambda out: (out / first_shard(out)).unlink(),
        {Code.SHARD_MISSING, Code.FILE_MISSING},
        exact=False,
    ),
    "shard replaced by a directory": Row(
        lambda out: ((out / first_shard(out)).unlink(), (out / first_shard(out)).mkdir()),
        {Code.NOT_A_REGULAR_FILE},
        exact=False,
    ),
    "a safetensors file the index does not name": Row(
        write("model-00099-of-00099.safetensors"), {Code.SHARD_UNREFERENCED, Code.FILE_UNRECORDED}
    ),
    # -- shard headers (the strict reader's codes, passed through) ---------------------------
    "shard truncated": Row(shard_bytes(lambda b: b[:-100]), {Code.FILE_TRUNCATED}, exact=False),
    "shard with trailing bytes": Row(
        shard_bytes(lambda b: b + b"\0" * 8), {Code.FILE_TRAILING_BYTES}, exact=False
    ),
    "shard of 3 bytes": Row(shard_bytes(lambda b: b[:3]), {Code.HEADER_TOO_SMALL}, exact=False),
    "header length 0": Row(
        shard_bytes(lambda b: bytes(8) + b[8:]), {Code.HEADER_LENGTH_ZERO}, exact=False
    ),
    "header length over 100 MB": Row(
        shard_bytes(lambda b: (200_000_000).to_bytes(8, "little") + b[8:]),
        {Code.HEADER_TOO_LARGE},
        exact=False,
    ),
    "header length beyond the file": Row(
        shard_bytes(lambda b: (len(b)).to_bytes(8, "little") + b[8:]),
        {Code.HEADER_BEYOND_FILE},
        exact=False,
    ),
    "header not UTF-8": Row(
        shard_bytes(lambda b: b[:8] + b"\xff" + b[9:]), {Code.HEADER_NOT_UTF8}, exact=False
    ),
    "header not JSON": Row(header_text(lambda t: "{" + t[2:]), {Code.HEADER_NOT_JSON}, exact=False),
    "header with a duplicate key": Row(
        header_text(dup_key), {Code.HEADER_DUPLICATE_KEY}, exact=False
    ),
    "header with an unknown dtype": Row(
        header_text(lambda t: t.replace('"U8"', '"U7"', 1)), {Code.HEADER_DTYPE}, exact=False
    ),
    # -- files -----------------------------------------------------------------------------
    "a stray file": Row(write("notes.txt"), {Code.FILE_UNRECORDED}),
    "a stray file in a subfolder": Row(write("extra/notes.txt"), {Code.FILE_UNRECORDED}),
    "a recorded file deleted": Row(
        lambda out: (out / "tokenizer_config.json").unlink(), {Code.FILE_MISSING}
    ),
    "a symlink in the output": Row(
        lambda out: (out / "link.txt").symlink_to("/etc/hostname"), {Code.NOT_A_REGULAR_FILE}
    ),
    "a FIFO in the output": Row(lambda out: os.mkfifo(out / "pipe"), {Code.NOT_A_REGULAR_FILE}),
    # -- incomplete ------------------------------------------------------------------------
    "no index": Row(lambda out: (out / INDEX).unlink(), {Code.INCOMPLETE_OUTPUT}),
    "no index, a run in progress": Row(
        lambda out: ((out / INDEX).unlink(), (out / STATE_DIR).mkdir()), {Code.INCOMPLETE_OUTPUT}
    ),
    "output is a file": Row(
        lambda out: (shutil.rmtree(out), out.write_text("x")), {Code.OUTPUT_NOT_DIRECTORY}
    ),
    "output missing": Row(lambda out: shutil.rmtree(out), {Code.OUTPUT_NOT_DIRECTORY}),
}


def _tree(root: Path) -> dict[str, int]:
    return (
        {str(p.relative_to(root)): p.lstat().st_size for p in root.rglob("*") if not p.is_dir()}
        if root.exists()
        else {}
    )


@pytest.mark.parametrize("case", list(ROWS))
def test_structure_fault_has_its_code(output_copy, case):
    row = ROWS[case]
    row.mutate(output_copy)
    before = _tree(output_copy.parent)
    report = verify(output_copy, manifest=row.manifest)
    # verify writes nothing; failing, it removes the record of an earlier passing one
    record = str(verified.record_path(output_copy).relative_to(output_copy.parent))
    assert _tree(output_copy.parent) == {k: v for k, v in before.items() if k != record}
    assert not report.ok
    assert {c.level for c in report.checks if c.ok is False} == {"structure"}
    if row.exact:
        assert report.codes == row.codes
    else:
        assert row.codes <= report.codes, report.codes


def test_every_structure_code_has_a_row():
    """The codes the structure level can report, each planted by at least one row."""
    planted = set().union(*(r.codes for r in ROWS.values()))
    structure_codes = {
        Code.LAYER_MISSING,
        Code.LAYER_INCOMPLETE,
        Code.LAYER_UNEXPECTED,
        Code.LAYER_DUPLICATED,
        Code.EXPERT_OUTSIDE_LAYER,
        Code.EXPERT_NAME,
        Code.EXPERT_TENSOR_UNEXPECTED,
        Code.EXPERT_ID_RANGE,
        Code.EXPERT_DTYPE,
        Code.EXPERT_SHAPE,
        Code.EXPERT_PARTNER_MISSING,
        Code.NO_EXPERTS,
        Code.BLOCK_MISSING,
        Code.BLOCK_FIELD,
        Code.BLOCK_MISMATCH,
        Code.NOT_WRAPPED,
        Code.NO_QUANTIZATION_CONFIG,
        Code.CONFIG_FIELD,
        Code.SITU_MISMATCH,
        Code.PINNED_MISMATCH,
        Code.INDEX_TENSOR_MISSING,
        Code.INDEX_WRONG_SHARD,
        Code.INDEX_TENSOR_NOT_IN_SHARD,
        Code.INDEX_TOTAL_SIZE,
        Code.INDEX_INVALID,
        Code.JSON_INVALID,
        Code.WEIGHT_MAP_ENTRY_UNSAFE,
        Code.SHARD_MISSING,
        Code.SHARD_UNREFERENCED,
        Code.NOT_A_REGULAR_FILE,
        Code.FILE_UNRECORDED,
        Code.FILE_MISSING,
        Code.INCOMPLETE_OUTPUT,
        Code.OUTPUT_NOT_DIRECTORY,
    }
    assert structure_codes <= planted, structure_codes - planted


def test_incomplete_output_says_whether_a_run_is_in_progress(output_copy):
    (output_copy / INDEX).unlink()
    idle = verify(output_copy).problems[0]
    (output_copy / STATE_DIR).mkdir()
    running = verify(output_copy).problems[0]
    assert idle.code == running.code == Code.INCOMPLETE_OUTPUT
    assert idle.found != running.found


def test_state_folder_is_not_a_stray(output_copy):
    OutputDir(output_copy).tmp.mkdir(parents=True)
    OutputDir(output_copy).ledger_path.write_text("{}\n")
    assert verify(output_copy).ok


def test_unknown_manifest_is_a_usage_error(converted):
    with pytest.raises(Fatal) as exc:
        verify(converted, manifest="no-such-manifest")
    assert exc.value.codes == [Code.MANIFEST_NOT_FOUND] and exc.value.exit_code == 2


def test_block_naming_an_unavailable_manifest_falls_back(output_copy):
    edit_json(output_copy / CONFIG, lambda c: c["kimi_w31"].update(manifest="my-own"))
    rerecord(output_copy)
    report = verify(output_copy)
    assert report.ok and "kimi-k3-any" in report.check("config").detail


# -- hostile names: never opened, never followed ------------------------------------------------


def _fifo_outside(out: Path) -> Path:
    fifo = out.parent / "fifo.safetensors"
    os.mkfifo(fifo)
    return fifo


@pytest.mark.parametrize("where", ["index", "checksums"])
def test_names_leading_outside_are_never_opened(output_copy, where):
    """A FIFO outside the output: opening it would block forever, so the test would hang."""
    fifo = _fifo_outside(output_copy)
    if where == "index":
        map_shard("../" + fifo.name)(output_copy)
        code = Code.WEIGHT_MAP_ENTRY_UNSAFE
        args = []
    else:
        edit_json(
            output_copy / "kimi_w31.checksums.json",
            lambda d: d["files"].update({"../" + fifo.name: {"size": 0, "sha256": "0" * 64}}),
        )
        code = Code.CHECKSUMS_INVALID
        args = ["--checksums"]
    proc = run_cli(["verify", output_copy, "--json", *args], timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert code.value in proc.json["codes"]


def test_fifo_swapped_in_for_a_recorded_file_is_never_opened(output_copy):
    (output_copy / "README.md").unlink()
    os.mkfifo(output_copy / "README.md")
    proc = run_cli(["verify", output_copy, "--checksums", "--json"], timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert Code.NOT_A_REGULAR_FILE.value in proc.json["codes"]


def test_hostile_outputs_never_crash_the_command(output_copy, tmp_path):
    """Every row through the real command line: exit 1 with codes, never a traceback."""
    for i, (case, row) in enumerate(ROWS.items()):
        out = tmp_path / f"case{i}"
        shutil.copytree(output_copy, out, symlinks=True)
        row.mutate(out)
        args = [str(out), "--checksums", "--json"]
        if row.manifest:
            args += ["--manifest", row.manifest]
        result = run_cli(args, inprocess=True, command=command)
        assert result.returncode == 1, (case, result.output)
        assert "Traceback" not in result.output and "KIMI_W31_DEBUG" not in result.output
        doc = result.json
        found = set(doc["codes"]) | set(doc["suppressed_codes"])  # listed, or counted
        assert row.codes <= found, (case, doc["codes"])
        if out.is_dir():
            shutil.rmtree(out)
        else:
            out.unlink(missing_ok=True)
