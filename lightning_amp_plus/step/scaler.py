"""``DynamicLossScaler``: ``torch.amp.GradScaler``'s API over the step engine, usable with or without Lightning.

A thin shell: the scale lives in a :class:`~.policy.LossScale`, the step (check once, skip on inf/NaN, count, record)
in a :class:`~.engine.StepEngine`; this module gives them GradScaler's constructor, calls and state keys, and checks
the arguments. The plugins hold the same engine: ``trainer.scaler`` is this object, over the plugin's engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, overload

import torch
from torch import Tensor, nn  # noqa: F401 (nn: the docstring examples run in this module)
from torch.optim import Optimizer

from lightning_amp_plus._checks import TRACKER_MAX, is_int, real, require, show
from lightning_amp_plus.step.engine import PendingStep, StepEngine, StepResult
from lightning_amp_plus.step.policy import LossScale, ScalePolicy

__all__ = ["DynamicLossScaler"]

_FLOAT32 = torch.finfo(torch.float32)
# Backoff factors this close to 1 round to no backoff at all in float32 (f32(s * b) == s).
_BACKOFF_MAX = 1.0 - 2.0**-22
# The instance's own attributes; any other name set on an instance must be one of the class's (see __setattr__).
_OWN_ATTRIBUTES = ("_device", "_enabled", "_init_scale", "_loss_scale", "engine")


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 mixed precision, with a floor, a ceiling, hysteresis and diagnostics.

    A drop-in for ``torch.amp.GradScaler``: the same constructor (``DynamicLossScaler("cuda", init_scale=1024)``,
    ``enabled=False``), the same calls (``scale(loss).backward()``, ``unscale_(optimizer)`` before clipping,
    ``step(optimizer)``, ``update()``), accessors and state keys. What it adds:

    * The scale stays within ``[min_scale, max_scale]``: it can never reach 0, inf or a denormal, so GradScaler's
      failure cannot happen (from 2**16, 166 overflows in a row take its scale to 0; the first finite gradients after
      that are multiplied by 1/0 and the weights turn NaN).
    * :meth:`unscale_` and :meth:`step` check as GradScaler does, in its one pass (its own kernel: the same values,
      the same cost), and only inf/NaN values skip a step. The global norm of the unscaled gradients is measured only
      when something reads it: :meth:`clip_grad_norm_` (which clips with it, bit for bit torch's
      ``clip_grad_norm_``, and multiplies only when over the limit), a ``MixedPrecisionMonitor``, a spike guard;
      :meth:`result` reports it (``None`` when nothing asked). In nanoGPT's loop (``unscale_``, then torch's own
      ``clip_grad_norm_``) the scaler makes GradScaler's passes and no other.
    * ``hysteresis`` overflows are tolerated before the scale backs off (1 behaves like GradScaler).
    * Skipped steps are counted (:attr:`skipped_steps`); the parameters whose gradients were non-finite are named
      (``result(optimizer).overflow_params``), only on skipped steps, so normal steps pay nothing.
    * No run goes nowhere silently: a skipped step that backing off could not help (the scale at ``min_scale``, a
      ``backoff_factor`` of 1, or an overflow the hysteresis tolerates) counts towards ``max_consecutive_skips``; when
      that many such skips come in a row, :meth:`step` raises ``FloatingPointError`` naming the parameters, the scale
      and the skipped steps. A run whose every step is skipped therefore stops after at most ``max_consecutive_skips``
      plus the backoffs from ``max_scale`` to ``min_scale`` steps (50 + 24 = 74 with the defaults), whatever the
      scale, the hysteresis or a loaded state.
    * Sparse gradients, float64 gradients and (unlike GradScaler) fp16 gradients are unscaled and checked.

    **Two paths** (see :mod:`~lightning_amp_plus.step.engine`). An optimizer with PyTorch's fused protocol
    (``Adam``/``AdamW``/``SGD``/``Adagrad(fused=True)``) stepped without a prior :meth:`unscale_` takes the *fused
    path*: GradScaler's check (by 1.0), then the scale and the overflow flag go to the optimizer's kernel: no host
    read in the step. The step's values are read later, all at once, when something reads them (:attr:`skipped_steps`,
    a field of :meth:`result`, :meth:`state_dict`) or when the skip limit could be reached. Otherwise the *unscale
    path*: the check's flag is read on the host (the step's one host read, as GradScaler's ``step``). On both paths
    :meth:`update` moves the scale on its device from the steps' flags there: it never reads.

    For a distributed loop, set ``scaler.engine.ranks`` to a :class:`~lightning_amp_plus.step.sharding.Ranks`
    (``Ranks(group=dist.group.WORLD)`` for DDP, ``Ranks(sharding=Sharding())`` for FSDP and FSDP2: every rank then
    skips alike), and ``scaler.engine.name_parameters(model)`` for readable names.

    Args:
        device: the device type the loss lives on, as GradScaler's first argument (``"cuda"``, ``"cpu"``); the scale
            always follows the loss's device, so ``None`` (the default) works anywhere.
        init_scale: the initial scale.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps in a row (>= 1).
        backoff_factor: multiplies the scale on an overflow once the hysteresis is used up (in ``(0, 1]``).
        growth_interval: clean steps in a row before the scale grows (up to ``2**31 - 1``: the trackers are int32, as
            GradScaler's).
        enabled: ``False`` makes every method GradScaler's pass-through: ``scale`` returns its input, ``step`` calls
            ``optimizer.step()``, ``get_scale`` is 1.0, ``state_dict`` is ``{}`` (nanoGPT's
            ``GradScaler(enabled=(dtype == "float16"))``).
        hysteresis: overflows tolerated before a backoff; refilled whenever the scale grows (as in Megatron-LM); up to
            ``2**31 - 1``.
        min_scale: the floor, a normal positive float32 (default 1.0, as DeepSpeed and Megatron-LM).
        max_scale: the ceiling (default 2**24, as apex). As GradScaler, a growth whose float32 product would be inf is
            not taken: a ceiling within ``growth_factor`` of float32's largest value may not be reached.
        max_consecutive_skips: skipped steps in a row that backing off could not help after which :meth:`step`
            raises; ``None`` never.

    Attributes:
        engine: the :class:`~lightning_amp_plus.step.engine.StepEngine` that scales, checks, steps and counts.

    Examples:
        >>> model = nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=2)
        >>> for _ in range(3):
        ...     loss = model(torch.ones(2, 4)).pow(2).mean()
        ...     scaler.scale(loss).backward()
        ...     scaler.unscale_(opt)
        ...     norm = scaler.clip_grad_norm_(opt, max_norm=1.0)
        ...     _ = scaler.step(opt)
        ...     scaler.update()
        ...     opt.zero_grad()
        >>> scaler.get_scale(), scaler.skipped_steps, scaler.result(opt).skipped
        (512.0, 0, False)
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        max_consecutive_skips: int | None = 50,
    ) -> None:
        self._device = _device_type(device)
        if not isinstance(enabled, bool):
            raise TypeError(f"`DynamicLossScaler(enabled={show(enabled)})` must be a bool (True or False).")
        _check_bounds(min_scale, max_scale, init_scale)
        _check_factors(growth_factor, backoff_factor)
        _check_interval("growth_interval", growth_interval, "e.g. 2000")
        _check_interval("hysteresis", hysteresis, "(1 backs off on every overflow, like GradScaler)")
        self._enabled = enabled
        self._init_scale = float(init_scale)
        policy = ScalePolicy(
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=int(growth_interval),
            hysteresis=int(hysteresis),
            min_scale=float(min_scale),
            max_scale=float(max_scale),
        )
        self._loss_scale = LossScale(policy, float(init_scale))
        self.engine = StepEngine(
            self._loss_scale if enabled else None,
            check=enabled,
            max_consecutive_skips=max_consecutive_skips,
        )

    def __setattr__(self, name: str, value: Any) -> None:
        # A name GradScaler does not have (``scaler.process_group = ...``) is refused, not ignored silently; a method
        # may be replaced on an instance, as GradScaler's can (``mock.patch.object(scaler, "step", wraps=...)`` in
        # Lightning's own tests: tests/step/test_scaler_dropin.py runs it).
        if name not in _OWN_ATTRIBUTES and not hasattr(type(self), name):
            raise AttributeError(
                f"`DynamicLossScaler` has no attribute {name!r}: setting it would do nothing. The step engine's "
                "settings are on `scaler.engine` (e.g. `scaler.engine.ranks`)."
            )
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        c = self._loss_scale.policy
        extra = "" if self._device is None else f"{self._device!r}, "
        extra += "" if self._enabled else "enabled=False, "
        return (
            f"DynamicLossScaler({extra}init_scale={self._init_scale:g}, growth_factor={c.growth_factor:g}, "
            f"backoff_factor={c.backoff_factor:g}, growth_interval={c.growth_interval}, hysteresis={c.hysteresis}, "
            f"min_scale={c.min_scale:g}, max_scale={c.max_scale:g}, "
            f"max_consecutive_skips={self.engine.max_consecutive_skips})"
        )

    # ---------------------------------------------------------------------------------------------------- the step
    @overload
    def scale(self, outputs: Tensor) -> Tensor: ...

    @overload
    def scale(self, outputs: list[Tensor]) -> list[Tensor]: ...

    @overload
    def scale(self, outputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[Tensor]) -> Iterable[Tensor]: ...

    def scale(self, outputs: Tensor | Iterable[Tensor]) -> Tensor | Iterable[Tensor]:
        """Multiply a loss (or nested lists/tuples, or any iterable, of losses) by the current scale.

        The scale lives on the device of the first loss scaled; a loss on another device is multiplied by a copy.

        Examples:
            >>> DynamicLossScaler(init_scale=4.0).scale(torch.tensor(1.5))
            tensor(6.)
        """
        if isinstance(outputs, Tensor):
            return self.engine.scale_loss(outputs)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(item) for item in outputs)
        if isinstance(outputs, Iterable):
            return map(self.scale, outputs)  # as GradScaler: a lazy map for other iterables
        raise TypeError(
            f"`DynamicLossScaler.scale(outputs)` takes a tensor or an iterable of tensors, got {outputs!r}."
        )

    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and check them for inf/NaN (GradScaler's one pass).

        Call it before clipping or inspecting gradients; :meth:`step` does it otherwise. A second call before
        :meth:`update` does nothing, so the gradients are unscaled exactly once. This is the step's one host read. The
        norm is measured here only for a reader (a monitor, a spike guard); :meth:`clip_grad_norm_` measures it when
        it clips. Disabled, nothing.
        """
        self.engine.unscale(optimizer)

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> float:
        """Clip the optimizer's gradients to a global L2 norm of ``max_norm``.

        The norm is ``torch.nn.utils.clip_grad_norm_``'s, bit for bit, and so are the clipped gradients; it is
        measured once (reused if a reader measured it already), and the gradients are multiplied only when the norm is
        over the limit. Unscales first if needed. On an overflow step nothing is multiplied (the step will be skipped).
        Disabled, ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters.

        Returns:
            The global norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` returns it.
        """
        return self.engine.clip_by_norm(optimizer, max_norm)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients hold inf/NaN; a skipped step leaves parameters and state untouched.

        As GradScaler's, it calls :meth:`unscale_` first if nothing did this iteration, unless the step takes the fused
        path (the optimizer unscales in its own kernel). Disabled, ``optimizer.step(*args, **kwargs)``.

        Returns:
            What ``optimizer.step`` returned, or ``None`` when the step was skipped on the host.

        Raises:
            FloatingPointError: the skip limit was reached (on the fused path, at the step by which it could have been:
                the steps' values are read then).
        """
        if not self._enabled:
            return self.engine.step(optimizer, lambda: optimizer.step(*args, **kwargs))
        if args:
            raise ValueError(
                "`DynamicLossScaler.step(optimizer, closure)`: closures are not supported, because the gradients must "
                "be checked before the step. Run the closure yourself, then call `step(optimizer)`."
            )
        # Unscaled, if nothing did, through this instance's unscale_, as GradScaler's step: a patched one sees the call.
        return self.engine.step(optimizer, unscale=self.unscale_, **kwargs)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Advance the scale once for everything stepped since the last call; no host read.

        Args:
            new_scale: set the scale to this value instead (a number or a one-element tensor, clamped to
                ``[min_scale, max_scale]``; a tensor is read on the host).
        """
        if not self._enabled:
            return
        if new_scale is None:
            self.engine.update()
            return
        policy = self._loss_scale.policy
        self.engine.update(new_scale=min(max(_new_scale_value(new_scale), policy.min_scale), policy.max_scale))

    # ------------------------------------------------------------------------------------------------ readings
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled): a host read, as GradScaler's."""
        return self._loss_scale.value() if self._enabled else 1.0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped since the start (restored from checkpoints)."""
        return self.engine.skipped_steps

    def result(self, optimizer: Optimizer) -> StepResult | PendingStep | None:
        """The :class:`~.engine.StepResult` of ``optimizer``'s latest step (``None`` before its first).

        A fused step not read yet is a :class:`~.engine.PendingStep`, which reads the same way.
        """
        return self.engine.result(optimizer)

    def is_enabled(self) -> bool:
        """Whether scaling is enabled (``enabled=False`` makes every method a pass-through)."""
        return self._enabled

    def get_growth_factor(self) -> float:
        """The factor the scale grows by (GradScaler's accessor)."""
        return self._loss_scale.policy.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (>= 1), as GradScaler's setter, checked.

        Examples:
            >>> scaler = DynamicLossScaler(); scaler.set_growth_factor(4.0); scaler.get_growth_factor()
            4.0
        """
        _check_factors(new_factor, self.get_backoff_factor(), owner="DynamicLossScaler.set_growth_factor")
        self._loss_scale.reconfigure(growth_factor=float(new_factor))

    def get_backoff_factor(self) -> float:
        """The factor the scale backs off by (GradScaler's accessor)."""
        return self._loss_scale.policy.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in ``(0, 1]``), as GradScaler's setter, checked."""
        _check_factors(self.get_growth_factor(), new_factor, owner="DynamicLossScaler.set_backoff_factor")
        self._loss_scale.reconfigure(backoff_factor=float(new_factor))

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows (GradScaler's accessor)."""
        return self._loss_scale.policy.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int >= 1), as GradScaler's setter, checked."""
        _check_interval("growth_interval", new_interval, "e.g. 2000", owner="DynamicLossScaler.set_growth_interval")
        self._loss_scale.reconfigure(growth_interval=int(new_interval))

    # ---------------------------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: plain Python numbers only, a superset of ``torch.amp.GradScaler``'s keys.

        ``{}`` when disabled, as GradScaler's.
        """
        return self.engine.scaler_state_dict() if self._enabled else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`, or by ``torch.amp.GradScaler.state_dict()`` (to migrate).

        The dynamic state (scale, trackers, skip counters) is restored. The hyperparameters this scaler was built with
        stay in force (GradScaler takes the saved ones); if the saved ones differ, a warning says which. Trackers
        beyond this scaler's growth interval or hysteresis are brought within them. A disabled scaler ignores the
        state, as GradScaler does.

        Raises:
            TypeError: the state is not a mapping, or a value has the wrong type.
            ValueError: a key is missing or a value is out of range (a counter above 2**62, a scale beyond float32).
        """
        if self._enabled:
            self.engine.load_scaler_state_dict(state_dict)


# ------------------------------------------------------------------------------------------------------- helpers
def _device_type(device: object) -> str | None:
    """GradScaler's first argument: a device type (``"cuda"``, ``"cpu"``), or ``None`` to follow the loss."""
    if device is None:
        return None
    if isinstance(device, (str, torch.device)) and not isinstance(device, bool):
        try:
            return torch.device(device).type
        except RuntimeError:
            pass
    raise ValueError(
        f"`DynamicLossScaler(device={show(device)})` is invalid: device must be a device type such as 'cuda' or "
        "'cpu' (as torch.amp.GradScaler's), or None to follow the loss; pass the scale by keyword, init_scale=..."
    )


def _check_bounds(min_scale: object, max_scale: object, init_scale: object) -> None:
    low, high, init = real(min_scale), real(max_scale), real(init_scale)
    require(
        low is not None and low >= _FLOAT32.tiny,
        "min_scale",
        min_scale,
        f"must be a finite normal float32 number >= {_FLOAT32.tiny:.3g}; the default is 1.0",
    )
    assert low is not None
    require(
        high is not None and low <= high <= _FLOAT32.max,
        "max_scale",
        max_scale,
        f"must be finite, >= min_scale ({min_scale}) and <= {_FLOAT32.max:.3g}; the default is 2**24",
    )
    assert high is not None
    require(
        init is not None and low <= init <= high,
        "init_scale",
        init_scale,
        f"must be a finite number in [min_scale, max_scale] = [{min_scale}, {max_scale}]",
    )


def _check_factors(growth_factor: object, backoff_factor: object, owner: str = "DynamicLossScaler") -> None:
    growth, backoff = real(growth_factor), real(backoff_factor)
    require(
        growth is not None and growth >= 1.0,
        "growth_factor",
        growth_factor,
        "must be a finite number >= 1.0, e.g. 2.0",
        owner,
    )
    require(
        backoff is not None and (0.0 < backoff <= _BACKOFF_MAX or backoff == 1.0),
        "backoff_factor",
        backoff_factor,
        "must be in (0, 1], e.g. 0.5 (1.0 never backs off; factors within 2**-22 of 1 would round to no backoff "
        "in float32)",
        owner,
    )


def _check_interval(argument: str, value: object, hint: str, owner: str = "DynamicLossScaler") -> None:
    require(
        is_int(value) and 1 <= value <= TRACKER_MAX,  # type: ignore[operator]
        argument,
        value,
        f"must be an int in [1, 2**31 - 1], {hint}",
        owner,
    )


def _new_scale_value(new_scale: float | Tensor) -> float:
    if isinstance(new_scale, Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad or not new_scale.is_floating_point():
            raise ValueError(
                f"`DynamicLossScaler.update(new_scale=...)` takes a number or a one-element floating tensor without "
                f"grad, got a tensor of shape {tuple(new_scale.shape)}, dtype {new_scale.dtype}."
            )
        value: object = float(new_scale.item())  # a host read, as the host policy keeps the scale
    else:
        value = new_scale
    number = real(value)
    require(number is not None and number > 0, "new_scale", value, "must be a finite number > 0", "update")
    assert number is not None
    return number
