"""Views rendered one batch ahead: while the trainer steps on batch n, a thread renders
batch n + 1 (a device backend's decode, crops and colour), on a side CUDA stream when the
device is a GPU. At most two batches are in flight: the one handed out and the one being
rendered. A backend that renders ahead starts its loader workers by forkserver: a worker
forked after the render thread ran torch ops crashed in a test (the thread's parallel
runtime is not reset in the child). The thread's current device is the rank's, and
its stream has high priority. The side stream's work is ordered before the
trainer's use of the batch (``wait_stream``), and its tensors are marked as used on the
trainer's stream (``record_stream``), so the caching allocator does not hand their memory
to the side stream while the step still reads them. The CUDA lines have never run on a
GPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

Batch = dict[str, Any]


class SideStream:
    """Where the renders run: a CUDA stream of ``device`` beside the trainer's, or (on a CPU)
    the thread alone."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # high priority: the trainer's next step waits on it, and it is short
        self.stream = (torch.cuda.Stream(device, priority=-1) if device.type == "cuda"
                       else None)

    def run(self, render: Callable[[Batch], Batch], batch: Batch) -> Batch:
        if self.stream is None:
            return render(batch)
        with torch.cuda.stream(self.stream):
            return render(batch)

    def hand_over(self, batch: Batch) -> Batch:
        """The batch, safe to use on the trainer's (current) stream."""
        if self.stream is None:
            return batch
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        for value in batch.values():
            if isinstance(value, Tensor) and value.is_cuda:
                value.record_stream(current)
        return batch


def rendered_ahead(batches: Iterator[Batch], render: Callable[[Batch], Batch],
                   device: torch.device) -> Iterator[Batch]:
    """``batches`` with ``render`` applied to each that holds encoded images (not a
    placeholder of zero images), the next one rendered while the caller works on the
    current one."""
    side = SideStream(device)
    with ThreadPoolExecutor(1, thread_name_prefix="views", initializer=bind_device,
                            initargs=(device,)) as pool:
        pending: Future | Batch | None = None
        for batch in batches:
            ahead = (batch if "encoded" not in batch  # every sample skipped: zero images
                     else pool.submit(side.run, render, batch))
            if pending is not None:
                yield _ready(pending, side)
            pending = ahead
        if pending is not None:
            yield _ready(pending, side)


def bind_device(device: torch.device) -> None:
    """The render thread's current CUDA device is its rank's (a thread starts on GPU 0,
    where its first CUDA call would open a context)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _ready(pending: Future | Batch, side: SideStream) -> Batch:
    return side.hand_over(pending.result()) if isinstance(pending, Future) else pending
