"""`kimi-convert serve` tells before starting and says how to recover: the layout SGLang
would run (expert split, MoE-DP), GPUs on this machine, an unfinished conversion, text-only
serving, and `smoke`'s first-token report against a local fake server."""

from __future__ import annotations

import json
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cli_helpers import run_cli
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.adapter.reasons import AdapterCode
from kimi_w31.adapter.sglang import launch
from kimi_w31.adapter.sglang.launch import ServeError, ServePlan, plan_serve, serve
from kimi_w31.adapter.sglang.smoke import SmokeError, smoke
from kimi_w31.converter import contract
from kimi_w31.converter.contract import STATE_DIR
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.synth import SynthSpec, make_config

EXPERTS = 896
CONFIG = contract.converted_config(
    make_config(SynthSpec(k=3584, n=3072, experts=EXPERTS)), contract.make_block(4.0, 25.0)
)


def ckpt(root: Path, cfg: dict = CONFIG) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def reason_of(root: Path, extra=(), **kw) -> str | None:
    try:
        plan_serve(root, list(extra), python="py", **kw)
    except ServeError as exc:
        return exc.reason
    return None


@pytest.fixture
def quiet_checks(monkeypatch):
    """The CLI's stack and structure checks pass; this machine has one GPU."""
    monkeypatch.setattr(launch, "check_stack", lambda: [])
    monkeypatch.setattr(launch, "verify_structure", lambda root: [])
    monkeypatch.setattr(launch, "count_gpus", lambda: 1)


# -- the layout: expert split, --ep | --tp, MoE-DP -------------------------------------------


@given(ep=st.integers(1, 128))
def test_ep_must_divide_the_experts(tmp_path_factory, ep):
    root = ckpt(tmp_path_factory.mktemp("c"))
    got = reason_of(root, tp=ep * 8, ep=ep, backend="marlin")  # marlin: no alignment rule
    assert (got == "expert-split") == (EXPERTS % ep != 0)


def test_twelve_gpus_as_twelve_ep_ranks_is_a_usage_error(tmp_path, quiet_checks):
    root = ckpt(tmp_path)
    got = run_cli(
        [root, "--tp", "12", "--ep", "12", "--gpu-memory", "141GB", "--print"],
        inprocess=True,
        command=serve,
    )
    assert got.returncode == 2 and "896" in got.output


@pytest.mark.parametrize(("tp", "ep"), [(16, 3), (8, 16), (12, 5)])
def test_ep_not_dividing_tp_exits_2_as_help_documents(tmp_path, quiet_checks, tp, ep):
    got = run_cli(
        [ckpt(tmp_path), "--tp", tp, "--ep", ep, "--print"], inprocess=True, command=serve
    )
    assert got.returncode == 2


@given(
    tp=st.sampled_from([1, 2, 4, 8, 16, 32]),
    ep=st.sampled_from([1, 2, 4, 8, 16]),
    dp=st.sampled_from([1, 2, 4, 8]),
)
def test_moe_tp_is_tp_over_ep_over_moe_dp_or_refused(tp, ep, dp):
    try:
        got = launch.moe_tp_size(tp, ep, dp)
    except ServeError as exc:
        assert exc.reason == "bad-flag" and exc.exit_code == 2
        assert tp % ep or (dp > 1 and (tp % dp or ep * dp > tp or (ep > 1 and ep * dp != tp)))
        return
    assert got == tp // ep // dp and got * ep * dp == tp


def test_moe_dp_after_the_separator_is_read_as_sglang_reads_it(tmp_path):
    root = ckpt(tmp_path)
    # MoE-TP 16 does not keep 3072 / 16 a multiple of 128; with MoE-DP 2 it is MoE-TP 8
    assert reason_of(root, tp=16) == "moe-tp-alignment"
    assert reason_of(root, ["--moe-dp-size", "2"], tp=16) is None
    assert reason_of(root, ["--moe-data-parallel-size=2"], tp=16) is None
    assert reason_of(root, ["--moe-dp-size", "3"], tp=16) == "bad-flag"


# -- GPUs on this machine --------------------------------------------------------------------


def test_no_gpu_refuses_unless_print(tmp_path, monkeypatch, quiet_checks):
    monkeypatch.setattr(launch, "count_gpus", lambda: 0)
    execs = []
    monkeypatch.setattr(launch.os, "execvpe", lambda *a: execs.append(a))
    root = ckpt(tmp_path)
    refused = run_cli([root, "--tp", "8"], inprocess=True, command=serve)
    assert refused.returncode == 1 and not execs
    assert run_cli([root, "--tp", "8", "--print"], inprocess=True, command=serve).returncode == 0
    monkeypatch.setattr(launch, "count_gpus", lambda: 8)  # negative control
    assert run_cli([root, "--tp", "8"], inprocess=True, command=serve).returncode == 0
    assert len(execs) == 1


def test_count_gpus_reads_nvidia_smi_then_the_driver(tmp_path):
    def smi(cmd, **kw):
        assert cmd == ["nvidia-smi", "-L"]
        return types.SimpleNamespace(returncode=0, stdout="GPU 0: H200 (UUID: a)\nGPU 1: x\n")

    assert launch.count_gpus(run=smi, which=lambda n: "/bin/nvidia-smi") == 2
    driver = tmp_path / "gpus"
    assert launch.count_gpus(which=lambda n: None, driver=driver) == 0
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (driver / bus).mkdir(parents=True)
    assert launch.count_gpus(which=lambda n: None, driver=driver) == 3


# -- an unfinished conversion ------------------------------------------------------------------


@pytest.mark.parametrize("with_config", [True, False])
def test_an_unfinished_output_is_incomplete_not_a_config_problem(tmp_path, with_config):
    root = tmp_path / "out"
    (root / STATE_DIR).mkdir(parents=True)
    if with_config:
        (root / "config.json").write_text("{")  # half-written: still the unfinished run's
    assert reason_of(root) == Code.INCOMPLETE_OUTPUT.value
    (root / "model.safetensors.index.json").write_text("{}")  # finished: judged as usual
    assert reason_of(root) != Code.INCOMPLETE_OUTPUT.value


# -- text-only serving -------------------------------------------------------------------------


def _override(argv: list[str]) -> dict | None:
    at = [i for i, a in enumerate(argv) if a == "--json-model-override-args"]
    return json.loads(argv[at[-1] + 1]) if at else None  # the last one wins in argparse


@pytest.mark.parametrize(
    ("extra", "text_only", "want"),
    [
        ([], False, None),
        ([], True, {"language_model_only": True}),
        (["--skip-tokenizer-init"], False, {"language_model_only": True}),
        (
            ["--json-model-override-args", '{"rope": 1}'],
            True,
            {"rope": 1, "language_model_only": True},
        ),
        (["--json-model-override-args", '{"language_model_only": false}'], True, None),
    ],
)
def test_text_only_passes_the_override_sglang_accepts(tmp_path, extra, text_only, want):
    argv = plan_serve(ckpt(tmp_path), extra, text_only=text_only, python="py").argv
    got = _override(argv)
    if want is None and extra:  # the user's own key is kept as given
        assert got == json.loads(extra[1])
    else:
        assert got == want


def test_language_model_only_is_refused_with_the_working_spelling(tmp_path):
    with pytest.raises(ServeError) as err:
        plan_serve(ckpt(tmp_path), ["--language-model-only"])
    assert err.value.reason == "language-model-only" and err.value.exit_code == 2


# -- smoke: one request against a local fake server ------------------------------------------


class FakeSGLang(BaseHTTPRequestHandler):
    """/health: 503 for the first `loading` calls, then 200; /generate: SSE events."""

    loading = 2
    events: list[str] = []
    seen: list[dict] = []
    post_status = 200

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        cls = type(self)
        status = 503 if cls.loading > 0 else 200
        cls.loading -= 1
        self.send_response(status)
        self.end_headers()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        self.send_response(self.post_status)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in self.events:
            self.wfile.write(f"data: {event}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_server():
    handler = type("Handler", (FakeSGLang,), {"loading": 2, "seen": []})
    handler.events = [
        json.dumps({"text": " Paris", "meta_info": {"completion_tokens": 1}}),
        json.dumps({"text": " Paris.", "meta_info": {"completion_tokens": 2}}),
    ]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_smoke_waits_for_health_then_reports_the_first_token(fake_server, monkeypatch):
    handler, url = fake_server
    monkeypatch.setattr("kimi_w31.adapter.sglang.smoke.time.sleep", lambda s: None)
    result = smoke(url, wait=60)
    assert result.tokens == 2 and result.text == " Paris."
    assert 0 <= result.first_token_s <= result.total_s
    (sent,) = handler.seen
    assert sent["stream"] is True and sent["sampling_params"]["temperature"] == 0


def test_smoke_cli_json_and_input_ids(fake_server, monkeypatch):
    handler, url = fake_server
    monkeypatch.setattr("kimi_w31.adapter.sglang.smoke.time.sleep", lambda s: None)
    got = run_cli(["smoke", "--url", url, "--input-ids", "1,2,3", "--json"], inprocess=True)
    assert got.returncode == 0, got.output
    report = json.loads(got.stdout)
    assert report["ok"] and report["tokens"] == 2 and report["first_token_s"] >= 0
    assert handler.seen[0]["input_ids"] == [1, 2, 3] and "text" not in handler.seen[0]


@pytest.mark.parametrize(
    ("events", "reason"),
    [([], "no-token"), ([json.dumps({"error": "oom"})], "server-error"), (["{"], "bad-stream")],
)
def test_smoke_says_why_no_token_came(fake_server, monkeypatch, events, reason):
    handler, url = fake_server
    handler.events = events
    monkeypatch.setattr("kimi_w31.adapter.sglang.smoke.time.sleep", lambda s: None)
    with pytest.raises(SmokeError) as err:
        smoke(url, wait=60)
    assert err.value.reason == reason


def test_smoke_names_an_http_refusal(fake_server, monkeypatch):
    handler, url = fake_server
    handler.post_status = 500
    monkeypatch.setattr("kimi_w31.adapter.sglang.smoke.time.sleep", lambda s: None)
    with pytest.raises(SmokeError) as err:
        smoke(url, wait=60)
    assert err.value.reason == "http-error"


def test_smoke_names_a_server_it_cannot_reach_after_health(fake_server, monkeypatch):
    import urllib.error
    import urllib.request

    handler, url = fake_server
    real = urllib.request.urlopen

    def urlopen(request, *args, **kwargs):  # /health answers; /generate cannot be reached
        if getattr(request, "full_url", request).endswith("/generate"):
            raise urllib.error.URLError("connection refused")
        return real(request, *args, **kwargs)

    monkeypatch.setattr("kimi_w31.adapter.sglang.smoke.time.sleep", lambda s: None)
    monkeypatch.setattr("kimi_w31.adapter.sglang.smoke.urllib.request.urlopen", urlopen)
    with pytest.raises(SmokeError) as err:
        smoke(url, wait=60)
    assert err.value.reason == AdapterCode.UNREACHABLE.value


def test_smoke_gives_up_when_the_server_never_comes_up(monkeypatch):
    monkeypatch.setattr("kimi_w31.adapter.sglang.smoke.time.sleep", lambda s: None)
    with pytest.raises(SmokeError) as err:
        smoke("http://127.0.0.1:9", wait=0)  # the discard port: nothing answers
    assert err.value.reason == "not-ready"
    with pytest.raises(SmokeError) as err:
        smoke("http://127.0.0.1:9", wait=60, alive=lambda: False)
    assert err.value.reason == "server-exited"


FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.end_headers()
        self.wfile.write(b'data: {"text": "x", "output_ids": [7]}\\n\\ndata: [DONE]\\n\\n')
        self.server.done = True
s = HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
s.done = False
while not s.done:
    s.handle_request()
"""


def test_serve_smoke_runs_the_server_reports_and_keeps_its_exit_code(
    tmp_path, monkeypatch, quiet_checks
):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    monkeypatch.setattr(
        launch, "plan_serve", lambda *a, **k: ServePlan([sys.executable, str(script), str(port)])
    )
    monkeypatch.setattr("kimi_w31.adapter.sglang.smoke.time.sleep", lambda s: None)
    root = ckpt(tmp_path / "c")
    got = run_cli([root, "--smoke", "--", "--port", port], inprocess=True, command=serve)
    assert got.returncode == 0, got.output
    assert "first token" in got.stderr and "1 tokens" in got.stderr


def test_server_url_follows_host_and_port():
    assert launch.server_url({}) == "http://127.0.0.1:30000"
    assert launch.server_url({"host": "0.0.0.0", "port": 8}) == "http://127.0.0.1:8"
    assert launch.server_url({"host": "node0"}) == "http://node0:30000"


def test_ifname_sets_both_interface_variables_in_the_printed_command(tmp_path, quiet_checks):
    root = ckpt(tmp_path)
    args = [root, "--tp", "16", "--ep", "2", "--gpu-memory", "141GB", "--print"]
    multi = ["--", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "h:5000"]
    got = run_cli([*args, "--ifname", "eth0", *multi], inprocess=True, command=serve)
    assert got.returncode == 0, got.output
    assert got.stdout.startswith("GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0 ")
    warned = run_cli(
        [*args, *multi], inprocess=True, command=serve, env=dict.fromkeys(launch.IFNAME_VARS)
    )
    assert warned.returncode == 0 and "--ifname" in warned.stderr
    single = run_cli(args, inprocess=True, command=serve)
    assert "--ifname" not in single.stderr  # one node: nothing to say
