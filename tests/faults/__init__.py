"""Fault injection for the `test_fault_*` suites and `tools/fault_table.py`, one module per
fault class over a thin shared core (`core`: outcomes, `Case`, sources, trees, the judges).

Each scenario runs the real converter through `cli_helpers.run_cli` and returns `Case`
rows; the tests assert on them and the fault table prints them. The names a test needs
are re-exported here (`import faults as fl`); `SCENARIOS` is the table's row order.
"""

from __future__ import annotations

from cli_helpers import json_problems, run_cli

from . import filesystem
from .aliases import alias_cases
from .arguments import argument_cases
from .bundle import bundle_cases
from .concurrency import concurrency_cases, lock_race_cases
from .config import bound_cases, config_cases, file_set_cases
from .core import (
    CLEAN,
    CORRECT,
    CRASH,
    INDEX,
    MANIFEST,
    OUTCOMES,
    RESUMED,
    SHARD_SIZE,
    STATE,
    VICTIM,
    WRONG,
    Case,
    bad_rows,
    classify_error,
    codes,
    convert_args,
    copy_source,
    fuzz,
    hostile_cases,
    looks_like_crash,
    make_source,
    read_shard,
    reference_output,
    shard_bytes,
    tensor_names,
    tree,
    tree_diff,
)
from .crash import crash_cases, kill_points, label_totals, sigint_cases, torn_ledger_cases
from .data import data_fault_cases
from .disk import disk_full_cases, dry_run_space_cases, free_space_cases
from .headers import HEADER_CASES, header_bound_cases, header_cases
from .hub import hub_cases
from .library import library_cases
from .paths import path_cases
from .planner import PLAN_CASES, plan_cases
from .publish import publish_proof_cases
from .shapes import shape_cases
from .source_change import header_swap_case, source_change_cases
from .source_tree import INDEX_CASES, index_cases
from .verify import verify_fifo_case, verify_hostile_cases

__all__ = [
    "alias_cases",
    "CLEAN",
    "CORRECT",
    "CRASH",
    "HEADER_CASES",
    "INDEX",
    "INDEX_CASES",
    "MANIFEST",
    "OUTCOMES",
    "PLAN_CASES",
    "RESUMED",
    "SHARD_SIZE",
    "STATE",
    "VICTIM",
    "WRONG",
    "Case",
    "argument_cases",
    "bad_rows",
    "bound_cases",
    "classify_error",
    "codes",
    "concurrency_cases",
    "config_cases",
    "convert_args",
    "copy_source",
    "crash_cases",
    "data_fault_cases",
    "disk_full_cases",
    "dry_run_space_cases",
    "file_set_cases",
    "filesystem",
    "free_space_cases",
    "fuzz",
    "header_bound_cases",
    "header_cases",
    "header_swap_case",
    "hub_cases",
    "hostile_cases",
    "index_cases",
    "json_problems",
    "kill_points",
    "label_totals",
    "bundle_cases",
    "library_cases",
    "lock_race_cases",
    "looks_like_crash",
    "make_source",
    "path_cases",
    "plan_cases",
    "publish_proof_cases",
    "read_shard",
    "reference_output",
    "run_cli",
    "shard_bytes",
    "shape_cases",
    "sigint_cases",
    "source_change_cases",
    "tensor_names",
    "torn_ledger_cases",
    "tree",
    "tree_diff",
    "verify_fifo_case",
    "verify_hostile_cases",
]
