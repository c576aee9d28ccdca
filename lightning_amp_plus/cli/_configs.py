"""The precision set-ups compared side by side: one table for ``amp-plus compare`` and ``benchmarks/bench_master.py``.

Plain data; torch and Lightning are imported only when a set-up's Trainer arguments are built, so the command line
can list the names without importing them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["BF16_TRUE", "COMPARE_DEFAULT", "FP8", "ON_REQUEST", "SETUPS", "PrecisionSetup"]


@dataclass(frozen=True)
class PrecisionSetup:
    """One precision set-up.

    Attributes:
        name: as ``--configs`` spells it.
        precision: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"`` (Lightning's, weights in bf16) or
            ``"fp8-mixed"`` (ours, torchao's tensorwise recipe).
        plugin: ``"none"`` (Lightning's ``precision=``), ``"lightning"`` (its ``MixedPrecision``) or ``"ours"``
            (:class:`~lightning_amp_plus.MixedPrecisionPlugin`).
        master_weights: ours with FP32 master weights.
        label: how tables and charts name it.
        compensation: ours with ``bf16-true``: ``"kahan"`` or ``"stochastic"`` compensated bf16 weights.

    Examples:
        >>> SETUPS["ours-bf16-mixed-master"].master_weights, SETUPS["lightning-bf16-true"].label
        (True, 'Lightning bf16-true')
    """

    name: str
    precision: Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true", "fp8-mixed"]
    plugin: Literal["none", "lightning", "ours"]
    master_weights: bool = False
    label: str = ""
    compensation: Literal["kahan", "stochastic"] | None = None

    def trainer_kwargs(self, device: str, scaler_options: dict[str, Any] | None = None) -> dict[str, Any]:
        """What to pass to ``Trainer`` for this set-up; ``scaler_options`` (``init_scale``...) configure fp16's scaler.

        The same options reach ``torch.amp.GradScaler`` (Lightning's) and ``DynamicLossScaler`` (ours): both take
        ``init_scale``, ``growth_factor``, ``backoff_factor`` and ``growth_interval``.

        Examples:
            >>> type(SETUPS["lightning-bf16-mixed"].trainer_kwargs("cpu")["plugins"][0]).__name__
            'MixedPrecision'
            >>> SETUPS["32-true"].trainer_kwargs("cpu")
            {'precision': '32-true'}
        """
        if self.plugin == "none":
            return {"precision": self.precision}
        if self.precision == "fp8-mixed" and self.plugin == "ours":
            from lightning_amp_plus.plugins.precision import MixedPrecisionPlugin as Ours

            return {"plugins": [Ours("fp8-mixed", device)]}
        if self.precision not in ("16-mixed", "bf16-mixed") and self.compensation is None:
            raise ValueError(
                f"set-up {self.name!r}: a precision plugin needs a mixed precision, not {self.precision!r}."
            )
        options = scaler_options or {}
        mixed: Literal["16-mixed", "bf16-mixed"] = "16-mixed" if self.precision == "16-mixed" else "bf16-mixed"
        if self.plugin == "lightning":
            import torch
            from lightning.pytorch.plugins.precision import MixedPrecision

            scaler = None
            if self.precision == "16-mixed" and options:
                scaler = torch.amp.GradScaler(device, **options)
            return {"plugins": [MixedPrecision(mixed, device, scaler=scaler)]}
        from lightning_amp_plus.plugins.precision import MixedPrecisionPlugin
        from lightning_amp_plus.step.scaler import DynamicLossScaler

        ours = DynamicLossScaler(**options) if self.precision == "16-mixed" and options else None
        if self.compensation is not None:
            return {"plugins": [MixedPrecisionPlugin("bf16-true", device, compensation=self.compensation)]}
        plugin = MixedPrecisionPlugin(mixed, device, ours, master_weights=self.master_weights)
        return {"plugins": [plugin]}


SETUPS: dict[str, PrecisionSetup] = {
    setup.name: setup
    for setup in (
        PrecisionSetup("32-true", "32-true", "none", label="32-true"),
        PrecisionSetup("lightning-16-mixed", "16-mixed", "lightning", label="Lightning 16-mixed"),
        PrecisionSetup("lightning-bf16-mixed", "bf16-mixed", "lightning", label="Lightning bf16-mixed"),
        PrecisionSetup("lightning-bf16-true", "bf16-true", "none", label="Lightning bf16-true"),
        PrecisionSetup("ours-16-mixed", "16-mixed", "ours", label="ours 16-mixed"),
        PrecisionSetup("ours-bf16-mixed", "bf16-mixed", "ours", label="ours bf16-mixed"),
        PrecisionSetup("ours-16-mixed-master", "16-mixed", "ours", True, "ours 16-mixed + master weights"),
        PrecisionSetup("ours-bf16-mixed-master", "bf16-mixed", "ours", True, "ours bf16-mixed + master weights"),
        PrecisionSetup(
            "ours-bf16-true-kahan", "bf16-true", "ours", label="ours bf16-true + Kahan", compensation="kahan"
        ),
        PrecisionSetup(
            "ours-bf16-true-sr",
            "bf16-true",
            "ours",
            label="ours bf16-true + stochastic rounding",
            compensation="stochastic",
        ),
        PrecisionSetup("ours-fp8-mixed", "fp8-mixed", "ours", label="ours fp8-mixed (tensorwise)"),
    )
}
"""Every set-up, by name: fp32, Lightning's built-in modes, ours, ours with FP32 master weights, compensated bf16."""

BF16_TRUE = ("lightning-bf16-true", "ours-bf16-true-kahan", "ours-bf16-true-sr")
"""The set-ups with bf16 weights: ``amp-plus compare --configs`` runs them on request."""

FP8 = ("ours-fp8-mixed",)
"""The FP8 set-up (needs torchao): on request, since the shipped models have no Linear layer FP8 can take (their only
one, the classifier, is not a multiple of 16 in both dimensions), so the row measures bf16-mixed with FP8's
bookkeeping."""

ON_REQUEST = (*BF16_TRUE, *FP8)
"""The set-ups ``amp-plus compare`` runs only when ``--configs`` names them."""

COMPARE_DEFAULT = tuple(name for name in SETUPS if name not in ON_REQUEST)
"""What ``amp-plus compare`` runs without ``--configs``: the mixed precisions against fp32 (bf16-true and fp8-mixed
on request)."""
