"""``step.sharding`` and ``DynamicLossScaler.sharding`` in one process (the 2-rank runs: test_sharded_plugin)."""

from __future__ import annotations

import math

import torch
from torch import nn
from versions import at_least

from lightning_amp_plus import DynamicLossScaler
from lightning_amp_plus.step.sharding import Ranks, Sharding, holders, local_view


def after_backward(sharding: Sharding | None) -> tuple[nn.Sequential, torch.optim.SGD, DynamicLossScaler]:
    """A small net, its optimizer and a scaler whose engine takes the gradients as ``sharding`` says, after one scaled
    backward (the same seed every time)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    scaler.engine.ranks = None if sharding is None else Ranks(sharding=sharding)
    scaler.scale(net(torch.randn(3, 4)).pow(2).sum()).backward()
    return net, opt, scaler


def stepped(sharding: Sharding | None) -> tuple[float | None, list[torch.Tensor]]:
    """The measured norm and the unscaled gradients of one step, with the gradients taken as ``sharding`` says."""
    net, opt, scaler = after_backward(sharding)
    scaler.engine.read_norms()
    scaler.unscale_(opt)
    grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    scaler.step(opt)
    result = scaler.result(opt)
    assert result is not None
    return result.grad_norm, grads


def test_a_single_shard_held_once_measures_and_unscales_as_unsharded() -> None:
    plain, plain_grads = stepped(None)
    sharded, sharded_grads = stepped(Sharding(replicas=1))
    if at_least("torch", "2.14"):
        assert sharded == plain
    else:  # the unsharded norm is torch's vector_norm (as clip_grad_norm_'s): torch 2.6's rounds this sum 1 ulp higher
        assert plain is not None and sharded is not None and math.isclose(sharded, plain, rel_tol=2**-23)
    torch.testing.assert_close(sharded_grads, plain_grads, rtol=0, atol=0)


def test_a_gradient_held_by_two_ranks_counts_once_in_the_world_sum() -> None:
    # In one process the SUM over ranks is this rank's value: a piece held by 2 ranks contributes half of its square.
    plain, _ = stepped(None)
    halved, _ = stepped(Sharding(replicas=2))
    assert plain is not None and halved is not None
    assert math.isclose(halved, plain / math.sqrt(2), rel_tol=1e-6)


def test_plain_tensors_are_their_own_local_view_and_held_by_the_given_replicas() -> None:
    grad = torch.ones(2)
    assert local_view(grad) is grad and holders(grad) == 1 and holders(grad, replicas=4) == 4


def plain_step(sharding: Sharding | None, poison: bool) -> tuple[bool, list[torch.Tensor]]:
    """A plain ``step()`` (no ``unscale_``: the one-pass check, no norm): whether it skipped, and the parameters."""
    net, opt, scaler = after_backward(sharding)
    if poison:
        net[1].bias.grad[0] = math.nan  # type: ignore[index]
    scaler.step(opt)
    result = scaler.result(opt)
    assert result is not None and result.grad_norm is None
    return result.skipped, [p.detach().clone() for p in net.parameters()]


def test_a_plain_step_with_sharding_checks_each_rank_shard_as_unsharded() -> None:
    for poison in (False, True):
        skipped, params = plain_step(None, poison)
        sharded_skipped, sharded_params = plain_step(Sharding(replicas=1), poison)
        assert sharded_skipped == skipped == poison
        torch.testing.assert_close(sharded_params, params, rtol=0, atol=0)
