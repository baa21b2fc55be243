"""Commands run as subprocesses with their time and peak resident memory, for the scale
benchmarks (``python -m bench.scale``, ``bench/scale/ingest.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import psutil


class Peaks(NamedTuple):
    """MiB: the peak resident memory of a command and of its largest descendant (VmHWM:
    file pages it mapped count too), and the largest anonymous memory sampled in each
    (RssAnon: what it allocated; a peak between two samples can be missed)."""

    command_mib: float
    worker_mib: float
    command_anon_mib: float
    worker_anon_mib: float


class PeakMemory:
    """Peak resident memory of ``process`` and of its descendants (its workers), sampled
    every ``interval`` seconds from each one's VmHWM (its own high-water mark, so a late
    sample still sees an earlier peak) and RssAnon."""

    def __init__(self, process: subprocess.Popen, interval: float = 0.05) -> None:
        self.root, self.interval = psutil.Process(process.pid), interval
        self.command = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        self.peaks: dict[int, int] = {}
        self.anon: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                pids = [self.root.pid, *(c.pid for c in self.root.children(recursive=True))]
            except psutil.NoSuchProcess:
                return
            for pid in pids:
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    forked = (pid != self.root.pid and Path(f"/proc/{pid}/cmdline").read_bytes()
                              == self.command)
                except OSError:
                    continue
                if forked:  # a child between fork and exec still shows its parent's memory
                    continue
                for line in status.splitlines():
                    for key, peaks in (("VmHWM:", self.peaks), ("RssAnon:", self.anon)):
                        if line.startswith(key):
                            peaks[pid] = max(peaks.get(pid, 0), int(line.split()[1]) << 10)
            self._stop.wait(self.interval)

    def stop(self) -> Peaks:
        self._stop.set()
        self._thread.join()
        command, worker = self._split(self.peaks)
        command_anon, worker_anon = self._split(self.anon)
        return Peaks(command, worker, command_anon, worker_anon)

    def _split(self, peaks: dict[int, int]) -> tuple[float, float]:
        """(the process's, the largest descendant's) of ``peaks``, MiB."""
        children = [v for pid, v in peaks.items() if pid != self.root.pid]
        return peaks.get(self.root.pid, 0) / 2**20, max(children, default=0) / 2**20


def run_command(module: str, overrides: list[str], nproc: int = 1) -> dict[str, float]:
    """Run ``python -m module overrides`` (``nproc`` > 1: under torchrun, whose ranks are
    then the workers): seconds, peak memory (command, largest worker; resident and
    anonymous, :class:`Peaks`), MiB, and what it printed."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable])
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    if nproc > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    start = time.perf_counter()
    process = subprocess.Popen([*launcher, "-m", module, *overrides], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    memory = PeakMemory(process)
    out, err = process.communicate()
    seconds = time.perf_counter() - start
    peaks = memory.stop()
    if process.returncode != 0:
        raise RuntimeError(f"{module} {overrides} failed: {err[-2000:]}")
    return {"seconds": seconds, "command_rss_mib": peaks.command_mib,
            "worker_rss_mib": peaks.worker_mib, "command_anon_mib": peaks.command_anon_mib,
            "worker_anon_mib": peaks.worker_anon_mib, "printed": out.strip()}
