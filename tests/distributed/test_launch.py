"""The launch machinery of the multi-process tests (:mod:`launch`): a failure or a hang ends the pool, with the cause.

Marked ``slow``: each test starts a pool of 2 processes (these import only torch: a few seconds) and waits for a
timeout on purpose.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch import run_pool, scenario

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COLLECTIVE_TIMEOUT = timedelta(seconds=5)


def ranks_and_world(out: Path) -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def rank_one_fails(out: Path) -> str:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    # Rank 0 waits in a collective for a rank that has stopped: the collective timeout (or the closed connection)
    # ends the wait with an error instead of a hang.
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def rank_one_hangs(out: Path) -> str:
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def rank_one_aborts(out: Path) -> str:
    if dist.get_rank() == 1:
        os.abort()  # as a native crash would: SIGABRT, no traceback, no record
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def never_runs(out: Path) -> str:
    return "ran"


def test_every_rank_runs_the_scenarios_in_order_and_a_failure_on_one_rank_ends_both_with_its_traceback(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    ranks = run_pool(
        {"who": ranks_and_world, "fail": rank_one_fails, "after": never_runs},
        tmp_path,
        collective_timeout=COLLECTIVE_TIMEOUT,
    )
    assert scenario(ranks, "who") == ((0, 2), (1, 2))
    assert "scenario 'fail' failed on rank 1" in ranks[1]["error"] and "rank 1 fails on purpose" in ranks[1]["error"]
    assert "scenario 'fail' failed on rank 0" in ranks[0]["error"]  # its collective raised
    assert all("after" not in record for record in ranks)  # nothing runs after a failure
    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        scenario(list(reversed(ranks)), "fail")
    # Bounded by the start of two processes plus the collective timeout, not by the pool's 600 s.
    assert time.monotonic() - started < 120


def test_a_rank_that_hangs_outside_any_collective_is_killed_at_the_pool_timeout(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="did not finish within 30 s"):
        run_pool({"hang": rank_one_hangs}, tmp_path, timeout_s=30, collective_timeout=COLLECTIVE_TIMEOUT)


def test_a_worker_killed_by_a_signal_fails_the_pool_naming_the_signal(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"a worker process died: process 1 terminated with signal SIGABRT"):
        run_pool({"abort": rank_one_aborts}, tmp_path, collective_timeout=COLLECTIVE_TIMEOUT)
