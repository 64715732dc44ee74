"""Mixture-of-experts parts of a policy rank: router settings, router freezing, and the
routers' auxiliary losses (load balancing, z-loss) in the training step and its metrics.

megatron-core computes the auxiliary losses inside each router and adds their gradient through
``MoEAuxLossAutoScaler``; with ``calculate_per_token_loss`` (our setting) every micro-batch's
aux loss is weighted by its token count and megatron expects the finalisation to divide every
gradient by the global token count. Our losses are globally normalised already, so
:func:`finalize_grads` divides nothing: :func:`per_token_coefficients` puts that division
into the coefficients for the step instead. The gradient is then megatron's: the
token-weighted mean of the micro-batches' aux losses times the configured coefficient.

Padding is no token: the model is called with each micro-batch's padding mask
(:attr:`~nemo_rl.models.policy.workers.megatron.forward.ModelInputs.padding_mask`), so the
routers' losses and their token counts cover the real tokens only, whatever padding a layout
adds (the trimmed micro-batch's longest row, the multiple of ``2 * CP`` or TP). Counted
with the padding, the losses changed with the layout's padding, and the padding tokens'
gradient reached the pad token's embedding row through the first norm, amplified by
``1 / sqrt(eps)`` where that row is zero (grad norm 1930 instead of 19.9 on the tiny test
model at TP=2 with sequence parallelism).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_bridge.parallel_state import collective_device
from nemo_rl.models.policy.workers.megatron.forward import ModelInputs

if TYPE_CHECKING:
    from megatron_bridge import BridgeConfig
    from nemo_rl.models.policy.config import MegatronConfig

# megatron-core's tracker names of the router losses -> our metric names.
AUX_LOSS_METRICS = {
    "load_balancing_loss": "moe/load_balancing_loss",
    "seq_load_balancing_loss": "moe/load_balancing_loss",
    "z_loss": "moe/z_loss",
}


def aux_loss_coeff(mcfg: MegatronConfig, bridge: BridgeConfig) -> float:
    """``moe_aux_loss_coeff``, or the checkpoint's ``router_aux_loss_coef`` (0 without one)."""
    if mcfg.moe_aux_loss_coeff is not None:
        return mcfg.moe_aux_loss_coeff
    return float(bridge.hf_config.get("router_aux_loss_coef") or 0.0)


def moe_overrides(mcfg: MegatronConfig, bridge: BridgeConfig) -> dict[str, Any]:
    """``TransformerConfig`` fields of the router's training settings from ``megatron_cfg``
    (the bridge's own are for inference: no aux loss); none for a dense model."""
    if not bridge.is_moe:
        return {}
    return dict(
        moe_router_dtype=mcfg.moe_router_dtype,
        moe_router_load_balancing_type=mcfg.moe_router_load_balancing_type,
        moe_aux_loss_coeff=aux_loss_coeff(mcfg, bridge),
        moe_z_loss_coeff=mcfg.moe_z_loss_coeff,
    )


def freeze_routers(model: torch.nn.Module) -> int:
    """Turn off gradients of every router parameter of ``model`` (before DDP wraps it, so
    neither gradient buffers nor optimizer state are made for them); returns how many."""
    from megatron.core.transformer.moe.router import Router

    frozen = 0
    for module in model.modules():
        if isinstance(module, Router):
            for param in module.parameters():
                param.requires_grad_(False)
                frozen += 1
    return frozen


def _has_router_losses(config: Any) -> bool:
    balancing = config.moe_router_load_balancing_type != "none" and config.moe_aux_loss_coeff
    return bool(config.num_moe_experts and (balancing or config.moe_z_loss_coeff))


def real_tokens(inputs: ModelInputs) -> int:
    """Real (non-padding) tokens of a micro-batch, all CP and TP shares together."""
    return int(inputs.lengths.sum())


@contextmanager
def per_token_coefficients(
    config: Any, micro_batch_tokens: Sequence[int], shares: int, group: Any
) -> Iterator[None]:
    """Divide the aux-loss and z-loss coefficients of ``config`` by the real tokens the
    routers see in the whole global batch for the duration of one step (see the module
    docstring).

    Args:
        config: the model's megatron ``TransformerConfig`` (the routers read it each forward).
        micro_batch_tokens: real tokens of each of this rank's micro-batches
            (:func:`real_tokens`; the model is called with their padding mask).
        shares: the ranks a micro-batch's rows are split over: CP x TP under sequence
            parallelism, else CP.
        group: the data-parallel group (without CP) the tokens are summed over.

    With the padding mask, megatron-core 0.16.1 weights every rank's part of a micro-batch's
    load-balancing loss by the micro-batch's real tokens (all shares: its "local" count is
    all-reduced in place over TP x CP), and each rank's z-loss by the rank's own real tokens
    with the coefficient divided by the TP x CP ranks. The router's gradient is summed over
    the CP ranks (DDP) and, under sequence parallelism, the TP ranks. Dividing the aux-loss
    coefficient by the real tokens and the z-loss coefficient by the real tokens over
    ``shares`` gives every layout the CP=1, TP=1 gradient (``test_moe_layouts``).
    """
    if not _has_router_losses(config):
        yield
        return
    total = torch.tensor(float(sum(micro_batch_tokens)), device=collective_device())
    dist.all_reduce(total, group=group)
    aux, z_loss = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    config.moe_aux_loss_coeff = aux / float(total)
    if z_loss:
        config.moe_z_loss_coeff = z_loss * shares / float(total)
    try:
        yield
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = aux, z_loss


def router_loss_metrics(config: Any, num_micro_batches: int) -> dict[str, float]:
    """The routers' losses of the step just run, as megatron-core logs them: each loss (without
    its coefficient) averaged over the MoE layers, this rank's micro-batches and the DP ranks;
    the tracker is cleared. Collective over the model's ranks; {} when no loss is on.

    Returns:
        ``moe/load_balancing_loss`` and/or ``moe/z_loss`` (dimensionless).
    """
    if not _has_router_losses(config):
        return {}
    from megatron.core.transformer.moe.moe_utils import (
        get_moe_layer_wise_logging_tracker,
        track_moe_metrics,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    names = []
    if config.moe_router_load_balancing_type != "none" and config.moe_aux_loss_coeff:
        names.append(
            "seq_load_balancing_loss"
            if config.moe_router_load_balancing_type == "seq_aux_loss"
            else "load_balancing_loss"
        )
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    for name in names:  # a stage without MoE layers, or an eval step, still joins the reduction
        if name not in tracker:
            tracker[name] = {
                "values": torch.zeros(config.num_layers, device=collective_device()),
                "reduce_group": None,
                "avg_group": None,
                "reduce_group_has_dp": False,
            }
    from megatron.core import parallel_state

    for name in names:  # losses megatron does not reduce itself (the z-loss): each rank's is
        # the mean over its tokens (a CP or sequence-parallel share), so average over them all
        if tracker[name]["reduce_group"] is None:
            tracker[name]["avg_group"] = parallel_state.get_tensor_and_data_parallel_group(
                with_context_parallel=True
            )
    totals: dict[str, torch.Tensor] = {}
    track_moe_metrics(
        loss_scale=1.0 / max(num_micro_batches, 1),
        iteration=0,
        total_loss_dict=totals,
        track_names=names,
        num_layers=config.num_layers,
        moe_layer_freq=config.moe_layer_freq,
    )
    return {AUX_LOSS_METRICS[name]: float(totals[name]) for name in names}
