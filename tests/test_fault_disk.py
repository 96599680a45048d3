"""Disk full: a file-size limit makes writes fail (EFBIG) like a full disk; the free-space
check up front; --dry-run states the space needed."""

from __future__ import annotations

from pathlib import Path

import faults as fl
import pytest


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fl.make_source(tmp_path_factory.mktemp("disk") / "template")


def test_disk_full_is_a_clean_error_then_resumes(template: Path, tmp_path: Path) -> None:
    rows = fl.disk_full_cases(template, tmp_path)
    assert len(rows) == 2
    assert not fl.bad_rows(rows, {fl.RESUMED}), fl.bad_rows(rows, {fl.RESUMED})
    # The problem (code no-space) names the shard being written.
    assert all(r.detail.endswith(".safetensors") for r in rows), rows


def test_free_space_checked_up_front(template: Path, tmp_path: Path) -> None:
    rows = fl.free_space_cases(template, tmp_path)
    assert not fl.bad_rows(rows, {fl.CLEAN}), fl.bad_rows(rows, {fl.CLEAN})


def test_dry_run_reports_space_needed(template: Path, tmp_path: Path) -> None:
    rows = fl.dry_run_space_cases(template, tmp_path)
    assert not fl.bad_rows(rows, {fl.CORRECT}), fl.bad_rows(rows, {fl.CORRECT})
