"""The autopsy's recorder: hooks on every module of a model for one replay, and where the first inf/NaN came from.

Forward hooks record each call's inputs and outputs (summarised on the device, read once); tensor hooks record the
gradients each call received and sent. :meth:`Recorder.forward_origin` and :meth:`Recorder.backward_origin` find the
innermost call that made a non-finite value from finite ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_amp_plus.diagnostics.findings import AbsRange, summarize
from lightning_amp_plus.diagnostics.names import plain_name
from lightning_amp_plus.diagnostics.replay import floating_tensors

__all__ = ["Call", "Recorder", "Stop"]


class Stop(Exception):
    """Ends a partial replay once the module of interest has been rerun."""


@dataclass(eq=False)
class Call:
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


class Recorder:
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
        self.calls: list[Call] = []
        self.rows: list[list[float]] = []
        self._names = {module: plain_name(name) for name, module in model.named_modules()}
        self._pending: list[Tensor] = []
        self._stack: list[Call] = []
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
        self._pending.append(summarize(tensor))
        return len(self._pending) - 1

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        number = self._counts.get(module, 0)
        self._counts[module] = number + 1
        parent = self._stack[-1].index if self._stack else None
        call = Call(len(self.calls), self._names[module], module, parent, number)
        tensors = list(floating_tensors((args, kwargs)))
        call.inputs = [self._row(t) for t in tensors]
        call.producers = {p for t in tensors for p in self._produced.get(id(t), ([], t))[0]}
        self.calls.append(call)
        self._stack.append(call)
        if not self.backward:
            return None
        return self._aliased(args, call), self._aliased(kwargs, call)

    def _aliased(self, value: Any, call: Call) -> Any:
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

    def _on_grad(self, call: Call, rows: list[int]) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if rows is call.grad_outputs and call.first_grad is None:
                call.first_grad = next(self._clock)
            rows.append(self._row(grad))

        return hook

    def _is_below(self, call: Call, ancestor: Call) -> bool:
        parent = call.parent
        while parent is not None:
            if parent == ancestor.index:
                return True
            parent = self.calls[parent].parent
        return False

    def _escaped(self, call: Call) -> bool:
        """Whether no enclosing call returned finite outputs (else the non-finite values stayed inside it)."""
        parent = call.parent
        while parent is not None:
            enclosing = self.calls[parent]
            if enclosing.outputs and self.finite(enclosing.outputs):
                return False
            parent = enclosing.parent
        return True

    def forward_origin(self) -> Call | None:
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

    def backward_origin(self, own_grads_finite: Callable[[nn.Module], bool]) -> Call | None:
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
