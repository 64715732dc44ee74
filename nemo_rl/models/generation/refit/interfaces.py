"""The weight-sync protocol: what a policy rank (sender) and a generation engine (receiver) do.

One protocol, two transports. Every verb below has exactly one implementation
(:class:`~.sender.RefitSender`, :class:`~.receiver.RefitReceiver`); the Ray workers expose
them through a single ``refit(verb, *args)`` method, and the driver-side facades add only
what the driver needs (the policy's are the seed's ``ColocatablePolicyInterface`` methods).

Transports:
    colocated (same node, same devices): the sender packs the whole stream into one shared
    buffer (``/dev/shm`` on CPU, CUDA IPC on GPU, :mod:`.ipc`) that every engine maps, checks
    and loads from: ``prepare_weights_for_ipc`` opens a stream, ``stream_weights_ipc`` (or
    ``get_weights_ipc_handles`` bucket by bucket) packs it, ``finish_weights_ipc`` ends it once
    the engines committed or aborted.
    collective: a broadcast group of its own over the trainer's rank 0 and every engine
    (gloo on CPU, NCCL on GPU, :mod:`.collective`): ``init_collective`` forms it,
    ``broadcast_weights_for_collective`` streams, ``close_collective`` leaves.

Either way the engines stage and check the whole refit, and load only at
``commit_weight_update`` once every engine has it (two-phase: a failure before leaves every
engine on its previous weights and version).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from nemo_rl.models.generation.refit.ipc import IpcBucket, IpcStream

# {hf_name: (shape, dtype)}, in export order.
RefitInfo = dict[str, tuple[tuple[int, ...], torch.dtype]]

# What became of the sender of a colocated stream: None while it runs, else a description.
SenderOutcome = Callable[[], str | None]


@dataclass(frozen=True)
class RefitSettings:
    """How a policy streams its weights; built from the ``policy`` config
    (:meth:`~nemo_rl.models.policy.config.PolicyConfig.refit_settings`).

    Attributes:
        bucket_bytes: bytes per bucket, a positive multiple of 64.
        dtype: dtype name the weights are exported in (the engines' precision); None: the
            parameters' own dtype.
        timeout_s: seconds any one step (a bucket, forming the group, a broadcast) may take.
        checksums: stamp every bucket with a 64-bit checksum the engines verify (catches
            corrupted bytes at the cost of one extra read on each side).
    """

    bucket_bytes: int
    dtype: str | None
    timeout_s: float
    checksums: bool


class WeightSender(Protocol):
    """A policy rank's verbs. Every rank of the policy is called (the export is collective
    over TP/PP); only global rank 0 sends and returns something, other ranks return None."""

    def prepare_refit_info(self) -> RefitInfo | None:
        """Export once; ``{hf_name: (shape, dtype)}`` of what every refit will send."""

    def prepare_weights_for_ipc(self) -> IpcStream | None:
        """Open a colocated stream: its bucket plan, shared buffer handle and version."""

    def get_weights_ipc_handles(self, keys: list[str]) -> IpcBucket | None:
        """Pack the next bucket (it must carry ``keys``) into the stream buffer."""

    def stream_weights_ipc(self) -> None:
        """Pack every remaining bucket of the open stream (engines poll their records)."""

    def finish_weights_ipc(self) -> dict[str, float] | None:
        """End the open stream once the engines committed or aborted; the timings (s)."""

    def init_collective(self, ip: str, port: int, world_size: int) -> None:
        """Join the broadcast group as its rank 0."""

    def broadcast_weights_for_collective(self) -> dict[str, float] | None:
        """Broadcast every bucket over the group; the timings (s)."""

    def close_collective(self) -> None:
        """Leave the broadcast group (idempotent)."""


class WeightReceiver(Protocol):
    """A generation engine's verbs; nothing reaches the engine before
    :meth:`commit_weight_update`."""

    def prepare_refit_info(self, info: RefitInfo) -> None:
        """Accept the sender's refit info (checked against the engine's checkpoint)."""

    def update_weights_from_ipc_handles(self, bucket: IpcBucket) -> None:
        """Check one colocated bucket where it lies."""

    def receive_weights_ipc_stream(
        self, stream: IpcStream, sender: SenderOutcome | Sequence[Any], timeout_s: float
    ) -> None:
        """Check every bucket of a colocated stream as the sender packs it."""

    def init_collective(
        self, ip: str, port: int, world_size: int, rank: int, timeout_s: float
    ) -> None:
        """Join the broadcast group as ``rank`` (1..world_size-1)."""

    def update_weights_from_collective(self, bucket_bytes: int) -> None:
        """Stage and check a whole broadcast stream."""

    def close_collective(self) -> None:
        """Leave the broadcast group (idempotent)."""

    def commit_weight_update(self) -> dict[str, float | int]:
        """Load the staged refit; ``version``, ``receive_s``, ``attach_s``, ``load_s``."""

    def abort_weight_update(self) -> None:
        """Drop a staged or partial refit; the engine keeps its weights and version."""


def _verbs(protocol: type) -> frozenset[str]:
    return frozenset(n for n in vars(protocol) if not n.startswith("_") and callable(vars(protocol)[n]))


# The names a worker's ``refit(verb, ...)`` accepts.
SENDER_VERBS = _verbs(WeightSender)
RECEIVER_VERBS = _verbs(WeightReceiver)


def call_verb(target: Any, verbs: frozenset[str], verb: str, *args: Any) -> Any:
    """``target.verb(*args)`` for a verb of the protocol (a worker's one refit entry point).

    Raises:
        ValueError: ``verb`` is not one of ``verbs``.
    """
    if verb not in verbs:
        raise ValueError(f"unknown refit verb {verb!r}; the protocol has {sorted(verbs)}")
    return getattr(target, verb)(*args)
