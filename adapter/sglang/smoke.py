"""One real generation request to a running SGLang server: is it up, does it generate, and
how long until the first token (`kimi-convert smoke`, `kimi-convert serve --smoke`).

The request needs only the standard library (and the command click): the check runs from
any machine that reaches the server.
SGLang's native `/generate` streams server-sent events (`data: {...}` lines, then
`data: [DONE]`); the first event that carries output is the first token.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass

import click

from ...converter.cli.arguments import json_option
from ...converter.errors import fatal
from ..reasons import AdapterCode
from ..refused import Refused

DEFAULT_PROMPT = "The capital of France is"


class SmokeError(Refused):
    """Why the request did not give a token; `reason` is stable (tests, `--json`)."""


@dataclass(frozen=True)
class SmokeResult:
    url: str
    ready_s: float  # waiting for /health to answer 200
    first_token_s: float  # request sent -> first streamed output
    total_s: float  # request sent -> the stream's end
    tokens: int
    text: str

    def as_dict(self) -> dict:
        return asdict(self)


def wait_ready(
    url: str,
    timeout: float,
    *,
    alive: Callable[[], bool] = lambda: True,
    poll: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """Seconds until `url`/health answers 200; SmokeError when `timeout` passes first or
    `alive()` says the server process is gone."""
    started = clock()
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
                if response.status == 200:
                    return clock() - started
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or loading (SGLang answers 503 until ready)
        if not alive():
            raise SmokeError(fatal(AdapterCode.SERVER_EXITED))
        if clock() - started >= timeout:
            raise SmokeError(fatal(AdapterCode.NOT_READY, url=url, timeout=timeout))
        time.sleep(poll)


def generate(
    url: str,
    *,
    prompt: str | None = DEFAULT_PROMPT,
    input_ids: list[int] | None = None,
    max_new_tokens: int = 16,
    timeout: float = 600.0,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[float, float, int, str]:
    """(first-token s, total s, tokens, text) of one greedy streamed request. `input_ids`
    instead of `prompt` for a server started with --skip-tokenizer-init."""
    body: dict = {
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "stream": True,
    }
    if input_ids is not None:
        body["input_ids"] = input_ids
    else:
        body["text"] = prompt
    request = urllib.request.Request(
        f"{url}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = clock()
    first: float | None = None
    last: dict = {}
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                try:
                    event = json.loads(payload)
                except ValueError:
                    raise SmokeError(fatal(AdapterCode.BAD_STREAM, payload=payload[:80])) from None
                if isinstance(event, dict) and event.get("error"):
                    raise SmokeError(fatal(AdapterCode.SERVER_ERROR, error=event["error"]))
                if first is None and _tokens(event):
                    first = clock() - started
                last = event
    except urllib.error.HTTPError as exc:
        raise SmokeError(fatal(AdapterCode.HTTP_ERROR, url=url, status=exc.code)) from None
    except (urllib.error.URLError, OSError) as exc:
        raise SmokeError(fatal(AdapterCode.UNREACHABLE, url=url, error=exc)) from None
    total = clock() - started
    if first is None:
        raise SmokeError(fatal(AdapterCode.NO_TOKEN))
    return first, total, _tokens(last), str(last.get("text", ""))


def _tokens(event: object) -> int:
    """Tokens generated so far, as an event says: meta_info.completion_tokens, else the
    output_ids it carries, else 1 when it carries text."""
    if not isinstance(event, dict):
        return 0
    meta = event.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("completion_tokens"), int):
        return meta["completion_tokens"]
    ids = event.get("output_ids")
    if isinstance(ids, list):
        return len(ids)
    return 1 if event.get("text") else 0


def smoke(
    url: str,
    *,
    wait: float = 1800.0,
    alive: Callable[[], bool] = lambda: True,
    **request: object,
) -> SmokeResult:
    """Wait for the server, then one streamed greedy request: the figures a launch needs."""
    url = url.rstrip("/")
    ready = wait_ready(url, wait, alive=alive)
    first, total, tokens, text = generate(url, **request)  # type: ignore[arg-type]
    return SmokeResult(url, round(ready, 3), round(first, 3), round(total, 3), tokens, text)


@click.command("smoke")
@click.option(
    "--url",
    default="http://127.0.0.1:30000",
    show_default=True,
    metavar="URL",
    help="The SGLang server (its --host/--port).",
)
@click.option(
    "--prompt", default=None, metavar="PROMPT", help="The prompt [default: a short factual one]."
)
@click.option(
    "--input-ids",
    default=None,
    metavar="IDS",
    help="Comma-separated token ids instead of --prompt (a server with --skip-tokenizer-init).",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(1),
    default=16,
    show_default=True,
    metavar="N",
    help="Tokens to generate (greedy).",
)
@click.option(
    "--wait",
    type=click.FloatRange(0),
    default=1800,
    show_default=True,
    metavar="SECONDS",
    help="Seconds to wait for /health to answer 200 (loading Kimi-K3 takes minutes).",
)
@json_option("the figures")
def smoke_command(
    url: str,
    prompt: str | None,
    input_ids: str | None,
    max_new_tokens: int,
    wait: float,
    as_json: bool,
) -> None:
    """Send one greedy streamed generation request to a running SGLang server, once it is
    up, and report how long the first token took.

    \b
    Examples:
      kimi-convert smoke                                 the server on this machine
      kimi-convert smoke --url http://NODE0_IP:30000 --json
      kimi-convert smoke --input-ids 1,2,3 --wait 0      a --skip-tokenizer-init server

    Exit codes: 0 a token came back, 1 it did not (the reason is printed), 2 usage error.
    """
    ids = None
    if input_ids is not None:
        try:
            ids = [int(x) for x in input_ids.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter("comma-separated integers", param_hint="--input-ids") from None
    try:
        result = smoke(
            url,
            wait=wait,
            prompt=prompt or DEFAULT_PROMPT,
            input_ids=ids,
            max_new_tokens=max_new_tokens,
        )
    except SmokeError as exc:
        if as_json:
            click.echo(json.dumps({"ok": False, "reason": exc.reason, "error": str(exc)}))
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps({"ok": True, **result.as_dict()}))
        return
    click.echo(
        f"{result.url}: ready after {result.ready_s:.1f} s; first token "
        f"{result.first_token_s * 1000:.0f} ms; {result.tokens} tokens in {result.total_s:.2f} s"
        f"\n{result.text}"
    )
