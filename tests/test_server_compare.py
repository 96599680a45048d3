"""gpu/server_compare.py against fake SGLang servers (the `/generate` fields it reads): the
comparison it reports is the one the fakes were built to show."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gpu import server_compare as sc


def _fake(shift: float, nan: bool = False, flip_at: int | None = None):
    """A server whose greedy token at step i of a prompt is (sum(prompt) + i) % 97 + 1, whose
    logprobs are -0.1 - shift, and which, with `flip_at`, answers another token there."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids, new = body["input_ids"], body["sampling_params"]["max_new_tokens"]
            batch = ids if isinstance(ids[0], list) else [ids]
            outs = [self._one(p, new, body) for p in batch]
            data = json.dumps(outs if isinstance(ids[0], list) else outs[0]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _one(self, prompt, new, body):
            lp = float("nan") if nan else -0.1 - shift
            tokens = [(sum(prompt) + i) % 97 + 1 for i in range(new)]
            if flip_at is not None and flip_at < new:
                tokens[flip_at] += 1
            meta = {
                "input_token_logprobs": [[None, prompt[0], None]]
                + [[lp, t, None] for t in prompt[1:]],
                "output_token_logprobs": [[lp, t, None] for t in tokens],
                "output_top_logprobs": [[[lp, t, None], [lp - 1, t + 1, None]] for t in tokens],
            }
            return {"output_ids": tokens, "meta_info": meta}

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def servers(request, tmp_path):
    made = {name: _fake(**kw) for name, kw in request.param.items()}
    for name in made:
        (tmp_path / f"server-{name}.started").write_text("0")
    yield {name: s.server_address[1] for name, s in made.items()}
    for s in made.values():
        s.shutdown()


def _run(tmp_path: Path, ports: dict[str, int]) -> tuple[int, dict]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 512}}))
    argv = ["--out", str(tmp_path), "--model", str(model), "--deadline-s", "20", "--no-speed"]
    argv += [a for n, p in ports.items() for a in ("--server", f"{n}={p}")]
    rc = sc.main(argv)
    return rc, json.loads((tmp_path / "report-server.json").read_text())


ALIKE = {"marlin-graph": {"shift": 0.0}, "plugin-graph": {"shift": 0.001}}


@pytest.mark.parametrize("servers", [ALIKE], indirect=True)
def test_servers_that_agree_pass(servers, tmp_path):
    rc, report = _run(tmp_path, servers)
    assert rc == 0
    pair = report["pairs"]["plugin-graph vs marlin-graph"]
    assert pair["forced"]["within_tolerance"]
    assert math.isclose(pair["forced"]["max_abs"], 0.001, rel_tol=1e-6)
    assert pair["greedy"]["identical"] == sc.PROMPTS
    assert report["servers"]["plugin-graph"]["repeatable"]["identical"] == sc.PROMPTS


FAR = {"marlin-eager": {"shift": 0.0}, "plugin-eager": {"shift": 0.5, "flip_at": 5}}


@pytest.mark.parametrize("servers", [FAR], indirect=True)
def test_a_server_off_by_half_a_nat_fails_and_its_first_difference_is_named(servers, tmp_path):
    rc, report = _run(tmp_path, servers)
    assert rc == 1
    pair = report["pairs"]["plugin-eager vs marlin-eager"]
    assert not pair["forced"]["within_tolerance"]
    assert pair["greedy"]["identical"] == 0
    assert {r["first_difference"] for r in pair["greedy"]["rows"]} == {5}


NAN = {"marlin-graph": {"shift": 0.0}, "plugin-graph": {"shift": 0.0, "nan": True}}


@pytest.mark.parametrize("servers", [NAN], indirect=True)
def test_a_nan_logprob_fails_the_run(servers, tmp_path):
    rc, report = _run(tmp_path, servers)
    assert rc == 1
    assert report["servers"]["plugin-graph"]["finite"] is False
    assert report["servers"]["marlin-graph"]["finite"] is True


def test_a_server_that_never_answers_is_reported_not_waited_for_forever(tmp_path):
    (tmp_path / "server-plugin-graph.pid").write_text("999999999")  # no such process
    (tmp_path / "server-plugin-graph.started").write_text("0")
    rc, report = _run(tmp_path, {"plugin-graph": 1})
    assert rc == 1
    assert "error" in report["servers"]["plugin-graph"]


@pytest.mark.parametrize(("done", "rc"), [(None, 1), ("server 1", 1), ("server 0", 0)])
def test_server_h200_wait_exits_with_the_comparisons_outcome(tmp_path, done, rc):
    """The script itself, on a work folder as its pipeline leaves it: `wait` passes only on
    the comparison's own success, and brings the report back to $OUT."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    work, out = tmp_path / "work", tmp_path / "returned"
    (work / "out").mkdir(parents=True)
    out.mkdir()
    (work / "out" / "pipeline.log").write_text("== pipeline start\n")
    (work / "out" / "report-server.md").write_text("# Real server\n")
    (work / "out" / "server-plugin-graph.log").write_text("ready\n")
    if done is not None:
        (work / "done").write_text(done + "\n")
    env = {**os.environ, "KIMI_W31_WORK": str(work), "OUT": str(out)}
    proc = subprocess.run(
        ["bash", str(root / "gpu" / "server_h200.sh"), "wait", "0"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert (out / "report-server.md").exists() and (out / "server-plugin-graph.log").exists()
