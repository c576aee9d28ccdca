"""Replaying one batch to look inside it, and leaving nothing of the replay behind.

The autopsy and the headroom both rerun a batch's forward and backward with hooks attached. A replay has to draw the
same random numbers as the step did (capture an :class:`RngState` at the start of the batch), must not accumulate into
``.grad`` (its gradients come from ``torch.autograd.grad``, which also fires no DDP gradient hook: :func:`gradients`),
and must leave the model as it found it: :func:`untouched` puts back the RNG streams, the buffers (BatchNorm running
statistics), the ``training`` flags and the ``.grad`` attributes. Parameters are never written.

A model checkpointed with ``torch.utils.checkpoint(use_reentrant=True)`` (transformers'
``gradient_checkpointing_enable()`` by default) computes the gradients of the layers it checkpoints only into
``.grad``: ``torch.autograd.grad`` through it raises, or, where nothing before the checkpointed part needs a gradient,
leaves those layers out as if they had none. A replay refuses such a graph (:class:`Unreplayable`), and its no-grad
forwards silence the warning such a checkpoint gives there (its inputs need no gradient: that is the point).
"""

from __future__ import annotations

import random
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "AutocastProbe",
    "Context",
    "RngState",
    "Unreplayable",
    "all_finite",
    "device_type",
    "floating_tensors",
    "gradients",
    "no_grad_forward",
    "replay",
    "untouched",
]

Context = Callable[[], AbstractContextManager[Any]]
"""A factory of the context a replay's forward runs in, e.g. ``lambda: torch.autocast("cpu", dtype=torch.float16)``."""


@dataclass(frozen=True, eq=False)
class RngState:
    """The random-number state of one moment, to replay a batch with the random numbers its step drew.

    It holds torch's CPU generator, every device's generator of the accelerator in use (CUDA, XPU...: when it has been
    initialised) and, if asked for, Python's ``random`` and NumPy's global generator (when NumPy is loaded).

    Capture one at the start of each batch, right before its forward (a few microseconds): a replay restores it so that
    dropout draws the same masks as the step did, on whichever device the forward ran (a model split over devices
    too). Python's and NumPy's generators are left out of that capture by default (they cost 7 and 20 us more, and a
    forward rarely draws from them: data augmentation happens in the DataLoader); the replay machinery captures them,
    with the rest, before it starts and puts them back afterwards, so no stream advances either way.
    ``torch.Generator`` objects of your own are not captured.

    Examples:
        >>> state = RngState.capture()
        >>> first = torch.rand(3)
        >>> state.restore()
        >>> torch.equal(first, torch.rand(3))
        True
    """

    cpu: Tensor
    accelerator: tuple[str, tuple[Tensor, ...]] | None  # the device type, and each of its devices' generator state
    python: tuple[Any, ...] | None = None
    numpy: Any = None

    @classmethod
    def capture(cls, *, host: bool = False) -> RngState:
        """The state now; with ``host=True`` also Python's and NumPy's generators (NumPy's if it has been imported)."""
        accelerator = None
        # Asked first: torch 2.6's current_accelerator() raises where there is none (later releases return None).
        device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if device is not None:
            module = torch.get_device_module(device)
            # An accelerator not initialised has drawn nothing yet: reading its generators would initialise it.
            if getattr(module, "is_initialized", lambda: False)():
                accelerator = (device.type, tuple(module.get_rng_state_all()))
        if not host:
            return cls(torch.get_rng_state(), accelerator)
        np = sys.modules.get("numpy")  # never imported here: numerics/ depends on torch only
        return cls(torch.get_rng_state(), accelerator, random.getstate(), None if np is None else np.random.get_state())

    def restore(self) -> None:
        """Set every generator captured back to this state (the state itself is not changed: restore it again)."""
        torch.set_rng_state(self.cpu)
        if self.accelerator is not None:
            kind, states = self.accelerator
            torch.get_device_module(kind).set_rng_state_all(list(states))
        if self.python is not None:
            random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


@contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Run the body eagerly, then put back what a replay of ``model`` may have changed.

    That is: the RNG streams (NumPy's included), every buffer (the same tensor objects, with their values), the
    ``training`` flags and each parameter's ``.grad`` (the same tensor, or ``None``). Eagerly: a compiled model's
    forward runs its Python code (``torch.compiler.set_stance("force_eager")``), so that hooks see every module and no
    graph of the training step is recompiled for a replay.

    Refuses to run under ``torch.inference_mode`` (a replay needs autograd).

    Examples:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Dropout(0.5))
        >>> before = net[1].running_mean.clone(), torch.get_rng_state()
        >>> with untouched(net):
        ...     _ = net(torch.randn(4, 2)); _ = net.eval()
        >>> torch.equal(net[1].running_mean, before[0]), torch.equal(torch.get_rng_state(), before[1]), net.training
        (True, True, True)
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "A replay needs autograd, but it was called under `torch.inference_mode()`: call it outside inference mode."
        )
    rng = RngState.capture(host=True)
    buffers = [
        (module, name, buffer, buffer.detach().clone())
        for module in model.modules()
        for name, buffer in module.named_buffers(recurse=False)
    ]
    flags = [(module, module.training) for module in model.modules()]
    grads = [(param, param.grad) for param in model.parameters()]
    try:
        # Eagerly: in a compiled model's graph the replay's hooks would not run (dynamo does not guard on module
        # hooks), and a replay's autocast or scale would recompile the graph the training step runs, towards dynamo's
        # recompile limit (tests/monitor/test_monitor_compiled.py).
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        with torch.no_grad():
            for module, name, buffer, saved in buffers:
                setattr(module, name, buffer)  # a forward may have replaced the buffer object
                buffer.copy_(saved)
        for module, training in flags:
            module.training = training
        for param, grad in grads:
            if param.grad is not grad:
                param.grad = grad
        rng.restore()


def device_type(model: nn.Module) -> str:
    """The device type of the model's first parameter or buffer (``"cpu"`` for a model with neither)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device.type
    return "cpu"


def floating_tensors(value: object) -> Iterator[Tensor]:
    """The floating-point tensors in ``value``, looking into tuples, lists and dicts (a model output may be any)."""
    if isinstance(value, Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from floating_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from floating_tensors(item)


def all_finite(tensors: Sequence[Tensor | None]) -> bool:
    """Whether every tensor given holds only finite values (one host read; ``None`` entries are skipped)."""
    checks = [torch.isfinite(t).all() for t in tensors if t is not None]
    return not checks or bool(torch.stack([c.to(checks[0].device) for c in checks]).all())


def replay(
    run: Callable[[], Tensor], context: Context, scale: float, params: Sequence[Tensor]
) -> tuple[Tensor, tuple[Tensor | None, ...] | None]:
    """Run the forward in ``context``, then the gradients of ``loss * scale`` with respect to ``params``.

    The loss is scaled as ``DynamicLossScaler.scale`` does (times a float32 scale tensor; left as it is at scale 1).
    Returns the loss and the gradients (``None`` for a parameter the loss does not depend on), or the loss and
    ``None`` when the loss is not finite (its gradients would say nothing). Restore the RNG state before calling.

    Raises:
        TypeError: ``run()`` returned something other than a scalar tensor with a gradient.
    """
    with torch.enable_grad():
        with context():
            loss = run()
        _check_loss(loss)
        if not bool(torch.isfinite(loss.detach()).all()):
            return loss, None
        scaled = loss if scale == 1.0 else loss * torch.tensor(scale, dtype=torch.float32, device=loss.device)
        grads = gradients(scaled, params)
    return loss, grads


class Unreplayable(ValueError):
    """The gradients of a replayed loss cannot be taken without writing ``.grad`` (see :func:`gradients`)."""


_REENTRANT_CHECKPOINT = (
    "the replay's gradients (torch.autograd.grad, which writes no .grad) cannot be taken through "
    "torch.utils.checkpoint(use_reentrant=True), which computes the gradients of the layers it checkpoints only into "
    ".grad: checkpoint with use_reentrant=False, as torch recommends (the same gradients; transformers: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))"
)


def gradients(loss: Tensor, params: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
    """The gradients of ``loss`` with respect to ``params`` (``None`` for one it does not reach), not into ``.grad``.

    Raises:
        Unreplayable: the loss was computed through a reentrant activation checkpoint (torch's
            ``checkpoint(use_reentrant=True)``, or another library's ``CheckpointFunction``); the message says to
            checkpoint with ``use_reentrant=False``.

    Examples:
        >>> w = torch.ones(2, requires_grad=True)
        >>> gradients((w * 3).sum(), [w]), w.grad
        ((tensor([3., 3.]),), None)
    """
    if _through_reentrant_checkpoint(loss):
        raise Unreplayable(_REENTRANT_CHECKPOINT)
    return torch.autograd.grad(loss, list(params), allow_unused=True)


def _through_reentrant_checkpoint(loss: Tensor) -> bool:
    """Whether the backward graph of ``loss`` has a reentrant checkpoint's node (one Python step per node)."""
    seen: set[Any] = set()
    nodes = [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        # By the Function's name: torch's is torch.utils.checkpoint.CheckpointFunction, and DeepSpeed's, Megatron's and
        # fairscale's reentrant checkpoints are named so too (each computes its layers' gradients into .grad).
        if getattr(getattr(node, "_forward_cls", None), "__name__", None) == "CheckpointFunction":
            return True
        nodes.extend(following for following, _ in node.next_functions)
    return False


@contextmanager
def no_grad_forward() -> Iterator[None]:
    """``torch.no_grad()`` for a replay's forward that needs no gradient, without a reentrant checkpoint's warning.

    ``checkpoint(use_reentrant=True)`` warns that no input requires grad ("Gradients will be None") in such a forward;
    none is asked for there.
    """
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad=True", category=UserWarning)
        yield


def _check_loss(loss: object) -> None:
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
        shown = type(loss).__name__ if not isinstance(loss, Tensor) else f"a tensor of shape {tuple(loss.shape)}"
        grad = "" if not isinstance(loss, Tensor) or loss.requires_grad else " that does not require grad"
        raise TypeError(
            f"`run()` returned {shown}{grad}: it must rerun the batch's forward and return its scalar loss tensor "
            "(e.g. `lambda: module.training_step(batch, batch_idx)`, returning the loss, with logging suppressed)."
        )


class AutocastProbe:
    """Forward pre-hooks on every module that note whether autocast was on for ``device`` inside a replay.

    A replay meant to run in FP32 (autocast off) is not FP32 if ``run`` enters autocast itself (Fabric's wrapped
    module does): the probe tells.

    Mutable state: ``seen`` (autocast was on in some module's forward), ``handles`` (the hooks, while attached).
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.seen = False
        self.handles: list[RemovableHandle] = []

    def attach(self, model: nn.Module) -> None:
        """Hook every module of ``model``."""
        self.handles = [module.register_forward_pre_hook(self._probe) for module in model.modules()]

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _probe(self, module: nn.Module, args: Any) -> None:
        self.seen = self.seen or torch.is_autocast_enabled(self.device)
