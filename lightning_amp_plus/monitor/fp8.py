"""The monitor's FP8 readings under ``"fp8-mixed"``: the casts that flush, the layers fallen back, where a NaN started.

The plugin's :class:`~lightning_amp_plus.weights.fp8.FP8Training` (``plugin.fp8``) reads, every
``fp8_check_interval`` optimizer steps, the share of each FP8 layer's cast values flushed to zero under torchao's own
scales (:attr:`FP8Training.checks <lightning_amp_plus.weights.fp8.FP8Training.checks>`). :class:`FP8Watch` takes each
new check after the step, keeps what it found in an :class:`FP8Record` (the history's ``fp8``, which the summary
words and the chart draws), keeps every cast above ``fp8_flush_warn_pct`` as an :class:`FP8Outlier`, warns once per
layer and cast, and gives the check step's ``amp/fp8_flushed_max``. On a step skipped for non-finite gradients it asks
the FP8 training which layers met the inf/NaN first (one host read, on skipped steps only).

Readings on demand: with ``MixedPrecisionMonitor(headroom_interval=N)`` the Trainer's monitor arms the readings on
the steps its headroom replays too, where that cannot change the run: a reading counts toward the fallback rule's
"two readings in a row", so with ``fp8_fallback`` set the readings follow ``fp8_check_interval`` alone
(:meth:`FP8Watch.arm`).

No Lightning here: the callback hands over the plugin and the step numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_amp_plus._wording import plural, spans

__all__ = ["FP8Outlier", "FP8Point", "FP8Record", "FP8Watch", "fp8_sentences"]

_SHOWN = 3  # outliers (layer and cast) named in the summary


@dataclass(frozen=True)
class FP8Outlier:
    """One cast of one FP8 layer that flushed more than ``fp8_flush_warn_pct`` at a check step.

    Attributes:
        step: the global step (the batch) of the check.
        layer: the layer's name, as ``named_modules()`` of the module handed to the plugin gives it.
        cast: the cast (``"input"``, ``"weight"``, ``"grad_output"``, ``"input_for_grad_weight"``...).
        flushed_pct: percent of the cast's nonzero values that became zero in float8.
        subnormal_pct: percent left subnormal (1-3 significant bits in e4m3).
    """

    step: int
    layer: str
    cast: str
    flushed_pct: float
    subnormal_pct: float


@dataclass(frozen=True)
class FP8Point:
    """A check step's largest flushed share, with the layer and cast it came from (one point of the chart)."""

    step: int
    layer: str
    cast: str
    flushed_pct: float


@dataclass
class FP8Record:
    """What the FP8 readings of a run found: the summary's and the chart's material.

    Attributes:
        warn_pct: the monitor's ``fp8_flush_warn_pct``.
        layers: how many layers trained in FP8 when the run started.
        checks: each check step's worst cast (:class:`FP8Point`), in step order.
        outliers: every cast above ``warn_pct`` at a check step (:class:`FP8Outlier`).
        fell_back: ``(step, layer)`` for each layer the plugin sent back to bf16 during this run.
        fallen_back: every layer fallen back so far, a resumed run's earlier ones included (the plugin's record).
        nonfinite: ``(step, layers)`` for each step skipped for non-finite gradients whose inf/NaN FP8 layers met,
            the origin first.
    """

    warn_pct: float
    layers: int = 0
    checks: list[FP8Point] = field(default_factory=list)
    outliers: list[FP8Outlier] = field(default_factory=list)
    fell_back: list[tuple[int, str]] = field(default_factory=list)
    fallen_back: list[str] = field(default_factory=list)
    nonfinite: list[tuple[int, list[str]]] = field(default_factory=list)


class FP8Watch:
    """Takes a plugin's FP8 checks after each step into an :class:`FP8Record`; warns once per layer and cast.

    Args:
        warn_pct: keep (and warn about) a cast whose flushed share is above this percent.
        warn: how to warn (the callback passes rank zero's warning).

    State: the plugin's FP8 training (``None`` outside ``"fp8-mixed"``), the last check taken, the (layer, cast)
    pairs warned about, the run's record.

    Examples:
        >>> from types import SimpleNamespace as NS
        >>> from lightning_amp_plus.weights.fp8.readings import CastReading
        >>> fp8 = NS(checks=[], layers={"fc": None}, fallen_back=[], nonfinite_layers=list)
        >>> watch = FP8Watch(1.0, warn=print)
        >>> watch.start(NS(fp8=fp8))
        >>> fp8.checks.append(NS(readings=[CastReading("fc", "input", 4.4, 58.0, 512)], fell_back=[]))
        >>> watch.take(7)  # doctest: +ELLIPSIS
        MixedPrecisionMonitor: FP8 layer `fc` flushed 4.40% of its input cast's nonzero values to zero at step 7...
        {'amp/fp8_flushed_max': 4.4}
        >>> [(o.step, o.layer, o.cast, o.flushed_pct) for o in watch.record.outliers]
        [(7, 'fc', 'input', 4.4)]
        >>> watch.take(8)  # no new check: nothing
        {}
    """

    def __init__(self, warn_pct: float, warn: Callable[[str], None]) -> None:
        self.warn_pct = warn_pct
        self._warn = warn
        self._fp8: Any = None
        self._last: object = None
        self._warned: set[tuple[str, str]] = set()
        self.record: FP8Record | None = None
        """This run's record (``None`` outside ``"fp8-mixed"``)."""

    @property
    def outliers(self) -> list[FP8Outlier]:
        """Every cast above ``warn_pct`` at a check step of this run, oldest first."""
        return [] if self.record is None else self.record.outliers

    def start(self, plugin: Any, *, from_first: bool = False) -> None:
        """A new run under ``plugin``: its FP8 training if it has one.

        The checks the plugin made before now are not this run's, unless ``from_first`` (a Fabric loop's first
        :meth:`take` comes after its first step).
        """
        fp8 = getattr(plugin, "fp8", None)
        self._fp8 = fp8 if hasattr(fp8, "checks") and hasattr(fp8, "nonfinite_layers") else None
        self._warned = set()
        if self._fp8 is None:
            self._last, self.record = None, None
            return
        checks = list(self._fp8.checks)
        self._last = checks[-1] if checks and not from_first else None
        self.record = FP8Record(self.warn_pct, len(self._fp8.layers), fallen_back=list(self._fp8.fallen_back))

    def arm(self, step: int, interval: int) -> None:
        """Before step ``step``'s forward: read its casts too when ``interval`` (the headroom's) asks for it.

        The steps the headroom replays (the last of every ``interval``: ``step + 1`` a multiple of it), and only where
        a reading cannot change the run: the fallback rule counts readings in a row, so with a fallback threshold set
        the readings follow the plugin's ``fp8_check_interval`` alone.
        """
        fp8 = self._fp8
        if fp8 is None or not interval or (step + 1) % interval or fp8.rule.threshold_pct is not None:
            return
        if not fp8.armed and fp8.layers:
            fp8.start_check()

    def take(self, step: int) -> dict[str, float]:
        """After the optimizer steps of batch ``step``: its new checks recorded; ``amp/fp8_flushed_max`` if any."""
        if self._fp8 is None or self.record is None:
            return {}
        checks = list(self._fp8.checks)
        seen = next((index for index, check in enumerate(checks) if check is self._last), None)
        new = checks if seen is None else checks[seen + 1 :]
        if not new:
            return {}
        self._last = new[-1]
        worst = 0.0
        for check in new:
            worst = max(worst, self._check(step, check))
        self.record.fallen_back = list(self._fp8.fallen_back)
        return {"amp/fp8_flushed_max": worst}

    def nonfinite(self, step: int, skipped: bool) -> None:
        """After batch ``step``: if it was skipped for non-finite gradients, record the FP8 layers that met them.

        Call before anything replays the batch (a replay's FP8 forward would raise the flags again).
        """
        if self._fp8 is None or self.record is None or not skipped:
            return
        layers = list(self._fp8.nonfinite_layers())
        if layers:
            self.record.nonfinite.append((step, layers))

    def _check(self, step: int, check: Any) -> float:
        """Record one check; return its largest flushed share."""
        record = self.record
        assert record is not None  # take() returns before without a record
        readings = list(check.readings)
        if readings:
            worst = max(readings, key=lambda reading: reading.flushed_pct)
            record.checks.append(FP8Point(step, worst.layer, worst.cast, worst.flushed_pct))
        record.fell_back.extend((step, layer) for layer in check.fell_back)
        for reading in readings:
            if reading.flushed_pct <= self.warn_pct:
                continue
            record.outliers.append(
                FP8Outlier(step, reading.layer, reading.cast, reading.flushed_pct, reading.subnormal_pct)
            )
            if (reading.layer, reading.cast) not in self._warned:
                self._warned.add((reading.layer, reading.cast))
                self._warn(_outlier_warning(step, reading.layer, reading.cast, reading.flushed_pct, self.warn_pct))
        return max((reading.flushed_pct for reading in readings), default=0.0)


def _outlier_warning(step: int, layer: str, cast: str, flushed_pct: float, warn_pct: float) -> str:
    return (
        f"MixedPrecisionMonitor: FP8 layer `{layer}` flushed {flushed_pct:.2f}% of its {cast} cast's nonzero values to "
        f"zero at step {step} (fp8_flush_warn_pct={warn_pct:g}): one large value sets that cast's scale and pushes "
        "the others below float8's smallest subnormal. If it persists, fp8_fallback sends the layer back to bf16 "
        "(two readings in a row above it), fp8_modules can keep it out of FP8, and for an outlier token rowwise "
        "scales each token alone. Said once per layer and cast; every reading is in monitor.fp8_outliers."
    )


def fp8_sentences(record: FP8Record) -> list[str]:
    """What the summary says of the FP8 readings: outliers, fallbacks, and where a NaN met the FP8 layers first.

    Examples:
        >>> record = FP8Record(1.0, layers=9, checks=[FP8Point(0, "fc", "input", 0.02), FP8Point(5, "fc", "input", 18.2)])
        >>> record.outliers.append(FP8Outlier(5, "fc", "input", 18.2, 71.1))
        >>> record.fell_back.append((5, "fc")); record.fallen_back.append("fc")
        >>> print("; ".join(fp8_sentences(record)))
        FP8 readings at 2 check steps of 9 FP8 layers: 1 cast flushed more than 1% of its nonzero values to zero: `fc` input (worst 18.2%, at step 5); FP8 layer sent back to bf16: `fc` at step 5
        >>> print(fp8_sentences(FP8Record(1.0, layers=9, checks=[FP8Point(0, "fc", "weight", 0.004)]))[0])
        FP8 readings at 1 check step of 9 FP8 layers: no cast flushed more than 1% of its nonzero values to zero (at most 0.004%)
    """  # noqa: E501
    parts = []
    if record.checks:
        head = f"FP8 readings at {plural(len(record.checks), 'check step')} of {plural(record.layers, 'FP8 layer')}: "
        if record.outliers:
            parts.append(head + _outliers(record))
        else:
            largest = max(point.flushed_pct for point in record.checks)
            parts.append(
                f"{head}no cast flushed more than {record.warn_pct:g}% of its nonzero values to zero (at most "
                f"{largest:.3g}%)"
            )
    if record.fallen_back:
        when = dict((layer, step) for step, layer in record.fell_back)
        named = [
            f"`{layer}` " + (f"at step {when[layer]}" if layer in when else "before this run")
            for layer in record.fallen_back
        ]
        noun = "FP8 layer" if len(named) == 1 else "FP8 layers"
        parts.append(f"{noun} sent back to bf16: {', '.join(named)}")
    for step, layers in record.nonfinite[:1]:
        more = "" if len(layers) == 1 else f" (then {_layers(layers[1:])})"
        also = f"; {plural(len(record.nonfinite) - 1, 'more skipped step')}" if len(record.nonfinite) > 1 else ""
        parts.append(f"at skipped step {step} the non-finite values met FP8 layer `{layers[0]}` first{more}{also}")
    return parts


def _outliers(record: FP8Record) -> str:
    grouped: dict[tuple[str, str], list[FP8Outlier]] = {}
    for outlier in record.outliers:
        grouped.setdefault((outlier.layer, outlier.cast), []).append(outlier)
    shown = []
    for (layer, cast), found in sorted(grouped.items(), key=lambda item: -max(o.flushed_pct for o in item[1])):
        steps = sorted({o.step for o in found})
        where = f"at step {steps[0]}" if len(steps) == 1 else f"at steps {spans(steps)}"
        shown.append(f"`{layer}` {cast} (worst {max(o.flushed_pct for o in found):.3g}%, {where})")
    more = f" and {len(shown) - _SHOWN} more (monitor.fp8_outliers)" if len(shown) > _SHOWN else ""
    pct = f"{record.warn_pct:g}%"
    which = (
        f"1 cast flushed more than {pct} of its"
        if len(grouped) == 1
        else f"{len(grouped)} casts flushed more than {pct} of their"
    )
    return f"{which} nonzero values to zero: {', '.join(shown[:_SHOWN])}{more}"


def _layers(names: list[str]) -> str:
    shown = ", ".join(f"`{name}`" for name in names[:2])
    return shown + (f" and {len(names) - 2} more" if len(names) > 2 else "")
