"""A LoRA policy's adapters served by vLLM itself (``vllm_cfg.lora_refit: adapter``).

The engine is built with vLLM's LoRA support (:func:`lora_engine_kwargs`) and keeps the base
weights it loaded at start. Each refit streams only the adapters' tensors; every rank process
of the engine turns them into a vLLM ``LoRAModel`` in memory (``LoRAModel.from_lora_tensors``,
no adapter folder on disk) and puts it in its LoRA manager under a new integer id, in place of
the previous one (:func:`install_adapter`). Requests then name that id
(:func:`adapter_request`): vLLM finds the adapter already loaded and never reads the request's
path, which only has to be non-empty.

vLLM's public ``add_lora`` takes a ``LoRARequest`` whose folder it reads; installing tensors
in memory goes through the worker's LoRA manager (``model_runner.lora_manager`` and its
``_adapter_manager``, vLLM 0.32), which this module is the only user of.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_rl.models.generation.lora_serving import AdapterServing

# The path every in-memory adapter's LoRARequest names (never read: see the module docstring).
IN_MEMORY_PATH = "nemo-rl:in-memory-adapter"


def lora_engine_kwargs(serving: AdapterServing) -> dict[str, Any]:
    """``vllm.LLM`` arguments of an engine that serves ``serving``'s adapters: one adapter
    at a time (the latest refit's), of rank up to :attr:`AdapterServing.max_lora_rank`."""
    return {
        "enable_lora": True,
        "max_lora_rank": serving.max_lora_rank,
        "max_loras": 1,
        "max_cpu_loras": 1,
    }


def adapter_request(lora_id: int) -> Any:
    """The ``LoRARequest`` of the adapter installed as ``lora_id``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"policy-adapter-{lora_id}", lora_id, IN_MEMORY_PATH)


def install_adapter(
    worker: Any, tensors: Mapping[str, torch.Tensor], serving: AdapterServing, lora_id: int
) -> None:
    """Runs in each rank process (``worker``: vLLM's worker of that rank): make ``tensors``
    (PEFT names ``<hf module>.lora_A.weight`` ``[dim, in]`` / ``.lora_B.weight``
    ``[out, dim]``, full size: vLLM slices a tensor-parallel rank's share itself) the engine's
    only adapter, as ``lora_id``.

    Raises:
        ValueError: an adapted module the engine's model cannot serve with LoRA, or an
            adapter vLLM refuses (its rank above the engine's max_lora_rank).
    """
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    adapters = manager._adapter_manager
    modules = sorted({name.rsplit(".", 3)[-3] for name in tensors})
    servable = {
        part
        for module in adapters.supported_lora_modules
        for part in adapters.packed_modules_mapping.get(module, [module])
    }
    unservable = [m for m in modules if m not in servable]
    if unservable:
        raise ValueError(
            f"the engine's model cannot serve LoRA adapters on {unservable} (vLLM serves "
            f"{sorted(servable)}); set policy.generation.vllm_cfg.lora_refit: merged"
        )
    helper = PEFTHelper.from_dict(
        {"r": serving.dim, "lora_alpha": serving.alpha, "target_modules": modules}
    )
    helper.validate_legal(manager.lora_config)
    # as vLLM's own loader: HF module names renamed to the engine model's, if it renames
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    model = LoRAModel.from_lora_tensors(
        lora_id,
        dict(tensors),
        helper,
        device="cpu",  # activation copies it into the engine's adapter slots
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
    )
    for old in list(adapters.list_adapters()):
        adapters.remove_adapter(old)
    adapters.add_adapter(model)
