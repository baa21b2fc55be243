"""The served encoder against hostile requests: ``launch/serve.sh`` (MLflow's scoring app
behind :class:`serving.guard.RequestGuard`) on 127.0.0.1, probed over real HTTP.

Held here: JPEG files answer with the trained encoder's L2-normalised embeddings; path rows
are off without a root and, with one, read nothing but regular files under it, with one
answer for every refusal; the body, the rows and the decoded pixels are bounded before
the work; only JPEG, PNG and WebP are decoded; errors are one line, without a trace, a
heap address or the request, and are logged; a tampered artifact stops the server before
its code runs."""

from __future__ import annotations

import base64
import io
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from data_pipeline.transforms import DecodeSize, decode, eval_view
from pretrain.model.encoder import ModelConfig, encoder_from_state
from tests.data_pipeline.helpers import digit_sample
from tests.data_pipeline.test_image_limits import bomb_png
from tests.serving.helpers import raw_exchange, registered_encoder, send, serving, start

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

REFUSED = "row 0: path: not a readable file under the serving root"
TRACE_MARKS = ("Traceback", "stack_trace", " at 0x", 'File "', "site-packages")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def encoded(fmt: str, size: tuple[int, int] = (40, 28), colour: tuple = (20, 200, 90)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format=fmt)
    return out.getvalue()


ECHO_LIMIT = 40  # the most characters of a bad value a refusal may quote


def longest_echo(sent: bytes, raw: bytes) -> int:
    """The length of the longest run of bytes of ``sent`` found anywhere in ``raw``."""
    def shared(length: int) -> bool:
        runs = {raw[i:i + length] for i in range(len(raw) - length + 1)}
        return any(sent[i:i + length] in runs for i in range(len(sent) - length + 1))
    low, high = 0, min(len(sent), len(raw))  # shared(low) holds; shared(high + 1) does not
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if shared(middle) else (low, middle - 1)
    return low


def assert_clean(status: int, body: dict, raw: bytes, sent: bytes | dict = b"") -> str:
    """The answer is one JSON line with no trace, no address and no run of more than
    :data:`ECHO_LIMIT` characters of the request (``sent``: its body, or the payload
    :func:`send` encoded) anywhere in it."""
    assert status < 500 or status == 503, (status, raw[:500])
    message = body.get("message", "")
    assert set(body) == {"error_code", "message"}, raw[:500]
    assert "\n" not in message and len(message) <= 400, message
    assert not any(mark in raw.decode("latin-1") for mark in TRACE_MARKS), raw[:500]
    sent = sent if isinstance(sent, bytes) else json.dumps(sent).encode()
    echoed = longest_echo(sent, raw)
    assert echoed <= ECHO_LIMIT, (f"{echoed} characters of the request echoed", raw[:500])
    return message


def test_serve_answers_jpeg_files_with_normalised_embeddings(server, store, image_root):
    """JPEG bytes (base64 in JSON) and a path under the root, in both spaces, against the
    trained encoder applied to the evaluation view of the same files."""
    jpegs = [digit_sample(i).image for i in range(3)]
    records = [{"image": b64(data), "path": ""} for data in jpegs[:2]]
    records.append({"image": "", "path": "ok.jpg"})  # "" is absent; relative to the root
    records.append({"image": "", "path": str(image_root / "inside")})  # a link inside it
    answers = {}
    for space in ("projector", "backbone"):
        status, body, raw = send(server.port, {"dataframe_records": records,
                                               "params": {"space": space}})
        assert status == 200, raw[:500]
        answers[space] = body["predictions"]
    final = sorted((store.parent / "checkpoints").glob("step_*"))[-1] / "shared.pt"
    encoder = encoder_from_state(ModelConfig(projector_hidden=64, projector_dim=32),
                                 torch.load(final, weights_only=True)["model"]).eval()
    views = torch.stack([eval_view(16)(decode(data, "test", DecodeSize(16)))
                         for data in [*jpegs, jpegs[2]]])
    with torch.no_grad():
        features, projections = encoder(views)
    for space, want in (("projector", projections), ("backbone", features)):
        got = torch.tensor(answers[space])
        assert got.shape == want.shape
        torch.testing.assert_close(got, F.normalize(want, dim=1), rtol=1e-4, atol=1e-5)


def test_every_path_outside_the_root_or_not_a_regular_file_gets_one_answer(server, store):
    probes = ["/etc/shadow", "/etc/hostname", "/root/.ssh/id_rsa", "/etc", "/dev/zero",
              "/proc/self/environ", "../../../../etc/passwd", "missing.jpg", "fifo",
              "folder", "to_hostname", "to_zero", "a\x00b.jpg", str(store),
              "runs/run/mlflow.db", "/proc/self/fd/0"]
    for probe in probes:
        request = {"dataframe_records": [{"path": probe}]}
        status, body, raw = send(server.port, request)
        assert status == 400, (probe, raw[:300])
        assert assert_clean(status, body, raw, request).startswith(REFUSED), (probe, body)
    answers = {send(server.port, {"dataframe_records": [{"path": p}]})[2] for p in probes}
    assert len(answers) == 1  # byte for byte: nothing tells an existing file from another


def test_fifos_and_devices_never_hold_a_worker(server):
    """Six FIFO rows at once (the server has 6 worker threads), then a JPEG: answered."""
    threads = [threading.Thread(target=send, args=(server.port, {
        "dataframe_records": [{"path": "fifo"}]})) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    status, _, raw = send(server.port, {"dataframe_records": [
        {"image": b64(digit_sample(0).image)}]}, timeout=30)
    assert status == 200, raw[:300]


def test_an_oversized_body_is_refused_before_it_is_read(server):
    """A Content-Length of 100 MB is answered 413 with 10 bytes sent; a chunked body is
    read only to the 8 MiB cap."""
    head = (b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n")
    answer = raw_exchange(server.port, head, b'{"datafram', wait=20)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"over the server's limit of 8388608" in answer
    chunk = b"x" * (1 << 20)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(9)) + b"0\r\n\r\n"
    head = (b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    answer = raw_exchange(server.port, head, chunked)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert server.alive()


def test_rows_and_pixels_are_bounded_from_the_headers(server):
    tiny = b64(encoded("PNG", (2, 2)))
    request = {"dataframe_records": [{"image": tiny}] * 257}
    status, body, raw = send(server.port, request)
    assert status == 400
    assert "257 rows, over the limit of 256" in assert_clean(status, body, raw, request)
    bomb = bomb_png(9_400, 9_400)  # 88.4M pixels: under the run's per-image cap
    request = {"dataframe_records": [{"image": b64(bomb)}]}
    status, body, raw = send(server.port, request, timeout=10)
    message = assert_clean(status, body, raw, request)
    assert status == 400 and "decode to more than 33554432 pixels" in message, message


def test_memory_returns_near_idle_after_a_burst_of_large_images(server):
    """Six concurrent requests, each of a real 5,000 x 5,000 PNG (25M pixels, under the
    budget): answered, and the server's memory afterwards is back within 250 MiB of idle."""
    big = b64(encoded("PNG", (5000, 5000)))
    send(server.port, {"dataframe_records": [{"image": b64(encoded("PNG", (64, 64)))}]})
    idle = server.rss_mib()
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(send(server.port, {
        "dataframe_records": [{"image": big}]})[0])) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results == [200] * 6
    after = server.rss_mib()
    print(f"burst: idle {idle:.0f} MiB, after {after:.0f} MiB")
    assert after - idle < 250, (idle, after)


@pytest.mark.parametrize("fmt", ["EPS", "GIF", "BMP", "TIFF"])
def test_only_jpeg_png_and_webp_are_decoded(server, fmt):
    request = {"dataframe_records": [{"image": b64(encoded(fmt, (16, 16)))}]}
    status, body, raw = send(server.port, request)
    assert status == 400
    assert assert_clean(status, body, raw, request) == (
        f"row 0: image: format {fmt} is not accepted (send JPEG, PNG or WebP)")


def npy_header(shape: tuple[int, ...]) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": "<f4", "fortran_order": False,
                                                "shape": shape})
    return out.getvalue() + b"\0" * 64


@pytest.mark.parametrize(("payload", "content_type", "status", "starts"), [
    ({"dataframe_records": [{"image": b64(npy_header((3, 200_000, 200_000)))}]},
     "application/json", 400, "row 0: image: an array must be float [3, 16, 16]"),
    ({"dataframe_records": [{"image": "%%%"}]}, "application/json", 400, "row 0: "),
    ({"dataframe_records": [{"image": b64(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)}]},
     "application/json", 400, "row 0: image: "),
    (b"{not json", "application/json", 400, "request: the body is not valid JSON"),
    (b"image\nAAAA\n", "text/csv", 415, "request: send Content-Type: application/json"),
    ({"dataframe_records": [{"image": b64(encoded("JPEG"))}], "params": {"space": "x" * 500}},
     "application/json", 400, "params.space: 'xxxx"),
])
def test_errors_are_one_line_without_trace_address_or_echo(server, payload, content_type,
                                                            status, starts):
    got, body, raw = send(server.port, payload, content_type)
    assert got == status, raw[:500]
    assert assert_clean(got, body, raw, payload).startswith(starts), body
    log = server.log.read_text()
    assert "refused 127.0.0.1:" in log and f": {status} {body['message']}" in log


def test_a_tampered_artifact_stops_the_server_naming_the_file(digits_shards, tmp_path):
    store = registered_encoder(digits_shards, tmp_path, name="tampered")
    code = next((store.parent / "mlartifacts").rglob("pyfunc.py"))
    code.write_text(code.read_text() + "\nopen('/tmp/ARTIFACT_CODE_RAN', 'w')\n")
    marker = Path("/tmp/ARTIFACT_CODE_RAN")
    marker.unlink(missing_ok=True)
    process = start(store, "models:/tampered/1", tmp_path)
    assert process.wait(timeout=240) == 1
    lines = (tmp_path / "serve.log").read_text().strip().splitlines()
    assert lines[-1] == ("serve: error: models:/tampered/1: file pyfunc.py does not match its "
                         "registered SHA-256 digest; refusing to load it (the artifact store "
                         "was changed)"), lines[-3:]
    assert not marker.exists()


def test_path_rows_are_off_without_a_root(store, tmp_path):
    with serving(store, "models:/served/1", tmp_path) as plain:
        request = {"dataframe_records": [{"path": "/etc/shadow"}]}
        status, body, raw = send(plain.port, request)
        assert status == 400
        assert assert_clean(status, body, raw, request) == (
            "row 0: path: path rows are off on this server; send the image's bytes in "
            "'image'")
