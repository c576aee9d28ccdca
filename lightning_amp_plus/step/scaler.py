"""``DynamicLossScaler``: dynamic loss scaling written from scratch, usable with or without Lightning.

A :class:`~lightning_amp_plus.step.guard.GradientGuard` (check once, skip on inf/NaN, count, record) that also
scales the loss and moves the scale: the scale policy is :mod:`~.policy` on the host and :mod:`~.device_policy` on the
device (the fused path), the passes over gradients are :mod:`~.grads`, the skip limit :mod:`~.skips`. This module gives
them ``torch.amp.GradScaler``'s API.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, overload

import torch
from torch import Tensor, nn  # noqa: F401 (nn: the docstring examples run in this module)
from torch.optim import Optimizer

from lightning_amp_plus._checks import TRACKER_MAX, is_int, read_count, read_number, real, require, show
from lightning_amp_plus.step.device_policy import DevicePolicy
from lightning_amp_plus.step.float32 import f32
from lightning_amp_plus.step.guard import GradientGuard
from lightning_amp_plus.step.outcome import StepRecord, StepResult
from lightning_amp_plus.step.pending import PendingReads, UpdateMark
from lightning_amp_plus.step.policy import ScalePolicy
from lightning_amp_plus.step.skips import Stall

__all__ = ["DynamicLossScaler"]

_FLOAT32 = torch.finfo(torch.float32)
_HYPERPARAMETERS = (
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
    "max_scale",
    "max_consecutive_skips",
)
# Backoff factors this close to 1 round to no backoff at all in float32 (f32(s * b) == s).
_BACKOFF_MAX = 1.0 - 2.0**-22


class DynamicLossScaler(GradientGuard):
    """Dynamic loss scaling for fp16 mixed precision, with a floor, a ceiling, hysteresis and diagnostics.

    A drop-in for ``torch.amp.GradScaler``: the same constructor (``DynamicLossScaler("cuda", init_scale=1024)``,
    ``enabled=False``), the same calls (``scale(loss).backward()``, ``unscale_(optimizer)`` before clipping,
    ``step(optimizer)``, ``update()``), accessors and state keys. What it adds:

    * The scale stays within ``[min_scale, max_scale]``: it can never reach 0, inf or a denormal, so the PyTorch failure
      where 170 overflows in a row take the scale to 0, the inverse to inf and the weights to NaN cannot happen.
    * The overflow check is the global norm of the *unscaled* gradients, measured as ``torch.nn.utils.clip_grad_norm_``
      measures it; :meth:`clip_grad_norm_` and :attr:`last_grad_norm` reuse that norm (clipping is bit-identical to
      torch's) instead of reading the gradients again.
    * ``hysteresis`` overflows are tolerated before the scale backs off (1 behaves like GradScaler).
    * Skipped steps are counted (:attr:`skipped_steps`, :attr:`consecutive_skips`); the parameters whose gradients were
      non-finite are named on overflow steps (:attr:`last_overflow_params`), and only then, so normal steps pay nothing.
    * No run goes nowhere silently: a skipped step that backing off could not help (the scale at ``min_scale``, a
      ``backoff_factor`` of 1, or an overflow the hysteresis tolerates) counts towards ``max_consecutive_skips``; when
      that many such skips come in a row, :meth:`step` raises ``FloatingPointError`` naming the parameters, the scale
      and the skipped steps. A run whose every step is skipped therefore stops after at most
      :attr:`max_skips_in_a_row` = ``max_consecutive_skips`` + the backoffs from ``max_scale`` to ``min_scale`` steps
      (50 + 24 = 74 with the defaults), whatever the scale, the hysteresis or a loaded state.
    * Sparse gradients, float64 gradients and (unlike GradScaler) fp16 gradients are unscaled and checked.

    **Two paths** (see :mod:`~lightning_amp_plus.step.guard`). An optimizer with PyTorch's fused protocol
    (``Adam``/``AdamW``/``SGD``/``Adagrad(fused=True)``) stepped without a prior :meth:`unscale_` takes the *fused
    path*: the scale and the overflow flag go to the optimizer's kernel, and the scale policy advances on the device
    too: no host sync in the step. The flags are read back later, together (when the skip limit could be reached, or
    when a counter, :meth:`get_scale`, :meth:`found_inf` or a :class:`~.outcome.StepResult` field is read), so
    counters are exact whenever they are read. Otherwise (clipping, any other optimizer) the *unscale path*:
    :meth:`unscale_` unscales, checks and measures and reads the norm back, the step's one host sync; the policy runs
    on the host from that read, and the device copy of the scale is written only when the policy changes it, so
    :meth:`update` never synchronises.

    State (besides :class:`~.guard.GradientGuard`'s): the scale policy, the device copy of the scale and where it
    lives, the device policy and whether it is current.

    Args:
        device: the device type the loss lives on, as GradScaler's first argument (``"cuda"``, ``"cpu"``); the scale
            always follows the loss's device, so ``None`` (the default) works anywhere. A number here is taken as
            ``init_scale`` (the signature of lightning-amp-plus 0.1, ``DynamicLossScaler(1.0, min_scale=1.0)``).
        init_scale: the initial scale.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps in a row (>= 1).
        backoff_factor: multiplies the scale on an overflow once the hysteresis is used up (in ``(0, 1]``).
        growth_interval: clean steps in a row before the scale grows.
        enabled: ``False`` makes every method GradScaler's pass-through: ``scale`` returns its input, ``step`` calls
            ``optimizer.step()``, ``get_scale`` is 1.0, ``state_dict`` is ``{}`` (nanoGPT's
            ``GradScaler(enabled=(dtype == "float16"))``).
        hysteresis: overflows tolerated before a backoff; refilled whenever the scale grows (as in Megatron-LM).
        min_scale: the floor, a normal positive float32 (default 1.0, as DeepSpeed and Megatron-LM).
        max_scale: the ceiling (default 2**24, as apex).
        max_consecutive_skips: skipped steps in a row that backing off could not help after which :meth:`step`
            raises; ``None`` never.

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
        >>> scaler.get_scale(), scaler.skipped_steps
        (512.0, 0)
    """

    def __init__(
        self,
        device: str | torch.device | float | None = None,
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
        device_type, init_scale = _split_device(device, init_scale)
        if not isinstance(enabled, bool):
            raise TypeError(f"`DynamicLossScaler(enabled={show(enabled)})` must be a bool (True or False).")
        _check_bounds(min_scale, max_scale, init_scale)
        _check_factors(growth_factor, backoff_factor)
        _check_interval("growth_interval", growth_interval, "e.g. 2000")
        _check_interval("hysteresis", hysteresis, "(1 backs off on every overflow, like GradScaler)")
        super().__init__(max_consecutive_skips)
        self._device = device_type
        self._enabled = enabled
        self._init_scale = float(init_scale)
        self._policy = ScalePolicy(
            scale=float(init_scale),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=int(growth_interval),
            hysteresis=int(hysteresis),
            min_scale=float(min_scale),
            max_scale=float(max_scale),
        )
        # The device copy of the scale, which `scale()` multiplies by: written from the host when the host policy
        # changes it (unscale path), advanced by the device policy on the fused path. It moves to the first device
        # a loss is scaled on.
        self._scale = torch.full((), self._policy.scale, dtype=torch.float32)
        self._placed = False
        self._device_policy: DevicePolicy | None = None
        self._device_policy_current = False

    def __repr__(self) -> str:
        c = self._policy
        extra = "" if self._device is None else f"{self._device!r}, "
        extra += "" if self._enabled else "enabled=False, "
        return (
            f"DynamicLossScaler({extra}init_scale={self._init_scale:g}, growth_factor={c.growth_factor:g}, "
            f"backoff_factor={c.backoff_factor:g}, growth_interval={c.growth_interval}, hysteresis={c.hysteresis}, "
            f"min_scale={c.min_scale:g}, max_scale={c.max_scale:g}, max_consecutive_skips={self.max_consecutive_skips})"
        )

    # ----------------------------------------------------------------------------------------------- configuration
    def is_enabled(self) -> bool:
        """Whether scaling is enabled (``enabled=False`` makes every method a pass-through)."""
        return self._enabled

    def get_growth_factor(self) -> float:
        """The factor the scale grows by (GradScaler's accessor)."""
        return self._policy.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (>= 1), as GradScaler's setter, checked.

        Examples:
            >>> scaler = DynamicLossScaler(); scaler.set_growth_factor(4.0); scaler.get_growth_factor()
            4.0
        """
        _check_factors(new_factor, self._policy.backoff_factor, owner="DynamicLossScaler.set_growth_factor")
        self._reconfigure(growth_factor=float(new_factor))

    def get_backoff_factor(self) -> float:
        """The factor the scale backs off by (GradScaler's accessor)."""
        return self._policy.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in ``(0, 1]``), as GradScaler's setter, checked."""
        _check_factors(self._policy.growth_factor, new_factor, owner="DynamicLossScaler.set_backoff_factor")
        self._reconfigure(backoff_factor=float(new_factor))

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows (GradScaler's accessor)."""
        return self._policy.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int >= 1), as GradScaler's setter, checked."""
        _check_interval("growth_interval", new_interval, "e.g. 2000", owner="DynamicLossScaler.set_growth_interval")
        self._reconfigure(growth_interval=int(new_interval))

    @property
    def min_scale(self) -> float:
        """The floor of the scale."""
        return self._policy.min_scale

    @property
    def max_scale(self) -> float:
        """The ceiling of the scale."""
        return self._policy.max_scale

    @property
    def hysteresis(self) -> int:
        """Overflows tolerated before a backoff."""
        return self._policy.hysteresis

    @property
    def growth_interval(self) -> int:
        """Clean steps in a row before the scale grows."""
        return self._policy.growth_interval

    @property
    def max_skips_in_a_row(self) -> int | None:
        """The most optimizer steps in a row that can be skipped before ``FloatingPointError`` (``None``: no limit).

        ``max_consecutive_skips`` plus the backoffs from ``max_scale`` to ``min_scale`` (each skip either lowers the
        scale, at most that many times, or counts towards the limit), for one optimizer stepped per ``update()``.

        Examples:
            >>> DynamicLossScaler().max_skips_in_a_row, DynamicLossScaler(backoff_factor=1.0).max_skips_in_a_row
            (74, 50)
        """
        limit = self.max_consecutive_skips
        return None if limit is None else limit + self._policy.backoffs_to_floor()

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
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            self._place(outputs.device)
            scale = (
                self._scale
                if self._scale.device == outputs.device
                else self._scale.to(outputs.device, non_blocking=True)
            )
            return outputs * scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(item) for item in outputs)
        if isinstance(outputs, Iterable):
            return map(self.scale, outputs)  # as GradScaler: a lazy map for other iterables
        raise TypeError(
            f"`DynamicLossScaler.scale(outputs)` takes a tensor or an iterable of tensors, got {outputs!r}."
        )

    # ------------------------------------------------------------------- enabled=False: GradScaler's pass-through
    def unscale_(self, optimizer: Optimizer) -> None:
        """:meth:`GradientGuard.unscale_ <.guard.GradientGuard.unscale_>`; disabled, nothing."""
        if self._enabled:
            super().unscale_(optimizer)

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> float:
        """:meth:`GradientGuard.clip_grad_norm_ <.guard.GradientGuard.clip_grad_norm_>`.

        Disabled, ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters.
        """
        if self._enabled:
            return super().clip_grad_norm_(optimizer, max_norm)
        limit = real(max_norm)
        if limit is None or limit <= 0:
            raise ValueError(f"`clip_grad_norm_(max_norm={show(max_norm)})` must be a finite number > 0.")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return float(torch.nn.utils.clip_grad_norm_(params, limit))

    def uses_fused_path(self, optimizer: Optimizer) -> bool:
        """:meth:`GradientGuard.uses_fused_path <.guard.GradientGuard.uses_fused_path>`; disabled, False."""
        return self._enabled and super().uses_fused_path(optimizer)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """:meth:`GradientGuard.step <.guard.GradientGuard.step>`; disabled, ``optimizer.step(*args, **kwargs)``."""
        if self._enabled:
            return super().step(optimizer, *args, **kwargs)
        self._results[id(optimizer)] = StepResult.known(skipped=False, scale=1.0, grad_norm=None)
        return optimizer.step(*args, **kwargs)

    def step_with(
        self, optimizer: Optimizer, apply: Callable[[], Any], *, fused_kwargs: dict[str, Any] | None = None
    ) -> Any:
        """:meth:`GradientGuard.step_with <.guard.GradientGuard.step_with>`; disabled, ``apply()``."""
        if self._enabled:
            return super().step_with(optimizer, apply, fused_kwargs=fused_kwargs)
        self._results[id(optimizer)] = StepResult.known(skipped=False, scale=1.0, grad_norm=None)
        return apply()

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Advance the scale once for everything stepped since the last call; no host sync.

        Args:
            new_scale: set the scale to this value instead (a number or a one-element tensor, clamped to
                ``[min_scale, max_scale]``; a tensor is read on the host).

        Raises:
            FloatingPointError: the skip limit was reached on the fused path.
        """
        if not self._enabled:
            return
        records = self._close_iteration()
        if new_scale is not None:
            value = _new_scale_value(new_scale)
            self._sync()
            self._set_scale(min(max(value, self.min_scale), self.max_scale))
            return
        if not records:
            return
        if not self._pending and all(record.overflow is not None for record in records):
            self._update_on_host(any(bool(record.overflow) for record in records))
            return
        self._pending.add_update(records)
        if not self._read_if_due() and not self._policy.fixed:
            self._update_on_device(records)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled).

        Free on the unscale path; on the fused path it first reads the pending flags (one host read).
        """
        if not self._enabled:
            return 1.0
        self._sync()
        return self._policy.scale

    # ---------------------------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: plain Python numbers only, a superset of ``torch.amp.GradScaler``'s keys.

        ``{}`` when disabled, as GradScaler's.
        """
        if not self._enabled:
            return {}
        self._sync()
        return {
            "scale": self._policy.scale,
            "growth_factor": self._policy.growth_factor,
            "backoff_factor": self._policy.backoff_factor,
            "growth_interval": self._policy.growth_interval,
            "_growth_tracker": self._policy.growth_tracker,
            "hysteresis": self._policy.hysteresis,
            "_hysteresis_tracker": self._policy.hysteresis_tracker,
            "min_scale": self._policy.min_scale,
            "max_scale": self._policy.max_scale,
            "max_consecutive_skips": self.max_consecutive_skips,
            **self._skips.counters(),
        }

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
        if not self._enabled:
            return
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"`DynamicLossScaler.load_state_dict` expects a dict, got {type(state_dict).__name__}.")
        if "scale" not in state_dict:
            raise ValueError(
                "The scaler state has no 'scale' key (keys: "
                f"{sorted(map(str, state_dict))}): it is not a DynamicLossScaler or torch.amp.GradScaler state."
            )
        scale = read_number(state_dict, "scale", float)
        if not (math.isfinite(scale) and 0 < scale <= _FLOAT32.max):
            raise ValueError(
                f"The scaler state holds scale={show(state_dict['scale'])}; a loss scale must be finite and > 0, "
                f"within float32 (<= {_FLOAT32.max:.3g}): the state is corrupt."
            )
        counters = {
            "_growth_tracker": read_count(state_dict, "_growth_tracker", 0),
            "_hysteresis_tracker": read_count(state_dict, "_hysteresis_tracker", self.hysteresis),
            "skipped_steps": read_count(state_dict, "skipped_steps", 0),
            "consecutive_skips": read_count(state_dict, "consecutive_skips", 0),
            "_floor_skips": read_count(state_dict, "_floor_skips", 0),
        }
        if not self.min_scale <= scale <= self.max_scale:
            warnings.warn(
                f"The saved loss scale {scale:g} is outside [min_scale, max_scale] = [{self.min_scale:g}, "
                f"{self.max_scale:g}]; it is clamped to that range.",
                stacklevel=2,
            )
            scale = min(max(scale, self.min_scale), self.max_scale)
        self._pending, self._passes, self._stop = PendingReads(), {}, None
        self._set_scale(scale)
        # A tracker at or past its end acts as the end: g >= interval - 1 grows at the next clean step either way.
        self._policy.growth_tracker = min(counters["_growth_tracker"], self.growth_interval - 1)
        self._policy.hysteresis_tracker = min(counters["_hysteresis_tracker"], self.hysteresis)
        self._skips.restore(counters)
        self._warn_if_hyperparameters_differ(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle between iterations only (as GradScaler): device tensors and references to parameters are dropped."""
        if not self._enabled:
            return self.__dict__.copy()
        state = super().__getstate__()
        state.update(_scale=None, _device_policy=None, _device_policy_current=False, _placed=False)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._scale = torch.full((), self._policy.scale, dtype=torch.float32)

    # ------------------------------------------------------------------------------------- what GradientGuard asks
    def _host_scale(self) -> float | None:
        return self._policy.scale

    def _device_scale(self, device: torch.device) -> Tensor | None:
        self._place(device)
        return self._scale

    def _backs_off(self) -> bool:
        return self._policy.backs_off_on_overflow()

    def _replay_update(self, mark: UpdateMark) -> None:
        if not self._policy.fixed:
            self._policy.update(any(bool(record.overflow) for record in mark.records))

    def _after_sync(self) -> None:
        # The device copies follow the host: it replayed the same steps (or stopped at the limit, or replayed one
        # update the device has not run yet).
        self._scale.fill_(self._policy.scale)
        self._device_policy_current = False

    def _stall(self, record: StepRecord) -> Stall:
        scale = record.scale if record.scale is not None else self._policy.scale
        if scale <= self.min_scale:
            return Stall(
                f"with the loss scale at its floor (scale={scale:g}, min_scale={self.min_scale:g})",
                "The model produces inf/NaN gradients even at the smallest loss scale allowed.",
                "check the inputs and the loss for inf/NaN, lower the learning rate, clip gradients, train in "
                "'bf16-mixed', or lower `min_scale`",
            )
        return Stall(
            f"without the loss scale coming down (scale={scale:g}, backoff_factor={self._policy.backoff_factor:g}, "
            f"hysteresis={self.hysteresis})",
            "The scale cannot back off to where the gradients fit: the hysteresis or the backoff factor hold it.",
            "lower `hysteresis`, use a `backoff_factor` below 1 (e.g. 0.5), or a lower `init_scale`",
        )

    def _reconfigure(self, **constants: Any) -> None:
        self._sync()
        for name, value in constants.items():
            setattr(self._policy, name, value)
        self._device_policy_current = False

    def _warn_if_hyperparameters_differ(self, state_dict: Mapping[str, Any]) -> None:
        mine = {key: value for key, value in self.state_dict().items() if key in _HYPERPARAMETERS}
        differing = {key: state_dict[key] for key in mine if key in state_dict and state_dict[key] != mine[key]}
        if differing:
            warnings.warn(
                f"The saved scaler was built with {differing}; this one keeps its own "
                f"{ {key: mine[key] for key in differing} }.",
                stacklevel=3,
            )

    def _place(self, device: torch.device) -> None:
        """Move the scale to the first device it is used on; later uses elsewhere take copies."""
        if not self._placed:
            self._placed = True
            if self._scale.device != device:
                self._scale = self._scale.to(device)

    def _set_scale(self, value: float) -> None:
        self._policy.scale = f32(value)
        self._scale.fill_(self._policy.scale)
        self._device_policy_current = False

    def _update_on_host(self, found_inf: bool) -> None:
        if self._policy.fixed:
            return
        before = self._policy.scale
        self._policy.update(found_inf=found_inf)
        self._device_policy_current = False
        if self._policy.scale != before:
            self._scale.fill_(self._policy.scale)  # no host sync: a host value written to the device

    def _update_on_device(self, records: list[StepRecord]) -> None:
        flags = self._pending.flags_of(records)
        if any(record.overflow for record in records):  # an overflow the host already knows
            found = self._flag_constants(self._scale.device)[1]
        elif len(flags) == 1:
            found = flags[0]
        else:
            found = torch.stack([flag.to(self._scale.device) for flag in flags]).amax()
        if self._device_policy is None or self._device_policy.device != self._scale.device:
            self._device_policy = DevicePolicy(self._policy, self._scale)
        elif not self._device_policy_current:
            self._device_policy.load(self._policy)
        self._device_policy_current = True
        self._device_policy.advance(self._scale, found, self._policy)


# ------------------------------------------------------------------------------------------------------- helpers
def _split_device(device: object, init_scale: float) -> tuple[str | None, float]:
    """GradScaler's first argument is the device; a number there is the initial scale of the 0.1 signature."""
    if real(device) is not None:
        if init_scale != 2.0**16:
            raise TypeError(
                f"`DynamicLossScaler({show(device)}, {show(init_scale)}, ...)`: the first argument is the device, as "
                "in torch.amp.GradScaler. Pass the scale by keyword: DynamicLossScaler(init_scale=...)."
            )
        return None, device  # type: ignore[return-value]
    if device is None:
        return None, init_scale
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device).type, init_scale
        except RuntimeError:
            pass
    raise ValueError(
        f"`DynamicLossScaler(device={show(device)})` is invalid: device must be a device type such as 'cuda' or "
        "'cpu' (as torch.amp.GradScaler's), or None to follow the loss."
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
        f"must be an int in [1, 2**53], {hint}",
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
