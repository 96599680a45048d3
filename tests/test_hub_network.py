"""Every request to the Hub is bounded, in time and in bytes (`converter/source/hub_net.py`).

- Time: an endpoint that accepts and never answers (the file list, or the header probes)
  stops the run, `--dry-run` included, with `hub-timeout` within seconds of the configured
  wait, exit 1, nothing written; retries are bounded (a property over generated failure
  sequences) and a timeout huggingface_hub raises is reported with the same code.
- Bytes: a server that ignores `Range` (200 with the whole file), or pads its answer far
  beyond what was asked, costs the bytes asked for, never the body: the header read is the
  one a local read gives, and the bytes the server got to send stay bounded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import faults as fl
import pytest
from cli_helpers import run_cli
from hub_server import FakeHub, Silent
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.safetensors_format import read_header
from kimi_w31.converter.source import hub as hub_source_mod
from kimi_w31.converter.source import hub_net
from kimi_w31.converter.source.hub import hub_error, open_repo, read_remote_header
from kimi_w31.converter.source.hub_net import NetSettings, is_timeout, with_retries
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint

REPO = "org/kimi-net"
ARGS = ["--manifest", "kimi-k3-any", "--max-shard-size", "600000"]
FAST = {"KIMI_W31_HUB_TIMEOUT": "0.3", "KIMI_W31_HUB_RETRIES": "1"}
PAD = 4 << 30  # what a server ignoring the range would send after the body: 4 GiB
SENT_BOUND = 64 << 20  # what it may get to send before the client hangs up (socket buffers)


@pytest.fixture(scope="module")
def net_source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("netsrc") / "repo"
    synth_checkpoint(root, SynthSpec(layers=3, experts=4, shards=3))
    return root


@pytest.fixture(scope="module")
def hub(net_source):
    with FakeHub({REPO: net_source}) as server:
        yield server


def _env(endpoint: str, tmp: Path, **extra: str | None) -> dict[str, str | None]:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(tmp / "hf_home"),
        HF_HUB_CACHE=str(tmp / "hf_cache"),
        HF_HUB_DISABLE_TELEMETRY="1",
        **FAST,
    )
    env.update(extra)
    return env


def _written(tmp: Path) -> list[str]:
    """Every file under tmp (the cache and the output included)."""
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())


# -- time ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dry_run", [True, False])
def test_an_endpoint_that_never_answers_stops_with_hub_timeout(tmp_path, dry_run):
    out = tmp_path / "out"
    extra = ["--dry-run"] if dry_run else []
    with Silent() as silent:
        started = time.monotonic()
        r = run_cli(
            [REPO, out, "--download", *ARGS, *extra, "--json"],
            env=_env(silent.endpoint, tmp_path),
            timeout=60,
        )
        took = time.monotonic() - started
    assert r.returncode == 1, r.output
    [problem] = r.problems
    assert (problem["code"], problem["file"]) == (Code.HUB_TIMEOUT.value, REPO)
    assert took < 30  # 2 tries x 0.3 s, a back-off, and the interpreter's start
    assert not out.exists() and _written(tmp_path) == []


def test_huggingface_hubs_own_wait_bounds_the_file_list_too(tmp_path):
    """No setting of ours: HF_HUB_ETAG_TIMEOUT, the user's wait for metadata, applies."""
    env = _env("", tmp_path, KIMI_W31_HUB_TIMEOUT=None, KIMI_W31_HUB_RETRIES=None)
    with Silent() as silent:
        env.update(HF_ENDPOINT=silent.endpoint, HF_HUB_ETAG_TIMEOUT="1")
        started = time.monotonic()
        r = run_cli([REPO, tmp_path / "out", "--download", *ARGS, "--dry-run", "--json"], env=env)
        took = time.monotonic() - started
    assert r.returncode == 1, r.output
    assert r.codes == [Code.HUB_TIMEOUT.value]
    assert took < 30  # 3 tries of 1 s and 1.5 s of back-off, and the interpreter's start


def test_header_probes_that_never_answer_stop_with_hub_timeout(hub, tmp_path):
    out = tmp_path / "out"
    hub.stall_probes = True
    try:
        r = run_cli(
            [REPO, out, "--download", *ARGS, "--dry-run", "--json"],
            env=_env(hub.endpoint, tmp_path),
            timeout=60,
        )
    finally:
        hub.stall_probes = False
    assert r.returncode == 1, r.output
    assert r.problems and {p["code"] for p in r.problems} == {Code.HUB_TIMEOUT.value}
    assert all(p["file"].endswith(".safetensors") for p in r.problems)  # the shard named
    assert not out.exists()


def test_a_probe_answer_dribbled_a_byte_at_a_time_ends_in_hub_timeout(hub, tmp_path):
    """Each byte arrives just inside the wait: the read still ends (the wait plus the asked
    bytes at `MIN_RATE`), with the same code."""
    hub.drip_probes = 0.05
    try:
        started = time.monotonic()
        r = run_cli(
            [REPO, tmp_path / "out", "--download", *ARGS, "--dry-run", "--json"],
            env=_env(hub.endpoint, tmp_path),
            timeout=60,
        )
        took = time.monotonic() - started
    finally:
        hub.drip_probes = 0.0
    assert r.returncode == 1, r.output
    assert r.problems and {p["code"] for p in r.problems} == {Code.HUB_TIMEOUT.value}
    assert took < 45


@fl.fuzz(40)
@given(
    failures=st.lists(st.sampled_from(["timeout", "reset", "other"]), max_size=6),
    retries=st.integers(0, 4),
)
def test_retries_are_bounded_and_only_for_transient_errors(failures, retries):
    """A call failing with `failures` in turn, then succeeding: retried only on a timeout or
    a dropped connection, at most `retries` times; spent retries on a timeout end in
    `hub-timeout`, any other error is the caller's as it is."""
    made = {
        "timeout": lambda: TimeoutError("timed out"),
        "reset": lambda: ConnectionResetError("reset"),
        "other": lambda: ValueError("bad"),
    }
    calls: list[float] = []

    def call(timeout: float) -> str:
        calls.append(timeout)
        if len(calls) <= len(failures):
            raise made[failures[len(calls) - 1]]()
        return "ok"

    net = NetSettings(timeout=0.25, retries=retries)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(hub_net.time, "sleep", lambda s: None)
        try:
            got: object = with_retries(call, net, "asking", "f")
        except Fatal as exc:
            got = exc.codes
        except (ValueError, ConnectionResetError) as exc:
            got = type(exc)
    # The model: stop at the first non-transient failure or once the retries are spent.
    expect, n = "ok", 0
    for i, kind in enumerate(failures):
        n = i + 1
        if kind == "other":
            expect = ValueError
            break
        if i == retries:
            expect = [Code.HUB_TIMEOUT] if kind == "timeout" else ConnectionResetError
            break
    else:
        n = len(failures) + 1
    assert got == expect
    assert len(calls) == n <= retries + 1
    assert all(t == 0.25 for t in calls)  # every try waits the configured time, no longer


@fl.fuzz(30)
@given(depth=st.integers(0, 3), via_cause=st.booleans(), timeout=st.booleans())
def test_a_timeout_anywhere_in_the_chain_is_a_hub_timeout(depth, via_cause, timeout):
    """huggingface_hub wraps a metadata timeout in its own error: the chain is what counts."""
    exc: BaseException = TimeoutError("read timed out") if timeout else OSError("refused")
    for i in range(depth):
        outer = RuntimeError(f"wrapped {i}")
        if via_cause:
            outer.__cause__ = exc
        else:
            outer.__context__ = exc
        exc = outer
    assert is_timeout(exc) is timeout
    code = hub_error(exc, "download", "f").codes
    assert code == [Code.HUB_TIMEOUT if timeout else Code.HUB_ERROR]


def test_httpx_timeouts_are_timeouts():
    import httpx2

    assert is_timeout(httpx2.ReadTimeout("slow"))
    assert is_timeout(httpx2.ConnectTimeout("slow"))
    assert not is_timeout(httpx2.ConnectError("refused"))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KIMI_W31_HUB_TIMEOUT", "0"),
        ("KIMI_W31_HUB_TIMEOUT", "-1"),
        ("KIMI_W31_HUB_TIMEOUT", "soon"),
        ("KIMI_W31_HUB_TIMEOUT", "inf"),
        ("KIMI_W31_HUB_TIMEOUT", "nan"),
        ("KIMI_W31_HUB_RETRIES", "-1"),
        ("KIMI_W31_HUB_RETRIES", "two"),
        ("KIMI_W31_HUB_RETRIES", "1.5"),
    ],
)
def test_unusable_network_settings_are_refused(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(Fatal) as exc:
        NetSettings.from_env()
    assert exc.value.codes == [Code.USAGE]


def test_network_settings_from_the_environment(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("KIMI_W31_HUB_TIMEOUT", raising=False)
    monkeypatch.delenv("KIMI_W31_HUB_RETRIES", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 10)
    assert NetSettings.from_env() == NetSettings(hub_net.DEFAULT_TIMEOUT, hub_net.DEFAULT_RETRIES)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 3)  # huggingface_hub's own setting
    assert NetSettings.from_env() == NetSettings(3.0, hub_net.DEFAULT_RETRIES)
    monkeypatch.setenv("KIMI_W31_HUB_TIMEOUT", "2.5")
    monkeypatch.setenv("KIMI_W31_HUB_RETRIES", "0")
    assert NetSettings.from_env() == NetSettings(2.5, 0)


# -- bytes -----------------------------------------------------------------------------------


@fl.fuzz(12)
@given(
    ignore_range=st.booleans(),
    pad=st.sampled_from([0, 1 << 20, PAD]),
    probe=st.integers(9, 4096),
    shard=st.integers(0, 2),
)
def test_a_header_read_costs_what_was_asked_whatever_the_server_sends(
    hub, net_source, ignore_range, pad, probe, shard
):
    """Range ignored or honoured, the answer padded by up to 4 GiB, a first probe shorter
    than the header (a second request then): the header is the local read's, and the
    server got to send a bounded number of bytes."""
    name = sorted(p.name for p in net_source.glob("*.safetensors"))[shard]
    repo = open_repo(REPO, None, endpoint=hub.endpoint, net=NetSettings(5.0, 0))
    hub.ignore_range, hub.pad_probes = ignore_range, pad
    hub.log.clear()
    since = hub.mark()
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(hub_source_mod, "HEADER_PROBE", probe)
            got = read_remote_header(repo, name, hub.endpoint, net=NetSettings(5.0, 0))
    finally:
        hub.ignore_range, hub.pad_probes = False, 0
    want = read_header(net_source / name, display_name=name)
    assert got == want
    assert hub.wait_quiet(name, since)  # a probe is logged once its (padded) answer is over
    probes = [r for r in hub.log if r.file == name and r.method == "GET"]
    assert probes and all(r.sent <= SENT_BOUND for r in probes), [r.sent for r in probes]


def test_a_dry_run_against_a_server_ignoring_ranges_stays_bounded(hub, tmp_path):
    """Through the CLI: every probe answered with the whole shard and 4 GiB more."""
    hub.ignore_range, hub.pad_probes = True, PAD
    hub.log.clear()
    try:
        started = time.monotonic()
        r = run_cli(
            [REPO, tmp_path / "out", "--download", *ARGS, "--dry-run", "--json"],
            env=_env(hub.endpoint, tmp_path),
            timeout=120,
        )
        took = time.monotonic() - started
    finally:
        hub.ignore_range, hub.pad_probes = False, 0
    assert r.returncode == 0, r.output
    probes = [x for x in hub.log if x.file and x.file.endswith(".safetensors")]
    assert probes and all(x.sent <= SENT_BOUND for x in probes)
    assert took < 60


@pytest.mark.parametrize("shift", [0, 1, 8])
def test_a_range_answered_from_elsewhere_is_refused(hub, net_source, shift):
    """A 206 whose Content-Range starts elsewhere than asked holds other bytes: refused
    with its code (shift 0: the negative control, read as asked)."""
    name = sorted(p.name for p in net_source.glob("*.safetensors"))[0]
    repo = open_repo(REPO, None, endpoint=hub.endpoint, net=NetSettings(5.0, 0))
    hub.shift_ranges = shift
    try:
        got: object = read_remote_header(repo, name, hub.endpoint, net=NetSettings(5.0, 0))
    except Fatal as exc:
        got = exc.codes
    finally:
        hub.shift_ranges = 0
    if shift:
        assert got == [Code.HUB_ERROR]
    else:
        assert got == read_header(net_source / name, display_name=name)


def test_a_download_that_never_answers_stops_with_hub_timeout(hub, net_source, tmp_path):
    """Where huggingface_hub makes the call (a shard's download), its own wait and bounded
    retries apply (HF_HUB_DOWNLOAD_TIMEOUT); spent, the run stops with the same code, names
    the shard, and leaves no index and no partial download."""
    import threading

    name = sorted(p.name for p in net_source.glob("*.safetensors"))[-1]
    held = hub.hold[name] = threading.Event()
    out = tmp_path / "out"
    try:
        started = time.monotonic()
        r = run_cli(
            [REPO, out, "--download", *ARGS, "--json"],
            env=_env(hub.endpoint, tmp_path, HF_HUB_DOWNLOAD_TIMEOUT="1"),
            timeout=120,
        )
        took = time.monotonic() - started
    finally:
        held.set()
        del hub.hold[name]
    assert r.returncode == 1, r.output
    assert [(p["code"], p["file"]) for p in r.problems] == [(Code.HUB_TIMEOUT.value, name)]
    assert took < 90
    assert not (out / "model.safetensors.index.json").exists()
    assert not list((tmp_path / "hf_cache").rglob("*.incomplete"))
