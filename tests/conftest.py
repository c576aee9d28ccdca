"""Shared test set-up: the CUDA and slow markers and quiet, deterministic runs."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest
import torch
from launch import free_port


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow", action="store_true", default=False, help="also run the tests marked slow (multi-process pools)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {}
    if not torch.cuda.is_available():
        skips["cuda"] = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    if not config.getoption("--run-slow"):
        skips["slow"] = pytest.mark.skip(reason="slow (starts a pool of processes): run with --run-slow")
    for item in items:
        for keyword, skip in skips.items():
            if item.get_closest_marker(keyword) is not None:
                item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread() -> Iterator[None]:
    # The models here are tiny: a second intra-op thread only adds synchronisation, and while the other core is busy it
    # stalls CPU fp16 matmuls about 10x (measured: 1.2 s vs 12 s for 400 steps). One thread keeps the suite fast.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
    # fp16 on CPU is allowed and says once that it is slow; tests use it on purpose.
    warnings.filterwarnings("ignore", message=r".*fp16 autocast is correct there but slow.*")


@pytest.fixture
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-process gloo group's environment for a test that starts one in this process (DDP or FSDP, devices=1).

    The variables Lightning sets for the process group are set here first, so that monkeypatch removes them again;
    the process group is destroyed afterwards, and ``OMP_NUM_THREADS``, which Lightning's launcher sets in this process
    when the test did not, is taken away again (later tests would otherwise run with it).
    """
    variables = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0", "LOCAL_RANK": "0"}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    threads = os.environ.get("OMP_NUM_THREADS")
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if threads is None:
        os.environ.pop("OMP_NUM_THREADS", None)


# The most workers `pytest -n auto` starts. The suite's tests take about 27 min in all and its longest file about 3 min
# (tests/plugins/test_fp8_plugins.py, 194 s; the sum of `--durations=0` by file, `-n 2` on the 2-core machine), so past
# about 8 workers the longest file decides the time, and each worker only adds its memory (1.4 GB: torch and Lightning,
# `/usr/bin/time -v`).
MAX_WORKERS = 8


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core this process may run on, at most :data:`MAX_WORKERS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, MAX_WORKERS)
