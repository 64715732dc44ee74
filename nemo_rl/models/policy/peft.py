"""``policy.megatron_cfg.peft`` applied to a model: which linears get adapters, and how.

Used at config time (:func:`~nemo_rl.models.policy.parallel_layout.plan_parallel_layout`,
when the model's config.json is here) and by the policy worker when it builds the model, so a
selection the model cannot take fails before any actor starts.
"""

from __future__ import annotations

from megatron_bridge import BridgeConfig, dtype_from_name
from megatron_bridge.lora import LoraSettings, LoraSpec
from megatron_bridge.lora_targets import LoraTarget, select_lora_targets
from nemo_rl.models.policy.config import PeftConfig

_PEFT = "policy.megatron_cfg.peft"


def lora_targets(peft: PeftConfig, bridge: BridgeConfig, model: str) -> list[LoraTarget]:
    """The linears ``peft`` adapts in the model ``bridge`` describes (at ``model``).

    Raises:
        ValueError: a target or exclusion the model lacks, a selection reaching the experts
            of a mixture-of-experts layer, or an empty selection; naming the field and model.
    """
    try:
        return select_lora_targets(
            bridge.num_layers,
            bridge.features.sparse_layers,
            peft.target_modules,
            peft.exclude_modules,
        )
    except ValueError as err:
        raise ValueError(f"{_PEFT} does not fit the model at {model}: {err}") from None


def lora_spec(peft: PeftConfig, bridge: BridgeConfig, model: str) -> LoraSpec:
    """The adapters ``peft`` gives the model ``bridge`` describes: settings and targets.

    Raises:
        ValueError: as :func:`lora_targets`.
    """
    settings = LoraSettings(
        dim=peft.dim,
        alpha=peft.alpha,
        dropout=peft.dropout,
        dropout_position=peft.dropout_position,
        a_init=peft.lora_A_init_method,
        dtype=None if peft.lora_dtype is None else dtype_from_name(peft.lora_dtype),
    )
    return LoraSpec(settings, tuple(lora_targets(peft, bridge, model)))
