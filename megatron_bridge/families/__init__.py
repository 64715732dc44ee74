"""Registry of supported model families, keyed by HF ``architectures[0]``.

Adding a family: write ``families/<name>.py`` with its rename tables and a :class:`Family`,
then list it in :data:`FAMILIES`.
"""

from __future__ import annotations

from megatron_bridge.families.base import Family, Features, ModelDims, ParamMapping, SparseMlp
from megatron_bridge.families.llama import LLAMA
from megatron_bridge.families.mistral import MISTRAL
from megatron_bridge.families.mixtral import MIXTRAL
from megatron_bridge.families.qwen2 import QWEN2
from megatron_bridge.families.qwen3 import QWEN3
from megatron_bridge.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {
    f.architecture: f for f in (LLAMA, QWEN2, QWEN3, MISTRAL, QWEN3_MOE, MIXTRAL)
}

CAUSAL_LM_SUFFIX = "ForCausalLM"
SEQUENCE_CLASSIFIER_SUFFIX = "ForSequenceClassification"


def causal_lm_architecture(architecture: str | None) -> str | None:
    """The causal-LM architecture of a sequence classifier (same decoder, score head instead
    of the LM head: ``LlamaForSequenceClassification`` -> ``LlamaForCausalLM``); any other
    name unchanged."""
    if architecture and architecture.endswith(SEQUENCE_CLASSIFIER_SUFFIX):
        return architecture.removesuffix(SEQUENCE_CLASSIFIER_SUFFIX) + CAUSAL_LM_SUFFIX
    return architecture


def get_family(architecture: str) -> Family:
    """The family for an HF ``architectures[0]`` value (a ``...ForSequenceClassification``
    one: its causal LM's family).

    Raises:
        ValueError: an unsupported architecture; the message lists the supported ones.
    """
    try:
        return FAMILIES[causal_lm_architecture(architecture)]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r} (config.json 'architectures'); "
            f"supported: {sorted(FAMILIES)}"
        ) from None


__all__ = [
    "CAUSAL_LM_SUFFIX",
    "FAMILIES",
    "Family",
    "Features",
    "ModelDims",
    "ParamMapping",
    "SEQUENCE_CLASSIFIER_SUFFIX",
    "SparseMlp",
    "causal_lm_architecture",
    "get_family",
]
