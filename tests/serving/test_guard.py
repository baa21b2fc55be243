"""The request guard on its own, around planted ASGI apps: bodies refused before MLflow
parses them, an exception inside the app answered by a fixed line, addresses scrubbed.
The real server under hostile requests: ``test_server.py`` and ``test_fuzz.py``."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from serving.guard import INTERNAL, RequestGuard, json_refusal
from serving.limits import ServeLimits

LIMITS = ServeLimits(max_rows=4, max_json_depth=6, max_number_chars=10)


def exchange(app, body: bytes) -> tuple[int, dict]:
    """POST /invocations of ``body`` through the guard around ``app``."""
    scope = {"type": "http", "path": "/invocations", "method": "POST",
             "client": ("127.0.0.1", 5), "headers": [(b"content-type", b"application/json")]}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(RequestGuard(app, LIMITS)(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


def answering(status: int, payload: dict):
    async def app(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(payload).encode()})
    return app


GOOD = b'{"dataframe_records": [{"image": "AAAA"}], "params": {"space": "backbone"}}'


@pytest.mark.parametrize(("body", "reason"), [
    (b"[" * 5000 + b"]" * 5000, "request: JSON nested deeper than 6 levels"),
    (b'{"a": [[[[[[1]]]]]]}', "request: JSON nested deeper than 6 levels"),
    (b'{"dataframe_records": [{"image": ' + b"9" * 5000 + b"}]}",
     "request: a number of 5000 characters, over the limit of 10"),
    (b'{"params": {"space": 1.' + b"5" * 20 + b"}}",
     "request: a number of 22 characters, over the limit of 10"),
    (b'{"params": {"space": NaN}}', "request: NaN is not JSON; send finite numbers"),
    (b'{"params": {"space": -Infinity}}', "request: -Infinity is not JSON; send finite numbers"),
    (b'{"dataframe_records": [{}, {}, {}, {}, {}]}',
     "request: 5 rows, over the limit of 4 per request; send fewer rows"),
    (b'{"dataframe_split": {"data": [[1], [2], [3], [4], [5]]}}',
     "request: 5 rows, over the limit of 4 per request; send fewer rows"),
    (b"\xff\xfe{", "request: the body is not valid JSON"),
    (b'{"a": ', "request: the body is not valid JSON"),
])
def test_bodies_past_the_bounds_are_refused_before_mlflow_parses_them(body, reason):
    assert json_refusal(body, LIMITS) == reason
    reached = []

    async def app(scope, receive, send) -> None:
        reached.append(scope)

    assert exchange(app, body) == (400, {"error_code": "BAD_REQUEST", "message": reason})
    assert not reached


@pytest.mark.parametrize("body", [GOOD, b'{"dataframe_records": "x"}', b"5", b'"text"',
                                  b'{"instances": [1, 2, 3, 4], "n": -1234.5e-3}'])
def test_bodies_within_the_bounds_reach_the_app(body):
    assert json_refusal(body, LIMITS) is None
    assert exchange(answering(200, {"predictions": [[0.5]]}), body)[0] == 200


def test_an_exception_inside_the_app_is_a_fixed_line_and_its_detail_stays_in_the_log(
        caplog):
    async def app(scope, receive, send) -> None:
        raise RecursionError(f"planted failure at {hex(id(scope))}")

    with caplog.at_level(logging.WARNING, logger="serving"):
        status, body = exchange(app, GOOD)
    assert (status, body) == (500, {"error_code": "INTERNAL_ERROR", "message": INTERNAL})
    assert "planted failure" in caplog.text and "Traceback" in caplog.text


def test_addresses_are_scrubbed_from_every_message():
    message = ("encoder: row 0: image: not a readable .npy array (Cannot parse header: "
               "<ast.Call object at 0x7f3a2b1c9d80>, id 0xdeadbeef00)")
    status, body = exchange(answering(400, {"message": message}), GOOD)
    assert status == 400 and "0x" not in body["message"], body
    assert body["message"] == ("row 0: image: not a readable .npy array (Cannot parse header: "
                               "<ast.Call object>, id )")
