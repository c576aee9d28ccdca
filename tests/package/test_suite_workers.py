"""The test command's workers: ``pytest -n auto`` starts one per core, at most ``conftest.MAX_WORKERS``."""

from __future__ import annotations

import os

import conftest
import pytest


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (2, 2), (8, 8), (64, 8)])
def test_n_auto_starts_one_worker_per_usable_core_and_at_most_eight(
    monkeypatch: pytest.MonkeyPatch, pytestconfig: pytest.Config, cores: int, workers: int
) -> None:
    # The cores this process may run on (a CI container's CPU set), not the machine's count.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 1000)
    assert conftest.pytest_xdist_auto_num_workers(pytestconfig) == workers
