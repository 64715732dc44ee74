"""Build a Megatron ``GPTModel`` for this rank and stream HF safetensors weights into it.

Each rank builds only its pipeline stage (its layers, the embedding on the first stage, the
head on the last) with only its expert-parallel share of the experts, and reads only its
tensor-parallel slice of each HF tensor through
``safe_open(...).get_slice``, one tensor at a time: peak memory is this rank's model plus
one tensor slice, never the full model twice.
"""

from __future__ import annotations

import json
import math
import os
import struct
import weakref
from pathlib import Path
from typing import Any, NamedTuple

import torch

from megatron_bridge.config import BridgeConfig
from megatron_bridge.families import ParamMapping
from megatron_bridge.families.base import TE_NORM_NAMES
from megatron_bridge.layer_spec import gpt_stage_spec, with_model_biases
from megatron_bridge.lora_targets import is_adapter_param
from megatron_bridge.tensor_check import check_hf_tensors

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


class SafetensorsReader:
    """Reads tensors or row/column ranges of them from an HF checkpoint (single file or
    sharded + index).

    Each file's header is parsed once (``safe_open`` validates it); tensor bytes are then read
    with ``os.preadv`` straight into the returned tensor's memory. Nothing stays mapped, so the
    process holds only the tensors it asked for (mmap reads would keep every page they
    touched resident until the file is closed, i.e. a second copy of the checkpoint).

    Raises (on construction):
        FileNotFoundError: no weights file, or a shard named by the index is missing.
        ValueError: an unreadable (corrupt/truncated) safetensors file or index.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._name_to_file: dict[str, Path] = {}
        self._files: dict[Path, _SafetensorsFile] = {}
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise ValueError(f"{index} is not a valid safetensors index: {err}") from err
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise FileNotFoundError(
                    f"checkpoint {self.path} is missing shard(s) {missing} listed in {INDEX_FILE}"
                )
            self._name_to_file = {name: self.path / f for name, f in weight_map.items()}
            for f in files:
                self._open(self.path / f)
        elif (self.path / SINGLE_FILE).is_file():
            single = self._open(self.path / SINGLE_FILE)
            self._name_to_file = {name: self.path / SINGLE_FILE for name in single.entries}
        else:
            raise FileNotFoundError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {self.path}: not an HF safetensors checkpoint"
            )

    def _open(self, file: Path) -> "_SafetensorsFile":
        if file not in self._files:
            self._files[file] = _SafetensorsFile(file)
        return self._files[file]

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self._name_to_file)

    def files(self) -> list[str]:
        """Names of the safetensors files holding the tensors."""
        return sorted({f.name for f in self._name_to_file.values()})

    def _entry(self, name: str) -> tuple["_SafetensorsFile", "_Entry"]:
        if name not in self._name_to_file:
            raise KeyError(f"tensor {name!r} not found in checkpoint {self.path}")
        file = self._open(self._name_to_file[name])
        if name not in file.entries:
            raise ValueError(f"{file.path} does not hold {name!r} although the index says so")
        return file, file.entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[1].dtype

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """Tensor ``name`` or its rows (``dim=0``) / columns (``dim=1``) ``[start:stop]``.

        Row ranges read only their bytes; a column range reads the whole tensor and returns a
        contiguous copy of the columns.
        """
        file, entry = self._entry(name)
        if dim is None:
            return file.read_rows(entry, 0, entry.shape[0] if entry.shape else 0)
        rows = range(entry.shape[dim])[start:stop]
        if dim == 0:
            return file.read_rows(entry, rows.start, rows.stop)
        full = file.read_rows(entry, 0, entry.shape[0])
        return full[:, rows.start : rows.stop].contiguous()


class _Entry(NamedTuple):
    """One tensor of a safetensors file: dtype, shape, and byte range in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class _SafetensorsFile:
    """One safetensors file: its parsed header and an unbuffered descriptor for ``preadv``."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        try:
            with safe_open(str(path), framework="pt"):  # validates header and file size
                pass
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"cannot read {path} (corrupt or truncated?): {err}") from err
        data_start = 8 + header_len
        header.pop("__metadata__", None)
        self.entries: dict[str, _Entry] = {}
        for name, info in header.items():
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise ValueError(
                    f"{path}: tensor {name!r} has dtype {info['dtype']}; supported: "
                    f"{sorted(_SAFETENSORS_DTYPES)}"
                )
            begin, end = info["data_offsets"]
            self.entries[name] = _Entry(
                _SAFETENSORS_DTYPES[info["dtype"]],
                tuple(info["shape"]),
                data_start + begin,
                data_start + end,
            )
        self._fd = os.open(path, os.O_RDONLY)
        self._finalizer = weakref.finalize(self, os.close, self._fd)

    def read_rows(self, entry: _Entry, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start:stop)`` of a tensor (a 0-d tensor whole), in new memory."""
        shape = (stop - start, *entry.shape[1:]) if entry.shape else ()
        out = torch.empty(shape, dtype=entry.dtype)
        row_bytes = math.prod(entry.shape[1:]) * out.element_size()
        buf = memoryview(out.view(-1).view(torch.uint8).numpy())
        offset, done = entry.begin + start * row_bytes, 0
        while done < len(buf):
            got = os.preadv(self._fd, [buf[done:]], offset + done)
            if got == 0:
                raise ValueError(f"{self.path} ends inside tensor data (truncated?)")
            done += got
        return out


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of this pipeline stage's first decoder layer."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def expert_range(bridge: BridgeConfig) -> range:
    """Global indices of the experts this expert-parallel rank holds (its contiguous share)."""
    from megatron.core import parallel_state

    if not bridge.is_moe:
        return range(0)
    ep = parallel_state.get_expert_model_parallel_world_size()
    per_rank = bridge.num_experts // ep
    start = parallel_state.get_expert_model_parallel_rank() * per_rank
    return range(start, start + per_rank)


def stage_mappings(model: torch.nn.Module, bridge: BridgeConfig) -> dict[str, ParamMapping]:
    """This stage's parameter name -> the mapping that fills it (and that exports it); of the
    experts, only this expert-parallel rank's.

    With tied embeddings on a multi-stage pipeline, the last stage has its own copy of the
    output matrix; it is filled from the HF embedding.

    Raises:
        ValueError: a parameter of the model with no HF tensor, or an HF tensor of the plan
            with no parameter: loading or exporting would drop it.
    """
    offset = layer_offset(model)
    num_local = len(model.decoder.layers)
    experts = expert_range(bridge)
    plan = bridge.plan()
    # LoRA adapters (megatron_bridge.lora) have no HF tensor of their own: export merges them.
    params = {name for name, _ in model.named_parameters() if not is_adapter_param(name)}
    result: dict[str, ParamMapping] = {}
    for mapping in plan:
        if mapping.layer is not None and not offset <= mapping.layer < offset + num_local:
            continue
        if mapping.layer is None and not (
            model.pre_process if mapping.megatron_name.startswith("embedding.") else model.post_process
        ):
            continue
        if mapping.expert is not None and mapping.expert not in experts:
            continue
        name = mapping.local_name(offset, experts.start)
        for local, te_name in TE_NORM_NAMES.items():
            # TransformerEngine's name where it fuses the norm (a sparse layer keeps its own
            # pre-MLP norm, not fused into the experts).
            te_local = name[: -len(local)] + te_name
            if name.endswith(local) and te_local in params:
                name = te_local
        result[name] = mapping
    if bridge.tie_word_embeddings and model.post_process and not model.pre_process:
        embedding = next(m for m in plan if m.kind == "vocab")
        result["output_layer.weight"] = embedding
    unmapped, unbuilt = sorted(params - set(result)), sorted(set(result) - params)
    if unmapped or unbuilt:
        raise ValueError(
            f"the {bridge.family.architecture} model and its HF tensors disagree: Megatron "
            f"parameters without an HF tensor {unmapped}, HF tensors without a Megatron "
            f"parameter {[result[n].hf_names for n in unbuilt]}"
        )
    return result


def partition_dims(model: torch.nn.Module) -> dict[str, int | None]:
    """Each parameter's tensor-parallel split dim: 0 column-parallel rows (and vocabulary
    rows), 1 row-parallel columns, None replicated.

    Derived from the module types, because Megatron only tags parameters with
    ``partition_dim`` when it initialises them itself (we skip that; weights are loaded).
    """
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    dims: dict[str, int | None] = {}
    for module_name, module in model.named_modules():
        # TransformerEngine's linear layers say which way they are split in parallel_mode.
        mode = getattr(module, "parallel_mode", None)
        column = isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) or mode == "column"
        row = isinstance(module, RowParallelLinear) or mode == "row"
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if column and param_name in ("weight", "bias"):
                dims[full] = 0
            elif row and param_name == "weight":
                dims[full] = 1
            else:
                dims[full] = None
    return dims


def build_gpt_model(bridge: BridgeConfig, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """An empty (uninitialised) GPTModel for this rank's (TP, PP, EP) position.

    megatron-core's parallel state must be initialised (:func:`megatron_bridge.parallel_state.
    initialize_megatron_parallel`, which also applies the CPU accommodations); TP/PP/EP sizes
    are read from it.

    Raises:
        ValueError: TP/PP/EP sizes that do not fit the model (from validation, before building).
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    config = bridge.transformer_config(tp, pp, dtype, ep=ep)
    return gpt_model_stage(bridge, config, gpt_stage_spec(config), tp).eval()


def gpt_model_stage(bridge: BridgeConfig, config: Any, spec: Any, tp: int) -> torch.nn.Module:
    """This rank's pipeline stage of the GPTModel ``bridge`` describes, from a megatron
    ``TransformerConfig`` (:meth:`BridgeConfig.transformer_config`) and layer spec, with the
    model's biases and transformers' RoPE frequencies (uninitialised weights); its logits give
    the vocabulary padding ``-inf`` (:mod:`megatron_bridge.vocab_padding`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_bridge.vocab_padding import exclude_vocab_padding

    model = GPTModel(
        config=config,
        transformer_layer_spec=with_model_biases(spec, bridge.features),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **bridge.gpt_model_kwargs(tp),
    )
    inv_freq = bridge.rope_inv_freq()
    if inv_freq is not None:
        # Scaled RoPE: use transformers' exact frequencies instead of Megatron's own formula.
        model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq.device)
    exclude_vocab_padding(model, bridge.vocab_size)
    return model


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, bridge: BridgeConfig, hf_path: str | Path) -> None:
    """Fill this rank's parameters from an HF checkpoint, one TP slice at a time.

    Raises:
        ValueError: missing, misshapen or left-over HF tensors (:func:`check_hf_tensors`),
            a parameter with no HF source, or a corrupt file.
        FileNotFoundError: missing shards.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    # Experts are split over the expert tensor-parallel group (of TP's size, its own ranks).
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    reader = SafetensorsReader(hf_path)
    check_hf_tensors(reader, bridge)
    mappings = stage_mappings(model, bridge)
    dims = bridge.dims(tp)
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            continue  # a LoRA adapter is not part of the HF checkpoint
        mapping = mappings[name]
        if mapping.expert is None:
            tensor = mapping.shard(reader, dims, tp_rank, tp)
        else:
            tensor = mapping.shard(reader, dims, etp_rank, etp)
        if tensor.shape != param.shape:
            raise ValueError(
                f"{name}: HF tensor(s) {mapping.hf_names} give shape "
                f"{tuple(tensor.shape)}, the Megatron parameter has {tuple(param.shape)}"
            )
        param.copy_(tensor)


def load_hf_into_megatron(
    hf_path: str | Path, dtype: torch.dtype = torch.float32, **bridge_kwargs: Any
) -> tuple[torch.nn.Module, BridgeConfig]:
    """Build this rank's GPTModel and load an HF checkpoint into it.

    Args:
        hf_path: HF checkpoint folder (config.json + safetensors).
        dtype: Megatron parameter dtype; HF tensors are cast to it.
        **bridge_kwargs: extra :class:`BridgeConfig` settings (vocabulary padding).

    Returns:
        ``(model, bridge)``; the model is in eval mode.
    """
    bridge = BridgeConfig.from_hf(hf_path, **bridge_kwargs)
    model = build_gpt_model(bridge, dtype)
    load_hf_weights(model, bridge, hf_path)
    return model, bridge
