"""Views rendered one batch ahead (``data_pipeline/loader/ahead.py``): the same batches in
the same order as rendering each in turn, placeholders passed through unrendered, the next
batch rendered while the caller holds the current one, never more than two in flight, and
the render thread on its rank's device."""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from data_pipeline.loader import ahead
from data_pipeline.loader.ahead import rendered_ahead

CPU = torch.device("cpu")


def stream(n: int, placeholders: set[int] = frozenset()):
    """Batches ``i``: encoded images, or (a placeholder) zero images already made."""
    for i in range(n):
        yield ({"i": i, "placeholder": True, "images": torch.zeros(2)} if i in placeholders
               else {"i": i, "placeholder": False, "encoded": [b""]})


class Renderer:
    def __init__(self) -> None:
        self.lock, self.started, self.handed = threading.Lock(), [], 0
        self.most_ahead = 0

    def __call__(self, batch: dict) -> dict:
        with self.lock:
            self.started.append(batch["i"])
            self.most_ahead = max(self.most_ahead, len(self.started) - self.handed)
        time.sleep(0.01)
        return {**batch, "images": torch.full((2,), float(batch["i"]))}


def test_the_batches_are_those_rendered_in_turn_with_placeholders_untouched():
    render = Renderer()
    got = list(rendered_ahead(stream(7, {2, 5}), render, CPU))
    assert [b["i"] for b in got] == list(range(7))
    assert [int(b["images"][0]) for b in got if not b["placeholder"]] == [0, 1, 3, 4, 6]
    assert all(not b["images"].any() for b in got if b["placeholder"])  # not rendered


def test_the_next_batch_is_rendered_while_the_caller_holds_one_and_no_further():
    """Batch i + 1's render waits until the caller holds batch i: it can only see that if
    it runs beside the caller (rendered in turn, it would wait out its timeout)."""
    holding = [threading.Event() for _ in range(6)]
    beside: list[bool] = []
    render = Renderer()

    def waiting(batch: dict) -> dict:
        if batch["i"] > 0:
            beside.append(holding[batch["i"] - 1].wait(timeout=5))
        return render(batch)

    for batch in rendered_ahead(stream(6), waiting, CPU):
        holding[batch["i"]].set()
        with render.lock:
            assert render.started[-1] <= batch["i"] + 1  # one ahead at most
            render.handed += 1
    assert beside == [True] * 5 and render.most_ahead <= 2


def test_the_render_thread_runs_on_the_ranks_device_on_a_high_priority_stream(monkeypatch):
    """The device logic on the CPU: on a CUDA device the render thread sets its rank's device
    before its first render, and the side stream is made at high priority."""
    seen: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: seen.append((threading.current_thread().name, device)))

    class Stream:
        def __init__(self, device, priority=0):
            seen.append(("stream", priority))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(ahead.SideStream, "hand_over", lambda self, batch: batch)
    device = torch.device("cuda", 3)

    def render(batch: dict) -> dict:
        seen.append((threading.current_thread().name, "render"))
        return batch

    assert [b["i"] for b in ahead.rendered_ahead(stream(2), render, device)] == [0, 1]
    assert seen[0] == ("stream", -1)
    thread = seen[1][0]
    assert thread.startswith("views") and seen[1:] == [(thread, device), (thread, "render"),
                                                       (thread, "render")], seen
