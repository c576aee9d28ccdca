"""Conformance with litgpt, the main user of Lightning Fabric: its pretraining loop, under our plugin and Fabric's.

A tiny ``litgpt.GPT`` (2 layers, 64 wide, 108k parameters) is trained on random tokens by the loop of
``litgpt/pretrain.py::fit``, written out with litgpt's own pieces (``get_lr``: linear warm-up then cosine;
``chunked_cross_entropy``; its ``ThroughputMonitor`` with the FLOPs ``measure_flops`` counts on a meta-device copy):
``fabric.setup(model)``, ``fabric.setup_optimizers(AdamW)``, per micro-batch ``fabric.no_backward_sync(model,
enabled=is_accumulating)`` and ``fabric.backward(loss / accumulate)``, then ``fabric.clip_gradients(model, optimizer,
max_norm=...)``, ``optimizer.step()``, ``optimizer.zero_grad()``, and the monitor's ``update`` and ``compute``.

Where no overflow happens, our plugin's parameters equal those of Fabric's built-in ``MixedPrecision`` at the same
precision bit for bit (fp16 with a ``GradScaler`` set like our scaler). With an overflow injected and litgpt's
``clip_gradients`` call as it is (``error_if_nonfinite=True``), both plugins raise there, as Fabric's contract says;
with ``error_if_nonfinite=False`` ours skips and counts the step, as GradScaler skips it, where Fabric's bf16-mixed
lets the NaN through.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from fabric_loops import GROWTH_INTERVAL, START_SCALE, UnscalesBeforeFusedSteps, fabrics, ours
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities import throughput
from torch import Tensor, nn

litgpt = pytest.importorskip("litgpt")
from litgpt.pretrain import get_lr  # noqa: E402
from litgpt.utils import chunked_cross_entropy  # noqa: E402

pytestmark = pytest.mark.filterwarnings(r"ignore:.*MixedPrecisionPlugin\('16-mixed'\) on CPU:UserWarning")

CONFIG = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32, "vocab_size": 64, "padded_vocab_size": 64}
ACCUMULATE, MICRO_BATCH, STEPS = 2, 2, 4
LR, MIN_LR, WARMUP = 4e-3, 4e-4, 2
# litgpt's default is 1.0, which this fresh tiny model's gradients (norm ~0.85) never reach: 0.5 makes every step clip.
MAX_NORM = 0.5


def tokens(iteration: int) -> Tensor:
    generator = torch.Generator().manual_seed(500 + iteration)
    return torch.randint(0, CONFIG["vocab_size"], (MICRO_BATCH, CONFIG["block_size"] + 1), generator=generator)


def pretrain(
    plugin: Precision,
    *,
    fault_at: int | None = None,
    fault: float = math.inf,
    fused: bool = False,
    steps: int = STEPS,
    prepare: Callable[[nn.Module], Any] | None = None,
    monitored: dict[str, Any] | None = None,
    **clip: Any,
) -> tuple[list[float], list[list[Tensor]]]:
    """litgpt's ``fit`` loop for ``STEPS`` optimizer steps; returns what ``clip_gradients`` returned at each step
    and the parameters after each step. ``prepare`` is applied to the model before ``fabric.setup``; ``monitored``
    receives the compute dtype the ``ThroughputMonitor`` read (``"dtype"``) and the names of its metrics."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    gpt = litgpt.GPT(litgpt.Config(**CONFIG))
    if prepare is not None:
        prepare(gpt)
    model = fabric.setup(gpt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, betas=(0.9, 0.95), fused=fused)
    optimizer = fabric.setup_optimizers(optimizer)
    with mock.patch.object(throughput, "get_available_flops", wraps=throughput.get_available_flops) as flops_of:
        monitor = throughput.ThroughputMonitor(fabric, window_size=2)
    with torch.device("meta"):
        meta_model = litgpt.GPT(gpt.config)
        x = torch.randint(0, 1, (MICRO_BATCH, meta_model.max_seq_length))
        measured_flops = throughput.measure_flops(
            meta_model, lambda: meta_model(x), lambda y: chunked_cross_entropy(y, x, chunk_size=0)
        )
    start = time.perf_counter()
    after: list[list[Tensor]] = []
    norms: list[float] = []
    iteration = step = 0
    while step < steps:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(LR, iteration, WARMUP, steps * ACCUMULATE, MIN_LR)
        train_data = tokens(iteration)
        iteration += 1
        input_ids = train_data[:, 0 : model.max_seq_length].contiguous().long()
        targets = train_data[:, 1 : model.max_seq_length + 1].contiguous().long()
        is_accumulating = iteration % ACCUMULATE != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits, targets)
            if step == fault_at and not is_accumulating:
                loss = loss * fault
            fabric.backward(loss / ACCUMULATE)
        if not is_accumulating:
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM, **clip)))  # type: ignore[arg-type]
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            after.append([p.detach().clone() for p in model.parameters()])
        monitor.update(
            time=time.perf_counter() - start,
            flops=measured_flops,
            batches=iteration,
            samples=iteration * MICRO_BATCH,
            lengths=iteration * MICRO_BATCH * model.max_seq_length,
        )
        metrics = monitor.compute()
    if monitored is not None:
        monitored.update(dtype=flops_of.call_args.args[1], metrics=sorted(metrics))
    return norms, after


def fabric_dtype(precision: str) -> torch.dtype:
    return torch.float16 if precision == "16-mixed" else torch.bfloat16


def assert_same(mine: list[list[Tensor]], theirs: list[list[Tensor]], what: str) -> None:
    for step, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        for index, (p, q) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(p, q), f"{what}: step {step}, parameter {index} differs"


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_litgpts_pretraining_loop_equals_fabrics_builtin_bit_for_bit(precision: str) -> None:
    plugin = ours(precision)
    plugin.engine.read_norms()  # as a monitor would: the step results carry the norm
    monitored: dict[str, Any] = {}
    their_monitored: dict[str, Any] = {}
    norms, mine = pretrain(plugin, monitored=monitored)
    their_norms, theirs = pretrain(fabrics(precision), monitored=their_monitored)
    assert_same(mine, theirs, precision)
    # litgpt's MFU is counted against the peak of the same dtype (it was FP32's: tests/plugins/test_throughput.py)
    assert monitored == their_monitored and monitored["dtype"] == fabric_dtype(precision)
    assert "device/flops_per_sec" in monitored["metrics"]
    assert norms == their_norms and all(norm > MAX_NORM for norm in norms)  # every step clipped
    assert plugin.skipped_steps == 0 and plugin.recent_steps[-1].grad_norm == norms[-1]
    assert not torch.equal(mine[0][0], mine[-1][0])  # premise: it trained
    if precision == "16-mixed":
        assert plugin.scaler is not None and plugin.scaler.get_scale() == START_SCALE * 2 ** (STEPS // GROWTH_INTERVAL)


def test_litgpt_fp16_overflow_is_skipped_as_gradscaler_skips_it_and_otherwise_equals_fabrics_builtin() -> None:
    for plugin in (fabrics(), ours()):  # litgpt's clip_gradients call, with Fabric's defaults: Fabric's contract
        with pytest.raises(RuntimeError, match="non-finite"):
            pretrain(plugin, fault_at=1)
    plugin = ours()
    _, mine = pretrain(plugin, fault_at=1, error_if_nonfinite=False)
    _, theirs = pretrain(fabrics(), fault_at=1, error_if_nonfinite=False)
    assert_same(mine, theirs, "fp16 with an overflow at step 1")
    assert plugin.skipped_steps == 1 and plugin.scaler is not None
    assert plugin.scaler.get_scale() == START_SCALE / 2  # backed off once; 2 clean steps since, short of growing
    assert all(torch.equal(p, q) for p, q in zip(mine[0], mine[1], strict=True))  # the skipped step changed nothing


def test_litgpt_bf16_nan_is_skipped_where_fabrics_builtin_raises_or_poisons_every_weight() -> None:
    # Premises: Fabric's bf16-mixed checks nothing; litgpt's clip_gradients call raises on the NaN, and without that
    # check (error_if_nonfinite=False, or no clipping) the NaN reaches every weight.
    with pytest.raises(RuntimeError, match="non-finite"):
        pretrain(fabrics("bf16-mixed"), fault_at=1, fault=math.nan)
    _, theirs = pretrain(fabrics("bf16-mixed"), fault_at=1, fault=math.nan, error_if_nonfinite=False)
    assert all(torch.isnan(p).all() for p in theirs[-1])
    plugin = ours("bf16-mixed")
    _, mine = pretrain(plugin, fault_at=1, fault=math.nan, error_if_nonfinite=False)
    assert plugin.skipped_steps == 1 and all(torch.isfinite(p).all() for p in mine[-1])
    assert all(torch.equal(p, q) for p, q in zip(mine[0], mine[1], strict=True))
    assert not any(torch.equal(p, q) for p, q in zip(mine[1], mine[2], strict=True))  # and it trains on


def test_litgpt_with_fused_adamw_and_clipping_skips_the_overflow_as_gradscaler_would() -> None:
    # litgpt's 16-mixed path on CUDA (fused AdamW + clipping), which Fabric's built-in refuses; on CPU here. The
    # reference is Fabric's built-in with that refusal lifted: GradScaler unscales, then steps the fused optimizer.
    with pytest.raises(NotImplementedError):
        pretrain(fabrics(), fused=True)
    plugin = ours()
    _, mine = pretrain(plugin, fault_at=2, fused=True, error_if_nonfinite=False)
    lifted = UnscalesBeforeFusedSteps("16-mixed", "cpu", scaler=fabrics().scaler)
    _, theirs = pretrain(lifted, fault_at=2, fused=True, error_if_nonfinite=False)
    assert_same(mine, theirs, "fused AdamW, clipping, an overflow at step 2")
    assert plugin.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(mine[1], mine[2], strict=True))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_litgpt_a_finite_spike_is_skipped_by_the_guard_where_fabrics_builtin_takes_it(precision: str) -> None:
    from lightning_amp_plus import SpikeGuard

    # A last micro-batch's loss x20: a norm 13x the usual (x1000 would overflow the scaled fp16 gradients instead).
    spike, steps, fault = 8, 10, 20.0
    guarded_plugin = ours(precision, spike_guard=SpikeGuard(warmup=4))
    _, with_guard = pretrain(guarded_plugin, fault_at=spike, fault=fault, steps=steps)
    _, unguarded = pretrain(ours(precision), fault_at=spike, fault=fault, steps=steps)
    verdicts = [result.spike_verdict for result in guarded_plugin.recent_steps]
    assert [i for i, v in enumerate(verdicts) if v is not None and v.spike] == [spike]
    assert guarded_plugin.skipped_steps == 1
    assert_same(with_guard[:spike], unguarded[:spike], "the steps before the spike")
    assert_same([with_guard[spike]], [with_guard[spike - 1]], "the skipped spike's step")  # nothing applied
    # Unguarded, the spike is taken (and clipped by litgpt's max_norm, which only scales its direction down).
    assert not all(torch.equal(a, b) for a, b in zip(unguarded[spike], unguarded[spike - 1], strict=True))
