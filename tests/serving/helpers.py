"""A registered encoder served by ``launch/serve.sh`` on 127.0.0.1, and clients for it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.app.helpers import REPO, run_pretrain, train_overrides
from tests.ports import free_port


@dataclass
class Server:
    port: int
    process: subprocess.Popen
    log: Path

    def rss_mib(self) -> float:
        """Resident memory of the server and its children, MiB."""
        root = psutil.Process(self.process.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20

    def alive(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ping", timeout=10) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False


def registered_encoder(shards: Path, out: Path, name: str = "served") -> Path:
    """Train two steps and register the encoder; the run's SQLite store."""
    result = run_pretrain(train_overrides(shards, out, **{
        "tracking.enabled": True, "tracking.system_metrics": False, "train.max_steps": 2,
        "tracking.registered_model": name}))
    assert result.returncode == 0, result.stderr[-3000:]
    return out / "run" / "mlflow.db"


def start(store: Path, model: str, cwd: Path, *options: str) -> subprocess.Popen:
    """``launch/serve.sh`` with the venv neither activated nor on ``PATH``."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin"
    return subprocess.Popen(["bash", str(REPO / "launch" / "serve.sh"), str(store), model,
                             *options], cwd=cwd, env=env, stdout=open(cwd / "serve.log", "a"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def serving(store: Path, model: str, cwd: Path, *options: str) -> Iterator[Server]:
    """The server, once ``/ping`` answers; stopped on exit."""
    port = free_port()
    process = start(store, model, cwd, str(port), *options)
    server = Server(port, process, cwd / "serve.log")
    try:
        deadline = time.monotonic() + 240
        while not server.alive():
            assert process.poll() is None, server.log.read_text()[-3000:]
            if time.monotonic() > deadline:
                pytest.fail(server.log.read_text()[-3000:])
            time.sleep(0.5)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def send(port: int, payload: dict | bytes, content_type: str = "application/json",
         timeout: float = 120) -> tuple[int, dict, bytes]:
    """(HTTP status, JSON body or {}, raw body) of POST /invocations."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=data,
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = {}
    return status, body, raw


def raw_exchange(port: int, head: bytes, body: bytes = b"", wait: float = 30) -> bytes:
    """Send ``head`` and ``body`` over a plain socket; what the server answered first."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as conn:
        conn.sendall(head + body)
        answer = b""
        with contextlib.suppress(ConnectionResetError, TimeoutError, BrokenPipeError):
            while b"\r\n\r\n" not in answer or len(answer) < answer.find(b"\r\n\r\n") + 5:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                answer += chunk
        return answer
