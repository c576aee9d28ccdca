"""FP32 master weights: the model's own parameters hold FP32 at all times; half values live only inside autocast's ops.

Lightning's ``*-mixed`` keeps an FP32 model and lets autocast cast each weight to the half dtype at each use, so the
optimizer always steps FP32 weights (updates far below a half weight's spacing survive) and everything that touches the
model between two uses (a ``training_step``, a hook, a callback, an EMA, a checkpoint) sees and changes FP32 values.
That is the design kept here, for every model: master weights are the model's own ``Parameter`` objects, in FP32.

What ``master_weights=True`` adds is for models that are not FP32: a model built or loaded in half precision
(``model.to(torch.bfloat16)``, ``from_pretrained(torch_dtype=torch.bfloat16)``) has every fp16/bf16 parameter and
floating buffer widened to FP32 once, before training (:func:`widen_model_`); from then on it trains exactly as an FP32
model under ``*-mixed``. Half copies that live *in* the parameters between uses (an earlier design of this package
swapped ``param.data`` for the whole step) leak: user code during the step then reads and writes rounded copies.

Two things can undo the widening, and both are refused rather than trained through: a copy of the model taken while it
was still in half (:func:`refuse_half_copies` looks for one where the plugin can see it), and a half tensor written
into a parameter's ``.data`` later (:func:`refuse_half_masters`, a dtype look-up per parameter before each step).

Examples:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).to(torch.bfloat16)
    >>> widen_model_(model)
    ['0.weight', '0.bias', '1.weight', '1.bias', '1.running_mean', '1.running_var']
    >>> sorted({str(t.dtype) for t in model.state_dict().values()})  # num_batches_tracked is a count: int64
    ['torch.float32', 'torch.int64']
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = [
    "HALF_DTYPES",
    "half_copies",
    "half_master",
    "half_parameters",
    "half_tensors",
    "refuse_half_copies",
    "refuse_half_masters",
    "widen_model_",
    "widen_to_fp32_",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)

# How deep half_copies looks into a holder's attributes (attribute, then dicts, lists and tuples inside it): deep
# enough for a module kept in a dict of records (`{id: {"data": module}}`), shallow enough to stay cheap.
_COPY_DEPTH = 4


def half_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module`` held in fp16 or bf16 (float64 and non-floating ones are left alone), each once.

    Examples:
        >>> lin = nn.Linear(2, 2); lin.weight.data = lin.weight.data.half()
        >>> [p.shape for p in half_parameters(lin)]
        [torch.Size([2, 2])]
    """
    return [param for param in module.parameters() if param.dtype in HALF_DTYPES]


def half_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """The parameters and buffers of ``module`` held in fp16 or bf16, each once, with its name.

    These are what ``module.to(torch.bfloat16)`` (or ``.half()``) made half, and what the masters widen back: floating
    tensors only, because torch never casts an integer or bool tensor (a step counter such as BatchNorm's
    ``num_batches_tracked``, a bool mask) to a floating dtype. float64 tensors were asked for on purpose and stay.

    Examples:
        >>> bn = nn.BatchNorm1d(2).to(torch.float16)
        >>> [name for name, _ in half_tensors(bn)]
        ['weight', 'bias', 'running_mean', 'running_var']
    """
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    return [(name, tensor) for name, tensor in named if tensor.dtype in HALF_DTYPES]


@torch.no_grad()
def widen_to_fp32_(params: Iterable[Tensor]) -> None:
    """Make the data of each tensor not in FP32 yet an FP32 copy (the ``Parameter`` or buffer objects stay the same).

    The objects stay, so every reference to them (an optimizer built before, tied weights, a module that holds a
    buffer) stays valid. A gradient already there is widened too, so that it matches its parameter.

    Examples:
        >>> w = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> widen_to_fp32_([w]); w.dtype
        torch.float32
    """
    for param in params:
        if param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)
            if param.grad is not None:
                param.grad = param.grad.to(torch.float32)


def widen_model_(module: nn.Module) -> list[str]:
    """Widen every fp16/bf16 parameter and floating buffer of ``module`` to FP32, in place; the names widened.

    What the plugins do with ``master_weights=True`` at their first hook. Call it yourself before ``trainer.fit`` when
    a callback copies the model in its ``setup`` (``StochasticWeightAveraging``, ``EMAWeightAveraging``,
    ``ModelPruning`` with the lottery-ticket reset): the Trainer runs the callbacks' ``setup`` before any precision
    plugin hook, so only a model widened before ``fit`` is copied in FP32. The values are kept exactly (every half
    value is an FP32 value); the objects are kept too (see :func:`widen_to_fp32_`).

    Examples:
        >>> lm = nn.Sequential(nn.Embedding(4, 2), nn.LayerNorm(2)).to(torch.bfloat16)
        >>> widen_model_(lm), widen_model_(lm)
        (['0.weight', '1.weight', '1.bias'], [])
    """
    found = half_tensors(module)
    widen_to_fp32_(tensor for _, tensor in found)
    return [name for name, _ in found]


def half_copies(holder: object, module: nn.Module) -> list[str]:
    """Where ``holder`` keeps a half copy of ``module``'s half tensors: attribute paths, e.g. ``['_average_model']``.

    A copy is a module (not one of ``module``'s own) or a tensor, found in ``holder``'s attributes or in the dicts,
    lists and tuples in them (a few levels deep), that holds an fp16/bf16 tensor shaped as one of ``module``'s half
    tensors. Only ``holder``'s own attributes are looked through, nothing is read from a tensor's memory, and no other
    object is entered: this finds the copies a callback keeps of the model it was handed, not every copy there is.

    Examples:
        >>> import copy
        >>> class Averager:  # a callback that copies the model it is handed, as SWA does in `setup`
        ...     def __init__(self, model): self.model, self._average = model, {"copy": copy.deepcopy(model)}
        >>> model = nn.Linear(2, 2).to(torch.bfloat16)
        >>> half_copies(Averager(model), model)
        ["_average['copy']"]
    """
    own = {id(tensor) for tensor in itertools.chain(module.parameters(), module.buffers())}
    own.update(id(submodule) for submodule in module.modules())
    shapes = {(tensor.shape, tensor.dtype) for _, tensor in half_tensors(module)}

    def copies(tensors: Iterable[Tensor]) -> bool:
        return any((t.shape, t.dtype) in shapes for t in tensors if id(t) not in own)

    found: list[str] = []

    def visit(value: Any, path: str, depth: int) -> None:
        if id(value) in own or depth > _COPY_DEPTH:
            return
        if isinstance(value, Tensor):
            if copies([value]):
                found.append(path)
        elif isinstance(value, nn.Module):
            if copies(itertools.chain(value.parameters(), value.buffers())):
                found.append(path)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, f"{path}[{key!r}]", depth + 1)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                visit(item, f"{path}[{index}]", depth + 1)

    if shapes:
        for name, value in getattr(holder, "__dict__", {}).items():
            visit(value, name, 1)
    return found


def refuse_half_copies(owner: str, module: nn.Module, holders: Iterable[object], when: str) -> None:
    """Raise ``ValueError`` if one of ``holders`` keeps a half copy of ``module`` (:func:`half_copies`).

    Called before ``module`` is widened: what such a copy averages or restores into the FP32 masters later is rounded
    to the half dtype, silently. ``when`` says where the copy was made (``"in a `setup` hook (...)"``).

    Examples:
        >>> import copy
        >>> class Snapshot:
        ...     def __init__(self, model): self.start = copy.deepcopy(model)
        >>> model = nn.Linear(2, 2).to(torch.bfloat16)
        >>> refuse_half_copies("Plugin", model, [Snapshot(model)], "when it was built")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Plugin(master_weights=True): Snapshot holds a torch.bfloat16 copy of the model (`start`), made ...
    """
    for holder in holders:
        paths = half_copies(holder, module)
        if paths:
            dtype = next(tensor.dtype for _, tensor in half_tensors(module))
            raise ValueError(
                f"{owner}(master_weights=True): {type(holder).__name__} holds a {dtype} copy of the model "
                f"({', '.join(f'`{path}`' for path in paths)}), made {when} while the model was still {dtype}. "
                f"What it averages or restores into the FP32 master weights would be rounded to {dtype}. Widen the "
                "model before training: `lightning_amp_plus.weights.master.widen_model_(model)` before "
                "`trainer.fit(model)` (or load the model in FP32), so that every copy is FP32."
            )


def half_master(optimizer: Optimizer) -> Tensor | None:
    """The first parameter ``optimizer`` steps that is held in fp16/bf16, or ``None``: a dtype look-up per parameter.

    Examples:
        >>> w = nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> half_master(opt) is None
        True
        >>> w.data = w.data.bfloat16(); half_master(opt) is w
        True
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.dtype in HALF_DTYPES:
                return param  # type: ignore[no-any-return]
    return None


def refuse_half_masters(owner: str, optimizer: Optimizer, names: Callable[[], Iterable[tuple[str, Tensor]]]) -> None:
    """Raise ``RuntimeError`` before ``optimizer`` steps a master that someone turned back into fp16/bf16.

    The masters are FP32 from the first hook on, so a half parameter at a step means its data was replaced since
    (``param.data = half_tensor``): a callback restoring weights from a copy taken while the model was still in half
    (``ModelPruning``'s lottery-ticket reset does ``dst.data = src.data``). Widening it back would be exact as a value
    (every half value is an FP32 value), but nothing proves the half value is what the master held: a writer that
    rounded the master through half lost its low bits, and training on would hide that. So the step is refused, with
    the parameter, the dtype, the likely writer and the fix; the optimizer never sees mixed dtypes. ``names`` gives
    the parameters' names (called only to write the message).

    Examples:
        >>> w = nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1)
        >>> refuse_half_masters("Plugin", opt, lambda: [("w", w)])  # FP32: nothing to say
        >>> w.data = w.data.half()
        >>> refuse_half_masters("Plugin", opt, lambda: [("w", w)])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: Plugin(master_weights=True): the parameter `w` is torch.float16 at this optimizer step, ...
    """
    param = half_master(optimizer)
    if param is None:
        return
    name = next((f"`{name}`" for name, tensor in names() if tensor is param), f"of shape {tuple(param.shape)}")
    raise RuntimeError(
        f"{owner}(master_weights=True): the parameter {name} is {param.dtype} at this optimizer step, but the master "
        "weights are FP32: its data was replaced by a half tensor since it was widened (`param.data = half_tensor`), "
        "most likely by a callback that restores weights from a copy made while the model was still in half "
        "(ModelPruning's lottery-ticket reset does `dst.data = src.data`). Stepping it would round the master to "
        f"{param.dtype} and mix dtypes in the optimizer. Widen the model before training "
        "(`lightning_amp_plus.weights.master.widen_model_(model)` before `trainer.fit` or `fabric.setup`) so that "
        "every copy is FP32, or restore weights in place (`param.data.copy_(source)` keeps the FP32 master)."
    )
