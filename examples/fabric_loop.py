"""Pretrain a tiny GPT with Lightning Fabric and lightning-amp-plus, the way litgpt's ``pretrain.py`` loop does.

The loop is litgpt's (``litgpt/pretrain.py::fit``): the learning rate set by hand each iteration (linear warm-up, then
cosine), gradient accumulation under ``fabric.no_backward_sync``, ``fabric.backward(loss / accumulate)``,
``fabric.clip_gradients(max_norm=1.0)``, ``optimizer.step()``, ``optimizer.zero_grad()``, a checkpoint with
``fabric.save``. What lightning-amp-plus adds is one plugin and one monitor:

* ``MixedPrecisionPlugin`` in ``L.Fabric(plugins=[...])``: a step whose gradients hold inf/NaN is skipped and counted
  (fp16 overflows and bf16 NaNs alike). ``fabric.clip_gradients`` keeps Fabric's contract: with its default
  ``error_if_nonfinite=True`` it raises on such a step, so the loop passes ``error_if_nonfinite=False`` and lets the
  plugin skip it;
* ``MixedPrecisionMonitor.observe`` after each optimizer step returns the ``amp/...`` metrics for
  ``fabric.log_dict``; its summary and chart at the end.

The data are random walks on a fixed Markov chain over 64 tokens (each token is followed by one of 4, uniformly): the
best possible loss is ln 4 = 1.386. A NaN is injected into the loss at ``--fault-at`` to show a skipped step. To
train litgpt's own model instead, replace ``TinyGPT(...)`` by ``litgpt.GPT(litgpt.Config(n_layer=2, n_embd=64,
n_head=2, block_size=32, vocab_size=64, padded_vocab_size=64))``: the loop is the same.

Run:
    python examples/fabric_loop.py                         # bf16-mixed on CPU, ~10 s
    python examples/fabric_loop.py --precision 16-mixed    # fp16 with loss scaling (slow on CPU; for GPUs)
    python examples/fabric_loop.py --resume runs/fabric/checkpoint.ckpt   # continue from the halfway checkpoint

Nothing is replaced: a second run's checkpoint goes to ``checkpoint-1.ckpt`` (and so on) and its chart to
``amp-1.png``, as the script says; the logs go to a new ``runs/fabric/logs/version_N``.
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.loggers import CSVLogger
from torch import Tensor, nn

from lightning_amp_plus import MixedPrecisionMonitor
from lightning_amp_plus.cli import without_lightning_noise
from lightning_amp_plus.fabric import MixedPrecisionPlugin

VOCAB, BLOCK, FOLLOWERS = 64, 32, 4


class TinyGPT(nn.Module):
    """Token and position embeddings, causal pre-norm transformer blocks, a linear head."""

    def __init__(self, n_layer: int = 2, n_embd: int = 64, n_head: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, n_embd)
        self.positions = nn.Embedding(BLOCK, n_embd)
        block = nn.TransformerEncoderLayer(n_embd, n_head, 4 * n_embd, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(n_embd, VOCAB)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(BLOCK), persistent=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.blocks(x, mask=self.causal, is_causal=True))


def markov_batch(iteration: int, batch_size: int) -> Tensor:
    """``batch_size`` walks of ``BLOCK + 1`` tokens; the same for a given iteration (a resumed run sees the same)."""
    followers = torch.randint(0, VOCAB, (VOCAB, FOLLOWERS), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1000 + iteration)
    walk = [torch.randint(0, VOCAB, (batch_size,), generator=generator)]
    for _ in range(BLOCK):
        choice = torch.randint(0, FOLLOWERS, (batch_size,), generator=generator)
        walk.append(followers[walk[-1], choice])
    return torch.stack(walk, dim=1)


def free_name(path: Path) -> Path:
    """``path``, or the first of ``checkpoint-1.ckpt``, ``checkpoint-2.ckpt``... no file has: none is replaced."""
    candidates = itertools.chain([path], (path.with_name(f"{path.stem}-{n}{path.suffix}") for n in itertools.count(1)))
    return next(candidate for candidate in candidates if not candidate.exists())


def get_lr(learning_rate: float, it: int, warmup_iters: int, max_iters: int, min_lr: float) -> float:
    """litgpt's schedule: linear warm-up, then cosine decay to ``min_lr``."""
    if it < warmup_iters:
        return learning_rate * it / warmup_iters
    decay_ratio = min(1.0, (it - warmup_iters) / max(1, max_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "16-mixed"])
    parser.add_argument("--device", default="cpu", help="Fabric's accelerator: cpu, cuda, ...")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fault-at", type=int, default=60, help="optimizer step whose loss is made NaN (-1: none)")
    parser.add_argument("--out", type=Path, default=Path("runs/fabric"), help="logs, checkpoint and chart")
    parser.add_argument("--resume", type=Path, default=None, help="a checkpoint this script saved")
    args = parser.parse_args(argv)
    with without_lightning_noise():  # Lightning's warnings about itself, silenced in this script only
        return pretrain(args)


def pretrain(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cpu":
        torch.set_num_threads(1)  # a model this small gains nothing from more threads; on a busy CPU they stall
    plugin = MixedPrecisionPlugin(args.precision)
    fabric = L.Fabric(accelerator=args.device, devices=1, plugins=[plugin], loggers=CSVLogger(args.out, name="logs"))
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module():
        model = TinyGPT()
    model = fabric.setup(model)
    fused = fabric.device.type == "cuda"  # as litgpt: fused AdamW on CUDA, which clips fine with this plugin
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95), fused=fused)
    optimizer = fabric.setup_optimizers(optimizer)
    # The plugin goes into the checkpoint with the model: its loss scale and skip counters resume with them.
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "amp": plugin, "iter_num": 0, "step_count": 0}
    if args.resume is not None:
        fabric.load(args.resume, state)
        fabric.print(f"resumed after {state['step_count']} steps, {plugin.skipped_steps} of them skipped")

    monitor = MixedPrecisionMonitor(check_interval=10)
    max_iters, warmup_iters = args.steps * args.accumulate, 10 * args.accumulate
    loss_value = math.nan
    while state["step_count"] < args.steps:
        lr = get_lr(args.lr, state["iter_num"], warmup_iters, max_iters, args.lr / 10)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        train_data = markov_batch(state["iter_num"], args.micro_batch).to(fabric.device)
        state["iter_num"] += 1
        input_ids, targets = train_data[:, :BLOCK], train_data[:, 1:]
        is_accumulating = state["iter_num"] % args.accumulate != 0
        step = state["step_count"]  # the index of the optimizer step this micro-batch belongs to, from 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            if step == args.fault_at and not is_accumulating:
                loss = loss * math.nan  # a fault, for the demonstration: this step must be skipped
            fabric.backward(loss / args.accumulate)
        if is_accumulating:
            continue
        # error_if_nonfinite=False: a step with inf/NaN gradients is the plugin's to skip (Fabric's default raises).
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
        state["step_count"] += 1
        loss_value = float(loss.detach())
        metrics = monitor.observe(plugin, model=model, step=step)  # this step's amp/... metrics
        fabric.log_dict({"loss": loss_value, "lr": lr, **metrics}, step=step)
        last = plugin.recent_steps[-1]  # this optimizer step: skipped or not, its scale, norm, overflowing tensors
        if last.skipped:
            names = last.overflow_params
            more = f" and {len(names) - 2} more" if len(names) > 2 else ""
            fabric.print(f"step {step}: skipped, non-finite gradients in {len(names)} tensors: {names[:2]}{more}")
        elif (step + 1) % 50 == 0:
            fabric.print(f"step {step}: loss {loss_value:.3f}, gradient norm {last.grad_norm:.3f}")
        if state["step_count"] == args.steps // 2 and args.resume is None:
            saved = free_name(args.out / "checkpoint.ckpt")  # a second run keeps the first one's checkpoint
            fabric.save(saved, state)
            fabric.print(f"step {step}: checkpoint saved to {saved}")

    fabric.logger.finalize("success")
    fabric.print(monitor.summary())
    chart = monitor.write_chart(args.out / "amp.png")
    fabric.print(f"chart: {chart}; floor of this data: ln {FOLLOWERS} = {math.log(FOLLOWERS):.3f}")
    return {
        "loss": loss_value,
        "skipped_steps": plugin.skipped_steps,
        "steps": state["step_count"],
        "parameters": [p.detach().clone() for p in model.parameters()],
        "chart": chart,
    }


if __name__ == "__main__":
    main()
