"""What a trainable policy offers the algorithm loop, and what a colocated one adds for refit.

Shapes: every per-token tensor is ``[batch, seq]`` aligned with ``input_ids``; logprobs follow
the convention of :mod:`nemo_rl.distributed.model_utils` (``logprobs[:, t]`` scores token ``t``
given the tokens before it; position 0 is 0).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional, TypedDict

import torch

if TYPE_CHECKING:
    import ray

    from nemo_rl.models.generation.refit.ipc import IpcStream

    from nemo_rl.algorithms.loss.interfaces import LossFunction
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict


class LogprobOutputSpec(TypedDict):
    """``logprobs``: ``[batch, seq]`` float32 log-probabilities of the given tokens."""

    logprobs: torch.Tensor


class ReferenceLogprobOutputSpec(TypedDict):
    """``reference_logprobs``: ``[batch, seq]`` float32 log-probabilities under the reference policy."""

    reference_logprobs: torch.Tensor


class PolicyInterface(ABC):
    """A policy the algorithm loop can score sequences with and train."""

    @abstractmethod
    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict[LogprobOutputSpec]:
        """Log-probabilities of ``data["input_ids"]`` (``[batch, seq]``, lengths in ``input_lengths``)."""

    @abstractmethod
    def get_reference_policy_logprobs(
        self, data: BatchedDataDict
    ) -> BatchedDataDict[ReferenceLogprobOutputSpec]:
        """Log-probabilities of ``data["input_ids"]`` under the reference (initial) weights."""

    @abstractmethod
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: Optional[int] = None,
        mbs: Optional[int] = None,
    ) -> dict[str, Any]:
        """Train on a global batch (one optimizer step per ``gbs`` samples).

        Args:
            data: the batch (``input_ids``, ``input_lengths`` and whatever ``loss_fn`` reads).
            loss_fn: the loss, globally normalised over the whole global batch.
            eval_mode: compute loss and metrics without updating weights.
            gbs: global batch size in samples; None uses the config's.
            mbs: micro-batch size in samples; None uses the config's.

        Returns:
            Aggregated metrics: loss, grad norm, learning rate, per-micro-batch metrics.
        """

    @abstractmethod
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """Bring weights, gradients and optimizer state onto the training devices."""

    @abstractmethod
    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        """End a training phase (e.g. release buffers only training needs)."""

    @abstractmethod
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Save model, optimizer, scheduler and RNG state."""

    @abstractmethod
    def shutdown(self) -> bool:
        """Stop the policy's workers; True when all stopped cleanly."""


class ColocatablePolicyInterface(PolicyInterface):
    """A policy that can hand its weights to a generation engine (refit).

    The refit verbs are the sender side of the weight-sync protocol
    (:mod:`nemo_rl.models.generation.refit.interfaces`); their settings (bucket size, export
    dtype, timeout, checksums) are the policy's configuration, not arguments.
    ``nemo_rl.models.generation.refit.refit_policy_generation`` runs the whole sequence.
    """

    @abstractmethod
    def init_collective(self, ip: str, port: int, world_size: int) -> list[ray.ObjectRef]:
        """Join one process group with the generation workers for broadcast refit; one
        future per rank, to wait for together with the engines' joins."""

    @abstractmethod
    def offload_before_refit(self) -> None:
        """Move optimizer state and gradients off the device before the engine wakes up."""

    @abstractmethod
    def offload_after_refit(self) -> None:
        """Move the weights off the device once the engine has them."""

    @abstractmethod
    def prepare_refit_info(self) -> Optional[dict[str, Any]]:
        """``{hf_name: (shape, dtype)}`` of the weights the engines will receive, in export
        order."""

    @abstractmethod
    def prepare_weights_for_ipc(self, readers: Mapping[int, int]) -> dict[int, IpcStream]:
        """Open a colocated transfer in which each rank of ``readers`` (``{writer rank:
        readers of its ring}``) writes a ring of bucket-sized slots on its node (GPU: its
        device); per writer, what the engines need to read it (an ``IpcStream``: the ring's
        shareable handle, CUDA IPC on GPU, shared memory on CPU; the version; the weight names
        grouped into buckets that fit the configured size)."""

    @abstractmethod
    def get_weights_ipc_handles(self, keys: list[str]) -> dict[str, Any]:
        """Pack the named weights (whole buckets of the open transfer, in order) into the
        writers' rings as the engines free their slots; ``{"writers": {rank: timings}}``."""

    @abstractmethod
    def broadcast_weights_for_collective(self) -> list[ray.ObjectRef]:
        """Broadcast all weights over the collective formed by :meth:`init_collective`; one
        future per rank, to wait for together with the engines' receives."""
