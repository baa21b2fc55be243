"""The chaos soak's measurements (``bench/soak/chaos_measure.py``) from a training log: each kill's
recovery to the first step at the new world and the steps trained again, a resume that
follows two kills counted once."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from bench.soak import chaos
from bench.soak.chaos_measure import Kill, healed, log_events, measure_kills

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


PAUSES_LOG = """\
2026-12-02 10:00:00,000 rank0 pretrain INFO: 3 ranks on cpu, fp32; backend gloo
2026-12-02 10:00:01,000 rank0 pretrain.loop.trainer INFO: step 1 loss=5 samples=48
2026-12-02 10:00:10,000 rank0 pretrain.loop.trainer INFO: step 2 loss=5 samples=96
2026-12-02 10:00:30,000 rank0 pretrain INFO: 3 ranks on cpu, fp32; backend gloo
2026-12-02 10:00:31,000 rank0 pretrain.loop.trainer INFO: resumed from /r/step_00000002 at step 2
2026-12-02 10:00:32,000 rank0 pretrain.loop.trainer INFO: step 3 loss=4 samples=144
2026-12-02 10:00:33,000 rank0 pretrain.loop.trainer INFO: step 4 loss=4 samples=192
2026-12-02 10:00:34,000 rank0 pretrain.loop.trainer INFO: step 5 loss=4 samples=240
2026-12-02 10:00:35,000 rank0 pretrain.loop.trainer INFO: step 6 loss=4 samples=288
2026-12-02 10:00:36,000 rank0 pretrain.loop.trainer INFO: step 7 loss=4 samples=336
"""


def test_a_pause_restarts_only_with_a_group_formed_before_the_next_fault(tmp_path):
    """A straggler paused at 10:00:02 is followed by a kill at 10:00:20, whose group forms
    at 10:00:30: the restart is the kill's, not the pause's; an agent tree frozen past the
    timeout restarts the group and heals at its next step."""
    from bench.soak.chaos import Soak

    log = tmp_path / "train.log"
    log.write_text(PAUSES_LOG)
    events = log_events(log)
    pause = Kill(at("10:00:02"), "straggler", 1, last_step=1, pause_s=5.0)
    kill = Kill(at("10:00:20"), "worker", 1, last_step=2)
    measure_kills([pause, kill], events)
    assert pause.restarts == 0 and healed(pause) and pause.recovery_s is None
    assert kill.recovery_s == 12.0 and kill.world_after == 3
    frozen = Kill(at("10:00:11"), "freeze_agent", 1, last_step=2, pause_s=16.0)
    measure_kills([frozen], events)
    assert frozen.restarts == 1 and frozen.recovery_s == 21.0 and healed(frozen)

    soak = Soak.__new__(Soak)  # its schedule's view of the group, without starting one
    soak.frozen, soak.alive = [], lambda: [0, 1, 2]
    soak.kills = [kill]
    assert soak.settled(log, {})  # 3 of 3 agents, 5 steps since the group after the kill
    soak.kills = [Kill(at("10:00:33"), "worker", 1, last_step=4)]
    assert not soak.settled(log, {})  # no group has formed since this fault
    soak.kills = [kill]
    assert not soak.settled(log, {2: 0.0})  # a node away
    soak.alive = lambda: [0, 1]
    assert not soak.settled(log, {})  # an agent that is not in the group


def test_a_soak_without_provenance_is_not_recorded_and_is_named(tmp_path):
    kept = tmp_path / "chaos.json"  # as a soak older than provenance wrote it
    kept.write_text(json.dumps({"seed": 1, "kills": [], "summary": {
        "epochs_asked": 80, "soak_s": 900.0, "uninterrupted_s": 500.0}}))
    with pytest.raises(SystemExit, match="chaos.json: no provenance"):
        chaos.main(["--analyse-only", "--record", "--output", str(kept),
                    "--workdir", str(tmp_path)])
