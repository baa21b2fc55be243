"""A run forked from the pre-imported server (``tests/prewarmed.py``) is what a fresh
``python -m`` interpreter shows the module and the caller: the same output, exit status,
argv, ``__name__``, environment, working directory, stdin and signal dispositions, its
threads joined and atexit handlers run; a run past its timeout is killed and reported as
``subprocess.run`` reports it. Under torchrun, forked ranks are what fresh ranks are to the
agent, and a rank goes with its stand-in; so are a launch script's stages."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests import prewarmed

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

ENDINGS = ["normal", "exit-message", "exit-3", "exit-negative", "raise", "interrupt",
           "sigterm"]


def fresh(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.prewarmed_probe", *args],
                          cwd=prewarmed.REPO, env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def without_server_frames(stderr: str) -> str:
    """A traceback's lines from the module's own frames on (the server's frames sit above
    them in the forked run, the interpreter's runpy frames in the fresh one)."""
    lines = stderr.splitlines()
    if "Traceback (most recent call last):" not in lines:
        return stderr
    return "\n".join(line for line in lines if "prewarmed" not in line or "probe" in line
                     ).split("_probe.py", 1)[-1]


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_forked_run_shows_what_a_fresh_interpreter_shows(ending):
    env = {**os.environ, "PROBE": "value"}
    expected = fresh([ending, "second"], env)
    got = prewarmed.run_module("tests.prewarmed_probe", [ending, "second"], env, timeout=120)
    assert got.args == expected.args
    assert got.returncode == expected.returncode, (got, expected)
    assert got.stdout == expected.stdout
    assert without_server_frames(got.stderr) == without_server_frames(expected.stderr)
    assert "probe=value" in got.stdout or ending == "sigterm"


def test_a_crash_in_native_code_is_repeated_where_a_failure_message_shows_it():
    """The fault handler's report sits above thousands of characters of what follows it (a
    launcher's summary here); the run's stderr ends with it again."""
    got = prewarmed.run_module("tests.prewarmed_probe", ["segfault"],
                               {**os.environ, "PROBE": "value"}, timeout=120)
    assert got.returncode == -signal.SIGSEGV
    tail = got.stderr[-3000:]
    assert "[native crash, repeated]\nFatal Python error: Segmentation fault" in tail, tail
    repeated = tail.split("[native crash, repeated]")[-1]
    assert "Current thread" in repeated and "prewarmed_probe.py" in repeated, tail
    assert prewarmed.native_crash("no crash here\n") == ""


def test_a_run_past_its_timeout_is_killed_and_reported():
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        prewarmed.run_module("tests.prewarmed_probe", ["sleep"], {**os.environ, "PROBE": "value"},
                             timeout=2)
    assert caught.value.timeout == 2
    assert "to stderr" in caught.value.stderr
    # the next run is served as before
    assert prewarmed.run_module("tests.prewarmed_probe", ["normal"],
                                {**os.environ, "PROBE": "value"}, timeout=120).returncode == 0


def test_an_environment_read_at_import_gets_its_own_server():
    env = {**os.environ, "PROBE": "value"}
    first = prewarmed.server_for(env)
    assert prewarmed.server_for({**env, "PYTEST_CURRENT_TEST": "another phase"}) is first
    other = prewarmed.run_module("tests.prewarmed_probe", ["normal"],
                                 {**env, "OMP_NUM_THREADS": "7"}, timeout=120)
    assert other.returncode == 0
    assert prewarmed.server_for({**env, "OMP_NUM_THREADS": "7"}) is not first
    assert prewarmed.server_for(env) is first


def test_the_server_forks_from_its_only_thread():
    """Not one native library's thread beside the one that forks (the module's docstring
    names the imports that start them)."""
    server = prewarmed.server_for({**os.environ, "PROBE": "value"})
    assert psutil.Process(server.process.pid).num_threads() == 1


def agent_report(stderr: str) -> list[str]:
    """The exit codes torchrun's agent reports, its root cause first."""
    root_cause = stderr.split("Root Cause", 1)[-1]
    return re.findall(r"exitcode\s*: (-?\d+)", root_cause)[:1]


@pytest.mark.parametrize("ending", ["normal", "exit-3", "sigterm"])
def test_forked_torchrun_ranks_show_the_agent_what_fresh_ranks_show(ending):
    env = {**os.environ, "PROBE": "value", "OMP_NUM_THREADS": "1"}
    launch = ["--standalone", "--nproc_per_node", "2", "-m", "tests.prewarmed_probe", ending]
    expected = subprocess.run([sys.executable, "-m", "torch.distributed.run", *launch],
                              cwd=prewarmed.REPO, env=env, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
    got = prewarmed.run_torchrun("tests.prewarmed_probe", [ending], 2, env, timeout=120)
    assert got.returncode == expected.returncode, (got, expected)
    assert agent_report(got.stderr) == agent_report(expected.stderr)
    if ending == "normal":  # the others race the agent's SIGTERM to the second rank
        assert sorted(got.stdout.splitlines()) == sorted(expected.stdout.splitlines())
        assert "rank=1 unbuffered=True" in got.stdout


@pytest.mark.parametrize("ending", ["normal", "exit-3", "raise", "sigterm"])
def test_a_scripts_stage_run_by_the_stand_in_shows_what_a_fresh_one_shows(ending, tmp_path):
    """A launch script's stage, ``"$PYTHON" -m <module>``, with ``PYTHON`` the stand-in
    (``tests/launch/test_demo.py``) or the real interpreter, in a folder of its own: the
    module is found there, first on ``sys.path``, as ``python -m`` finds it."""
    shutil.copy(prewarmed.REPO / "tests" / "prewarmed_probe.py", tmp_path / "stage_probe.py")
    script = tmp_path / "stage.sh"
    script.write_text(f'cd {tmp_path}\n"$PYTHON" -m stage_probe {ending} second\n')
    env = {**os.environ, "PROBE": "value"}

    def stage(python: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script)], env={**env, "PYTHON": python},
                              capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)

    expected = stage(sys.executable)
    got = stage(str(prewarmed.server_for(env).python))
    assert got.returncode == expected.returncode, (got, expected)
    assert got.stdout == expected.stdout
    assert without_server_frames(got.stderr) == without_server_frames(expected.stderr)
    assert f"cwd={tmp_path} path0={tmp_path} probe=value" in got.stdout or ending == "sigterm"


def forked_runs(server: prewarmed.Server) -> list[psutil.Process]:
    """The runs the server has forked and not yet reaped (its grandchildren)."""
    runs = []
    for middle in psutil.Process(server.process.pid).children():
        with contextlib.suppress(psutil.NoSuchProcess):  # it exits once it has reported
            runs.extend(middle.children())
    return runs


def started_run(server: prewarmed.Server, known: set[int]) -> psutil.Process:
    """The run the server forked that is not in ``known``."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        runs = [run for run in forked_runs(server) if run.pid not in known]
        if runs:
            return runs[0]
        time.sleep(0.05)
    raise AssertionError("the server started no run")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_rank_goes_with_its_stand_in_whichever_signal_ends_it(signum):
    env = {**os.environ, "PROBE": "value"}
    server = prewarmed.server_for(env)
    known = {run.pid for run in forked_runs(server)}
    stand_in = subprocess.Popen([server.python, "-u", "-m", "tests.prewarmed_probe", "sleep"],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        run = started_run(server, known)
        stand_in.send_signal(signum)
        assert stand_in.wait(timeout=60) == -signum
        run.wait(timeout=60)
    finally:  # a failure leaves no run behind for the next test to find
        stand_in.kill()
        stand_in.wait()
