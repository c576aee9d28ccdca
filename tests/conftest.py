"""Shared test set-up: the CUDA marker and quiet, deterministic runs."""

from __future__ import annotations

import warnings

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
    # fp16 on CPU is allowed and says once that it is slow; tests use it on purpose.
    warnings.filterwarnings("ignore", message=r".*fp16 autocast is correct there but slow.*")
