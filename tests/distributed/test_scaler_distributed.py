"""``DynamicLossScaler.engine.ranks`` on the fused path: two gloo ranks agree on every skip without a host read.

A plain loop on 2 CPU processes. Gradients are averaged across the ranks by hand (as DDP does in backward); then one
rank alone makes its gradient non-finite at one step (a rank-local fault). The overflow flag is reduced on the device
(MAX of the norm, NaN as inf), so both ranks skip that step, keep the same scale and stay bit-identical.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import host_reads
from launch import POOL_TIMEOUT_S, free_port, join_within
from torch import nn

from lightning_amp_plus import DynamicLossScaler
from lightning_amp_plus.step.sharding import Ranks

pytestmark = pytest.mark.integration  # starts processes or runs whole commands

WORLD = 2
STEPS = 8
FAULT_STEP, FAULT_RANK = 3, 1


def train_rank(rank: int, fused: bool) -> dict[str, Any]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2, max_consecutive_skips=None)
    scaler.engine.ranks = Ranks(group=dist.group.WORLD)
    reads: list[str] = []
    outcomes = []
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for step in range(STEPS):
        opt.zero_grad()
        x = torch.randn(4, 6, generator=gen)
        scaler.scale(model(x).pow(2).mean()).backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= WORLD
        if step == FAULT_STEP and rank == FAULT_RANK:
            model[2].weight.grad[0, 0] = float("nan")  # type: ignore[index]
        with host_reads(reads):
            scaler.step(opt)
            scaler.update()
        outcomes.append(scaler.result(opt))
    return {
        "skipped": [outcome.skipped for outcome in outcomes],
        "scale": scaler.get_scale(),
        "params": [p.detach().clone() for p in model.parameters()],
        "reads": reads,
        "overflow_params": next(o for o in reversed(outcomes) if o.skipped).overflow_params,
    }


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = {fused: train_rank(rank, fused) for fused in (True, False)}
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[bool, dict[str, Any]]]:
    out = tmp_path_factory.mktemp("scaler_ddp")
    context = mp.start_processes(worker, args=(free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn")
    join_within(context, POOL_TIMEOUT_S)  # killed past it: a hung rank fails the test instead of hanging it
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused-path", "unscale-path"])
def test_a_fault_on_one_rank_skips_the_step_on_every_rank_and_the_replicas_stay_identical(
    ranks: list[dict[bool, dict[str, Any]]], fused: bool
) -> None:
    first, second = (record[fused] for record in ranks)
    expected = [step == FAULT_STEP for step in range(STEPS)]
    assert first["skipped"] == second["skipped"] == expected
    assert first["scale"] == second["scale"]
    for a, b in zip(first["params"], second["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # bit-identical replicas
    # Each rank names what it saw: the faulty rank its own parameter, the other nothing. On the fused path nothing
    # read the gradients (no monitor, no clip): the names were not looked up, which the results say (None).
    named = ([], ["param_groups[0][2]"]) if not fused else (None, None)
    assert (first["overflow_params"], second["overflow_params"]) == named


def test_the_fused_path_agrees_across_ranks_without_a_host_read(ranks: list[dict[bool, dict[str, Any]]]) -> None:
    # Nothing at all is read in step() and update(), the fused AdamW included: the all-reduce stays on the device.
    assert [record[True]["reads"] for record in ranks] == [[], []]
