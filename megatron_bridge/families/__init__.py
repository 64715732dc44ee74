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


def get_family(architecture: str) -> Family:
    """The family for an HF ``architectures[0]`` value.

    Raises:
        ValueError: an unsupported architecture; the message lists the supported ones.
    """
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r} (config.json 'architectures'); "
            f"supported: {sorted(FAMILIES)}"
        ) from None


__all__ = [
    "FAMILIES", "Family", "Features", "ModelDims", "ParamMapping", "SparseMlp", "get_family",
]
