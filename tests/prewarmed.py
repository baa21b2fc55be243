"""Command-line runs of the project's modules without paying their imports each time.

Most of the suite's time went to starting interpreters: ``python -m app.pretrain`` spends
about 3 s importing torch, torchvision and the project before its first line of work, and
the suite starts it and ``app.evaluate`` dozens of times. :func:`run_module` runs
``python -m <module> <args>`` in a process forked from a server that imported them once
(the way DataLoader workers and multiprocessing's forkserver start): the module runs as
``__main__`` in the repository root with its own argv, environment, stdin, stdout and
stderr, ends as the interpreter ends it (threads joined, atexit handlers run, streams
flushed: :func:`end`) and reports its exit status as ``subprocess.run`` does (a negative
status: the signal that killed it).

:func:`run_torchrun` does the same for ``torchrun``: the agent is forked from the server,
and so is each rank, through the server's stand-in for ``python`` (torchrun starts its
ranks with ``$PYTHON_EXEC -u -m <module> <args>``). The stand-in is what the agent watches:
it hands its environment, working directory and stdin/stdout/stderr to the forked rank,
forwards the signals the agent sends, ends with the rank's exit status (or its signal),
and a rank whose stand-in is killed is killed with it. A launch script that starts its
stages as ``"$PYTHON" -m <module> <args>`` (``launch/demo_pipeline.sh``) has each forked
the same way, with the stand-in as ``PYTHON``.

What it does not prove, and who does: that the command imports from a fresh interpreter
and tears it down (the signal, restart and multi-node tests start real ``torchrun`` ranks,
and ``tests/app/test_run_config.py`` runs ``python -m app.pretrain --help`` fresh), and
what a variable read at import time does (a server is started with the run's environment: a run
whose environment differs from every server's in anything but :data:`READ_AT_RUN_TIME` gets
a server started with its own; a rank may differ only in what torchrun sets,
:data:`SET_BY_TORCHRUN`, which is read when the process group starts).

A server is one process with one thread, as the kernel counts them, when it forks (else it
refuses to serve: a lock another thread held stays held in the child). The imports' native
threads are turned off first (:data:`NO_NATIVE_THREADS`: Arrow's jemalloc purger, OpenBLAS's
pools; numpy's BLAS runs on one thread in a run). Each run is a grandchild (the middle
process waits for it and reports its status), so the server never waits on anyone.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import locale
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parents[1]
# imported by the server: the commands, with what they import, and what their runs import
# when they track (MLflow, 1.7 s) or read captions (transformers)
PRELOADED = ("app.pretrain", "app.evaluate", "mlflow", "transformers", "torch.distributed.run")
# set per test phase by pytest; the interpreter torchrun starts its ranks with; the session
# id MLflow's telemetry sets in a test's environment once the test uses MLflow, for what it
# starts to report under (an identifier, read when a run first tracks)
READ_AT_RUN_TIME = frozenset({"PYTEST_CURRENT_TEST", "PYTHON_EXEC",
                              "_MLFLOW_TELEMETRY_SESSION_ID",
                              # read by the launch scripts, not by Python: the interpreter
                              # their stages start with (a stand-in), the demo's folder
                              "PYTHON", "DEMO_DIR",
                              # what bash exports to each command it starts
                              "_", "SHLVL", "PWD", "OLDPWD"})
NO_NATIVE_THREADS = {"JE_ARROW_MALLOC_CONF": "background_thread:false",  # MLflow's pyarrow
                     "OPENBLAS_NUM_THREADS": "1"}  # numpy's and scipy's OpenBLAS
SET_BY_TORCHRUN = frozenset({  # for each rank, by torch.distributed.run's agent
    "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "RANK", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "WORLD_SIZE"})
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)  # from the stand-in to its rank
START_TIMEOUT_S = 120.0
HEADER = struct.Struct("!Q")  # the request body's length, sent with the run's descriptors


class Server:
    """The pre-imported interpreter: a child process listening on a Unix socket."""

    def __init__(self, env: dict[str, str]) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="prewarmed-"))
        self.address = str(self.directory / "socket")
        self.log = self.directory / "server.log"
        self.python = self.directory / "python"  # ``python``'s stand-in: :func:`stand_in`
        self.python.write_text(f"#!{sys.executable}\nimport sys\n"
                               f"sys.path.insert(0, {str(REPO)!r})\n"
                               f"from tests.prewarmed import stand_in\n"
                               f"stand_in({self.address!r}, sys.argv[1:])\n")
        self.python.chmod(0o755)
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.prewarmed", self.address], cwd=REPO, env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(self.address):
            if self.process.poll() is not None or time.monotonic() > deadline:
                said = self.log.read_text(errors="replace")[-3000:]  # before close() removes it
                self.close()
                raise RuntimeError(f"tests.prewarmed: the server did not start:\n{said}")
            time.sleep(0.05)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for path in self.directory.iterdir():
            path.unlink()
        self.directory.rmdir()


def startup(env: dict[str, str], rank: bool = False) -> tuple[tuple[str, str], ...]:
    """What of ``env`` a process (a torchrun rank: ``rank``) may read while it starts."""
    ignored = READ_AT_RUN_TIME | SET_BY_TORCHRUN if rank else READ_AT_RUN_TIME
    return tuple(sorted((k, v) for k, v in env.items() if k not in ignored))


_servers: dict[tuple[tuple[str, str], ...], Server] = {}  # by the environment they started in
# the commands run in 2 environments (``OMP_NUM_THREADS`` or not), and each img2dataset
# test in one of its own (its ``XDG_CACHE_HOME``), which should not evict them
MAX_SERVERS = 5


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
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            open(os.devnull, "rb") as stdin, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(server_for(env).address)
        request = {"module": module, "args": args, "env": env, "cwd": str(REPO),
                   "ignored": ignored()}
        pid, replies = send(connection, request, [stdin.fileno(), out.fileno(), err.fileno()])
        connection.settimeout(timeout)
        try:
            status = replies.readline()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(command, timeout, read(out), read(err)) from None
        if not status:
            raise RuntimeError(f"tests.prewarmed: the server lost run {pid} of {command}")
        errors = read(err)
        return subprocess.CompletedProcess(command, int(status), read(out),
                                           errors + native_crash(errors))


def native_crash(stderr: str) -> str:
    """The fault handler's report of a crash in native code (the fatal error and the
    crashing thread's Python stack), repeated at the end of ``stderr``, where a test's
    failure message (its last few thousand characters) shows it: the report itself is
    followed by the extension modules' list and torchrun's summary; "" without one."""
    start = stderr.rfind("Fatal Python error:")
    if start < 0:
        return ""
    report = stderr[start:]
    current = report.find("Current thread")
    stack = report[current:report.find("\n\n", current)] if current >= 0 else ""
    return f"\n[native crash, repeated]\n{report.splitlines()[0]}\n{stack[:2000]}\n"


def run_torchrun(module: str, args: list[str], nproc: int, env: dict[str, str],
                 timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", "torch.distributed.run", "--standalone",
    "--nproc_per_node", nproc, "-m", module, *args], ...)`` as :func:`run_module` runs it,
    the agent and each rank forked from the server."""
    if nproc > 1:  # what torchrun sets for its ranks when it is unset, read at import
        env = {"OMP_NUM_THREADS": "1", **env}
    launch = ["--standalone", "--nproc_per_node", str(nproc), "-m", module, *args]
    return run_module("torch.distributed.run", launch,
                      {**env, "PYTHON_EXEC": str(server_for(env).python)}, timeout)


def ignored() -> list[int]:
    """The signals of :data:`FORWARDED` this process ignores: those a process it starts
    ignores too (every other one starts with its default action)."""
    return [int(signum) for signum in FORWARDED if signal.getsignal(signum) is signal.SIG_IGN]


def send(connection: socket.socket, request: dict,
         fds: list[int]) -> tuple[int, io.BufferedReader]:
    """Ask the server for a run with ``fds`` as its stdin, stdout and stderr: its pid, and
    the replies, whose next line is its exit status."""
    body = json.dumps(request).encode()
    socket.send_fds(connection, [HEADER.pack(len(body))], fds)
    connection.sendall(body)
    replies = connection.makefile("rb")
    reply = replies.readline()
    if not reply.strip().isdigit():
        raise RuntimeError(f"tests.prewarmed: the server refused {request['module']}: "
                           f"{reply.decode(errors='replace').strip() or 'no reply'}")
    return int(reply), replies


def stand_in(address: str, argv: list[str]) -> None:
    """``python <argv>`` for a torchrun rank (``PYTHON_EXEC``: ``-u -m <module> <args>``) or
    a launch script's stage (``PYTHON``: ``-m <module> <args>``), forked from the server at
    ``address``; anything else runs the real interpreter."""
    rank = argv[:1] == ["-u"]  # torchrun starts its ranks unbuffered
    command = argv[1:] if rank else argv
    if command[:1] != ["-m"] or len(command) < 2:
        os.execv(sys.executable, [sys.executable, *argv])
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(address)
    request = {"module": command[1], "args": command[2:], "env": dict(os.environ),
               "cwd": os.getcwd(), "ignored": ignored(), "rank": rank}
    try:
        pid, replies = send(connection, request, [0, 1, 2])
    except RuntimeError as refused:
        raise SystemExit(str(refused)) from None

    def forward(received: int, _: object) -> None:
        with contextlib.suppress(ProcessLookupError):  # the rank has ended
            os.kill(pid, received)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    status = replies.readline()  # empty: the server went away before the rank ended
    code = int(status) if status.strip() else -signal.SIGKILL
    if code < 0:  # end as the rank ended: by its signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)


def read(file: io.BufferedRandom) -> str:
    """The file's bytes as ``text=True`` decodes a pipe (universal newlines)."""
    file.seek(0)
    return io.TextIOWrapper(io.BytesIO(file.read()),
                            encoding=locale.getpreferredencoding(False)).read()


def serve(address: str) -> NoReturn:
    own = dict(os.environ)  # before the imports, which may set variables of their own
    os.environ.update(NO_NATIVE_THREADS)
    for module in PRELOADED:
        __import__(module)
    if len(threads()) != 1:  # a fork would copy another thread's locks half-held
        raise SystemExit(f"tests.prewarmed: importing {PRELOADED} started threads "
                         f"{threads()}")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the middle processes reap themselves
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".new")
    listener.listen(16)
    os.rename(address + ".new", address)  # ready
    while True:
        connection, _ = listener.accept()
        header, fds, _, _ = socket.recv_fds(connection, HEADER.size, 3)
        request = json.loads(receive(connection, HEADER.unpack(header)[0]))
        differs = differences(own, request)
        if differs:
            connection.sendall(f"started in another environment: {differs}\n".encode())
        elif os.fork() == 0:
            listener.close()
            wait_for_run(connection, request, fds)
        connection.close()
        for fd in fds:
            os.close(fd)


def threads() -> list[str]:
    """The names of this process's threads as the kernel (Linux) lists them."""
    tasks = Path("/proc/self/task")
    return [(tasks / task / "comm").read_text().strip() for task in os.listdir(tasks)]


def differences(own: dict[str, str], request: dict) -> list[str]:
    """The variables a run may read while it starts that differ from the server's."""
    rank = request.get("rank", False)
    mine, theirs = dict(startup(own, rank)), dict(startup(request["env"], rank))
    return sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))


def receive(connection: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunks.append(connection.recv(size))
        if not chunks[-1]:
            raise ConnectionError("the request ended early")
        size -= len(chunks[-1])
    return b"".join(chunks)


def wait_for_run(connection: socket.socket, request: dict, fds: list[int]) -> NoReturn:
    """The middle process: fork the run, report its pid and then its exit status; a client
    that goes away first (a stand-in killed) takes the run with it."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        connection.close()
        become_run(request, fds)
    for fd in fds:
        os.close(fd)
    run = os.pidfd_open(pid)
    try:
        connection.sendall(f"{pid}\n".encode())
        hung_up = run not in select.select([connection, run], [], [])[0]
    except OSError:  # the client went away before it read the pid
        hung_up = True
    if hung_up:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):  # the client gave up (its timeout)
        connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def become_run(request: dict, fds: list[int]) -> NoReturn:
    """Turn this process into ``python -m <module> <args>``, run it and exit as its
    interpreter would."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request.get("rank"):  # torchrun's ``-u``: unbuffered stdout and stderr
        sys.stdout, sys.stderr = (
            io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), write_through=True,
                             encoding=stream.encoding, errors=stream.errors)
            for fd, stream in ((1, sys.stdout), (2, sys.stderr)))
    for signum in FORWARDED:  # as the client would have started it, not as the server was
        default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        signal.signal(signum, signal.SIG_IGN if signum in request["ignored"] else default)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as ``python -m`` puts it first
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]  # argv[0]: runpy sets the file
    sys.modules.pop(request["module"], None)  # as in a fresh interpreter: not yet imported
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as ending:
        end(exit_status(ending.code))
    except BaseException as error:  # the interpreter's own last resort
        sys.excepthook(type(error), error, error.__traceback__)
        end(-signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1)
    end(0)


def exit_status(code: object) -> int:
    """The exit status the interpreter makes of ``sys.exit(code)`` (0-255)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def end(status: int) -> NoReturn:
    """The interpreter's exit as far as a caller sees it: non-daemon threads joined, atexit
    handlers run, stdout and stderr flushed, then the status (a negative one: that signal,
    as an uncaught KeyboardInterrupt ends). What comes after that in the interpreter's
    own exit, its teardown of every module and object, is skipped: 1.7 s for what the
    server imported in a fresh interpreter, 2.1 s in a fork, where each object's page is
    copied before it is freed."""
    threading._shutdown()  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and not stream.closed:
            try:
                stream.flush()
            except OSError:  # the interpreter's status for a failed flush, short of a signal
                status = 120 if status >= 0 else status
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)


if __name__ == "__main__":
    serve(sys.argv[1])
