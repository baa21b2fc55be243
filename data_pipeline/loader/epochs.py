"""Training batches epoch after epoch, from one DataLoader whose workers persist.

A DataLoader made per epoch starts its worker processes again at every epoch boundary and
the trainer waits while they open shards and fill their shuffle buffers. With
``data.persistent_workers`` one DataLoader serves the whole run, and when the last batch
of an epoch arrives the workers are already sent on to the next epoch, so their start-up
overlaps the trainer's last step. The order of batches is the same either way: each
worker counts the epochs it has begun (:meth:`TrainStream.position`), so the batches of
epoch e are those a fresh loader would deliver for e.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.util  # registers its exit handler before ours (atexit runs LIFO)
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import DataLoader

from data_pipeline.config import DataConfig
from data_pipeline.loader.ahead import rendered_ahead
from data_pipeline.loader.backends import backend_spec
from data_pipeline.loader.collate import ChunkJoiner
from data_pipeline.loader.state import LoaderState
from data_pipeline.loader.train import TrainStream
from data_pipeline.shards import ShardSet
from data_pipeline.text import TextConfig

log = logging.getLogger(__name__)


# what schedulers send a job's process group to stop or warn it: the training process
# decides (pretrain/run/preemption.py) and ends its loader workers itself
SCHEDULER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
                     signal.SIGINT)  # Ctrl-C reaches the whole group: the main process answers


def ignore_scheduler_signals(worker_id: int) -> None:
    """A loader worker's start: ignore :data:`SCHEDULER_SIGNALS`. A signal sent to the whole
    process group (torchrun's agent, slurm) would otherwise kill the workers under a
    training process that is still writing its checkpoint; they end with their parent
    (:func:`end_workers_at_exit`)."""
    for sig in SCHEDULER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def end_workers_at_exit(grace_s: float = 2.0) -> None:
    """At interpreter exit, end the daemonic children still running: SIGTERM, then SIGKILL
    for those that ignore it. Torch leaves the workers of a loader still alive at exit
    (persistent workers, an iterator not yet collected) to multiprocessing, which sends
    them SIGTERM and then waits for them; workers that ignore SIGTERM
    (:func:`ignore_scheduler_signals`) would keep the process from ever exiting. Runs
    before multiprocessing's own exit handler (registered after it)."""
    children = [p for p in multiprocessing.active_children() if p.daemon]
    if not children:
        return
    # torch reports a worker ended by a signal as a failure; at exit it is the intent
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join()


atexit.register(end_workers_at_exit)  # after multiprocessing.util's: runs before it


@contextmanager
def ctrl_c_after_arrival() -> Iterator[None]:
    """A Ctrl-C that lands inside the block is raised when the block ends; a second one is
    raised at once. A batch's tensors cross from a loader worker as file descriptors the
    worker hands over on a connection of its own: an interrupt in the middle breaks that
    handshake and the worker prints its side as a traceback. Only where Ctrl-C raises
    (the default handler, main thread); elsewhere the block runs as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pressed = False

    def defer(signum: int, frame: object) -> None:
        nonlocal pressed
        if pressed:
            raise KeyboardInterrupt
        pressed = True

    signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


def arriving_whole(batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """``batches``, each received whole before a Ctrl-C is raised
    (:func:`ctrl_c_after_arrival`)."""
    end = object()
    while True:
        with ctrl_c_after_arrival():
            batch = next(batches, end)
        if batch is end:
            return
        yield batch


def loader_options(cfg: DataConfig) -> dict[str, Any]:
    """Worker count, prefetch depth, pinned host memory (when a GPU will copy it) and the
    workers' signal disposition."""
    options: dict[str, Any] = {"num_workers": cfg.workers,
                               "pin_memory": cfg.pin_memory and torch.cuda.is_available()}
    if cfg.workers > 0:
        options["prefetch_factor"] = cfg.prefetch
        options["worker_init_fn"] = ignore_scheduler_signals
        if backend_spec(cfg.backend).forkserver:  # a fork would copy its threads half-alive
            options["multiprocessing_context"] = "forkserver"
    return options


class TrainLoader:
    """One rank's training batches, an epoch per :meth:`epoch` call, from ``state`` on
    (updated as batches arrive; a checkpoint saves it). A step takes ``global_batch``
    instances over all ranks (0: ``batch_size`` on each), this rank its share."""

    def __init__(self, cfg: DataConfig, rank: int = 0, world: int = 1,
                 state: LoaderState | None = None, text: TextConfig | None = None,
                 device: torch.device | None = None, global_batch: int = 0) -> None:
        backend = backend_spec(cfg.backend)
        backend.check(cfg)
        self.cfg, self.state = cfg, state or LoaderState()
        shards = ShardSet.open(cfg.shards, cfg.verify_checksums, cfg.retry)
        self.stream = TrainStream(cfg, shards, rank, world, self.state, global_batch)
        self.joiner = ChunkJoiner(cfg, text, self.stream.slots, bool(shards.class_names),
                                  pin=bool(loader_options(cfg)["pin_memory"]))
        # data.backend=dali: workers send encoded images, views are made on ``device``
        render = backend_spec(cfg.backend).device_views
        self.device = device or torch.device("cpu")
        self.device_views = render(cfg, self.device) if render is not None else None
        self.persistent = cfg.persistent_workers and cfg.workers > 0
        self.loader: DataLoader | None = None
        self.prepared: Iterator[dict[str, Any]] | None = None  # the next epoch's, started

    def _start(self) -> Iterator[dict[str, Any]]:
        if self.loader is None or not self.persistent:
            # the joiner writes each batch into page-locked memory itself
            self.loader = DataLoader(self.stream, batch_size=None,
                                     persistent_workers=self.persistent,
                                     **{**loader_options(self.cfg), "pin_memory": False})
        return self._joined(arriving_whole(iter(self.loader)))

    def _joined(self, groups: Iterator[list[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
        """Batches from the workers' pieces: every worker makes one piece of every batch,
        K batches' pieces at a time (one message per worker for K batches, as many as when
        each worker made whole batches), and the DataLoader takes them from each worker in
        turn, worker 0 first."""
        workers = max(1, self.cfg.workers)
        while outputs := list(itertools.islice(groups, workers)):
            for pieces in zip(*outputs, strict=True):
                yield self.joiner(list(pieces))

    def epoch(self) -> Iterator[dict[str, Any]]:
        """The batches of the current epoch; the state moves to the next epoch after the
        last one. An epoch left unfinished ends the workers (the next call starts anew
        from the state)."""
        batches = self.prepared if self.prepared is not None else self._start()
        self.prepared = None
        skips: Counter = Counter()
        finished = False
        if self.device_views is not None:  # rendered one batch ahead, beside the step
            batches = rendered_ahead(batches, self.device_views, self.device)
        try:
            for batch in batches:
                self.state.record(batch)
                skips.update(batch["skipped"])
                last = self.state.batches == self.stream.batches_per_epoch
                if last:
                    # the end of this epoch: every worker is done, and DataLoader ends them
                    # now rather than when the iterator is collected (5 s a worker then,
                    # when a reference cycle holds it)
                    next(batches, None)
                    if self.persistent:
                        # workers begin the next epoch now (a persistent loader hands out
                        # the same iterator again, reset: hence the break below)
                        self.prepared = self._start()
                yield batch
                if last:
                    break
            finished = True
        finally:
            if not finished:
                self.close()
        if skips:
            log.warning("data: epoch %d skipped %s (totals so far %s)", self.state.epoch,
                        dict(skips), self.state.skipped)
        self.state.next_epoch()

    @property
    def samples_per_step(self) -> int:
        """Samples of the data set a step takes over all ranks."""
        return self.stream.layout.per_batch

    @property
    def samples_per_epoch(self) -> int:
        """Samples of the data set an epoch delivers: whole global batches."""
        layout = self.stream.layout
        return layout.batches(self.stream.shards.total) * layout.per_batch

    def steps_left(self, epochs: int) -> int:
        """Global batches until ``epochs`` epochs are delivered."""
        if self.state.epoch >= epochs:
            return 0
        full = self.stream.layout.batches(self.stream.shards.total)
        return (self.stream.batches_per_epoch - self.state.batches
                + (epochs - self.state.epoch - 1) * full)

    def close(self) -> None:
        """End the worker processes (they also end with the process)."""
        self.prepared = self.loader = None

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (before the first epoch is started)."""
        restored = LoaderState.from_state_dict(state)
        for item in dataclasses.fields(LoaderState):
            setattr(self.state, item.name, getattr(restored, item.name))
        self.state.enter(list(self.stream.layout))  # as the stream does when made


def train_batches(cfg: DataConfig, rank: int = 0, world: int = 1,
                  state: LoaderState | None = None, text: TextConfig | None = None,
                  device: torch.device | None = None) -> Iterator[dict[str, Any]]:
    """One epoch of training batches from ``state`` on (updating it as batches arrive),
    from a loader of its own.

    ``text``: tokenise each instance's caption with this sentence model (CLIP).
    """
    single = dataclasses.replace(cfg, persistent_workers=False)
    yield from TrainLoader(single, rank, world, state, text, device).epoch()
