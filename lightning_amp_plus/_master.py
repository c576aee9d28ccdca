"""FP32 master weights for a model that computes in fp16/bf16: the numerics, without Lightning.

The model's own parameters *are* the masters. Between optimizer steps every managed parameter holds its FP32 value,
so the optimizer steps the model's own ``Parameter`` objects, ``state_dict()`` returns them, and everything else that
touches the model (callbacks that average, load or freeze weights, the optimizer's param groups) sees what it would see
in an FP32 model. For the forward and backward of a step, :class:`HalfCopies` swaps each parameter's data for a half
copy made once (:meth:`HalfCopies.narrow_`), so:

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
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HALF_DTYPES", "HalfCopies", "default_fp32_modules", "managed_parameters", "rnn_modules"]

HALF_DTYPES = (torch.float16, torch.bfloat16)
# Parameters of these dtypes get FP32 masters; float64 (asked for on purpose) and non-floating ones are left alone.
_MANAGED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def default_fp32_modules() -> tuple[type[nn.Module], ...]:
    """The module types whose parameters stay FP32 by default: normalisation layers and embeddings.

    Normalisation layers need FP32's precision for their statistics and small affine parameters, and their kernels
    accept half inputs with FP32 weights. Embeddings run outside autocast's casts in Lightning's ``*-mixed`` modes
    (FP32 lookups), and their gradient sums rows that repeat in a batch: kept FP32, that sum is taken in FP32 as there.

    Example:
        >>> nn.LayerNorm in default_fp32_modules(), nn.Embedding in default_fp32_modules()
        (True, True)
    """
    from torch.nn.modules.batchnorm import _NormBase  # BatchNorm*, SyncBatchNorm, InstanceNorm*

    return (_NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm, nn.Embedding, nn.EmbeddingBag)


def managed_parameters(module: nn.Module, keep_fp32: Sequence[type[nn.Module]] | None = None) -> list[nn.Parameter]:
    """The parameters of ``module`` that compute in the half dtype, each once (tied parameters are one object).

    A parameter is managed when it is floating (fp32, fp16 or bf16) and no module that owns it is one of the
    ``keep_fp32`` types. With ``keep_fp32=None`` (the default set, :func:`default_fp32_modules`) a parameter reachable
    under more than one name (tied weights, e.g. an LM's decoder sharing the embedding) stays FP32 too: autograd sums
    the gradients of its uses inside one backward, and that sum is then taken in FP32, as under ``*-mixed``. An explicit
    ``keep_fp32`` (``()`` for a pure half model) is taken literally.

    Example:
        >>> lm = nn.ModuleDict({"emb": nn.Embedding(10, 4), "proj": nn.Linear(4, 4), "out": nn.Linear(4, 10)})
        >>> lm["out"].weight = lm["emb"].weight  # tied
        >>> [n for n, p in lm.named_parameters() if any(p is q for q in managed_parameters(lm))]
        ['proj.weight', 'proj.bias', 'out.bias']
        >>> len(managed_parameters(lm, keep_fp32=()))
        4
    """
    keep = default_fp32_modules() if keep_fp32 is None else tuple(keep_fp32)
    kept: set[int] = set()
    seen: dict[int, int] = {}
    ordered: list[nn.Parameter] = []
    for owner in module.modules():
        for param in owner.parameters(recurse=False):
            seen[id(param)] = seen.get(id(param), 0) + 1
            if keep and isinstance(owner, keep):
                kept.add(id(param))
            if seen[id(param)] == 1:
                ordered.append(param)
    tied = {key for key, count in seen.items() if count > 1} if keep_fp32 is None else set()
    return [p for p in ordered if p.dtype in _MANAGED_DTYPES and id(p) not in kept and id(p) not in tied]


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
        # FP32 gradient sums between micro-batches (`accumulate_grads_`).
        self._fp32_grads: dict[Tensor, Tensor] = {}
        # Parameters whose `.grad` is what the last optimizer step used: dropped, not narrowed, at the next narrowing.
        self._stepped: set[Tensor] = set()
        self._handles: list[RemovableHandle] = []
        with torch.no_grad():
            for param in self.params:
                if param.dtype != torch.float32:
                    param.data = param.data.to(torch.float32)

    def __deepcopy__(self, memo: dict[int, Any]) -> HalfCopies:
        # A deep copy of the model (e.g. StochasticWeightAveraging's averaged model) copies the state-dict hooks that
        # point here; the copy's parameters are never managed, so sharing this object leaves them alone.
        return self

    # ------------------------------------------------------------------------------------------------ queries
    def holds_half(self, param: Tensor) -> bool:
        """Whether ``param`` currently holds its half copy."""
        return param in self._fp32

    @property
    def any_half(self) -> bool:
        """Whether some parameter holds its half copy."""
        return bool(self._fp32)

    def fp32_data(self, param: Tensor) -> Tensor:
        """The FP32 value of ``param`` (its data between steps, its kept FP32 data while it holds the half copy)."""
        return self._fp32.get(param, param.data)

    # ------------------------------------------------------------------------------------------------- swaps
    @torch.no_grad()
    def narrow_(self) -> None:
        """Give every parameter that holds FP32 data a half copy of it (the FP32 data is kept aside).

        A gradient that the last optimizer step used is dropped (the next backward starts a new sum; Lightning would
        zero it before that backward anyway). Any other gradient (a sum still accumulating, widened early, e.g. by a
        ``load_state_dict`` in the middle of an accumulation cycle) is kept as an FP32 sum that the next backward's
        half gradients are added to, unrounded.
        """
        narrowed = []
        for param in self.params:
            if param in self._fp32:
                continue
            grad, fp32 = param.grad, param.data
            if grad is not None:
                param.grad = None
                if param not in self._stepped:
                    self._fp32_grads[param] = grad
            param.data = fp32.to(self.dtype)  # memory format preserved
            self._fp32[param] = fp32
            narrowed.append(param)
        self._stepped.difference_update(narrowed)
        if narrowed:
            for rnn in self._rnns:
                rnn.flatten_parameters()
        for param in narrowed:
            self._versions[param] = param._version

    @torch.no_grad()
    def widen_(self, params: Iterable[Tensor] | None = None, *, for_step: bool = False) -> None:
        """Give ``params`` (default: all) their FP32 data back; each half gradient becomes an FP32 gradient.

        One tensor at a time: each half copy and half gradient is released as soon as its FP32 gradient exists. A
        parameter whose half copy was written in place since :meth:`narrow_` keeps what was written.

        Args:
            params: the parameters to widen (those that hold FP32 already are skipped).
            for_step: the gradients are for an optimizer step (they are then dropped at the next :meth:`narrow_`).
        """
        for param in self.params if params is None else params:
            fp32 = self._fp32.pop(param, None)
            if fp32 is None:
                continue
            if param._version != self._versions.pop(param):
                fp32.copy_(param.data)
            grad = param.grad
            param.data = fp32
            total = self._fp32_grads.pop(param, None)
            if grad is not None:
                total = grad.to(torch.float32) if total is None else total.add_(grad)
            param.grad = total
            if for_step and total is not None:
                self._stepped.add(param)

    def widen_idle_(self) -> None:
        """Widen every parameter that holds no gradient yet (frozen ones, or ones no backward reached)."""
        self.widen_([p for p in self._fp32 if p.grad is None and p not in self._fp32_grads])

    @torch.no_grad()
    def accumulate_grads_(self) -> None:
        """Move the half gradients into FP32 sums kept between micro-batches (4 bytes per parameter).

        Called after each backward, each micro-batch's gradient is rounded to the half dtype once and summed in FP32,
        as Lightning's ``*-mixed`` accumulation does; :meth:`widen_` hands the sums over.
        """
        for param in self._fp32:
            grad = param.grad
            if grad is None:
                continue
            total = self._fp32_grads.get(param)
            if total is None:
                self._fp32_grads[param] = grad.to(torch.float32)
            else:
                total.add_(grad)
            param.grad = None

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
