"""The tiny GRPO run the functional tests share: tiny Llama, 4 prompts x 2 generations,
float32, 64-token sequences, a local 8-CPU Ray (or 8 CPUs per node of a running cluster); and
the greedy continuations of a saved policy folder, the reference for what an exported
checkpoint generates. Importable as ``tiny_grpo``."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.grpo import grpo_train, setup
from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.grpo_step.components import GRPOComponents
from nemo_rl.algorithms.rollout_run import shutdown
from nemo_rl.distributed.ray_bootstrap import ray_cluster
from nemo_rl.utils.config import load_typed_config
from nemo_rl.utils.logger import read_metrics_jsonl


def tiny_grpo_config(
    log_dir: Path,
    model: Path,
    *,
    grpo: dict[str, Any] | None = None,
    colocated: bool = True,
    tensor_parallel: int = 1,
    num_nodes: int = 1,
    **sections: Any,
) -> GRPOMasterConfig:
    """The tiny run logging to ``log_dir``; ``grpo`` keys override the loop's, ``sections``
    add whole top-level sections (``sft_warmup``, ``checkpointing``, ``data_plane``...).
    The policy's TP size ``tensor_parallel`` spans that many CPU bundles, split evenly over
    ``num_nodes`` nodes; each node's bundles run one vLLM engine (TP = bundles per node)."""
    per_node = tensor_parallel // num_nodes
    return GRPOMasterConfig.model_validate(
        {
            "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2, **(grpo or {})},
            "policy": {
                "model_name": str(model),
                "train_global_batch_size": 8,
                "train_micro_batch_size": 4,
                "logprob_batch_size": 4,
                "max_total_sequence_length": 64,
                "precision": "float32",
                "megatron_cfg": {"optimizer": {"lr": 1e-4, "min_lr": 1e-4},
                                 "tensor_model_parallel_size": tensor_parallel},
                "generation": {
                    "max_new_tokens": 8,
                    "colocated": {"enabled": colocated},
                    "vllm_cfg": {
                        "precision": "float32", "max_model_len": 64,
                        "kv_cache_memory_bytes": 16 * 1024**2, "enforce_eager": True,
                        "tensor_parallel_size": per_node,
                    },
                },
            },
            "cluster": {
                "cpus_per_node": 8, "num_nodes": num_nodes, "cpu_bundles_per_node": per_node,
            },
            "logger": {"log_dir": str(log_dir), "console_enabled": False},
            **sections,
        }
    )


# The SFT warm start of the runs that start from warm-started weights: the KL penalty then
# anchors to them, and the first GRPO step's on-policy checks show they reached the engines.
WARMUP = {"enabled": True, "num_steps": 4, "log_period": 2}
# Steps of the shared warm-started run (``warm_colocated_run`` in the root conftest).
WARM_RUN_STEPS = 3


def warm_started_config(
    root: Path, model: Path, steps: int, *, warmup: bool = True, **checkpointing: Any
) -> GRPOMasterConfig:
    """The tiny colocated run under ``root`` (``logs``, ``ckpt``) for ``steps`` steps, keeping
    every checkpoint (``checkpointing`` keys override), after the WARMUP unless ``warmup`` is
    False."""
    ckpt = {"enabled": True, "keep_top_k": None, "checkpoint_dir": str(root / "ckpt")}
    return tiny_grpo_config(
        root / "logs", model, grpo={"max_num_steps": steps},
        checkpointing={**ckpt, **checkpointing}, **({"sft_warmup": WARMUP} if warmup else {}),
    )


def run_grpo(
    cfg: GRPOMasterConfig, on_setup: Callable[[GRPOComponents], None] | None = None
) -> dict[str, float]:
    """Set up, train and tear down (components, then the local Ray unless one was running
    before, e.g. the ``local_ray_8cpu`` fixture's) one GRPO run; its final metrics.
    ``on_setup`` sees the components before training (to ask the workers where they run)."""
    with ray_cluster(num_cpus=cfg.cluster.cpus_per_node):
        components = setup(cfg)
        try:
            if on_setup is not None:
                on_setup(components)
            return grpo_train(components)
        finally:
            shutdown(components)


def run_recipe_cut(
    recipe: Path,
    steps: int,
    log_dir: Path,
    overrides: Sequence[str] = (),
    on_setup: Callable[[GRPOComponents], None] | None = None,
) -> list[dict[str, Any]]:
    """Run the GRPO ``recipe`` for ``steps`` steps, validating at the start and at the end, no
    checkpoints, logging only to ``log_dir``, then the command-line ``overrides`` (which win);
    its metric records. ``on_setup`` as in :func:`run_grpo`."""
    cfg = load_typed_config(
        recipe,
        [
            f"grpo.max_num_steps={steps}",
            f"grpo.val_period={steps}",
            "checkpointing.enabled=false",
            f"logger.log_dir={log_dir}",
            "logger.console_enabled=false",
            "logger.tensorboard_enabled=false",
            *overrides,
        ],
        GRPOMasterConfig,
    )
    run_grpo(cfg, on_setup)
    return read_metrics_jsonl(log_dir / "metrics.jsonl")


def sigterm_after_first_step(log_dir: Path) -> threading.Thread:
    """A started thread that sends this process SIGTERM once the run logging to ``log_dir``
    has logged its first train step (within 600 s); join it after the run."""

    def send() -> None:
        metrics = log_dir / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if metrics.is_file() and '"prefix": "train"' in metrics.read_text():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.2)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def assert_same_steps(
    resumed: dict[int, dict[str, float]], expected: dict[int, dict[str, float]], steps: range
) -> None:
    """``resumed``'s loss, grad norm and reward (:func:`train_records`) are ``expected``'s at
    every step of ``steps``, up to float round-off."""
    for step in steps:
        for name in ("loss", "grad_norm", "reward"):
            assert resumed[step][name] == pytest.approx(expected[step][name], rel=1e-5, abs=1e-6), (
                step, name
            )


def by_prefix(records: list[dict[str, Any]], prefix: str) -> dict[int, dict[str, float]]:
    """``{step: metrics}`` of the metric ``records`` logged under ``prefix``."""
    return {r["step"]: r["metrics"] for r in records if r["prefix"] == prefix}


def train_records(log_dir: Path) -> dict[int, dict[str, float]]:
    """``{step: metrics}`` of the ``train`` records in ``log_dir/metrics.jsonl``."""
    return by_prefix(read_metrics_jsonl(log_dir / "metrics.jsonl"), "train")


def megatron_greedy(
    policy_dir: Path, prompts: list[torch.Tensor], eos: int, max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuations (at most ``max_new_tokens``, through the first ``eos``) of the
    Megatron model loaded from a saved policy folder, in this process at TP=PP=1."""
    from megatron_bridge.checkpoint import load_megatron_checkpoint
    from megatron_bridge.forward import megatron_logits
    from megatron_bridge.parallel_state import (
        destroy_megatron_parallel,
        find_free_port,
        initialize_megatron_parallel,
    )

    initialize_megatron_parallel(0, 1, tp=1, pp=1, master_port=find_free_port())
    try:
        model, bridge = load_megatron_checkpoint(policy_dir)
        out = []
        for ids in prompts:
            new: list[int] = []
            while len(new) < max_new_tokens and (not new or new[-1] != eos):
                seq = torch.cat([ids, torch.tensor(new, dtype=torch.long)])
                with torch.no_grad():
                    logits = megatron_logits(model, seq.unsqueeze(0), bridge.vocab_size)[0]
                new.append(int(logits[-1].argmax()))
            out.append(new)
        return out
    finally:
        destroy_megatron_parallel()
