"""The Megatron-Core policy worker, split by concern.

``model_setup`` (process groups, model, DDP, optimizer, scheduler), ``forward`` (micro-batch
inputs -> logprobs, padded or packed, CP-split), ``train_step`` (global batch -> optimizer step),
``checkpointing`` (dist checkpoints), ``reference`` (the frozen initial weights) and ``offload``
(device memory release around refit). :class:`~nemo_rl.models.policy.workers.
megatron_policy_worker.MegatronPolicyWorker` wires them.
"""
