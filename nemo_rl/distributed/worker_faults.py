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

A node is named as ``<slurm node> (<address>)`` under ``nemo-rl launch slurm`` (the Ray node's
``slurm_node`` label, which Ray keeps after the node died), else ``<host name> (<address>)``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import ray

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
