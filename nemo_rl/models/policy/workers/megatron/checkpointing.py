"""Training checkpoints with ``megatron.core.dist_checkpointing``: model, optimizer, scheduler,
step and RNG.

Model and optimizer go through their sharded state dicts (the distributed optimizer's in
megatron's ``fully_reshardable`` format), whose layout is independent of TP/PP/DP, so a
checkpoint saved at one layout loads at another. Scheduler state and the step are common
(replicated) entries. RNG states are per rank (``rng/rank_<r>.pt``) and restored only when
the layout is unchanged. ``layout.json`` records the layout of the save and the optimizer
steps taken (``optimizer_step``: SFT warm-start steps included, so it is not the GRPO step of
the ``step_<n>`` folder holding it). A LoRA policy's folder also has ``lora.json`` (its
adapters' settings and linears); a checkpoint loads only into a policy with the same adapters.
Every file is fsynced before the save returns (the caller seals the folder with a manifest and
renames it: nemo_rl/utils/checkpoint.py).

The folder is also a ``megatron_bridge`` checkpoint: ``bridge.json`` (the HF config, vocabulary
padding, parameter dtype) and ``hf_assets/`` (tokenizer, chat template, generation config of the
source model), so ``megatron-bridge convert --from megatron --to hf`` and ``nemo-rl export``
stream its model tensors into an HF folder without building a model (the optimizer's tensors
are skipped).

The folder must not exist or be empty: dist_checkpointing treats a non-empty folder without its
metadata as corrupt. The vocabulary padding must match across layouts (it depends on TP only
through ``make_vocab_size_divisible_by * TP``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_bridge.checkpoint import read_lora_spec, write_bridge_files, write_lora_file
from megatron_bridge.lora import LoraSpec
from nemo_rl.models.megatron.optimizer_parts import optimizer_parts
from nemo_rl.models.policy.workers.megatron.model_setup import PolicyModel
from nemo_rl.utils.checkpoint_manifest import fsync_path, fsync_tree

LAYOUT_FILE = "layout.json"
RNG_DIR = "rng"
# Layout entries a checkpoint may lack, with the value its layout had (written before EP was
# recorded: EP=1).
_LAYOUT_DEFAULTS = {"ep": 1}


# The distributed optimizer's resharding format; its default in megatron-core 0.16.1
# ("fully_sharded_model_space") builds flattened-range tensors dist_checkpointing rejects.
# Expert parallelism (EP > 1) splits the optimizer in two (dense and expert parameters,
# megatron's ChainedOptimizer) where EP = 1 has one; without the "chained_<i>." key prefix the
# optimizer state of every parameter has the same key at any EP.
_OPTIMIZER_FORMAT = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
}


def _sharded_state(policy: PolicyModel, is_loading: bool) -> dict[str, Any]:
    model_state = policy.model.module.sharded_state_dict()
    return {
        "model": model_state,
        "optimizer": policy.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=_OPTIMIZER_FORMAT
        ),
    }


def _init_empty_optimizer_state(optimizer: Any) -> None:
    """Give every parameter of a not-yet-stepped Adam or SGD its (zero) state.

    Loading builds the optimizer's sharded state dict from its current state, which megatron's
    distributed optimizer reads with the Adam step count of every parameter: a fresh optimizer
    has none. SGD's momentum buffers are made here too, since megatron-core 0.16.1 has no state
    initialiser for SGD (its ``init_state_fn`` is None and loading calls it; it becomes a no-op).
    Loading then overwrites these zeros.
    """
    for opt in optimizer_parts(optimizer):
        inner = opt.optimizer
        if isinstance(inner, torch.optim.SGD):
            if getattr(opt, "init_state_fn", False) is None:
                opt.init_state_fn = lambda *_: None
            for group in inner.param_groups:
                for param in group["params"]:
                    if group["momentum"] and not inner.state[param]:
                        inner.state[param] = {"momentum_buffer": torch.zeros_like(param)}
            continue
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        # where torch's Adam keeps it: a fused Adam's step on the device
                        "step": torch.zeros((), dtype=torch.float32, device=param.device)
                        if group.get("fused") else torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param),
                        "exp_avg_sq": torch.zeros_like(param),
                    }


@contextlib.contextmanager
def _keeping_torch_adam_step(optimizer: Any) -> Iterator[None]:
    """Let a distributed optimizer over torch's Adam (megatron's fallback without
    TransformerEngine or apex, on CPU and on GPU) load its ``fully_reshardable`` state.

    megatron-core 0.16.1 restores torch Adam's ``step`` from the param groups, then copies each
    parameter's saved state over its current one key by key; the saved parameter state has no
    ``step``, so that copy raises ``KeyError: 'step'``. Inside this block the copy is given the
    step already restored (copied onto itself) for the keys the checkpoint lacks.
    """
    patched = []
    for part in optimizer_parts(optimizer):
        copy_state = getattr(part, "_set_main_param_and_optimizer_states", None)
        if copy_state is None or not isinstance(part.optimizer, torch.optim.Adam | torch.optim.AdamW):
            continue

        def with_current_step(model_param: Any, tensors: dict, _part: Any = part,
                              _copy: Any = copy_state) -> None:
            current = _part._get_main_param_and_optimizer_states(model_param)
            _copy(model_param, {**({"step": current["step"]} if "step" in current else {}),
                                **tensors})

        part._set_main_param_and_optimizer_states = with_current_step
        patched.append(part)
    try:
        yield
    finally:
        for part in patched:
            del part._set_main_param_and_optimizer_states  # the class's method again
    for part in patched:  # megatron gave every parameter the same step tensor: Adam would
        for state in part.optimizer.state.values():  # add 1 to it once per parameter
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _saved_step(state: Any) -> Any:
    """The Adam step count anywhere in ``state``: megatron's ``common_step`` (plain optimizer)
    or the ``step`` of a param group (distributed optimizer over torch's Adam)."""
    if isinstance(state, dict):
        if "common_step" in state:
            return state["common_step"]
        for group in state.get("param_groups") or ():
            if isinstance(group, dict) and "step" in group:
                return group["step"]
        for value in state.values():
            found = _saved_step(value)
            if found is not None:
                return found
    return None


def _in_current_split(loaded: dict[Any, Any], optimizer: Any) -> Any:
    """``loaded`` (optimizer state read for ``optimizer``'s parameters from a checkpoint whose
    optimizer was split differently) in the structure ``optimizer.load_state_dict`` takes.

    Expert parallelism splits megatron's optimizer into a dense and an expert part (EP = 1 has
    one): the per-parameter tensors (a plain optimizer's ``state``, a distributed optimizer's
    ``param_state``) load by parameter name whatever the split (no ``chained_<i>`` prefix), but
    the saved param groups and step count follow the saved split. The param groups are taken
    from ``optimizer`` itself (the same config; the learning rate comes back with the
    scheduler's state) and the step count from the checkpoint.
    """
    step = _saved_step(loaded)
    parts = optimizer_parts(optimizer)

    def part(loaded_part: dict[Any, Any], opt: Any) -> dict[str, Any]:
        if "param_state" in loaded_part:  # megatron's distributed optimizer
            own = opt.state_dict()
            for group in own["optimizer"]["param_groups"]:
                if step is not None and "step" in group:
                    group["step"] = step
            return {**own, "param_state": loaded_part["param_state"],
                    "param_state_sharding_type": _OPTIMIZER_FORMAT["distrib_optim_sharding_type"]}
        state = {k: v for k, v in loaded_part["state"].items() if isinstance(k, int)}
        if step is not None:
            state["common_step"] = step
        return {"state": state, "param_groups": opt.state_dict()["param_groups"]}

    if len(parts) == 1:
        return part(loaded, parts[0])
    return {i: part(loaded[i], opt) for i, opt in enumerate(parts)}


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_training_checkpoint(
    policy: PolicyModel, path: str | Path, step: int, assets_dir: str | Path | None = None
) -> None:
    """Save this rank's share of the training state into ``path`` (call on every rank).

    Args:
        step: optimizer steps taken (restored by :func:`load_training_checkpoint`).
        assets_dir: the source HF folder whose tokenizer/generation files go to
            ``hf_assets/`` (None: none, and an export has no tokenizer).
    """
    from megatron.core import dist_checkpointing

    ckpt = Path(path)
    rank = dist.get_rank()
    if rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
        if any(ckpt.iterdir()):
            raise ValueError(f"checkpoint folder {ckpt} is not empty; save into a new folder")
    dist.barrier()
    state = _sharded_state(policy, is_loading=False)
    state["scheduler"] = policy.scheduler.state_dict()
    state["step"] = step
    dist_checkpointing.save(state, str(ckpt))
    if rank == 0:
        (ckpt / RNG_DIR).mkdir()
        layout = _layout_record(policy)
        (ckpt / LAYOUT_FILE).write_text(
            json.dumps({**layout, "optimizer_step": step}, indent=2) + "\n"
        )
        write_bridge_files(ckpt, policy.bridge, policy.layout.tp, policy.dtype, assets_dir)
        if policy.lora is not None:
            write_lora_file(ckpt, policy.lora)
    dist.barrier()
    rng_file = ckpt / RNG_DIR / f"rank_{rank}.pt"
    torch.save(_rng_state(), rng_file)
    fsync_path(rng_file)
    dist.barrier()
    if rank == 0:
        # The shards are fsynced by dist_checkpointing's writer; this covers the small files
        # written on rank 0 (metadata, common state, layout) and the folders' entries.
        fsync_tree(ckpt)


def _layout_record(policy: PolicyModel) -> dict[str, int]:
    """The parallel layout a checkpoint records: the grid sizes, not this rank's place in it
    (every rank compares its own grid with the saved one to restore its RNG file)."""
    layout = dataclasses.asdict(policy.layout)
    layout.pop("rank")
    return layout


def _check_same_adapters(saved: LoraSpec | None, policy: PolicyModel, ckpt: Path) -> None:
    """A checkpoint loads only into a policy with the LoRA adapters it was saved with (or
    none, as it had none): its adapters and their optimizer state are the training state.

    Raises:
        ValueError: naming what differs and the config that restores it.
    """
    if saved == policy.lora:
        return

    def describe(spec: LoraSpec | None) -> str:
        if spec is None:
            return "no LoRA adapters (policy.megatron_cfg.peft.enabled=false)"
        s = spec.settings
        return (
            f"LoRA adapters dim={s.dim}, alpha={s.alpha}, dropout={s.dropout} "
            f"({s.dropout_position}), A init {s.a_init!r}, dtype {s.dtype} on "
            f"{len(spec.targets)} linears ({spec.targets[0].module_name()}, ...)"
        )

    raise ValueError(
        f"{ckpt} holds {describe(saved)}, but this policy has {describe(policy.lora)}; set "
        "policy.megatron_cfg.peft as the checkpoint was saved, or start a new run"
    )


def load_training_checkpoint(policy: PolicyModel, path: str | Path) -> int:
    """Load a checkpoint written by :func:`save_training_checkpoint` (any TP/PP/DP/EP layout).

    Returns:
        The saved step count.

    Raises:
        FileNotFoundError: ``path`` is not such a checkpoint.
    """
    from megatron.core import dist_checkpointing

    ckpt = Path(path)
    if not (ckpt / LAYOUT_FILE).is_file():
        raise FileNotFoundError(
            f"{ckpt / LAYOUT_FILE} not found: {ckpt} is not a Megatron policy checkpoint"
        )
    saved_layout = json.loads((ckpt / LAYOUT_FILE).read_text())
    _check_same_adapters(read_lora_spec(ckpt), policy, ckpt)
    _init_empty_optimizer_state(policy.optimizer)
    state = _sharded_state(policy, is_loading=True)
    state["scheduler"] = policy.scheduler.state_dict()
    state["step"] = 0
    loaded = dist_checkpointing.load(state, str(ckpt))
    policy.model.module.load_state_dict(loaded["model"], strict=False)
    saved_ep = saved_layout.get("ep", _LAYOUT_DEFAULTS["ep"])
    if policy.bridge.is_moe and (saved_ep > 1) != (policy.layout.ep > 1):
        loaded["optimizer"] = _in_current_split(loaded["optimizer"], policy.optimizer)
    with _keeping_torch_adam_step(policy.optimizer):
        policy.optimizer.load_state_dict(loaded["optimizer"])
    policy.scheduler.load_state_dict(loaded["scheduler"])
    record = _layout_record(policy)
    if all(saved_layout.get(k, _LAYOUT_DEFAULTS.get(k)) == v for k, v in record.items()):
        _set_rng_state(torch.load(ckpt / RNG_DIR / f"rank_{dist.get_rank()}.pt", weights_only=False))
    return int(loaded["step"])
