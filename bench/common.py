"""Helpers shared by the benchmarks: timing, peak tensor memory, JSON and table output."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep the profiler quiet

import numpy as np  # noqa: E402
import torch  # noqa: E402


def keep_freed_memory() -> bool:
    """Make glibc reuse freed large blocks instead of unmapping them (for every case alike).

    By default each [N, N] float32 tensor above 32 MiB is a fresh mmap whose pages fault in
    on first touch; on these CPUs that costs more than the arithmetic and swamps the
    comparison. A GPU's caching allocator, or ``MALLOC_MMAP_THRESHOLD_``/jemalloc on a CPU
    host, behaves like this setting. Returns whether it took effect.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(
        libc.mallopt(m_trim_threshold, 1 << 31))


def time_interleaved(cases: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median wall time in seconds of each case, timed round-robin after one warm-up call
    each, so that drift in the machine's speed hits every case alike (CUDA synchronised)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in cases.values():
        fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def peak_memory_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes of tensor memory allocated while ``fn`` runs, above what was live before.

    CUDA: the allocator's peak counter. CPU: the profiler's allocation events, replayed in
    time order.
    """
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return _replayed_memory(fn).peak


def held_memory_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Bytes of tensor memory that ``fn`` leaves allocated while its result is held (for a
    forward pass: the activations autograd keeps for the backward)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        del result
        return held
    return _replayed_memory(fn).end


class _Replayed(NamedTuple):
    peak: int
    end: int


def _replayed_memory(fn: Callable[[], Any]) -> _Replayed:
    """CPU tensor memory while ``fn`` runs, from the profiler's allocation events replayed
    in time order (its result held until the replay ends)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        # "[memory]" events are frees outside any op; ops carry their own net allocation
        live += event.cpu_memory_usage if event.name == "[memory]" else \
            event.self_cpu_memory_usage
        peak = max(peak, live)
    del result
    return _Replayed(peak, live)


def rss_bytes() -> int:
    """This process's resident memory now (Linux VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux VmHWM: unlike ru_maxrss, not inherited
    from the parent across fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


class PeakAnonymous:
    """The peak of this process's anonymous resident memory (Linux RssAnon, sampled every
    ``every`` seconds by a thread while the block runs): what the process holds itself,
    without the file-backed pages of memory maps that VmHWM also counts and the kernel
    may drop."""

    def __init__(self, every: float = 0.02) -> None:
        self.every, self.peak = every, 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakAnonymous:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            self._read()

    def _read(self) -> None:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                self.peak = max(self.peak, int(line.split()[1]) * 1024)


def machine() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write_json(path: Path, payload: dict[str, Any], seen: dict[str, Any] | None = None
               ) -> None:
    """A benchmark's result: ``payload`` with its ``provenance`` (the command as typed, the
    commit, whether the tree differed from it, the date and the machine: ``seen``, taken
    when the measurement began, else now), which a record under ``bench/records/`` keeps
    when a page cites it."""
    from bench.records import invocation, provenance

    path.parent.mkdir(parents=True, exist_ok=True)
    seen = seen or provenance(invocation())
    path.write_text(json.dumps({**payload, "provenance": seen}, indent=1, default=_plain))


def _plain(value: Any) -> Any:
    """A NumPy or 0-dim torch value as the plain number or list JSON holds."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return float(value)


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "" if value is None else str(value)
