"""What the diagnostics call a module or a parameter: its name in the user's model, without the wrappers' parts.

torch's module wrappers that hold the user's module as a child put that child's attribute into every name below them:
FSDP1's ``_fsdp_wrapped_module`` and activation checkpointing's ``_checkpoint_wrapped_module`` (``checkpoint_wrapper``,
``apply_activation_checkpointing``, Lightning's ``activation_checkpointing_policy``, ``offload_wrapper``). torch leaves
both out of the state dict's keys, and so do the diagnostics: a layer is named as the user's model and its checkpoint
name it (``transformer.h.0.mlp``, not ``transformer.h.0._checkpoint_wrapped_module.mlp``).
"""

from __future__ import annotations

__all__ = ["plain_name"]

_WRAPPED = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def plain_name(name: str) -> str:
    """``name`` (from ``named_modules()`` or ``named_parameters()``) without the parts torch's wrappers add.

    A wrapper and the module it holds then share a name, the user's.

    Examples:
        >>> plain_name("transformer.h.0._checkpoint_wrapped_module.mlp.fc.weight")
        'transformer.h.0.mlp.fc.weight'
        >>> plain_name("transformer.h.0._checkpoint_wrapped_module"), plain_name("")
        ('transformer.h.0', '')
    """
    return ".".join(part for part in name.split(".") if part not in _WRAPPED)
