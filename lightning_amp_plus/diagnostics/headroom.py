"""Per-layer headroom: how near each layer is to overflow in each format, and to underflow at the loss scale.

For each layer: how close its activations come to overflowing each format, and how many of its weight gradients the
half dtype flushes to zero (or makes subnormal) at the current loss scale.

Under autocast the weight gradients are computed by half ops, so the values the half dtype flushes are already zero in
the step's gradients: counting them needs the FP32 values. :func:`measure_headroom` therefore replays the batch in
FP32 (autocast off; on CUDA with TF32 matmuls, whose 8-bit exponent leaves the ranges measured here unchanged) and
reads, per layer, the activations' largest magnitude and what ``(g * scale).to(dtype)`` makes of each FP32 gradient
``g``. One reading costs about two steps (on CPU: an FP32 forward and backward, and a few passes over each gradient):
run it every N steps (N=50 keeps the mean overhead under 5% of a step).

How to read a layer's entry:

* ``headroom_bits[fmt]`` is for the forward: ``log2(format max / act_absmax)``. Below about 1 bit the activations are
  within a factor of 2 of overflowing that format; negative means they overflow it now (keep the layer in FP32).
  The float8 entries are unscaled figures: every FP8 recipe (torchao's, Transformer Engine's) scales each tensor so
  that its largest value lands at float8's top, so nothing overflows there; what FP8 loses is at the bottom, which
  ``"fp8-mixed"``'s own readings measure (:mod:`~lightning_amp_plus.weights.fp8.readings`). The monitor shows
  float16's only.
* ``grad_headroom_bits[fmt]`` is for the backward at the loss scale: ``log2(format max / (grad_absmax * scale))``.
  Negative: this layer's gradients overflow at this scale (the scaler will back off).
* ``grad_flushed_pct`` and ``grad_subnormal_pct``: the share of the layer's non-zero FP32 weight gradients that
  the half dtype at this scale turns into zero (lost updates), or stores as subnormals (a few bits of precision left).
  High percentages with plenty of ``grad_headroom_bits`` say the scale could be higher.

These are the layer's own rounding only: in a real half backward the activation gradients that feed a layer are
rounded too, which flushes a little more.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_amp_plus._checks import check_real, show
from lightning_amp_plus.diagnostics.formats import format_of, headroom_bits
from lightning_amp_plus.diagnostics.names import plain_name
from lightning_amp_plus.diagnostics.replay import (
    AutocastProbe,
    RngState,
    device_type,
    floating_tensors,
    gradients,
    untouched,
)

__all__ = ["LayerHeadroom", "measure_headroom"]


@dataclass(frozen=True)
class LayerHeadroom:
    """One layer's headroom reading (the module docstring says how to read it).

    Attributes:
        act_absmax: the largest ``|output|`` of the layer's forward (FP32; over all its calls).
        grad_absmax: the largest ``|g|`` of its own parameters' FP32 gradients, unscaled.
        grad_flushed_pct: percent of those gradients' non-zero values that ``(g * scale).to(dtype)`` makes zero
            (``nan`` when the layer has no non-zero gradient).
        grad_subnormal_pct: percent of them that land among the half dtype's subnormals.
        headroom_bits: per format name, ``log2(format max / act_absmax)``.
        scale: the loss scale the percentages are for.
        dtype: the half dtype they are for.

    Examples:
        >>> reading = LayerHeadroom(act_absmax=1024.0, grad_absmax=2.0**-10, grad_flushed_pct=0.0,
        ...                         grad_subnormal_pct=0.0, headroom_bits=headroom_bits(1024.0), scale=2.0**16,
        ...                         dtype=torch.float16)
        >>> round(reading.headroom_bits["float16"], 2), round(reading.grad_headroom_bits["float16"], 2)
        (6.0, 10.0)
    """

    act_absmax: float
    grad_absmax: float
    grad_flushed_pct: float
    grad_subnormal_pct: float
    headroom_bits: Mapping[str, float]
    scale: float
    dtype: torch.dtype

    @property
    def grad_headroom_bits(self) -> dict[str, float]:
        """Per format name, ``log2(format max / (grad_absmax * scale))``: the weight gradients' room at this scale."""
        return headroom_bits(self.grad_absmax * self.scale)


def measure_headroom(
    model: nn.Module,
    run: Callable[[], Tensor],
    *,
    scale: float,
    dtype: torch.dtype,
    rng: RngState | None = None,
) -> dict[str, LayerHeadroom]:
    """Replay a batch in FP32 and read each layer's headroom.

    Args:
        model: the model; its layers are its modules with parameters of their own that require grad, by qualified
            name without the parts torch's wrappers add (:func:`~lightning_amp_plus.diagnostics.names.plain_name`;
            only those that ran in the replay).
        run: reruns the batch's forward and returns its scalar loss, without entering autocast (it is called with
            autocast off; a ``run`` that turns it on raises ``ValueError``).
        scale: the loss scale the percentages are for (the scaler's current scale; 1.0 for bf16).
        dtype: the half dtype, ``torch.float16`` or ``torch.bfloat16``.
        rng: the RNG state at the start of the batch, so that dropout draws the masks the step drew; ``None``
            replays from the current state. Either way the RNG streams are put back afterwards.

    Returns:
        ``{layer name: LayerHeadroom}`` in ``named_modules()`` order.

    Raises:
        ValueError: a bad argument, or ``run`` entered autocast.
        TypeError: ``run()`` does not return a scalar loss with a gradient.
        Unreplayable: the loss was computed through a reentrant activation checkpoint
            (:func:`~lightning_amp_plus.diagnostics.replay.gradients`).

    Examples:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> with torch.no_grad():
        ...     net[0].weight.zero_(); net[0].bias.copy_(torch.tensor([1000.0, -1.0]))  # doctest: +ELLIPSIS
        Parameter...
        >>> readings = measure_headroom(net, lambda: net(torch.ones(4, 2)).sum(), scale=1.0, dtype=torch.float16)
        >>> list(readings), readings["0"].act_absmax, round(readings["0"].headroom_bits["float8_e4m3fn"], 3)
        (['0', '2'], 1000.0, -1.158)
    """
    fmt = format_of(dtype, "measure_headroom")
    scale = check_real(
        "measure_headroom", "scale", scale, "a finite number > 0: the current loss scale", lambda s: s > 0
    )
    if rng is not None and not isinstance(rng, RngState):
        raise TypeError(f"`measure_headroom(rng={show(rng)})` must be an RngState (from `RngState.capture()`) or None.")
    layers = {
        name: params
        for name, module in model.named_modules()
        if (params := [p for p in module.parameters(recurse=False) if p.requires_grad])
    }
    modules = dict(model.named_modules())
    device = device_type(model)
    activations: dict[str, list[Tensor]] = {name: [] for name in layers}
    probe = AutocastProbe(device)
    with untouched(model), _fp32_matmuls(device):
        if rng is not None:
            rng.restore()
        handles = [modules[name].register_forward_hook(_recorder(activations[name])) for name in layers]
        probe.attach(model)
        try:
            with torch.enable_grad(), torch.autocast(device, enabled=False):
                loss = run()
        finally:
            probe.detach()
            for handle in handles:
                handle.remove()
        if probe.seen:
            raise ValueError(
                "`measure_headroom(run=...)`: autocast was on inside `run`, so the replay was not FP32. Pass a `run` "
                "that calls the module's forward without autocast (e.g. the LightningModule's training_step, not "
                "Fabric's wrapped module)."
            )
        ran = [name for name in layers if activations[name]]
        params = [p for name in ran for p in layers[name]]
        grads = dict(zip(params, _gradients(loss, params), strict=True))
        rows = [_layer_row(activations[name], [grads[p] for p in layers[name]], scale, fmt.dtype) for name in ran]
        values = torch.stack([row.to(rows[0].device) for row in rows]).tolist() if rows else []
    return {plain_name(name): _reading(row, scale, fmt.dtype) for name, row in zip(ran, values, strict=True)}


def _recorder(into: list[Tensor]) -> Callable[[nn.Module, Any, Any], None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        into.extend(t.detach().abs().amax() for t in floating_tensors(output) if t.numel())

    return hook


def _gradients(loss: Tensor, params: list[Tensor]) -> tuple[Tensor | None, ...]:
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise TypeError(
            f"`run()` returned {type(loss).__name__ if not isinstance(loss, Tensor) else tuple(loss.shape)}: it must "
            "rerun the batch's forward and return its scalar loss tensor (with a gradient)."
        )
    return gradients(loss, params)


def _layer_row(activations: list[Tensor], grads: list[Tensor | None], scale: float, dtype: torch.dtype) -> Tensor:
    """``[act_absmax, grad_absmax, non-zero, flushed, subnormal]`` of one layer, on its device (no host read)."""
    wide = torch.float32 if activations[0].device.type == "mps" else torch.float64
    device = activations[0].device
    act = torch.stack([a.to(device, wide) for a in activations]).amax()
    rows = [_grad_counts(g.detach(), scale, dtype, wide).to(device) for g in grads if g is not None]
    if not rows:
        return torch.cat([act.reshape(1), torch.zeros(4, dtype=wide, device=device)])
    counts = torch.stack(rows)
    return torch.cat([act.reshape(1), counts[:, :1].amax(0), counts[:, 1:].sum(0)])


def _grad_counts(grad: Tensor, scale: float, dtype: torch.dtype, wide: torch.dtype) -> Tensor:
    """``[max |g|, non-zero, flushed, subnormal]`` of one FP32 gradient at ``scale`` in the half ``dtype``.

    ``(g * scale).to(dtype)`` is zero when ``|g| * scale`` is at most half the smallest subnormal, and subnormal below
    the smallest normal minus half the smallest subnormal (at that tie it rounds up to the smallest normal): both
    thresholds are float32 numbers for float16 and bfloat16. Counting against them reads the gradient about five times
    instead of casting it (about twice as fast); ``|g| * scale`` is exact for a power-of-two scale, as the scaler's.
    """
    fmt = format_of(dtype)
    half_tiny = fmt.smallest_subnormal / 2
    magnitude = grad.float().abs()
    largest, nonzero = magnitude.amax(), (magnitude > 0).sum()
    magnitude.mul_(scale)
    kept, normal = (magnitude > half_tiny).sum(), (magnitude >= fmt.smallest_normal - half_tiny).sum()
    return torch.stack([largest.to(wide), nonzero.to(wide), (nonzero - kept).to(wide), (kept - normal).to(wide)])


def _reading(row: list[float], scale: float, dtype: torch.dtype) -> LayerHeadroom:
    act_absmax, grad_absmax, nonzero, flushed, subnormal = row
    share = (lambda count: 100.0 * count / nonzero) if nonzero else (lambda count: math.nan)
    return LayerHeadroom(
        act_absmax=act_absmax,
        grad_absmax=grad_absmax,
        grad_flushed_pct=share(flushed),
        grad_subnormal_pct=share(subnormal),
        headroom_bits=headroom_bits(act_absmax),
        scale=scale,
        dtype=dtype,
    )


@contextlib.contextmanager
def _fp32_matmuls(device: str) -> Iterator[None]:
    """On CUDA, let FP32 matmuls use TF32 during the replay (its exponent is FP32's: ranges are unchanged); restore."""
    if device != "cuda":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
