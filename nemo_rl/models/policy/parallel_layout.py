"""How a policy's ranks split into PP x DP x CP x TP (and the experts' EP), checked before any
actor starts.

Every check names the config field that breaks it, so a bad recipe fails when the config is
validated (``GRPOMasterConfig`` runs :func:`plan_parallel_layout` with the cluster section's
ranks) instead of inside a Ray actor minutes later (or, for grouped-query attention with fewer
KV heads than TP ranks, silently wrong). The driver runs it again with the ranks it got.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_bridge import BridgeConfig
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.peft import lora_targets

_MCFG = "policy.megatron_cfg"


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the four parallel axes; their product is the policy's world size (ranks)."""

    pp: int
    dp: int
    cp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def axes(self) -> dict[str, int]:
        """Axis sizes outermost first, the order :class:`RayWorkerGroup` lays ranks out in."""
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}


def plan_parallel_layout(
    cfg: PolicyConfig,
    model_path: str | Path | None,
    world_size: int,
    *,
    world_source: str = "the cluster size",
) -> ParallelLayout:
    """Derive DP from the world size and check the whole layout against the model and batches.

    Args:
        cfg: the validated policy config.
        model_path: local HF checkpoint folder (its config.json gives heads and layers); None
            skips the model checks (a hub model not downloaded yet).
        world_size: ranks the policy gets (bundles of its cluster).
        world_source: the config fields ``world_size`` comes from, named in the fix.

    Raises:
        ValueError: naming the field and the fix, for: world size not a multiple of
            TP*PP*CP or of TP*EP*PP (megatron-core takes the expert-parallel ranks out of
            DP x CP); heads, KV heads, FFN size or layers not divisible (KV heads < TP);
            experts not divisible by EP, EP > 1 on a dense model, a mixture-of-experts model
            at TP > 1 without sequence parallelism (megatron-core refuses to train it); CP
            with lengths that cannot split into 2*CP chunks; global batch not divisible into
            DP x micro-batches; LoRA targets the model lacks
            (:func:`~nemo_rl.models.policy.peft.lora_targets`).
    """
    mcfg = cfg.megatron_cfg
    tp = mcfg.tensor_model_parallel_size
    pp = mcfg.pipeline_model_parallel_size
    cp = mcfg.context_parallel_size
    ep = mcfg.expert_model_parallel_size
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ValueError(
            f"the policy has {world_size} ranks, not a multiple of {_MCFG}.tensor_model_parallel_size"
            f" x pipeline_model_parallel_size x context_parallel_size = {tp} x {pp} x {cp} = "
            f"{model_parallel}; change those sizes or {world_source}"
        )
    if world_size % (tp * ep * pp):
        raise ValueError(
            f"the policy has {world_size} ranks, not a multiple of {_MCFG}."
            f"tensor_model_parallel_size x expert_model_parallel_size x "
            f"pipeline_model_parallel_size = {tp} x {ep} x {pp} = {tp * ep * pp} (the "
            f"expert-parallel ranks come out of the data- and context-parallel ones); change "
            f"those sizes or {world_source}"
        )
    if model_path is not None:
        bridge = BridgeConfig.from_hf(model_path)
        try:
            bridge.validate_parallelism(tp, pp, ep)
        except ValueError as err:
            raise ValueError(
                f"{_MCFG}.tensor_model_parallel_size={tp} / pipeline_model_parallel_size={pp} "
                f"/ expert_model_parallel_size={ep} do not fit the model at {model_path}: {err}"
            ) from None
        if mcfg.peft.enabled:
            lora_targets(mcfg.peft, bridge, str(model_path))
        if bridge.is_moe and tp > 1 and not mcfg.sequence_parallel:
            raise ValueError(
                f"{_MCFG}.tensor_model_parallel_size={tp} on the mixture-of-experts model at "
                f"{model_path} needs {_MCFG}.sequence_parallel=true (megatron-core trains MoE "
                f"layers under TP only with sequence parallelism); set it, or use "
                f"expert_model_parallel_size instead of TP"
            )
    if cp > 1:
        _check_context_parallel_lengths(cfg, cp)
    dp = world_size // model_parallel
    _check_batch_sizes(cfg, dp)
    return ParallelLayout(pp=pp, dp=dp, cp=cp, tp=tp)


def _check_context_parallel_lengths(cfg: PolicyConfig, cp: int) -> None:
    """CP splits each sequence into 2*CP equal chunks, so every padded length must divide."""
    chunks = 2 * cp
    if cfg.max_total_sequence_length % chunks:
        raise ValueError(
            f"policy.max_total_sequence_length ({cfg.max_total_sequence_length}) must be a "
            f"multiple of 2 x {_MCFG}.context_parallel_size = {chunks}"
        )
    if cfg.dynamic_batching.enabled and cfg.dynamic_batching.sequence_length_round % chunks:
        raise ValueError(
            f"policy.dynamic_batching.sequence_length_round "
            f"({cfg.dynamic_batching.sequence_length_round}) must be a multiple of 2 x "
            f"{_MCFG}.context_parallel_size = {chunks}"
        )


def _check_batch_sizes(cfg: PolicyConfig, dp: int) -> None:
    """Each optimizer step gives every DP rank gbs/DP samples in whole micro-batches."""
    gbs, mbs = cfg.train_global_batch_size, cfg.train_micro_batch_size
    if gbs % dp:
        raise ValueError(
            f"policy.train_global_batch_size ({gbs}) must be a multiple of the data-parallel "
            f"size ({dp} = ranks / (TP x PP x CP))"
        )
    uses_token_budget = cfg.dynamic_batching.enabled or cfg.sequence_packing.enabled
    if not uses_token_budget and (gbs // dp) % mbs:
        raise ValueError(
            f"policy.train_global_batch_size / DP = {gbs} / {dp} = {gbs // dp} samples per rank "
            f"must be a multiple of policy.train_micro_batch_size ({mbs})"
        )
