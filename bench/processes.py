"""Commands run as subprocesses with their time and peak resident memory, for the scale
benchmarks (``bench/scale.py``, ``bench/scale_ingest.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil


class PeakMemory:
    """Peak resident memory of ``process`` and of its descendants (its workers), sampled
    every ``interval`` seconds from each one's VmHWM (its own high-water mark, so a late
    sample still sees an earlier peak)."""

    def __init__(self, process: subprocess.Popen, interval: float = 0.05) -> None:
        self.root, self.interval = psutil.Process(process.pid), interval
        self.command = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        self.peaks: dict[int, int] = {}
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
                    if line.startswith("VmHWM"):
                        self.peaks[pid] = max(self.peaks.get(pid, 0), int(line.split()[1]) << 10)
            self._stop.wait(self.interval)

    def stop(self) -> tuple[float, float]:
        """(the process's peak, the largest descendant's peak), MiB."""
        self._stop.set()
        self._thread.join()
        children = [v for pid, v in self.peaks.items() if pid != self.root.pid]
        return self.peaks.get(self.root.pid, 0) / 2**20, max(children, default=0) / 2**20


def run_command(module: str, overrides: list[str], nproc: int = 1) -> dict[str, float]:
    """Run ``python -m module overrides`` (``nproc`` > 1: under torchrun, whose ranks are
    then the workers): seconds and peak memory (command, largest worker), MiB, and what
    it printed."""
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
    command_mib, worker_mib = memory.stop()
    if process.returncode != 0:
        raise RuntimeError(f"{module} {overrides} failed: {err[-2000:]}")
    return {"seconds": seconds, "command_rss_mib": command_mib, "worker_rss_mib": worker_mib,
            "printed": out.strip()}
