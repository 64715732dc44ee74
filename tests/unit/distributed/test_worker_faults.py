"""How the driver reads a worker's failure: Ray's reason for an actor's death, and gloo's and
NCCL's messages for a collective whose peer stopped or died (the texts below are what torch
2.13's gloo and Ray 2.60 print; the group-level messages are checked in test_worker_groups.py
against real actors)."""

from __future__ import annotations

import ray

from nemo_rl.distributed.worker_faults import (
    CollectiveFailed,
    WorkerDied,
    WorkerTimeout,
    collective_failure,
    collective_timeout_s,
    death_reason,
    ranks_text,
)
from nemo_rl.utils.errors import ResumableFault

GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 4000ms for recv operation to complete"
)
GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:56532: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application."
)
NCCL_WATCHDOG = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
    "600012 milliseconds before timing out."
)


def test_collective_failures_are_told_from_other_errors() -> None:
    assert collective_failure(RuntimeError(GLOO_TIMEOUT)) == (
        "Timed out waiting 4000ms for recv operation to complete"
    )
    assert collective_failure(RuntimeError(GLOO_PEER_GONE)).startswith(
        "Read error [127.0.0.1]:56532: Connection reset by peer."
    )
    assert collective_failure(RuntimeError(NCCL_WATCHDOG)) is not None
    assert collective_failure(RuntimeError("CUDA out of memory")) is None
    assert collective_failure(ValueError("Timed out waiting for the data")) is None  # not torch's


def test_the_collective_timeout_is_read_from_the_message() -> None:
    assert collective_timeout_s(collective_failure(RuntimeError(GLOO_TIMEOUT))) == 4
    assert collective_timeout_s(NCCL_WATCHDOG) == 600
    assert collective_timeout_s(GLOO_PEER_GONE) is None


def test_death_reason_is_rays_own_few_words() -> None:
    text = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: A\n\tactor_id: "
        "2d9f\nThe actor is dead because its worker process has died. Worker exit type: "
        "SYSTEM_ERROR"
    )
    assert death_reason(ray.exceptions.RayActorError("2d9f", text)) == (
        "its worker process has died"
    )
    node = "The actor died because its node has died. Node Id: 4c5b"
    assert death_reason(ray.exceptions.RayActorError("2d9f", node)) == "its node has died"
    killed = "The actor is dead because it was killed by `ray.kill`."
    assert death_reason(ray.exceptions.RayActorError("2d9f", killed)) == (
        "it was killed by `ray.kill`"
    )


def test_faults_are_resumable_and_a_timeout_is_a_timeout_error() -> None:
    for kind in (WorkerDied, WorkerTimeout, CollectiveFailed):
        assert issubclass(kind, ResumableFault) and kind.exit_code == 75
    assert issubclass(WorkerTimeout, TimeoutError)
    assert ranks_text([3]) == "rank 3" and ranks_text([0, 2]) == "ranks 0, 2"
