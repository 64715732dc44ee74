"""Checkpoints on disk: HF safetensors folders and Megatron distributed checkpoints.

HF: :func:`save_hf_checkpoint` writes an exported tensor stream into safetensors shards of at
most ``max_shard_bytes`` each (plus ``model.safetensors.index.json`` when there is more than
one), the HF ``config.json`` and the tokenizer/generation files copied from the source folder.
Each shard's header is written first (names and shapes come from the conversion plan), then
each tensor's bytes as it arrives; none is held after that.

Megatron: :func:`save_megatron_checkpoint` / :func:`load_megatron_checkpoint` use
``megatron.core.dist_checkpointing`` on a built model; its layout is independent of TP/PP, so
a checkpoint saved at TP=2 loads at PP=2. The folder also holds ``bridge.json`` (the HF
config, the padded vocabulary size and the dtype) and an ``hf_assets/`` copy of the tokenizer
files; a model with LoRA adapters (:mod:`megatron_bridge.lora`) also records them in
``lora.json``. Conversion writes and reads the same folders without a model
(:mod:`megatron_bridge.dist_ckpt_writer`, :mod:`megatron_bridge.dist_ckpt_reader`).
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from megatron_bridge.config import BridgeConfig, dtype_from_name, dtype_name
from megatron_bridge.dcp_file_writer import dcp_file_writer
from megatron_bridge.load import INDEX_FILE, SINGLE_FILE, build_gpt_model
from megatron_bridge.lora import LoraSpec
from megatron_bridge.safetensors_stream import SafetensorsStreamWriter, TensorSpec, tensor_nbytes

BRIDGE_FILE = "bridge.json"
LORA_FILE = "lora.json"
HF_ASSETS_DIR = "hf_assets"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

# Files of an HF folder that are not weights and not config.json: tokenizer, chat template,
# generation config. Copied next to converted weights so the result is a complete checkpoint.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def copy_hf_assets(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy tokenizer/generation files (everything but weights, index and config.json); the
    copies' modes are the umask's, not the source files' (a private cache's 0600 stays
    private to the cache).

    Returns:
        The copied file names.
    """
    copied = []
    for item in sorted(Path(src_dir).iterdir()):
        if (
            item.is_file()
            and item.name not in ("config.json", INDEX_FILE, BRIDGE_FILE)
            and not item.name.endswith(_WEIGHT_SUFFIXES)
        ):
            shutil.copyfile(item, Path(dst_dir) / item.name)
            copied.append(item.name)
    return copied


def save_hf_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]],
    bridge: BridgeConfig,
    out_dir: str | Path,
    assets_dir: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write an HF checkpoint folder from a ``(name, tensor)`` stream.

    Call on every rank with the same stream (e.g. from :func:`export_hf_weights`): all ranks
    consume it, only global rank 0 writes.

    Args:
        weights: every HF tensor of ``bridge``'s model in plan order, all of one dtype (what
            :func:`export_hf_weights` and :func:`~megatron_bridge.dist_ckpt_reader.
            checkpoint_hf_weights` yield). Names and shapes are known from ``bridge`` and the
            dtype from the first tensor, so each shard's header is written before its data.
        bridge: provides ``config.json``, written unchanged except its dtype label
            (``dtype`` / ``torch_dtype``), which is set to the tensors' dtype.
        out_dir: destination folder (created if missing).
        assets_dir: folder whose tokenizer/generation files are copied; None copies none.
        max_shard_bytes: start a new shard file once a shard would exceed this many bytes.

    Raises:
        ValueError: the stream differs from ``bridge``'s tensors (names, order, shapes, one
            dtype); checked on the writing rank.
    """
    out = Path(out_dir)
    writer = _is_writer()
    tensors = iter(weights)
    first = next(tensors, None)
    if first is None:
        raise ValueError("no tensors to write")
    dims = bridge.dims(1)
    specs = [
        (name, first[1].dtype, shape)
        for mapping in bridge.plan()
        for name, shape in zip(mapping.hf_names, mapping.hf_shapes(dims))
    ]
    shards = _group_into_shards(specs, max_shard_bytes)
    if len(shards) == 1:
        files = [SINGLE_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    tensors = itertools.chain([first], tensors)
    for file, shard_specs in zip(files, shards):
        shard = None
        if writer:
            shard = SafetensorsStreamWriter(out / file, shard_specs, {"format": "pt"})
        for name, tensor in itertools.islice(tensors, len(shard_specs)):
            if shard is not None:
                shard.add(name, tensor)
        if shard is not None:
            shard.close()
    if not writer:
        return
    if next(tensors, None) is not None:
        raise ValueError(f"the stream holds more tensors than the {len(specs)} of the model")

    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(tensor_nbytes(spec) for spec in specs)},
            "weight_map": dict(sorted(
                (spec[0], file) for file, shard in zip(files, shards) for spec in shard
            )),
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    # The label is the tensors' dtype, whatever the source config said: in the key(s) the
    # config uses ("dtype" since transformers 4.56, "torch_dtype" before), "dtype" if neither.
    config = dict(bridge.hf_config)
    for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
        config[key] = dtype_name(first[1].dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if assets_dir is not None:
        copy_hf_assets(assets_dir, out)


def _group_into_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors per shard file: a shard ends before the tensor that would take it
    past ``max_shard_bytes`` (a tensor larger than that gets a shard of its own)."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        nbytes = tensor_nbytes(spec)
        if not shards or (shards[-1] and size + nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _in_process_save_strategy(sync_files: bool) -> Any:
    """megatron-core's ``torch_dist`` save, written by this process with a DCP file writer
    that holds one tensor at a time (:func:`~megatron_bridge.dcp_file_writer.dcp_file_writer`).

    The checkpoint is the one megatron-core's default strategy writes (same ShardedTensor ->
    torch ShardedTensor translation, same planner, same ``__<rank>_<n>.distcp`` files and
    ``.metadata``); only the write step differs. The default strategy hands the write to
    worker processes it forks, collecting results through a ``multiprocessing`` Manager it
    starts with the spawn method (a fresh interpreter that re-imports the main module, about
    2.5 s here, and the reason scripts needed a ``__main__`` guard).
    """
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import save as dcp_save

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            writer = dcp_file_writer(checkpoint_dir, sync_files)
            planner = MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica,
                flatten_state_dict=False,
            )
            dcp_save(mcore_to_pyt_state_dict(flat, False), storage_writer=writer, planner=planner)

    return InProcessTorchDistSave("torch_dist", 1)


def save_megatron_checkpoint(
    model: torch.nn.Module,
    bridge: BridgeConfig,
    ckpt_dir: str | Path,
    assets_dir: str | Path | None = None,
) -> None:
    """Save this rank's stage with ``dist_checkpointing`` (call on every rank).

    Written in ``torch_dist`` format by this process itself (see
    :func:`_in_process_save_strategy`); files are fsynced before the call returns.
    """
    from megatron.core import dist_checkpointing, parallel_state

    ckpt = Path(ckpt_dir)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    # dist_checkpointing needs the folder to exist, and treats a non-empty folder without its
    # metadata as a corrupt checkpoint: create it empty, save, then add our own files.
    if _is_writer():
        ckpt.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save(
        model.sharded_state_dict(), str(ckpt), sharded_strategy=_in_process_save_strategy(True)
    )
    if _is_writer():
        write_bridge_files(ckpt, bridge, tp, next(model.parameters()).dtype, assets_dir)
    if dist.is_initialized():
        dist.barrier()


def write_bridge_files(
    ckpt_dir: Path,
    bridge: BridgeConfig,
    tp: int,
    dtype: torch.dtype,
    assets_dir: str | Path | None,
    source_dtype: torch.dtype | None = None,
) -> None:
    """Add our own files to a dist checkpoint: ``bridge.json`` (HF config, padded vocabulary
    at TP size ``tp``, parameter dtype, and the dtype of the HF tensors it was converted from
    when they had one) and the tokenizer files under ``hf_assets/``."""
    meta = {
        "hf_config": bridge.hf_config,
        "make_vocab_size_divisible_by": bridge.make_vocab_size_divisible_by,
        "padded_vocab_size": bridge.padded_vocab(tp),
        "dtype": dtype_name(dtype),
        "source_dtype": None if source_dtype is None else dtype_name(source_dtype),
    }
    (ckpt_dir / BRIDGE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if assets_dir is not None:
        (ckpt_dir / HF_ASSETS_DIR).mkdir(exist_ok=True)
        copy_hf_assets(assets_dir, ckpt_dir / HF_ASSETS_DIR)


def write_lora_file(ckpt_dir: Path, spec: LoraSpec) -> None:
    """Record a model's LoRA adapters (settings and adapted linears) as ``lora.json``."""
    (Path(ckpt_dir) / LORA_FILE).write_text(json.dumps(spec.to_json(), indent=2) + "\n")


def read_lora_spec(ckpt_dir: str | Path) -> LoraSpec | None:
    """The LoRA adapters a checkpoint holds (its ``lora.json``); None when it holds none."""
    lora_file = Path(ckpt_dir) / LORA_FILE
    return LoraSpec.from_json(json.loads(lora_file.read_text())) if lora_file.is_file() else None


def read_bridge_metadata(ckpt_dir: str | Path) -> dict[str, Any]:
    """The ``bridge.json`` of a Megatron checkpoint.

    Raises:
        FileNotFoundError: not a checkpoint written by :func:`save_megatron_checkpoint`.
    """
    meta_file = Path(ckpt_dir) / BRIDGE_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(
            f"{meta_file} not found: {ckpt_dir} is not a megatron_bridge checkpoint"
        )
    return json.loads(meta_file.read_text())


def export_dtype(ckpt_dir: str | Path) -> torch.dtype:
    """The dtype an export of a Megatron checkpoint writes by default: that of the HF tensors
    it was converted from (so a bf16 source round-trips bit for bit through a float32
    checkpoint), else the checkpoint's own parameter dtype."""
    meta = read_bridge_metadata(ckpt_dir)
    return dtype_from_name(meta.get("source_dtype") or meta["dtype"])


def checkpoint_bridge(ckpt_dir: str | Path) -> BridgeConfig:
    """The :class:`BridgeConfig` of a Megatron checkpoint, with its saved vocabulary padding."""
    meta = read_bridge_metadata(ckpt_dir)
    return BridgeConfig(
        meta["hf_config"],
        make_vocab_size_divisible_by=meta["make_vocab_size_divisible_by"],
        padded_vocab_size=meta["padded_vocab_size"],
    )


def load_megatron_checkpoint(
    ckpt_dir: str | Path, dtype: torch.dtype | None = None
) -> tuple[torch.nn.Module, BridgeConfig]:
    """Build this rank's stage at the current TP/PP sizes and load a dist checkpoint into it.

    Args:
        dtype: expected parameter dtype; None uses the checkpoint's.

    Raises:
        ValueError: ``dtype`` differs from the checkpoint's dtype, or TP/PP do not fit.
    """
    from megatron.core import dist_checkpointing

    meta = read_bridge_metadata(ckpt_dir)
    saved = dtype_from_name(meta["dtype"])
    if dtype is not None and dtype != saved:
        raise ValueError(
            f"dtype mismatch: the checkpoint in {ckpt_dir} holds {meta['dtype']} weights, "
            f"{dtype_name(dtype)} was requested; pass dtype={meta['dtype']} (--dtype "
            f"{meta['dtype']}) or convert to HF and reload"
        )
    bridge = checkpoint_bridge(ckpt_dir)
    model = build_gpt_model(bridge, saved)
    sharded = model.sharded_state_dict()
    _merge_in_place(sharded)
    state = dist_checkpointing.load(sharded, str(ckpt_dir))
    own = dict(model.state_dict(keep_vars=True))
    # dist_checkpointing reads straight into the parameters it was given; copy only what it
    # returned in other memory. strict=False only to tolerate TransformerEngine's
    # "_extra_state" entries; any real parameter missing from the checkpoint is an error.
    loaded_in_place = {k for k, v in state.items() if k in own and _same_view(v, own[k])}
    result = model.load_state_dict(
        {k: v for k, v in state.items() if k not in loaded_in_place}, strict=False
    )
    missing = [
        k for k in result.missing_keys
        if k not in loaded_in_place and not k.endswith("_extra_state")
    ]
    if missing:
        raise ValueError(f"checkpoint {ckpt_dir} lacks parameters {missing}")
    return model, bridge


def _same_view(a: Any, b: Any) -> bool:
    """True if tensors ``a`` and ``b`` are the same memory with the same layout."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _merge_in_place(sharded_state_dict: dict[str, Any]) -> None:
    """Make tensor factories whose parts are loaded into their own tensor return that tensor.

    megatron-core saves a fused gate/up ``linear_fc1`` weight as two sharded tensors (views of
    the parameter's halves, which dist_checkpointing loads into directly) and merges them
    after loading with ``torch.cat``: a full copy of every fc1 weight, all alive at once. When
    the loaded parts are exactly the parameter's consecutive memory, the parameter already
    holds the merged result; any other case keeps megatron-core's own merge.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for factory in nested_values(sharded_state_dict):
        # Only the GLU factory of megatron.core.transformer.mlp, whose merge is a dim-0 cat.
        if (
            isinstance(factory, ShardedTensorFactory)
            and isinstance(factory.data, torch.Tensor)
            and getattr(factory.merge_fn, "__module__", None) == "megatron.core.transformer.mlp"
        ):
            factory.merge_fn = _merge_or_reuse(factory.data, factory.merge_fn)


def _merge_or_reuse(whole: torch.Tensor, merge_fn: Any) -> Any:
    def merge(parts: Any) -> Any:
        if isinstance(parts, list) and _tiles(whole, parts):
            return whole
        return merge_fn(parts)

    return merge


def _tiles(whole: torch.Tensor, parts: list[Any]) -> bool:
    """True if ``torch.cat(parts)`` equals ``whole`` because the contiguous parts lie back to
    back in ``whole``'s own memory, fill it, and share its trailing shape."""
    if not whole.is_contiguous() or not all(
        isinstance(p, torch.Tensor) and p.is_contiguous() and p.dtype == whole.dtype
        for p in parts
    ):
        return False
    ptr = whole.data_ptr()
    for part in parts:
        if part.data_ptr() != ptr:
            return False
        ptr += part.numel() * part.element_size()
    return ptr == whole.data_ptr() + whole.numel() * whole.element_size() and all(
        p.shape[1:] == whole.shape[1:] for p in parts
    )
