"""FP8 training of a model's Linear layers on torchao, in one object a training loop (or a precision plugin) drives.

:class:`FP8Training` holds the choices (recipe, which layers, how often to read the casts, when to fall back) and the
state of a run: the converted layers, the layers fallen back, the steps counted, the fallback rule's counts. A loop
calls :meth:`~FP8Training.convert` once before building the optimizer, then either

* :meth:`~FP8Training.before_forward` before each training forward and :meth:`~FP8Training.after_step` after each
  optimizer step, skipped or not (what the precision plugins do: the check steps come every ``check_interval`` steps,
  the flags of a skipped step are kept for :meth:`~FP8Training.nonfinite_layers`), or
* each part itself: :meth:`~FP8Training.start_check` before the forward of a check step and
  :meth:`~FP8Training.finish_check` after its optimizer step, :meth:`~FP8Training.nonfinite_layers` when a step was
  skipped, and :meth:`~FP8Training.end_step` after every step.

**What a step runs.** Everything a training step of an FP8 model runs beyond bf16-mixed is in this module: the forward
of each converted layer (:meth:`LayerGuard.forward`, around torchao's), one identity autograd function applied around
it (:class:`_Flags`, on its input and on its output), and the two calls around the step. The non-finite flags come
from values the casts produce (the first column of the layer's output in forward; the first column of the gradient it
hands to its input in backward: see :mod:`~lightning_amp_plus.weights.fp8.nonfinite`) and travel with autograd: each
becomes the gradient of a small leaf tensor of the layer's own, which autograd adds up over micro-batches. On a check
step the same forward counts the casts too (:mod:`~lightning_amp_plus.weights.fp8.readings`), carried the same way,
and stamps each layer's place in the forward order on the device (so does the first step after a conversion): no hook
is added or removed, a switch is turned.

**Under torch.compile** all of it compiles into the graph without a break, and nothing in it is particular to a layer
but tensors: blocks compiled one by one share their graphs. Two switches decide the graph: ``reading`` (a check step
compiles a second graph, once) and ``ordering`` (the first step after a conversion stamps; where that is not a check
step, one graph more, once). Nothing else recompiles.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_amp_plus._checks import show
from lightning_amp_plus.diagnostics.names import plain_name
from lightning_amp_plus.weights.fp8.casts import (
    Cast,
    all_gathers_in_fp8,
    has_high_precision_gemm,
    recipe_casts,
    recipe_config,
)
from lightning_amp_plus.weights.fp8.convert import (
    GUARD,
    Float8Config,
    Modules,
    Recipe,
    convert_layers,
    fall_back,
    warn_what_stays_in_bf16,
)
from lightning_amp_plus.weights.fp8.fallback import FallbackRule
from lightning_amp_plus.weights.fp8.nonfinite import snapshot
from lightning_amp_plus.weights.fp8.options import (
    DEFAULT_CHECK_INTERVAL,
    DEFAULT_FALLBACK,
    DEFAULT_RECIPE,
    check_all_gather,
    check_check_interval,
    check_fallback,
    check_modules,
    check_recipe,
    require_torchao,
)
from lightning_amp_plus.weights.fp8.readings import COLUMNS, CastReading, count_rows, readings_of, worst_flush

__all__ = [
    "DEFAULT_CHECK_INTERVAL",
    "DEFAULT_FALLBACK",
    "DEFAULT_RECIPE",
    "FP8Check",
    "FP8Training",
    "LayerGuard",
    "Outcome",
    "convert_in_place",
    "input_as_cast",
    "nonfinite_flag",
]

STATE_VERSION = 2
"""The :meth:`FP8Training.state_dict` format: 2 holds the steps counted; 1 (read too) did not."""


@dataclass(frozen=True)
class FP8Check:
    """What one check step found.

    Attributes:
        readings: one per converted layer and cast.
        fell_back: the layers sent back to bf16 at this check (by the rule).
        step: the optimizer step it read (counted from 0 by :meth:`FP8Training.after_step`; ``None`` when the loop
            drives the check itself).
    """

    readings: list[CastReading]
    fell_back: list[str]
    step: int | None = None


class Outcome(Protocol):
    """What :meth:`FP8Training.after_step` needs to know of a step.

    A :class:`~lightning_amp_plus.step.engine.StepResult` (always ``resolved``) has it, and a fused optimizer's step
    whose fate may still be on the device (a :class:`~lightning_amp_plus.step.engine.PendingStep`).
    """

    @property
    def resolved(self) -> bool:
        """Whether the step's fate is known on the host (reading the others then costs no device read)."""

    @property
    def skipped(self) -> bool:
        """Whether the step was skipped (for inf/NaN, or a spike)."""

    @property
    def overflowed(self) -> bool:
        """Whether the step was skipped because its gradients held inf/NaN."""


# ------------------------------------------------------------------------------------------- one layer's forward
def input_as_cast(value: Any, every_device: bool) -> Any:
    """``value`` as the FP8 layer's casts take it.

    In CUDA's autocast dtype under CUDA autocast (torchao's own rule), and, if ``every_device``, in the autocast dtype
    of its device under that device's autocast. torchao 0.18 casts a layer's input only under CUDA autocast; a recipe
    that computes a GEMM in high precision (``rowwise_with_gw_hp``'s ``grad_weight``) then multiplies a bf16 gradient
    by an FP32 input under CPU autocast and fails: for such recipes the input is cast on every device.

    Examples:
        >>> x = torch.ones(2, 16)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     input_as_cast(x, every_device=False).dtype, input_as_cast(x, every_device=True).dtype
        (torch.float32, torch.bfloat16)
    """
    if not isinstance(value, Tensor) or not value.is_floating_point():
        return value
    if torch.is_autocast_enabled("cuda"):
        return value.to(torch.get_autocast_dtype("cuda"))
    device = value.device.type
    if every_device and device != "cuda" and torch.is_autocast_enabled(device):
        return value.to(torch.get_autocast_dtype(device))
    return value


class _Run:
    """What the guards of one :class:`FP8Training` share.

    Attributes:
        reading: whether the casts are read (a check step): a switch a compiled graph depends on.
        ordering: whether the layers stamp their place in the forward order: from a conversion to the end of the next
            step. The other switch: a check step stamps too, so it adds a compiled graph only where the first step
            after a conversion is not a check step (a resumed run's, a loop's own).
        clock: 0-d int64 on the layers' device: the layers stamped so far (the next position).
        device: where the guards' tensors were placed last (``None``: to be placed before the next forward).
    """

    def __init__(self) -> None:
        self.reading = False
        self.ordering = False
        self.clock = torch.zeros((), dtype=torch.int64)
        self.device: torch.device | None = None


def nonfinite_flag(value: Tensor) -> Tensor:
    """A 0-d FP32 tensor on ``value``'s device: 0 if ``value`` is all finite, NaN otherwise (no host sync).

    Examples:
        >>> nonfinite_flag(torch.ones(2, 2)), nonfinite_flag(torch.tensor([[1.0, float("inf")]]))
        (tensor(0.), tensor(nan))
    """
    if not value.numel():
        return torch.zeros((), dtype=torch.float32, device=value.device)
    low, high = torch.aminmax(value)
    # x * 0 is 0 for a finite x and NaN for NaN or +-inf.
    return (low.float() * 0).add_(high.float(), alpha=0)


class _Flags(torch.autograd.Function):
    """The identity on a layer's input or output; in backward, the layer's flags handed to its leaf tensors as grads.

    The flags are non-finite flags, and on a check step the casts' counts.

    Gradients, not in-place writes: autograd adds them up over micro-batches, on the device, in eager and compiled
    backward alike (a hook writing a tensor from backward would not compile). Written in place, the forward's flag
    would also be one more input the compiled graph mutates, which reorders how inductor fuses the model's own kernels
    (measured: the parameters then differ from torchao's compiled path, 1.3e-2 after 4 steps of the tiny Llama under
    the Trainer); carried, it is one more value the forward saves for backward, and the kernels stay torchao's
    (tests/plugins/test_fp8_compile.py).

    On the layer's input (``flag`` ``None``): the gradient the layer hands back to its input is ``grad_output @
    weight`` from float8 casts of ``grad_output``: a non-finite value anywhere in a row of ``grad_output`` makes that
    row's scale (or the tensor's) non-finite, and so the whole row of this gradient, its first column included. That
    column's flag (0, or NaN) becomes the gradient of ``backward_sink``.

    On the layer's output: the forward's ``flag`` becomes the gradient of ``sink``. Given ``backward_sink`` (a layer
    whose input needs no gradient, so that no input saw its backward), the backward flag is read here, from the whole
    output gradient its casts read. Given ``count_sink`` (a check step), the forward casts' ``counts`` and the
    output-gradient casts' (:func:`~lightning_amp_plus.weights.fp8.readings.count_rows` of ``casts``, counted here)
    become its gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        value: Tensor,
        sink: Tensor | None,
        flag: Tensor | None,
        backward_sink: Tensor | None,
        count_sink: Tensor | None = None,
        counts: Tensor | None = None,
        casts: tuple[Cast, ...] = (),
    ) -> Tensor:
        ctx.save_for_backward(flag, counts)
        ctx.read = backward_sink is not None
        ctx.whole = flag is not None  # on the output: the whole gradient (its casts read it all)
        ctx.casts = casts
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        flag, counts = ctx.saved_tensors
        seen = nonfinite_flag(grad if ctx.whole else grad[..., :1]) if ctx.read else None
        if counts is not None:
            with torch.no_grad():
                counts = torch.cat([counts, count_rows(ctx.casts, {"grad_output": grad}, grad.device)])
        return grad, flag, None, seen, counts, None, None


class LayerGuard:
    """The forward of one converted layer, and its flags, counts and place in the forward order on the device.

    :meth:`forward` becomes the layer's own (an attribute of the module object, which ``nn.Module.__call__`` runs
    between the layer's hooks, over torchao's ``Float8Linear.forward``). It leaves inference mode where it is on
    (torchao's float8 tensor cannot run under it: the forward runs as under ``torch.no_grad()``, the same numbers),
    casts the input as torchao does under CUDA autocast for a recipe with a high-precision GEMM (:func:`input_as_cast`),
    and wraps a training input in :class:`_Flags`; after torchao's forward it flags the output's first column (see
    :mod:`~lightning_amp_plus.weights.fp8.nonfinite`), on check steps counts the input and weight casts, and wraps the
    output in :class:`_Flags`, which hands both to backward. An output that needs no gradient (a frozen layer on a
    frozen input) has no backward: its flag and counts are added in place to :attr:`flag` and :attr:`counts`. While the
    run is ordering or reading, the layer's first forward stamps the run's clock into :attr:`stamp`. A guard without
    ``run`` only casts and leaves inference mode.

    One method, not a pre-hook and a forward hook: the inference-mode exit is a ``with`` block (a hook pair needs a
    forward hook that runs even when the forward raises, which dynamo guards on per layer), and nothing in it is
    particular to the layer but tensors, so the blocks of a model compiled one by one share their graphs
    (tests/plugins/test_fp8_compile.py, block by block).

    Args:
        name: the layer's name (``named_modules()`` of the model that was converted, without the wrappers' parts).
        config: torchao's ``Float8LinearConfig`` of the layer.
        added: the attribute names the conversion added to the module (removed again by a fallback).
        run: what the guards of one :class:`FP8Training` share, or ``None``.

    Attributes:
        flag: 0-d FP32, NaN once the forward casts met a non-finite value (forwards without backward).
        forward_sink: 0-d FP32 leaf; its gradient is NaN once the forward casts met a non-finite value.
        backward_sink: 0-d FP32 leaf; its gradient is NaN once the backward casts met one.
        counts: the forward casts' counts on check steps (forwards without backward: their rows of :attr:`casts`).
        count_sink: a leaf whose gradient holds the counts of every cast of :attr:`casts` on check steps.
        stamp: 0-d int64, the run's clock at the layer's first forward while stamping (-1 before).
        position: :attr:`stamp` as the host last read it (-1: not known yet).
    """

    def __init__(self, name: str, config: Float8Config, added: tuple[str, ...], run: _Run | None) -> None:
        self.name = name
        self.added = added
        self.run = run
        self.cast_every_device = has_high_precision_gemm(config)
        casts = recipe_casts(config)
        self.casts = (
            *(cast for cast in casts if cast.operand != "grad_output"),
            *(cast for cast in casts if cast.operand == "grad_output"),
        )
        self.forward_casts = sum(cast.operand != "grad_output" for cast in casts)
        self.position = -1
        self.stamp = torch.full((), -1, dtype=torch.int64)
        self.layer: nn.Module | None = None
        self._own_forward: Any = None  # a forward the module object carried before (given back by detach)
        self.flag = self.forward_sink = self.backward_sink = self.counts = self.count_sink = torch.empty(0)

    def attach(self, layer: nn.Module) -> None:
        """Make :meth:`forward` ``layer``'s forward and place the tensors on its weight's device."""
        layer.__dict__[GUARD] = self
        self.layer = layer
        self._own_forward = layer.__dict__.get("forward")
        self.place(layer.get_parameter("weight").device)
        # An attribute of the module object shadows its class's forward (nn.Module.__call__ looks it up on the object):
        # the layer keeps torchao's class, and blocks compiled one by one share their graphs, which a pre-hook and an
        # always-called forward hook prevented (tests/plugins/test_fp8_compile.py, block by block). A deep copy of the
        # model copies the guard with its layer (tests/weights/test_fp8.py, test_a_deep_copy_...).
        layer.__dict__["forward"] = self.forward

    def detach(self) -> None:
        """Give the layer its forward back: its class's, or the one its module object carried before."""
        if self.layer is not None:
            self.layer.__dict__.pop("forward", None)
            if self._own_forward is not None:
                self.layer.__dict__["forward"] = self._own_forward
            self.layer = None
            self._own_forward = None

    def place(self, device: torch.device) -> None:
        """(Re)make the flags and counts on ``device`` (zero), and move the stamp and the run's clock there.

        Nothing is done when they are there already.
        """
        if self.flag.device == device and self.flag.ndim == 0:
            return
        self.flag = torch.zeros((), dtype=torch.float32, device=device)
        self.forward_sink = torch.zeros((), dtype=torch.float32, device=device, requires_grad=True)
        self.backward_sink = torch.zeros((), dtype=torch.float32, device=device, requires_grad=True)
        self.counts = torch.zeros(self.forward_casts, COLUMNS, dtype=torch.float64, device=device)
        self.count_sink = torch.zeros(len(self.casts), COLUMNS, dtype=torch.float64, device=device, requires_grad=True)
        self.stamp = self.stamp.to(device)
        if self.run is not None:
            self.run.clock = self.run.clock.to(device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's forward: torchao's, its input and output flagged (and counted on check steps) on the way."""
        # torch.compile cannot trace the inference-mode test (a graph break per layer), and needs no help there: a
        # compiled FP8 model runs under inference mode as it is.
        if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():
                return self.forward(*args, **kwargs)
        layer, run = self.layer, self.run
        assert layer is not None  # attached: the method is the layer's forward only while attached
        given = args[0] if args else kwargs.get("input")
        if run is not None and isinstance(given, Tensor):
            if self.flag.device != given.device:
                self.place(given.device)  # moved since the conversion (a plugin's step has them placed beforehand)
            if run.reading or run.ordering:
                self._stamp(run)
        value = input_as_cast(given, every_device=True) if self.cast_every_device else given
        if run is not None and isinstance(value, Tensor) and value.requires_grad and torch.is_grad_enabled():
            value = _Flags.apply(value, None, None, self.backward_sink)
        if value is not given:
            args, kwargs = ((value, *args[1:]), kwargs) if args else (args, {**kwargs, "input": value})
        output = type(layer).forward(layer, *args, **kwargs)
        if run is None or not isinstance(output, Tensor) or not torch.is_grad_enabled() or not output.numel():
            return output
        flag = nonfinite_flag(output[..., :1].detach())
        counts = self._count(layer, value) if run.reading else None
        if output.requires_grad:
            # An input that needs a gradient was probed above; for another, the output's gradient is read whole.
            unprobed = None if isinstance(value, Tensor) and value.requires_grad else self.backward_sink
            if counts is None:
                carried: Tensor = _Flags.apply(output, self.forward_sink, flag, unprobed)
            else:
                casts = self.casts[self.forward_casts :]
                carried = _Flags.apply(output, self.forward_sink, flag, unprobed, self.count_sink, counts, casts)
            return carried
        self.flag.add_(flag)  # NaN once anything non-finite was seen, until the step's end
        if counts is not None:
            self.counts.add_(counts)
        return output

    def _stamp(self, run: _Run) -> None:
        """At the layer's first stamped forward: the run's clock into :attr:`stamp`, and the clock moved on.

        On the device and without a branch on a value: torch.compile puts it in the graph as two in-place writes,
        where a position noted on the host while dynamo traced the layer would tie the graph to the layer.
        """
        with torch.no_grad():
            new = self.stamp < 0
            self.stamp.copy_(torch.where(new, run.clock.to(self.stamp.device), self.stamp))
            run.clock.add_(new.to(run.clock.device, torch.int64))

    def _count(self, layer: nn.Module, value: Any) -> Tensor:
        """On a check step: the input and weight casts' counts (one row per forward cast of :attr:`casts`)."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        operands = {"input": value} if isinstance(value, Tensor) else {}
        weight = layer.get_parameter("weight")
        # A weight FSDP2 all-gathered in float8 was cast from the shards: its high-precision values never reach here.
        if not isinstance(weight, Float8TrainingTensor):
            operands["weight"] = weight
        with torch.no_grad():
            return count_rows(self.casts[: self.forward_casts], operands, weight.device)


def convert_in_place(
    model: nn.Module,
    recipe: Recipe | Float8Config,
    modules: Modules = None,
    skip: Collection[str] = (),
    run: _Run | None = None,
) -> dict[str, nn.Linear]:
    """Convert the chosen Linear layers of ``model`` to torchao's FP8 training layer, in place, each with its hooks.

    Args:
        model: the model (its submodules are converted; a bare ``nn.Linear`` cannot be replaced in place: wrap it).
        recipe: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``
            (``Float8LinearConfig.from_recipe_name(recipe)``), or a ``Float8LinearConfig`` of one's own (e.g.
            ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``: tensorwise, weights all-gathered in FP8).
        modules: ``None``, ``"auto"`` or a callable ``(module, name) -> bool``
            (:mod:`~lightning_amp_plus.weights.fp8.convert`).
        skip: names never to convert (the layers fallen back).
        run: the run whose flags and readings the layers keep (:class:`FP8Training`'s), or ``None``.

    Returns:
        The layers this call converted, by name, in ``named_modules()`` order: the name ``named_modules()`` gives,
        without the parts torch's wrappers add (``_checkpoint_wrapped_module``:
        :func:`~lightning_amp_plus.diagnostics.names.plain_name`), as the model's state dict names it.

    Raises:
        ValueError: ``model`` is itself an eligible ``nn.Linear``.
    """
    config = recipe_config(recipe)
    layers: dict[str, nn.Linear] = {}
    for name, added in convert_layers(model, config, modules, skip).items():
        layer = model.get_submodule(name)
        # Named as the model's state dict and the monitor name it: without activation checkpointing's wrapper part.
        user_name = plain_name(name)
        LayerGuard(user_name, config, added, run).attach(layer)
        layers[user_name] = layer  # type: ignore[assignment]  # torchao's Float8Linear, an nn.Linear
    return layers


# ------------------------------------------------------------------------------------------------------- the run
class FP8Training:
    """FP8 training of a model's eligible Linear layers with torchao, readings of its casts and a fallback to bf16.

    Args:
        recipe: torchao's recipe, ``"tensorwise"`` (one scale per tensor: the fastest), ``"rowwise"`` (one scale
            per row, e4m3 everywhere) or ``"rowwise_with_gw_hp"`` (rowwise, the weight gradient in high precision);
            or a torchao ``Float8LinearConfig`` (e.g. ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``:
            tensorwise, the weights all-gathered in FP8 under FSDP2, which needs ``fallback=None``).
        modules: which eligible layers: ``None`` (all), ``"auto"`` (torchao's speed filter) or a callable
            ``(module, name) -> bool`` (see :mod:`~lightning_amp_plus.weights.fp8.convert`).
        check_interval: read the casts every this many optimizer steps (:meth:`is_check_step`).
        fallback: percent flushed above which a layer, at two readings in a row, goes back to bf16; ``None`` to
            only read and warn (once per layer flushing more than 1% at two readings in a row).
        owner: the class named in error messages and warnings (a front end passes its own).

    Attributes:
        checks: the latest check steps' findings (:class:`FP8Check`, up to 16, the newest last) that
            :meth:`after_step` made.

    Raises:
        ModuleNotFoundError: torchao is not installed (the message says how to install it).
        ValueError: a bad option (the message names it), or a fallback with the weights all-gathered in FP8.

    Examples:
        >>> import pytest; _ = pytest.importorskip("torchao.float8")  # the example needs the fp8 extra
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))  # 64x10: not eligible
        >>> fp8 = FP8Training("tensorwise")
        >>> fp8.convert(model)
        ['0']
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> fp8.start_check()
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     loss = model(torch.randn(32, 64)).float().square().mean()
        >>> loss.backward(); optimizer.step()
        >>> [(r.cast, r.flushed_pct) for r in fp8.finish_check().readings]
        [('input', 0.0), ('weight', 0.0), ('grad_output', 0.0)]
    """

    def __init__(
        self,
        recipe: Recipe | Float8Config = DEFAULT_RECIPE,
        modules: Modules = None,
        check_interval: int = DEFAULT_CHECK_INTERVAL,
        fallback: float | None = DEFAULT_FALLBACK,
        owner: str = "FP8Training",
    ) -> None:
        self.recipe = check_recipe(owner, "recipe", recipe)
        self.modules = check_modules(owner, "modules", modules)
        self.check_interval = check_check_interval(owner, "check_interval", check_interval)
        self.rule = FallbackRule(check_fallback(owner, "fallback", fallback))
        self.owner = owner
        require_torchao(owner)
        check_all_gather(owner, self.recipe, self.rule.threshold_pct, ("recipe", "fallback"))
        self.checks: deque[FP8Check] = deque(maxlen=16)
        self._run = _Run()
        self._layers: dict[str, nn.Linear] = {}  # every layer converted, fallen back or not
        self._guards: dict[str, LayerGuard] = {}  # the layers in FP8 now
        self._fallen: list[str] = []
        self._steps = 0  # optimizer steps seen by after_step (saved: a resumed run reads at the same steps)
        # The non-finite flags of skipped steps (and, on a fused optimizer's path, of steps whose skip is still on the
        # device), each with the step's outcome, oldest first: what nonfinite_layers reads once the current step's
        # flags are clear.
        self._kept: list[tuple[Outcome, Callable[[], list[str]]]] = []
        self._all_gather = all_gathers_in_fp8(self.recipe)

    @property
    def layers(self) -> dict[str, nn.Linear]:
        """The layers training in FP8 now, by name (converted and not fallen back)."""
        return {name: self._layers[name] for name in self._guards}

    @property
    def fallen_back(self) -> list[str]:
        """The layers sent back to bf16, in the order they fell back."""
        return list(self._fallen)

    @property
    def armed(self) -> bool:
        """Whether the casts are read (between :meth:`start_check` and :meth:`finish_check`)."""
        return self._run.reading

    def convert(self, model: nn.Module) -> list[str]:
        """Convert ``model``'s chosen layers in place (a second call converts only what is new); return their names.

        Warns, at the first conversion, when the model ends up with no FP8 layer at all (saying why), or when some of
        its layers with a weight matrix are not ``nn.Linear`` (they compute in bf16: GPT-2's ``Conv1D``).
        """
        before = len(self._guards)
        now = convert_in_place(model, self.recipe, self.modules, skip=set(self._fallen), run=self._run)
        self._layers.update(now)
        self._guards.update({name: layer.__dict__[GUARD] for name, layer in now.items()})
        self._run.device = None  # placed before the next forward, where the model will be by then
        self._run.ordering = self._run.ordering or len(self._guards) > before  # the new layers stamp their places
        warn_what_stays_in_bf16(now, before, model, self.modules)
        return list(now)

    def is_check_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` (counted from 0) reads the casts."""
        return step % self.check_interval == 0

    def start_check(self) -> None:
        """Read the casts of every FP8 layer until :meth:`finish_check` (call before the step's first forward)."""
        self._place()
        self._run.reading = bool(self._guards)

    def finish_check(
        self, reduce: Callable[[Tensor], Tensor] | None = None, warn: Callable[[str], None] | None = None
    ) -> FP8Check:
        """Read the check step's casts (one host sync), apply the fallback rule, and fall back the layers it names.

        The layers' places in the forward order not known yet are read first (one more host read, while any is).

        With ``fallback=None``, a layer the rule names (more than 1% flushed at two readings in a row) is warned about
        instead, once.

        Args:
            reduce: applied to the counts before they are read (e.g. a SUM all-reduce across data-parallel ranks, so
                that every rank falls back the same layers).
            warn: says that a layer fell back (default: a ``UserWarning``; a plugin passes rank zero's warning).
        """
        self._run.reading = False
        self._note_positions()
        readings = self._take_readings(reduce)
        due = self.rule.update(readings)
        worst = worst_flush(readings)
        falls = self.rule.threshold_pct is not None
        for name in due:
            reading = worst[name]
            said = (
                f"FP8 layer `{name}` flushed {reading.flushed_pct:.2f}% of its {reading.cast} cast's nonzero values "
                f"to zero at {self.rule.in_a_row} readings in a row (above {self.rule.limit_pct:g}%)"
            )
            if falls:
                self.fall_back(name)
                message = f"{said}: it computes in bf16 from now on, over the same parameters and optimizer state."
            else:
                message = (
                    f"{said}; with fp8_fallback=None it stays in FP8. Pass fp8_fallback={self.rule.limit_pct:g} to "
                    "send such a layer back to bf16, or keep it out of FP8 with fp8_modules. Said once per layer."
                )
            if warn is None:
                warnings.warn(message, UserWarning, stacklevel=2)
            else:
                warn(message)
        return FP8Check(readings, due if falls else [])

    def _take_readings(self, reduce: Callable[[Tensor], Tensor] | None) -> list[CastReading]:
        guards = self._in_forward_order()
        if not guards:
            return []
        keys, rows, grads = [], [], []
        for guard in guards:
            keys += [(guard.name, cast.name) for cast in guard.casts]
            carried = guard.count_sink.grad
            # The forward rows added in place (forwards without backward) on top of those carried to backward.
            padded = torch.nn.functional.pad(guard.counts, (0, 0, 0, len(guard.casts) - guard.forward_casts))
            rows.append(padded if carried is None else carried + padded)
            grads += [] if carried is None else [carried]
        device = rows[0].device
        counts = torch.cat([row.to(device) for row in rows])
        torch._foreach_zero_([*(guard.counts for guard in guards), *grads])
        return readings_of(keys, counts, reduce)

    def _note_positions(self) -> None:
        """Read the stamps of the layers whose place is not known yet (one host read, if any)."""
        unknown = [guard for guard in self._guards.values() if guard.position < 0]
        if not unknown:
            return
        device = unknown[0].stamp.device
        stamps = torch.stack([guard.stamp.to(device) for guard in unknown]).tolist()
        for guard, stamp in zip(unknown, stamps, strict=True):
            guard.position = stamp

    def _in_forward_order(self) -> list[LayerGuard]:
        """The FP8 layers' guards, those stamped in the order they first ran, then the others by name."""
        guards = list(self._guards.values())
        ran = sorted((guard for guard in guards if guard.position >= 0), key=lambda guard: guard.position)
        return ran + sorted((guard for guard in guards if guard.position < 0), key=lambda guard: guard.name)

    def before_forward(self) -> None:
        """Before each training forward (each micro-batch's): arm the readings if the coming step is a check step.

        The coming step is the number of steps :meth:`after_step` has seen (a check every ``check_interval`` steps,
        from step 0); once armed, the readings stay on until :meth:`after_step`, so micro-batches add up. The first
        call after a conversion places the flags on the layers' devices.
        """
        if self._run.device is None:
            self._place()
        if self.is_check_step(self._steps) and not self._run.reading:
            self.start_check()

    def _place(self) -> None:
        for name, guard in self._guards.items():
            guard.place(self._layers[name].weight.device)
            self._run.device = guard.flag.device

    def after_step(
        self,
        outcome: Outcome | None = None,
        *,
        reduce: Callable[[Tensor], Tensor] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> FP8Check | None:
        """After each optimizer step, skipped or not: the check's readings, the non-finite flags kept, the step counted.

        1. If the readings are armed (a check step, or :meth:`start_check` called by someone), they are read and the
           fallback rule applied (:meth:`finish_check`); the result is returned and kept in :attr:`checks`. Else, at
           the first step after a conversion, the layers' places in the forward order it stamped are read (one host
           read, once).
        2. If the step was skipped (``outcome.skipped``), its flags are kept for :meth:`nonfinite_layers`, which reads
           them from the device only when asked, for the steps skipped for non-finite gradients
           (``outcome.overflowed``). Where the skip is still on the device (a fused optimizer's pending step:
           ``outcome.resolved`` is false), the flags are kept without reading it.
        3. The flags are cleared; with the weights all-gathered in FP8 under FSDP2, their scales are computed for the
           next all-gather (torchao's ``precompute_float8_dynamic_scale_for_fsdp``: one all-reduce).

        Args:
            outcome: what became of the step (``.resolved``, ``.skipped``, ``.overflowed``); ``None`` for a step
                known to be applied.
            reduce: applied on the device to the readings' counts and to the kept flags (a SUM all-reduce across
                data-parallel ranks: every rank falls back the same layers and names the layers any rank's casts
                met). Every rank must call this method at every step.
            warn: says that a layer fell back (see :meth:`finish_check`).
        """
        check = None
        if self._run.reading:
            found = self.finish_check(reduce, warn)
            check = FP8Check(found.readings, found.fell_back, self._steps)
            self.checks.append(check)
        elif self._run.ordering:
            self._note_positions()  # the first step after a conversion, if not a check step (finish_check read them)
        if outcome is not None and (not outcome.resolved or outcome.skipped):
            # A step known to be skipped is read with its weights; one whose fate is on the device, without (a pass
            # over every weight at every step would cost more than the step's flags). A spike the guard skipped is
            # kept too: which skips were overflows is asked when the names are.
            kept = [(earlier, names) for earlier, names in self._kept if not earlier.resolved or earlier.overflowed]
            last = max((i for i, (earlier, _) in enumerate(kept) if earlier.resolved), default=0)
            self._kept = [*kept[last:], (outcome, self._snapshot(outcome.resolved, reduce))]
        self.end_step()
        if self._all_gather and self._guards:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(nn.ModuleList(self.layers.values()))
        self._steps += 1
        return check

    def nonfinite_layers(self) -> list[str]:
        """The FP8 layers whose casts met a NaN or inf, the origin first.

        Those of the step under way (since the last :meth:`end_step`) if any; else those of the last step
        :meth:`after_step` saw skipped for non-finite gradients (``[]`` if none). One host sync (one more while a
        layer's place in the forward order is not known): read it when a step is known to be skipped.
        """
        self._note_positions()
        current = self._snapshot(with_weights=True)()
        if current:
            return current
        for outcome, names in reversed(self._kept):
            if outcome.overflowed:
                return names()
        return []

    def _snapshot(
        self, with_weights: bool, reduce: Callable[[Tensor], Tensor] | None = None
    ) -> Callable[[], list[str]]:
        """The flags now, on the device: forward in forward order (a non-finite weight counts), backward in reverse."""
        guards = self._in_forward_order()
        forward = []
        for guard in guards:
            carried = guard.forward_sink.grad
            flag = guard.flag if carried is None else guard.flag + carried
            if with_weights:
                weight = self._layers[guard.name].weight
                # A DTensor (FSDP2's sharded weight): this rank's shard, whose values are the rank's to check.
                local = weight.to_local() if type(weight).__name__ == "DTensor" else weight  # type: ignore[attr-defined]
                weight_flag = nonfinite_flag(local.detach())
                flag = flag.to(weight_flag.device) + weight_flag
            forward.append((guard.name, flag))
        backward = [
            (guard.name, guard.backward_sink.detach() if guard.backward_sink.grad is None else guard.backward_sink.grad)
            for guard in reversed(guards)
        ]
        return snapshot(forward, backward, reduce)

    def end_step(self) -> None:
        """Clear the non-finite flags (no sync): after every optimizer step, skipped or not.

        The first step after a conversion ends its stamping of the forward order here too (the stamps stay on the
        device until read).
        """
        self._run.ordering = False
        flags = [guard.flag for guard in self._guards.values()]
        for guard in self._guards.values():
            flags += [sink.grad for sink in (guard.forward_sink, guard.backward_sink) if sink.grad is not None]
        if flags:
            torch._foreach_zero_(flags)

    def fall_back(self, name: str) -> None:
        """Send FP8 layer ``name`` back to bf16 over the same Parameters, and record it.

        The layer becomes what it would be had it never been converted: a plain ``nn.Linear``, or the class a
        wrapper gives one (FSDP2's ``FSDPLinear``; :func:`~lightning_amp_plus.weights.fp8.convert.fall_back`).

        Raises:
            KeyError: ``name`` is not an FP8 layer.
        """
        if name not in self._guards:
            raise KeyError(f"{name!r} is not an FP8 layer; FP8 layers: {sorted(self._guards)}.")
        fall_back(self._layers[name])
        del self._guards[name]
        self._fallen.append(name)

    def state_dict(self) -> dict[str, Any]:
        """Plain values: the steps counted, the layers fallen back and the rule's counts."""
        return {
            "version": STATE_VERSION,
            "steps": self._steps,
            "fallen_back": list(self._fallen),
            **self.rule.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`: the recorded layers fall back now if converted, or are never converted.

        A version-1 state (written before the steps counted were saved) restores its layers and counts and counts the
        steps from 0 at this resume, which a warning says: the check steps may then come at other steps than in the
        run that saved it.

        Raises:
            ValueError: the state is not one :meth:`state_dict` wrote.
        """
        version, fallen, steps = state.get("version"), state.get("fallen_back"), state.get("steps", 0)
        shape = isinstance(fallen, list) and all(isinstance(n, str) for n in fallen)
        counted = isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0
        if version not in (1, STATE_VERSION) or not shape or not counted or (version == 2 and "steps" not in state):
            raise ValueError(
                f"Not an FP8 training state (version 1 or 2, 'fallen_back': [names], 'steps': an int >= 0 in version "
                f"2): {show(dict(state))}."
            )
        assert isinstance(fallen, list) and isinstance(steps, int)  # checked above
        fallen = [plain_name(name) for name in fallen]  # as saved before names lost checkpointing's wrapper part
        self.rule.load_state_dict(state)
        self._steps = steps
        if version == 1:
            warnings.warn(
                "The FP8 state was saved by an earlier version (version 1), which did not save the steps counted: the "
                f"fallen-back layers {fallen} and the fallback rule's counts are restored, and the readings count "
                f"steps from 0 at this resume, so the check steps (every {self.check_interval}) may come at other "
                "steps than in the run that saved it.",
                UserWarning,
                stacklevel=2,
            )
        live = self.layers
        # Loaded after a conversion, a recorded name should be one of the converted layers.
        missing = [name for name in fallen if name not in live and name not in self._fallen] if self._layers else []
        for name in fallen:
            if name in live:
                self.fall_back(name)
            elif name not in self._fallen:
                self._fallen.append(name)
        if missing:
            warnings.warn(
                f"The FP8 state records fallen-back layers this model has not converted: {missing}.",
                UserWarning,
                stacklevel=2,
            )
