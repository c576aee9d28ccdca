"""The precision plugins' checkpoint state: what is saved, and the checks made when it is loaded back.

One format for every front end (the Trainer's and Fabric's plugins): ``{"format", "precision", "master_weights",
"held_scheduler_steps", "scaler", ...}`` (``"compensation"`` and ``"spike_guard"`` hold a state per optimizer;
``"fp8"``, under ``"fp8-mixed"``, the FP8 layers fallen back), in plain Python values and tensors (Lightning loads
checkpoints with ``weights_only=True``). A ``torch.amp.GradScaler`` state (Lightning's own plugin, or a plain loop
migrating) is read too. Every refusal names the key and the way out.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities import rank_zero_warn

from lightning_amp_plus._checks import COUNTER_MAX
from lightning_amp_plus.plugins.options import Settings
from lightning_amp_plus.step.engine import StepEngine
from lightning_amp_plus.weights.compensated import Compensators
from lightning_amp_plus.weights.fp8.training import FP8Training

__all__ = ["FORMAT", "is_grad_scaler_state", "load_state", "save_state"]

FORMAT = "lightning_amp_plus/1"


def save_state(
    engine: StepEngine, settings: Settings, fp8: FP8Training | None = None, compensators: Compensators | None = None
) -> dict[str, Any]:
    """The plugin's state: ``{}`` when nothing is checked nor compensated (nothing to restore).

    With ``"fp8-mixed"``, ``"fp8"`` holds the FP8 training's state: the layers fallen back and the fallback rule's
    counts (:meth:`~lightning_amp_plus.weights.fp8.FP8Training.state_dict`).
    """
    if not engine.check and settings.compensation is None:
        return {}
    state = {
        "format": FORMAT,
        "precision": settings.precision,
        "master_weights": settings.master_weights,
        **engine.state_dict(),
    }
    if compensators is not None:
        state["compensation_method"] = compensators.method
        state["compensation"] = compensators.state_dict()
    if fp8 is not None:
        state["fp8"] = fp8.state_dict()
    return state


def is_grad_scaler_state(state: dict[str, Any]) -> bool:
    """Whether ``state`` is a bare ``GradScaler`` (or ``DynamicLossScaler``) state rather than a plugin state."""
    return "format" not in state and "scale" in state


def load_state(
    state: object,
    engine: StepEngine,
    *,
    owner: str,
    settings: Settings,
    fp8: FP8Training | None = None,
    compensators: Compensators | None = None,
) -> dict[str, Any]:
    """Check a saved plugin state against this run's ``settings`` and load it into ``engine`` (and ``fp8``).

    Args:
        state: what the checkpoint holds under the plugin's key.
        engine: the engine to restore.
        owner: the plugin's class name (its checkpoint key), for the messages.
        settings: this run's settings; the precision, master weights and compensation must equal the saved ones.
        fp8: the plugin's FP8 training (``"fp8-mixed"``): the layers the saved run fell back fall back now.
        compensators: the plugin's compensated updates (``"bf16-true"``), given their saved state.

    Returns:
        The state, checked (for the plugin's own extra keys).
    """
    if not isinstance(state, dict):
        raise TypeError(f"The checkpoint's {owner} state is a {type(state).__name__}, not a dict.")
    if is_grad_scaler_state(state):
        load_grad_scaler_state(state, engine, f"for {owner}")
        return state
    if state.get("format") != FORMAT or "scaler" not in state or "precision" not in state:
        raise ValueError(_unreadable(state, owner))
    compared: dict[str, object] = {"precision": settings.precision, "master_weights": settings.master_weights}
    if settings.compensation is not None:
        compared["compensation"] = settings.compensation
    for key, mine in compared.items():
        _check_saved_setting(state, "compensation_method" if key == "compensation" else key, mine, owner, key)
    held = _saved_count(state, "held_scheduler_steps", owner)
    compensation = state.get("compensation")
    if compensation is not None and not isinstance(compensation, list):
        raise TypeError(
            f"The checkpoint's {owner} state holds compensation={type(compensation).__name__}; expected a list (one "
            f"state per optimizer). Remove checkpoint['{owner}'] to start the compensation afresh."
        )
    guard = state.get("spike_guard")
    if guard is not None and not isinstance(guard, list):
        raise TypeError(
            f"The checkpoint's {owner} state holds spike_guard={type(guard).__name__}; expected a list (one state per "
            f"optimizer). Remove checkpoint['{owner}']['spike_guard'] to start the guard's statistics afresh."
        )
    saved_fp8 = state.get("fp8")
    if saved_fp8 is not None and not isinstance(saved_fp8, dict):
        raise TypeError(
            f"The checkpoint's {owner} state holds fp8={type(saved_fp8).__name__}; expected a dict (the FP8 layers "
            f"fallen back). Remove checkpoint['{owner}']['fp8'] to start with every layer in FP8."
        )
    engine.load_state_dict(state["scaler"], held, guard)
    if compensation is not None and compensators is not None:
        compensators.load_state_dict(compensation)
    if saved_fp8 is not None and fp8 is not None:
        fp8.load_state_dict(saved_fp8)
    return state


def load_grad_scaler_state(state: object, engine: StepEngine, where: str) -> None:
    """Load a ``GradScaler`` state into the engine's scaler (ignored, with a warning, for bf16).

    Args:
        state: the state.
        engine: the engine whose scaler takes it.
        where: where the checkpoint holds it, as the messages say it (``"under 'MixedPrecision'"``, or ``"for
            MixedPrecisionPlugin"`` when the Trainer handed it to the plugin: under the plugin's key, or a Lightning
            1.x checkpoint's ``"native_amp_scaling_state"``).
    """
    if engine.loss_scale is None:
        rank_zero_warn(f"The checkpoint holds an fp16 GradScaler state {where}; bf16 uses no scaler: ignored.")
        return
    if not isinstance(state, dict):
        raise TypeError(
            f"The checkpoint's entry {where} is a {type(state).__name__}, not a GradScaler state dict. Remove it "
            "from the checkpoint to start with a fresh scaler."
        )
    engine.load_scaler_state_dict(state)


def _check_saved_setting(state: dict[str, Any], key: str, mine: object, owner: str, argument: str) -> None:
    """Refuse a saved setting (``state[key]``) other than this run's, named as the constructor's ``argument``."""
    if key not in state:
        return  # written before the setting was saved: nothing to compare
    saved = state[key]
    if type(saved) is not type(mine) or saved != mine:
        # As the constructor reads: the precision positionally, the other settings by keyword.
        then, now = (
            (repr(saved), repr(mine)) if argument == "precision" else (f"{argument}={saved!r}", f"{argument}={mine!r}")
        )
        name = owner.split(".")[-1]
        raise ValueError(
            f"The checkpoint was trained with {name}({then}), this run uses {now}. Resume with "
            f"{argument}={saved!r}, or delete checkpoint['{owner}'] to start the plugin's state afresh (loss scale, "
            "skip counters, compensation)."
        )


def _unreadable(state: dict[str, Any], owner: str) -> str:
    keys = sorted(map(str, state))  # keys of any type: the message must not fail itself
    if "format" not in state:
        problem = f"has keys {keys} and no 'format'"
    elif state["format"] != FORMAT:
        problem = f"has format={state['format']!r}, which this version does not read ('{FORMAT}')"
    else:
        missing = [key for key in ("precision", "scaler") if key not in state]
        problem = f"lacks {', '.join(repr(key) for key in missing)}"
    return (
        f"The checkpoint's {owner} state {problem}: expected a '{FORMAT}' state with 'precision' and 'scaler', or a "
        "GradScaler state. Remove that key from the checkpoint to start with a fresh scaler."
    )


def _saved_count(state: dict[str, Any], key: str, owner: str) -> int:
    value = state.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"The checkpoint's {owner} state holds {key}={value!r} ({type(value).__name__}); expected an int >= 0. "
            f"Remove checkpoint['{owner}'] to start with a fresh scaler."
        )
    if not 0 <= value <= COUNTER_MAX:
        raise ValueError(
            f"The checkpoint's {owner} state holds {key}={value}; expected an int in [0, 2**62]. "
            f"Remove checkpoint['{owner}'] to start with a fresh scaler."
        )
    return value
