"""The request guard on its own, around planted ASGI apps: bodies refused before MLflow
parses them, an exception inside the app answered by a fixed line, addresses scrubbed.
The real server under hostile requests: ``test_server.py`` and ``test_fuzz.py``."""

from __future__ import annotations

import asyncio
import json
import logging

import pandas
import pytest

from serving.guard import GENERIC, INTERNAL, RequestGuard, json_refusal
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


@pytest.mark.parametrize(("body", "reason"), [
    ({"dataframe_records": [{"image": 0}]},
     "row 0: image: expected base64 text of a JPEG, PNG, WebP or .npy file, got a number"),
    ({"dataframe_records": [{"image": "AAAA"}, {"image": ["AAAA"]}]},
     "row 1: image: expected base64 text of a JPEG, PNG, WebP or .npy file, got a list"),
    ({"dataframe_split": {"columns": ["image"], "data": [["AAAA"], [{}]]}},
     "row 1: image: expected base64 text of a JPEG, PNG, WebP or .npy file, got an object"),
    ({"dataframe_records": [{"image": "/dev/zero"}]},
     "row 0: image: not valid base64 (its length or padding is wrong)"),
    ({"dataframe_records": [{"image": None}]},
     "row 0: set exactly one of 'image' (base64 of an encoded image) and 'path' (a file "
     "under the server's path root)"),
    ({"dataframe_records": [{"image": None, "path": "a.jpg"}]},
     "row 0: image: null; leave 'image' out of a row that sets 'path'"),
    ({"dataframe_records": [{"image": "AAAA"}], "params": {"space": ["backbone"]}},
     "params.space: expected text (projector or backbone), got a list"),
    ({"dataframe_records": [{"image": "AAAA"}], "params": "backbone"},
     "params: expected an object, got text"),
], ids=["number", "list-row-1", "split-object", "bad-padding", "null", "null-beside-path",
        "space-list", "params-text"])
def test_a_table_mlflow_cannot_read_is_refused_naming_the_row_and_cell(body, reason):
    reached = []

    async def app(scope, receive, send) -> None:
        reached.append(True)

    status, answered = exchange(app, json.dumps(body).encode())
    assert (status, answered["message"]) == (400, reason) and not reached


@pytest.mark.parametrize("body", [
    {"dataframe_records": [{"image": "AAAA", "extra": 1}]},  # MLflow drops other columns
    {"dataframe_records": [{"path": "a.jpg"}], "params": None},
    {"instances": [0]},  # not a table form: MLflow's to read
])
def test_tables_mlflow_reads_and_other_forms_reach_the_app(body):
    assert exchange(answering(200, {"predictions": [[0.5]]}),
                    json.dumps(body).encode())[0] == 200


def test_a_fault_of_our_code_is_a_500_and_mlflow_s_other_refusals_a_400():
    """``serving.pyfunc`` raises an exception of ours as MLflow's INTERNAL_ERROR (a 500):
    the guard keeps it a 500 with its fixed line; a 400 without our mark (MLflow refusing
    a body that is not a table) gets the fallback line."""
    fault = answering(500, {"error_code": "INTERNAL_ERROR",
                            "message": "encoder fault: RuntimeError"})
    assert exchange(fault, GOOD) == (500, {"error_code": "INTERNAL_ERROR",
                                           "message": INTERNAL})
    refused = answering(400, {"message": "Failed to predict data '...'"})
    assert exchange(refused, GOOD) == (400, {"error_code": "BAD_REQUEST",
                                             "message": GENERIC[400]})


def test_an_exception_in_the_decode_path_is_a_fault_not_a_refusal(monkeypatch, caplog):
    """Planted in ``decode``: ``predict`` raises MLflow's INTERNAL_ERROR (its 500) with no
    detail, and the server log holds the traceback."""
    from mlflow.exceptions import MlflowException

    from pretrain.model.encoder import Encoder, ModelConfig
    from registry.package import EmbeddingModel
    from serving import inputs
    from serving.pyfunc import EncoderModel
    from tests.data_pipeline.helpers import digit_sample

    def planted(*args, **kwargs):
        raise RuntimeError("planted fault in decode")

    served = EncoderModel()
    served.model = EmbeddingModel(Encoder(ModelConfig(width=8, projector_hidden=16,
                                                      projector_dim=8))).eval()
    served.tree = {"data": {"resolution": 16}}
    served.configure(ServeLimits())
    frame = pandas.DataFrame({"image": [digit_sample(0).image]})
    assert served.predict(None, frame).shape == (1, 8)
    monkeypatch.setattr(inputs, "decode", planted)
    with caplog.at_level(logging.ERROR, logger="serving"), \
            pytest.raises(MlflowException) as raised:
        served.predict(None, frame)
    assert raised.value.get_http_status_code() == 500
    assert raised.value.message == "encoder fault: RuntimeError"
    assert "planted fault in decode" in caplog.text and "Traceback" in caplog.text
