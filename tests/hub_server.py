"""A loopback HTTP server that answers the way the Hugging Face Hub's endpoints do.

Enough of the Hub for the real `huggingface_hub` client: `GET /api/models/{repo}[/revision/
{rev}]` (model info with per-file sizes and LFS sha256 when `blobs=true`) and
`HEAD|GET /{repo}/resolve/{rev}/{path}` with the headers the client relies on
(`X-Repo-Commit`, `ETag`, `X-Linked-Etag`, `X-Linked-Size`, `Content-Length`) and byte
ranges (206 + `Content-Range`). Every request is logged; faults can be switched on per file:
an HTTP 500 for downloads, a connection dropped part-way (once), or a download held until
released; and every download can be slowed to a set rate (a slow link, so that a run can be
interrupted while its downloads are partly on disk). A repo can be gated. A hostile or
broken server: byte ranges ignored (200 with the whole file), a probe's body padded far
beyond what was asked, or header probes that are accepted and never answered; `Silent` is
an endpoint that accepts connections and never answers at all.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Served:
    data_path: Path
    size: int
    etag: str  # sha256 for LFS-style (safetensors) files, git blob sha1 otherwise
    lfs: bool


@dataclass
class Request:
    method: str
    file: str | None
    range: str | None
    status: int
    sent: int

    @property
    def is_download(self) -> bool:
        """A body transfer the client started to fetch the file (not a header probe)."""
        return (
            self.method == "GET"
            and self.file is not None
            and (self.range is None or self.range.endswith("-"))
        )


@dataclass
class FakeHub:
    repos: dict[str, Path]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    fail_download: set[str] = field(default_factory=set)  # -> HTTP 500 on downloads
    drop_once: dict[str, int] = field(default_factory=dict)  # file -> bytes before a drop
    hold: dict[str, threading.Event] = field(default_factory=dict)  # download waits on it
    rate: int | None = None  # bytes per second per download body; None: as fast as it goes
    gated: set[str] = field(default_factory=set)  # repos whose terms were not accepted
    ignore_range: bool = False  # answer a range request with 200 and the whole file
    pad_probes: int = 0  # zero bytes sent after a range probe's body (Content-Length says so)
    stall_probes: bool = False  # range probes are read and never answered
    shift_ranges: int = 0  # a range answered from this many bytes later (and says so)
    drip_probes: float = 0.0  # a range probe's body sent one byte every this many seconds
    log: list[Request] = field(default_factory=list)
    files: dict[str, dict[str, Served]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for repo, root in self.repos.items():
            self.files[repo] = {}
            for p in sorted(root.rglob("*")):
                if p.is_file():
                    data = p.read_bytes()
                    lfs = p.name.endswith(".safetensors")
                    etag = (
                        hashlib.sha256(data).hexdigest()
                        if lfs
                        else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                    )
                    self.files[repo][str(p.relative_to(root))] = Served(p, len(data), etag, lfs)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._busy = threading.Condition(self._lock)
        self._in_flight: list[tuple[int, str]] = []  # (number, path) of requests being answered
        self._numbered = 0  # requests received so far
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def do_GET(self) -> None:
                hub._answer(self, head=False)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a client hanging up (a probe cut short, a timeout) is no server error

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.set()
        for event in self.hold.values():
            event.set()
        self.server.shutdown()
        self.server.server_close()

    def downloads(self, file: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.log if r.is_download and (file is None or r.file == file)]

    def mark(self) -> int:
        """How many requests have been received: `wait_quiet(file, since=mark())` then waits
        only for what came after (a request another test left hanging does not count)."""
        with self._busy:
            return self._numbered

    def wait_quiet(self, file: str, since: int = 0, timeout: float = 30.0) -> bool:
        """Until no request for `file` received after `since` is being answered (a body
        still being sent to a client that hung up is logged only once the send fails)."""

        def quiet() -> bool:
            return not any(n >= since and p.endswith("/" + file) for n, p in self._in_flight)

        with self._busy:
            return self._busy.wait_for(quiet, timeout)

    # -- request handling ------------------------------------------------------------------
    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        with self._busy:
            entry = (self._numbered, h.path.split("?", 1)[0])
            self._numbered += 1
            self._in_flight.append(entry)
        try:
            self._handle(h, head)
        finally:
            with self._busy:
                self._in_flight.remove(entry)
                self._busy.notify_all()

    def _record(self, r: Request) -> None:
        with self._lock:
            self.log.append(r)

    def _send_json(
        self, h: BaseHTTPRequestHandler, status: int, doc: dict, extra: dict | None = None
    ) -> None:
        body = json.dumps(doc).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            return self._model_info(h, m[1], m[2] or "main", "blobs=true" in url.query.lower())
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._resolve(h, m[1], m[2], m[3], head)
        self._send_json(h, 404, {"error": "not found"})

    def _check(self, h: BaseHTTPRequestHandler, repo: str, rev: str) -> bool:
        if repo in self.gated:
            self._send_json(
                h,
                403,
                {"error": "Access to this repository is restricted"},
                {"X-Error-Code": "GatedRepo"},
            )
            return False
        if repo not in self.files:
            self._send_json(
                h, 401, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
            )
            return False
        if rev not in ("main", self.commit):
            self._send_json(
                h, 404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"}
            )
            return False
        return True

    def _model_info(self, h: BaseHTTPRequestHandler, repo: str, rev: str, blobs: bool) -> None:
        if not self._check(h, repo, rev):
            return
        siblings = []
        for name, f in self.files[repo].items():
            s: dict = {"rfilename": name}
            if blobs:
                s["size"] = f.size
                s["blobId"] = f.etag if not f.lfs else hashlib.sha1(f.etag.encode()).hexdigest()
                if f.lfs:
                    s["lfs"] = {"sha256": f.etag, "size": f.size, "pointerSize": 134}
            siblings.append(s)
        self._send_json(
            h,
            200,
            {
                "_id": "x",
                "id": repo,
                "modelId": repo,
                "sha": self.commit,
                "private": False,
                "disabled": False,
                "gated": False,
                "siblings": siblings,
            },
        )
        self._record(Request("GET", None, None, 200, 0))

    def _resolve(
        self, h: BaseHTTPRequestHandler, repo: str, rev: str, name: str, head: bool
    ) -> None:
        if not self._check(h, repo, rev):
            return
        f = self.files[repo].get(name)
        common = {"X-Repo-Commit": self.commit}
        if f is None:
            self._send_json(
                h, 404, {"error": "Entry not found"}, {**common, "X-Error-Code": "EntryNotFound"}
            )
            return
        rng = h.headers.get("Range")
        hdrs = {
            **common,
            "ETag": f'"{f.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if f.lfs:
            hdrs["X-Linked-Etag"] = f'"{f.etag}"'
            hdrs["X-Linked-Size"] = str(f.size)
        if head:
            h.send_response(200)
            for k, v in hdrs.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(f.size))
            h.end_headers()
            self._record(Request("HEAD", name, rng, 200, 0))
            return
        req = Request("GET", name, rng, 0, 0)
        if req.is_download:
            if name in self.hold:
                self.hold[name].wait()
            if name in self.fail_download:
                req.status = 500
                self._record(req)
                self._send_json(h, 500, {"error": "Internal Error"}, common)
                return
        if rng and not req.is_download and self.stall_probes:
            self._record(req)
            self._closing.wait()  # until the server is shut down
            return
        if self.ignore_range:
            rng = None
        first, last = 0, f.size - 1
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m or int(m[1]) >= f.size:
                req.status = 416
                self._record(req)
                self._send_json(h, 416, {"error": "Range Not Satisfiable"}, common)
                return
            first = min(int(m[1]) + self.shift_ranges, f.size - 1)
            last = min(int(m[2]), f.size - 1) if m[2] else f.size - 1
        with open(f.data_path, "rb") as fh:
            fh.seek(first)
            body = fh.read(last - first + 1)
        req.status = 206 if rng else 200
        h.send_response(req.status)
        for k, v in hdrs.items():
            h.send_header(k, v)
        if rng:
            h.send_header("Content-Range", f"bytes {first}-{last}/{f.size}")
        pad = self.pad_probes if req.range is not None and not req.is_download else 0
        h.send_header("Content-Length", str(len(body) + pad))
        h.end_headers()
        cut = self.drop_once.pop(name, None) if req.is_download else None
        if cut is not None:
            h.wfile.write(body[:cut])
            h.wfile.flush()
            req.sent = cut
            self._record(req)
            h.close_connection = True  # the peer sees a body shorter than Content-Length
            return
        self._send_body(h, body, req, pad)

    def _send_body(
        self, h: BaseHTTPRequestHandler, body: bytes, req: Request, pad: int = 0
    ) -> None:
        """The body, at `rate` for downloads, then `pad` zero bytes; a client that hangs up
        ends it quietly."""
        rate = self.rate if req.is_download else None  # read once: a test may change it
        step = 16_384 if rate else max(len(body), 1)
        drip = self.drip_probes if req.range is not None and not req.is_download else 0.0
        if drip:
            rate, step = 1 / drip, 1
        try:
            for start in range(0, len(body), step):
                h.wfile.write(body[start : start + step])
                req.sent += len(body[start : start + step])
                if rate:
                    h.wfile.flush()
                    if self._closing.wait(step / rate):
                        break
            zeros = bytes(1 << 20)
            while pad > 0:
                n = min(pad, len(zeros))
                h.wfile.write(zeros[:n])
                req.sent += n
                pad -= n
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True
        self._record(req)


class Silent:
    """An endpoint that accepts connections and never answers: the kernel completes each
    handshake (the listen backlog) and nothing ever reads the request."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __enter__(self) -> Silent:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()
