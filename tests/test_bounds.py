"""Bounds: config sizes far beyond any real model are refused with a code before anything
that size is built, in convert (--dry-run too) and verify, and --json stays JSON.

Each run is a real CLI subprocess under an address-space limit, so a regression that builds
a list of 10^10 layers fails fast (MemoryError: a crash, not JSON) instead of swapping.
"""

from __future__ import annotations

import json
import resource
import shutil

import pytest
from cli_helpers import run_cli
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from kimi_w31.converter.contract import CONFIG_NAME
from kimi_w31.converter.reasons import Code

LIMIT = 4 << 30  # far above what these small runs need, far below what the bug builds
# Address space a run reserves without using it grows with the core count (BLAS threads,
# malloc arenas): keep it small so the limit measures what the tool builds.
QUIET_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
SIZES = {"num_hidden_layers", "num_experts", "num_nextn_predict_layers", "n_routed_experts"}
REFUSED = {Code.CONFIG_BOUND.value, Code.CONFIG_CONFLICT.value}


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def run_json(*args) -> tuple[int, dict, set[str]]:
    """(exit code, the `--json` report, its reason codes), under the memory limit."""
    proc = run_cli([*args, "--json"], preexec_fn=_limited, env=QUIET_THREADS)
    if not isinstance(proc.json, dict):
        raise AssertionError(f"not JSON (exit {proc.returncode}):\n{proc.output}")
    return proc.returncode, proc.json, set(proc.codes)


def set_sizes(config_path, sizes: dict) -> None:
    config = json.loads(config_path.read_text())
    config["text_config"].update(sizes)
    config_path.write_text(json.dumps(config))


huge = st.dictionaries(
    st.sampled_from(sorted(SIZES)), st.integers(10**7, 10**15), min_size=1, max_size=3
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("bounds")
    run_cli(["synth", base / "src", "--layers", "3", "--experts", "4"], check=True)
    run_cli([base / "src", base / "out", "--manifest", "kimi-k3-any"], check=True)
    return base


# Few examples, no shrinking: each is a process; a failure names its sizes.
SLOW = settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
)


@SLOW
@given(sizes=huge, dry_run=st.booleans())
@example(sizes={"num_hidden_layers": 10**10}, dry_run=True)
@example(sizes={"n_routed_experts": 10**12}, dry_run=False)
def test_convert_refuses_huge_sizes(pair, sizes, dry_run):
    src = pair / "src-huge"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(pair / "src", src)
    set_sizes(src / CONFIG_NAME, sizes)
    out = pair / "out-huge"
    shutil.rmtree(out, ignore_errors=True)
    args = [src, out, "--manifest", "kimi-k3-any", *(["--dry-run"] if dry_run else [])]
    rc, doc, codes = run_json(*args)
    assert rc == 1 and codes & REFUSED, doc
    assert not list(out.glob("*.safetensors"))


@SLOW
@given(sizes=huge)
@example(sizes={"n_routed_experts": 10**7})
@example(sizes={"num_hidden_layers": 10**10, "num_experts": 10**12})
def test_verify_refuses_huge_sizes(pair, sizes):
    out = pair / "out-edited"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(pair / "out", out)
    set_sizes(out / CONFIG_NAME, sizes)
    rc, doc, codes = run_json("verify", out, "--source", pair / "src")
    assert rc == 1 and codes & REFUSED, doc
