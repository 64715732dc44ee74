"""What a config's ``model_name`` names, as a local checkpoint folder: a tiny model (built here
on first use, :data:`~nemo_rl.models.tiny.TINY_MODEL_NAMES`), a local folder, or a Hugging Face
Hub name (its snapshot in the ``HF_HOME`` cache).

:func:`resolve_model_path` is what a run loads (downloading a hub model not yet cached);
:func:`local_model_path` is what checks before a run may read without a download.
"""

from __future__ import annotations

from megatron_bridge.hub import local_hf_checkpoint, resolve_hf_checkpoint
from nemo_rl.models.tiny import TINY_MODEL_NAMES, TINY_MODEL_SIZES, build_tiny_model
from nemo_rl.utils.errors import ModelNotFoundError


def resolve_model_path(model_name: str, field: str | None = None) -> str:
    """The local checkpoint folder of a model name.

    Args:
        model_name: a tiny model name (see :data:`TINY_MODEL_NAMES`), a local checkpoint
            folder, or a Hugging Face Hub name such as "Qwen/Qwen2.5-1.5B".
        field: the config field ``model_name`` came from, named first in the error message.

    Returns:
        The local folder of a tiny model (built on first use), or what
        :func:`megatron_bridge.hub.resolve_hf_checkpoint` resolves the name to (the folder, or
        the hub snapshot in the ``HF_HOME`` cache).

    Raises:
        ModelNotFoundError: (a ``FileNotFoundError``) as
            :func:`~megatron_bridge.hub.resolve_hf_checkpoint`, the message also naming the tiny
            models.
    """
    if model_name in TINY_MODEL_NAMES:
        family, vocab = TINY_MODEL_NAMES[model_name]
        return str(build_tiny_model(family, vocab=vocab, **TINY_MODEL_SIZES.get(model_name, {})))
    try:
        return str(resolve_hf_checkpoint(model_name))
    except FileNotFoundError as err:
        where = f"{field}: " if field else ""
        raise ModelNotFoundError(
            f"{where}{err} (or use one of {sorted(TINY_MODEL_NAMES)})"
        ) from err


def local_model_path(model_name: str) -> str | None:
    """The local folder of ``model_name``'s checkpoint when it is here without a download.

    For checks that read config.json before a run starts: a tiny model name resolves (built
    locally on first use); otherwise :func:`megatron_bridge.hub.local_hf_checkpoint` (a local
    folder with config.json, or a hub snapshot whose config.json is already cached). Anything
    else (a hub name not cached, a path that exists only on the cluster's nodes) gives None:
    nothing is downloaded.
    """
    if model_name in TINY_MODEL_NAMES:
        return resolve_model_path(model_name)
    path = local_hf_checkpoint(model_name)
    return None if path is None else str(path)
