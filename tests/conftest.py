"""Shared test set-up: the CUDA and slow markers and quiet, deterministic runs."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch


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
