"""DynamicLossScaler in a plain PyTorch loop, with gradient clipping and an injected overflow.

Run: python examples/plain_loop.py [--steps 200] [--device cpu|cuda]

The loop reads top to bottom as every AMP recipe does: scale, backward, unscale, clip, step, update. At step 50 the
loss is made infinite on purpose: the step is skipped, the scale backs off, and the parameters stay finite.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from lightning_amp_plus import DynamicLossScaler


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(growth_interval=50)
    scaler.engine.name_parameters(model)  # names for the diagnostics
    x = torch.randn(256, 16, device=args.device)
    y = x[:, :4].sum(1, keepdim=True)
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if step == 50:
            loss = loss * float("inf")  # an overflow, on purpose
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grad_norm = scaler.clip_grad_norm_(opt, max_norm=1.0)  # measured here, torch's norm bit for bit
        scaler.step(opt)
        scaler.update()
        result = scaler.result(opt)  # what this step did
        if result is not None and result.skipped:
            print(f"step {step}: skipped, non-finite gradients in {result.overflow_params}")
        elif step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f}, grad norm {grad_norm:.3f}, scale {scaler.get_scale():g}")
    final = nn.functional.mse_loss(model(x).float(), y).item()
    print(f"final loss {final:.4f}, skipped steps {scaler.skipped_steps}, scale {scaler.get_scale():g}")
    return {"loss": final, "skipped_steps": scaler.skipped_steps}


if __name__ == "__main__":
    main()
