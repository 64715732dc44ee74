"""The run of an algorithm that trains the policy on fixed data with one loss: SFT, DPO, RM.

:func:`setup` builds a run (tokenizer, the algorithm's datasets, the resumable loader,
validation batches, Ray, the policy's cluster, the policy, logger, checkpoints);
:func:`train` runs the shared :func:`~nemo_rl.algorithms.training_loop.train_loop` with
:func:`train_step` and :func:`validate`; :func:`run_command` is a command's body after set-up
(train, shut down, report).

A step takes one batch of ``train_global_batch_size`` samples (a sample is
``rows_per_sample`` rows: 1 for SFT, a chosen and a rejected row for DPO and RM), flattens its
conversations (loss on assistant tokens only), adds the reference policy's logprobs when the
loss needs them and makes one optimizer step. Validation runs the same loss without updates
(``eval_mode``) on each validation batch (the last one padded with masked rows) and reports
the metrics over the whole validation set (means over its samples, counts summed).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from nemo_rl.algorithms import training_loop
from nemo_rl.algorithms.loop_config import SupervisedLoopConfig, SupervisedMasterConfig
from nemo_rl.data.llm_message_utils import message_logs_to_flat
from nemo_rl.algorithms.training_loop import LoopParts, Metrics
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.utils.run_stop import RunStopped


@dataclass(frozen=True)
class SupervisedAlgorithm:
    """What distinguishes one supervised algorithm from another.

    Attributes:
        section: the recipe's loop section (``sft``, ``dpo``, ``rm``), a :class:`SupervisedLoopConfig`.
        loss_fn: the loss (``NLLLoss``, ``DPOLossFn``).
        rows_per_sample: policy rows per sample of ``train_global_batch_size``.
        needs_reference: the loss reads ``reference_policy_logprobs``.
        plot_curves: ``(prefix, metric)`` of the two curves of the end-of-run plot.
    """

    section: str
    loss_fn: Any
    rows_per_sample: int
    needs_reference: bool
    plot_curves: tuple[tuple[str, str], tuple[str, str]]


@dataclass
class SupervisedRun:
    """Everything a supervised run holds (built by :func:`setup`)."""

    cfg: SupervisedMasterConfig
    algorithm: SupervisedAlgorithm
    pad_token_id: int
    policy: Any
    cluster: Any
    train_loader: Any
    val_batches: list[BatchedDataDict]
    logger: Any
    timer: Any
    checkpointer: Optional[Any]
    max_num_steps: int

    @property
    def loop(self) -> SupervisedLoopConfig:
        """The run's loop section (``sft``, ``dpo`` or ``rm``)."""
        return getattr(self.cfg, self.algorithm.section)

    def loop_parts(self) -> LoopParts:
        """What the shared training loop reads of the run."""
        return training_loop.loop_parts(self, self.loop, self.max_num_steps)


def validation_batches(
    dataset: Sequence[Any] | None,
    loop: SupervisedLoopConfig,
    collate_fn: Callable[[list[Any]], BatchedDataDict],
    section: str,
) -> list[BatchedDataDict]:
    """The first ``val_batches`` batches of ``val_global_batch_size`` samples of ``dataset``
    (every sample when ``val_batches`` is 0); none without validation.

    A last, partial batch is padded to a whole one (the layout the policy's data-parallel
    split and micro-batches need) with copies of its first sample whose rows have
    ``loss_multiplier`` 0: the losses mask them out of every sum and count.
    """
    if dataset is None or not loop.validates or len(dataset) == 0:
        return []
    size = loop.val_global_batch_size
    count = -(-len(dataset) // size)
    if loop.val_batches:
        count = min(count, loop.val_batches)
    batches = []
    for b in range(count):
        samples = [dataset[i] for i in range(b * size, min((b + 1) * size, len(dataset)))]
        real = len(samples)
        batch = collate_fn(samples + [samples[0]] * (size - real))
        rows_per_sample = len(batch["loss_multiplier"]) // size
        batch["loss_multiplier"][real * rows_per_sample :] = 0.0
        batches.append(batch)
    return batches


def load_tokenizer(cfg: SupervisedMasterConfig) -> tuple[Any, int]:
    """The tokenizer of ``policy.model_name`` (with ``policy.tokenizer.chat_template`` when set)
    and its pad token id (else EOS).

    Raises:
        ModelNotFoundError: ``policy.model_name`` names no model here or on the hub.
    """
    from transformers import AutoTokenizer

    from nemo_rl.models.model_path import resolve_model_path

    model_path = resolve_model_path(cfg.policy.model_name, field="policy.model_name")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if cfg.policy.tokenizer.chat_template is not None:
        tokenizer.chat_template = cfg.policy.tokenizer.chat_template
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return tokenizer, pad


def check_inputs(
    cfg: SupervisedMasterConfig,
    load_datasets: Callable[[Any], tuple[Sequence[Any], Sequence[Any] | None]],
) -> None:
    """The reads of :func:`setup` before Ray starts, for ``nemo-rl launch slurm``: the
    tokenizer and every row when the model is here (a local folder, a tiny model, a cached hub
    snapshot); otherwise the local data files are parsed (their rows are checked on the cluster,
    with the tokenizer).

    Raises:
        DataError: a line that does not parse, a row without a field the algorithm reads.
    """
    from nemo_rl.data.files import read_data_file
    from nemo_rl.models.model_path import local_model_path

    if local_model_path(cfg.policy.model_name) is not None:
        load_datasets(load_tokenizer(cfg)[0])
        return
    for source in (cfg.data.train_path, cfg.data.val_path):
        if source is not None and Path(source).is_file():
            read_data_file(Path(source))


def setup(
    cfg: SupervisedMasterConfig,
    algorithm: SupervisedAlgorithm,
    load_datasets: Callable[[Any], tuple[Sequence[Any], Sequence[Any] | None]],
    collate_fn: Callable[[list[Any]], BatchedDataDict],
) -> SupervisedRun:
    """Data, Ray, the policy's cluster, the policy, logger and checkpoints of a run.

    Args:
        load_datasets: ``tokenizer -> (train set, validation set or None)``.
        collate_fn: a list of samples -> one batch of conversations.

    Raises:
        ConfigError: before Ray starts, when the latest checkpoint was trained on another model
            or data than ``cfg`` names.
    """
    from nemo_rl.data.dataloader import StatefulPromptLoader
    from nemo_rl.distributed.ray_bootstrap import init_ray, shutdown_ray
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.models.policy.lm_policy import Policy
    from nemo_rl.utils.logger import Logger
    from nemo_rl.utils.timer import Timer

    loop: SupervisedLoopConfig = getattr(cfg, algorithm.section)
    checkpointer = training_loop.open_checkpointer(cfg)
    tokenizer, pad = load_tokenizer(cfg)
    train_set, val_set = load_datasets(tokenizer)
    gbs = cfg.policy.train_global_batch_size
    loader = StatefulPromptLoader(
        train_set, gbs, seed=loop.seed, shuffle=cfg.data.shuffle, collate_fn=collate_fn
    )
    val_batches = validation_batches(val_set, loop, collate_fn, algorithm.section)

    c = cfg.cluster
    # Under `nemo-rl launch` (RAY_ADDRESS set) the cluster exists and has its own CPU count.
    local_cpus = c.cpus_per_node if c.gpus_per_node == 0 else None
    init_ray(num_cpus=None if os.environ.get("RAY_ADDRESS") else local_cpus)
    use_gpus = c.gpus_per_node > 0
    per_node = c.gpus_per_node if use_gpus else c.cpu_bundles_per_node
    cluster = None
    try:
        cluster = RayVirtualCluster(
            [per_node] * c.num_nodes, use_gpus, c.cpus_per_node / 2 / per_node, name="policy"
        )
        policy = Policy(
            cluster, cfg.policy, init_reference_model=algorithm.needs_reference, seed=loop.seed
        )
    except BaseException:  # a failed start leaves neither bundles nor its init_ray behind
        if cluster is not None:
            cluster.shutdown()
        shutdown_ray()
        raise
    logger = Logger(cfg.logger)
    logger.log_hyperparams(cfg.model_dump())
    return SupervisedRun(
        cfg=cfg,
        algorithm=algorithm,
        pad_token_id=pad,
        policy=policy,
        cluster=cluster,
        train_loader=loader,
        val_batches=val_batches,
        logger=logger,
        timer=Timer(),
        checkpointer=checkpointer,
        max_num_steps=min(loop.max_num_steps, loop.max_num_epochs * loader.batches_per_epoch),
    )


def sft_train_data(batch: BatchedDataDict, pad_token_id: int) -> BatchedDataDict:
    """Training data of NLL on the assistant tokens of a collated batch of conversations.

    Args:
        batch: :func:`~nemo_rl.data.llm_message_utils.rl_collate_fn` output (``message_log``,
            ``loss_multiplier`` ``[B]``).
        pad_token_id: fills ``input_ids`` past each row's length.

    Returns:
        ``input_ids`` ``[B, S]``, ``input_lengths`` ``[B]``, ``token_mask`` ``[B, S]`` (1 on
        assistant tokens) and ``sample_mask`` ``[B]`` (0 for truncated rows).
    """
    flat = message_logs_to_flat(batch["message_log"], pad_token_id)
    return BatchedDataDict(
        input_ids=flat["input_ids"],
        input_lengths=flat["input_lengths"],
        token_mask=flat["token_mask"].float(),
        sample_mask=batch["loss_multiplier"].float(),
    )


def policy_data(run: SupervisedRun, batch: BatchedDataDict) -> BatchedDataDict:
    """The loss's data of a collated batch: flattened rows (``input_ids``, ``input_lengths``,
    ``token_mask`` on assistant tokens, ``sample_mask``) plus, when the loss needs them,
    ``reference_policy_logprobs`` ``[B, S]``."""
    data = sft_train_data(batch, run.pad_token_id)
    if run.algorithm.needs_reference:
        with run.timer.time("reference_logprobs"):
            ref = run.policy.get_reference_policy_logprobs(data)
        data["reference_policy_logprobs"] = ref["reference_logprobs"]
    return data


def _step_metrics(results: dict[str, Any], index: int) -> Metrics:
    """Metrics of optimizer step ``index`` of a :meth:`Policy.train` result."""
    metrics = {name: float(values[index]) for name, values in results["metrics"].items()}
    metrics["loss"] = float(results["loss"][index])
    return metrics


def train_step(run: SupervisedRun, batches: Iterator[BatchedDataDict]) -> Metrics:
    """One optimizer step on the next batch; returns the loss's metrics, ``grad_norm`` and
    ``lr``."""
    rows = run.algorithm.rows_per_sample
    with run.timer.time("data"):
        batch = next(batches)
    data = policy_data(run, batch)
    with run.timer.time("policy_training"):
        results = run.policy.train(
            data,
            run.algorithm.loss_fn,
            gbs=rows * run.cfg.policy.train_global_batch_size,
            mbs=rows * run.cfg.policy.train_micro_batch_size,
        )
    metrics = _step_metrics(results, 0)
    metrics["grad_norm"] = float(results["grad_norm"][0])
    metrics["lr"] = float(results["lr"][0])
    return metrics


def validate(run: SupervisedRun) -> Metrics:
    """The loss's metrics on every validation batch (no update), over the whole validation
    set: each mean weighted by its batch's valid samples (valid tokens for a token-level
    loss, SFT's), so it is the mean over every sample (token); counts (``num_*``) summed."""
    from nemo_rl.algorithms.loss.interfaces import LossType

    rows = run.algorithm.rows_per_sample
    token_level = run.algorithm.loss_fn.loss_type == LossType.TOKEN_LEVEL
    weight_name = "num_unmasked_tokens" if token_level else "num_valid_samples"
    per_batch: list[Metrics] = []
    with run.timer.time("validation"):
        for batch in run.val_batches:
            results = run.policy.train(
                policy_data(run, batch),
                run.algorithm.loss_fn,
                eval_mode=True,
                gbs=rows * run.loop.val_global_batch_size,
                mbs=rows * run.loop.val_micro_batch_size,
            )
            per_batch.append(_step_metrics(results, 0))
    weights = [m[weight_name] for m in per_batch]
    total = sum(weights)
    if total == 0:  # nothing valid (every row cut): plain means of the batches' zeros
        weights, total = [1.0] * len(per_batch), float(len(per_batch))
    return {
        name: sum(m[name] for m in per_batch) if name.startswith("num_")
        else sum(w * m[name] for w, m in zip(weights, per_batch)) / total
        for name in per_batch[0]
    }


def train(run: SupervisedRun) -> Metrics:
    """Train from the resumed checkpoint (or step 0) to the run's last step in the shared loop.

    Returns:
        The last step's train metrics plus the last validation's (``val_`` prefixed).

    Raises:
        RunStopped: a stop signal or ``checkpoint_must_save_by`` ended the run early.
    """
    parts = run.loop_parts()
    with training_loop.stop_guard(parts) as guard:
        step, _ = training_loop.restore_checkpoint(parts)
        run.policy.prepare_for_training()
        return training_loop.train_loop(
            parts,
            guard,
            step,
            step_fn=lambda batches: train_step(run, batches),
            validate_fn=(lambda: validate(run)) if run.val_batches else None,
        )


def shutdown(run: SupervisedRun) -> None:
    """Stop the policy workers and the cluster; close the logger; undo :func:`setup`'s
    ``init_ray`` (which stops Ray only if the run started it)."""
    from nemo_rl.distributed.ray_bootstrap import shutdown_ray

    run.policy.shutdown()
    run.cluster.shutdown()
    run.logger.close()
    shutdown_ray()


def run_command(run: SupervisedRun) -> int | None:
    """A command's body after :func:`setup`: train, shut down, report.

    Returns:
        None when the run finished; 75 when it saved and stopped early; 128 + the signal
        number when a stop signal ended it without checkpointing (nothing saved).
    """
    try:
        final = train(run)
    except RunStopped as stop:
        print(stop)
        return stop.code
    finally:
        shutdown(run)
    training_loop.report_finished(
        run.loop_parts(), final, f"{run.algorithm.section}_curves.png", run.algorithm.plot_curves
    )
    return None
