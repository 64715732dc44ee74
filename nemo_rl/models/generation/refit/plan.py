"""Which policy rank writes the ring each colocated engine rank reads.

A colocated engine only ever reads a ring on its own node. The unit a ring serves is a *place*:
a node on CPU (one shared-memory ring per node, read by every engine process there), a device
on GPU (one CUDA IPC ring per GPU, written by the policy rank on that GPU and read by the
engine rank on it, as NeMo RL does). Each place's ring is written by the lowest policy rank
at that place, which exports the full weights itself (the export gathers over the policy's
TP/PP/EP groups what the ranks of its place lack).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from nemo_rl.models.generation.refit.errors import RefitError


@dataclass(frozen=True)
class RingAssignment:
    """One ring of a colocated refit.

    Attributes:
        writer: the policy rank that writes it.
        readers: ``(engine, engine rank)`` of its readers, in reader-index order.
        place: the node (CPU) or device (GPU) it serves.
    """

    writer: int
    readers: tuple[tuple[int, int], ...]
    place: Hashable


def plan_rings(
    policy_places: Sequence[Hashable], engine_places: Sequence[Sequence[Hashable]]
) -> list[RingAssignment]:
    """The rings of a colocated refit, in writer order.

    Args:
        policy_places: the place (node id on CPU, device on GPU) of each policy rank.
        engine_places: for each engine, the place of each of its ranks.

    Raises:
        RefitError: an engine rank's place has no policy rank (the engine is not colocated
            with the policy).
    """
    writers: dict[Hashable, int] = {}
    for rank, place in enumerate(policy_places):
        writers.setdefault(place, rank)
    readers: dict[Hashable, list[tuple[int, int]]] = {}
    for engine, places in enumerate(engine_places):
        for engine_rank, place in enumerate(places):
            if place not in writers:
                raise RefitError(
                    f"rank {engine_rank} of engine {engine} runs at {place!r}, where no policy "
                    f"rank runs (policy ranks at {sorted(map(str, writers))}): a colocated "
                    "refit needs the engines on the policy's bundles"
                )
            readers.setdefault(place, []).append((engine, engine_rank))
    return sorted(
        (RingAssignment(writers[p], tuple(r), p) for p, r in readers.items()),
        key=lambda a: a.writer,
    )


def engine_reads(
    rings: Sequence[RingAssignment], engine: int, tp: int
) -> list[tuple[RingAssignment, int]]:
    """For each rank of ``engine`` (``tp`` ranks), the ring it reads and its reader index."""
    found: dict[int, tuple[RingAssignment, int]] = {}
    for ring in rings:
        for index, (e, engine_rank) in enumerate(ring.readers):
            if e == engine:
                found[engine_rank] = (ring, index)
    missing = [t for t in range(tp) if t not in found]
    if missing:
        raise RefitError(f"ranks {missing} of engine {engine} read no ring in the refit plan")
    return [found[t] for t in range(tp)]
