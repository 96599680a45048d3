"""Every reason code has a negative test that asserts it (one variant, one test, like the
safetensors reader's errors): a code no test names is a reason nobody has seen happen."""

from __future__ import annotations

import re
from pathlib import Path

from reason_codes import ALL_CODES

TESTS = Path(__file__).resolve().parent


def _named_in_tests() -> set[str]:
    text = "\n".join(p.read_text() for p in TESTS.rglob("*.py") if p.name != Path(__file__).name)
    by_member = set(re.findall(r"\b(?:Code|AdapterCode|C)\.([A-Z_0-9]+)\b", text))
    by_value = set(re.findall(r'"([a-z0-9]+(?:-[a-z0-9]+)+)"', text)) | set(
        re.findall(r"'([a-z0-9]+(?:-[a-z0-9]+)+)'", text)
    )
    return {c.value for c in ALL_CODES if c.name in by_member or c.value in by_value}


def test_every_reason_code_is_asserted_by_some_test():
    named = _named_in_tests()  # once: it reads every test file
    missing = sorted(c.value for c in ALL_CODES if c.value not in named)
    assert missing == [], f"codes no test asserts: {missing}"


def test_codes_are_stable_kebab_case_and_unique():
    values = [c.value for c in ALL_CODES]
    assert len(values) == len(set(values))
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", v) for v in values)
