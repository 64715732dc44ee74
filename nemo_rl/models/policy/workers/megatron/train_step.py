"""Global batches -> micro-batches -> forward/backward -> clip -> optimizer and scheduler step.

One optimizer step per global batch. A rank's share of a global batch is ``gbs / DP`` rows
(plain shards) or the rows between two ``global_batch_offsets`` of its micro-batch plan
(dynamic batching / packing). Before any loss call, the valid tokens and sequences of the WHOLE
global batch are summed over the data-parallel ranks, so the globally normalised micro-batch
losses sum to the global loss however the batch is split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_bridge.parallel_state import collective_device

from nemo_rl.algorithms.loss.interfaces import LossInputType, MetricReduction, metric_reductions
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.sampling import TrainingSamplingParams
from nemo_rl.models.megatron.lm_head import output_layer_returns_hidden, output_weight
from nemo_rl.models.policy.workers.megatron.distillation import (
    distillation_loss_inputs,
    teacher_topk,
)
from nemo_rl.models.policy.workers.megatron.forward import (
    ModelInputs,
    build_model_inputs,
    logprobs_from_hidden,
    logprobs_from_logits,
    rewards_from_outputs,
    run_micro_batches,
    values_from_outputs,
    zero_outside_sampled_set,
)
from nemo_rl.models.policy.workers.megatron.model_setup import PolicyModel
from nemo_rl.models.policy.workers.megatron.moe import (
    per_token_coefficients,
    real_tokens,
    router_loss_metrics,
)


def micro_batches(
    batch: BatchedDataDict, mbs: int, packing_enabled: bool
) -> tuple[list[BatchedDataDict], bool]:
    """The micro-batches of ``batch`` and whether they are to be packed.

    A batch carrying a micro-batch plan is cut by the plan (dynamic: padded micro-batches of
    their planned length; packed: bins); otherwise into ``mbs`` rows each, every micro-batch
    cut to its longest row (:func:`trim_to_longest_row`).

    Raises:
        ValueError: a packing plan while ``sequence_packing.enabled`` is false (the model was
            built without the packed-sequence attention).
    """
    plan = batch.micro_batch_plan
    if plan is None:
        return [trim_to_longest_row(mb) for mb in batch.make_microbatch_iterator(mbs)], False
    if plan.kind == "dynamic":
        return list(batch.make_microbatch_iterator_with_dynamic_shapes()), False
    if not packing_enabled:
        raise ValueError(
            "the batch carries a sequence-packing plan but policy.sequence_packing.enabled is "
            "false; enable it in the policy config (the model needs packed-sequence attention)"
        )
    return list(batch.make_microbatch_iterator_for_packable_sequences()), True


def trim_to_longest_row(mb: BatchedDataDict) -> BatchedDataDict:
    """``mb`` with every per-token tensor (``[b, S, ...]``, ``S`` = ``input_ids``' length) cut
    to ``max(input_lengths)`` positions: the model and the loss see no column that is padding
    in every row. Causal attention makes the kept positions' outputs the same; results are
    padded back to ``S`` where rows are returned (:func:`_score`)."""
    mb.cut_sequences(mb["input_ids"].shape[1], max(int(mb["input_lengths"].max()), 1))
    return mb


def sequence_parallel_size(policy: PolicyModel) -> int:
    """Ranks every model row's tokens are split over between the TP regions: TP under
    sequence parallelism, else 1."""
    return policy.layout.tp if policy.model.module.config.sequence_parallel else 1


def model_inputs(policy: PolicyModel, mbs: list[BatchedDataDict], packed: bool) -> list[ModelInputs]:
    """Model inputs of every micro-batch on this rank (CP-split when CP > 1; rows padded to
    split over TP under sequence parallelism)."""
    from megatron.core import parallel_state

    cp_rank = parallel_state.get_context_parallel_rank()
    device = next(policy.model.parameters()).device
    sp_size = sequence_parallel_size(policy)
    return [
        build_model_inputs(
            {"input_ids": mb["input_ids"].to(device), "input_lengths": mb["input_lengths"]},
            packed,
            policy.layout.cp,
            cp_rank,
            sp_size,
        )
        for mb in mbs
    ]


def split_global_batches(data: BatchedDataDict, gbs: int, dp: int) -> list[BatchedDataDict]:
    """This rank's part of each global batch of ``gbs`` rows (over all DP ranks).

    Raises:
        ValueError: ``gbs`` not a multiple of DP, or a plain shard whose size is not a
            multiple of ``gbs / DP``.
    """
    if data.micro_batch_plan is not None:
        return data.split_global_batches()
    if gbs % dp:
        raise ValueError(f"gbs ({gbs}) must be a multiple of the data-parallel size ({dp})")
    local = gbs // dp
    if data.size % local:
        raise ValueError(
            f"this rank's shard has {data.size} rows, not a multiple of gbs / DP = {local}; "
            f"pass a batch of a whole number of global batches of {gbs}"
        )
    return [data.get_batch(i, local) for i in range(data.size // local)]


def global_valid_counts(batch: BatchedDataDict, dp_group: Any) -> tuple[Tensor, Tensor]:
    """Valid sequences and tokens of the global batch: ``sample_mask`` and
    ``token_mask * sample_mask`` summed over this rank's rows, then over the DP ranks.

    Raises:
        ValueError: ``token_mask`` or ``sample_mask`` missing.
    """
    for key in ("token_mask", "sample_mask"):
        if key not in batch:
            raise ValueError(
                f"training data needs '{key}' ({'[batch, seq]' if key == 'token_mask' else '[batch]'}); "
                f"present keys: {sorted(batch.keys())}"
            )
    sample_mask = batch["sample_mask"].double().cpu()
    counts = torch.stack(
        [sample_mask.sum(), (batch["token_mask"].double().cpu() * sample_mask[:, None]).sum()]
    )
    counts = counts.to(collective_device())
    dist.all_reduce(counts, group=dp_group)
    return counts[0].float(), counts[1].float()


def _share_from_last_stage(payload: dict[str, Any]) -> dict[str, Any]:
    """The last pipeline stage's ``payload`` on every stage of this pipeline."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return payload
    box = [payload]
    dist.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]


def _combine_metric(how: MetricReduction, a: float | None, b: float) -> float:
    """Two micro-batches' values of a metric reduced by ``how``."""
    if a is None:
        return b
    return {MetricReduction.SUM: a + b, MetricReduction.MIN: min(a, b), MetricReduction.MAX: max(a, b)}[how]


def _reduce_over_dp(
    values: dict[str, float], reductions: Mapping[str, MetricReduction], dp_group: Any
) -> dict[str, float]:
    """``values`` of this DP rank reduced over ``dp_group``: summed, or by min / max for the
    keys ``reductions`` names (an extreme over no valid token, +-inf, becomes 0)."""
    keys = sorted(values)
    if not keys:
        return {}
    how = [reductions.get(k, MetricReduction.SUM) for k in keys]
    sums = torch.tensor(
        [values[k] if h == MetricReduction.SUM else 0.0 for k, h in zip(keys, how)],
        dtype=torch.float64,
        device=collective_device(),
    )
    dist.all_reduce(sums, group=dp_group)
    out = dict(zip(keys, sums.tolist()))
    extreme = [(k, h) for k, h in zip(keys, how) if h != MetricReduction.SUM]
    if extreme:  # one MAX all-reduce: a minimum is the negated maximum of the negations
        sign = [-1.0 if h == MetricReduction.MIN else 1.0 for _, h in extreme]
        maxima = torch.tensor(
            [s * values[k] for (k, _), s in zip(extreme, sign)],
            dtype=torch.float64,
            device=collective_device(),
        )
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=dp_group)
        for (k, _), s, m in zip(extreme, sign, maxima.tolist()):
            out[k] = s * m if math.isfinite(m) else 0.0
    return out


def train_global_batch(
    policy: PolicyModel,
    batch: BatchedDataDict,
    loss_fn: Any,
    mbs: int,
    packing_enabled: bool,
    eval_mode: bool,
) -> dict[str, Any]:
    """One optimizer step (or, with ``eval_mode``, only the loss) on this rank's part of a
    global batch.

    Returns:
        ``loss`` (global loss: micro-batch losses summed over micro-batches and DP ranks),
        ``grad_norm`` (global L2 norm before clipping; None in eval mode), ``lr`` (learning
        rate of this step), ``metrics`` (each loss metric summed over micro-batches and DP
        ranks, or reduced by min / max where the loss's ``metric_reductions`` says so; a
        mixture-of-experts model's training step adds its routers' losses
        ``moe/load_balancing_loss`` / ``moe/z_loss``, means as megatron-core logs them, not
        included in ``loss``), ``num_micro_batches`` (this rank's).
    """
    from megatron.core import parallel_state

    trained = (
        LossInputType.LOGPROB, LossInputType.REWARD, LossInputType.VALUE, LossInputType.DISTILLATION
    )
    if loss_fn.input_type not in trained:
        raise ValueError(
            f"the Megatron worker trains losses with input_type LOGPROB, REWARD, VALUE or "
            f"DISTILLATION, got {loss_fn.input_type}; use a logprob-based loss (NLLLoss, "
            "ClippedPGLossFn, DPOLossFn), DistillationLossFn or, with "
            "policy.reward_model_cfg.enabled, PreferenceLossFn or MseValueLossFn"
        )
    dp_group = parallel_state.get_data_parallel_group()
    valid_seqs, valid_toks = global_valid_counts(batch, dp_group)
    mbs_data, packed = micro_batches(batch, mbs, packing_enabled)
    device = next(policy.model.parameters()).device  # the loss meets the logits there
    mbs_data = [mb.to(device) for mb in mbs_data]
    inputs = model_inputs(policy, mbs_data, packed)

    fused = fused_lm_head(policy, loss_fn.input_type)

    def on_logits(index: int, logits: Tensor) -> tuple[Tensor, dict[str, Any]]:
        mb = mbs_data[index]
        if fused:  # the output layer handed back its input: the LM head runs fused here
            logprobs = scored_logprobs(policy, logits, inputs[index], eval_mode)
            scored = {"next_token_logprobs": logprobs}
        else:
            scored = loss_inputs(
                loss_fn, logits, inputs[index], mb, eval_mode, policy.sampling
            )
        if loss_fn.input_type == LossInputType.LOGPROB and policy.sampling.truncates:
            truncated_loss_inputs(
                policy, loss_fn, logits, inputs[index], mb, scored, fused, eval_mode
            )
        loss, metrics = loss_fn(mb, valid_seqs, valid_toks, **scored)
        return loss, {"loss": float(loss.detach()), "metrics": metrics}

    model = policy.model
    model.train(not eval_mode)
    lr = float(policy.optimizer.param_groups[0]["lr"])
    model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    tconfig = model.config
    router_group = parallel_state.get_data_parallel_group()
    shares = policy.layout.cp * sequence_parallel_size(policy)
    with torch.set_grad_enabled(not eval_mode), per_token_coefficients(
        tconfig, [real_tokens(mb) for mb in inputs], shares, router_group
    ), lm_head_mode(policy, fused):
        outputs = run_micro_batches(model, inputs, eval_mode, on_logits)
    grad_norm, router_losses = None, {}
    if not eval_mode:
        router_losses = router_loss_metrics(tconfig, len(inputs))
        _, grad_norm, _ = policy.optimizer.step()
        policy.scheduler.step(increment=1)
        grad_norm = float(grad_norm)
    reductions = {f"metrics/{k}": h for k, h in metric_reductions(loss_fn).items()}
    summed: dict[str, float] = {"loss": sum(o["loss"] for o in outputs)}
    for out in outputs:
        for key, value in out["metrics"].items():
            name = f"metrics/{key}"
            how = reductions.get(name, MetricReduction.SUM)
            summed[name] = _combine_metric(how, summed.get(name), float(value))
    is_last = parallel_state.is_pipeline_last_stage()
    summed = _share_from_last_stage(
        _reduce_over_dp(summed, reductions, dp_group) if is_last else {}
    )
    loss = summed.pop("loss")
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "metrics": {k.removeprefix("metrics/"): v for k, v in summed.items()} | router_losses,
        "num_micro_batches": len(inputs),
    }


def fused_lm_head(policy: PolicyModel, input_type: LossInputType) -> bool:
    """Whether the LM head runs fused with the logprobs (``policy.logprob_chunk_size`` set)
    for outputs of ``input_type``: logprobs only (distillation's top-k and a reward head need
    the model's own outputs)."""
    return policy.logprob_chunk_size is not None and input_type == LossInputType.LOGPROB


def lm_head_mode(policy: PolicyModel, fused: bool) -> Any:
    """The context the micro-batches run in: the output layer hands back its input when
    ``fused``; otherwise nothing changes."""
    return output_layer_returns_hidden(policy.model.module) if fused else nullcontext()


def scored_logprobs(
    policy: PolicyModel,
    hidden: Tensor,
    inputs: ModelInputs,
    inference_only: bool,
    sampling: TrainingSamplingParams | None = None,
) -> Tensor:
    """``[B, S]`` float32 logprobs from the output layer's input ``hidden`` (fused LM head),
    under ``sampling`` (None: the policy's, ``policy.sampling``)."""
    weight, vocab_start = output_weight(policy.model.module)
    return logprobs_from_hidden(
        hidden, weight, vocab_start, inputs, inference_only,
        policy.logprob_chunk_size, policy.sampling if sampling is None else sampling,
    )


def truncated_loss_inputs(
    policy: PolicyModel,
    loss_fn: Any,
    outputs: Tensor,
    inputs: ModelInputs,
    mb: BatchedDataDict,
    scored: dict[str, Tensor],
    fused: bool,
    eval_mode: bool,
) -> None:
    """With top-k / top-p sampling, NeMo RL's handling of a logprob loss's inputs: the
    truncated ``next_token_logprobs`` score 0 outside the kept set
    (:func:`~.forward.zero_outside_sampled_set`), and a loss with a KL penalty gets
    ``curr_logprobs_unfiltered`` in ``mb`` (temperature only, the reference policy's
    distribution)."""
    mask = mb["token_mask"] * mb["sample_mask"][:, None]
    scored["next_token_logprobs"] = zero_outside_sampled_set(
        scored["next_token_logprobs"], mask, "the current logprobs"
    )
    if getattr(getattr(loss_fn, "cfg", None), "loss_kl_penalty", 0.0) == 0.0:
        return
    untruncated = policy.sampling.untruncated()
    if fused:
        mb["curr_logprobs_unfiltered"] = scored_logprobs(
            policy, outputs, inputs, eval_mode, untruncated
        )
    else:
        mb["curr_logprobs_unfiltered"] = logprobs_from_logits(
            outputs, inputs, eval_mode, untruncated
        )


def loss_inputs(
    loss_fn: Any,
    logits: Tensor,
    inputs: ModelInputs,
    mb: BatchedDataDict,
    eval_mode: bool,
    sampling: TrainingSamplingParams,
) -> dict[str, Tensor]:
    """The model outputs ``loss_fn`` takes (by its ``input_type``) from a micro-batch's output:
    ``next_token_logprobs`` ``[B, S]`` (LOGPROB), ``rewards`` ``[B]`` (REWARD: the scalar head
    at each row's last real token), ``values`` ``[B, S]`` (VALUE: the scalar head at each
    token's previous position), or the top-k distillation inputs against the teacher's
    ``teacher_topk_logits`` / ``teacher_topk_indices`` of ``mb`` (DISTILLATION, at
    ``loss_fn.cfg.temperature`` and ``zero_outside_topk``). Logprobs follow ``sampling``."""
    if loss_fn.input_type == LossInputType.DISTILLATION:
        return distillation_loss_inputs(
            logits, inputs, mb, loss_fn.cfg.temperature, loss_fn.cfg.zero_outside_topk
        )
    if loss_fn.input_type == LossInputType.REWARD:
        return {"rewards": rewards_from_outputs(logits, inputs)}
    if loss_fn.input_type == LossInputType.VALUE:
        return {"values": values_from_outputs(logits, inputs)}
    return {
        "next_token_logprobs": logprobs_from_logits(logits, inputs, eval_mode, sampling)
    }


def _score(
    policy: PolicyModel,
    data: BatchedDataDict,
    mbs: int,
    packing_enabled: bool,
    score: Callable[[Tensor, ModelInputs], dict[str, Tensor]],
    fused: bool = False,
) -> dict[str, Tensor] | None:
    """Per-row tensors ``score(logits, inputs)`` of every micro-batch of ``data`` (no grad),
    each ``[b]`` or ``[b, S, ...]`` (cut or zero-padded to ``data``'s ``S``), concatenated in
    row order on the CPU; None off the last pipeline stage. ``fused``: ``score`` gets the
    output layer's input instead of logits (:func:`lm_head_mode`)."""
    from megatron.core import parallel_state

    mbs_data, packed = micro_batches(data, mbs, packing_enabled)
    inputs = model_inputs(policy, mbs_data, packed)

    def on_logits(index: int, logits: Tensor) -> tuple[Tensor, dict[str, Any]]:
        return logits.new_zeros(()), score(logits, inputs[index])

    policy.model.eval()
    with torch.no_grad(), lm_head_mode(policy, fused):
        outputs = run_micro_batches(policy.model, inputs, True, on_logits)
    if not parallel_state.is_pipeline_last_stage():
        return None
    seq = data["input_ids"].shape[1]

    def fit(value: Tensor) -> Tensor:
        value = value.cpu()
        if value.dim() == 1:  # one value per row
            return value
        value = value[:, :seq]
        missing = seq - value.shape[1]
        return torch.cat([value, value.new_zeros(value.shape[0], missing, *value.shape[2:])], 1)

    return {key: torch.cat([fit(out[key]) for out in outputs]) for key in outputs[0]}


def _score_rows(
    policy: PolicyModel,
    data: BatchedDataDict,
    mbs: int,
    packing_enabled: bool,
    score: Callable[[Tensor, ModelInputs], Tensor],
    fused: bool = False,
) -> Tensor | None:
    """:func:`_score` of one per-row tensor ``score(outputs, inputs)``; None off the last
    pipeline stage."""
    out = _score(policy, data, mbs, packing_enabled, lambda o, i: {"rows": score(o, i)}, fused)
    return None if out is None else out["rows"]


def compute_logprobs(
    policy: PolicyModel,
    data: BatchedDataDict,
    mbs: int,
    packing_enabled: bool,
    reference: bool = False,
) -> Tensor | None:
    """``[B, S]`` float32 logprobs of ``data`` in its row order (no grad), under the engines'
    sampling distribution (``policy.sampling``); ``reference``: the reference policy's pass,
    temperature only (another model's top-k / top-p set need not hold the samples).

    Returns:
        The logprobs on the last pipeline stage, None on the others.
    """

    fused = fused_lm_head(policy, LossInputType.LOGPROB)
    sampling = policy.sampling.untruncated() if reference else policy.sampling

    def score(outputs: Tensor, inputs: ModelInputs) -> Tensor:
        if fused:
            return scored_logprobs(policy, outputs, inputs, True, sampling)
        return logprobs_from_logits(outputs, inputs, True, sampling).float()

    rows = _score_rows(policy, data, mbs, packing_enabled, score, fused)
    if rows is None or not sampling.truncates:
        return rows
    scored = "token_mask" in data and "sample_mask" in data  # training data: count the outliers
    mask = data["token_mask"] * data["sample_mask"][:, None] if scored else None
    return zero_outside_sampled_set(rows, mask, "the previous logprobs")


def compute_topk_logits(
    policy: PolicyModel, data: BatchedDataDict, mbs: int, k: int, temperature: float
) -> dict[str, Tensor] | None:
    """``topk_logits`` (float32 logprobs at ``temperature``) and ``topk_indices`` (int64),
    ``[B, S, k]`` each, of ``data`` in its row order (no grad; see
    :func:`~nemo_rl.models.policy.workers.megatron.distillation.teacher_topk`); None off the
    last pipeline stage."""

    def score(logits: Tensor, inputs: ModelInputs) -> dict[str, Tensor]:
        values, ids = teacher_topk(logits, inputs, k, temperature)
        return {"topk_logits": values, "topk_indices": ids}

    return _score(policy, data, mbs, False, score)


def compute_rewards(
    policy: PolicyModel, data: BatchedDataDict, mbs: int, packing_enabled: bool
) -> Tensor | None:
    """``[B]`` float32 rewards of ``data``'s rows (a reward model's scalar head at each row's
    last real token), in row order, no grad.

    Returns:
        The rewards on the last pipeline stage, None on the others.
    """

    return _score_rows(policy, data, mbs, packing_enabled, rewards_from_outputs)


def compute_values(
    policy: PolicyModel, data: BatchedDataDict, mbs: int, packing_enabled: bool
) -> Tensor | None:
    """``[B, S]`` float32 per-token values of ``data`` (a critic's scalar head at each
    token's previous position, :func:`~.forward.values_from_outputs`), in row order, no grad.

    Returns:
        The values on the last pipeline stage, None on the others.
    """
    return _score_rows(policy, data, mbs, packing_enabled, values_from_outputs)


def iterate_steps(
    policy: PolicyModel,
    data: BatchedDataDict,
    loss_fn: Any,
    gbs: int,
    mbs: int,
    packing_enabled: bool,
    eval_mode: bool,
) -> Iterator[dict[str, Any]]:
    """:func:`train_global_batch` over every global batch of ``data``, in order."""
    for batch in split_global_batches(data, gbs, policy.layout.dp):
        yield train_global_batch(policy, batch, loss_fn, mbs, packing_enabled, eval_mode)
