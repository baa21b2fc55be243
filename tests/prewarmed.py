"""Command-line runs of the project's modules without paying their imports each time.

Most of the suite's time went to starting interpreters: ``python -m app.pretrain`` spends
about 3 s importing torch, torchvision and the project before its first line of work, and
the suite starts it and ``app.evaluate`` dozens of times. :func:`run_module` runs
``python -m <module> <args>`` in a process forked from a server that imported them once
(the way DataLoader workers and multiprocessing's forkserver start): the module runs as
``__main__`` in the repository root with its own argv, environment, stdin, stdout and
stderr, ends through the interpreter's own exit (threads joined, atexit handlers run, streams
flushed) and reports its exit status as ``subprocess.run`` does (a negative status: the
signal that killed it).

What it does not prove, and who does: that the command imports from a fresh interpreter
(every ``torchrun`` rank of the suite starts one, and ``tests/app/test_run_config.py`` runs
``python -m app.pretrain --help`` fresh), and what a variable read at import time does
(a server is started with the run's environment: a run whose environment differs from
every server's in anything but :data:`READ_AT_RUN_TIME` gets a server started with its own).

A server is one process, single-threaded when it forks (it refuses to serve otherwise);
each run is a grandchild (the middle process waits for it and reports its status), so
the server never waits on anyone.
"""

from __future__ import annotations

import contextlib
import io
import json
import locale
import os
import runpy
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# imported by the server: the commands, with what they import, and what their runs import
# when they track (MLflow, 1.7 s) or read captions (transformers)
PRELOADED = ("app.pretrain", "app.evaluate", "mlflow", "transformers")
READ_AT_RUN_TIME = frozenset({"PYTEST_CURRENT_TEST"})  # set per test phase by pytest
START_TIMEOUT_S = 120.0
HEADER = struct.Struct("!Q")  # the request body's length, sent with the run's descriptors


class Server:
    """The pre-imported interpreter: a child process listening on a Unix socket."""

    def __init__(self, env: dict[str, str]) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="prewarmed-"))
        self.address = str(self.directory / "socket")
        self.log = self.directory / "server.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.prewarmed", self.address], cwd=REPO, env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(self.address):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"tests.prewarmed: the server did not start:\n"
                                   f"{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for path in self.directory.iterdir():
            path.unlink()
        self.directory.rmdir()


def startup(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What of ``env`` a process may read while it starts."""
    return tuple(sorted((k, v) for k, v in env.items() if k not in READ_AT_RUN_TIME))


_servers: dict[tuple[tuple[str, str], ...], Server] = {}  # by the environment they started in
MAX_SERVERS = 3  # the suite runs the commands in 2 environments (``OMP_NUM_THREADS`` or not)


def server_for(env: dict[str, str]) -> Server:
    key = startup(env)
    server = _servers.pop(key, None)  # put back last: the least recently used goes first
    if server is not None and server.process.poll() is not None:
        server.close()
        server = None
    if server is None:
        while len(_servers) >= MAX_SERVERS:
            _servers.pop(next(iter(_servers))).close()
        server = Server(env)
    _servers[key] = server
    return server


def close() -> None:
    """Stop the servers (the session's end; a new one starts on the next run)."""
    while _servers:
        _servers.popitem()[1].close()


def run_module(module: str, args: list[str], env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", module, *args], cwd=REPO, env=env,
    capture_output=True, text=True, timeout=timeout)``, forked from the server."""
    command = [sys.executable, "-m", module, *args]
    request = json.dumps({"module": module, "args": args, "env": env}).encode()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(server_for(env).address)
        socket.send_fds(connection, [HEADER.pack(len(request))], [out.fileno(), err.fileno()])
        connection.sendall(request)
        connection.settimeout(timeout)
        replies = connection.makefile("rb")
        pid = int(replies.readline())
        try:
            status = replies.readline()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(command, timeout, read(out), read(err)) from None
        if not status:
            raise RuntimeError(f"tests.prewarmed: the server lost run {pid} of {command}")
        return subprocess.CompletedProcess(command, int(status), read(out), read(err))


def read(file: io.BufferedRandom) -> str:
    """The file's bytes as ``text=True`` decodes a pipe (universal newlines)."""
    file.seek(0)
    return io.TextIOWrapper(io.BytesIO(file.read()),
                            encoding=locale.getpreferredencoding(False)).read()


def serve(address: str) -> None:
    for module in PRELOADED:
        __import__(module)
    if threading.active_count() != 1:  # a fork would copy a thread's locks half-held
        raise SystemExit(f"tests.prewarmed: importing {PRELOADED} started threads "
                         f"{threading.enumerate()}")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the middle processes reap themselves
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".new")
    listener.listen(16)
    os.rename(address + ".new", address)  # ready
    while True:
        connection, _ = listener.accept()
        header, fds, _, _ = socket.recv_fds(connection, HEADER.size, 2)
        body = receive(connection, HEADER.unpack(header)[0])
        if os.fork() == 0:
            listener.close()
            wait_for_run(connection, json.loads(body), fds)  # the run returns from here
            return
        connection.close()
        for fd in fds:
            os.close(fd)


def receive(connection: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunks.append(connection.recv(size))
        if not chunks[-1]:
            raise ConnectionError("the request ended early")
        size -= len(chunks[-1])
    return b"".join(chunks)


def wait_for_run(connection: socket.socket, request: dict, fds: list[int]) -> None:
    """The middle process: fork the run, report its pid and then its exit status. Only
    the run itself returns from here."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        connection.close()
        become_run(request, fds)
        return
    for fd in fds:
        os.close(fd)
    connection.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):  # the client gave up (its timeout)
        connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def become_run(request: dict, fds: list[int]) -> None:
    """Turn this process into ``python -m <module> <args>`` and run it: what is left of
    the server's stack only unwinds after it, into the interpreter's exit."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    for target, fd in zip((0, 1, 2), (stdin, *fds), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]  # argv[0]: runpy sets the file
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    serve(sys.argv[1])
