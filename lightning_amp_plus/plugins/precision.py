"""``MixedPrecisionPlugin``: one plugin, two front ends.

:class:`FabricMixedPrecisionPlugin` (``lightning_amp_plus.fabric.MixedPrecisionPlugin``) is the plugin: its options
(:class:`~.options.Settings`), its :class:`~lightning_amp_plus.step.engine.StepEngine`, autocast, the step, the
checkpoint state: everything both front ends do, over Fabric's ``Precision`` hooks. :class:`MixedPrecisionPlugin`
(``lightning_amp_plus.MixedPrecisionPlugin``) is that plugin plus the Trainer's own hooks (``connect``,
``pre_backward``, ``optimizer_step`` with its closure, clipping by norm), as Lightning's ``TransformerEnginePrecision``
is Fabric's plus the Trainer's ``Precision``. The same settings give the same step on both
(``tests/plugins/test_parity.py`` trains every option on both, bit for bit).

One optimizer step, on either front end: the loss is scaled before backward (under fp16, by the scaler's ``scale``);
the gradients are unscaled and checked once, where something first needs them unscaled (Fabric's ``clip_gradients``,
the Trainer's hooks and clipping; under fp16 on the Trainer, before the hooks, as Lightning's plugin unscales, unless
the optimizer unscales in its own kernel) or else in the step; :meth:`FabricMixedPrecisionPlugin._step` steps or skips
(:meth:`~StepEngine.step`, with bf16 weights' compensated update in place of the optimizer's); the loss scale moves once
per iteration (:meth:`~StepEngine.update`): after the step on the Trainer, at the next ``backward`` under Fabric (whose
loop has no end-of-batch hook), so several optimizers stepped after one backward are all unscaled by the scale their
gradients carry. Under fp16 the scaler's ``scale``, ``unscale_``, ``step`` and ``update`` are called where Lightning's
and Fabric's plugins call their GradScaler's, so that a test counting them counts alike.
"""

from __future__ import annotations

import sys
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities import rank_zero_warn
from lightning.pytorch.plugins.precision import MixedPrecision as TrainerMixedPrecision
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.optim import LBFGS, Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import Unpack, override

from lightning_amp_plus.plugins import fp8 as _fp8
from lightning_amp_plus.plugins import state as _state
from lightning_amp_plus.plugins.options import FP8, PluginOptions, Precision, Settings
from lightning_amp_plus.plugins.ranks import fsdp2_policy, refuse_sharded_master_weights, set_up_ranks
from lightning_amp_plus.plugins.wrappers import unwrapped, user_names
from lightning_amp_plus.step.engine import PendingStep, StepEngine, StepResult
from lightning_amp_plus.step.scaler import DynamicLossScaler
from lightning_amp_plus.weights.compensated import Compensators
from lightning_amp_plus.weights.fp8 import FP8Training
from lightning_amp_plus.weights.fp32_modules import compute_in_fp32
from lightning_amp_plus.weights.master import refuse_half_copies, refuse_half_masters, widen_model_

__all__ = ["FabricMixedPrecisionPlugin", "MixedPrecisionPlugin", "skipped_steps"]

# The key under which Lightning's own plugin stores its GradScaler state. (Lightning 1.x's native AMP stored it under
# "native_amp_scaling_state", which Lightning hands to the load_state_dict of any MixedPrecision, this plugin included.)
_LIGHTNINGS_KEY = "MixedPrecision"


# This module is loaded twice (lightning_amp_plus._standalone): over `lightning`, and over Lightning's standalone
# packages (`lightning_fabric`, `pytorch_lightning`), where `pl` is `pytorch_lightning`. (The standalone load renames
# `lightning.pytorch` and `lightning.fabric` in strings too: the test is written with the name it leaves alone.)
_STANDALONE = pl.__name__ == "pytorch_lightning"


def _home(front: str, *, other: bool = False) -> str:
    """The public module of this load's plugins for ``front`` (``"fabric"`` or ``"trainer"``), or of the other load's.

    Each Fabric and each Trainer takes only plugins built on its own package's classes, and refuses the others with
    "Found invalid type for plugin {plugin}": the plugins' ``str`` says where to import the right one from.

    Examples:
        >>> _home("fabric"), _home("fabric", other=True), _home("trainer", other=True)
        ('lightning_amp_plus.fabric', 'lightning_amp_plus.lightning_fabric', 'lightning_amp_plus.pytorch_lightning')
    """
    standalone = other != _STANDALONE
    if front == "fabric":
        return "lightning_amp_plus.lightning_fabric" if standalone else "lightning_amp_plus.fabric"
    return "lightning_amp_plus.pytorch_lightning" if standalone else "lightning_amp_plus"


def _package(front: str, *, other: bool = False) -> str:
    """The package a user installs for ``front`` whose classes this load's plugins are built on (or the other's)."""
    if other == _STANDALONE:
        return "lightning"
    return "lightning_fabric" if front == "fabric" else "pytorch_lightning"


class FabricMixedPrecisionPlugin(FabricMixedPrecision):
    """Mixed precision for Lightning Fabric with a from-scratch loss scaler: ``L.Fabric(plugins=[this])``.

    ``"16-mixed"`` runs under fp16 autocast with a :class:`~lightning_amp_plus.DynamicLossScaler`; ``"bf16-mixed"``
    under bf16 autocast; ``"bf16-true"`` holds the model in bf16 and steps it with compensated updates; ``"fp8-mixed"``
    is ``"bf16-mixed"`` with the eligible ``nn.Linear`` layers converted in place to torchao's FP8 training layers at
    ``fabric.setup``. The options are the Trainer plugin's (:class:`MixedPrecisionPlugin` says what each does), but
    ``hold_schedulers_on_skip``: Fabric steps no LR scheduler, and refuses it.

    An optimizer step whose gradients hold inf/NaN is skipped (parameters and optimizer state untouched) and counted,
    in every precision, with fused optimizers too. Parameters equal those of Fabric's own ``MixedPrecision`` with
    ``torch.amp.GradScaler`` bit for bit (the same loss scale policy, unscale and clipping). ``fabric.clip_gradients``
    keeps Fabric's contract: with its default ``error_if_nonfinite=True`` it raises on a step whose gradients hold
    inf/NaN, as Fabric's own plugin does; with ``error_if_nonfinite=False`` it returns that step's non-finite norm and
    the step is skipped (pass it under ``"16-mixed"``, where a loss scale overflows routinely). The loss scale moves
    once per iteration, when the next ``fabric.backward`` starts: several optimizers stepped after one backward are
    all unscaled by the scale their gradients carry (Fabric's own moves it after each optimizer step).

    Compensators (``"bf16-true"``) are made at each optimizer's first step (Fabric shows the plugin no optimizer
    before): an optimizer the compensated update does not implement is refused there, before it steps.

    Attributes:
        settings: the options, checked (:class:`~lightning_amp_plus.plugins.options.Settings`).
        device: the autocast device type in use (the one given, or the model's, learnt at its first forward).
        scaler: the loss scaler (``None`` for bf16); after ``optimizer.step()`` its ``get_scale()`` is the scale that
            step's gradients carried. Save it with your checkpoint by putting the plugin in the state:
            ``fabric.save(path, {"model": model, "optimizer": optimizer, "amp": plugin})``.
        engine: the :class:`~lightning_amp_plus.step.engine.StepEngine` doing the step's numerics.
        recent_steps: the last optimizer steps' results, newest last (``recent_steps[-1].skipped``, ``.grad_norm``,
            ``.scale``, ``.overflow_params``); ``.grad_norm`` is measured when something reads it (a
            :class:`~lightning_amp_plus.MixedPrecisionMonitor` observing the plugin, a spike guard), else ``None``.
        skipped_steps: the optimizer steps skipped since the start.
        compensators: under ``"bf16-true"`` with compensation, each optimizer's compensated update; else ``None``.
        fp8: under ``"fp8-mixed"``, the :class:`~lightning_amp_plus.weights.fp8.FP8Training` of the run (``layers``,
            ``fallen_back``, ``checks``, ``nonfinite_layers()``); ``None`` otherwise.

    State (besides those): the modules set up (weak references, where the device and the names are learnt), the hooks
    keeping ``keep_fp32`` modules in FP32, the optimizers stepped since the scale last moved, whether the ranks are
    known, and whether a replay suspended the precision.

    Examples:
        >>> import lightning as L
        >>> plugin = FabricMixedPrecisionPlugin("bf16-mixed", device="cpu")
        >>> fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        >>> model, optimizer = fabric.setup(torch.nn.Linear(4, 1), torch.optim.SGD(torch.nn.Linear(4, 1).parameters()))
        >>> fabric.backward(model(torch.ones(2, 4)).sum()); optimizer.step()
        >>> plugin.skipped_steps, plugin.recent_steps[-1].skipped
        (0, False)
    """

    _autocast_cache = True  # as Fabric's own MixedPrecision (the Trainer's turns it off)
    _public_name = "MixedPrecisionPlugin"  # its name in lightning_amp_plus.fabric (and .lightning_fabric)

    # Fabric's MixedPrecision is the base (every method of it is overridden here, and its __init__, which builds a
    # torch GradScaler and refuses bf16-true and fp8-mixed, does not run) so that what Lightning decides by a plugin's
    # class holds for this one as for Fabric's own: ThroughputMonitor's compute dtype, which sets the peak FLOPs of its
    # MFU, reads `_desired_input_dtype` of a MixedPrecision and takes any other plugin for FP32
    # (tests/plugins/test_throughput.py).

    def __init__(
        self,
        precision: Precision = "16-mixed",
        device: str | None = None,
        scaler: DynamicLossScaler | None = None,
        **options: Unpack[PluginOptions],
    ) -> None:
        self.settings = Settings.checked(self._name(), precision, device, options, refused=self._refused())
        self.precision = precision  # type: ignore[assignment]  # "fp8-mixed" is ours: Lightning reports it
        self.device = self.settings.device  # type: ignore[assignment]  # None: the model's, learnt at set-up
        self.engine, self._scaler = _engine(self._name(), self.settings, scaler)
        method = self.settings.compensation
        self.compensators = None if method is None else Compensators(method, self.settings.rounding_seed)
        self.fp8: FP8Training | None = _fp8.fp8_for(self._name(), self.settings)
        # The compute (autocast) dtype, where Lightning's MixedPrecision keeps it: ThroughputMonitor reads it there.
        self._desired_input_dtype = _half_dtype(self.settings.precision)
        self._modules: list[weakref.ref[nn.Module]] = []
        self._fp32_hooks: list[RemovableHandle] = []
        self._stepped: set[int] = set()  # optimizers stepped since the scale last moved (ids)
        self._ranks_known = False
        self._suspended = False
        self._warned = False  # the device's warning (fp16 or FP8 on a CPU) is given once

    def _name(self) -> str:
        """The class name the messages give."""
        return "MixedPrecisionPlugin"

    def _refused(self) -> dict[str, str]:
        """The options this front end cannot honour, with the reason."""
        return {
            "hold_schedulers_on_skip": "Fabric steps no LR scheduler, so there is none to hold (your loop steps its "
            "own: skip its step when `plugin.recent_steps[-1].skipped`). Drop hold_schedulers_on_skip."
        }

    def __repr__(self) -> str:
        return f"{_home('fabric')}.{self._public_name}({self.precision!r})"

    def __str__(self) -> str:
        # What a Trainer, or the other package's Fabric, prints when it refuses this plugin ("Found invalid type for
        # plugin {plugin}"): where the plugin it takes is imported from.
        fabric, other = FabricPrecision.__module__.split(".plugins")[0], _package("fabric", other=True)
        return (
            f"{self!r}, a plugin for `{fabric}`'s Fabric (with the `{other}` package, import it from "
            f"{_home('fabric', other=True)}; for the Trainer, use {_home('trainer')}.{self._public_name})"
        )

    # ------------------------------------------------------------------------------------------------ readings
    @property  # type: ignore[override]  # a DynamicLossScaler: GradScaler's API, not its class
    def scaler(self) -> DynamicLossScaler | None:
        """The loss scaler (``None`` for bf16): ``torch.amp.GradScaler``'s API over this plugin's engine.

        Assigning another :class:`~lightning_amp_plus.DynamicLossScaler` makes it scale, check and update from then
        on; the plugin's optimizers, names, ranks, held schedulers and recent results carry over to it. Under fp16 the
        plugin calls its ``scale``, ``unscale_``, ``step`` and ``update`` where Lightning's plugin calls its
        GradScaler's, so ``mock.patch.object(plugin.scaler, ...)`` or ``plugin.scaler = Mock(wraps=plugin.scaler)``
        (Lightning's own tests do both) counts the same calls.
        """
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: DynamicLossScaler | None) -> None:
        where = f"`{self._name()}.scaler = {scaler!r}`"
        if scaler is None and self.precision != "16-mixed":
            return  # bf16 has no scaler to replace (its check stays)
        if scaler is None:
            raise ValueError(
                f"{where}: fp16 needs a loss scaler (its gradients would underflow unscaled). Assign a "
                "lightning_amp_plus.DynamicLossScaler, e.g. DynamicLossScaler(init_scale=2.0**12)."
            )
        checked = _checked_scaler(self.settings, _wrapped(scaler), where)
        if checked.engine is not self.engine:  # the same scaler again (or wrapped by a Mock): nothing to take over
            checked.engine.take_over(self.engine)
        self._scaler, self.engine = scaler, checked.engine

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients since the start (0 when nothing is checked)."""
        return self.engine.skipped_steps

    @property
    def recent_steps(self) -> deque[StepResult | PendingStep]:
        """The last optimizer steps' results, newest last (:class:`~lightning_amp_plus.step.engine.StepResult`).

        A fused optimizer's step not read yet is a :class:`~lightning_amp_plus.step.engine.PendingStep`, which reads
        the same way.
        """
        return self.engine.log.recent

    @property
    def mp_policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for half compute under ``ModelParallelStrategy``: FP32 shards, half math.

        Pass it to ``fully_shard(..., mp_policy=...)`` where the model is sharded (in a LightningModule's
        ``configure_model``, ``self.trainer.precision_plugin.mp_policy``): the FP32 sharded parameters are then the
        masters the optimizer steps, the forward and backward run on all-gathered half copies, and the gradients are
        reduce-scattered in FP32.
        """
        return fsdp2_policy(self._desired_input_dtype)

    # -------------------------------------------------------------------------------------------------- set-up
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            module = module.to(dtype=torch.bfloat16)  # as Lightning's bf16-true: parameters and buffers
        elif self.settings.master_weights:
            refuse_sharded_master_weights(self._name(), module)
            # FP32 masters (parameters and the buffers they compute with), before the strategy moves and wraps the
            # model: this is the first hook, and the model comes back from it FP32, before user code can copy it.
            self._widen(module)
        if self.fp8 is not None:
            # Before the optimizers are made and before a strategy shards the model, as torchao needs; a model
            # converted already (a second set-up) gains nothing.
            _fp8.convert_for(self._name(), self.fp8, unwrapped(module))
        # The module is converted before it is moved to its device and wrapped (DDP, FSDP): the device and the
        # parameters' names are read from it later, once it is where it will train.
        self._modules.append(weakref.ref(module))
        if self.device is not None:
            self._fp32_hooks.extend(compute_in_fp32(module, self.settings.keep_fp32, self.device))
        return module

    def _widen(self, module: nn.Module) -> None:
        widen_model_(module)

    def _live_modules(self) -> list[nn.Module]:
        return [module for ref in self._modules if (module := ref()) is not None]

    def _autocast_device(self) -> str:
        """The autocast device type: the one given, else the set-up modules' (learnt once), else the default."""
        if self.device is None:
            found = next((p.device.type for m in self._live_modules() for p in m.parameters()), None)
            if found is None or found == "meta":
                return _default_device()  # nothing set up yet (`fabric.autocast()` before `fabric.setup`)
            self._use_device(found)
            for module in self._live_modules():
                self._fp32_hooks.extend(compute_in_fp32(module, self.settings.keep_fp32, found))
        assert self.device is not None
        return self.device

    def _use_device(self, device: str) -> None:
        """Train on ``device``: refused where the precision cannot run there, warned once where it is slow."""
        self.device = device
        if self.precision == FP8:
            _fp8.check_fp8_device(self._name(), device, warn=not self._warned)
        elif device == "cpu" and self.precision == "16-mixed" and not self._warned:
            rank_zero_warn(
                f"{self._name()}('16-mixed') on CPU: fp16 autocast is correct there but slow (many times slower than "
                "fp32 on most CPUs). For speed on CPU prefer 'bf16-mixed' or 32-bit.",
                category=UserWarning,
            )
        self._warned = True

    def _know(self, optimizer: Optimizer, *, fused: bool) -> None:
        """Meet ``optimizer``: refuse what cannot be checked, number it, make its compensator.

        The compensator refuses what it cannot step here, before any step.
        """
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, LBFGS) and self.engine.check:
            raise TypeError(
                f"{self._name()}({self.precision!r}) cannot drive torch.optim.LBFGS: it re-evaluates the closure "
                "inside `step()`, where gradients cannot be checked or unscaled first. Use another optimizer, or "
                f"{self._name()}('bf16-mixed', skip_nonfinite=False)."
            )
        position = self.engine.track(optimizer, fused=fused and self.compensators is None)
        if self.compensators is not None:
            self.compensators.of(inner, position)

    def _learn_ranks(self, params: list[Tensor], names: list[tuple[str, Tensor]], wrapper: Any = None) -> None:
        """Where the gradients live across ranks (every rank then skips alike), and the parameters' names."""
        self._ranks_known = True
        if self.engine.check:
            set_up_ranks(self.engine, params, wrapper)
            self.engine.name_parameters(names)

    def _user_names(self) -> list[tuple[str, Tensor]]:
        return [pair for module in self._live_modules() for pair in user_names(module)]

    # ---------------------------------------------------------------------------------------------- autocast
    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        if self._suspended:
            return nullcontext()
        if self.fp8 is not None and torch.is_grad_enabled():
            self.fp8.before_forward()  # a training forward: a check step's readings start with its first
        return self.autocast_context_manager()

    def autocast_context_manager(self) -> AbstractContextManager[Any]:
        """The precision's forward context: autocast (``*-mixed``) or bf16 default tensors (``bf16-true``)."""
        if self.precision == "bf16-true":
            return _DtypeContextManager(torch.bfloat16)  # as Lightning's bf16-true: tensors made in forward are bf16
        device = self.device or self._autocast_device()
        return torch.autocast(device, dtype=self._desired_input_dtype, cache_enabled=self._autocast_cache)

    @contextmanager
    def autocast_suspended(self) -> Iterator[None]:
        """For a replay that sets its own precision (the monitor's autopsy and headroom readings, under Fabric).

        Inside, Fabric's wrapper runs no forward context and converts no input, and a backward taken outside
        ``fabric.backward`` is allowed (the replay's ``torch.autograd.grad``, which writes no ``.grad``).
        """
        import lightning.fabric.wrappers as wrappers

        self._suspended = True
        # Fabric refuses a backward outside fabric.backward through this module-level flag of its own; the replay is
        # one (tests/monitor/test_monitor_autopsy.py replays a Fabric step).
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

    # ------------------------------------------------------------------------------------------- Fabric's step
    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        _refuse_deepspeed(self._name(), model, "Fabric")  # under DeepSpeed, Fabric hands the engine here
        self._end_iteration()  # the steps since the last backward are over: the scale moves once for them
        # Through the scaler, as Fabric's plugin scales with its GradScaler: a test patching `scaler.scale` counts it.
        scaled = tensor if self._scaler is None else self._scaler.scale(tensor)
        scaled.backward(*args, **kwargs)  # type: ignore[no-untyped-call]

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        # Fabric's clip_gradients calls this first: unscaled and checked here, before any clipping (clipping by value
        # would turn inf into the clip value). Fused optimizers too: their step then takes the unscale path.
        self._first_step(optimizer)
        self._begin(optimizer)
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)  # as Fabric's plugin unscales: a test patching `scaler.unscale_` counts it
        # Read now: a spike guard judges (and clips) before the clip that follows, and the non-finite gradients are
        # named before a clip by value makes them finite. The step's one host read, as later in the step.
        self.engine.unscale(optimizer, read=True)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._first_step(optimizer)
        self._begin(optimizer)
        return self._step(optimizer, **kwargs)  # the scale moves at the next backward

    def _first_step(self, optimizer: Optimizer) -> None:
        """What Fabric never tells a plugin at set-up, learnt at the first step: the optimizer, the ranks, the names."""
        if not self.engine.knows(optimizer):
            self._know(optimizer, fused=True)
        if not self._ranks_known:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if self.device is None and not self._live_modules() and params:
                self._use_device(params[0].device.type)  # no module was set up with Fabric: the optimizer's
            self._autocast_device()
            # The names as the user's model gives them, read now that Fabric has wrapped it (FSDP replaces them).
            self._learn_ranks(params, self._user_names())

    def _begin(self, optimizer: Optimizer) -> None:
        if id(optimizer) in self._stepped:
            self._end_iteration()  # stepped again with no backward between: its last iteration is over
        if self.settings.master_weights:  # a half tensor written into a master since set-up: refused now
            refuse_half_masters(self._name(), optimizer, self._user_names)

    # ------------------------------------------------------------------------------------- the step, both fronts
    def _step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` or skip it (the engine decides), with bf16 weights' compensated update in its place.

        Under fp16 the scaler steps and updates, as Lightning's plugin steps through its GradScaler: a test that
        patches ``plugin.scaler.step`` (Lightning's own do) sees every call (tests/plugins/test_one_plugin.py).
        """
        if self._scaler is not None:
            output = self._scaler.step(optimizer, **kwargs)
        else:
            apply = None
            if self.compensators is not None:
                inner = getattr(optimizer, "optimizer", optimizer)
                apply = self.compensators.of(inner, self.engine.track(optimizer)).step
            output = self.engine.step(optimizer, apply, **kwargs)
        if self.fp8 is not None:
            _fp8.after_step(self.fp8, self.engine.log.recent[-1])
        self._stepped.add(id(optimizer))  # the iteration ends (the scale moves) after every optimizer has stepped
        return output

    def _end_iteration(self) -> None:
        """Move the loss scale once for the optimizer steps taken since it last moved (none: nothing to do)."""
        if self._stepped:
            self._stepped.clear()
            if self._scaler is not None:
                self._scaler.update()
            else:
                self.engine.update()

    # --------------------------------------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        self._end_iteration()  # the scale's move the iteration's end would make, made now, so that it is saved
        return _state.save_state(self.engine, self.settings, self.fp8, self.compensators)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        owner, settings = self._checkpoint_key(), self.settings
        _state.load_state(
            state_dict, self.engine, owner=owner, settings=settings, fp8=self.fp8, compensators=self.compensators
        )

    def _checkpoint_key(self) -> str:
        return self._name()

    def __getstate__(self) -> dict[str, Any]:
        # Modules and their hooks belong to this process (Lightning pickles the plugin to start ddp_spawn's workers);
        # the scale's pending move is made first, as for a checkpoint.
        self._end_iteration()
        return {**self.__dict__, "_modules": [], "_fp32_hooks": []}

    @override
    def teardown(self) -> None:
        self._remove_fp32_hooks()

    def _remove_fp32_hooks(self) -> None:
        for handle in self._fp32_hooks:
            handle.remove()
        self._fp32_hooks = []


class MixedPrecisionPlugin(TrainerMixedPrecision, FabricMixedPrecisionPlugin):  # type: ignore[misc]
    """Mixed-precision training with autocast, a from-scratch dynamic loss scaler, FP32 master weights, or bf16 weights.

    The Trainer's face of the plugin (:class:`FabricMixedPrecisionPlugin` plus the Trainer's hooks):
    ``Trainer(plugins=[MixedPrecisionPlugin(...)])``.

    ``"16-mixed"`` runs forward under fp16 autocast and scales the loss with a :class:`DynamicLossScaler`;
    ``"bf16-mixed"`` runs under bf16 autocast without scaling; ``"bf16-true"`` holds the model in bf16 (the memory of
    Lightning's ``bf16-true``) and steps it with compensated updates (``compensation``), so updates too small for a
    bf16 weight are not lost; ``"fp8-mixed"`` is ``"bf16-mixed"`` with the eligible ``nn.Linear`` layers converted in
    place to torchao's FP8 training layers at set-up (``fp8_*`` options; the documentation's "FP8 training" page). In
    all of them, an optimizer step whose gradients hold inf/NaN is skipped: parameters and optimizer state stay
    untouched and, by default, so do the LR schedulers of that optimizer.

    Each optimizer step reads as the recipe: the closure runs (forward under autocast, backward of the scaled loss);
    the gradients are unscaled exactly once and checked (GradScaler's one pass); ``on_before_optimizer_step`` hooks
    and clipping (by norm: ``clip_grad_norm_``'s result bit for bit; or by value) see them unscaled; the step is taken
    or skipped; the scale is updated once per training batch, also when several optimizers step in one batch under
    manual optimization. The norm is measured when something reads it (a clip by norm, a
    :class:`~lightning_amp_plus.MixedPrecisionMonitor`, a spike guard); otherwise ``recent_steps[-1].grad_norm`` is
    ``None``. A fused optimizer (``AdamW(fused=True)``...) that nothing reads or clips before its step unscales and
    skips in its own kernel, with no host read in the step.

    Args:
        precision: ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"fp8-mixed"`` (needs torchao:
            ``pip install "lightning-amp-plus[fp8]"``; CUDA from compute capability 8.9, or CPU, emulated).
        device: the autocast device type (``"cuda"``, ``"cpu"``, ``"mps"``); ``None`` takes the model's device at setup.
        scaler: the loss scaler for ``"16-mixed"`` (a default :class:`DynamicLossScaler` if ``None``); not for bf16.
        **options: by keyword (each refused where the precision would ignore it):

            * ``skip_nonfinite`` (default ``True``): with ``"bf16-mixed"`` or ``"bf16-true"``, skip steps whose
              gradients are non-finite. fp16 and FP8 always check.
            * ``hold_schedulers_on_skip`` (default ``True``): do not advance an LR scheduler when every step of its
              optimizer since its last step was skipped (a fused optimizer's skip, still on the device, is made up
              for at a later scheduler step: docs/plugin.md). Off, schedulers step as in Lightning's built-in plugin.
            * ``max_consecutive_skips`` (default 50): skipped steps in a row after which training stops with a
              diagnosis (``None``: never). It configures the default fp16 scaler and the bf16 check; with your own
              ``scaler``, that scaler's limit applies, and a limit passed here too must equal it.
            * ``master_weights`` (default ``False``): every floating parameter is an FP32 master: a model built or
              loaded in fp16/bf16 is widened to FP32 before training, then trains as an FP32 model under ``*-mixed``
              (hooks and callbacks see and change FP32 values). Under DDP the gradients are also all-reduced in the
              half dtype (half the bytes). See the documentation's "Master weights" page.
            * ``keep_fp32``: module types whose forward runs in FP32 (autocast off inside them, their inputs widened).
            * ``compensation`` (default ``"auto"``: Kahan): with ``"bf16-true"``, how the bf16 weights keep updates
              smaller than their spacing: ``"kahan"``, ``"stochastic"`` or ``None`` (Lightning's plain
              ``bf16-true``). The model's own ``torch.optim.AdamW``, ``Adam`` or ``SGD`` is stepped so.
            * ``rounding_seed`` (default 0): with ``compensation="stochastic"``, the seed of the random stream.
            * ``spike_guard``: a :class:`~lightning_amp_plus.SpikeGuard` that skips or clips a step whose finite
              gradient norm is a spike (see the documentation's "Spike guard" page); one guard per optimizer.
            * ``fp8_recipe`` (default ``"tensorwise"``), ``fp8_modules`` (default: every eligible Linear),
              ``fp8_check_interval`` (default 50), ``fp8_fallback`` (default 1.0; ``None``: warn only): with
              ``"fp8-mixed"``, see the documentation's "FP8 training" page.

    Attributes:
        settings: the options, checked (:class:`~lightning_amp_plus.plugins.options.Settings`).
        device: the autocast device type in use (the one given, or the model's, learnt at set-up).
        scaler: the :class:`DynamicLossScaler` (``None`` for bf16); ``trainer.scaler`` returns it. Assigning another
            scaler replaces it for every part of the step.
        engine: the :class:`~lightning_amp_plus.step.engine.StepEngine` doing the step's numerics.
        recent_steps: the last optimizer steps' results, newest last (up to 1024 kept).
        skipped_steps: the optimizer steps skipped since the start.
        compensators: under ``"bf16-true"`` with compensation, each optimizer's compensated update.
        fp8: under ``"fp8-mixed"``, the :class:`~lightning_amp_plus.weights.fp8.FP8Training` of the run; else ``None``.

    State (besides :class:`FabricMixedPrecisionPlugin`'s): whether something reads the gradients before the step (the
    Trainer knows at ``connect``).

    Examples:
        >>> from lightning import Trainer
        >>> plugin = MixedPrecisionPlugin("bf16-mixed", device="cpu")
        >>> trainer = Trainer(plugins=[plugin], accelerator="cpu", logger=False, enable_progress_bar=False)
        >>> trainer.precision, trainer.scaler
        ('bf16-mixed', None)
        >>> MixedPrecisionPlugin("16-mixed", master_weights=True).settings.master_weights
        True
    """

    _autocast_cache = False  # as Lightning's own plugin: the cast cache breaks under activation checkpointing
    _read_before_step = True  # until connect knows better: unscale before the hooks (set per instance there)

    # Lightning's MixedPrecision is the first base, so that Lightning's checks of a plugin's class take this one for
    # its own (ThroughputMonitor's compute dtype; a Lightning 1.x checkpoint's "native_amp_scaling_state", handed to
    # load_state_dict). Its methods come before the Fabric plugin's: those this plugin does not override are taken
    # from where they came before. Its clip_gradients refuses a fused optimizer; this plugin clips its gradients. (Its
    # types say an autocast context: bf16-true's is a dtype context.)
    __init__ = FabricMixedPrecisionPlugin.__init__
    autocast_context_manager = FabricMixedPrecisionPlugin.autocast_context_manager  # type: ignore[assignment]
    state_dict = FabricMixedPrecisionPlugin.state_dict
    load_state_dict = FabricMixedPrecisionPlugin.load_state_dict
    clip_gradients = TrainerPrecision.clip_gradients

    def _refused(self) -> dict[str, str]:
        return {}

    def _checkpoint_key(self) -> str:
        return type(self).__qualname__

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision!r})"

    def __str__(self) -> str:
        # Each of Lightning's two Trainer packages (`lightning.pytorch`, `pytorch_lightning`: classes of their own)
        # refuses the other's plugin with "Found invalid type for plugin {plugin}": the str says what to import there.
        other, home = _package("trainer", other=True), _home("trainer", other=True)
        return f"{self!r} (for `{pl.__name__}`; with the `{other}` package, import it from {home})"

    # -------------------------------------------------------------------------------------------------- set-up
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if getattr(unwrapped(module), "_trainer", None) is None:
            # Only Lightning Fabric converts a module that no Trainer holds (at `fabric.setup`, before any forward).
            home = _home("fabric")
            raise TypeError(
                f"{type(self).__name__} is the Trainer's plugin; with Lightning Fabric use "
                f"{home}.MixedPrecisionPlugin({self.precision!r}) instead "
                f"(`Fabric(plugins=[{home}.MixedPrecisionPlugin(...)])`)."
            )
        return FabricMixedPrecisionPlugin.convert_module(self, module)  # (the FSDP plugin's next base is FSDP's)

    def _widen(self, module: nn.Module) -> None:
        # The Trainer runs `setup` (every callback's and the LightningModule's) before this hook, on the model as it
        # was given: a half copy kept there (StochasticWeightAveraging's, EMAWeightAveraging's, ModelPruning's lottery
        # ticket) would later write half values into the FP32 masters, so it is refused first, naming the fix.
        if fitting(module):
            trainer = getattr(unwrapped(module), "_trainer", None)
            holders = [*getattr(trainer, "callbacks", []), unwrapped(module)]
            when = "in a `setup` hook (the Trainer runs those before any precision plugin hook)"
            refuse_half_copies(type(self).__name__, module, holders, when)
            widen_model_(module)

    @override
    def convert_input(self, data: Any) -> Any:
        # Lightning's plugins convert the batch only for half weights (bf16-true); mixed precision keeps it as given.
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.bfloat16)

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        _refuse_deepspeed(type(self).__name__, model, "Trainer")
        module = unwrapped(model)
        if self.device is None:
            param = next(model.parameters(), None)
            self._use_device(param.device.type if param is not None else "cpu")
        else:
            self._use_device(self.device)
        self._read_before_step = _read_before_step(module)
        for optimizer in optimizers:
            self._know(optimizer, fused=not self._read_before_step)
        self._remove_fp32_hooks()
        self._fp32_hooks = compute_in_fp32(module, self.settings.keep_fp32, self.device or _default_device())
        if self.settings.master_weights and isinstance(model, DistributedDataParallel) and fitting(module):
            self._compress_all_reduce(model)
        self._learn_ranks(list(module.parameters()), user_names(module), model)
        if self.settings.hold_schedulers_on_skip and self.engine.check:  # nothing checked: no step is ever skipped
            for config in lr_schedulers:
                self.engine.log.held_schedulers.hold(getattr(config, "scheduler", config))
        return TrainerPrecision.connect(self, model, optimizers, lr_schedulers)

    def _compress_all_reduce(self, model: DistributedDataParallel) -> None:
        # Master weights under DDP: the gradients travel in the half dtype (half the bytes), as DDP's hook compresses.
        fp16 = self._desired_input_dtype == torch.float16
        hook = default_hooks.fp16_compress_hook if fp16 else default_hooks.bf16_compress_hook
        try:
            model.register_comm_hook(None, hook)  # None: the default process group
        except RuntimeError:
            rank_zero_warn(
                f"{type(self).__name__}(master_weights=True): the DDP model already has a communication hook, so its "
                "gradients are all-reduced as that hook does, not compressed to the half dtype.",
                category=UserWarning,
            )

    @override
    def teardown(self) -> None:
        self.engine.log.held_schedulers.release()
        FabricMixedPrecisionPlugin.teardown(self)

    # ---------------------------------------------------------------------------------------------- autocast
    @override
    def forward_context(self) -> AbstractContextManager[Any]:  # type: ignore[override]  # Lightning's is a generator's
        return self.autocast_context_manager()  # the FP8 readings are armed by train_step_context

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        if self.fp8 is not None:
            self.fp8.before_forward()  # a check step's readings start with its first micro-batch
        with self.autocast_context_manager():
            yield
        if self._stepped:  # manual optimization: every opt.step() of the batch ran inside; the scale moves once
            self._end_iteration()

    # --------------------------------------------------------------------------------------------------- step
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        # Hooks see the true loss; only backward sees the scaled one. Lightning's base hook by name: in the FSDP
        # plugin the next base is Lightning's FSDPPrecision, whose pre_backward would scale the loss a second time.
        loss = TrainerPrecision.pre_backward(self, tensor, module)
        return loss if self._scaler is None else self._scaler.scale(loss)  # through the scaler, as Lightning's plugin

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if not self.engine.check and self.compensators is None:
            return self._step_unchecked(optimizer, model, closure, **kwargs)
        if self.settings.master_weights:
            self._refuse_half_masters(optimizer, model)  # a half tensor written into a master since the last step
        closure_result = closure()  # forward under autocast, backward of the scaled loss
        if self.settings.master_weights:
            self._refuse_half_masters(optimizer, model)  # ...or during this step (training_step, backward hooks)
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: no backward ran. Hooks run (as Lightning's); nothing is stepped.
            self._after_closure(model, optimizer)
            self.engine.discard(optimizer)
            return None
        if self._scaler is not None and (self._read_before_step or not _unscales_in_its_step(optimizer)):
            # As Lightning's plugin calls its GradScaler: before the hooks, unless the optimizer unscales in its own
            # kernel (and here: nothing reads the gradients first). A test counting `scaler.unscale_` counts the same,
            # the scaler patched or wrapped (a Mock wrapping it does not see the call the scaler's step would make).
            self._scaler.unscale_(optimizer)
        elif self._read_before_step:
            self.engine.unscale(optimizer)  # the hooks and the clipping see unscaled, checked gradients
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clipping
        output = self._step(optimizer, **kwargs)
        if model.automatic_optimization:  # one optimizer per batch: its iteration ends with its step (under manual
            self._end_iteration()  # optimization, with the batch: train_step_context)
        return output

    def _step_unchecked(
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Nothing to check or compensate: the optimizer runs the closure, as under Lightning's plugin.

        LBFGS evaluates it several times (tests/weights/test_master.py trains one); the hooks and the clipping follow
        each evaluation, as Lightning's ``_wrap_closure`` has them.
        """

        def closure_with_hooks() -> Any:
            if self.settings.master_weights:
                self._refuse_half_masters(optimizer, model)
            closure_result = closure()
            if self.settings.master_weights:
                self._refuse_half_masters(optimizer, model)
            self._after_closure(model, optimizer)
            return closure_result

        output = self._step(optimizer, closure=closure_with_hooks, **kwargs)
        if model.automatic_optimization:
            self._end_iteration()
        return output

    def _refuse_half_masters(self, optimizer: Any, model: nn.Module) -> None:
        refuse_half_masters(type(self).__name__, optimizer, lambda: user_names(model))

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.engine.clip_by_norm(optimizer, float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        # Checked first (also under manual optimization, where nothing unscaled before): a clamp would turn inf into
        # the clip value. torch's clip_grad_value_ fails when no parameter has a gradient (no backward reached them).
        self.engine.unscale(optimizer, read=True)
        params = [param for param in self.main_params(optimizer) if param.grad is not None]
        if params:
            torch.nn.utils.clip_grad_value_(params, float(clip_val))

    # --------------------------------------------------------------------------------------------- checkpoints
    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._checkpoint_key() in checkpoint:
            return  # ours (or a GradScaler state under the old class name): load_state_dict handles it
        if _LIGHTNINGS_KEY in checkpoint:
            _state.load_grad_scaler_state(checkpoint[_LIGHTNINGS_KEY], self.engine, f"under {_LIGHTNINGS_KEY!r}")


# ------------------------------------------------------------------------------------------------------- helpers
def _engine(name: str, settings: Settings, scaler: object) -> tuple[StepEngine, DynamicLossScaler | None]:
    """The engine a plugin starts with, and its scaler: under fp16 the scaler's own (given or default) engine.

    Raises:
        ValueError: a scaler with bf16, or a skip limit that differs from the given scaler's.
        TypeError: a scaler that is not a ``DynamicLossScaler``.
    """
    if scaler is not None or settings.precision == "16-mixed":
        where = f"`{name}(precision={settings.precision!r}, scaler={scaler!r})`"
        checked = _checked_scaler(settings, _wrapped(scaler), where)
        if settings.spike_guard is not None:  # the scaler's engine judges the norms: a scaler replaced takes it over
            checked.engine.guard_spikes(settings.spike_guard)
        # A Mock wrapping the scaler (Lightning's tests wrap one) is called in its place: see _wrapped.
        return checked.engine, checked if scaler is None else cast(DynamicLossScaler, scaler)
    engine = StepEngine(
        None,
        check=settings.skip_nonfinite,
        max_consecutive_skips=settings.max_consecutive_skips,
        spike_guard=settings.spike_guard,
    )
    return engine, None


def _wrapped(scaler: object) -> object:
    """The scaler a ``unittest.mock`` wrapper wraps (``Mock(wraps=plugin.scaler)``), else ``scaler`` itself.

    Lightning's own tests wrap a plugin's scaler so to count its calls (``test_skip_training_step_with_grad_scaler``):
    the plugin then calls the wrapper, whose calls reach the wrapped scaler, and steps with that scaler's engine
    (tests/plugins/test_one_plugin.py, ``test_the_scaler_is_called_as_lightnings_plugin_calls_its_grad_scaler``).
    """
    mocks = sys.modules.get("unittest.mock")  # not imported: no Mock exists
    if mocks is not None and isinstance(scaler, mocks.NonCallableMock):
        wrapped = scaler._mock_wraps  # unittest.mock names what a Mock wraps only here
        if isinstance(wrapped, DynamicLossScaler):
            return wrapped
    return scaler


def _checked_scaler(settings: Settings, scaler: object, where: str) -> DynamicLossScaler:
    """The fp16 scaler: the given one (checked against the skip limit), or a default one for ``None``."""
    if settings.precision != "16-mixed":
        why = (
            "fp8-mixed scales each FP8 cast by its own amax and runs the rest under bf16 autocast, which needs"
            if settings.precision == FP8
            else "bf16 has fp32's range and needs"
        )
        raise ValueError(f"{where}: {why} no loss scaling. Drop `scaler`, or use precision='16-mixed'.")
    limit = settings.max_consecutive_skips
    if scaler is None:
        return DynamicLossScaler(max_consecutive_skips=limit)
    if not isinstance(scaler, DynamicLossScaler):
        raise TypeError(
            f"{where}: fp16 needs a lightning_amp_plus.DynamicLossScaler. To migrate from torch.amp.GradScaler, "
            "load its state: `DynamicLossScaler().load_state_dict(grad_scaler.state_dict())`."
        )
    if "max_consecutive_skips" in settings.given and scaler.engine.max_consecutive_skips != limit:
        raise ValueError(
            f"{where}: the scaler's max_consecutive_skips={scaler.engine.max_consecutive_skips!r} differs from "
            f"MixedPrecisionPlugin(max_consecutive_skips={limit!r}): set the limit in one place, e.g. "
            f"DynamicLossScaler(..., max_consecutive_skips={limit!r})."
        )
    return scaler


def _half_dtype(precision: str) -> torch.dtype:
    """The half dtype of a precision: fp16 for ``"16-mixed"``, else bf16 (autocast's, or the weights' for bf16-true)."""
    return torch.float16 if precision == "16-mixed" else torch.bfloat16


def _default_device() -> str:
    """The autocast device when none was given or found."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _refuse_deepspeed(name: str, model: object, framework: str) -> None:
    """Refuse a DeepSpeed engine: it does its own mixed precision, loss scaling and master weights.

    Two loss scalers on one model would corrupt each other silently. Lightning checks the plugin type for FSDP and XLA
    strategies, not for DeepSpeed's, so the plugin checks the model it is handed.
    """
    if type(model).__module__.split(".")[0] == "deepspeed":
        raise TypeError(
            f"{name} cannot run under DeepSpeed: its engine does its own mixed precision and loss scaling. Use "
            f"{framework}(strategy='deepspeed', precision='16-mixed' or 'bf16-mixed') without this plugin."
        )


def _unscales_in_its_step(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` can unscale in its own kernel (torch's fused ones): GradScaler's test, and Lightning's."""
    return bool(getattr(getattr(optimizer, "optimizer", optimizer), "_step_supports_amp_scaling", False))


def _read_before_step(module: nn.Module) -> bool:
    """Whether something may read the unscaled gradients between backward and the step: clipping, a hook.

    The Trainer clips when ``gradient_clip_val`` is set or the LightningModule overrides
    ``configure_gradient_clipping``; ``on_before_optimizer_step`` hooks (the module's, a callback's) are promised
    unscaled gradients, except a callback's that declares ``reads_unscaled_gradients = False``
    (``MixedPrecisionMonitor`` does). A fused optimizer then takes the unscale path (its step cannot unscale in its own
    kernel after the gradients were read unscaled).
    """
    if not isinstance(module, pl.LightningModule):
        return True
    overridden = {
        name
        for name in ("on_before_optimizer_step", "configure_gradient_clipping")
        if getattr(type(module), name) is not getattr(pl.LightningModule, name)
    }
    trainer = module._trainer
    if overridden or (trainer is not None and trainer.gradient_clip_val):
        return True
    callbacks: list[pl.Callback] = getattr(trainer, "callbacks", [])
    return any(
        type(callback).on_before_optimizer_step is not pl.Callback.on_before_optimizer_step
        and getattr(callback, "reads_unscaled_gradients", True)
        for callback in callbacks
    )


def fitting(module: nn.Module, default: bool = True) -> bool:
    """Whether the Trainer that holds ``module`` is fitting (``Strategy.setup`` runs for validate/test/predict too)."""
    trainer = getattr(unwrapped(module), "_trainer", None)
    if trainer is None:
        return default
    return bool(trainer.state.fn == "fit")


def skipped_steps(source: pl.Trainer | TrainerPrecision) -> int | None:
    """The optimizer steps the precision plugin skipped for non-finite gradients; ``None`` where it does not count them.

    ``source`` is a Trainer (its ``precision_plugin`` is read) or a precision plugin. This package's plugins count
    their skips (0 when they check nothing). A plugin with a loss scaler of its own (Lightning's
    ``MixedPrecision("16-mixed")`` and its ``torch.amp.GradScaler``, or another fp16 mixed plugin) skips steps without
    counting them: ``None``, not a number that may be wrong. Any other plugin never skips a step (``32-true``, bf16
    without a scaler): 0.

    Examples:
        >>> from lightning.pytorch.plugins.precision import MixedPrecision
        >>> skipped_steps(MixedPrecisionPlugin("bf16-mixed")), skipped_steps(MixedPrecision("16-mixed", "cpu"))
        (0, None)
        >>> skipped_steps(pl.Trainer(precision="32-true", logger=False))
        0
    """
    plugin = source.precision_plugin if isinstance(source, pl.Trainer) else source
    engine = getattr(plugin, "engine", None)
    if isinstance(engine, StepEngine):
        return engine.skipped_steps
    if getattr(plugin, "scaler", None) is not None or getattr(plugin, "precision", None) == "16-mixed":
        return None
    return 0
