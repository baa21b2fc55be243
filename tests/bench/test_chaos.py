"""The chaos soak's measurements (``bench/chaos.py``) from a training log: each kill's
recovery to the first step at the new world and the steps trained again, a resume that
follows two kills counted once."""

from __future__ import annotations

from datetime import datetime

from bench.chaos import Kill, log_events, measure_kills

LOG = """\
2026-12-02 10:00:00,000 rank0 pretrain INFO: 3 ranks on cpu, fp32; backend gloo
2026-12-02 10:00:01,000 rank0 pretrain.loop.trainer INFO: step 1 loss=5 samples=48
2026-12-02 10:00:02,000 rank0 pretrain.loop.trainer INFO: step 2 loss=4.5 samples=96
2026-12-02 10:00:20,000 rank0 pretrain INFO: 2 ranks on cpu, fp32; backend gloo
2026-12-02 10:00:21,000 rank0 pretrain.loop.trainer INFO: resumed from /r/step_00000001 at step 1
2026-12-02 10:00:22,500 rank0 pretrain.loop.trainer INFO: step 2 loss=4.4 samples=96
2026-12-02 10:00:23,000 rank0 pretrain.loop.trainer INFO: step 3 loss=4 samples=144
"""


def at(clock: str) -> float:
    return datetime.strptime(f"2026-12-02 {clock}", "%Y-%m-%d %H:%M:%S").timestamp()


def test_recovery_and_steps_redone_are_read_from_the_log(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(LOG)
    events = log_events(log)
    assert [(kind, number) for _, kind, number, _ in events] == [
        ("world", 3), ("step", 1), ("step", 2), ("world", 2), ("resumed", 1), ("step", 2),
        ("step", 3)]
    assert events[2][3] == {"loss": 4.5, "samples": 96.0}
    kills = [Kill(at("10:00:05"), "agent", 2, last_step=2),
             Kill(at("10:00:10"), "worker", 0, last_step=2)]  # the same recovery
    measure_kills(kills, events)
    assert kills[0].recovery_s == 17.5 and kills[0].redone == 1 and kills[0].world_after == 2
    assert kills[1].recovery_s == 12.5 and kills[1].redone == 0
