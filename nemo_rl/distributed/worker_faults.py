"""What the driver reports when a worker of a :class:`~nemo_rl.distributed.worker_groups.RayWorkerGroup`
dies, hangs, or gives up on a collective: one line naming the group, the rank, its node and the
call, as a :class:`~nemo_rl.utils.errors.ResumableFault` (``nemo-rl`` prints it and exits 75: a
rerun resumes from the newest checkpoint).

- :class:`WorkerDied`: the rank's actor is gone (its process was killed or crashed, or its node
  died); Ray fails every call to it at once.
- :class:`WorkerTimeout`: no result within the call's bound (a stopped or hung rank, or ranks
  waiting in a collective for one).
- :class:`CollectiveFailed`: a rank's collective (gloo, NCCL) timed out or lost its peer, so a
  peer rank stopped or died; the other ranks' state is named as far as the driver knows it.

:class:`CallFaults` words them for one call of a group (its ranks' nodes, actors and futures).

A node is named as ``<slurm node> (<address>)`` under ``nemo-rl launch slurm`` (the Ray node's
``slurm_node`` label, which Ray keeps after the node died), else ``<host name> (<address>)``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import ray
from ray import ObjectRef

from nemo_rl.launch.wait_for_nodes import SLURM_NODE_LABEL
from nemo_rl.utils.errors import ResumableFault


class WorkerDied(ResumableFault):
    """A worker's actor died (its process or its node); rerunning resumes the run."""


class WorkerTimeout(ResumableFault, TimeoutError):
    """Workers gave no result within the call's bound; rerunning resumes the run."""


class CollectiveFailed(ResumableFault):
    """A worker's collective timed out or lost its peer; rerunning resumes the run."""


# How a collective that a peer left reports itself (gloo on CPU, NCCL on GPU): a timeout, or
# the peer's connection gone.
_COLLECTIVE_FAILURES = re.compile(
    r"Timed out waiting|Connection (reset|closed) by peer|Broken pipe|"
    r"Watchdog caught collective operation timeout|NCCL communicator was aborted"
)
_MILLISECONDS = re.compile(r"(?:waiting |Timeout\(ms\)=)(\d+)\s*(?:ms)?")


def node_description(node_id: str) -> str:
    """``"<name> (<address>)"`` of the Ray node ``node_id`` (alive or dead): its slurm node
    name under ``nemo-rl launch slurm`` (its ``slurm_node`` label), else its host name; the id
    itself if Ray no longer knows it."""
    try:
        nodes = ray.nodes()
    except Exception:  # the GCS is unreachable: the id is all there is
        return f"Ray node {node_id[:12]}"
    for node in nodes:
        if node["NodeID"] != node_id:
            continue
        name = node.get("Labels", {}).get(SLURM_NODE_LABEL) or node.get(
            "NodeManagerHostname", node_id[:12]
        )
        return f"{name} ({node.get('NodeManagerAddress', '?')})"
    return f"Ray node {node_id[:12]}"


def death_reason(error: ray.exceptions.RayActorError) -> str:
    """Ray's reason for an actor's death in a few words (``its worker process has died``,
    ``its node has died``...), from the error's message."""
    text = str(error)
    match = re.search(r"The actor (?:is dead|died) because (.+?)\.(?:\s|$)", text)
    if match:
        return match.group(1).strip()
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return first[:200]


def collective_failure(cause: BaseException) -> str | None:
    """The first line of ``cause``'s message when it is a collective that timed out or lost
    its peer (gloo's or NCCL's error), else None."""
    if not isinstance(cause, RuntimeError):
        return None
    text = str(cause)
    if not _COLLECTIVE_FAILURES.search(text):
        return None
    line = next((line for line in text.splitlines() if _COLLECTIVE_FAILURES.search(line)), text)
    return re.sub(r"^\[[^\]]*\]\s*", "", line.strip())  # gloo's "[file.cc:78] " prefix


def collective_timeout_s(message: str) -> float | None:
    """The timeout a collective's error message states (gloo: ``waiting 20000ms``, NCCL:
    ``Timeout(ms)=600000``), in seconds; None when it states none (a peer's connection lost)."""
    match = _MILLISECONDS.search(message)
    return int(match.group(1)) / 1000 if match else None


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` / ``ranks 0, 2``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class CallFaults:
    """Words the fault of one call of a worker group, from what the group knows of it.

    Args:
        label: what the workers are (``"policy worker"``).
        node_ids: the Ray node of each rank, in rank order.
        actor_ids: each rank's actor id (hex), in rank order.
        method: the call's worker method.
        futures: ``(rank, future)`` of every rank of the call.
    """

    def __init__(
        self,
        label: str,
        node_ids: Sequence[str],
        actor_ids: Sequence[str],
        method: str,
        futures: Sequence[tuple[int, ObjectRef]],
    ) -> None:
        self.label = label
        self.node_ids = list(node_ids)
        self.actor_ids = list(actor_ids)
        self.method = method or "a call"
        self.futures = list(futures)

    def _where(self, rank: int | None) -> str:
        """``"<label> rank R on <node>"`` (a worker of the group when the rank is unknown)."""
        if rank is None:
            return f"a {self.label}"
        return f"{self.label} rank {rank} on {node_description(self.node_ids[rank])}"

    def _call_of(self, futures: Sequence[ObjectRef]) -> list[tuple[int, ObjectRef]]:
        """Every rank's future of the call when ``futures`` belong to it (else none: the
        ranks of another call are not known)."""
        ours = {ref.hex() for _, ref in self.futures}
        return self.futures if all(ref.hex() in ours for ref in futures) else []

    def _unanswered(self, futures: Sequence[ObjectRef]) -> list[int]:
        """Ranks of the call of ``futures`` that have no result yet."""
        known = self._call_of(futures)
        if not known:
            return []
        ready, _ = ray.wait([ref for _, ref in known], num_returns=len(known), timeout=0,
                            fetch_local=False)
        done = {ref.hex() for ref in ready}
        return sorted(rank for rank, ref in known if ref.hex() not in done)

    def died(self, error: ray.exceptions.RayActorError) -> WorkerDied:
        """A rank's actor died (``error`` names the actor)."""
        actor = getattr(error, "actor_id", None)
        rank = self.actor_ids.index(actor) if actor in self.actor_ids else None
        return WorkerDied(f"{self._where(rank)} died during {self.method} ({death_reason(error)})")

    def collective_failed(self, message: str, futures: Sequence[ObjectRef]) -> CollectiveFailed:
        """A rank's collective failed with ``message``: the first such rank of the call is
        named, with the ranks that had not answered."""
        rank = None
        for candidate, ref in self._call_of(futures):
            ready, _ = ray.wait([ref], timeout=0, fetch_local=False)
            if not ready:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as failure:
                if failure.cause is not None and collective_failure(failure.cause):
                    rank = candidate
                    break
        seconds = collective_timeout_s(message)
        after = f" after {seconds:g} s" if seconds is not None else ""
        waiting = [r for r in self._unanswered(futures) if r != rank]
        others = f"; {ranks_text(waiting)} had not answered" if waiting else ""
        return CollectiveFailed(
            f"{self._where(rank)} gave up on a collective during {self.method}{after} "
            f"({message}): a peer rank stopped or died{others}"
        )

    def timed_out(
        self,
        futures: Sequence[ObjectRef],
        timeout_s: float,
        field: str | None,
        side_results: Sequence[tuple[int, ObjectRef]],
    ) -> WorkerTimeout:
        """``futures`` gave no result within ``timeout_s`` (from config key ``field``); the
        errors already raised by ``side_results`` (ranks whose results are not returned) are
        named too."""
        waiting = self._unanswered(futures)
        if waiting:
            nodes = sorted({node_description(self.node_ids[r]) for r in waiting})
            who = f"{self.label} {ranks_text(waiting)} on {', '.join(nodes)}"
        else:
            who = f"{len(futures)} {self.label} result(s)"
        bound = f"{timeout_s:g} s" + (f" ({field})" if field else "")
        failures = []
        for rank, ref in side_results:
            ready, _ = ray.wait([ref], timeout=0, fetch_local=False)
            if ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as failure:
                    cause = getattr(failure, "cause", None) or failure
                    failures.append(f"rank {rank}: {type(cause).__name__}: {cause}")
        detail = "; failed ranks: " + " | ".join(failures) if failures else ""
        return WorkerTimeout(
            f"{who} gave no result for {self.method} within {bound}: stopped, hung, or waiting "
            f"in a collective for a rank that is{detail}"
        )
