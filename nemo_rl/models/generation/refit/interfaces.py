"""The weight-sync protocol: what a policy rank (sender) and a generation engine (receiver) do.

One protocol, two transports. Every verb below has exactly one implementation
(:class:`~.sender.RefitSender`, :class:`~.receiver.RefitReceiver`); the Ray workers expose
them through a single ``refit(verb, *args)`` method, and the driver-side facades add only
what the driver needs (the policy's are the seed's ``ColocatablePolicyInterface`` methods).

Both transports stream the weights through rings of a few bucket-sized slots (:mod:`.ring`),
each on one node, from which the engines load every bucket as it arrives; no process ever
stages the whole model.

Transports:
    colocated (engines on the policy's bundles): on each node (on GPU: each device) a policy
    rank of that place writes a ring that only the engines there read (:mod:`.plan`):
    ``prepare_weights_for_ipc`` opens a stream on every rank (the writers return their ring's
    handle), ``get_weights_ipc_handles`` exports and packs buckets into the rings, the engines'
    ``update_weights_from_ipc_handles`` load them meanwhile, ``finish_weights_ipc`` ends the
    stream once the engines are done.
    collective (engines on their own bundles, any node): a broadcast group of its own over the
    trainer's rank 0 and every engine (gloo on CPU, NCCL on GPU, :mod:`.collective`):
    ``init_collective`` forms it, ``broadcast_weights_for_collective`` streams, each engine's
    ``update_weights_from_collective`` receives into its own ring and loads from it,
    ``close_collective`` leaves.

An engine takes a stream's version only once it has loaded all of it; one whose load broke off
refuses to generate until a later refit completes (:mod:`.receiver`), and the driver retries a
failed refit (:mod:`.orchestrate`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from nemo_rl.models.generation.refit.ipc import IpcStream

# {hf_name: (shape, dtype)}, in export order.
RefitInfo = dict[str, tuple[tuple[int, ...], torch.dtype]]


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
        max_retries: times the driver starts a failed refit over before giving up.
    """

    bucket_bytes: int
    dtype: str | None
    timeout_s: float
    checksums: bool
    max_retries: int = 0


class WeightSender(Protocol):
    """A policy rank's verbs. Every rank of the policy is called (the export is collective
    over each replica's TP/PP/EP ranks)."""

    def prepare_refit_info(self) -> RefitInfo:
        """Export once; ``{hf_name: (shape, dtype)}`` of what every refit will send."""

    def prepare_weights_for_ipc(self, readers: Mapping[int, int]) -> IpcStream | None:
        """Open a colocated stream; ``readers``: ``{writer rank: readers of its ring}``. A
        writer returns its ring's stream, other ranks None."""

    def get_weights_ipc_handles(self, keys: list[str]) -> dict[str, float] | None:
        """Export the buckets carrying ``keys`` and pack them into this rank's ring (writers
        return their timings)."""

    def finish_weights_ipc(self) -> None:
        """End the open stream once the engines are done with it."""

    def init_collective(self, ip: str, port: int, world_size: int) -> None:
        """Rank 0 joins the broadcast group as its rank 0."""

    def broadcast_weights_for_collective(self) -> dict[str, float] | None:
        """Broadcast every bucket over the group; rank 0 returns its timings (s)."""

    def close_collective(self) -> None:
        """Leave the broadcast group (idempotent)."""


class WeightReceiver(Protocol):
    """A generation engine's verbs."""

    def prepare_refit_info(self, info: RefitInfo) -> None:
        """Accept the sender's refit info (checked against the engine's checkpoint)."""

    def update_weights_from_ipc_handles(
        self, streams: Sequence[tuple[IpcStream, int]], timeout_s: float
    ) -> dict[str, Any]:
        """Load a colocated stream: per engine rank, the stream of its ring and its reader
        index."""

    def init_collective(
        self, ip: str, port: int, world_size: int, rank: int, timeout_s: float
    ) -> None:
        """Join the broadcast group as ``rank`` (1..world_size-1)."""

    def update_weights_from_collective(self, bucket_bytes: int, timeout_s: float) -> dict[str, Any]:
        """Receive a broadcast stream into the engine's own ring and load it from there."""

    def close_collective(self) -> None:
        """Leave the broadcast group (idempotent)."""


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
