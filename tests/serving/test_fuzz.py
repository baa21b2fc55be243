"""A seeded fuzz pass through the real server: 400 mutated image files (JPEG, PNG, WebP,
.npy: bit flips, cuts, spliced bytes, rewritten header fields) and 200 mutated JSON bodies
(wrong types, missing and extra keys, nested values, odd parameters, path rows). No answer
is a 5xx (a fault of our code is one: the oracle sees it) or carries a trace, an address or
the request; a table of one row is embedded or refused naming what was wrong, never with
the fallback line; ``/ping`` stays up; the server's memory stays bounded. And the requests
an earlier fuzz pass found answered 500, 200 with ``NaN`` tokens or an address: each is
answered 400 in one line."""

from __future__ import annotations

import base64
import io
import json
import random
import re
import struct
from collections import Counter

import numpy as np
from PIL import Image

from serving.guard import GENERIC
from tests.serving.helpers import send
from tests.serving.test_server import assert_clean

SEED, FILES, BODIES = 20261125, 400, 200


def corpus() -> list[bytes]:
    """Valid files of every accepted kind, and a normalised .npy array."""
    rng = np.random.default_rng(SEED)
    files = []
    for fmt, size in (("JPEG", (48, 40)), ("PNG", (33, 20)), ("WEBP", (24, 24)),
                      ("JPEG", (300, 200)), ("PNG", (64, 64))):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), np.uint8)).save(out, fmt)
        files.append(out.getvalue())
    out = io.BytesIO()
    np.save(out, rng.standard_normal((3, 16, 16)).astype(np.float32))
    files.append(out.getvalue())
    return files


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to four random edits of ``data``."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(6)
        at = rng.randrange(max(1, len(data)))
        if kind == 0:  # flip bits
            data[at] ^= 1 << rng.randrange(8)
        elif kind == 1:  # cut the tail
            del data[at:]
        elif kind == 2:  # splice random bytes
            data[at:at] = rng.randbytes(rng.randint(1, 64))
        elif kind == 3 and len(data) > 24:  # a header field: width/height-like integers
            at = rng.randrange(8, 24)
            data[at:at + 4] = struct.pack(">I", rng.choice([0, 1, 0xFFFF, 0x7FFFFFFF,
                                                            rng.randrange(1 << 32)]))
        elif kind == 4:  # repeat a chunk
            data[at:at] = data[at:at + rng.randint(1, 256)] * rng.randint(1, 8)
        else:  # overwrite a byte run
            data[at:at + 8] = rng.randbytes(8)
    return bytes(data)


def mutated_body(rng: random.Random, files: list[bytes]) -> tuple[str, bytes]:
    """(what it is, a JSON or almost JSON body of the wrong shape): ``table`` for a
    well-formed table of one row (the server must embed it or name what is wrong with it),
    ``other`` for anything else."""
    good = base64.b64encode(rng.choice(files)).decode()
    odd = rng.choice([None, 0, -1, 1e308, True, "", "x" * rng.randint(1, 3000), [], {},
                      [good], {"image": good}, "../../etc/passwd", "/dev/zero", "\u0000",
                      "fifo", good[: rng.randrange(len(good))]])
    bodies = [
        ("table", {"dataframe_records": [{"image": odd}]}),
        ("table", {"dataframe_records": [{"path": odd}]}),
        ("table", {"dataframe_records": [{"image": good, "path": odd}]}),
        ("table", {"dataframe_records": [{"image": good,
                                          odd if isinstance(odd, str) else "k": 1}]}),
        ("other", {"dataframe_records": odd}),
        ("table", {"dataframe_split": {"columns": ["image"], "data": [[odd]]}}),
        ("other", {"instances": [odd]}),
        ("other", {"inputs": {"image": [odd]}}),
        ("table", {"dataframe_records": [{"image": good}], "params": {"space": odd}}),
        ("other", {"dataframe_records": [{"image": good}], "params": odd}),
        ("other", {"dataframe_records": [{"image": good}] * rng.randint(1, 8), "extra": odd}),
        ("other", odd),
    ]
    kind, body = rng.choice(bodies)
    text = json.dumps(body)
    if rng.random() < 0.15:  # broken JSON
        at = rng.randrange(len(text))
        text = text[:at] + rng.choice(["", "{", "\"", "]", "\\u12"]) + text[at + 1:]
        kind = "other"
    return kind, text.encode()


def fuzzed(rng: random.Random, files: list[bytes]) -> list[tuple[str, bytes]]:
    """The pass's requests in order: mutated files, each in a table of one row, then
    mutated bodies."""
    requests = []
    for _ in range(FILES):
        data = mutate(rng.choice(files), rng)
        requests.append(("table", json.dumps({"dataframe_records": [
            {"image": base64.b64encode(data).decode()}]}).encode()))
    return requests + [mutated_body(rng, files) for _ in range(BODIES)]


def refusal_kind(message: str) -> str:
    """A refusal's subject and reason without its variable detail."""
    return re.sub(r" \(.*", "", re.sub(r"\d+", "N", message))[:80]


def test_mutated_files_and_bodies_never_break_the_server(server):
    """Every answer is 200 or one clean line and none is a 5xx; a one-row table is embedded
    or refused naming what was wrong, never with the fallback line (which is for bodies
    that are not a table). ``got`` names what each kind of request got."""
    files = corpus()
    send(server.port, {"dataframe_records": [{"image": base64.b64encode(files[0]).decode()}]})
    idle = server.rss_mib()
    got: Counter = Counter()
    unnamed = []
    for i, (kind, payload) in enumerate(fuzzed(random.Random(SEED), files)):
        status, body, raw = send(server.port, payload, timeout=60)
        message = assert_clean(status, body, raw, payload) if status != 200 else ""
        got[(kind, status, refusal_kind(message))] += 1
        if kind == "table" and (status >= 500 or message == GENERIC[400]):
            unnamed.append((i, status, message[:120]))
    report = "\n".join(f"{n:4d} {kind} {status} {what}"
                       for (kind, status, what), n in sorted(got.items()))
    print(report)
    assert not unnamed, (unnamed, report)
    assert all(status < 500 for _, status, _ in got), report
    assert server.alive()
    assert server.rss_mib() - idle < 300, (idle, server.rss_mib())
    statuses = Counter()
    for (_, status, _), n in got.items():
        statuses[status] += n
    assert statuses[200] > 20 and statuses[400] > 200, report


def npy(array: np.ndarray) -> str:
    out = io.BytesIO()
    np.save(out, array)
    return base64.b64encode(out.getvalue()).decode()


def code_in_shape() -> str:
    """A .npy whose header's shape field is a call: read as data, never run."""
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (__import__('os').getpid(),), }"
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    return base64.b64encode(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header
                            + b"\x00" * 64).decode()


def finding_bodies() -> dict[str, bytes]:
    """The hostile requests of the fuzz pass that got a 500, a 200 holding ``NaN`` or an
    address: each must be answered 400 in one line."""
    good = base64.b64encode(corpus()[0]).decode()
    normal = np.random.default_rng(SEED).standard_normal((3, 16, 16)).astype(np.float32)
    bodies = {"nested 10,000 deep": ("[" * 10_000 + "]" * 10_000).encode(),
              "nested in a row": ('{"dataframe_records": [{"image": ' + "[" * 10_000
                                  + "]" * 10_000 + "}]}").encode(),
              "5,000-digit image": b'{"dataframe_records": [{"image": ' + b"9" * 5000 + b"}]}",
              "5,000-digit space": ('{"dataframe_records": [{"image": "' + good
                                    + '"}], "params": {"space": ' + "9" * 5000 + "}}").encode(),
              "NaN token": ('{"dataframe_records": [{"image": "' + good
                            + '"}], "params": {"space": NaN}}').encode(),
              "code in a .npy shape": json.dumps(
                  {"dataframe_records": [{"image": code_in_shape()}]}).encode()}
    for name, value in (("NaN", np.nan), ("+inf", np.inf), ("-inf", -np.inf), ("3e38", 3e38)):
        for at in ((0, 0, 0), (2, 15, 15)):
            planted = normal.copy()
            planted[at] = value
            bodies[f".npy {name} at {at}"] = json.dumps(
                {"dataframe_records": [{"image": good}, {"image": npy(planted)}]}).encode()
    bodies[".npy float64 1e300"] = json.dumps({"dataframe_records": [
        {"image": npy(np.full((3, 16, 16), 1e300))}]}).encode()
    unbalanced = b"{'descr': '<f4', 'fortran_order': False, 'shape': (3, 32, 32"
    unbalanced += b" " * (63 - (len(unbalanced) + 10) % 64) + b"\n"
    bodies[".npy header unbalanced"] = json.dumps({"dataframe_records": [
        {"image": good}, {"image": base64.b64encode(
            b"\x93NUMPY\x01\x00" + struct.pack("<H", len(unbalanced)) + unbalanced
            + b"\x00" * 64).decode()}]}).encode()
    return bodies


def test_the_fuzzer_findings_are_answered_400_in_one_line(server):
    for name, payload in finding_bodies().items():
        status, body, raw = send(server.port, payload, timeout=60)
        assert status == 400, (name, status, raw[:300])
        message = assert_clean(status, body, raw, payload)
        assert "0x" not in message, (name, message)
        if name.startswith(".npy") and "1e300" not in name:
            assert message.startswith("row 1: "), (name, message)
    assert server.alive()
