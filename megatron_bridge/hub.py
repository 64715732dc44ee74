"""HF checkpoint arguments: a local folder, or a Hugging Face Hub name resolved to its snapshot.

A hub name resolves to the snapshot folder in the Hugging Face cache (``HF_HOME``), downloaded
on first use with only the files loading needs; ``HF_HUB_OFFLINE=1`` uses the cache alone.
"""

from __future__ import annotations

from pathlib import Path

# Files of a hub checkpoint that loading needs: config and tokenizer files, safetensors weights
# (with their index), sentencepiece / tiktoken vocabularies, merges, chat templates.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def _as_local_path(name: str) -> Path | None:
    """``name`` as a local path when it names one (starts with "/", "." or "~", or exists
    here), None when it is a hub name."""
    path = Path(name).expanduser()
    return path if name.startswith(("/", ".", "~")) or path.exists() else None


def resolve_hf_checkpoint(name: str) -> Path:
    """The local folder of HF checkpoint ``name``.

    Args:
        name: a local checkpoint folder, or a hub name such as "Qwen/Qwen2.5-1.5B". A name
            starting with "/", "." or "~", or naming an existing path, is a local folder.

    Returns:
        The folder (holding config.json): the given one, or the hub snapshot. On several
        nodes put ``HF_HOME`` on a shared filesystem: the path is resolved once, on the driver.

    Raises:
        FileNotFoundError: a local path that is not a folder or has no config.json; a hub name
            the hub could not provide (no network, gated without ``HF_TOKEN``, unknown), with
            the hub's error as the cause; with no network and no ``HF_HUB_OFFLINE=1`` only
            after huggingface_hub's retries.
    """
    path = _as_local_path(name)
    if path is not None:
        if not path.is_dir():
            raise FileNotFoundError(
                f"model path {path} is not an existing folder; give a checkpoint folder or a "
                f"Hugging Face Hub name"
            )
    else:
        path = download_from_hub(name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model folder {path} has no config.json; point at a folder saved with "
            f"save_pretrained"
        )
    return path


def local_hf_checkpoint(name: str) -> Path | None:
    """The folder of HF checkpoint ``name`` if it is on this machine, without downloading: a
    local folder with config.json, or a hub snapshot whose config.json is already cached;
    None otherwise (a hub name not cached, a path that exists only on other nodes)."""
    path = _as_local_path(name)
    if path is not None:
        return path if (path / "config.json").is_file() else None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a valid hub repo id
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def download_from_hub(name: str) -> Path:
    """``snapshot_download`` of the loading files of hub model ``name`` (cached)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=HUB_ALLOW_PATTERNS))
    except (LocalEntryNotFoundError, HfHubHTTPError, ValueError) as err:
        raise FileNotFoundError(
            f"model {name!r} is not a local folder, and the Hugging Face Hub could not provide "
            f"it ({type(err).__name__}). Give a local checkpoint folder, or make the hub "
            "reachable (HF_TOKEN for gated models); offline, a model already in the HF_HOME "
            "cache loads with HF_HUB_OFFLINE=1."
        ) from err
