"""``DynamicLossScaler``: dynamic loss scaling written from scratch, usable with or without Lightning.

The scale policy lives in :mod:`lightning_amp_plus._policy`, the passes over gradients in
:mod:`lightning_amp_plus._grads`; this module ties them to optimizers with ``torch.amp.GradScaler``'s call pattern.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_amp_plus._float32 import f32
from lightning_amp_plus._grads import clip_by_norm_, unscale_and_measure_
from lightning_amp_plus._policy import ScalePolicy

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
_NAMES_SHOWN = 10

_Outputs = TypeVar("_Outputs", Tensor, list[Tensor], tuple[Tensor, ...])


@dataclass
class _StepRecord:
    """What one optimizer's gradients looked like since the last ``update()``."""

    params: list[Tensor] = field(default_factory=list)
    checked: bool = False
    grad_norm: float | None = None
    scale: float = 1.0
    overflow: bool = False
    stepped: bool = False
    nonfinite: list[str] = field(default_factory=list)


def _require(condition: bool, argument: str, value: object, rule: str) -> None:
    if not condition:
        raise ValueError(f"`DynamicLossScaler({argument}={value!r})` is invalid: {argument} {rule}.")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 mixed precision, with a floor, a ceiling, hysteresis and diagnostics.

    The call pattern is ``torch.amp.GradScaler``'s: ``scale(loss).backward()``, ``unscale_(optimizer)``
    (optional, before clipping), ``step(optimizer)``, ``update()``. What it adds:

    * The scale stays within ``[min_scale, max_scale]``: it can never reach 0, inf or a denormal, so the PyTorch failure
      where 170 overflows in a row take the scale to 0, the inverse to inf and the weights to NaN cannot happen.
    * The overflow check is made on the *unscaled* gradients, in the same pass that yields the global gradient norm;
      ``clip_grad_norm_`` and :attr:`last_grad_norm` reuse that norm instead of reading the gradients again.
    * ``hysteresis`` overflows are tolerated before the scale backs off (1 behaves like GradScaler).
    * Skipped steps are counted (:attr:`skipped_steps`, :attr:`consecutive_skips`); the parameters whose gradients were
      non-finite are named on overflow steps (:attr:`last_overflow_params`), and only then, so normal steps pay nothing.
    * When ``max_consecutive_skips`` steps in a row are skipped with the scale at ``min_scale``, training cannot make
      progress: :meth:`step` raises ``FloatingPointError`` naming the parameters, the scale and the skipped steps.

    Each optimizer step costs one host sync: :meth:`unscale_` reads the gradient norm back, which decides the skip. The
    scale policy then runs on the host from that same read (no kernels, no further sync); the scale the loss is
    multiplied by is a tensor on the loss's device, written only when the policy changes it, so :meth:`update` never
    synchronises. Counters and :meth:`get_scale` are plain Python numbers: reading them is free.

    Args:
        init_scale: the initial scale.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps in a row (>= 1).
        backoff_factor: multiplies the scale on an overflow once the hysteresis is used up (in ``(0, 1]``).
        growth_interval: clean steps in a row before the scale grows.
        hysteresis: overflows tolerated before a backoff; refilled whenever the scale grows (as in Megatron-LM).
        min_scale: the floor, a normal positive float32 (default 1.0, as DeepSpeed and Megatron-LM).
        max_scale: the ceiling (default 2**24, as apex).
        max_consecutive_skips: skipped steps in a row at ``min_scale`` after which :meth:`step` raises; ``None`` never.

    Example:
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
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        max_consecutive_skips: int | None = 50,
    ) -> None:
        _require(
            _is_real(min_scale) and min_scale >= _FLOAT32.tiny,
            "min_scale",
            min_scale,
            f"must be a finite normal float32 number >= {_FLOAT32.tiny:.3g}; the default is 1.0",
        )
        _require(
            _is_real(max_scale) and min_scale <= max_scale <= _FLOAT32.max,
            "max_scale",
            max_scale,
            f"must be finite, >= min_scale ({min_scale}) and <= {_FLOAT32.max:.3g}; the default is 2**24",
        )
        _require(
            _is_real(init_scale) and min_scale <= init_scale <= max_scale,
            "init_scale",
            init_scale,
            f"must be a finite number in [min_scale, max_scale] = [{min_scale}, {max_scale}]",
        )
        _require(
            _is_real(growth_factor) and growth_factor >= 1.0,
            "growth_factor",
            growth_factor,
            "must be a finite number >= 1.0, e.g. 2.0",
        )
        _require(
            _is_real(backoff_factor) and 0.0 < backoff_factor <= 1.0,
            "backoff_factor",
            backoff_factor,
            "must be in (0, 1], e.g. 0.5",
        )
        _require(
            _is_int(growth_interval) and growth_interval >= 1,
            "growth_interval",
            growth_interval,
            "must be an int >= 1, e.g. 2000",
        )
        _require(
            _is_int(hysteresis) and hysteresis >= 1,
            "hysteresis",
            hysteresis,
            "must be an int >= 1 (1 backs off on every overflow, like GradScaler)",
        )
        _require(
            max_consecutive_skips is None or (_is_int(max_consecutive_skips) and max_consecutive_skips >= 1),
            "max_consecutive_skips",
            max_consecutive_skips,
            "must be an int >= 1, or None to never stop",
        )
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
        self.max_consecutive_skips = max_consecutive_skips
        # A scale pinned at 1 needs no multiply at all: only the check runs (the bf16 case).
        self._unit_scale = min_scale == max_scale == 1.0
        # The device copy of the scale, which `scale()` multiplies by; written only when the policy changes it.
        self._scale = torch.full((), self._policy.scale, dtype=torch.float32)
        self._records: dict[int, _StepRecord] = {}
        self._names: dict[int, str] = {}
        self._skipped_steps = 0
        self._consecutive_skips = 0
        self._floor_skips = 0
        self.last_grad_norm: float | None = None
        """The global L2 norm of the unscaled gradients at the last ``unscale_`` (before clipping; inf on overflow)."""
        self.last_overflow_params: list[str] = []
        """Names of the parameters whose gradients were non-finite at the last skipped step."""
        self.last_step_skipped = False
        """Whether the last optimizer step was skipped."""
        self.last_step_scale: float | None = None
        """The scale the last unscaled gradients had been multiplied by."""
        self.process_group: Any = None
        """Set to a ``torch.distributed`` process group to make every rank take the same skip decision: the overflow
        flag is reduced across it in the host read each step already makes (``MixedPrecisionPlugin`` sets it under
        DDP). The measured norm is then the largest of the ranks' (equal on all ranks under DDP, which averages the
        gradients in backward); :attr:`last_overflow_params` names this rank's non-finite parameters only."""

    def __repr__(self) -> str:
        c = self._policy
        return (
            f"DynamicLossScaler(init_scale={self._init_scale:g}, growth_factor={c.growth_factor:g}, "
            f"backoff_factor={c.backoff_factor:g}, growth_interval={c.growth_interval}, hysteresis={c.hysteresis}, "
            f"min_scale={c.min_scale:g}, max_scale={c.max_scale:g}, max_consecutive_skips={self.max_consecutive_skips})"
        )

    # ----------------------------------------------------------------------------------------------- configuration
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
    def skipped_steps(self) -> int:
        """Optimizer steps skipped since the start (restored from checkpoints)."""
        return self._skipped_steps

    @property
    def consecutive_skips(self) -> int:
        """Optimizer steps skipped in a row, up to now."""
        return self._consecutive_skips

    def set_parameter_names(self, named_parameters: nn.Module | Iterable[tuple[str, Tensor]]) -> None:
        """Tell the scaler what to call each parameter in diagnostics (a module or ``named_parameters()`` pairs).

        Without names, parameters are called by their place in the optimizer, e.g. ``param_groups[0][3]``.
        """
        pairs = named_parameters.named_parameters() if isinstance(named_parameters, nn.Module) else named_parameters
        self._names = {id(param): name for name, param in pairs}

    # ---------------------------------------------------------------------------------------------------- the step
    def scale(self, outputs: _Outputs) -> _Outputs:
        """Multiply a loss (or a list/tuple of losses) by the current scale, on the loss's device.

        Example:
            >>> DynamicLossScaler(init_scale=4.0).scale(torch.tensor(1.5))
            tensor(6.)
        """
        if isinstance(outputs, Tensor):
            if self._unit_scale:
                return outputs
            self._ensure_device(outputs.device)
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(item) for item in outputs)
        raise TypeError(
            f"`DynamicLossScaler.scale(outputs)` takes a tensor or a list/tuple of tensors, got {outputs!r}."
        )

    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, check them and measure their norm.

        Call it before clipping or inspecting gradients; :meth:`step` calls it if you did not. A second call before
        :meth:`update` does nothing, so the gradients are unscaled exactly once. This is the step's one host sync.
        """
        record = self._record(optimizer)
        if record.checked:
            return
        record.params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in record.params if p.grad is not None]
        if grads:
            self._ensure_device(grads[0].device)
        record.scale = self._policy.scale
        # 1 / scale rounded once to float32, as GradScaler computes it.
        inv_scale = None if self._unit_scale else f32(1.0 / record.scale)
        squared = unscale_and_measure_(grads, inv_scale, self._scale.device)
        total = squared.sum() if self.process_group is None else self._reduce_across_ranks(squared.sum())
        norm = float(total.sqrt().item())  # the step's one host sync: the skip decision
        record.checked = True
        record.grad_norm = norm
        self.last_step_scale = record.scale
        record.overflow = not math.isfinite(norm)
        self.last_grad_norm = norm
        if record.overflow:
            record.nonfinite = self._nonfinite_names(optimizer, record.params, squared)

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> float:
        """Clip the optimizer's gradients to a global L2 norm of ``max_norm``, reusing the norm ``unscale_`` measured.

        Unscales first if needed. On an overflow step nothing is multiplied (the step will be skipped).

        Returns:
            The global norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` returns it.
        """
        if not (_is_real(max_norm) and max_norm > 0):
            raise ValueError(f"`clip_grad_norm_(max_norm={max_norm!r})` must be a finite number > 0.")
        self.unscale_(optimizer)
        record = self._record(optimizer)
        assert record.grad_norm is not None
        if not record.overflow:
            clip_by_norm_([p.grad for p in record.params if p.grad is not None], record.grad_norm, float(max_norm))
        return record.grad_norm

    def grad_norm(self, optimizer: Optimizer) -> float | None:
        """The unscaled global gradient norm of ``optimizer`` this step, or ``None`` before ``unscale_``."""
        record = self._records.get(id(optimizer))
        return None if record is None else record.grad_norm

    def found_inf(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s gradients were found non-finite since the last ``update()`` (False if unchecked)."""
        record = self._records.get(id(optimizer))
        return record is not None and record.overflow

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients held inf/NaN; a skipped step leaves parameters and state untouched.

        Returns:
            What ``optimizer.step`` returned, or ``None`` when the step was skipped.

        Raises:
            FloatingPointError: ``max_consecutive_skips`` steps in a row were skipped at ``min_scale``.
        """
        if "closure" in kwargs:
            raise ValueError(
                "`DynamicLossScaler.step(optimizer, closure=...)`: closures are not supported, because the gradients "
                "must be checked before the step. Run the closure yourself, then call `step(optimizer)`."
            )
        record = self._record(optimizer)
        if record.stepped:
            raise RuntimeError(
                "`DynamicLossScaler.step()` was already called for this optimizer: call `update()` first."
            )
        self.unscale_(optimizer)
        record.stepped = True
        self.last_step_skipped = record.overflow
        if record.overflow:
            self._count_skip(record)
            return None
        self._consecutive_skips = 0
        self._floor_skips = 0
        return optimizer.step(*args, **kwargs)

    def discard(self, optimizer: Optimizer) -> None:
        """Forget what :meth:`unscale_` recorded for ``optimizer`` since the last :meth:`update`, without stepping.

        For a step that does not happen after all (in Lightning, a ``training_step`` that returned ``None``): the next
        :meth:`unscale_` of ``optimizer`` unscales and checks its gradients afresh, and :meth:`update` does not count
        the discarded check.

        Example:
            >>> w = nn.Parameter(torch.ones(1)); opt = torch.optim.SGD([w], lr=0.1)
            >>> scaler = DynamicLossScaler(init_scale=4.0)
            >>> scaler.unscale_(opt); scaler.discard(opt)
            >>> scaler.scale(w.sum()).backward(); scaler.unscale_(opt); w.grad
            tensor([1.])
        """
        self._records.pop(id(optimizer), None)

    def update(self, new_scale: float | None = None) -> None:
        """Advance the scale once for everything stepped since the last call; no host sync.

        Args:
            new_scale: set the scale to this value instead (clamped to ``[min_scale, max_scale]``).
        """
        if new_scale is not None:
            _require(_is_real(new_scale) and new_scale > 0, "new_scale", new_scale, "must be a finite number > 0")
            self._set_scale(min(max(float(new_scale), self.min_scale), self.max_scale))
        elif any(record.checked for record in self._records.values()) and not self._policy.fixed:
            before = self._policy.scale
            self._policy.update(found_inf=any(record.overflow for record in self._records.values()))
            if self._policy.scale != before:
                self._scale.fill_(self._policy.scale)  # no host sync: a host value written to the device
        self._records.clear()

    def get_scale(self) -> float:
        """The current scale as a Python float (no device read)."""
        return self._policy.scale

    # ---------------------------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: plain Python numbers only, a superset of ``torch.amp.GradScaler``'s keys."""
        return {
            "scale": self.get_scale(),
            "growth_factor": self._policy.growth_factor,
            "backoff_factor": self._policy.backoff_factor,
            "growth_interval": self._policy.growth_interval,
            "_growth_tracker": self._policy.growth_tracker,
            "hysteresis": self._policy.hysteresis,
            "_hysteresis_tracker": self._policy.hysteresis_tracker,
            "min_scale": self._policy.min_scale,
            "max_scale": self._policy.max_scale,
            "max_consecutive_skips": self.max_consecutive_skips,
            "skipped_steps": self._skipped_steps,
            "consecutive_skips": self._consecutive_skips,
            "_floor_skips": self._floor_skips,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`, or by ``torch.amp.GradScaler.state_dict()`` (to migrate).

        The dynamic state (scale, trackers, skip counters) is restored. The hyperparameters this scaler was built with
        stay in force; if the saved ones differ, a warning says which.

        Raises:
            TypeError: the state is not a mapping, or a value has the wrong type.
            ValueError: a key is missing or a value is out of range.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"`DynamicLossScaler.load_state_dict` expects a dict, got {type(state_dict).__name__}.")
        if "scale" not in state_dict:
            raise ValueError(
                "The scaler state has no 'scale' key (keys: "
                f"{sorted(map(str, state_dict))}): it is not a DynamicLossScaler or torch.amp.GradScaler state."
            )
        scale = _number(state_dict, "scale", float)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"The scaler state holds scale={scale!r}; a loss scale must be finite and > 0.")
        if not self.min_scale <= scale <= self.max_scale:
            warnings.warn(
                f"The saved loss scale {scale:g} is outside [min_scale, max_scale] = [{self.min_scale:g}, "
                f"{self.max_scale:g}]; it is clamped to that range.",
                stacklevel=2,
            )
            scale = min(max(scale, self.min_scale), self.max_scale)
        self._set_scale(scale)
        self._policy.growth_tracker = _count(state_dict, "_growth_tracker", 0)
        self._policy.hysteresis_tracker = _count(state_dict, "_hysteresis_tracker", self.hysteresis)
        self._skipped_steps = _count(state_dict, "skipped_steps", 0)
        self._consecutive_skips = _count(state_dict, "consecutive_skips", 0)
        self._floor_skips = _count(state_dict, "_floor_skips", 0)
        mine = {key: value for key, value in self.state_dict().items() if key in _HYPERPARAMETERS}
        differing = {key: state_dict[key] for key in mine if key in state_dict and state_dict[key] != mine[key]}
        if differing:
            warnings.warn(
                f"The saved scaler was built with {differing}; this one keeps its own "
                f"{ {key: mine[key] for key in differing} }.",
                stacklevel=2,
            )

    # ---------------------------------------------------------------------------------------------------- private
    def _reduce_across_ranks(self, squared_total: Tensor) -> Tensor:
        # MAX of the squared norms, with NaN first turned into inf (MAX with NaN is not defined the same way by every
        # backend): any rank's overflow becomes every rank's, and equal norms stay themselves.
        flag = torch.where(torch.isfinite(squared_total), squared_total, torch.full_like(squared_total, math.inf))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
        return flag

    def _record(self, optimizer: Optimizer) -> _StepRecord:
        return self._records.setdefault(id(optimizer), _StepRecord())

    def _ensure_device(self, device: torch.device) -> None:
        if self._scale.device != device:
            self._scale = self._scale.to(device)

    def _set_scale(self, value: float) -> None:
        self._policy.scale = f32(value)
        self._scale.fill_(self._policy.scale)

    def _nonfinite_names(self, optimizer: Optimizer, params: list[Tensor], squared: Tensor) -> list[str]:
        bad = set(torch.nonzero(~torch.isfinite(squared)).flatten().tolist())
        places = {
            id(p): f"param_groups[{g}][{i}]"
            for g, grp in enumerate(optimizer.param_groups)
            for i, p in enumerate(grp["params"])
        }
        return [self._names.get(id(p), places[id(p)]) for index, p in enumerate(params) if index in bad]

    def _count_skip(self, record: _StepRecord) -> None:
        self._skipped_steps += 1
        self._consecutive_skips += 1
        self.last_overflow_params = record.nonfinite
        if record.scale <= self.min_scale:
            self._floor_skips += 1
        if self.max_consecutive_skips is not None and self._floor_skips >= self.max_consecutive_skips:
            raise FloatingPointError(self._diagnosis(record))

    def _diagnosis(self, record: _StepRecord) -> str:
        names = record.nonfinite
        if names:
            shown = ", ".join(names[:_NAMES_SHOWN]) + (
                f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
            )
            where = f"non-finite gradients in {len(names)} parameter(s): {shown}"
        else:
            where = "no single gradient is non-finite, but their global L2 norm overflows float32"
        if self._unit_scale:
            what = f"{self._floor_skips} optimizer steps in a row were skipped for non-finite gradients"
        else:
            what = (
                f"{self._floor_skips} optimizer steps in a row were skipped with the loss scale at its floor "
                f"(scale={record.scale:g}, min_scale={self.min_scale:g})"
            )
        return (
            f"Training cannot make progress: {what} ({self._skipped_steps} skipped in all); {where}. "
            "The model produces inf/NaN gradients even without loss scaling. Try: check the inputs and the loss for "
            "inf/NaN, lower the learning rate, clip gradients, train in 'bf16-mixed', or lower `min_scale`. "
            f"To keep going anyway, raise `max_consecutive_skips` (now {self.max_consecutive_skips}) or set it to None."
        )


def _number(state: Mapping[str, Any], key: str, kind: type[int] | type[float], default: float | None = None) -> Any:
    """Read ``state[key]`` as an int or float (a 0-d tensor is accepted, as some GradScaler states hold)."""
    if key not in state:
        if default is None:
            raise ValueError(f"The scaler state has no {key!r} key.")
        return kind(default)
    value = state[key]
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    valid = _is_int(value) if kind is int else isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not valid:
        expected = "an int" if kind is int else "a number"
        raise TypeError(f"The scaler state holds {key}={value!r} ({type(value).__name__}); expected {expected}.")
    return kind(value)


def _count(state: Mapping[str, Any], key: str, default: int) -> int:
    """Read a tracker or counter: an int >= 0 (a negative one would, e.g., postpone the max_consecutive_skips stop)."""
    value: int = _number(state, key, int, default)
    if value < 0:
        raise ValueError(f"The scaler state holds {key}={value}; counters and trackers must be >= 0.")
    return value
