"""The one-paragraph summary of a run, in the words ``fit`` prints at its end."""

from __future__ import annotations

from typing import Any

from lightning_amp_plus._wording import plural, spans
from lightning_amp_plus.monitor.fp8 import fp8_sentences
from lightning_amp_plus.monitor.history import ROUTINE, AmpHistory, StepEntry, batches, scale_text

__all__ = ["summary"]

_SPIKES_SHOWN = 3


def summary(history: AmpHistory) -> str:
    """One paragraph that says how the run went.

    Skips under a loss scaler are fp16 overflows, routine while the scale finds its level, and are said to be, unless
    an autopsy found a cause that no loss scale cures; non-finite values the monitor found itself (in parameters, or in gradients nothing guarded) are counted apart.

    Examples:
        >>> h = AmpHistory([StepEntry(0, 65536.0, True, None, None), StepEntry(1, 32768.0, False, 1.5, None)])
        >>> h.nonfinite_events.append((0, "overflowed gradients", ["w"]))
        >>> print(summary(h))
        MixedPrecisionMonitor: 2 optimizer steps, 1 skipped (50.0%) at step 0; loss scale 2**15 to 2**16, last 2**15; the skipped step was an fp16 overflow caught by the loss scaler, routine in dynamic loss scaling; no non-finite parameters found.
        >>> print(summary(AmpHistory([StepEntry(0, 1024.0, False, 1.0, 900.0)], memory_kind="process memory")))
        MixedPrecisionMonitor: 1 optimizer step, 0 skipped (0.0%); loss scale 2**10 throughout; peak process memory 900 MB; no non-finite parameters or gradients found.
    """  # noqa: E501
    records = history.steps
    if not records:
        return "MixedPrecisionMonitor: no optimizer step was taken."
    skipped, overflows = history.skipped, history.overflowed
    batches = len({record.step for record in records})
    head = plural(len(records), "optimizer step")
    if batches != len(records):
        head += f" in {plural(batches, 'batch', 'batches')}"
    head += f", {len(skipped)} skipped ({100 * len(skipped) / len(records):.1f}%)"
    if skipped:
        distinct = sorted(set(skipped))
        head += f" at {'step' if len(distinct) == 1 else 'steps'} {spans(distinct)}"
    parts = [head]
    scales = [r.scale for r in records if r.scale is not None]
    if scales:
        low, high = min(scales), max(scales)
        if low == high:
            parts.append(f"loss scale {scale_text(low)} throughout")
        else:
            parts.append(f"loss scale {scale_text(low)} to {scale_text(high)}, last {scale_text(scales[-1])}")
    if history.spikes:
        parts.append(_spikes(history))
    routine = [event for event in history.nonfinite_events if event[1] == ROUTINE]
    streak = _final_streak(records)
    # An autopsy that found a cause no loss scale cures ("forward", "backward") makes the skips anything but routine.
    incurable = [autopsy.step for autopsy in history.autopsies if autopsy.kind != "scale"]
    if overflows and scales and incurable:
        parts.append(
            f"the skips include a cause loss scaling cannot cure (the autopsy of step {incurable[0]}), not only the "
            "overflows a loss scaler catches"
        )
    elif overflows and scales and not streak:
        parts.append(_scaled_skips(history))
    elif overflows and scales:
        ending = "a skipped step (an fp16 overflow)" if streak == 1 else f"{streak} skipped steps in a row"
        parts.append(f"the run ended on {ending}: overflows that lowering the loss scale did not cure")
    elif overflows:
        first = f", the first at step {routine[0][0]} in {_names(routine[0][2])}" if routine else ""
        parts.append(f"skipped for non-finite gradients{first}")
    if history.fp8 is not None:
        parts.extend(fp8_sentences(history.fp8))
    memory = [r.memory_mb for r in records if r.memory_mb is not None]
    if memory:
        parts.append(f"peak {history.memory_kind} {max(memory):,.0f} MB")
    parts.extend(history.notes)
    parts.extend(_autopsy_and_headroom(history))
    found = [event for event in history.nonfinite_events if event[1] != ROUTINE]
    if found:
        step, kind, names = found[0]
        parts.append(f"{plural(len(found), 'non-finite event')}, the first at step {step} in {kind} {_names(names)}")
    else:
        parts.append("no non-finite parameters found" if skipped else "no non-finite parameters or gradients found")
    return "MixedPrecisionMonitor: " + "; ".join(parts) + "."


def _scaled_skips(history: AmpHistory) -> str:
    """What the skips under a loss scaler were, as far as the run established it, and what the rest suggests.

    A skip is an fp16 overflow the scaler caught, routine in dynamic loss scaling, when the run shows it: before the
    first applied step (the scale coming down from ``init_scale``), at a scale above every scale earlier steps passed
    at (the scale had grown past what the gradients hold), or when an autopsy found the gradients finite at a lower
    scale. A skip at a scale earlier steps passed at is not that; nor is one whose replay (the autopsy's) found the
    batch's gradients finite at the same scale.
    """
    routine, unreproduced, unexplained = [], [], []
    cured = {step for step, kind in history.replayed.items() if kind == "scale"}
    highest_applied: float | None = None
    for batch in batches(history.steps):
        if not batch.overflowed:
            if batch.scale is not None and not batch.skipped:
                highest_applied = max(batch.scale, highest_applied or batch.scale)
            continue
        grown = highest_applied is None or (batch.scale is not None and batch.scale > highest_applied)
        if batch.step in history.replayed and history.replayed[batch.step] is None:
            unreproduced.append(batch.step)
        elif grown or batch.step in cured:
            routine.append(batch.step)
        else:
            unexplained.append(batch.step)
    if not unreproduced and not unexplained:
        what = "the skipped step was an fp16 overflow" if len(routine) == 1 else "the skipped steps were fp16 overflows"
        return f"{what} caught by the loss scaler, routine in dynamic loss scaling"
    said = []
    if routine:
        said.append(
            f"{_steps(routine)} {'was an fp16 overflow' if len(routine) == 1 else 'were fp16 overflows'} caught by "
            "the loss scaler, routine in dynamic loss scaling"
        )
    if unreproduced:
        said.append(
            f"{_steps(unreproduced)} had non-finite gradients that a replay of the batch at the same loss scale did "
            "not reproduce: not a stable overflow of that batch at that scale, but something that happened once (a "
            "NaN or inf in the data or the loss, a non-deterministic kernel, a fault on one process)"
        )
    if unexplained:
        cause = "its cause was" if len(unexplained) == 1 else "their causes were"
        why = history.unexamined or (
            "under this package's plugins the monitor's autopsy replays such a step and says where its first inf/NaN "
            "starts; in a Fabric or plain loop, pass observe(..., replay=...)"
        )
        said.append(
            f"{_steps(unexplained)} had non-finite gradients at a loss scale earlier steps had passed at: not the "
            f"overflow that follows the scale's growth, and {cause} not examined ({why})"
        )
    return "; ".join(said)


def _spikes(history: AmpHistory) -> str:
    """The spikes the spike guard judged: how many, and the first few with their norms against the running mean."""
    spikes = history.spikes
    shown = []
    for step, verdict in spikes[:_SPIKES_SHOWN]:
        what = "skipped" if verdict.action == "skip" else "clipped to the limit"
        ratio = f", {verdict.norm / verdict.mean:.3g}x the running mean {verdict.mean:.3g}" if verdict.mean > 0 else ""
        shown.append(f"step {step} {what} (norm {verdict.norm:.3g}{ratio}; limit {verdict.threshold_norm:.3g})")
    more = f" and {len(spikes) - _SPIKES_SHOWN} more (monitor.history.spikes)" if len(spikes) > _SPIKES_SHOWN else ""
    return f"the spike guard judged {plural(len(spikes), 'gradient-norm spike')}: {', '.join(shown)}{more}"


def _steps(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {spans(steps)}"


def _autopsy_and_headroom(history: AmpHistory) -> list[str]:
    """What the monitor's autopsies found and what its last headroom reading says, in the summary's words."""
    parts = []
    if history.autopsies:
        first = history.autopsies[0]
        more = len(history.autopsies) - 1
        parts.append(
            f"overflow autopsy: {first.message.rstrip('.')}"
            + (f" ({more} more cause{'s' if more > 1 else ''} in monitor.autopsies)" if more else "")
        )
    if history.headroom:
        step, reading = history.headroom[-1]
        if reading:
            parts.append(_headroom_sentence(step, reading))
    if history.replays_stopped is not None:
        step, why = history.replays_stopped
        parts.append(f"no autopsy or headroom reading from step {step} on: {why}")
    return parts


def _headroom_sentence(step: int, reading: dict[str, Any]) -> str:
    # float16's range is the one activations can outgrow (bfloat16's is float32's). No float8 figure: every FP8
    # recipe scales each tensor so that its largest value lands at float8's top, so an unscaled one would mislead
    # (under fp8-mixed, the FP8 readings say what the casts lose).
    tightest, layer = min(reading.items(), key=lambda item: item[1].headroom_bits["float16"])
    text = (
        f"headroom at step {step}: the tightest layer is `{tightest or 'model'}` (activations up to "
        f"{layer.act_absmax:.3g}: {layer.headroom_bits['float16']:.1f} bits below float16's largest value)"
    )
    flushed = [(name, entry) for name, entry in reading.items() if entry.grad_flushed_pct == entry.grad_flushed_pct]
    if flushed:
        name, entry = max(flushed, key=lambda item: item[1].grad_flushed_pct)
        if entry.grad_flushed_pct > 0:
            text += f"; {entry.grad_flushed_pct:.1f}% of `{name or 'model'}`'s gradients flush to zero at its scale"
    return text


def _final_streak(records: list[StepEntry]) -> int:
    """How many batches at the end were all skipped (0 when the run ended on an applied step)."""
    count = 0
    for batch in reversed(batches(records)):
        if not batch.overflowed:
            break
        count += 1
    return count


def _names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
