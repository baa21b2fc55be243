"""The gloo group the multi-rank tests run on: a rank that fails fails the test within a
bounded time, never leaving the suite waiting on a collective, and the next task runs on a
fresh group."""

from __future__ import annotations

import time

import pytest

from tests import gloo_tasks
from tests.conftest import GlooGroup

GRACE_S = 3  # the suite's groups give 20 s (FAILED_RANK_GRACE_S); the mechanism is the same
BOUND_S = GRACE_S + 10  # the grace, and the stop of the stuck rank


@pytest.fixture(scope="module")
def group() -> GlooGroup:
    group = GlooGroup(world=2, grace_s=GRACE_S)
    yield group
    group.close()


@pytest.mark.parametrize(("task", "said"), [
    (gloo_tasks.rank_one_fails_before_the_all_reduce, "planted failure on rank 1"),
    (gloo_tasks.rank_one_dies_before_the_all_reduce, "the process exited (3)")],
    ids=["raises", "dies"])
def test_a_failed_rank_fails_the_task_in_bounded_time_and_the_group_restarts(group, task,
                                                                             said):
    assert group.run(gloo_tasks.all_reduce_of_ones) == [2.0, 2.0]
    start = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        group.run(task)
    assert time.monotonic() - start < BOUND_S
    assert "rank 1 failed" in str(failed.value) and said in str(failed.value)
    assert "rank 0 failed" in str(failed.value)  # stopped in its all-reduce
    assert group.run(gloo_tasks.all_reduce_of_ones) == [2.0, 2.0]
