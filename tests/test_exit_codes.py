"""Exit codes belong to reason codes: each reason's record says its own (`errors.reason`), the
same in every command and in `--json`; no raise site chooses one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_helpers import run_cli
from kimi_w31.adapter.reasons import AdapterCode
from kimi_w31.converter.errors import EXIT_PROBLEMS, EXIT_USAGE, Fatal, Problem, reason
from kimi_w31.converter.reasons import Code
from reason_codes import ALL_CODES

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("converter", "adapter", "kimi_w31")
ANY = ["--manifest", "kimi-k3-any"]


# The reasons that exit as usage errors, as the README lists them: a record that changes its
# exit code changes the interface, and this table with it.
USAGE_REASONS = {
    Code.USAGE,
    Code.MANIFEST_NOT_FOUND,
    Code.MANIFEST_INVALID,
    Code.OUTPUT_INSIDE_SOURCE,
    Code.WINDOW_TOO_SMALL,
    Code.PATH_UNUSABLE,
    AdapterCode.AMBIGUOUS_FLAG,
    AdapterCode.BAD_FLAG,
    AdapterCode.EXPERT_SPLIT,
    AdapterCode.LANGUAGE_MODEL_ONLY,
}


def test_every_reason_exits_as_usage_or_as_a_problem():
    assert {c for c in ALL_CODES if reason(c).exit == EXIT_USAGE} == USAGE_REASONS
    assert {reason(c).exit for c in ALL_CODES if c not in USAGE_REASONS} == {EXIT_PROBLEMS}


def test_no_raise_site_chooses_an_exit_code():
    pattern = re.compile(
        r"\bexit_code\s*=\s*(?!exit_code_of\b)|\b(?:sys|ctx)\.exit\(\s*\d|SystemExit\(\s*\d"
    )
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and not line.lstrip().startswith("#"):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


@pytest.mark.parametrize("code", ALL_CODES)
def test_a_fatal_exits_as_its_reason_says(code):
    assert Fatal([Problem(code, "x")]).exit_code == reason(code).exit


def test_a_usage_reason_wins_over_a_data_reason():
    usage = [c for c in ALL_CODES if reason(c).exit == EXIT_USAGE]
    data = [c for c in ALL_CODES if reason(c).exit == EXIT_PROBLEMS]
    for u, d in zip(usage, data, strict=False):
        assert Fatal([Problem(d, "x"), Problem(u, "y")]).exit_code == EXIT_USAGE


# -- one reason, several commands: the same exit code, in the process and in --json ---------
def _non_empty(tmp: Path) -> Path:
    target = tmp / "full"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    return target


def _cases(small_source: Path, tmp: Path) -> list[tuple[Code, str, list[str], bool]]:
    """(reason, command, argv, prints --json): each reason reached from several commands."""
    full, src, absent = str(_non_empty(tmp)), str(small_source), str(tmp / "absent")
    return [
        (Code.OUTPUT_NOT_EMPTY, "synth", ["synth", full], False),
        (Code.OUTPUT_NOT_EMPTY, "convert", [src, full, *ANY], True),
        (Code.MANIFEST_NOT_FOUND, "convert", [src, str(tmp / "o1"), "--manifest", "nope"], True),
        (Code.MANIFEST_NOT_FOUND, "verify", ["verify", src, "--manifest", "nope"], True),
        (Code.USAGE, "convert", [src, str(tmp / "o2"), "--seed", "1"], False),
        (Code.USAGE, "convert", [src, str(tmp / "o3"), "--download-dir", "d"], True),
        (Code.USAGE, "verify", ["verify", src, "--seed", "1"], True),
        (Code.USAGE, "synth", ["synth", str(tmp / "s"), "--k", "33"], False),
        (Code.SOURCE_NOT_FOUND, "convert", [absent, str(tmp / "o4")], True),
        (Code.SOURCE_NOT_FOUND, "verify", ["verify", src, "--source", absent], True),
    ]


def test_the_same_reason_exits_the_same_in_every_command(small_source, tmp_path):
    seen: dict[Code, set[int]] = {}
    for code, command, argv, has_json in _cases(small_source, tmp_path):
        result = run_cli([*argv, "--json"] if has_json else argv, inprocess=True)
        seen.setdefault(code, set()).add(result.returncode)
        assert result.returncode == reason(code).exit, (command, argv, result.output)
        if has_json:
            doc = result.json
            assert doc["exit_code"] == result.returncode, (command, doc)
            codes = set(result.codes) | set(doc.get("codes", []))  # problems, verify's checks
            assert code.value in codes, (command, doc)
    assert all(len(exits) == 1 for exits in seen.values()), seen


def test_success_says_exit_code_0_in_json(small_source, tmp_path):
    result = run_cli([small_source, tmp_path / "o", *ANY, "--json"], inprocess=True)
    assert result.returncode == result.json["exit_code"] == 0
    result = run_cli(["verify", tmp_path / "o", "--json"], inprocess=True)
    assert result.returncode == result.json["exit_code"] == 0
