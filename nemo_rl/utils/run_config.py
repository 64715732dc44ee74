"""The resolved recipe a GRPO checkpoint records, and the check that a resumed run continues it.

Every ``step_<n>`` folder holds ``config.yaml`` (:data:`RUN_CONFIG_FILE`): the validated
recipe of the run that saved it, so a checkpoint says which model it was trained from
(``policy.model_name``), on which data and with which settings. Resuming checks the new recipe
against it: a changed model, LoRA adapters or data (:data:`RESUME_FIXED_KEYS`) is refused,
naming each changed key with both values; anything else (the parallel layout, which the policy
reshards, the learning rate, the step count...) may change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from nemo_rl.utils.config import ConfigError, config_to_yaml

RUN_CONFIG_FILE = "config.yaml"

# Recipe keys (dotted; a section covers every key under it) a resumed run must keep: what the
# saved weights, optimizer state and data position mean depends on them.
# A key a checkpoint may not record (saved before the key existed) is checked only where it does.
RESUME_FIXED_KEYS = (
    "policy.model_name",
    "policy.megatron_cfg.make_vocab_size_divisible_by",
    "policy.megatron_cfg.peft",  # the adapters are trained state: their shape and placement
    "data",
)


def save_run_config(step_dir: str | Path, cfg: BaseModel) -> None:
    """Write ``cfg`` as ``step_dir/config.yaml``."""
    (Path(step_dir) / RUN_CONFIG_FILE).write_text(config_to_yaml(cfg))


def _flatten(tree: Any, prefix: str) -> dict[str, Any]:
    """``{dotted key: leaf value}`` of a nested dict (lists are leaves)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _select(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def changed_fixed_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"key: saved -> current"`` for every leaf under :data:`RESUME_FIXED_KEYS` that differs
    between two recipe trees (sorted by key)."""
    changes = []
    for key in RESUME_FIXED_KEYS:
        if _select(saved, key) is None and _select(current, key) is not None:
            continue  # not recorded by this checkpoint
        old = _flatten(_select(saved, key), key)
        new = _flatten(_select(current, key), key)
        for leaf in sorted(old.keys() | new.keys()):
            if old.get(leaf) != new.get(leaf):
                changes.append(f"{leaf}: {old.get(leaf)!r} -> {new.get(leaf)!r}")
    return changes


def check_resume(step_dir: str | Path, cfg: BaseModel) -> None:
    """Refuse to resume from ``step_dir`` with a recipe that changed its model, LoRA adapters or
    data.

    A checkpoint without ``config.yaml`` (saved before checkpoints carried one) is not checked.

    Raises:
        ConfigError: names every changed key with its saved and new value, and the two ways on.
    """
    saved_file = Path(step_dir) / RUN_CONFIG_FILE
    if not saved_file.is_file():
        return
    saved = yaml.safe_load(saved_file.read_text())
    changes = changed_fixed_keys(saved, cfg.model_dump(mode="json"))
    if changes:
        raise ConfigError(
            f"cannot resume from {step_dir}: the recipe changed the model, its LoRA adapters or "
            f"the data it was trained with ({'; '.join(changes)}); restore those keys, or start a "
            "new run with another checkpointing.checkpoint_dir"
        )
