"""`verify`: a clean conversion passes every level; each level catches what it is for.

Assertions are on reason codes (`Code`), never on message text. Faults are planted in copies
of one session-wide conversion (`tests/conftest.py`); structure-level faults, one per code,
are in `test_fault_verify.py`.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kimi_w31.converter.audit import verify
from kimi_w31.converter.cli import verify as verify_command
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.reasons import Code
from verify_mutations import (
    CHECKSUMS,
    CONFIG,
    edit_json,
    forge_crc,
    locate,
    patch,
    read_shard,
    rerecord,
)

P = "language_model.model.layers.1.block_sparse_moe.experts.2."
W31 = P + "w31.weight_packed"
ALL_LEVELS = {"checksums": True, "numerics": True, "sample": None}


def failed(report) -> dict[str, set[Code]]:
    """check name -> the codes it failed with (passing and skipped checks left out)."""
    return {c.name: c.codes for c in report.checks if c.ok is False}


def cli(*args: object) -> tuple[int, str]:
    result = run_cli(args, inprocess=True, command=verify_command.verify)
    return result.returncode, result.output


# -- a clean conversion ----------------------------------------------------------------------


def test_clean_conversion_passes_every_level(converted, small_source):
    report = verify(converted, source=str(small_source), **ALL_LEVELS)
    assert report.ok, failed(report)
    assert report.levels == ["structure", "checksums", "source", "numerics"]
    names = [c.name for c in report.checks]
    assert names == [
        "index",
        "config",
        "experts",
        "shapes",
        "files",
        "checksums",
        "source-block",
        "source-config",
        "source-tensors",
        "source-files",
        "numerics",
    ]
    assert all(c.ok for c in report.checks)


def test_clean_conversion_passes_on_the_command_line(converted, small_source):
    args = ["verify", converted, "--checksums", "--source", small_source, "--numerics", "--all"]
    proc = run_cli([*args, "--json"])
    assert proc.returncode == 0, proc.stderr
    doc = proc.json
    assert doc["ok"] is True and doc["codes"] == []
    assert {c["name"] for c in doc["checks"]} >= {"index", "experts", "source-tensors", "numerics"}


def test_structure_only_is_the_default(converted):
    report = verify(converted)
    assert report.ok and report.levels == ["structure"]
    assert {c.level for c in report.checks} == {"structure"}


# -- --checksums -----------------------------------------------------------------------------


def test_flipped_byte_fails_checksums_not_structure(output_copy):
    patch(output_copy, P + "w31.weight_scale", lambda b: bytes([b[0] ^ 1]) + b[1:])
    assert verify(output_copy).ok  # headers alone cannot see it
    report = verify(output_copy, checksums=True)
    assert failed(report) == {"checksums": {Code.CHECKSUM_MISMATCH}}
    bad = report.check("checksums").problems[0]
    assert bad.tensor == P + "w31.weight_scale"
    code, _ = cli(output_copy, "--checksums", "--progress", "none")
    assert code == 1


def test_changed_extra_file_fails_checksums(output_copy):
    (output_copy / "tokenizer_config.json").write_text("{}")
    assert failed(verify(output_copy, checksums=True)) == {"checksums": {Code.FILE_SIZE_MISMATCH}}
    text = (output_copy / "README.md").read_text()
    (output_copy / "README.md").write_text(text.upper())
    assert Code.CHECKSUM_MISMATCH in verify(output_copy, checksums=True).codes


def test_changed_header_bytes_fail_checksums(output_copy):
    path, _, _ = locate(output_copy, W31)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"format":"pt"', b'"format":"np"', 1))
    assert verify(output_copy).ok
    assert failed(verify(output_copy, checksums=True)) == {"checksums": {Code.HEADER_HASH_MISMATCH}}


def test_nan_scale_is_found_with_its_position(output_copy):
    name = P + "w2.weight_scale"
    patch(output_copy, name, lambda b: b[:5] + b"\xff" + b[6:])
    rerecord(output_copy)  # only the scan can see it now
    report = verify(output_copy, checksums=True)
    assert failed(report) == {"checksums": {Code.SCALE_NAN}}
    problem = report.check("checksums").problems[0]
    assert problem.tensor == name and "byte 5 " in problem.what


@pytest.mark.parametrize(
    "damage",
    ["missing", "not json", "unknown algorithm", "no files", "unsafe name", "malformed entry"],
)
def test_unusable_checksums_file(output_copy, damage):
    path = output_copy / CHECKSUMS
    if damage == "missing":
        path.unlink()
    elif damage == "not json":
        path.write_text("[")
    else:

        def edit(doc):
            if damage == "unknown algorithm":
                doc["tensor_checksum"] = "md4"
            elif damage == "no files":
                del doc["files"]
            elif damage == "unsafe name":
                doc["files"]["../outside.txt"] = {"size": 1, "sha256": "0" * 64}
            else:
                doc["files"]["tokenizer_config.json"] = {"size": "big"}

        edit_json(path, edit)
    report = verify(output_copy, checksums=True)
    want = {"checksums": {Code.CHECKSUMS_INVALID}}
    if damage == "malformed entry":  # the entry is dropped: its file counts as unrecorded
        want["files"] = {Code.FILE_UNRECORDED}
    assert failed(report) == want  # the file's own problems are the checksums level's


# -- --source: byte for byte, from the contract ----------------------------------------------------


def _swap_halves(data: bytes) -> bytes:
    half = len(data) // 2
    return data[half:] + data[:half]  # [gate; up]


def test_forged_crc_passes_checksums_but_fails_source(output_copy, small_source):
    """A w31 stored [gate; up], with 4 bytes patched so its CRC-32 is what was recorded."""
    recorded = json.loads((output_copy / CHECKSUMS).read_text())
    shard, _, _ = locate(output_copy, W31)
    want = int(recorded["files"][shard.name]["tensors"][W31], 16)
    patch(output_copy, W31, lambda b: forge_crc(_swap_halves(b), want, at=len(b) // 2 - 4))
    report = verify(output_copy, checksums=True, source=str(small_source))
    assert report.check("checksums").ok  # CRC-32 is for accidents, not for tampering
    assert failed(report) == {"source-tensors": {Code.W31_NOT_UP_GATE}}
    assert report.check("source-tensors").problems[0].tensor == W31


def test_source_works_without_the_checksums_file(output_copy, small_source):
    (output_copy / CHECKSUMS).unlink()
    report = verify(output_copy, source=str(small_source))
    assert report.ok, failed(report)
    assert report.check("checksums").ok is None and report.check("files").ok is None
    assert report.check("source-tensors").ok
    patch(output_copy, W31, _swap_halves)
    assert failed(verify(output_copy, source=str(small_source))) == {
        "source-tensors": {Code.W31_NOT_UP_GATE}
    }


def test_source_finds_a_stray_file_without_the_checksums_file(output_copy, small_source):
    (output_copy / CHECKSUMS).unlink()
    (output_copy / "notes.txt").write_text("not from the source")
    assert failed(verify(output_copy, source=str(small_source))) == {
        "source-files": {Code.FILE_NOT_FROM_SOURCE}
    }


def test_changed_non_expert_tensor_and_extra_file_fail_source(output_copy, small_source):
    name = "language_model.model.norm.weight"
    patch(output_copy, name, lambda b: bytes(len(b)))
    (output_copy / "encoding_k3.py").write_text("{{ tampered }}\n" + "x" * 52)
    rerecord(output_copy)
    report = verify(output_copy, checksums=True, source=str(small_source))
    assert failed(report) == {
        "source-tensors": {Code.BYTES_DIFFER},
        "source-files": {Code.BYTES_DIFFER},
    }


def test_config_edit_fails_source(output_copy, small_source):
    edit_json(output_copy / CONFIG, lambda c: c["text_config"].update(rope_theta=1.0))
    rerecord(output_copy)
    report = verify(output_copy, checksums=True, source=str(small_source))
    assert failed(report) == {"source-config": {Code.CONFIG_DIFFERS}}


@pytest.mark.parametrize(
    ("field", "edit", "code"),
    [
        ("dims", lambda b: b["dims"].update(N=b["dims"]["N"] * 2), Code.BLOCK_MISMATCH),
        ("dims", lambda b: b["dims"].pop("E"), Code.BLOCK_MISMATCH),
        (
            "source identity",
            lambda b: next(iter(b["source"]["files"].values())).update(size=1),
            Code.SOURCE_CHANGED_SINCE,
        ),
        (
            "source identity",
            lambda b: next(iter(b["source"]["files"].values())).update(header_sha256="0" * 64),
            Code.SOURCE_CHANGED_SINCE,
        ),
        (
            "source identity",
            lambda b: b["source"]["files"].update(
                {"model-00009-of-00009.safetensors": {"size": 1, "header_sha256": "0" * 64}}
            ),
            Code.SOURCE_CHANGED_SINCE,
        ),
        ("manifest_sha256", lambda b: b.update(manifest_sha256="0" * 64), Code.BLOCK_MISMATCH),
    ],
)
def test_block_informational_fields_are_checked_against_the_source(
    output_copy, small_source, field, edit, code
):
    edit_json(output_copy / CONFIG, lambda c: edit(c["kimi_w31"]))
    rerecord(output_copy)
    report = verify(output_copy, checksums=True, source=str(small_source))
    assert report.check("index").ok and report.check("experts").ok  # structure cannot tell
    assert failed(report) == {"source-block": {code}}, field


def test_changed_source_is_reported_as_such_not_as_corruption(converted, source_copy):
    name = P + "w1.weight_packed"
    patch(source_copy, name, lambda b: bytes(len(b)))  # data only: same size and header
    report = verify(converted, source=str(source_copy))
    # Nothing but the bytes can tell: the w31's gate half differs.
    assert failed(report) == {"source-tensors": {Code.W31_NOT_UP_GATE}}
    # Once the shard's header changes too, the block's source identity names the cause.
    shard, _, _ = locate(source_copy, name)
    header, raw, start = read_shard(shard)
    header["__metadata__"] = {"format": "pt", "edited": "yes"}
    body = json.dumps(header).encode()
    body += b" " * (-(8 + len(body)) % 8)
    shard.write_bytes(len(body).to_bytes(8, "little") + body + raw[start:])
    report = verify(converted, source=str(source_copy))
    assert failed(report) == {
        "source-block": {Code.SOURCE_CHANGED_SINCE},
        "source-tensors": {Code.SOURCE_CHANGED_SINCE},
    }


def test_missing_and_extra_tensors_against_the_source(output_copy, small_source):
    from verify_mutations import Model, Tensor

    model = Model(output_copy)
    model.remove(lambda n: n == "language_model.model.norm.weight")
    model.add("language_model.model.extra.weight", Tensor("U8", (4,), b"abcd"))
    model.write()
    report = verify(output_copy, checksums=True, source=str(small_source))
    assert failed(report) == {"source-tensors": {Code.TENSOR_MISSING, Code.TENSOR_NOT_FROM_SOURCE}}


def test_dtype_and_shape_against_the_source(output_copy, small_source):
    from verify_mutations import Model

    model = Model(output_copy)
    norm = model.get("language_model.model.norm.weight")
    norm.dtype = "F16"
    lm = model.get("language_model.lm_head.weight")
    lm.shape = (lm.shape[1], lm.shape[0])
    model.write()
    report = verify(output_copy, source=str(small_source))
    assert failed(report) == {
        "shapes": {Code.INVENTORY_SHAPE},  # lm_head's shape is the config's business too
        "source-tensors": {Code.TENSOR_DTYPE_DIFFERS, Code.TENSOR_SHAPE_DIFFERS},
    }


def _bad_sources(converted: Path, tmp_path: Path) -> dict[str, tuple[str, Code, int]]:
    """A --source that cannot be one, the reason, and the exit code."""
    empty = tmp_path / "empty"
    empty.mkdir()
    other_output = tmp_path / "another-output"
    shutil.copytree(converted, other_output)
    return {
        "the output": (str(converted), Code.USAGE, 2),
        "missing": (str(tmp_path / "nowhere"), Code.SOURCE_NOT_FOUND, 1),
        "no weights": (str(empty), Code.FILE_MISSING, 1),
        "a converted checkpoint": (str(other_output), Code.ALREADY_MARKED, 1),
    }


@pytest.mark.parametrize("case", ["the output", "missing", "no weights", "a converted checkpoint"])
def test_a_bad_source_is_refused_before_any_data_is_read(
    converted, small_source, tmp_path, monkeypatch, case
):
    import kimi_w31.converter.audit as audit

    def must_not_run(*args, **kwargs):
        raise AssertionError("data read before the arguments were judged")

    monkeypatch.setattr(audit, "check_structure", must_not_run)
    monkeypatch.setattr(audit, "check_checksums", must_not_run)
    spec, code, exit_code = _bad_sources(converted, tmp_path)[case]
    with pytest.raises(Fatal) as err:
        verify(converted, checksums=True, source=spec)
    assert err.value.codes == [code] and err.value.exit_code == exit_code
    # negative control: the real source passes the same gate
    assert audit.locate_source(str(small_source), converted) == small_source.resolve()


def test_a_bad_source_exits_before_the_checksum_pass(converted, tmp_path):
    got = run_cli(["verify", converted, "--checksums", "--source", converted, "--json"])
    assert got.returncode == 2 and got.json["problems"][0]["code"] == Code.USAGE.value


# A property: any byte change in any tensor, however placed, is caught by --source.


@pytest.fixture(scope="module")
def mutable_output(converted, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prop") / "out"
    shutil.copytree(converted, out)
    return out


def _tensor_ranges(out: Path) -> list[tuple[str, Path, int, int]]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    return [(name, *locate(out, name)) for name in sorted(index["weight_map"])]


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_source_catches_any_byte_change(mutable_output, small_source, data):
    ranges = _tensor_ranges(mutable_output)
    name, path, begin, end = data.draw(st.sampled_from(ranges))
    flips = data.draw(
        st.lists(
            st.tuples(st.integers(0, end - begin - 1), st.integers(1, 255)), min_size=1, max_size=4
        )
    )
    original = path.read_bytes()
    raw = bytearray(original)
    for pos, mask in flips:
        raw[begin + pos] ^= mask
    if raw == original:  # two flips that cancel out: nothing changed
        return
    path.write_bytes(bytes(raw))
    try:
        report = verify(mutable_output, source=str(small_source), workers=1)
    finally:
        path.write_bytes(original)
    codes = failed(report).get("source-tensors", set())
    assert codes <= {Code.BYTES_DIFFER, Code.W31_NOT_UP_GATE} and codes, failed(report)
    assert {p.tensor for p in report.check("source-tensors").problems} == {name}


# -- --numerics ---------------------------------------------------------------------------------


def test_swapped_halves_with_forged_records_fail_source_and_numerics(output_copy, small_source):
    for suffix in ("weight_packed", "weight_scale"):
        patch(output_copy, P + "w31." + suffix, _swap_halves)
    rerecord(output_copy)
    report = verify(output_copy, source=str(small_source), **ALL_LEVELS)
    assert report.check("checksums").ok
    assert failed(report) == {
        "source-tensors": {Code.W31_NOT_UP_GATE},
        "numerics": {Code.NUMERICS_DIFFER},
    }
    assert [p.tensor for p in report.check("numerics").problems] == [P + "*"]


def test_swapped_betas_in_the_block_fail_numerics(output_copy, small_source):
    def swap(config):
        block = config["kimi_w31"]
        block["situ_beta"], block["situ_linear_beta"] = (
            block["situ_linear_beta"],
            block["situ_beta"],
        )

    edit_json(output_copy / CONFIG, swap)
    report = verify(output_copy, source=str(small_source), numerics=True, sample=3)
    assert Code.BLOCK_MISMATCH in failed(report)["config"]
    assert failed(report)["numerics"] == {Code.NUMERICS_DIFFER}


def test_reversed_fc1_order_fails_numerics(output_copy, small_source):
    edit_json(output_copy / CONFIG, lambda c: c["kimi_w31"].update(fc1_order=["gate", "up"]))
    report = verify(output_copy, source=str(small_source), numerics=True, sample=2)
    assert failed(report)["config"] == {Code.BLOCK_FIELD}
    assert failed(report)["numerics"] == {Code.NUMERICS_DIFFER}


@pytest.mark.parametrize(
    "edit",
    [
        lambda block: block.update(fc1_order=["up", "up"]),  # no gate half to compute with
        lambda block: block.update(situ_beta="4"),  # no number to compute with
    ],
)
def test_a_block_numerics_cannot_compute_with_is_said_so(output_copy, small_source, edit):
    edit_json(output_copy / CONFIG, lambda c: edit(c["kimi_w31"]))
    report = verify(output_copy, source=str(small_source), numerics=True, sample=2)
    assert failed(report)["numerics"] == {Code.NUMERICS_UNAVAILABLE}


def test_numerics_sample_is_seeded(converted, small_source):
    def chosen(seed):
        report = verify(converted, source=str(small_source), numerics=True, sample=3, seed=seed)
        return report.check("numerics").detail

    assert chosen(1) == chosen(1)
    assert (
        verify(converted, source=str(small_source), numerics=True, sample=None)
        .check("numerics")
        .detail.startswith("16 experts")
    )


# -- the command ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--numerics"],
        ["--experts", "0", "--numerics"],
        ["--experts", "3"],
        ["--all"],
        ["--seed", "1"],
        ["--numerics", "--source", ".", "--all", "--experts", "2"],
        ["--workers", "0"],
        ["--manifest", "no-such-manifest"],
        ["--progress", "sometimes"],
    ],
)
def test_usage_errors_exit_2(converted, args):
    code, _ = cli(converted, *args)
    assert code == 2


def test_json_lists_problems_with_codes(output_copy):
    (output_copy / "stray.bin").write_bytes(b"x")
    code, text = cli(output_copy, "--json")
    doc = json.loads(text)
    assert code == 1 and doc["ok"] is False and doc["codes"] == [Code.FILE_UNRECORDED.value]
    files = next(c for c in doc["checks"] if c["name"] == "files")
    assert files["problems"][0]["code"] == Code.FILE_UNRECORDED.value
    assert files["problems"][0]["file"] == "stray.bin"


def test_report_is_one_line_per_check_then_problems(output_copy):
    (output_copy / "stray.bin").write_bytes(b"x")
    code, text = cli(output_copy, "--progress", "none")
    lines = text.splitlines()
    assert code == 1
    assert sum(1 for line in lines if line.lstrip().startswith(("ok", "FAIL", "skip"))) == 5
    assert any(f"[{Code.FILE_UNRECORDED.value}]" in line for line in lines)


def test_quiet_prints_only_problems(converted, output_copy):
    assert cli(converted, "-q") == (0, "")
    (output_copy / "stray.bin").write_bytes(b"x")
    code, text = cli(output_copy, "-q")
    assert code == 1 and "stray.bin" in text and "ok" not in text.split()


def test_progress_lines_have_a_total(converted, small_source):
    proc = run_cli(
        [
            "verify",
            converted,
            "--checksums",
            "--source",
            small_source,
            "--numerics",
            "--experts",
            "2",
            "--progress",
            "lines",
        ],
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("verify --")]
    for label in ("verify --checksums:", "verify --source:", "verify --numerics:"):
        mine = [line for line in lines if line.startswith(label)]
        assert mine and all("/?" not in line for line in mine), label
        assert "(100%)" in mine[-1]
    assert any("expert 2 of 2" in line for line in lines)


def test_ctrl_c_says_verify_stopped(converted, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_command, "run_verify", interrupted)
    code, text = cli(converted, "--checksums")
    assert code == 130
    assert verify_command.INTERRUPTED in " ".join(text.split())


def test_help_teaches(converted):
    code, text = cli("--help")
    assert code == 0
    for word in (
        "OUT_DIR",
        "--source SRC_DIR_OR_REPO_ID",
        "--experts N",
        "--seed N",
        "--manifest NAME_OR_PATH",
        "--workers N",
        "Examples:",
        "Exit codes:",
    ):
        assert word in text, word


def test_serve_preflight_shape(converted, output_copy):
    """`adapter/sglang/launch.py` calls verify(root) and reads .ok and checks[*].ok/.problems."""
    report = verify(converted)
    assert report.ok and all(hasattr(c, "problems") for c in report.checks)
    (output_copy / "model.safetensors.index.json").unlink()
    report = verify(output_copy)
    assert not report.ok
    assert [p.code for c in report.checks if c.ok is False for p in c.problems] == [
        Code.INCOMPLETE_OUTPUT
    ]


# -- independence --------------------------------------------------------------------------------

FORBIDDEN = {"plan", "validate", "pipeline", "execute", "synth"}
VERIFY_DIR = Path(__file__).resolve().parents[1] / "converter" / "audit"


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, resolved to a dotted name under `kimi_w31.converter`."""
    package = ["kimi_w31", "converter", "audit"]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_verify_imports_neither_planner_nor_executor():
    files = sorted(VERIFY_DIR.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        for module in _imported_modules(path):
            parts = module.split(".")
            if parts[:2] == ["kimi_w31", "converter"] and len(parts) > 2:
                assert parts[2] not in FORBIDDEN, f"{path.name} imports {module}"
            assert parts[0] != "torch", f"{path.name} imports torch"


def test_importing_verify_loads_neither_planner_nor_executor_nor_torch():
    code = (
        "import sys, kimi_w31.converter.cli.verify, kimi_w31.converter.audit.numerics\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or "
        "m.split('.')[:3] in [['kimi_w31', 'converter', x] for x in "
        f"{sorted(FORBIDDEN)!r}]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
