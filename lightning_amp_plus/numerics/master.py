"""FP32 master weights for a model that computes in fp16/bf16: the numerics, without Lightning.

The model's own parameters *are* the masters. Between optimizer steps every managed parameter holds its FP32 value,
so the optimizer steps the model's own ``Parameter`` objects, ``state_dict()`` returns them, and everything else that
touches the model (callbacks that average, load or freeze weights, the optimizer's param groups) sees what it would see
in an FP32 model. For the forward and backward of a step, :class:`HalfCopies` swaps the data of each parameter of the
layers autocast runs in half (:func:`managed_parameters`) for a half copy made once (:meth:`HalfCopies.narrow_`), so:

* the weights take 2 bytes each while activations are made, and no per-forward weight casts are needed (autocast finds
  them in the half dtype already, however many micro-batches a step accumulates);
* the gradients arrive in the half dtype (2 bytes each).

At the optimizer step, :meth:`HalfCopies.widen_` gives each parameter its FP32 data back and widens its half gradient
into an FP32 gradient, one tensor at a time (so the two never coexist in full): the optimizer then steps FP32 weights
with FP32 gradients, and updates far smaller than a half weight's spacing (1/2048 of the weight in fp16, 1/256 in bf16)
are kept.

The swap changes only ``param.data``: the ``Parameter`` objects, and with them every reference held elsewhere, stay the
same, and so does each tensor's memory format (a ``channels_last`` weight stays ``channels_last``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "HALF_DTYPES",
    "HalfCopies",
    "default_half_modules",
    "managed_parameters",
    "repeated_uses",
    "rnn_modules",
    "widen_to_fp32_",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)
# Parameters of these dtypes get FP32 masters; float64 (asked for on purpose) and non-floating ones are left alone.
_MANAGED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def default_half_modules() -> tuple[type[nn.Module], ...]:
    """The module types whose parameters compute from half copies by default: the layers autocast runs in half.

    For these, autocast casts the weights to the half dtype at every use anyway (Lightning's ``*-mixed``), so a half
    copy made once per step computes exactly the same values. Every other parameter (normalisation layers, embeddings,
    a learned positional table added elementwise, a custom module's own weights) stays FP32, and autocast treats it
    as under ``*-mixed``.

    Example:
        >>> nn.Linear in default_half_modules(), nn.LayerNorm in default_half_modules()
        (True, False)
    """
    return (
        nn.Linear,
        nn.Bilinear,
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
        nn.ConvTranspose1d,
        nn.ConvTranspose2d,
        nn.ConvTranspose3d,
        nn.MultiheadAttention,
        nn.RNNBase,
    )


def managed_parameters(
    module: nn.Module,
    half_modules: Sequence[type[nn.Module]] | None = None,
    keep_fp32: Sequence[type[nn.Module]] = (),
) -> list[nn.Parameter]:
    """The parameters of ``module`` that compute from half copies, each once (tied parameters are one object).

    A parameter is managed when it is floating (fp32, fp16 or bf16), every module that owns it is one of the
    ``half_modules`` types (default: :func:`default_half_modules`; ``(nn.Module,)`` for all), and none of its owners
    lies inside a subtree rooted at a ``keep_fp32`` type. A tied parameter (reachable under several names) is managed
    only if all of its owners qualify: an LM decoder tied to its embedding stays FP32 with the embedding.

    Example:
        >>> lm = nn.ModuleDict({"emb": nn.Embedding(10, 4), "proj": nn.Linear(4, 4), "out": nn.Linear(4, 10)})
        >>> lm["out"].weight = lm["emb"].weight  # tied
        >>> [n for n, p in lm.named_parameters() if any(p is q for q in managed_parameters(lm))]
        ['proj.weight', 'proj.bias', 'out.bias']
        >>> len(managed_parameters(lm, half_modules=(nn.Module,)))
        4
    """
    half = default_half_modules() if half_modules is None else tuple(half_modules)
    keep = tuple(keep_fp32)
    refused: set[int] = set()
    ordered: dict[int, nn.Parameter] = {}
    for owner, kept in _modules_with_kept_flag(module, keep):
        for param in owner.parameters(recurse=False):
            ordered.setdefault(id(param), param)
            if kept or not isinstance(owner, half) or param.dtype not in _MANAGED_DTYPES:
                refused.add(id(param))
    return [param for key, param in ordered.items() if key not in refused]


def _modules_with_kept_flag(module: nn.Module, keep: tuple[type[nn.Module], ...]) -> Iterator[tuple[nn.Module, bool]]:
    """``(submodule, inside a keep subtree)`` for ``module`` and all its descendants (each module once)."""
    seen: set[int] = set()
    stack = [(module, False)]
    while stack:
        current, inside = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        inside = inside or (bool(keep) and isinstance(current, keep))
        yield current, inside
        stack.extend((child, inside) for child in reversed(list(current.children())))


@torch.no_grad()
def widen_to_fp32_(params: Iterable[Tensor]) -> None:
    """Make the data of each parameter not in FP32 yet an FP32 copy (the ``Parameter`` objects stay the same).

    Example:
        >>> w = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> widen_to_fp32_([w]); w.dtype
        torch.float32
    """
    for param in params:
        if param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)


def repeated_uses(output: Tensor, params: Iterable[Tensor]) -> dict[Tensor, int]:
    """How many times each of ``params`` feeds the autograd graph of ``output``, where that is more than once.

    Autograd sums the gradients of a tensor's uses inside one backward in the tensor's own dtype: for a parameter
    holding its half copy, in the half dtype (one rounding per extra use), where an FP32 weight cast per use by
    autocast gets them summed in FP32. One walk over the graph, without running it.

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> out = lin(torch.tanh(lin(torch.ones(1, 2)))).sum()  # the layer applied twice
        >>> {name: n for name, p in lin.named_parameters() for q, n in repeated_uses(out, [p]).items()}
        {'weight': 2, 'bias': 2}
    """
    wanted = {id(p): p for p in params}
    counts: dict[int, int] = {}
    seen: set[Any] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            leaf = getattr(child, "variable", None)  # an AccumulateGrad node: the edge into a leaf
            if leaf is not None:
                if id(leaf) in wanted:
                    counts[id(leaf)] = counts.get(id(leaf), 0) + 1
            elif child is not None:
                stack.append(child)
    return {wanted[key]: count for key, count in counts.items() if count > 1}


class HalfCopies:
    """Swap managed parameters between their FP32 data (between steps) and a half copy (forward and backward).

    Args:
        params: the managed parameters (see :func:`managed_parameters`). Any already in fp16/bf16 are widened to FP32
            here: from now on their FP32 value is the master.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        rnn_modules: RNN modules among the owners: after narrowing, their weights are flattened again into the one
            contiguous chunk cuDNN wants (a no-op off CUDA).

    Example:
        >>> w = nn.Parameter(torch.ones(1))
        >>> copies, opt = HalfCopies([w], torch.float16), torch.optim.SGD([w], lr=1e-4)
        >>> for _ in range(1000):
        ...     copies.narrow_()                  # forward and backward see an fp16 weight
        ...     (-w).sum().backward()             # an fp16 gradient of -1
        ...     copies.widen_()                   # FP32 weight, FP32 gradient
        ...     _ = opt.step(); opt.zero_grad()
        >>> w.dtype, round(w.item(), 4)           # fp16 alone would stay at 1.0: 1e-4 is under its spacing
        (torch.float32, 1.1)
    """

    def __init__(self, params: Iterable[Tensor], dtype: torch.dtype, rnn_modules: Sequence[nn.RNNBase] = ()) -> None:
        if dtype not in HALF_DTYPES:
            raise ValueError(f"`HalfCopies(dtype={dtype})` takes torch.float16 or torch.bfloat16.")
        self.dtype = dtype
        self.params: list[Tensor] = list({id(p): p for p in params}.values())
        self._rnns = list(rnn_modules)
        # Each parameter's FP32 data while it holds its half copy, and its version counter right after narrowing: a
        # later change means somebody wrote into the half copy in place, and that write must not be lost.
        self._fp32: dict[Tensor, Tensor] = {}
        self._versions: dict[Tensor, int] = {}
        self._handles: list[RemovableHandle] = []
        widen_to_fp32_(self.params)

    def __deepcopy__(self, memo: dict[int, Any]) -> HalfCopies:
        # A deep copy of the model (e.g. StochasticWeightAveraging's averaged model) copies the state-dict hooks that
        # point here; the copy's parameters are never managed, so sharing this object leaves them alone.
        return self

    # ------------------------------------------------------------------------------------------------ queries
    def holds_half(self, param: Tensor) -> bool:
        """Whether ``param`` currently holds its half copy."""
        return param in self._fp32

    # ------------------------------------------------------------------------------------------------- swaps
    @torch.no_grad()
    def narrow_(self, drop_grads: bool = False) -> None:
        """Give every parameter that holds FP32 data a half copy of it (the FP32 data is kept aside).

        Its gradient, if any, stays as it is, in FP32 (a backward adds its half gradients into it in FP32, as into an
        FP32 parameter's gradient, and ``zero_grad()`` clears it), unless ``drop_grads``: the caller knows it would
        be zeroed before the next backward anyway (Lightning's automatic optimization, at the start of a step), and
        freeing it first keeps its 4 bytes per parameter out of the forward.
        """
        narrowed = []
        for param in self.params:
            if param in self._fp32:
                continue
            if drop_grads:
                param.grad = None
            fp32 = param.data
            param.data = fp32.to(self.dtype)  # memory format preserved
            self._fp32[param] = fp32
            narrowed.append(param)
        if narrowed:
            for rnn in self._rnns:
                rnn.flatten_parameters()
        for param in narrowed:
            self._versions[param] = param._version

    @torch.no_grad()
    def widen_(self, params: Iterable[Tensor] | None = None) -> None:
        """Give ``params`` (default: all) their FP32 data back; each half gradient becomes an FP32 gradient.

        One tensor at a time: each half copy and half gradient is released as soon as its FP32 gradient exists. A
        parameter whose half copy was written in place since :meth:`narrow_` keeps what was written.
        """
        for param in self.params if params is None else params:
            fp32 = self._fp32.pop(param, None)
            if fp32 is None:
                continue
            if param._version != self._versions.pop(param):
                fp32.copy_(param.data)
            param.data = fp32
            grad = param.grad
            if grad is not None and grad.dtype != torch.float32:
                param.grad = grad.to(torch.float32)

    def widen_idle_(self) -> None:
        """Widen every parameter that holds no gradient yet (frozen ones, or ones no backward reached)."""
        self.widen_([p for p in self._fp32 if p.grad is None])

    @torch.no_grad()
    def widen_grads_(self) -> None:
        """Turn the half gradients of the half parameters into FP32 gradients (4 bytes per parameter).

        Called before a backward that adds to gradients already there (gradient accumulation), it makes that backward
        add its half gradients into FP32 sums (autograd accumulates into a gradient of another dtype in place), so each
        micro-batch's gradient is rounded to the half dtype once and summed in FP32, as Lightning's ``*-mixed``
        accumulation does.
        """
        for param in self._fp32:
            grad = param.grad
            if grad is not None and grad.dtype != torch.float32:
                # `.data` of the gradient, not `param.grad = ...`: assigning checks the dtype against the parameter's.
                grad.data = grad.to(torch.float32)

    # ---------------------------------------------------------------------------------------------- state dicts
    def hook_state_dicts(self, module: nn.Module) -> None:
        """Keep ``state_dict()`` and ``load_state_dict()`` of ``module`` (and its submodules) in FP32 at all times.

        While a parameter holds its half copy, ``state_dict()`` returns its FP32 data instead, and ``load_state_dict()``
        widens it first, so the loaded values land in FP32 unrounded. Hooks go on every submodule that owns a managed
        parameter, so a submodule's own ``state_dict()`` is covered too; :meth:`unhook` removes them.
        """
        managed = {id(p) for p in self.params}
        for owner in module.modules():
            local: list[tuple[str, Tensor]] = [
                (name, p) for name, p in owner.named_parameters(recurse=False) if id(p) in managed
            ]
            if not local:
                continue
            save = functools.partial(self._save_fp32, local)
            load = functools.partial(self._load_into_fp32, [p for _, p in local])
            self._handles.append(owner.register_state_dict_post_hook(save))  # type: ignore[no-untyped-call]
            self._handles.append(owner.register_load_state_dict_pre_hook(load))  # type: ignore[no-untyped-call]

    def unhook(self) -> None:
        """Remove the hooks :meth:`hook_state_dicts` installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _save_fp32(
        self, local: list[tuple[str, Tensor]], _module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any
    ) -> None:
        for name, param in local:
            if param in self._fp32 and prefix + name in state:
                state[prefix + name] = self._fp32[param]

    def _load_into_fp32(self, params: list[Tensor], _module: nn.Module, *_args: Any) -> None:
        self.widen_(params)


def rnn_modules(module: nn.Module) -> list[nn.RNNBase]:
    """The RNN modules inside ``module`` (their weights must be re-flattened after each narrowing for cuDNN)."""
    return [m for m in module.modules() if isinstance(m, nn.RNNBase)]
