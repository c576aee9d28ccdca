"""``DynamicLossScaler``: dynamic loss scaling written from scratch, usable with or without Lightning.

The scale policy lives in :mod:`~.policy` (host) and :mod:`~.device_policy` (device), the passes over gradients in
:mod:`~.grads`, the per-step record and its lazy public view in :mod:`~.outcome` (all in
``lightning_amp_plus.numerics``); this module ties them to optimizers with ``torch.amp.GradScaler``'s API.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_amp_plus.numerics.checks import (
    TRACKER_MAX,
    is_int,
    read_count,
    read_number,
    real,
    require,
    show,
)
from lightning_amp_plus.numerics.device_policy import DevicePolicy
from lightning_amp_plus.numerics.float32 import f32
from lightning_amp_plus.numerics.grads import clip_by_norm_, measure, unscale_and_measure_
from lightning_amp_plus.numerics.outcome import StepOutcome, StepRecord
from lightning_amp_plus.numerics.policy import ScalePolicy
from lightning_amp_plus.numerics.sharding import Sharding, local_views

__all__ = ["DynamicLossScaler", "StepOutcome"]

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
# Backoff factors this close to 1 round to no backoff at all in float32 (f32(s * b) == s).
_BACKOFF_MAX = 1.0 - 2.0**-22
# Fused-path steps whose flags may wait unread on the device, when no skip limit asks for them sooner.
_PENDING_MAX = 256
# Devices where the policy can run on the device (it needs float64).
_DEVICE_POLICY_TYPES = ("cpu", "cuda")

_TAKES_GRAD_SCALER: dict[type, bool] = {}


@dataclass(eq=False)
class _Update:
    """An ``update()`` whose overflow flag was on the device: the records it combined."""

    records: list[StepRecord]


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 mixed precision, with a floor, a ceiling, hysteresis and diagnostics.

    A drop-in for ``torch.amp.GradScaler``: the same constructor (``DynamicLossScaler("cuda", init_scale=1024)``,
    ``enabled=False``), the same calls (``scale(loss).backward()``, ``unscale_(optimizer)`` before clipping,
    ``step(optimizer)``, ``update()``), accessors and state keys. What it adds:

    * The scale stays within ``[min_scale, max_scale]``: it can never reach 0, inf or a denormal, so the PyTorch failure
      where 170 overflows in a row take the scale to 0, the inverse to inf and the weights to NaN cannot happen.
    * The overflow check is made on the *unscaled* gradients, in the same pass that yields the global gradient norm;
      ``clip_grad_norm_`` and :attr:`last_grad_norm` reuse that norm instead of reading the gradients again.
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

    **Two paths.** An optimizer with PyTorch's fused protocol (``Adam``/``AdamW``/``SGD``/``Adagrad(fused=True)``,
    ``optimizer._step_supports_amp_scaling``) stepped without a prior :meth:`unscale_` takes the *fused path*: one
    read-only pass measures the still-scaled gradients, the scale and the overflow flag go to the optimizer as
    ``optimizer.grad_scale`` / ``optimizer.found_inf`` (its kernel divides and skips on the device), and the scale
    policy advances on the device too: no host sync in the step. The flags are read back later, together (every
    ``max_consecutive_skips - skips so far`` steps, or when a counter, :meth:`get_scale`, :meth:`found_inf` or an
    :class:`StepOutcome` field is read), so counters are exact whenever they are read. Otherwise (clipping, any other
    optimizer) the *unscale path*: :meth:`unscale_` multiplies, checks and measures in one pass and reads the norm
    back, the step's one host sync; the policy runs on the host from that read, and the device copy of the scale is
    written only when the policy changes it, so :meth:`update` never synchronises.

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
        self.max_consecutive_skips = max_consecutive_skips
        # A scale pinned at 1 needs no multiply at all: only the check runs (the bf16 case).
        self._unit_scale = min_scale == max_scale == 1.0
        # The device copy of the scale, which `scale()` multiplies by. On the unscale path it is written only when the
        # host policy changes the scale; on the fused path the device policy advances it.
        self._scale = torch.full((), self._policy.scale, dtype=torch.float32)
        self._placed = False
        self._device_policy: DevicePolicy | None = None
        self._device_policy_current = False
        self._constants: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self._ring: Tensor | None = None
        self._records: dict[int, StepRecord] = {}
        self._outcomes: dict[int, StepOutcome] = {}
        # Fused-path steps and updates the host has not replayed yet, in order; counters are as of before them.
        self._pending: list[StepRecord | _Update] = []
        self._unread = 0
        self._stop: str | None = None
        self._names: dict[int, str] = {}
        self._skipped_steps = 0
        self._consecutive_skips = 0
        self._stuck_skips = 0
        self._last_grad_norm: float | None = None
        self._last_overflow: StepRecord | None = None
        self._last_step_skipped = False
        self._last_step_scale: float | None = None
        self.process_group: Any = None
        """Set to a ``torch.distributed`` process group to make every rank take the same skip decision: the overflow
        flag (the norm, NaN turned into inf) is reduced with MAX across it, in the host read the unscale path makes
        and on the device on the fused path (``MixedPrecisionPlugin`` sets it under DDP). The measured norm is then
        the largest of the ranks' (equal on all ranks under DDP, which averages the gradients in backward);
        :attr:`last_overflow_params` names this rank's non-finite parameters only."""
        self.sharding: Sharding | None = None
        """Set when the gradients are sharded across ranks (FSDP, FSDP2: ``MixedPrecisionPlugin`` sets it): each rank
        measures its local shards, and one SUM all-reduce of the weighted local squared norms gives the global norm
        and the overflow flag on every rank (see :mod:`lightning_amp_plus.numerics.sharding`). It replaces the MAX
        reduction of :attr:`process_group`."""

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

        Example:
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
    def max_consecutive_skips(self) -> int | None:
        """Skipped steps in a row that backing off could not help after which :meth:`step` raises (``None``: never)."""
        return self._max_consecutive_skips

    @max_consecutive_skips.setter
    def max_consecutive_skips(self, value: int | None) -> None:
        require(
            value is None or (is_int(value) and value >= 1),
            "max_consecutive_skips",
            value,
            "must be an int >= 1, or None to never stop",
        )
        self._max_consecutive_skips = None if value is None else int(value)

    @property
    def max_skips_in_a_row(self) -> int | None:
        """The most optimizer steps in a row that can be skipped before ``FloatingPointError`` (``None``: no limit).

        ``max_consecutive_skips`` plus the backoffs from ``max_scale`` to ``min_scale`` (each skip either lowers the
        scale, at most that many times, or counts towards the limit), for one optimizer stepped per ``update()``.

        Example:
            >>> DynamicLossScaler().max_skips_in_a_row, DynamicLossScaler(backoff_factor=1.0).max_skips_in_a_row
            (74, 50)
        """
        limit = self.max_consecutive_skips
        return None if limit is None else limit + self._policy.backoffs_to_floor()

    # -------------------------------------------------------------------------------------------------- counters
    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped since the start (restored from checkpoints)."""
        self._resolve()
        return self._skipped_steps

    @property
    def consecutive_skips(self) -> int:
        """Optimizer steps skipped in a row, up to now."""
        self._resolve()
        return self._consecutive_skips

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped."""
        self._resolve()
        return self._last_step_skipped

    @property
    def last_grad_norm(self) -> float | None:
        """The global L2 norm of the unscaled gradients at the last check (before clipping; inf on overflow).

        Taken by :meth:`unscale_` on the unscale path and by the read-only pass on the fused path (there the norm of
        the scaled gradients divided by the scale).
        """
        self._resolve()
        return self._last_grad_norm

    @property
    def last_step_scale(self) -> float | None:
        """The scale the last checked gradients had been multiplied by."""
        self._resolve()
        return self._last_step_scale

    @property
    def last_overflow_params(self) -> list[str]:
        """Names of the parameters whose gradients were non-finite at the last skipped step."""
        self._resolve()
        return [] if self._last_overflow is None else list(self._last_overflow.names())

    def set_parameter_names(self, named_parameters: nn.Module | Iterable[tuple[str, Tensor]]) -> None:
        """Tell the scaler what to call each parameter in diagnostics (a module or ``named_parameters()`` pairs).

        Without names, parameters are called by their place in the optimizer, e.g. ``param_groups[0][3]``.
        """
        pairs = named_parameters.named_parameters() if isinstance(named_parameters, nn.Module) else named_parameters
        self._names = {id(param): name for name, param in pairs}

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

        Example:
            >>> DynamicLossScaler(init_scale=4.0).scale(torch.tensor(1.5))
            tensor(6.)
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            if self._unit_scale:
                return outputs
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

    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, check them and measure their norm.

        Call it before clipping or inspecting gradients; :meth:`step` calls it if you did not (for an optimizer
        without the fused protocol). A second call before :meth:`update` does nothing, so the gradients are unscaled
        exactly once. This is the step's one host sync. Sparse gradients are unscaled in place (fp16 ones coalesced
        first, replacing ``.grad``, as GradScaler does).
        """
        if not self._enabled:
            return
        record = self._record(optimizer)
        if record.stepped:
            raise RuntimeError("`DynamicLossScaler.unscale_()` was called after `step()`: call `update()` first.")
        if not record.checked:
            self._unscale(optimizer, record, _params_with_grads(optimizer))

    def _unscale(self, optimizer: Optimizer, record: StepRecord, params: list[Tensor]) -> None:
        """:meth:`unscale_` of ``params``, the optimizer's parameters with gradients (gathered once by the caller)."""
        # The host policy must be current for the inverse scale: read any fused-path flags first (only when the two
        # paths mix, e.g. clipping on some steps only).
        self._resolve()
        record.params = params
        grads = [p.grad for p in record.params if p.grad is not None]
        if grads:
            self._place(grads[0].device)
        record.scale = self._policy.scale
        # 1 / scale rounded once to float32, as GradScaler computes it.
        inv_scale = None if self._unit_scale else f32(1.0 / record.scale)
        with torch.no_grad():
            squared = unscale_and_measure_(self._local(grads), inv_scale, self._scale.device)
            total = self._total(squared, grads)
            # The step's one host sync: the skip decision. The square root of a float32 taken in float64 and rounded
            # once is the float32 square root (correctly rounded either way), without another tensor op.
            norm = f32(math.sqrt(total.item()))
        record.checked = True
        record.grad_norm = norm
        record.overflow = not math.isfinite(norm)
        record.nonfinite = self._nonfinite_names(optimizer, record.params, squared) if record.overflow else []
        self._last_step_scale = record.scale
        self._last_grad_norm = norm

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> float:
        """Clip the optimizer's gradients to a global L2 norm of ``max_norm``, reusing the norm ``unscale_`` measured.

        Unscales first if needed. On an overflow step nothing is multiplied (the step will be skipped). With
        ``enabled=False``, ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters.

        Returns:
            The global norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` returns it.
        """
        limit = real(max_norm)
        if limit is None or limit <= 0:
            raise ValueError(f"`clip_grad_norm_(max_norm={show(max_norm)})` must be a finite number > 0.")
        if not self._enabled:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            return float(torch.nn.utils.clip_grad_norm_(params, limit))
        self.unscale_(optimizer)
        record = self._record(optimizer)
        assert record.grad_norm is not None
        if not record.overflow:
            clip_by_norm_(self._local([p.grad for p in record.params if p.grad is not None]), record.grad_norm, limit)
        return record.grad_norm

    def grad_norm(self, optimizer: Optimizer) -> float | None:
        """The unscaled global gradient norm of ``optimizer`` this step, or ``None`` before it was measured."""
        record = self._records.get(id(optimizer))
        if record is not None and record.stepped and record.overflow is None:
            self._resolve()
        return None if record is None else record.grad_norm

    def found_inf(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s gradients were found non-finite since the last ``update()`` (False if unchecked).

        On the fused path this reads the pending flags (see :class:`StepOutcome`); use :meth:`outcome` to ask later.
        """
        record = self._records.get(id(optimizer))
        if record is None:
            return False
        if record.stepped and record.overflow is None:
            self._resolve()
        return bool(record.overflow)

    def uses_fused_path(self, optimizer: Optimizer) -> bool:
        """Whether :meth:`step` would now take the fused path for ``optimizer``: no host sync, the optimizer unscales.

        That is, with its gradients as they are and no :meth:`unscale_` yet this iteration, the optimizer would unscale
        and skip inside its own kernel. On the fused path the gradients stay scaled in memory until that kernel: code
        that must see them unscaled (a hook, clipping) calls :meth:`unscale_` first, which makes the step take the
        unscale path.

        Example:
            >>> w = nn.Parameter(torch.ones(2)); w.grad = torch.ones(2)
            >>> scaler = DynamicLossScaler()
            >>> fused, foreach = torch.optim.AdamW([w], fused=True), torch.optim.AdamW([w])
            >>> scaler.uses_fused_path(fused), scaler.uses_fused_path(foreach)
            (True, False)
        """
        record = self._records.get(id(optimizer))
        if not self._enabled or (record is not None and (record.checked or record.stepped)):
            return False
        return self._takes_fused_path(optimizer, _params_with_grads(optimizer))

    def outcome(self, optimizer: Optimizer) -> StepOutcome | None:
        """The :class:`StepOutcome` of ``optimizer``'s latest :meth:`step` (``None`` before its first).

        It stays valid after :meth:`update`; on the fused path its fields resolve on first access.
        """
        return self._outcomes.get(id(optimizer))

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients held inf/NaN; a skipped step leaves parameters and state untouched.

        Fused optimizers (``_step_supports_amp_scaling``) stepped without a prior :meth:`unscale_` get the scale and
        the overflow flag as ``optimizer.grad_scale`` / ``optimizer.found_inf`` and skip on the device (see the class
        docstring); :meth:`outcome` tells later whether the step was skipped. The unscale path skips on the host.

        Returns:
            What ``optimizer.step`` returned, or ``None`` when the step was skipped on the host.

        Raises:
            FloatingPointError: the skip limit was reached (on the fused path also from :meth:`update`).
        """
        if not self._enabled:
            self._outcomes[id(optimizer)] = StepOutcome(StepRecord(overflow=False, scale=1.0), self._resolve)
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or args:
            raise ValueError(
                "`DynamicLossScaler.step(optimizer, closure=...)`: closures are not supported, because the gradients "
                "must be checked before the step. Run the closure yourself, then call `step(optimizer)`."
            )
        record = self._record(optimizer)
        if record.stepped:
            raise RuntimeError(
                "`DynamicLossScaler.step()` was already called for this optimizer: call `update()` first."
            )
        if not record.checked:
            params = _params_with_grads(optimizer)
            if self._takes_fused_path(optimizer, params):
                self._raise_stop()
                record.params = params
                return self._step_fused(optimizer, record, kwargs)
            self._unscale(optimizer, record, params)
        self._raise_stop()
        record.stepped = True
        self._outcomes[id(optimizer)] = StepOutcome(record, self._resolve)
        diagnosis = self._settle(record)
        if diagnosis is not None:
            # The iteration ends here: an update() after a caught error does not advance the policy for it (as on the
            # fused path, which learns of the limit in update()).
            del self._records[id(optimizer)]
            raise FloatingPointError(diagnosis)
        if record.overflow:
            return None
        return optimizer.step(**kwargs)

    def discard(self, optimizer: Optimizer) -> None:
        """Forget what :meth:`unscale_` recorded for ``optimizer`` since the last :meth:`update`, without stepping.

        For a step that does not happen after all (in Lightning, a ``training_step`` that returned ``None``): the next
        :meth:`unscale_` of ``optimizer`` unscales and checks its gradients afresh, and :meth:`update` does not count
        the discarded check. A step already taken is not forgotten.

        Example:
            >>> w = nn.Parameter(torch.ones(1)); opt = torch.optim.SGD([w], lr=0.1)
            >>> scaler = DynamicLossScaler(init_scale=4.0)
            >>> scaler.unscale_(opt); scaler.discard(opt)
            >>> scaler.scale(w.sum()).backward(); scaler.unscale_(opt); w.grad
            tensor([1.])
        """
        record = self._records.get(id(optimizer))
        if record is not None and not record.stepped:
            del self._records[id(optimizer)]

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
        records = [record for record in self._records.values() if record.checked or record.stepped]
        self._records = {}
        self._raise_stop()  # a limit a lazy read found since step(): this iteration's update does not happen
        if new_scale is not None:
            value = _new_scale_value(new_scale)
            self._resolve()
            self._set_scale(min(max(value, self.min_scale), self.max_scale))
            return
        if not records:
            return
        if not self._pending and all(record.overflow is not None for record in records):
            self._update_on_host(any(bool(record.overflow) for record in records))
            return
        self._pending.append(_Update(records))
        if self._due():
            self._resolve()
            self._raise_stop()
        elif not self._policy.fixed:
            self._update_on_device(records)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled).

        Free on the unscale path; on the fused path it first reads the pending flags (one host read).
        """
        if not self._enabled:
            return 1.0
        self._resolve()
        return self._policy.scale

    # ---------------------------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: plain Python numbers only, a superset of ``torch.amp.GradScaler``'s keys.

        ``{}`` when disabled, as GradScaler's.
        """
        if not self._enabled:
            return {}
        self._resolve()
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
            "skipped_steps": self._skipped_steps,
            "consecutive_skips": self._consecutive_skips,
            # Skips in a row that backing off could not help (the name dates from when only skips at the floor did).
            "_floor_skips": self._stuck_skips,
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
        self._pending, self._unread, self._records, self._stop = [], 0, {}, None
        self._set_scale(scale)
        # A tracker at or past its end acts as the end: g >= interval - 1 grows at the next clean step either way.
        self._policy.growth_tracker = min(counters["_growth_tracker"], self.growth_interval - 1)
        self._policy.hysteresis_tracker = min(counters["_hysteresis_tracker"], self.hysteresis)
        self._skipped_steps = counters["skipped_steps"]
        self._consecutive_skips = counters["consecutive_skips"]
        self._stuck_skips = counters["_floor_skips"]
        self._warn_if_hyperparameters_differ(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle between iterations only (as GradScaler): device tensors and references to parameters are dropped."""
        if self._enabled:
            self._resolve()
            if self._records:
                raise RuntimeError(
                    "A DynamicLossScaler can be pickled only between iterations: before `scale()` or after `update()`."
                )
        state = self.__dict__.copy()
        if self._last_overflow is not None:
            names = self._last_overflow.names()
            state["_last_overflow"] = StepRecord(overflow=True, nonfinite=list(names))
        # Parameter ids, outcomes (which hold parameters) and device tensors do not mean anything in another process.
        for key in ("_names", "_outcomes", "_constants"):
            state[key] = {}
        for key in ("_scale", "_device_policy", "_ring"):
            state[key] = None
        state["_device_policy_current"] = state["_placed"] = False
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._scale = torch.full((), self._policy.scale, dtype=torch.float32)

    # ----------------------------------------------------------------------------------------- the two step paths
    def _takes_fused_path(self, optimizer: Optimizer, params: list[Tensor]) -> bool:
        """Whether ``optimizer`` can unscale and skip inside its own kernel, safely, this step."""
        inner = _innermost(optimizer)
        if not getattr(inner, "_step_supports_amp_scaling", False) or _takes_grad_scaler(inner):
            return False
        if not params or any(p.grad is None or p.grad.is_sparse for p in params):
            return False
        if params[0].device.type not in _DEVICE_POLICY_TYPES:
            return False
        # torch's fused SGD with momentum creates its buffers uninitialised on its first step and keeps them even when
        # found_inf skips it: that first step takes the unscale path (skipped on the host, no buffers made).
        return not _sgd_buffers_missing(optimizer)

    def _step_fused(self, optimizer: Optimizer, record: StepRecord, kwargs: dict[str, Any]) -> Any:
        grads = [p.grad for p in record.params if p.grad is not None]
        self._place(grads[0].device)
        zero, one = self._flag_constants(self._scale.device)
        with torch.no_grad():
            norms = measure(self._local(grads), self._scale.device)
            if self.sharding is not None:
                total = self._total(norms.square(), grads).sqrt()
            else:
                total = torch.linalg.vector_norm(norms)
                if self.process_group is not None:
                    total = self._reduce_across_ranks(total)
            # Exactly 1.0 or 0.0: the CPU kernels skip only on found_inf == 1.0.
            flag = torch.where(torch.isfinite(total), zero, one)
        record.flag, record.total, record.norms, record.stepped = flag, total, norms, True
        record.namer = lambda r: self._nonfinite_names(optimizer, r.params, r.norms)
        self._copy_to_host(record)
        self._pending.append(record)
        self._unread += 1
        self._outcomes[id(optimizer)] = StepOutcome(record, self._resolve)
        # As GradScaler: a grad_scale the user set is multiplied in; both attributes are removed after the step. They
        # go on the optimizer that runs the kernel: a wrapper (Lightning's LightningOptimizer) would keep them itself.
        inner = _innermost(optimizer)
        user_scale = getattr(inner, "grad_scale", None)
        scale = self._scale if user_scale is None else self._scale * user_scale
        inner.grad_scale = user_scale if self._unit_scale else scale  # type: ignore[attr-defined]
        inner.found_inf = flag  # type: ignore[attr-defined]
        try:
            return optimizer.step(**kwargs)
        finally:
            del inner.grad_scale  # type: ignore[attr-defined]
            del inner.found_inf  # type: ignore[attr-defined]

    def _copy_to_host(self, record: StepRecord) -> None:
        """On CUDA: start copying the step's flag and norm to pinned memory, so a later read waits for nothing else."""
        assert record.flag is not None and record.total is not None
        if record.flag.device.type != "cuda":
            return
        if self._ring is None:
            self._ring = torch.empty(_PENDING_MAX + 16, 2, dtype=torch.float32, pin_memory=True)
        slot = self._unread
        if slot >= len(self._ring):
            return  # read the slow way
        self._ring[slot].copy_(torch.stack([record.flag, record.total]), non_blocking=True)
        record.slot, record.event = slot, torch.cuda.Event()  # type: ignore[no-untyped-call]
        record.event.record()

    def _update_on_host(self, found_inf: bool) -> None:
        if self._policy.fixed:
            return
        before = self._policy.scale
        self._policy.update(found_inf=found_inf)
        self._device_policy_current = False
        if self._policy.scale != before:
            self._scale.fill_(self._policy.scale)  # no host sync: a host value written to the device

    def _update_on_device(self, records: list[StepRecord]) -> None:
        flags = [record.flag for record in records if record.overflow is None and record.flag is not None]
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

    # ---------------------------------------------------------------------------------- reading the device lazily
    def _due(self) -> bool:
        """Whether the pending flags must be read now: the skip limit could be reached at this step."""
        limit = self.max_consecutive_skips
        if self._unread >= _PENDING_MAX:
            return True
        return limit is not None and self._unread >= limit - self._stuck_skips

    def _resolve(self) -> None:
        """Read every pending flag (one host read) and replay the policy and the counters on the host, in order."""
        if not self._pending:
            return
        self._read_flags()
        pending, self._pending, self._unread = self._pending, [], 0
        for event in pending:
            if isinstance(event, _Update):
                if self._stop is None and not self._policy.fixed:
                    self._policy.update(any(bool(record.overflow) for record in event.records))
                continue
            # The host policy is now where the device policy was when this step ran.
            event.scale = self._policy.scale
            scaled = event.scaled_norm if event.scaled_norm is not None else math.nan
            event.grad_norm = scaled if self._unit_scale else f32(scaled * f32(1.0 / event.scale))
            if self._stop is None:  # after the limit is reached nothing more is counted, as on the unscale path
                self._last_step_scale, self._last_grad_norm = event.scale, event.grad_norm
                self._stop = self._settle(event)
        # The device copies follow the host: it replayed the same steps (or stopped at the limit, or replayed one
        # update the device has not run yet).
        self._scale.fill_(self._policy.scale)
        self._device_policy_current = False

    def _read_flags(self) -> None:
        unread = [event for event in self._pending if isinstance(event, StepRecord) and event.overflow is None]
        if not unread:
            return
        ringed = [record for record in unread if record.event is not None]
        if ringed and self._ring is not None:
            last = ringed[-1].event
            assert last is not None
            last.synchronize()  # waits until the last check has run, not for the optimizer kernels after it
            rows = self._ring[: max(record.slot or 0 for record in ringed) + 1].tolist()
            for record in ringed:
                assert record.slot is not None
                record.overflow, record.scaled_norm = rows[record.slot][0] != 0.0, rows[record.slot][1]
        rest = [record for record in unread if record.event is None]
        if rest:
            values = torch.stack([t for r in rest for t in (r.flag, r.total) if t is not None]).tolist()
            for index, record in enumerate(rest):
                record.overflow, record.scaled_norm = values[2 * index] != 0.0, values[2 * index + 1]
        for record in unread:
            record.flag, record.total, record.event, record.slot = None, None, None, None
            if not record.overflow:
                record.norms, record.nonfinite = None, []

    def _settle(self, record: StepRecord) -> str | None:
        """Count a step whose outcome is known, in order; return the diagnosis if it reaches the skip limit."""
        self._last_step_skipped = bool(record.overflow)
        if not record.overflow:
            self._consecutive_skips = 0
            self._stuck_skips = 0
            return None
        self._skipped_steps += 1
        self._consecutive_skips += 1
        self._last_overflow = record
        if not self._policy.backs_off_on_overflow():
            self._stuck_skips += 1
        limit = self.max_consecutive_skips
        if limit is not None and self._stuck_skips >= limit:
            return self._diagnosis(record)
        return None

    def _raise_stop(self) -> None:
        if self._stop is not None:
            diagnosis, self._stop = self._stop, None
            raise FloatingPointError(diagnosis)

    # ---------------------------------------------------------------------------------------------------- private
    def _reconfigure(self, **constants: Any) -> None:
        self._resolve()
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

    def _local(self, grads: list[Tensor]) -> list[Tensor]:
        """The gradients to measure and change in place: this rank's shards when sharded, else the gradients."""
        return grads if self.sharding is None else local_views(grads)

    def _total(self, squared: Tensor, grads: list[Tensor]) -> Tensor:
        """The squared global norm from the per-gradient squared norms: summed here, then across ranks if need be."""
        if self.sharding is not None:
            weighted = (squared * self.sharding.weights(grads, squared.device)).sum()
            return self.sharding.all_reduce_(weighted)
        return squared.sum() if self.process_group is None else self._reduce_across_ranks(squared.sum())

    def _reduce_across_ranks(self, total: Tensor) -> Tensor:
        # MAX of the norms, with NaN first turned into inf (MAX with NaN is not defined the same way by every
        # backend): any rank's overflow becomes every rank's, and equal norms stay themselves.
        flag = torch.where(torch.isfinite(total), total, torch.full_like(total, math.inf))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
        return flag

    def _flag_constants(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._constants:
            self._constants[device] = (
                torch.zeros((), dtype=torch.float32, device=device),
                torch.ones((), dtype=torch.float32, device=device),
            )
        return self._constants[device]

    def _record(self, optimizer: Optimizer) -> StepRecord:
        return self._records.setdefault(id(optimizer), StepRecord())

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

    def _nonfinite_names(self, optimizer: Optimizer, params: list[Tensor], norms: Tensor | None) -> list[str]:
        if norms is None:
            return []
        bad = set(torch.nonzero(~torch.isfinite(norms)).flatten().tolist())
        places = {
            id(p): f"param_groups[{g}][{i}]"
            for g, grp in enumerate(optimizer.param_groups)
            for i, p in enumerate(grp["params"])
        }
        return [self._names.get(id(p), places.get(id(p), "?")) for index, p in enumerate(params) if index in bad]

    def _diagnosis(self, record: StepRecord) -> str:
        names = record.names()
        if names:
            shown = ", ".join(names[:_NAMES_SHOWN]) + (
                f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
            )
            where = f"non-finite gradients in {len(names)} parameter(s): {shown}"
        else:
            where = "no single gradient is non-finite, but their global L2 norm overflows float32"
        scale = record.scale if record.scale is not None else self._policy.scale
        skipped = f"{self._stuck_skips} optimizer steps in a row were skipped"
        if self._unit_scale:
            what, why = f"{skipped} for non-finite gradients", "The model produces inf/NaN gradients."
            fix = "check the inputs and the loss for inf/NaN, lower the learning rate, or clip gradients"
        elif scale <= self.min_scale:
            what = f"{skipped} with the loss scale at its floor (scale={scale:g}, min_scale={self.min_scale:g})"
            why = "The model produces inf/NaN gradients even at the smallest loss scale allowed."
            fix = (
                "check the inputs and the loss for inf/NaN, lower the learning rate, clip gradients, train in "
                "'bf16-mixed', or lower `min_scale`"
            )
        else:
            what = (
                f"{skipped} without the loss scale coming down (scale={scale:g}, "
                f"backoff_factor={self._policy.backoff_factor:g}, hysteresis={self.hysteresis})"
            )
            why = "The scale cannot back off to where the gradients fit: the hysteresis or the backoff factor hold it."
            fix = "lower `hysteresis`, use a `backoff_factor` below 1 (e.g. 0.5), or a lower `init_scale`"
        return (
            f"Training cannot make progress: {what} ({self._skipped_steps} skipped in all); {where}. {why} Try: {fix}. "
            f"To keep going anyway, raise `max_consecutive_skips` (now {self.max_consecutive_skips}) or set it to None."
        )


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


def _params_with_grads(optimizer: Optimizer) -> list[Tensor]:
    params = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse and param.grad.dtype == torch.float16:
                # As GradScaler: duplicates of scaled fp16 values may overflow when summed, so check them summed.
                param.grad = param.grad.coalesce()
            params.append(param)
    return params


def _innermost(optimizer: Optimizer) -> Optimizer:
    """The optimizer inside wrappers that expose it as ``.optimizer`` (as Lightning's ``LightningOptimizer`` does)."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def _takes_grad_scaler(optimizer: Optimizer) -> bool:
    """Optimizers of GradScaler's old protocol (``step(grad_scaler=...)``) expect GradScaler itself: not fused here."""
    kind = type(optimizer)
    if kind not in _TAKES_GRAD_SCALER:
        _TAKES_GRAD_SCALER[kind] = "grad_scaler" in inspect.signature(optimizer.step).parameters
    return _TAKES_GRAD_SCALER[kind]


def _sgd_buffers_missing(optimizer: Optimizer) -> bool:
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    state = optimizer.state
    return any(
        group["momentum"] != 0 and param.grad is not None and state.get(param, {}).get("momentum_buffer") is None
        for group in optimizer.param_groups
        for param in group["params"]
    )
