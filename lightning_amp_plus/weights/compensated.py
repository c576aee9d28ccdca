"""Compensated bf16 weights: the memory of pure bf16 training without losing the updates too small for bf16.

A bf16 weight keeps 8 significant bits, so an update smaller than half its spacing (1/512 of the weight, relative) is
rounded away: plain ``bf16-true`` training stalls when the learning rate is small. :class:`Compensator` steps the
user's own ``torch.optim.AdamW``, ``Adam`` or ``SGD`` whose parameters are bf16, in place of ``optimizer.step()``:
each update is computed in FP32 from the widened weight, gradient and states, with torch's own formulas in torch's
order of operations, then written back to bf16 in one of two ways:

* ``"kahan"``: the weight rounds to nearest and the rounding error goes into a bf16 compensation buffer, added back at
  the next step (weight + buffer carry about 16 significant bits); 2 more bytes per parameter.
* ``"stochastic"``: the weight rounds up or down with probability proportional to the distance, so every update
  survives in expectation; no buffer, a random stream per device (seeded: replicas round alike under DDP).

The optimizer's ``state`` keeps torch's keys and format (``step``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``),
so its checkpoint loads into a stock optimizer; the first moment (and SGD's momentum) is kept in bf16 and the second
moment in FP32 by default (the choice, measured, is in the class docstring). Parameters that are not bf16 (FP32 ones
left so on purpose) are stepped by the optimizer's own ``step()``, exactly as torch steps them.

Examples:
    >>> w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    >>> opt = torch.optim.SGD([w], lr=1e-4)
    >>> compensator = Compensator(opt, "kahan")
    >>> for _ in range(1000):
    ...     w.grad = -torch.ones_like(w)
    ...     compensator.step()
    >>> w.tolist()  # 1.1 as bf16 holds it; plain bf16 SGD stays at [1.0, 1.0, 1.0]
    [1.1015625, 1.1015625, 1.1015625]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from lightning_amp_plus._checks import check_int, show
from lightning_amp_plus.step.positions import ByPosition
from lightning_amp_plus.step.sharding import local_view

__all__ = [
    "Compensator",
    "Compensators",
    "Footprint",
    "Method",
    "footprint",
    "per_model_parameter",
    "round_stochastically",
]

Method = Literal["kahan", "stochastic"]
# Exact types: a subclass may override step() with another algorithm, which the compensated math would silently replace.
SUPPORTED = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
STATE_DTYPES = (torch.bfloat16, torch.float32)
# Options of torch's param groups that the compensated path does not implement, and the value it needs.
_UNSUPPORTED_OPTIONS = {"amsgrad": False, "capturable": False, "differentiable": False}
# The low 16 bits of an FP32 number are what bf16 drops; this mask (0xFFFF0000 as an int32) keeps the rest.
_HIGH_HALF = -(1 << 16)


def round_stochastically(value: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Round FP32 ``value`` to bf16, up or down with probability proportional to the distance (unbiased).

    Adds a uniform random integer in ``[0, 2**16)`` to the low 16 bits of each FP32 bit pattern and drops them: the
    magnitude rounds up exactly when the addition carries, with probability (dropped bits) / 2**16, so the expected
    result is ``value`` itself and the result is always one of its two bf16 neighbours. Sign-magnitude bit patterns
    make it work for negative numbers alike; the carry into the exponent gives the next binade (or inf past the largest
    bf16, as rounding up must).

    Examples:
        >>> x = torch.full((10_000,), 1.0 + 2**-9)  # a quarter of the way from bf16's 1.0 to 1.0078125
        >>> y = round_stochastically(x, torch.Generator().manual_seed(0))
        >>> sorted(set(y.tolist())), round(y.double().mean().item(), 3)
        ([1.0, 1.0078125], 1.002)
    """
    noise = torch.randint(0, 1 << 16, value.shape, dtype=torch.int32, device=value.device, generator=generator)
    bits = value.view(torch.int32) + noise
    # The low half is zero now: the cast to bf16 is exact.
    return bits.bitwise_and_(_HIGH_HALF).view(torch.float32).to(torch.bfloat16)


def adam_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: float,
    *,
    lr: float | Tensor,
    beta1: float | Tensor,
    beta2: float | Tensor,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """One Adam/AdamW update of FP32 ``param``, ``exp_avg`` and ``exp_avg_sq`` in place, as torch computes it.

    The operations and their order are those of torch's single-tensor Adam (``amsgrad=False``, neither capturable
    nor differentiable), so FP32 inputs give torch's result bit for bit. ``step`` is the count including this step;
    ``grad`` is not modified.
    """
    lr, beta1, beta2 = _scalar(lr), _scalar(beta1), _scalar(beta2)
    if maximize:
        grad = -grad
    if weight_decay != 0:
        if decoupled_weight_decay:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    # torch moves a tensor beta1 to the parameter's device and dtype for lerp_ (pytorch#140601).
    weight_beta1 = beta1.to(param.device, param.dtype) if isinstance(beta1, Tensor) else beta1
    exp_avg.lerp_(grad, 1 - weight_beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # type: ignore[arg-type]  # a 0-d tensor too, as torch
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)  # type: ignore[arg-type]  # a 0-d tensor too, as torch


def sgd_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | None,
    *,
    lr: float | Tensor,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
) -> Tensor | None:
    """One SGD update of FP32 ``param`` in place, as torch computes it; returns the new momentum buffer (or ``None``).

    The operations and their order are those of torch's single-tensor SGD. ``momentum_buffer`` (FP32, updated in
    place) is ``None`` at the first step with momentum, as in torch, which then starts it from the gradient. ``grad``
    is not modified.
    """
    lr = _scalar(lr)
    if maximize:
        grad = -grad
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        if momentum_buffer is None:
            momentum_buffer = grad.detach().clone()
        else:
            momentum_buffer.mul_(momentum).add_(grad, alpha=1 - dampening)
        grad = grad.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(grad, alpha=-lr)  # type: ignore[arg-type]  # a 0-d tensor too, as torch
    return momentum_buffer


def _scalar(value: Any) -> Any:
    """A hyperparameter as torch's single-tensor step uses it: a 1-element tensor squeezed to 0-d, a number as is."""
    return value.squeeze() if isinstance(value, Tensor) and value.dim() != 0 else value


def _widened(tensor: Tensor) -> Tensor:
    """``tensor`` in FP32: the tensor itself if it is FP32 already (updates in place then reach it), else a copy."""
    return tensor if tensor.dtype == torch.float32 else tensor.float()


# The most elements one piece of a compensated update holds (see ``Compensator._update``): 4 Mi elements, 16 MiB in
# FP32, so a few FP32 temporaries of a piece stay well below a large tensor's own size.
PIECE = 1 << 22


def _pieces(*tensors: Tensor) -> list[slice | None]:
    """Slices of the flattened tensors, at most ``PIECE`` elements each; ``[None]`` (the whole) when one suffices.

    Pieces need flat views: a tensor that is not contiguous (a ``channels_last`` weight, say) is updated whole.
    """
    numel = tensors[0].numel()
    if numel <= PIECE or not all(tensor.is_contiguous() for tensor in tensors):
        return [None]
    return [slice(start, min(start + PIECE, numel)) for start in range(0, numel, PIECE)]


def _piece(tensor: Tensor, part: slice | None) -> Tensor:
    """The elements ``part`` of ``tensor`` (a view, written through), or the tensor itself."""
    return tensor if part is None else tensor.view(-1)[part]


def _write_back(target: Tensor, value: Tensor) -> None:
    """Round FP32 ``value`` to nearest into ``target`` (nothing to do if ``value`` is ``target`` itself)."""
    if value is not target:
        target.copy_(value)


class Compensator:
    """Step one torch optimizer whose parameters are bf16 with compensated updates: call :meth:`step` in its place.

    Hyperparameters are read from ``optimizer.param_groups`` at every step (LR schedulers work), and the states stay
    in ``optimizer.state`` in torch's format. The math of each bf16 parameter runs on its local values
    (:func:`~lightning_amp_plus.step.sharding.local_view`), and every tensor made for it is made like it
    (``torch.zeros_like``): buffers and states follow a DTensor's sharding. Gradients are assumed finite (check them,
    and skip the step, before).

    States' dtype: the first moment (``exp_avg``, and SGD's ``momentum_buffer``) in bf16, the second moment
    (``exp_avg_sq``) in FP32: 10 bytes per parameter with Kahan and AdamW (weight 2, buffer 2, states 2 + 4), 8 with
    stochastic rounding. A bf16 second moment cannot decay when ``1 - beta2`` is below bf16's relative half-spacing
    (2**-9): with torch's default ``beta2=0.999`` it sticks at its largest values. See the notes of the benchmark
    (``benchmarks/bench_compensated.py``) for the measurements.

    Because ``torch.optim.Optimizer.load_state_dict`` casts every floating state to its parameter's dtype, an FP32
    ``exp_avg_sq`` of a bf16 parameter comes back bf16 from a checkpoint. :meth:`state_dict` therefore also carries
    each state whose dtype differs from its parameter's; :meth:`load_state_dict` keeps them until the next
    :meth:`step`, which puts them back (after checking that the optimizer's loaded state is their cast): load the
    optimizer and the compensator in either order, then step, and the run continues bit for bit.

    Mutable state (besides the optimizer's ``state``, which it updates):

    * ``_buffers``: bf16 parameter -> its Kahan compensation buffer (a bf16 tensor like it), made at its first step.
    * ``_generators``: device -> the ``torch.Generator`` of stochastic rounding there, seeded with ``seed``.
    * ``_pending``: states loaded by :meth:`load_state_dict` that the next :meth:`step` puts into the optimizer's
      state, as ``(param, key, tensor)``.

    Args:
        optimizer: a ``torch.optim.AdamW``, ``Adam`` or ``SGD`` (exactly these types). Not supported: ``amsgrad``,
            ``capturable``, ``differentiable``, fp16 parameters, sparse gradients of bf16 parameters.
        method: ``"kahan"`` or ``"stochastic"``.
        seed: the seed of the stochastic-rounding streams (one generator per device; the same on every rank).
        exp_avg_dtype: the dtype of ``exp_avg`` and ``momentum_buffer`` of bf16 parameters (bf16 or FP32).
        exp_avg_sq_dtype: the dtype of ``exp_avg_sq`` of bf16 parameters (bf16 or FP32).

    Raises:
        TypeError: ``optimizer`` is not one of the supported types.
        ValueError: ``method``, ``seed`` or a dtype is invalid, or a param group sets an unsupported option or holds
            an fp16 parameter.

    Examples:
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> opt = torch.optim.AdamW([w], lr=1e-3)
        >>> compensator = Compensator(opt, "stochastic", seed=0)
        >>> w.grad = torch.ones_like(w)
        >>> compensator.step()
        >>> sorted(opt.state[w]), opt.state[w]["exp_avg"].dtype, opt.state[w]["exp_avg_sq"].dtype
        (['exp_avg', 'exp_avg_sq', 'step'], torch.bfloat16, torch.float32)
        >>> footprint(opt, compensator).per_trainable_parameter  # weights 2 + states 2 + 4, a 4-byte step counter
        10.0
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        method: Method,
        *,
        seed: int = 0,
        exp_avg_dtype: torch.dtype = torch.bfloat16,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
    ) -> None:
        if type(optimizer) not in SUPPORTED:
            supported = ", ".join(f"torch.optim.{cls.__name__}" for cls in SUPPORTED)
            raise TypeError(
                f"{type(optimizer).__module__}.{type(optimizer).__qualname__} cannot be stepped with compensated bf16 "
                f"updates (precision 'bf16-true' with compensation={method!r}): they are implemented for {supported} "
                "(exactly these types; the torch optimizer itself, not a wrapper). Use one of them; or "
                "compensation=None, which steps your optimizer as it is (plain bf16-true: updates below half a bf16 "
                "spacing are lost); or 'bf16-mixed', whose FP32 weights need no compensation."
            )
        if method not in get_args(Method):
            raise ValueError(f"`Compensator(method={method!r})` is not supported: use 'kahan' or 'stochastic'.")
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in STATE_DTYPES:
                raise ValueError(f"`Compensator({name}={dtype})` must be torch.bfloat16 or torch.float32.")
        self.optimizer = optimizer
        self.method: Method = method
        self.seed = check_int("Compensator", "seed", seed, minimum=0)
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self._buffers: dict[Tensor, Tensor] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._pending: list[tuple[Tensor, str, Tensor]] = []
        _check_groups(self.optimizer)

    @torch.no_grad()
    def step(self) -> None:
        """Update every parameter that has a gradient: bf16 ones compensated, the others by ``optimizer.step()``.

        The bf16 parameters are updated first; then ``optimizer.step()`` runs with their gradients hidden (put back
        after), so it steps the other parameters exactly as torch does, and its step hooks run once per step (an LR
        scheduler sees that the optimizer stepped).

        Raises:
            ValueError: a param group now sets an unsupported option or holds an fp16 parameter.
            RuntimeError: a bf16 parameter has a sparse gradient, or the states loaded by :meth:`load_state_dict`
                do not match the optimizer's (it was not loaded, or from another checkpoint).
        """
        _check_groups(self.optimizer)
        self._restore_pending()
        compensated = self._compensated()
        for group, param, grad in compensated:
            self._update(group, param, grad)
        try:
            for _, param, _ in compensated:
                param.grad = None
            self.optimizer.step()
        finally:
            for _, param, grad in compensated:
                param.grad = grad

    def _compensated(self) -> list[tuple[dict[str, Any], Tensor, Tensor]]:
        """``(group, param, grad)`` of each bf16 parameter with a gradient, in the optimizer's order.

        All are checked before any is updated: a refusal leaves the step undone, not half done.
        """
        found = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None or param.dtype != torch.bfloat16:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(
                        "A bf16 parameter has a sparse gradient, which the Compensator does not support: use "
                        "dense gradients (e.g. `nn.Embedding(..., sparse=False)`) for bf16 parameters."
                    )
                found.append((group, param, grad))
        return found

    def _update(self, group: dict[str, Any], param: Tensor, grad: Tensor) -> None:
        """One compensated update of bf16 ``param``: the FP32 math, then the states and the weight written back.

        The math runs on pieces of at most ``PIECE`` elements, so its FP32 temporaries (the widened weight, gradient
        and moments) cost at most a few ``PIECE``-sized buffers, not a few copies of the largest tensor (an LLM's
        embedding). Every operation is elementwise: the pieces give the whole tensor's result bit for bit (under
        stochastic rounding the random numbers are drawn piece by piece, from the same stream).
        """
        weight, grad = local_view(param), local_view(grad)
        buffer, fresh = self._kahan_buffer(param)
        is_sgd = isinstance(self.optimizer, torch.optim.SGD)
        states = self._sgd_states(group, param) if is_sgd else self._adam_states(param)
        step = None if is_sgd else float(self.optimizer.state[param]["step"].item())
        involved = [weight, grad, *[t for t in (buffer, *states.values()) if t is not None]]
        for part in _pieces(*involved):
            master = _piece(weight, part).float()
            if buffer is not None and not fresh:
                master.add_(_piece(buffer, part))
            grad32 = _widened(_piece(grad, part))
            pieces = {key: None if state is None else _piece(state, part) for key, state in states.items()}
            if is_sgd:
                self._sgd(group, master, grad32, pieces)
            else:
                assert step is not None
                self._adam(group, master, grad32, pieces, step)
            self._write_weight(_piece(weight, part), master, None if buffer is None else _piece(buffer, part))

    def _kahan_buffer(self, param: Tensor) -> tuple[Tensor | None, bool]:
        """The local Kahan buffer of ``param`` (made at its first step: then ``fresh``), or ``None`` without Kahan."""
        if self.method != "kahan":
            return None, False
        buffer = self._buffers.get(param)
        fresh = buffer is None
        if buffer is None:
            buffer = self._buffers[param] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return local_view(buffer), fresh

    def _adam_states(self, param: Tensor) -> dict[str, Tensor | None]:
        """``param``'s Adam states in their configured dtypes (made at its first step), the step counter advanced."""
        state = self.optimizer.state[param]
        if not state:
            # torch's own initial state (the step counter on the CPU, as torch keeps it when neither fused nor
            # capturable, which a fused optimizer loading this state moves to the device itself).
            state["step"] = torch.tensor(0.0, dtype=_step_dtype())
            state["exp_avg"] = torch.zeros_like(param, dtype=self.exp_avg_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(
                param, dtype=self.exp_avg_sq_dtype, memory_format=torch.preserve_format
            )
        _cast_state(state, "exp_avg", self.exp_avg_dtype)
        _cast_state(state, "exp_avg_sq", self.exp_avg_sq_dtype)
        state["step"] += 1
        return {"exp_avg": local_view(state["exp_avg"]), "exp_avg_sq": local_view(state["exp_avg_sq"])}

    def _sgd_states(self, group: dict[str, Any], param: Tensor) -> dict[str, Tensor | None]:
        """``param``'s momentum buffer (``None`` without momentum), and whether this is its first step (``"new"``).

        At the first step with momentum the buffer is made here, to be written, but the update starts it from the
        gradient, as torch does.
        """
        if group["momentum"] == 0:
            return {"momentum_buffer": None, "new": None}
        state = self.optimizer.state[param]
        first = "momentum_buffer" not in state or state["momentum_buffer"] is None
        if first:
            state["momentum_buffer"] = torch.zeros_like(param, dtype=self.exp_avg_dtype)
        _cast_state(state, "momentum_buffer", self.exp_avg_dtype)
        buffer = local_view(state["momentum_buffer"])
        return {"momentum_buffer": buffer, "new": buffer if first else None}

    def _adam(
        self, group: dict[str, Any], master: Tensor, grad32: Tensor, states: dict[str, Tensor | None], step: float
    ) -> None:
        exp_avg, exp_avg_sq = states["exp_avg"], states["exp_avg_sq"]
        assert exp_avg is not None and exp_avg_sq is not None
        exp_avg32, exp_avg_sq32 = _widened(exp_avg), _widened(exp_avg_sq)
        adam_(
            master,
            grad32,
            exp_avg32,
            exp_avg_sq32,
            step,
            lr=group["lr"],
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            # AdamW is Adam with decoupled_weight_decay=True in torch >= 2.7's groups; older AdamW groups lack the key.
            decoupled_weight_decay=group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW)),
            maximize=group["maximize"],
        )
        _write_back(exp_avg, exp_avg32)
        _write_back(exp_avg_sq, exp_avg_sq32)

    def _sgd(self, group: dict[str, Any], master: Tensor, grad32: Tensor, states: dict[str, Tensor | None]) -> None:
        buffer, new = states["momentum_buffer"], states["new"]
        buffer32 = sgd_(
            master,
            grad32,
            None if buffer is None or new is not None else _widened(buffer),  # the first step starts it from grad
            lr=group["lr"],
            momentum=group["momentum"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            weight_decay=group["weight_decay"],
            maximize=group["maximize"],
        )
        if buffer is not None and buffer32 is not None:
            _write_back(buffer, buffer32)

    def _write_weight(self, weight: Tensor, master: Tensor, buffer: Tensor | None) -> None:
        """Write the FP32 result into the bf16 weight: rounded to nearest with the error kept, or stochastically."""
        if self.method == "stochastic":
            weight.copy_(round_stochastically(master, self._generator(weight.device)))
            return
        assert buffer is not None
        weight.copy_(master)
        # The residual of rounding an FP32 number to bf16 is exact in FP32; the buffer keeps its 8 leading bits.
        buffer.copy_(master.sub_(weight))

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return generator

    # ----------------------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides the optimizer's own state: tensors and plain containers only.

        Keys: ``method``; ``group_sizes`` (the optimizer's structure, checked on load); ``compensation``, per param
        group a list with each parameter's Kahan buffer or ``None``; ``exact_states``, per param group a list with a
        dict of each parameter's states whose dtype differs from the parameter's (``Optimizer.load_state_dict``
        would cast them); ``generators``, the stochastic-rounding streams as ``{"device_type", "state"}`` (uint8
        tensor), in the order the devices first appear among the parameters. Tensors are the live ones, not copies
        (as in ``Optimizer.state_dict``): saved in one file with the optimizer's state, they are written once.
        """
        pending = {(id(param), key): tensor for param, key, tensor in self._pending}
        compensation: list[list[Tensor | None]] = []
        exact: list[list[dict[str, Tensor]]] = []
        for group in self.optimizer.param_groups:
            compensation.append([self._buffers.get(param) for param in group["params"]])
            exact.append([self._exact_states(param, pending) for param in group["params"]])
        return {
            "method": self.method,
            "group_sizes": _group_sizes(self.optimizer),
            "compensation": compensation,
            "exact_states": exact,
            "generators": [
                {"device_type": device.type, "state": self._generator(device).get_state()}
                for device in (self._devices() if self.method == "stochastic" else [])
            ],
        }

    def _exact_states(self, param: Tensor, pending: Mapping[tuple[int, str], Tensor]) -> dict[str, Tensor]:
        found = {key: tensor for (key_id, key), tensor in pending.items() if key_id == id(param)}
        for key, value in self.optimizer.state.get(param, {}).items():
            if key not in found and _cast_on_load(param, key, value):
                found[key] = value
        return found

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, before or after ``optimizer.load_state_dict``: then step.

        The buffers and random streams are loaded at once; the optimizer's states are put back at the next
        :meth:`step` (the optimizer's own load, whenever it happens, would cast them).

        Raises:
            ValueError: the state is malformed, was saved with another method, or for an optimizer of another
                structure (param group sizes, a buffer's shape, a stream's device type).
        """
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"`Compensator.load_state_dict` takes a dict, not a {type(state_dict).__name__}.")
        for key in ("method", "group_sizes", "compensation", "exact_states", "generators"):
            if key not in state_dict:
                raise ValueError(f"The Compensator state has no {key!r} key: it is not a Compensator.state_dict().")
        if state_dict["method"] != self.method:
            raise ValueError(
                f"The Compensator state was saved with method={show(state_dict['method'])}; this Compensator uses "
                f"{self.method!r}. Create it with method={show(state_dict['method'])} to resume that run."
            )
        if state_dict["group_sizes"] != _group_sizes(self.optimizer):
            raise ValueError(
                f"The Compensator state was saved for param groups of sizes {show(state_dict['group_sizes'])}; this "
                f"optimizer's are {_group_sizes(self.optimizer)}. Load it with the optimizer (and model) it was saved "
                "with."
            )
        buffers: dict[Tensor, Tensor] = {}
        for position, param, saved in _entries(self.optimizer, state_dict["compensation"], "compensation"):
            if saved is not None:
                buffers[param] = self._loaded_buffer(param, saved, position)
        pending: list[tuple[Tensor, str, Tensor]] = []
        for position, param, states in _entries(self.optimizer, state_dict["exact_states"], "exact_states"):
            if not isinstance(states, Mapping):
                raise ValueError(f"The Compensator state's {position} must be a dict of tensors, not {show(states)}.")
            for key, tensor in states.items():
                pending.append((param, key, _checked_state(param, key, tensor, f"{position}[{key!r}]")))
        generators = _loaded_generators(
            state_dict["generators"], self._devices() if self.method == "stochastic" else []
        )
        self._buffers, self._pending, self._generators = buffers, pending, generators

    def _loaded_buffer(self, param: Tensor, saved: Any, position: str) -> Tensor:
        if self.method != "kahan" or param.dtype != torch.bfloat16:
            raise ValueError(f"The Compensator state's {position} holds a buffer for a parameter that has none.")
        _check_like(param, saved, position)
        buffer = torch.zeros_like(param, memory_format=torch.preserve_format)
        local_view(buffer).copy_(local_view(saved))
        return buffer

    def _restore_pending(self) -> None:
        """Put the loaded states back into the optimizer's state, once it holds their (cast) values.

        All are checked first: a mismatch changes nothing.
        """
        for param, key, saved in self._pending:
            current = self.optimizer.state.get(param, {}).get(key)
            if not isinstance(current, Tensor) or not torch.equal(
                local_view(current), local_view(saved).to(local_view(current).device, current.dtype)
            ):
                raise RuntimeError(
                    f"The optimizer's state {key!r} does not match the one the Compensator's state was saved with "
                    "(the optimizer's state was not loaded, or comes from another checkpoint): load the optimizer's "
                    "and the Compensator's states saved together, in either order, before the next step."
                )
        for param, key, saved in self._pending:
            state = self.optimizer.state[param]
            state[key] = saved.to(local_view(state[key]).device)  # the same tensor when already there
        self._pending = []

    def _devices(self) -> list[torch.device]:
        """The devices of the bf16 parameters' local values, in order of first appearance."""
        devices: dict[torch.device, None] = {}
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.dtype == torch.bfloat16:
                    devices.setdefault(local_view(param).device, None)
        return list(devices)


def _cast_state(state: dict[str, Any], key: str, dtype: torch.dtype) -> None:
    """Give ``state[key]`` the configured dtype (a stock optimizer's checkpoint holds it in the parameter's)."""
    if state[key].dtype != dtype:
        state[key] = state[key].to(dtype)


def _check_groups(optimizer: torch.optim.Optimizer) -> None:
    """Refuse options the compensated path lacks, and fp16 parameters (checked at every step: groups change)."""
    name = type(optimizer).__name__
    for index, group in enumerate(optimizer.param_groups):
        for option, needed in _UNSUPPORTED_OPTIONS.items():
            if group.get(option, needed) != needed:
                raise ValueError(
                    f"`{name}({option}={show(group[option])})` (param group {index}) is not supported by the "
                    f"Compensator: create the optimizer with {option}={needed}."
                )
        for position, param in enumerate(group["params"]):
            if param.dtype == torch.float16:
                raise ValueError(
                    f"Parameter {position} of param group {index} is fp16: the Compensator compensates bf16 "
                    "parameters and steps FP32 ones as torch does, but an fp16 one would lose its small updates "
                    "silently. Convert the model to bf16 (or FP32)."
                )


def _entries(optimizer: torch.optim.Optimizer, nested: Any, name: str) -> Iterator[tuple[str, Tensor, Any]]:
    """``(position, param, nested[group][index])`` for each parameter, once ``nested`` has the optimizer's shape."""
    sizes = (
        [len(values) if isinstance(values, list) else None for values in nested] if isinstance(nested, list) else None
    )
    if sizes != _group_sizes(optimizer):
        raise ValueError(
            f"The Compensator state's {name!r} must be a list per param group with one entry per parameter "
            f"(sizes {_group_sizes(optimizer)}), not {show(nested)}."
        )
    for g, (group, values) in enumerate(zip(optimizer.param_groups, nested, strict=True)):
        for i, (param, value) in enumerate(zip(group["params"], values, strict=True)):
            yield f"{name}[{g}][{i}]", param, value


def _loaded_generators(saved: Any, devices: list[torch.device]) -> dict[torch.device, torch.Generator]:
    if not isinstance(saved, list) or len(saved) != len(devices):
        raise ValueError(
            f"The Compensator state's 'generators' must be a list of {len(devices)} (one per device of the bf16 "
            f"parameters under stochastic rounding), not {show(saved)}."
        )
    generators = {}
    for device, entry in zip(devices, saved, strict=True):
        if not isinstance(entry, Mapping) or entry.get("device_type") != device.type:
            raise ValueError(
                f"The Compensator state holds a random stream of device type {show(_get(entry, 'device_type'))} "
                f"where this optimizer's parameters are on {device}: resume on the same kind of device."
            )
        state = entry.get("state")
        if not isinstance(state, Tensor) or state.dtype != torch.uint8:
            raise ValueError(f"The Compensator state's random stream must be a uint8 tensor, not {show(state)}.")
        generators[device] = torch.Generator(device=device)
        generators[device].set_state(state)
    return generators


def _group_sizes(optimizer: torch.optim.Optimizer) -> list[int]:
    return [len(group["params"]) for group in optimizer.param_groups]


class Compensators:
    """One :class:`Compensator` per optimizer of an engine, by the optimizer's position, made at first use.

    A front end may meet its optimizers only at their first step (Fabric): a state loaded before then waits, by
    position, until the optimizer's compensator is made.

    State: the compensators by optimizer position, and the states loaded for positions that have none yet (a
    :class:`~lightning_amp_plus.step.positions.ByPosition`).

    Examples:
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16)); opt = torch.optim.SGD([w], lr=0.1)
        >>> compensators = Compensators("kahan", seed=0)
        >>> compensators.of(opt, 0).method, len(compensators.state_dict())
        ('kahan', 1)
    """

    def __init__(self, method: Method, seed: int = 0) -> None:
        self.method: Method = method
        self.seed = seed
        self._compensators: ByPosition[Compensator] = ByPosition()

    def of(self, optimizer: torch.optim.Optimizer, position: int) -> Compensator:
        """The compensator of ``optimizer`` (at ``position``), made and given any waiting state the first time.

        Raises:
            TypeError: ``optimizer`` is not one the compensated update implements (before any step).
        """
        return self._compensators.get(position, lambda: Compensator(optimizer, self.method, seed=self.seed))

    def footprints(self) -> list[Footprint]:
        """Each optimizer's bytes of weights, compensation buffers and state, counted from the tensors."""
        return [footprint(c.optimizer, c) for c in self._compensators.made.values()]

    def state_dict(self) -> list[dict[str, Any] | None]:
        """Each position's compensator state (``None`` for a position with none)."""
        return self._compensators.state_dict()

    def load_state_dict(self, states: list[dict[str, Any] | None]) -> None:
        """Load each position's state into its compensator, or keep it until that compensator is made."""
        self._compensators.load_state_dict(states)


def _checked_state(param: Tensor, key: Any, tensor: Any, position: str) -> Tensor:
    if key == "step" or not isinstance(key, str) or not isinstance(tensor, Tensor) or not tensor.is_floating_point():
        raise ValueError(f"The Compensator state's {position} must be a floating state tensor.")
    _check_like(param, tensor, position)
    return tensor


def _get(entry: Any, key: str) -> Any:
    return entry.get(key) if isinstance(entry, Mapping) else entry


def _check_like(param: Tensor, saved: Any, position: str) -> None:
    if not isinstance(saved, Tensor) or tuple(saved.shape) != tuple(param.shape):
        shape = tuple(saved.shape) if isinstance(saved, Tensor) else type(saved).__name__
        raise ValueError(
            f"The Compensator state's {position} ({shape}) does not fit parameter of shape {tuple(param.shape)}: load "
            "it with the model and optimizer it was saved with."
        )


def _cast_on_load(param: Tensor, key: str, value: Any) -> bool:
    """Whether ``Optimizer.load_state_dict`` would change this state's dtype (to the parameter's): then it is lost."""
    return key != "step" and isinstance(value, Tensor) and value.is_floating_point() and value.dtype != param.dtype


def _step_dtype() -> torch.dtype:
    """The dtype torch gives a (non-fused) optimizer's ``step`` counter."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@dataclass(frozen=True)
class Footprint:
    """Bytes held for training by one optimizer's trainable parameters, counted from the tensors (local values only).

    The trainable parameters are those the optimizer holds with ``requires_grad``: frozen parameters passed to it too
    (a LoRA model handed whole to AdamW) are not counted here, so :attr:`per_trainable_parameter` means the same
    whether or not they were passed. What the whole model costs per parameter, frozen ones included, is
    :func:`per_model_parameter`.

    Attributes:
        parameters: the number of trainable parameter elements.
        weights: bytes of those parameters.
        compensation: bytes of their Kahan buffers.
        states: bytes of their optimizer state tensors (moments, momentum, step counters).
    """

    parameters: int
    weights: int
    compensation: int
    states: int

    @property
    def per_trainable_parameter(self) -> float:
        """(weights + compensation + states) / trainable parameters; gradients and activations are not counted."""
        return (self.weights + self.compensation + self.states) / max(self.parameters, 1)


def footprint(optimizer: torch.optim.Optimizer, compensator: Compensator | None = None) -> Footprint:
    """Count what ``optimizer``'s trainable parameters, their states and ``compensator``'s buffers hold, in bytes.

    Examples:
        >>> w, frozen = torch.nn.Parameter(torch.ones(1000)), torch.nn.Parameter(torch.ones(3000), requires_grad=False)
        >>> opt = torch.optim.AdamW([w, frozen])
        >>> w.grad = torch.ones_like(w); opt.step()
        >>> footprint(opt).per_trainable_parameter  # FP32 weight 4 + moments 8 (+ a 4-byte step counter)
        12.004
        >>> per_model_parameter([w, frozen], [footprint(opt)])  # (4 x 4000 + 8 x 1000 + 4) / 4000: frozen included
        6.001
    """
    trainable = {id(p): p for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
    states = [
        value for p in trainable.values() for value in optimizer.state.get(p, {}).values() if isinstance(value, Tensor)
    ]
    buffers = [] if compensator is None else [b for param, b in compensator._buffers.items() if id(param) in trainable]
    return Footprint(
        parameters=sum(local_view(p).numel() for p in trainable.values()),
        weights=_nbytes(trainable.values()),
        compensation=_nbytes(buffers),
        states=_nbytes(states),
    )


def per_model_parameter(params: Iterable[Tensor], footprints: Iterable[Footprint]) -> float:
    """(every parameter's bytes + the optimizers' compensation and states) / every parameter: frozen ones included.

    ``params`` are the model's parameters (each counted once); ``footprints`` the optimizers' (:func:`footprint`).
    Unlike :attr:`Footprint.per_trainable_parameter`, this divides by the whole model, so a model that trains a few
    adapters reads close to its weights' own bytes per parameter.

    Examples:
        >>> base, adapter = torch.nn.Linear(64, 64).bfloat16().requires_grad_(False), torch.nn.Linear(64, 2).bfloat16()
        >>> opt = torch.optim.SGD(adapter.parameters(), lr=0.1, momentum=0.9)
        >>> compensator = Compensator(opt, "kahan")
        >>> adapter(torch.ones(1, 64, dtype=torch.bfloat16)).sum().backward(); compensator.step()
        >>> footprint(opt, compensator).per_trainable_parameter  # weight, Kahan buffer, momentum: 2 bytes each
        6.0
        >>> every = [*base.parameters(), *adapter.parameters()]  # 4,160 frozen and 130 trained: 2 x 4,290 + 4 x 130
        >>> round(per_model_parameter(every, [footprint(opt, compensator)]), 3)
        2.121
    """
    unique = list({id(p): p for p in params}.values())
    count = sum(local_view(p).numel() for p in unique)
    held = _nbytes(unique) + sum(f.compensation + f.states for f in footprints)
    return held / max(count, 1)


def _nbytes(tensors: Any) -> int:
    return sum(local_view(t).numel() * t.element_size() for t in tensors)
