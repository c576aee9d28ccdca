"""The overflow autopsy: replay a skipped step's batch with hooks, find where its first inf/NaN came from, and why.

:func:`run_autopsy` is called after a step was skipped for non-finite gradients (nothing runs on healthy steps but the
:class:`~lightning_amp_plus.diagnostics.replay.RngState` capture at the start of each batch). It replays the batch from
that RNG state, with the parameters as they are (a skipped step left them unchanged), and classifies the failure:

* ``"forward"``: an output of ``module`` is non-finite though its inputs are finite. No loss scale can help: keep the
  module in FP32 or train in bf16 (or, if it is non-finite in FP32 too, fix the computation).
* ``"scale"``: the forward is finite and the gradients are finite at ``safe_scale``, a power of two below the scale
  used: backing off the scale helps. ``module`` is where the backward first made a non-finite value at the scale used
  (``None`` when the scaled gradient of the loss overflowed before any module's backward).
* ``"backward"``: the gradients are non-finite even at ``min_scale`` (1 by default, the scaler's floor); ``module``
  is where the backward first made a non-finite value from finite incoming gradients.

Modules are judged by their outputs: a module that makes -inf inside its forward (an attention mask) but returns
finite values is never blamed, nor is a module whose -inf output a later module turns into finite values.

Replays: one with hooks at the scale used; for gradients non-finite there, one with hooks at ``min_scale``; then either
a binary search for ``safe_scale`` over the powers of two in between (5 hookless replays from 2**24 down to 1) or one
replay in FP32. A forward culprit costs one more, partial replay (its forward rerun in FP32). Nothing is left behind:
see :func:`~lightning_amp_plus.diagnostics.replay.untouched`.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_amp_plus._checks import check_int, check_real, show
from lightning_amp_plus.diagnostics.findings import AbsRange, Autopsy, Kind, ModuleStats, summarize
from lightning_amp_plus.diagnostics.formats import format_of
from lightning_amp_plus.diagnostics.recorder import Call, Recorder, Stop
from lightning_amp_plus.diagnostics.replay import (
    AutocastProbe,
    Context,
    RngState,
    all_finite,
    device_type,
    floating_tensors,
    no_grad_forward,
    replay,
    untouched,
)

__all__ = ["AbsRange", "Autopsy", "Kind", "ModuleStats", "run_autopsy"]


def run_autopsy(
    model: nn.Module,
    run: Callable[[], Tensor],
    *,
    rng: RngState,
    scale: float,
    step: int,
    dtype: torch.dtype,
    autocast: Context | None = None,
    min_scale: float = 1.0,
) -> Autopsy | None:
    """Replay a skipped step's batch and find where its first inf/NaN came from.

    Args:
        model: the module whose modules are judged (names from ``model.named_modules()``, without the parts torch's
            wrappers add: :func:`~lightning_amp_plus.diagnostics.names.plain_name`); its parameters are the ones whose
            gradients decide the step (those that require grad).
        run: reruns the batch's forward and returns its scalar loss, e.g. ``lambda: module.training_step(batch, i)``
            with logging suppressed. It is called inside ``autocast()``: it must not enter autocast itself (if it
            does, pass ``autocast=contextlib.nullcontext``; the FP32 checks then report ``None``).
        rng: the RNG state captured at the start of the batch, before its forward.
        scale: the loss scale the skipped step used (1.0 for bf16).
        step: the global step, for the record.
        dtype: the half dtype, ``torch.float16`` or ``torch.bfloat16``.
        autocast: a factory of the precision's autocast context (default ``torch.autocast(<model's device type>,
            dtype=dtype)``).
        min_scale: the lowest scale tried: the scaler's floor (1.0 by default, as DynamicLossScaler's).

    Returns:
        The :class:`Autopsy`, or ``None`` when the replay is finite everywhere (the fault did not reproduce: a
        rank-local fault, or a non-deterministic kernel).

    Raises:
        ValueError: a bad argument (the message names it, its value and the fix).
        TypeError: ``run()`` does not return a scalar loss with a gradient.
        Unreplayable: the gradients are needed and the loss was computed through a reentrant activation checkpoint
            (:func:`~lightning_amp_plus.diagnostics.replay.gradients`; a forward fault is still found).

    Examples:
        >>> _ = torch.manual_seed(0)
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        >>> with torch.no_grad():
        ...     net[0].weight.fill_(3e4)  # the first layer's output overflows float16  # doctest: +ELLIPSIS
        Parameter...
        >>> x = torch.ones(2, 4)
        >>> rng = RngState.capture()  # at the start of the batch
        >>> record = run_autopsy(net, lambda: net(x).float().mean(), rng=rng, scale=2.0**16, step=3,
        ...                      dtype=torch.float16)
        >>> record.kind, record.module, record.safe_scale
        ('forward', '0', None)
        >>> print(record.message)
        step 3: layer `0` (Linear): forward output 1.2e5 exceeds float16's 65504; loss scaling cannot fix this: keep \
it in FP32 with `keep_fp32=(Linear,)` or train in bf16.
    """
    fmt = format_of(dtype, "run_autopsy")
    _check_arguments(model, run, rng, autocast)
    scale = check_real("run_autopsy", "scale", scale, "a finite number > 0: the scale the step used", lambda s: s > 0)
    min_scale = check_real("run_autopsy", "min_scale", min_scale, "a finite number > 0, e.g. 1.0", lambda s: s > 0)
    step = check_int("run_autopsy", "step", step, minimum=0)
    device = device_type(model)
    context = autocast if autocast is not None else functools.partial(torch.autocast, device, dtype=fmt.dtype)
    replayer = _Replayer(model, run, rng, context, device)
    with untouched(model):
        return replayer.diagnose(step, scale, min_scale, fmt.dtype)


def _check_arguments(model: object, run: object, rng: object, autocast: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"`run_autopsy(model={show(model)})` must be an nn.Module: the model whose step was skipped.")
    if not callable(run):
        raise TypeError(f"`run_autopsy(run={show(run)})` must be a callable that reruns the batch, returning its loss.")
    if not isinstance(rng, RngState):
        raise TypeError(
            f"`run_autopsy(rng={show(rng)})` must be an RngState: capture one at the start of each batch with "
            "`RngState.capture()`."
        )
    if autocast is not None and not callable(autocast):
        raise TypeError(
            f"`run_autopsy(autocast={show(autocast)})` must be a callable returning a context manager, e.g. "
            '`lambda: torch.autocast("cuda", dtype=torch.float16)`, or None.'
        )


@dataclass
class _Hooked:
    """A replay with the recorder: its loss, its gradients (``None`` when the loss was non-finite)."""

    recorder: Recorder
    loss: Tensor
    grads: tuple[Tensor | None, ...] | None


class _Replayer:
    """The replays of one autopsy, each from the batch-start RNG state; the caller holds ``untouched(model)``."""

    def __init__(self, model: nn.Module, run: Callable[[], Tensor], rng: RngState, context: Context, device: str):
        self.model, self.run, self.rng, self.context, self.device = model, run, rng, context, device
        self.params = [p for p in model.parameters() if p.requires_grad]

    def diagnose(self, step: int, scale: float, min_scale: float, dtype: torch.dtype) -> Autopsy | None:
        """Classify the failure (the module docstring says how)."""
        first = self.hooked(scale)
        if first.grads is None:
            return self.forward_autopsy(first, step, scale, min_scale, dtype)
        if all_finite(first.grads):
            return None
        if scale > min_scale:
            floor = self.hooked(min_scale)
            if floor.grads is not None and all_finite(floor.grads):
                safe = self.safe_scale(min_scale, scale)
                return self.backward_autopsy(first, "scale", step, scale, min_scale, dtype, safe_scale=safe)
            first = floor
        fp32 = self.finite_in_fp32(backward=True)
        return self.backward_autopsy(first, "backward", step, scale, min_scale, dtype, finite_in_fp32=fp32)

    def hooked(self, scale: float) -> _Hooked:
        """One replay with the recorder attached, its summaries read."""
        recorder = Recorder(self.model, backward=True)
        self.rng.restore()
        recorder.attach()
        try:
            loss, grads = replay(self.run, self.context, scale, self.params)
        finally:
            recorder.detach()
        recorder.read()
        return _Hooked(recorder, loss, grads)

    def finite_at(self, scale: float) -> bool:
        """Whether a replay without hooks has finite gradients at ``scale``."""
        self.rng.restore()
        _, grads = replay(self.run, self.context, scale, self.params)
        return grads is not None and all_finite(grads)

    def safe_scale(self, min_scale: float, scale: float) -> float:
        """The largest ``min_scale * 2**k`` below ``scale`` with finite gradients, by binary search over ``k``.

        Finite at ``k = 0`` is known, and non-finite at ``scale``.
        """
        low, high = 0, max(1, math.ceil(math.log2(scale / min_scale)))
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.finite_at(min_scale * 2.0**middle) else (low, middle)
        return min_scale * 2.0**low

    def finite_in_fp32(self, backward: bool) -> bool | None:
        """Whether the batch is finite with autocast off (``None`` when autocast was on inside ``run`` anyway).

        Its loss; with ``backward``, its gradients at scale 1 too.
        """
        probe = AutocastProbe(self.device)
        self.rng.restore()
        probe.attach(self.model)
        try:
            if backward:
                _, grads = replay(self.run, self._fp32, 1.0, self.params)
                finite = grads is not None and all_finite(grads)
            else:
                with no_grad_forward(), self._fp32():
                    finite = all_finite([self.run()])
        finally:
            probe.detach()
        return None if probe.seen else finite

    def _fp32(self) -> Any:
        return torch.autocast(self.device, enabled=False)

    def fp32_outputs(self, call: Call) -> AbsRange | None:
        """The outputs of ``call``'s forward rerun in FP32 (``None`` if the module does not run so).

        A replay runs up to that call; there the module's forward runs on its inputs upcast, and the replay stops.
        """
        found: list[AbsRange | None] = []
        seen = itertools.count()

        def rerun(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if next(seen) != call.number:
                return
            try:
                with no_grad_forward(), self._fp32():
                    output = module.forward(*_upcast(args), **_upcast(kwargs))
                found.append(AbsRange.of([summarize(t) for t in floating_tensors(output)]))
            except Exception:  # e.g. half weights (a model converted to bf16): no FP32 rerun to compare with
                found.append(None)
            raise Stop

        handle = call.module.register_forward_pre_hook(rerun, with_kwargs=True)
        self.rng.restore()
        try:
            with torch.enable_grad(), self.context():
                self.run()
        except Stop:
            pass
        finally:
            handle.remove()
        return found[0] if found else None

    def forward_autopsy(
        self, hooked: _Hooked, step: int, scale: float, min_scale: float, dtype: torch.dtype
    ) -> Autopsy:
        """The ``"forward"`` record: the first module whose output went non-finite, or the loss computation."""
        recorder = hooked.recorder
        call = recorder.forward_origin()
        if call is None:
            fp32 = self.finite_in_fp32(backward=False)
            return Autopsy(step, "forward", None, None, scale, None, dtype, None, fp32, min_scale)
        fp32_outputs = self.fp32_outputs(call)
        stats = ModuleStats(
            inputs=recorder.range(call.inputs),
            weights=_own_weights(call.module),
            outputs=recorder.range(call.outputs),
            fp32_outputs=fp32_outputs,
        )
        fp32 = None if fp32_outputs is None else fp32_outputs.finite
        return Autopsy(
            step, "forward", call.name, type(call.module).__name__, scale, None, dtype, stats, fp32, min_scale
        )

    def backward_autopsy(
        self,
        hooked: _Hooked,
        kind: Kind,
        step: int,
        scale: float,
        min_scale: float,
        dtype: torch.dtype,
        safe_scale: float | None = None,
        finite_in_fp32: bool | None = None,
    ) -> Autopsy:
        """The ``"scale"`` or ``"backward"`` record, blaming the call where the hooked replay's backward went bad."""
        grads = dict(zip(self.params, hooked.grads or (), strict=True))
        finite = _finite_by_param(grads)
        recorder = hooked.recorder
        call = recorder.backward_origin(lambda m: all(finite.get(p, True) for p in m.parameters(recurse=False)))
        if call is None:
            return Autopsy(step, kind, None, None, scale, safe_scale, dtype, None, finite_in_fp32, min_scale)
        own = [grads.get(p) for p in call.module.parameters(recurse=False)]
        stats = ModuleStats(
            inputs=recorder.range(call.inputs),
            weights=_own_weights(call.module),
            outputs=recorder.range(call.outputs),
            grad_outputs=recorder.range(call.grad_outputs),
            grad_inputs=recorder.range(call.grad_inputs),
            grad_weights=AbsRange.of([summarize(g) for g in own if g is not None]),
        )
        name, module_type = call.name, type(call.module).__name__
        return Autopsy(step, kind, name, module_type, scale, safe_scale, dtype, stats, finite_in_fp32, min_scale)


def _finite_by_param(grads: Mapping[nn.Parameter, Tensor | None]) -> dict[nn.Parameter, bool]:
    present = [(p, g) for p, g in grads.items() if g is not None]
    if not present:
        return {}
    device = present[0][1].device
    flags = torch.stack([torch.isfinite(g).all().to(device) for _, g in present]).tolist()
    return {p: bool(f) for (p, _), f in zip(present, flags, strict=True)}


def _own_weights(module: nn.Module) -> AbsRange | None:
    return AbsRange.of([summarize(p) for p in module.parameters(recurse=False)])


def _upcast(value: Any) -> Any:
    """``value`` with its half tensors made float32 (looking into tuples, lists and dicts)."""
    if isinstance(value, Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if type(value) in (tuple, list):
        return type(value)(_upcast(item) for item in value)
    if type(value) is dict:
        return {key: _upcast(item) for key, item in value.items()}
    return value
