"""``MixedPrecisionPlugin`` for Lightning Fabric: the Fabric face of the step engine.

A ``lightning.fabric.plugins.precision.Precision`` that adapts Fabric's hooks to
:class:`~lightning_amp_plus.step.engine.StepEngine`. Fabric's contract differs from the Trainer's, and each hook
here says how it meets it:

* no ``connect``: the plugin never sees the optimizers at set-up, so it keeps the modules ``fabric.setup`` converts
  and learns from them, at the first forward and the first step, the autocast device (Fabric converts a module
  *before* it moves it to the device: a model built on the CPU and trained on a GPU is on the CPU then), the
  parameter names and where the gradients live (ranks, shards);
* ``fabric.backward(loss)`` calls :meth:`backward`, which must scale the loss itself (what ``pre_backward`` returns is
  ignored);
* ``fabric.clip_gradients`` calls :meth:`unscale_gradients` (the check happens there, before any clipping) and then
  clips :meth:`main_params` with torch's functions: on a step found non-finite, nothing to clip is returned, so the
  default ``error_if_nonfinite=True`` does not raise and the step is skipped;
* ``optimizer.step()`` reaches :meth:`optimizer_step` with no closure, no model, no end-of-batch hook: the loss scale
  moves once for all the optimizer steps since the last backward, when the next :meth:`backward` starts (or when the
  state is saved). Moving it after every optimizer step, as Fabric's own ``MixedPrecision`` does, unscales a second
  optimizer stepped after the same backward by a scale its gradients were not scaled with. With one optimizer the two
  are the same sequence of scales.

State owned here: the options, the autocast device, the modules set up (weak references), the hooks keeping
``keep_fp32`` modules in FP32, whether the ranks are set up, the optimizers stepped since the scale last moved, a
zero-gradient stand-in per device (:meth:`main_params`), and under ``"fp8-mixed"`` the FP8 training (``fp8``: the
layers converted at ``fabric.setup``, the readings armed at a check step's first training forward, read after its
``optimizer.step()``; :mod:`~lightning_amp_plus.plugins.fp8`). The engine owns the rest.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_amp_plus.plugins import fp8 as _fp8
from lightning_amp_plus.plugins import state as _plugin_state
from lightning_amp_plus.plugins.core import (
    DEFAULT_SKIPS,
    Readings,
    check_device_supports,
    checked_settings,
    default_device,
    engine_for,
    half_dtype,
    refuse_deepspeed,
)
from lightning_amp_plus.plugins.ranks import refuse_sharded_master_weights, set_up_ranks
from lightning_amp_plus.plugins.wrappers import user_names
from lightning_amp_plus.step.scaler import DynamicLossScaler
from lightning_amp_plus.step.spikes import SpikeGuard
from lightning_amp_plus.weights.fp8 import FP8Training
from lightning_amp_plus.weights.fp8.convert import Float8Config, Modules, Recipe
from lightning_amp_plus.weights.fp8.training import DEFAULT_CHECK_INTERVAL, DEFAULT_FALLBACK, DEFAULT_RECIPE
from lightning_amp_plus.weights.fp32_modules import compute_in_fp32
from lightning_amp_plus.weights.master import refuse_half_masters, widen_model_

__all__ = ["MixedPrecisionPlugin"]


class MixedPrecisionPlugin(Readings, Precision):
    """Mixed precision for Lightning Fabric with a from-scratch loss scaler: ``L.Fabric(plugins=[this])``.

    ``"16-mixed"`` runs under fp16 autocast with a :class:`~lightning_amp_plus.DynamicLossScaler`; ``"bf16-mixed"``
    under bf16 autocast; ``"bf16-true"`` holds the model in bf16 and steps it with compensated updates (as the
    Trainer's plugin; its ``compensation`` and ``rounding_seed``); ``"fp8-mixed"`` is ``"bf16-mixed"`` with the
    eligible ``nn.Linear`` layers converted in place to torchao's FP8 training layers at ``fabric.setup`` (the
    ``fp8_*`` options, as the Trainer's plugin). Compensators are made at each optimizer's first step (Fabric shows the
    plugin no optimizer before): an unsupported optimizer is refused there, before it steps.

    An optimizer step whose gradients hold inf/NaN is skipped (parameters and optimizer state untouched) and counted, in
    every precision, with fused optimizers too, and whether or not you clip (``fabric.clip_gradients`` then returns 0.0:
    ``recent_steps[-1].grad_norm`` holds the non-finite norm). Parameters equal those of Fabric's own ``MixedPrecision``
    with ``torch.amp.GradScaler`` bit for bit (the same loss scale policy and unscale; the check made once, before any
    clipping). The scale moves once per iteration, when the next ``fabric.backward`` starts: several optimizers stepped
    after one backward are all unscaled by the scale their gradients carry (Fabric's own moves it after each optimizer
    step). Inputs and outputs are converted as Fabric's plugin converts them.

    Args:
        precision: ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"fp8-mixed"`` (needs torchao).
        device: the autocast device type (``"cuda"``, ``"cpu"``, ``"mps"``); ``None`` takes the one the model is on
            after ``fabric.setup`` (read at its first forward).
        scaler: the loss scaler for ``"16-mixed"`` (a default one if ``None``); not for bf16.
        skip_nonfinite: with ``"bf16-mixed"``, skip steps whose gradients are non-finite (on by default).
        max_consecutive_skips: skipped steps in a row after which training stops with a diagnosis (``None``: never).
        master_weights: widen a model built or loaded in fp16/bf16 to FP32 masters at ``fabric.setup`` (see the
            Trainer plugin).
        keep_fp32: module types whose forward runs in FP32 (autocast off inside them).
        compensation: with ``"bf16-true"``: ``"kahan"`` (default, ``"auto"``), ``"stochastic"`` or ``None``.
        rounding_seed: the seed of stochastic rounding's random stream (the same on every rank).
        spike_guard: a :class:`~lightning_amp_plus.SpikeGuard`: skip or clip a step whose finite gradient norm is a
            spike (see the Trainer plugin); saved with the plugin's state. ``None``: no guard.
        fp8_recipe: with ``"fp8-mixed"``: ``"tensorwise"`` (default), ``"rowwise"``, ``"rowwise_with_gw_hp"`` or a
            torchao ``Float8LinearConfig`` (see the Trainer plugin).
        fp8_modules: with ``"fp8-mixed"``: ``None`` (every eligible Linear), ``"auto"`` or a callable
            ``(module, name) -> bool`` (names as ``named_modules()`` of the module given to ``fabric.setup``).
        fp8_check_interval: with ``"fp8-mixed"``: read the FP8 casts every this many optimizer steps.
        fp8_fallback: with ``"fp8-mixed"``: the percent flushed at two readings in a row above which a layer goes
            back to bf16 (``None``: warn only). Put the plugin in ``fabric.save``'s state to keep it across a resume.

    Attributes:
        scaler: the loss scaler (``None`` for bf16); after ``optimizer.step()`` its ``get_scale()`` is the scale that
            step's gradients carried. Save it with your checkpoint by putting the plugin in the state:
            ``fabric.save(path, {"model": model, "optimizer": optimizer, "amp": plugin})``.
        settings: the options above, checked (:class:`~lightning_amp_plus.plugins.core.Settings`).
        device: the autocast device type in use (the one given, or the model's, learnt at its first forward).
        engine: the :class:`~lightning_amp_plus.step.engine.StepEngine` doing the step's numerics.
        recent_steps: the last optimizer steps' results, newest last (``recent_steps[-1].skipped``, ``.grad_norm``,
            ``.scale``, ``.overflow_params``); ``.grad_norm`` is measured when something needs it (a clip, a
            :class:`~lightning_amp_plus.MixedPrecisionMonitor` observing the plugin, a spike guard), else ``None``.
        skipped_steps: the optimizer steps skipped since the start.
        fp8: under ``"fp8-mixed"``, the :class:`~lightning_amp_plus.weights.fp8.FP8Training` of the run (``layers``,
            ``fallen_back``, ``checks``, ``nonfinite_layers()``); ``None`` otherwise.

    Examples:
        >>> import lightning as L
        >>> plugin = MixedPrecisionPlugin("bf16-mixed", device="cpu")
        >>> fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        >>> model, optimizer = fabric.setup(torch.nn.Linear(4, 1), torch.optim.SGD(torch.nn.Linear(4, 1).parameters()))
        >>> fabric.backward(model(torch.ones(2, 4)).sum()); optimizer.step()
        >>> plugin.skipped_steps, plugin.recent_steps[-1].skipped
        (0, False)
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed", "bf16-true", "fp8-mixed"] = "16-mixed",
        device: str | None = None,
        scaler: DynamicLossScaler | None = None,
        *,
        skip_nonfinite: bool = True,
        max_consecutive_skips: int | None = DEFAULT_SKIPS,
        master_weights: bool = False,
        keep_fp32: Sequence[type[nn.Module]] | None = None,
        compensation: Literal["auto", "kahan", "stochastic"] | None = "auto",
        rounding_seed: int = 0,
        spike_guard: SpikeGuard | None = None,
        fp8_recipe: Recipe | Float8Config = DEFAULT_RECIPE,
        fp8_modules: Modules = None,
        fp8_check_interval: int = DEFAULT_CHECK_INTERVAL,
        fp8_fallback: float | None = DEFAULT_FALLBACK,
    ) -> None:
        self.settings = checked_settings(
            self._name(),
            precision,
            device,
            skip_nonfinite=skip_nonfinite,
            max_consecutive_skips=max_consecutive_skips,
            master_weights=master_weights,
            keep_fp32=keep_fp32,
            compensation=compensation,
            rounding_seed=rounding_seed,
            spike_guard=spike_guard,
            fp8_recipe=fp8_recipe,
            fp8_modules=fp8_modules,
            fp8_check_interval=fp8_check_interval,
            fp8_fallback=fp8_fallback,
        )
        self.precision = precision  # type: ignore[assignment]  # "fp8-mixed" is ours
        self.device = self.settings.device
        self.engine, self._scaler = engine_for(self._name(), self.settings, scaler)
        self.fp8: FP8Training | None = _fp8.fp8_for(self._name(), self.settings)
        if self.fp8 is not None and self.device is not None:
            check_device_supports(self._name(), self.device, precision)  # no float8 GEMM here: refused before setup
        self._desired_input_dtype = half_dtype(precision)
        self._modules: list[weakref.ref[nn.Module]] = []
        self._fp32_hooks: list[RemovableHandle] = []
        self._ranks_known = False
        self._optimizers_seen: set[int] = set()
        self._stand_ins: dict[torch.device, Tensor] = {}
        self._suspended = False
        self._stepped: set[int] = set()  # optimizers stepped since the scale last moved (ids)

    def __repr__(self) -> str:
        return f"lightning_amp_plus.fabric.MixedPrecisionPlugin({self.precision!r})"

    def __str__(self) -> str:
        # What Lightning's Trainer prints when this plugin is given to it ("Found invalid type for plugin {plugin}").
        return f"{self!r}, a Lightning Fabric plugin (for the Trainer, use lightning_amp_plus.MixedPrecisionPlugin)"

    # -------------------------------------------------------------------------------------------------- set-up
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            module = module.to(dtype=torch.bfloat16)  # as Fabric's bf16-true: parameters and buffers
        if self.settings.master_weights:
            refuse_sharded_master_weights(self._name(), module)
            # FP32 masters (parameters and the buffers they compute with), before Fabric moves and wraps the model:
            # `fabric.setup` is the first hook, and the model comes back from it FP32, before user code can copy it.
            widen_model_(module)
        if self.fp8 is not None:
            # Before Fabric shards it (ModelParallelStrategy's parallelize_fn runs after this hook), as torchao needs.
            _fp8.convert_for(self._name(), self.fp8, module)
        # Fabric converts before it moves the module to its device and wraps it (DDP, FSDP): the device and the
        # parameters' names are read from the module later, once it is where it will train.
        self._modules.append(weakref.ref(module))
        if self.device is not None:
            self._fp32_hooks.extend(compute_in_fp32(module, self.settings.keep_fp32, self.device))
        return module

    def _autocast_device(self) -> str:
        """The autocast device type: the one given, else the set-up modules' (learnt once), else the default."""
        if self.device is None:
            found = next((p.device.type for m in self._live_modules() for p in m.parameters()), None)
            if found is None or found == "meta":
                return default_device()  # nothing set up yet (`fabric.autocast()` before `fabric.setup`)
            self.device = found
            if self.fp8 is not None:  # before the first FP8 GEMM runs there
                check_device_supports(self._name(), found, self.precision)
            for module in self._live_modules():
                self._fp32_hooks.extend(compute_in_fp32(module, self.settings.keep_fp32, found))
        return self.device

    def _live_modules(self) -> list[nn.Module]:
        return [module for ref in self._modules if (module := ref()) is not None]

    def _set_up(self, optimizer: Optimizer) -> None:
        """What Fabric never tells a plugin at set-up, learnt at the first step: the ranks, the names, the device."""
        if id(optimizer) not in self._optimizers_seen:
            self._optimizers_seen.add(id(optimizer))
            if isinstance(optimizer, LBFGS) and self.engine.check:
                raise TypeError(
                    f"{self._name()}({self.precision!r}) cannot drive torch.optim.LBFGS: it re-evaluates the "
                    "closure inside `step()`, where gradients cannot be checked or unscaled first. Use another "
                    f"optimizer, or {self._name()}('bf16-mixed', skip_nonfinite=False)."
                )
            self.engine.track(optimizer)  # a compensation refuses an optimizer it does not implement, before its step
        if self._ranks_known or not self.engine.check:
            return
        self._ranks_known = True
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.device is None and not self._live_modules() and params:
            self.device = params[0].device.type  # no module was set up with Fabric: the optimizer's parameters
        # fp8-mixed was checked (and warned about) when the device became known, before its first forward.
        check_device_supports(self._name(), self._autocast_device(), self.precision, warn=self.fp8 is None)
        # The names as the user's model gives them, read now that Fabric has wrapped it (FSDP replaces parameters).
        self.engine.name_parameters([pair for module in self._live_modules() for pair in user_names(module)])
        set_up_ranks(self.engine, params)

    # ---------------------------------------------------------------------------------------------- autocast
    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        if self._suspended:
            return nullcontext()
        if self.fp8 is not None and torch.is_grad_enabled():
            self.fp8.before_forward()  # a training forward: a check step's readings start with its first
        return self.precision_context()

    def precision_context(self) -> AbstractContextManager[Any]:
        """The precision's forward context: autocast (``*-mixed``) or bf16 default tensors (``bf16-true``)."""
        if self.precision == "bf16-true":
            return _DtypeContextManager(torch.bfloat16)  # as Fabric's bf16-true: tensors made in forward are bf16
        return torch.autocast(self._autocast_device(), dtype=half_dtype(self.precision))

    @contextmanager
    def autocast_suspended(self) -> Iterator[None]:
        """For a replay that sets its own precision (the monitor's autopsy and headroom readings).

        Inside, Fabric's wrapper runs no forward context and converts no input, and a backward taken outside
        ``fabric.backward`` is allowed (the replay's ``torch.autograd.grad``, which writes no ``.grad``).
        """
        import lightning.fabric.wrappers as wrappers

        self._suspended = True
        # Fabric refuses a backward outside fabric.backward through a module-level flag; the replay is one.
        inside = getattr(wrappers, "_in_fabric_backward", False)
        wrappers._in_fabric_backward = True
        try:
            yield
        finally:
            self._suspended = False
            wrappers._in_fabric_backward = inside

    @override
    def tensor_init_context(self) -> AbstractContextManager[Any]:
        return _DtypeContextManager(torch.bfloat16) if self.precision == "bf16-true" else nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager[Any]:
        return self.tensor_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        # As Fabric's MixedPrecision: floating inputs in the half dtype (as given during a suspended replay).
        if self._suspended:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self._desired_input_dtype)

    @override
    def convert_output(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())

    # -------------------------------------------------------------------------------------------------- step
    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        refuse_deepspeed(self._name(), model, "Fabric")  # under DeepSpeed, Fabric hands the engine here
        self._end_iteration()  # the steps since the last backward are over: the scale moves once for them
        self.engine.scale_loss(tensor).backward(*args, **kwargs)  # type: ignore[no-untyped-call]

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        # Fabric's clip_gradients calls this first: unscaled, checked and measured here, before any clipping (clipping
        # by value would turn inf into the clip value). Fused optimizers too: their step then takes the unscale path.
        self._set_up(optimizer)
        self._refuse_half_masters(optimizer)
        self._begin_pass(optimizer)
        self.engine.prepare(optimizer)

    @override
    def main_params(self, optimizer: Optimizer) -> list[Tensor]:  # type: ignore[override]
        # What Fabric clips. On a step found non-finite (it will be skipped) a stand-in with a zero gradient: torch's
        # clip_grad_norm_ (error_if_nonfinite=True by default) and clip_grad_value_ (which fails on an empty list) then
        # have nothing to clip, and the real gradients are left as they are.
        params = self.engine.main_params(optimizer)
        if params or not self.engine.found_inf(optimizer):
            return params
        device = next(p.device for group in optimizer.param_groups for p in group["params"])
        return [self._stand_in(device)]

    def _stand_in(self, device: torch.device) -> Tensor:
        if device not in self._stand_ins:
            stand_in = torch.zeros(1, device=device, requires_grad=True)
            stand_in.grad = torch.zeros(1, device=device)
            self._stand_ins[device] = stand_in
        return self._stand_ins[device]

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._set_up(optimizer)
        self._refuse_half_masters(optimizer)
        self._begin_pass(optimizer)
        output = self.engine.step(optimizer, **kwargs)
        if self.fp8 is not None:
            _fp8.after_step(self.fp8, self.engine.result(optimizer))
        self._stepped.add(id(optimizer))  # the scale moves at the next backward, after every optimizer has stepped
        return output

    def _refuse_half_masters(self, optimizer: Optimizer) -> None:
        if self.settings.master_weights:  # a half tensor written into a master since `fabric.setup`: refused now
            names = lambda: [pair for module in self._live_modules() for pair in user_names(module)]  # noqa: E731
            refuse_half_masters(self._name(), optimizer, names)

    def _begin_pass(self, optimizer: Optimizer) -> None:
        if id(optimizer) in self._stepped:
            self._end_iteration()  # stepped again with no backward between: its last iteration is over

    def _end_iteration(self) -> None:
        """Move the loss scale once for the optimizer steps taken since it last moved (none: nothing to do)."""
        if self._stepped:
            self._stepped.clear()
            self.engine.end_batch()

    # --------------------------------------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        self._end_iteration()  # the scale's move the next backward would make, made now, so that it is saved
        return _plugin_state.save_state(self.engine, self.settings, self.fp8)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _plugin_state.load_state(state_dict, self.engine, owner=self._name(), settings=self.settings, fp8=self.fp8)

    def __getstate__(self) -> dict[str, Any]:
        # Modules and their hooks belong to this process (Fabric pickles the plugin to start ddp_spawn's workers);
        # the scale's pending move is made first, as for a checkpoint.
        self._end_iteration()
        return {**self.__dict__, "_modules": [], "_fp32_hooks": []}

    @override
    def teardown(self) -> None:
        for handle in self._fp32_hooks:
            handle.remove()
        self._fp32_hooks = []
