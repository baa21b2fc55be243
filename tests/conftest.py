"""Session-wide fixtures: a 2-rank gloo process group that runs test functions, and a
small real digits shard set."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from pretrain.model.text_tower import TextTowerConfig, random_text_model
from tests import prewarmed
from tests.app.helpers import run_pretrain, train_overrides
from tests.data_pipeline.helpers import digit_sample, write_set
from tests.leftovers import lingering_threads, mark_session, remove_strays
from tests.ports import free_port
from tests.scratch import over_budget


def share_the_cores() -> None:
    """Under pytest-xdist, intra-op threads for this worker and every process it starts:
    the worker's share of the cores. Workers whose OpenMP regions each take every core spin
    at their barriers for a core another worker holds (docs/architecture.md, "The test
    suite")."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


share_the_cores()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files marked ``long_file`` first, each kept whole and in collected order: the two
    workers take a file at a time (``--dist loadfile``), so the suite ends on short files
    and neither worker waits long for the other at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long_file") is None)


TASK_TIMEOUT_S = 300  # a task with no answer from any rank
FAILED_RANK_GRACE_S = 20  # the other ranks' time to answer once one has failed
DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _serve(rank: int, world: int, port: int, inbox: Any, outbox: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun sets them
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    except Exception:  # the first task's answer: the test fails with it, not at a timeout
        outbox.put((rank, False, traceback.format_exc()))
        return
    while (task := inbox.get()) is not None:
        fn, args = task
        try:
            outbox.put((rank, True, fn(*args)))
        except Exception:  # reported to the test, which fails with the traceback
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class GlooGroup:
    """Worker processes joined in one gloo group; ``run(fn, *args)`` calls ``fn`` on each
    rank (``fn`` must be importable, e.g. a module-level test helper) and returns the
    results in rank order.

    A task that fails on any rank fails the test within ``FAILED_RANK_GRACE_S`` of the
    failure, whatever the other ranks are doing (waiting in a collective for the failed
    rank, say): they are stopped, and the next ``run`` starts a fresh group. A rank that
    dies is a failure; a task with no answer at all fails after ``TASK_TIMEOUT_S``."""

    def __init__(self, world: int = 2, grace_s: float = FAILED_RANK_GRACE_S) -> None:
        self.world, self.grace_s = world, grace_s
        self.procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.procs = [ctx.Process(target=_serve, args=(r, self.world, port, q, self.outbox),
                                  daemon=True) for r, q in enumerate(self.inboxes)]
        for proc in self.procs:
            proc.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        if not self.procs:
            self._start()
        for inbox in self.inboxes:
            inbox.put((fn, args))
        results, failures = self._collect()
        if failures:
            self.close(silent=[r for r in range(self.world) if r not in results])
            raise RuntimeError("\n".join(f"rank {rank} failed:\n{why}"
                                         for rank, why in sorted(failures.items())))
        return [results[r] for r in range(self.world)]

    def _collect(self) -> tuple[dict[int, Any], dict[int, str]]:
        """Every rank's answer, or the failures: a rank's exception, a rank that died, or
        the ranks still silent at the deadline (``grace_s`` after the first failure,
        ``TASK_TIMEOUT_S`` after the start)."""
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + TASK_TIMEOUT_S
        while len(results) + len(failures) < self.world:
            try:
                rank, ok, value = self.outbox.get(timeout=0.5)
                (results if ok else failures)[rank] = value
            except queue.Empty:
                pending = [r for r in range(self.world) if r not in results and r not in failures]
                for rank in pending:
                    if not self.procs[rank].is_alive():
                        failures[rank] = f"the process exited ({self.procs[rank].exitcode})"
                if time.monotonic() > deadline:
                    waited = "a failed rank" if failures else f"{TASK_TIMEOUT_S} s"
                    failures.update({r: f"no answer (stopped after {waited})"
                                     for r in pending if r not in failures})
            if failures:
                deadline = min(deadline, time.monotonic() + self.grace_s)
        return results, failures

    def close(self, silent: Collection[int] = ()) -> None:
        """Stop every rank: those that answered the last task end their loop; ``silent``
        ones (a task failed on them, or they wait in a collective for a rank that failed)
        are killed."""
        for inbox in self.inboxes:
            inbox.put(None)
        for rank, proc in enumerate(self.procs):
            if rank in silent:
                proc.kill()
            proc.join(timeout=5)
            if proc.is_alive():  # waiting in a collective for a rank that failed
                proc.kill()
                proc.join(timeout=5)
        self.procs = []


@contextlib.contextmanager
def restored_environment() -> Iterator[None]:
    """``os.environ`` as it was, after the body: what code under test sets there (MLflow's
    ``set_tracking_uri`` sets ``MLFLOW_TRACKING_URI``, inductor ``TORCHINDUCTOR_CACHE_DIR``)
    reaches neither a later test nor the processes it starts, and the pre-imported
    interpreters of ``tests/prewarmed.py``, one per environment, are not started again."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if os.environ != saved:
            os.environ.clear()
            os.environ.update(saved)


@pytest.fixture(autouse=True, scope="module")
def module_environment() -> Iterator[None]:
    with restored_environment():  # around the module's fixtures
        yield


@pytest.fixture(autouse=True)
def test_environment() -> Iterator[None]:
    with restored_environment():
        yield


@pytest.fixture(scope="session")
def gloo2() -> GlooGroup:
    group = GlooGroup(world=2)
    yield group
    group.close()


@pytest.fixture(scope="module")
def gloo3() -> GlooGroup:
    group = GlooGroup(world=3)
    yield group
    group.close()


@pytest.fixture(scope="module")
def gloo4() -> GlooGroup:
    group = GlooGroup(world=4)
    yield group
    group.close()


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Python's own Ctrl-C handler for the test, whatever launched pytest: a shell's
    background job (``cmd &``, ``nohup``) starts with SIGINT ignored, and then a SIGINT the
    test raises would never become a KeyboardInterrupt."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def digits_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 shards of 120 real digits (24 px JPEGs with labels and captions)."""
    directory = tmp_path_factory.mktemp("digits") / "shards"
    write_set(directory, [[digit_sample(i) for i in range(s * 120, (s + 1) * 120)]
                          for s in range(3)], DIGIT_NAMES)
    return directory


@pytest.fixture(scope="session")
def uninterrupted(digits_shards: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Callable[..., Path]:
    """Uninterrupted reference runs on the digits shards (``train_overrides`` plus
    ``settings``), trained once per settings and process count for every test that
    compares a run with them (they only read it): ``uninterrupted(nproc, **settings)``
    -> its run directory."""
    runs: dict[tuple, Path] = {}

    def run(nproc: int = 1, **settings: object) -> Path:
        key = (nproc, tuple(sorted(settings.items())))
        if key not in runs:
            out = tmp_path_factory.mktemp("uninterrupted")
            result = run_pretrain(train_overrides(digits_shards, out, **settings), nproc=nproc)
            assert result.returncode == 0, result.stderr[-3000:]
            runs[key] = out / "run"
        return runs[key]
    return run


_SESSION = {"mark": mark_session(), "status": 0, "over_budget": False}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test of a file, once its fixtures are gone: the worker's scratch
    within its budget (tests/scratch.py), or an error naming the file, once a worker."""
    result = yield
    if _SESSION["over_budget"] or (nextitem is not None and nextitem.path == item.path):
        return result
    base = item.config._tmp_path_factory.getbasetemp()  # this worker's
    complaint = over_budget(base, item.nodeid.split("::")[0])
    if complaint:
        _SESSION["over_budget"] = True
        raise AssertionError(complaint)
    return result


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _SESSION["status"] = int(exitstatus)
    prewarmed.close()
    for stray in remove_strays(str(_SESSION["mark"])):
        sys.stderr.write(f"\nconftest: a test left a process running; killed {stray}\n")


def pytest_unconfigure(config: pytest.Config) -> None:
    threads = lingering_threads()
    if threads:  # the interpreter would wait for them forever: report them and leave
        sys.stderr.write(f"\nconftest: a test left non-daemon threads {threads}; exiting "
                         f"with the session's status {_SESSION['status']}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_SESSION["status"])


@pytest.fixture(scope="session")
def random_text(tmp_path_factory) -> TextTowerConfig:
    """``model.text`` for a randomly initialised 1-layer BERT: CLIP's and SigLIP's tower
    without the bundled sentence model (tests of the step's mechanics, not of its text)."""
    return TextTowerConfig(model=random_text_model(tmp_path_factory.mktemp("text-model")))

