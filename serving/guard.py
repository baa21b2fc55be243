"""An ASGI middleware around MLflow's scoring app, for what that app lacks.

MLflow's scoring server (kept as it is, with its request timeout) reads any body whole
before looking at it, answers errors with the request's table and a stack trace, and logs
nothing of a refused request. :class:`RequestGuard` sits in front of it:

- ``POST /invocations`` with a ``Content-Length`` over the cap is answered 413 before the
  body is read; a chunked body is read only up to the cap, then answered 413;
- a content type other than JSON is answered 415 (the signature's binary column travels
  as base64 in JSON; MLflow's CSV and Parquet parsers are not exposed);
- a body is parsed once here, within bounds, before MLflow parses it: JSON that is not
  valid, nests deeper than ``max_json_depth``, holds a number longer than
  ``max_number_chars`` or a ``NaN``/``Infinity`` token, or lists more than ``max_rows``
  rows is answered 400 in one line (MLflow's own parser would fail with a 500 on the first
  two and accept the third); a table whose ``image`` cell MLflow cannot decode is answered
  400 naming the row and the cell (:mod:`serving.table`);
- an exception from MLflow's app, an exception of our own code inside ``predict`` (which
  :mod:`serving.pyfunc` marks as a fault, not a refusal) and any other 5xx from the app
  are answered with a fixed one-line 500, the detail in the server log only: a fault of
  the server is never dressed as the client's error;
- every error answer is replaced by one line, ``{"error_code", "message"}``: our own
  refusals (marked ``encoder: ``, naming the row) as they are, anything else by a fixed
  line for its status, so no trace or echo of the request leaves the server; heap
  addresses are scrubbed from every message;
- each refused request is logged in one line: client address, status, reason.

Other paths (``/ping``, ``/health``, ``/version``) pass through untouched.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from serving.limits import ServeLimits
from serving.table import table_refusal

log = logging.getLogger("serving")
MARK = "encoder: "  # the start of every refusal of ours (serving.pyfunc)
GENERIC = {
    400: "request: not a table this model takes; send JSON {\"dataframe_records\": "
         "[{\"image\": \"<base64 of a JPEG, PNG or WebP>\"}]}",
    404: "not found: POST /invocations, GET /ping",
    405: "method not allowed: POST /invocations",
    413: "request: body over the server's limit",
    415: "request: send Content-Type: application/json",
    422: "request: not a table this model takes",
    503: "server busy; retry later",
    504: "request: took longer than the server's timeout; send fewer or smaller images",
}
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
ADDRESS = re.compile(r"\s*\bat 0x[0-9a-fA-F]+|\b0x[0-9a-fA-F]{6,}")  # "<X object at 0x7f...>"
INTERNAL = "internal error; the server's log has the detail"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class RequestGuard:
    """``RequestGuard(app, limits)``: MLflow's ``app`` behind the bounds above."""

    def __init__(self, app: Callable, limits: ServeLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ("/ping", "/health", "/version"):
            await self.app(scope, receive, send)
            return
        host, port = scope.get("client") or ("?", "?")
        client = f"{host}:{port}"
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await answer(send, client, *refusal)
            return
        body = await read_body(receive, self.limits.max_body_bytes)
        if body is None:
            await answer(send, client, 413, f"request: body over the server's limit of "
                                            f"{self.limits.max_body_bytes} bytes")
            return
        value, unparsable = parsed_within_bounds(body, self.limits)
        unreadable = unparsable or table_refusal(value)
        if unreadable is not None:
            await answer(send, client, 400, unreadable)
            return
        try:
            await self._forward(scope, body, send, client)
        except Exception:  # noqa: BLE001 (whatever MLflow's app raised: logged, not sent)
            log.exception("internal error on a request from %s", client)
            await answer(send, client, 500, INTERNAL)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, str] | None:
        """(status, message) for a request refused from its line and headers alone."""
        if scope["path"] != "/invocations":
            return 404, GENERIC[404]
        if scope["method"] != "POST":
            return 405, GENERIC[405]
        if headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return 415, GENERIC[415]
        length = headers.get("content-length")
        if length is not None and (not length.isdigit()
                                   or int(length) > self.limits.max_body_bytes):
            return 413, (f"request: body of {length[:20]} bytes, over the server's limit of "
                         f"{self.limits.max_body_bytes}")
        return None

    async def _forward(self, scope: Scope, body: bytes, send: Send, client: str) -> None:
        """Run MLflow's app on ``body``; pass a success through, rewrite an error."""
        delivered = False

        async def replay() -> dict[str, Any]:
            nonlocal delivered
            if delivered:
                return {"type": "http.disconnect"}
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, replay, capture)
        status = int(start.get("status", 500))
        if status < 400:
            await send(start)
            await send({"type": "http.response.body", "body": b"".join(chunks)})
            return
        await answer(send, client, *one_line(status, b"".join(chunks)))


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None as soon as it passes ``limit`` bytes (not read further)."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(parts)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


class Unbounded(ValueError):
    """A JSON value past the guard's bounds."""


def json_refusal(body: bytes, limits: ServeLimits) -> str | None:
    """Why ``body`` is refused before MLflow parses it, or None."""
    return parsed_within_bounds(body, limits)[1]


def parsed_within_bounds(body: bytes, limits: ServeLimits) -> tuple[Any, str | None]:
    """(the parsed body, None), or (None, why it is refused before MLflow parses it). The C
    parser's recursion stops at Python's limit (a RecursionError, caught); depth and rows
    are then counted on the parsed value without recursion."""
    def number(text: str) -> float | int:
        if len(text) > limits.max_number_chars:
            raise Unbounded(f"request: a number of {len(text)} characters, over the limit "
                            f"of {limits.max_number_chars}")
        return float(text) if any(c in text for c in ".eE") else int(text)

    def constant(text: str) -> None:
        raise Unbounded(f"request: {text} is not JSON; send finite numbers")

    try:
        value = json.loads(body, parse_int=number, parse_float=number,
                           parse_constant=constant)
    except Unbounded as err:
        return None, str(err)
    except RecursionError:
        return None, f"request: JSON nested deeper than {limits.max_json_depth} levels"
    except ValueError:  # not UTF-8, or not JSON
        return None, "request: the body is not valid JSON"
    if nesting(value) > limits.max_json_depth:
        return None, f"request: JSON nested deeper than {limits.max_json_depth} levels"
    rows = row_count(value)
    if rows > limits.max_rows:
        return None, (f"request: {rows} rows, over the limit of {limits.max_rows} per "
                      "request; send fewer rows")
    return value, None


def row_count(value: Any) -> int:
    """The rows a scoring request lists (``dataframe_records``, ``dataframe_split.data``,
    ``instances``); 0 for any other shape, which MLflow then refuses."""
    if not isinstance(value, dict):
        return 0
    split = value.get("dataframe_split")
    lists = [value.get("dataframe_records"), value.get("instances"),
             split.get("data") if isinstance(split, dict) else None]
    return max((len(rows) for rows in lists if isinstance(rows, list)), default=0)


def nesting(value: Any) -> int:
    """How deep lists and objects nest in ``value`` (a scalar: 0)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (item.values() if isinstance(item, dict)
                    else item if isinstance(item, list) else None)
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def one_line(status: int, body: bytes) -> tuple[int, str]:
    """(status, message) for MLflow's error answer: our refusal's line, else the fixed line
    of the status; never MLflow's text, which holds the request and a trace."""
    try:
        message = str(json.loads(body).get("message", ""))
    except (ValueError, AttributeError):
        message = ""
    at = message.rfind(MARK)
    if at >= 0:
        return status, CONTROL.sub(" ", message[at + len(MARK):].splitlines()[0])[:400]
    if status >= 500 and status not in (503, 504):  # a fault of the server, not the client
        return 500, INTERNAL
    return status, GENERIC.get(status, GENERIC[400])


async def answer(send: Send, client: str, status: int, message: str) -> None:
    """Send ``{"error_code", "message"}`` with ``status`` and log the refusal."""
    code = {413: "REQUEST_LIMIT_EXCEEDED", 503: "TEMPORARILY_UNAVAILABLE"}.get(
        status, "BAD_REQUEST" if status < 500 else "INTERNAL_ERROR")
    message = ADDRESS.sub("", message)
    log.warning("refused %s: %d %s", client, status, message)
    payload = json.dumps({"error_code": code, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})
