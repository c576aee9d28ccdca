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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_amp_plus._checks import check_int, check_real, show
from lightning_amp_plus.diagnostics.formats import Format, format_of
from lightning_amp_plus.diagnostics.replay import (
    AutocastProbe,
    Context,
    RngState,
    all_finite,
    device_type,
    floating_tensors,
    replay,
    untouched,
)

__all__ = ["AbsRange", "Autopsy", "Kind", "ModuleStats", "run_autopsy"]

Kind = Literal["forward", "scale", "backward"]


@dataclass(frozen=True)
class AbsRange:
    """The magnitudes of some tensors' values.

    Attributes:
        abs_min: the smallest non-zero ``|x|`` (0.0 when every value is zero; inf when no value is finite and
            non-zero, NaNs aside): how close the values come to underflow.
        abs_max: the largest ``|x|``; ``inf`` or ``nan`` when the values hold them.
        nonfinite: how many values are inf or NaN (exact up to 2**24).
        neg_inf: how many of those are -inf, what attention masks hold.

    Examples:
        >>> AbsRange.of([_summary(torch.tensor([0.0, -3.0, 0.5, float("inf"), -float("inf")]))])
        AbsRange(abs_min=0.5, abs_max=inf, nonfinite=2, neg_inf=1)
        >>> str(AbsRange.of([_summary(torch.tensor([float("nan"), float("nan")]))]))
        '|x| in [inf, nan], 2 inf/NaN'
    """

    abs_min: float
    abs_max: float
    nonfinite: int
    neg_inf: int = 0

    @property
    def finite(self) -> bool:
        """Whether every value is finite."""
        return self.nonfinite == 0

    @property
    def finite_or_masked(self) -> bool:
        """Whether every value is finite or -inf (the autopsy takes a -inf among a module's inputs for a mask)."""
        return self.nonfinite == self.neg_inf

    @classmethod
    def of(cls, summaries: Sequence[Tensor | Sequence[float]]) -> AbsRange | None:
        """Merge per-tensor summaries (``[abs-min of non-zeros, abs-max, non-finite, -inf]``); ``None`` if none."""
        rows = [s.tolist() if isinstance(s, Tensor) else list(s) for s in summaries]
        if not rows:
            return None
        maxima = [row[1] for row in rows]
        abs_max = math.nan if any(math.isnan(m) for m in maxima) else max(maxima)
        abs_min = min(row[0] for row in rows)
        # The summaries' inf stands for "no finite non-zero value": with every value zero, the smallest is 0.
        no_nonzero = math.isinf(abs_min) and abs_max == 0
        counts = [round(sum(row[i] for row in rows)) for i in (2, 3)]
        return cls(0.0 if no_nonzero else abs_min, abs_max, *counts)

    def __str__(self) -> str:
        bad = f", {self.nonfinite} inf/NaN" if self.nonfinite else ""
        return f"|x| in [{_num(self.abs_min)}, {_num(self.abs_max)}]{bad}"


@dataclass(frozen=True)
class ModuleStats:
    """What the blamed module saw in the replay that blamed it (one call of it, if it ran more than once).

    Each field is an :class:`AbsRange` over the floating-point tensors named, or ``None`` when there were none (a
    module without parameters has no ``weights``; the gradients are ``None`` for a ``"forward"`` autopsy).

    Attributes:
        inputs: its forward's inputs, positional and keyword.
        weights: its own parameters (not its children's).
        outputs: its forward's outputs (in the half precision of the replay).
        grad_outputs: the gradients reaching its outputs in the backward.
        grad_inputs: the gradients its backward sent to its inputs (``None`` if no input required grad, or it
            modified its input in place).
        grad_weights: the gradients of its own parameters.
        fp32_outputs: ``"forward"`` only: its outputs when its forward is rerun in FP32 (autocast off, the same inputs
            upcast), e.g. the 7.1e4 that float16 turned into inf.
    """

    inputs: AbsRange | None = None
    weights: AbsRange | None = None
    outputs: AbsRange | None = None
    grad_outputs: AbsRange | None = None
    grad_inputs: AbsRange | None = None
    grad_weights: AbsRange | None = None
    fp32_outputs: AbsRange | None = None


@dataclass(frozen=True)
class Autopsy:
    """Where one skipped step's first inf/NaN came from, and whether a lower loss scale would have helped.

    Attributes:
        step: the global step of the skipped step.
        kind: ``"forward"``, ``"scale"`` or ``"backward"`` (see the module docstring).
        module: the qualified name from ``model.named_modules()`` (``""`` is the model itself), or ``None`` when the
            first non-finite value was made outside any module (the loss computation).
        module_type: the module's class name (what ``keep_fp32=(...)`` takes), or ``None``.
        scale: the loss scale the step used.
        safe_scale: ``"scale"``: the largest power of two below ``scale`` at which the gradients are finite; ``None``
            for the other kinds.
        dtype: the half dtype of the mixed precision.
        stats: what the module saw (:class:`ModuleStats`); ``None`` when ``module`` is ``None``.
        finite_in_fp32: whether the same computation is finite in FP32: for ``"forward"``, the module's forward rerun
            in FP32 on the same inputs (the whole forward when ``module`` is ``None``); for ``"backward"``, the batch
            replayed with autocast off; ``None`` for ``"scale"``, or when it could not be told (``run`` enters
            autocast itself, or the module does not run on FP32 inputs).
        min_scale: the lowest loss scale tried (``"backward"`` means non-finite even there).

    Examples:
        >>> record = Autopsy(step=7, kind="scale", module="fc", module_type="Linear", scale=2.0**16,
        ...                  safe_scale=2.0**12, dtype=torch.float16)
        >>> print(record.message)
        step 7: gradients are non-finite at loss scale 65536 (2**16) but finite at 4096 (2**12): backing off the \
scale fixes this, and the scaler does so by itself (routine while the scale settles; if frequent, the scale is too \
high). The first non-finite gradient appeared in the backward of `fc` (Linear).
    """

    step: int
    kind: Kind
    module: str | None
    module_type: str | None
    scale: float
    safe_scale: float | None
    dtype: torch.dtype
    stats: ModuleStats | None = None
    finite_in_fp32: bool | None = None
    min_scale: float = 1.0

    @property
    def message(self) -> str:
        """The diagnosis in one paragraph a user acts on: where, what, and the fix."""
        fmt = format_of(self.dtype)
        if self.kind == "forward":
            text = self._forward_text(fmt)
        elif self.kind == "scale":
            text = self._scale_text()
        else:
            text = self._backward_text(fmt)
        return f"step {self.step}: {text}"

    def __str__(self) -> str:
        return self.message

    def _where(self) -> str:
        return f"`{self.module}` ({self.module_type})"

    def _keep_fp32(self, fmt: Format) -> str:
        bf16 = " or train in bf16" if fmt.dtype == torch.float16 else ""
        return f"keep it in FP32 with `keep_fp32=({self.module_type},)`{bf16}"

    def _forward_text(self, fmt: Format) -> str:
        stats = self.stats
        if stats is None or self.module is None:
            return self._loss_text()
        outputs, inputs, fp32 = stats.outputs, stats.inputs, stats.fp32_outputs
        what = _nonfinite_word(outputs)
        if inputs is not None and not inputs.finite_or_masked:
            return (
                f"layer {self._where()} is the first module with a non-finite forward output, but its inputs already "
                f"held {inputs.nonfinite} inf/NaN values: they come from the batch or from code outside any module. "
                f"Loss scaling cannot fix this: check the batch and the code that feeds `{self.module}`."
            )
        given = "from finite inputs"
        if inputs is not None and inputs.neg_inf:
            given += " (but for the -inf of a mask)"
        elif inputs is not None:
            given += f" (abs-max {_num(inputs.abs_max)})"
        cannot = "loss scaling cannot fix this"
        if fp32 is None:
            return (
                f"layer {self._where()}: forward output is {what} {given}; {cannot}. If it exceeds {fmt.name}'s "
                f"{_limit(fmt.max)}, {self._keep_fp32(fmt)}; otherwise check its computation."
            )
        if not fp32.finite:
            return (
                f"layer {self._where()}: forward output is {what} {given}, and non-finite in FP32 too: not a "
                f"precision problem, and {cannot}: check its computation (log or sqrt of a negative number, 0/0, "
                "inf - inf) and its weights."
            )
        if fp32.abs_max > fmt.max:
            return (
                f"layer {self._where()}: forward output {_num(fp32.abs_max)} exceeds {fmt.name}'s {_limit(fmt.max)}; "
                f"{cannot}: {self._keep_fp32(fmt)}."
            )
        return (
            f"layer {self._where()}: forward output is {what} in {fmt.name} {given} but finite in FP32 (abs-max "
            f"{_num(fp32.abs_max)}): a value inside its computation leaves {fmt.name}'s range or precision; {cannot}: "
            f"{self._keep_fp32(fmt)}."
        )

    def _loss_text(self) -> str:
        advice = {
            True: "It is finite in FP32: compute the loss in FP32 (`.float()` the model's output before the loss).",
            False: "It is non-finite in FP32 too: check the loss computation and the targets.",
            None: "Check the loss computation and the targets.",
        }[self.finite_in_fp32]
        return (
            "the loss is non-finite though every module's output is finite: the computation after the modules (the "
            f"loss function) makes it, and loss scaling cannot fix this. {advice}"
        )

    def _scale_text(self) -> str:
        where = (
            f"in the backward of {self._where()}"
            if self.module is not None
            else "in the scaled gradient of the loss itself, before any module's backward"
        )
        return (
            f"gradients are non-finite at loss scale {_scale(self.scale)} but finite at "
            f"{_scale(self.safe_scale or 0.0)}: backing off the scale fixes this, and the scaler does so by itself "
            "(routine while the scale settles; if frequent, the scale is too high). The first non-finite gradient "
            f"appeared {where}."
        )

    def _backward_text(self, fmt: Format) -> str:
        floor = _scale(self.min_scale)
        if self.module is None:
            return (
                f"gradients are non-finite even at loss scale {floor}, first in the gradient of the loss itself, "
                "before any module's backward: no loss scale can fix this; check the loss computation."
            )
        stats = self.stats or ModuleStats()
        bad = [g for g in (stats.grad_inputs, stats.grad_weights) if g is not None and not g.finite]
        what = _nonfinite_word(bad[0] if bad else None)
        made = f"the backward of {self._where()} makes {what} from finite gradients even at loss scale {floor}"
        if self.finite_in_fp32:
            return (
                f"{made}, but the FP32 backward is finite: a {fmt.name} value in its backward overflows; no loss "
                f"scale >= {floor} helps: {self._keep_fp32(fmt)}."
            )
        fp32 = " and in FP32" if self.finite_in_fp32 is False else ""
        return (
            f"{made}{fp32}: its backward is broken (a custom autograd Function, or a derivative taken at a singular "
            "point such as sqrt(0) or log(0)); no loss scale can fix this."
        )


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
        model: the module whose modules are judged (names from ``model.named_modules()``); its parameters are the
            ones whose gradients decide the step (those that require grad).
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


class _Stop(Exception):
    """Ends a partial replay once the module of interest has been rerun."""


@dataclass(eq=False)
class _Call:
    """One call of one module in a hooked replay; the lists hold row numbers of the recorder's summaries."""

    index: int
    name: str
    module: nn.Module
    parent: int | None
    number: int
    """How many calls of the same module came before this one in the replay."""
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    producers: set[int] = field(default_factory=set)
    """The calls whose outputs this call took as inputs."""
    finished: int | None = None
    grad_outputs: list[int] = field(default_factory=list)
    grad_inputs: list[int] = field(default_factory=list)
    first_grad: int | None = None
    """When the first gradient reached its outputs: its place in the backward's order."""


def _summary(tensor: Tensor) -> Tensor:
    """``[smallest non-zero |x| (inf if none), max |x|, count of inf/NaN, count of -inf]``, float32, on its device."""
    values = tensor.detach()
    if values.numel() == 0:
        return torch.tensor([math.inf, 0.0, 0.0, 0.0], device=values.device)
    magnitudes = values.abs()
    smallest = torch.where(magnitudes > 0, magnitudes, math.inf).amin()
    counts = (~torch.isfinite(values)).sum(), torch.isneginf(values).sum()
    return torch.stack([smallest.float(), magnitudes.amax().float(), *(c.float() for c in counts)])


class _Recorder:
    """Hooks on every module of a model for one replay: what each call took, returned, and received in the backward.

    With ``backward``, it also sees the gradients that reached each call's outputs and those its backward sent to its
    inputs.
    Gradients are seen through tensor hooks on the outputs and on aliases (``x.view_as(x)``) of the inputs that
    require grad, handed to the module instead of ``x``: the alias's gradient is that call's own contribution, and
    unlike module backward hooks an alias allows in-place modules (``ReLU(inplace=True)``).

    Mutable state: ``calls`` (in the order they started), ``rows`` (the summaries, read once by :meth:`read`),
    ``_pending`` (summaries still on the device), ``_stack`` (calls in progress), ``_produced`` (id of each output
    tensor -> the calls that returned it, with the tensor kept alive so the id stays unique), ``_counts`` (calls per
    module), ``_clock``, ``_handles``.
    """

    def __init__(self, model: nn.Module, backward: bool) -> None:
        self.backward = backward
        self.calls: list[_Call] = []
        self.rows: list[list[float]] = []
        self._names = {module: name for name, module in model.named_modules()}
        self._pending: list[Tensor] = []
        self._stack: list[_Call] = []
        self._produced: dict[int, tuple[list[int], Tensor]] = {}
        self._counts: dict[nn.Module, int] = {}
        self._clock = itertools.count()
        self._handles: list[RemovableHandle] = []

    def attach(self) -> None:
        """Hook every module."""
        for module in self._names:
            self._handles.append(module.register_forward_pre_hook(self._before, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._after, with_kwargs=True))

    def detach(self) -> None:
        """Remove the hooks and let go of the replay's tensors."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._produced = {}
        self._stack = []

    def read(self) -> None:
        """Bring every summary to the host, in one read."""
        if self._pending:
            device = self._pending[0].device
            self.rows = torch.stack([p.to(device) for p in self._pending]).tolist()
        self._pending = []

    def range(self, rows: Iterable[int]) -> AbsRange | None:
        """The :class:`AbsRange` of some rows (after :meth:`read`)."""
        return AbsRange.of([self.rows[r] for r in rows])

    def finite(self, rows: Iterable[int]) -> bool:
        """Whether the tensors of these rows were all finite (after :meth:`read`)."""
        return all(self.rows[r][2] == 0 for r in rows)

    def masked(self, rows: Iterable[int]) -> bool:
        """Whether the tensors of these rows were finite but for -inf (after :meth:`read`)."""
        return all(self.rows[r][2] == self.rows[r][3] for r in rows)

    def _row(self, tensor: Tensor) -> int:
        self._pending.append(_summary(tensor))
        return len(self._pending) - 1

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        number = self._counts.get(module, 0)
        self._counts[module] = number + 1
        parent = self._stack[-1].index if self._stack else None
        call = _Call(len(self.calls), self._names[module], module, parent, number)
        tensors = list(floating_tensors((args, kwargs)))
        call.inputs = [self._row(t) for t in tensors]
        call.producers = {p for t in tensors for p in self._produced.get(id(t), ([], t))[0]}
        self.calls.append(call)
        self._stack.append(call)
        if not self.backward:
            return None
        return self._aliased(args, call), self._aliased(kwargs, call)

    def _aliased(self, value: Any, call: _Call) -> Any:
        if isinstance(value, Tensor):
            if not (value.is_floating_point() and value.requires_grad):
                return value
            try:
                alias = value.view_as(value)
            except RuntimeError:  # a layout without views (sparse): leave it unaliased
                return value
            alias.register_hook(self._on_grad(call, call.grad_inputs))  # type: ignore[no-untyped-call]
            if id(value) in self._produced:
                self._produced[id(alias)] = (self._produced[id(value)][0], alias)
            return alias
        if type(value) in (tuple, list):
            return type(value)(self._aliased(item, call) for item in value)
        if type(value) is dict:
            return {key: self._aliased(item, call) for key, item in value.items()}
        return value

    def _after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        call = self._stack.pop()
        tensors = list(floating_tensors(output))
        call.outputs = [self._row(t) for t in tensors]
        call.finished = next(self._clock)
        for tensor in tensors:
            producers = self._produced.setdefault(id(tensor), ([], tensor))[0]
            producers.append(call.index)
            if self.backward and tensor.requires_grad:
                tensor.register_hook(self._on_grad(call, call.grad_outputs))  # type: ignore[no-untyped-call]

    def _on_grad(self, call: _Call, rows: list[int]) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if rows is call.grad_outputs and call.first_grad is None:
                call.first_grad = next(self._clock)
            rows.append(self._row(grad))

        return hook

    def _is_below(self, call: _Call, ancestor: _Call) -> bool:
        parent = call.parent
        while parent is not None:
            if parent == ancestor.index:
                return True
            parent = self.calls[parent].parent
        return False

    def _escaped(self, call: _Call) -> bool:
        """Whether no enclosing call returned finite outputs (else the non-finite values stayed inside it)."""
        parent = call.parent
        while parent is not None:
            enclosing = self.calls[parent]
            if enclosing.outputs and self.finite(enclosing.outputs):
                return False
            parent = enclosing.parent
        return True

    def forward_origin(self) -> _Call | None:
        """The call where the forward went non-finite, or ``None`` when every module's output stayed finite.

        The suspects are the calls whose non-finite output escaped every enclosing module (none of them returned
        finite values) and that no consumer made finite again. The first to finish (inner before outer) is blamed,
        among, in this order: those with finite inputs (-inf taken for a mask) and +inf or NaN in their output; those
        with finite inputs (a -inf output is likelier a mask than an overflow); the rest.
        """
        done = sorted((c for c in self.calls if c.finished is not None), key=lambda c: c.finished or 0)
        absorbed = {p for c in done if c.outputs and self.finite(c.outputs) for p in c.producers}
        suspects = [c for c in done if not self.finite(c.outputs) and c.index not in absorbed and self._escaped(c)]
        ranked = sorted(suspects, key=lambda c: (not self.masked(c.inputs), self.masked(c.outputs)))
        return ranked[0] if ranked else None

    def backward_origin(self, own_grads_finite: Callable[[nn.Module], bool]) -> _Call | None:
        """The call where the backward went non-finite, or ``None`` when that happened outside every module.

        That is the first call, in backward order, whose outputs received finite gradients but whose backward made
        non-finite ones (for its inputs or its own parameters); an inner call comes before an enclosing one.
        """
        reached = sorted((c for c in self.calls if c.first_grad is not None), key=lambda c: c.first_grad or 0)
        makers = [
            c
            for c in reached
            if self.finite(c.grad_outputs) and not (self.finite(c.grad_inputs) and own_grads_finite(c.module))
        ]
        innermost = [c for c in makers if not any(self._is_below(other, c) for other in makers if other is not c)]
        return innermost[0] if innermost else None


@dataclass
class _Hooked:
    """A replay with the recorder: its loss, its gradients (``None`` when the loss was non-finite)."""

    recorder: _Recorder
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
        recorder = _Recorder(self.model, backward=True)
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
                with torch.no_grad(), self._fp32():
                    finite = all_finite([self.run()])
        finally:
            probe.detach()
        return None if probe.seen else finite

    def _fp32(self) -> Any:
        return torch.autocast(self.device, enabled=False)

    def fp32_outputs(self, call: _Call) -> AbsRange | None:
        """The outputs of ``call``'s forward rerun in FP32 (``None`` if the module does not run so).

        A replay runs up to that call; there the module's forward runs on its inputs upcast, and the replay stops.
        """
        found: list[AbsRange | None] = []
        seen = itertools.count()

        def rerun(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if next(seen) != call.number:
                return
            try:
                with torch.no_grad(), self._fp32():
                    output = module.forward(*_upcast(args), **_upcast(kwargs))
                found.append(AbsRange.of([_summary(t) for t in floating_tensors(output)]))
            except Exception:  # e.g. half weights (a model converted to bf16): no FP32 rerun to compare with
                found.append(None)
            raise _Stop

        handle = call.module.register_forward_pre_hook(rerun, with_kwargs=True)
        self.rng.restore()
        try:
            with torch.enable_grad(), self.context():
                self.run()
        except _Stop:
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
            grad_weights=AbsRange.of([_summary(g) for g in own if g is not None]),
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
    return AbsRange.of([_summary(p) for p in module.parameters(recurse=False)])


def _upcast(value: Any) -> Any:
    """``value`` with its half tensors made float32 (looking into tuples, lists and dicts)."""
    if isinstance(value, Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if type(value) in (tuple, list):
        return type(value)(_upcast(item) for item in value)
    if type(value) is dict:
        return {key: _upcast(item) for key, item in value.items()}
    return value


def _nonfinite_word(values: AbsRange | None) -> str:
    if values is None or values.finite:
        return "non-finite"
    return "NaN" if math.isnan(values.abs_max) else "inf"


def _num(value: float) -> str:
    """A magnitude in two significant digits, as a user reads it: 7.1e4, 0.5, inf."""
    if math.isinf(value) or math.isnan(value):
        return str(value)
    text = f"{value:.2g}"
    return text.replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


def _scale(value: float) -> str:
    """A loss scale: ``65536 (2**16)`` for a power of two, else its value."""
    shown = f"{value:.0f}" if 1 <= value < 2**53 and value == int(value) else f"{value:g}"
    exponent = math.log2(value) if 0 < value < math.inf else 0.5
    return f"{shown} (2**{int(exponent)})" if exponent == int(exponent) and exponent != 0 else shown


def _limit(value: float) -> str:
    """A format's largest value: 65504, 448, 3.4e38."""
    return f"{value:.0f}" if value < 1e6 else _num(value)
