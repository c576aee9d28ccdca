"""What the autopsy finds, and the words that explain it to a user.

The magnitudes it reads (:class:`AbsRange`, from :func:`summarize`), per module (:class:`ModuleStats`), and its verdict
(:class:`Autopsy`, whose :attr:`~Autopsy.message` says where, why and what to do).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_amp_plus.diagnostics.formats import Format, format_of

__all__ = ["AbsRange", "Autopsy", "Kind", "ModuleStats", "summarize"]

Kind = Literal["forward", "scale", "backward"]


def summarize(tensor: Tensor) -> Tensor:
    """``[smallest non-zero |x| (inf if none), max |x|, count of inf/NaN, count of -inf]``, float32, on its device."""
    values = tensor.detach()
    if values.numel() == 0:
        return torch.tensor([math.inf, 0.0, 0.0, 0.0], device=values.device)
    magnitudes = values.abs()
    smallest = torch.where(magnitudes > 0, magnitudes, math.inf).amin()
    counts = (~torch.isfinite(values)).sum(), torch.isneginf(values).sum()
    return torch.stack([smallest.float(), magnitudes.amax().float(), *(c.float() for c in counts)])


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
        >>> AbsRange.of([summarize(torch.tensor([0.0, -3.0, 0.5, float("inf"), -float("inf")]))])
        AbsRange(abs_min=0.5, abs_max=inf, nonfinite=2, neg_inf=1)
        >>> str(AbsRange.of([summarize(torch.tensor([float("nan"), float("nan")]))]))
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
