"""Every request this tool makes to the Hub itself: with a timeout, bounded retries, and a
bounded read.

Two rules, one place:

- No wait is unbounded. Each request waits at most `timeout` seconds for the server (to
  connect, and between any two bytes), and is retried `retries` times on a timeout or a
  dropped connection; then the run stops with `hub-timeout`. Both come from
  `KIMI_W31_HUB_TIMEOUT` (default: huggingface_hub's `HF_HUB_ETAG_TIMEOUT`, 10 s) and
  `KIMI_W31_HUB_RETRIES` (default 2). Where `huggingface_hub` makes the call
  (downloads), its own settings apply (`HF_HUB_ETAG_TIMEOUT`, `HF_HUB_DOWNLOAD_TIMEOUT`, and
  its bounded retries); a timeout it raises is reported with the same code (`is_timeout`).
- No read is larger than what was asked. A byte range is streamed and the stream is left
  once the asked bytes are in: a server that ignores `Range` (200 with the whole file) or
  sends more than it was asked costs the asked bytes, never the file.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import Fatal, fatal
from ..reasons import Code

TIMEOUT_ENV = "KIMI_W31_HUB_TIMEOUT"  # seconds a request waits for the server
RETRIES_ENV = "KIMI_W31_HUB_RETRIES"  # retries of a request that timed out
DEFAULT_TIMEOUT = 10.0  # huggingface_hub's own default for its metadata requests
DEFAULT_RETRIES = 2
_BACKOFF = (0.5, 1.0, 2.0, 4.0)  # s before retry n (the last repeats)
# A ranged read must also end: a server that sends one byte just inside every wait would
# otherwise hold it for days. It may take `timeout` plus the asked bytes at this rate.
MIN_RATE = 64 * 1024  # bytes/s

T = TypeVar("T")


@dataclass(frozen=True)
class NetSettings:
    timeout: float = DEFAULT_TIMEOUT
    retries: int = DEFAULT_RETRIES

    @classmethod
    def from_env(cls) -> NetSettings:
        """The settings the environment gives; a value that is not a number is refused.
        Unset, the wait is huggingface_hub's for its metadata requests (HF_HUB_ETAG_TIMEOUT),
        so one setting bounds every request the user knows of."""
        from huggingface_hub import constants

        timeout, retries = float(constants.HF_HUB_ETAG_TIMEOUT or DEFAULT_TIMEOUT), DEFAULT_RETRIES
        raw = os.environ.get(TIMEOUT_ENV)
        if raw:
            try:
                timeout = float(raw)
            except ValueError:
                timeout = -1.0
            if not timeout > 0 or timeout == float("inf"):
                raise fatal(Code.USAGE, rule="hub-timeout", name=TIMEOUT_ENV, value=raw)
        raw = os.environ.get(RETRIES_ENV)
        if raw:
            if not raw.strip().isdigit():
                raise fatal(Code.USAGE, rule="hub-retries", name=RETRIES_ENV, value=raw)
            retries = int(raw)
        return cls(timeout, retries)


def is_timeout(exc: BaseException) -> bool:
    """Whether a timeout caused `exc` (anywhere in its chain: huggingface_hub wraps the
    client's error in its own when a metadata request times out)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, TimeoutError) or any("Timeout" in k.__name__ for k in type(e).__mro__):
            return True
        e = e.__cause__ or e.__context__
    return False


def _transient(exc: BaseException) -> bool:
    """A timeout or a dropped connection: worth another try."""
    if is_timeout(exc) or isinstance(exc, ConnectionError):
        return True
    names = {k.__name__ for k in type(exc).__mro__}
    return bool(names & {"NetworkError", "RemoteProtocolError", "ConnectError"})


def with_retries(
    call: Callable[[float], T], net: NetSettings, action: str, file: object = None
) -> T:
    """`call(timeout)`, retried on a timeout or a dropped connection; `hub-timeout` once
    the retries are spent. Any other error goes to the caller as it is."""
    attempt = 0
    while True:
        try:
            return call(net.timeout)
        except Fatal:
            raise
        except Exception as exc:
            if not _transient(exc):
                raise
            if attempt >= net.retries:
                if not is_timeout(exc):
                    raise
                raise fatal(
                    Code.HUB_TIMEOUT,
                    rule="request",
                    file=file,
                    action=action,
                    timeout=net.timeout,
                    tries=attempt + 1,
                ) from None
            time.sleep(_BACKOFF[min(attempt, len(_BACKOFF) - 1)])
            attempt += 1


_CONTENT_RANGE = re.compile(r"bytes (\d+)-\d+/(?:\d+|\*)")


def read_range(
    url: str, headers: dict[str, str], first: int, last: int, timeout: float, file: object
) -> bytes:
    """Bytes first..last of `url` (fewer if the server has fewer).

    Streamed: a 200 (the server ignored the range) is read up to byte `last` and left
    there; a 206 longer than asked is cut at what was asked. Never more than
    `last + 1` bytes are read, whatever the server sends, and never for longer than the
    wait plus those bytes at `MIN_RATE` (a timeout then). A 206 that starts elsewhere
    than asked is refused (its bytes are not the ones asked for).
    """
    from huggingface_hub.utils import get_session, hf_raise_for_status

    want = last - first + 1
    got = bytearray()
    limit = timeout + (last + 1) / MIN_RATE
    deadline = time.monotonic() + limit
    with get_session().stream(
        "GET", url, headers={**headers, "range": f"bytes={first}-{last}"}, timeout=timeout
    ) as resp:
        hf_raise_for_status(resp)
        if resp.status_code == 206:
            said = _CONTENT_RANGE.fullmatch(resp.headers.get("content-range", "").strip())
            if said is None or int(said[1]) != first:
                found = resp.headers.get("content-range") or "no Content-Range"
                raise fatal(Code.HUB_ERROR, rule="bad-range", file=file, first=first, said=found)
        skip = first if resp.status_code == 200 else 0  # a whole file: start at `first`
        for chunk in resp.iter_bytes():
            if skip:
                cut = min(skip, len(chunk))
                chunk, skip = chunk[cut:], skip - cut
            got += chunk[: want - len(got)]
            if len(got) >= want:
                break  # leaving the block closes the connection: the rest is never read
            if time.monotonic() > deadline:
                raise TimeoutError(f"{want} bytes not in after {limit:.1f} s")
        return bytes(got)
