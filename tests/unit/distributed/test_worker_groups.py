"""Tests for RayVirtualCluster and RayWorkerGroup against a real local Ray cluster (~40 s).

Two worker groups of 4 ranks share one cluster of 4 bundles (max_colocated_worker_groups=2):
``gloo`` (dp=2, tp=2) really rendezvous with torch.distributed on 127.0.0.1, ``light``
(pp=2, dp=2) checks the pipeline output-rank rule. Groups of two ``fragile`` ranks on a cluster
of their own have a rank stop (SIGSTOP) or die: the waits report it in one line naming the
rank, its node and the call.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import ray
import torch
import torch.distributed as dist

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.ray_bootstrap import LOOPBACK
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster, TooFewNodesError
from nemo_rl.distributed.worker_faults import (
    CollectiveFailed,
    WorkerDied,
    WorkerTimeout,
    node_description,
)
from nemo_rl.distributed.worker_groups import RayWorkerGroup, sharding_from_env, start_together

pytestmark = pytest.mark.slow

_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class EchoWorker:
    """Remembers the last shard it was given and reports its coordinates. Its methods use no
    torch, so its actors start without importing it (most groups here are of this class)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.rank = int(os.environ["RANK"])
        self.coords = sharding_from_env().get_rank_coords(self.rank)
        self.last: Any = None

    def echo(self, shard: Any, scale: int = 1) -> tuple[int, dict[str, int], Any, int]:
        self.last = shard
        return self.rank, self.coords, shard, scale

    def last_seen(self) -> tuple[dict[str, int], Any]:
        return self.coords, self.last

    def env(self, names: list[str]) -> dict[str, str | None]:
        return {name: os.environ.get(name) for name in names}


class ThreadsWorker(EchoWorker):
    """Reports torch's intra-op thread count and OMP_NUM_THREADS."""

    def threads(self) -> tuple[int, str | None]:
        return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


class GlooWorker(EchoWorker):
    """Joins a gloo process group from the RayWorkerGroup environment and builds TP subgroups."""

    def __init__(self, tag: str) -> None:
        super().__init__(tag)
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # env:// rendezvous
        self.tp_group = None
        for ranks in sharding_from_env().get_ranks_by_axis("tp"):
            group = dist.new_group(ranks)  # every rank creates every group, in the same order
            if self.rank in ranks:
                self.tp_group = group

    def tp_all_reduce(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, group=self.tp_group)
        return float(tensor.item())

    def fail_on_rank(self, shard: Any, bad_rank: int) -> float:
        if self.rank == bad_rank:
            raise ValueError(f"rank {self.rank} fails on purpose")
        return self.tp_all_reduce(1.0)

    def destroy(self) -> None:
        dist.destroy_process_group()


# Collective timeout of the fragile groups, seconds.
FRAGILE_TIMEOUT_S = 3


class FragileWorker(EchoWorker):
    """A rank of a gloo world whose collectives time out after FRAGILE_TIMEOUT_S; a rank can
    stop itself (SIGSTOP: a hung process)."""

    def __init__(self, tag: str) -> None:
        super().__init__(tag)
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # env:// rendezvous
        world = list(range(dist.get_world_size()))
        self.world = dist.new_group(world, timeout=timedelta(seconds=FRAGILE_TIMEOUT_S))

    def pid(self) -> int:
        return os.getpid()

    def stop_on_rank(self, rank: int) -> int:
        if self.rank == rank:
            os.kill(os.getpid(), signal.SIGSTOP)
        return self.rank

    def all_reduce_unless_stopped(self, rank: int) -> float:
        self.stop_on_rank(rank)
        tensor = torch.ones(1)
        dist.all_reduce(tensor, group=self.world)
        return float(tensor.item())


# The worker classes travel by value: workers need not import this test module (and with it
# torch), whatever name pytest gave it.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster(local_ray_8cpu: None) -> Iterator[RayVirtualCluster]:
    cluster = RayVirtualCluster(
        [4], use_gpus=False, num_cpus_per_bundle=1.0, max_colocated_worker_groups=2, name="shared"
    )
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def gloo_group(cluster: RayVirtualCluster) -> Iterator[RayWorkerGroup]:
    # Set after Ray started, so only the allow-list can carry them to the workers.
    os.environ["HF_HOME"] = "/tmp/nemo-rl-test-hf-home"
    os.environ["NEMO_RL_TEST_NOT_FORWARDED"] = "leaked"
    try:
        group = RayWorkerGroup(
            cluster,
            GlooWorker,
            {"dp": 2, "tp": 2},
            actor_kwargs={"tag": "gloo"},
            env_vars={"EXTRA_FLAG": "on"},
        )
    finally:
        del os.environ["HF_HOME"], os.environ["NEMO_RL_TEST_NOT_FORWARDED"]
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def light_group(cluster: RayVirtualCluster) -> Iterator[RayWorkerGroup]:
    group = RayWorkerGroup(
        cluster, ray.remote(EchoWorker), {"pp": 2, "dp": 2}, actor_kwargs={"tag": "light"}
    )
    yield group
    group.shutdown()


def _base_cpus_free() -> float:
    return ray.available_resources().get("CPU", 0.0)


def _wait_for_free_cpus(expected: float, limit_s: float = 20.0) -> float:
    """Poll until Ray reports ``expected`` free CPUs (resource release is asynchronous)."""
    deadline = time.monotonic() + limit_s
    while _base_cpus_free() != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return _base_cpus_free()


def test_cluster_reserves_bundles_and_finds_a_master_port(local_ray_8cpu: None) -> None:
    free_before = _wait_for_free_cpus(8.0)
    cluster = RayVirtualCluster([3], use_gpus=False, num_cpus_per_bundle=1.5, name="small")
    try:
        assert cluster.world_size() == 3
        groups = cluster.get_placement_groups()
        assert [pg.bundle_specs for pg in groups] == [[{"CPU": 1.5}] * 3]
        assert _wait_for_free_cpus(free_before - 4.5) == free_before - 4.5
        locations = cluster.get_bundle_locations()
        assert [(loc.placement_group, loc.bundle_index) for loc in locations] == [
            (groups[0], 0),
            (groups[0], 1),
            (groups[0], 2),
        ]
        address, port = cluster.get_master_address_and_port()
        assert address == LOOPBACK and 1024 <= port < 65536
        assert cluster.worker_resources() == {"num_cpus": 1.5, "num_gpus": 0.0}
    finally:
        cluster.shutdown()
    assert cluster.get_placement_groups() == []
    assert _wait_for_free_cpus(free_before) == free_before


def test_cluster_larger_than_ray_fails_in_bounded_time(local_ray_8cpu: None) -> None:
    with pytest.raises(TimeoutError, match=r"\[100\] bundles of \{'CPU': 1.0\}.*available"):
        RayVirtualCluster(
            [100], use_gpus=False, num_cpus_per_bundle=1.0, name="huge", placement_timeout_s=2
        )
    mine = [e for e in ray.util.placement_group_table().values() if e["name"] == "huge-node0"]
    assert len(mine) == 1 and mine[0]["state"] == "REMOVED"


def test_cluster_of_more_nodes_than_ray_has_is_refused(local_ray_8cpu: None) -> None:
    # one Ray node could hold both groups' bundles, but a group is a node
    with pytest.raises(TooFewNodesError, match=r"'pair' needs 2 Ray nodes .* has 1 node\(s\) "
                       r".*cluster.num_nodes=1"):
        RayVirtualCluster([1, 1], use_gpus=False, num_cpus_per_bundle=1.0, name="pair")
    assert not [e for e in ray.util.placement_group_table().values() if e["name"] == "pair-node0"]


def test_cluster_rejects_bad_arguments(local_ray_8cpu: None) -> None:
    with pytest.raises(ValueError, match="bundle_ct_per_node_list"):
        RayVirtualCluster([2, 0], use_gpus=False, num_cpus_per_bundle=1.0)
    with pytest.raises(ValueError, match="num_cpus_per_bundle"):
        RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=0)
    with pytest.raises(ValueError, match="max_colocated_worker_groups"):
        RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=1, max_colocated_worker_groups=0)


def test_worker_environment(gloo_group: RayWorkerGroup) -> None:
    names = [*_ENV_KEYS, "NEMO_RL_AXES", "NEMO_RL_DP_RANK", "NEMO_RL_TP_RANK", "NEMO_RL_DP_SIZE"]
    names += ["HF_HOME", "EXTRA_FLAG", "NEMO_RL_TEST_NOT_FORWARDED"]
    envs = ray.get(gloo_group.run_all_workers_single_data("env", names))
    ports = {env["MASTER_PORT"] for env in envs}
    assert len(ports) == 1 and ports.pop().isdigit()
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)  # one node: local == global
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "4"
        assert env["MASTER_ADDR"] == LOOPBACK
        assert env["NEMO_RL_AXES"] == "dp,tp"
        assert (env["NEMO_RL_DP_RANK"], env["NEMO_RL_TP_RANK"]) == (str(rank // 2), str(rank % 2))
        assert env["NEMO_RL_DP_SIZE"] == "2"
        assert env["HF_HOME"] == "/tmp/nemo-rl-test-hf-home"
        assert env["EXTRA_FLAG"] == "on"
        assert env["NEMO_RL_TEST_NOT_FORWARDED"] is None
    assert gloo_group.dp_size == 2 and gloo_group.world_size == 4


def test_cpu_workers_split_the_cores_over_the_bundles_computing_on_the_node(
    local_ray_8cpu: None,
) -> None:
    # one bundle of 2 logical CPUs beside one bundle of another cluster: Ray alone would give
    # the worker 2 threads (OMP_NUM_THREADS = its CPUs, capped at the cores)
    cores = len(os.sched_getaffinity(0))
    expected = max(1, cores // 2)
    cluster = RayVirtualCluster(
        [1], use_gpus=False, num_cpus_per_bundle=2.0, name="beside", other_bundles_per_node=1
    )
    try:
        assert cluster.cpu_threads(cluster.get_bundle_locations()[0]) == expected
        group = RayWorkerGroup(cluster, ThreadsWorker, {"dp": 1}, actor_kwargs={"tag": "threads"})
        try:
            (threads,) = ray.get(group.run_all_workers_single_data("threads"))
        finally:
            group.shutdown()
    finally:
        cluster.shutdown()
    assert threads == (expected, str(expected))
    with pytest.raises(ValueError, match="other_bundles_per_node"):
        RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1, other_bundles_per_node=-1)


def test_tp_subgroup_all_reduce(gloo_group: RayWorkerGroup) -> None:
    values = [float(rank + 1) for rank in range(4)]
    futures = gloo_group.run_all_workers_multiple_data("tp_all_reduce", [(v,) for v in values])
    # TP groups are consecutive ranks: {0, 1} and {2, 3}.
    assert gloo_group.get_all_worker_results(futures, timeout_s=60) == [3.0, 3.0, 7.0, 7.0]


def test_sharded_data_reaches_every_rank_of_its_replica(gloo_group: RayWorkerGroup) -> None:
    batch = BatchedDataDict({"ids": torch.arange(8).reshape(4, 2), "names": list("abcd")})
    shards = batch.shard_by_batch_size(gloo_group.dp_size).shards
    futures = gloo_group.run_all_workers_sharded_data(
        "echo", shards, common_kwargs={"scale": 3}
    )
    results = gloo_group.get_all_worker_results(futures, timeout_s=60)
    assert len(results) == 2
    for dp, (rank, coords, shard, scale) in enumerate(results):
        assert (rank, coords, scale) == (2 * dp, {"dp": dp, "tp": 0}, 3)  # tp=0 answers
        assert torch.equal(shard["ids"], torch.arange(8).reshape(4, 2)[2 * dp : 2 * dp + 2])
        assert shard["names"] == list("abcd")[2 * dp : 2 * dp + 2]
    seen = ray.get(gloo_group.run_all_workers_single_data("last_seen"))
    for coords, shard in seen:
        assert shard["names"] == list("abcd")[2 * coords["dp"] : 2 * coords["dp"] + 2]


def test_output_not_replicated_on_tp_returns_every_tp_rank(gloo_group: RayWorkerGroup) -> None:
    futures = gloo_group.run_all_workers_sharded_data(
        "echo", ["x", "y"], output_is_replicated=["pp", "cp"]
    )
    results = gloo_group.get_all_worker_results(futures, timeout_s=60)
    assert [(rank, shard) for rank, _, shard, _ in results] == [
        (0, "x"), (1, "x"), (2, "y"), (3, "y")
    ]


def test_last_pipeline_stage_answers(light_group: RayWorkerGroup) -> None:
    futures = light_group.run_all_workers_sharded_data("echo", ["first", "second"])
    results = light_group.get_all_worker_results(futures, timeout_s=60)
    # ranks = pp * 2 + dp; the last stage pp=1 holds ranks 2 (dp=0) and 3 (dp=1).
    assert [(rank, coords, shard) for rank, coords, shard, _ in results] == [
        (2, {"pp": 1, "dp": 0}, "first"),
        (3, {"pp": 1, "dp": 1}, "second"),
    ]
    assert light_group.output_coordinate("pp") == 1 and light_group.output_coordinate("dp") == 0


def test_sharded_data_validation(light_group: RayWorkerGroup) -> None:
    with pytest.raises(ValueError, match="has 3 entries but axis 'dp' has size 2"):
        light_group.run_all_workers_sharded_data("echo", ["a", "b", "c"])
    with pytest.raises(TypeError, match=r"shard_by_batch_size\(2\)"):
        light_group.run_all_workers_sharded_data("echo", BatchedDataDict({"x": [1, 2]}))
    with pytest.raises(ValueError, match=r"axes \['pp'\] .* neither"):
        light_group.run_all_workers_sharded_data("echo", ["a", "b"], replicate_on_axes=["tp"])
    with pytest.raises(ValueError, match="not in replicate_on_axes"):
        light_group.run_all_workers_sharded_data(
            "echo", [["a", "b"], ["c", "d"]], in_sharded_axes=["pp", "dp"], replicate_on_axes=[]
        )
    with pytest.raises(ValueError, match="one tuple of arguments per rank"):
        light_group.run_all_workers_multiple_data("echo", [("a",)])


def test_a_replaced_rank_gets_a_new_actor_on_its_bundle_with_its_environment(
    light_group: RayWorkerGroup,
) -> None:
    """What a restarted generation engine relies on: the dead rank's new actor sits in the
    same placement group and node with the same rank environment (its bundle is the one
    RANK names); the other ranks keep their actors."""
    names = ["RANK", "LOCAL_RANK", "NEMO_RL_PP_RANK", "NEMO_RL_DP_RANK", "MASTER_PORT"]

    def place(worker: Any) -> tuple[str, str]:
        return ray.get(worker.__ray_call__.remote(
            lambda _: (
                ray.get_runtime_context().get_placement_group_id(),
                ray.get_runtime_context().get_node_id(),
            )
        ))

    before = list(light_group.workers)
    env, where = ray.get(before[2].env.remote(names)), place(before[2])
    ray.kill(before[2])  # its process ends, as under kill -9
    light_group.replace_workers([2])
    after = light_group.workers
    assert after[2] != before[2] and [after[i] for i in (0, 1, 3)] == [before[i] for i in (0, 1, 3)]
    assert ray.get(after[2].env.remote(names)) == env and place(after[2]) == where
    futures = light_group.run_all_workers_sharded_data("echo", ["first", "second"])
    assert [r[:3] for r in light_group.get_all_worker_results(futures, timeout_s=60)] == [
        (2, {"pp": 1, "dp": 0}, "first"),
        (3, {"pp": 1, "dp": 1}, "second"),
    ]
    with pytest.raises(ValueError, match=r"ranks \[4\] are not in this group of 4"):
        light_group.replace_workers([4])


def test_third_colocated_group_does_not_fit(
    cluster: RayVirtualCluster, gloo_group: RayWorkerGroup, light_group: RayWorkerGroup
) -> None:
    # Refused when built (no actor is started and nothing waits for startup_timeout_s).
    with pytest.raises(ValueError, match="already hold max_colocated_worker_groups=2"):
        RayWorkerGroup(cluster, EchoWorker, {"dp": 1}, {"tag": "extra"})


def test_generation_on_a_full_cluster_fails_at_once_naming_the_limit(local_ray_8cpu: None) -> None:
    """A VllmGeneration on bundles whose one colocation slot is taken fails before any
    engine starts (it used to wait the whole startup_timeout_s), and fits once it is free."""
    from nemo_rl.models.generation.config import GenerationConfig
    from nemo_rl.models.generation.vllm import VllmGeneration

    full = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=0.5, name="full")
    try:
        group = RayWorkerGroup(full, ray.remote(EchoWorker), {"dp": 1}, {"tag": "first"})
        with pytest.raises(ValueError, match="max_colocated_worker_groups=1") as info:
            VllmGeneration(full, GenerationConfig(), "no-model-needed", pad_token_id=0)
        assert "max_colocated_worker_groups=2" in str(info.value)  # the fix it names
        group.shutdown()
        again = RayWorkerGroup(full, ray.remote(EchoWorker), {"dp": 1}, {"tag": "second"})
        assert ray.get(again.run_all_workers_single_data("last_seen")) is not None
        again.shutdown()
    finally:
        full.shutdown()


def _node_of(group: RayWorkerGroup, rank: int) -> str:
    return node_description(group.cluster.get_bundle_locations()[rank].node_id)


def test_failed_rank_is_reported_on_timeout(gloo_group: RayWorkerGroup) -> None:
    # Rank 1 raises; rank 0 (the output rank of DP shard 0) then waits in its TP all_reduce.
    futures = gloo_group.run_all_workers_sharded_data(
        "fail_on_rank", [0, 1], common_kwargs={"bad_rank": 1}
    )
    # The timeout names the ranks that failed by then: wait (each wait times out, rank 0 being
    # stuck) until rank 1's failure has arrived, however slow the host.
    deadline = time.monotonic() + 120
    while True:
        with pytest.raises(WorkerTimeout) as info:
            gloo_group.get_all_worker_results(futures, timeout_s=1)
        if "failed ranks" in str(info.value) or time.monotonic() > deadline:
            break
    assert isinstance(info.value, TimeoutError)
    assert str(info.value) == (
        f"worker rank 0 on {_node_of(gloo_group, 0)} gave no result for fail_on_rank within "
        "1 s: stopped, hung, or waiting in a collective for a rank that is; failed ranks: "
        "rank 1: ValueError: rank 1 fails on purpose"
    )


@pytest.fixture
def fragile_cluster(local_ray_8cpu: None) -> Iterator[RayVirtualCluster]:
    cluster = RayVirtualCluster([2], use_gpus=False, num_cpus_per_bundle=1.0, name="fragile")
    yield cluster
    cluster.shutdown()


def _assert_dead(workers: list[Any]) -> None:
    for worker in workers:
        with pytest.raises(ray.exceptions.ActorDiedError):
            ray.get(worker.last_seen.remote(), timeout=30)


def test_a_stopped_rank_fails_its_peers_collective_within_the_collective_timeout(
    fragile_cluster: RayVirtualCluster,
) -> None:
    group = RayWorkerGroup(fragile_cluster, FragileWorker, {"tp": 2}, {"tag": "f"}, name="fragile")
    workers = list(group.workers)
    futures = group.run_all_workers_single_data("all_reduce_unless_stopped", 1)
    # far longer than the collective's timeout: what ends the wait is rank 0's collective
    with pytest.raises(CollectiveFailed) as failed:
        group.get_all_worker_results(futures, timeout_s=300)
    message = str(failed.value)
    assert message.startswith(
        f"fragile worker rank 0 on {_node_of(group, 0)} gave up on a collective during "
        f"all_reduce_unless_stopped after {FRAGILE_TIMEOUT_S} s (Timed out waiting "
        f"{FRAGILE_TIMEOUT_S * 1000}ms for "
    ), message
    assert message.endswith(": a peer rank stopped or died; rank 1 had not answered"), message
    assert failed.value.exit_code == 75
    # no cleanup call (the stopped rank would never answer it): the actors are killed
    assert group.shutdown(cleanup_method="destroy") is False
    _assert_dead(workers)


def test_a_hung_rank_times_out_and_a_killed_one_fails_the_next_call_at_once(
    fragile_cluster: RayVirtualCluster,
) -> None:
    group = RayWorkerGroup(fragile_cluster, FragileWorker, {"dp": 2}, {"tag": "f"}, name="fragile")
    workers = list(group.workers)
    pid = ray.get(workers[1].pid.remote())
    futures = group.run_all_workers_single_data("stop_on_rank", 1)
    with pytest.raises(WorkerTimeout) as hung:
        group.get_all_worker_results(futures, timeout_s=2, timeout_field="test.timeout_s")
    assert str(hung.value) == (
        f"fragile worker rank 1 on {_node_of(group, 1)} gave no result for stop_on_rank within "
        "2 s (test.timeout_s): stopped, hung, or waiting in a collective for a rank that is"
    )
    os.kill(pid, signal.SIGKILL)  # what the OOM killer or a lost node does to it
    with pytest.raises(WorkerDied) as died:
        group.get_all_worker_results(group.run_all_workers_single_data("echo", "x"), 300)
    assert str(died.value) == (
        f"fragile worker rank 1 on {_node_of(group, 1)} died during echo (its worker process "
        "has died)"
    )
    assert group.shutdown(cleanup_method="destroy") is False
    _assert_dead(workers)


def test_shutdown_kills_only_own_actors(
    cluster: RayVirtualCluster, gloo_group: RayWorkerGroup, light_group: RayWorkerGroup
) -> None:
    workers = list(gloo_group.workers)
    # Rank 1 fails, leaving rank 0 blocked in its TP all_reduce, so cleanup cannot finish.
    gloo_group.run_all_workers_sharded_data("fail_on_rank", [0, 1], common_kwargs={"bad_rank": 1})
    assert gloo_group.shutdown(cleanup_method="destroy", timeout_s=2) is False
    assert gloo_group.workers == []
    for worker in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.last_seen.remote(), timeout=30)
    # The colocated group on the same bundles is untouched.
    assert len(ray.get(light_group.run_all_workers_single_data("last_seen"))) == 4
    light_workers = list(light_group.workers)
    assert light_group.shutdown(cleanup_method="last_seen") is True
    for worker in light_workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.last_seen.remote(), timeout=30)


def test_shutdown_returns_once_its_actors_are_dead(cluster: RayVirtualCluster) -> None:
    # ray.kill alone lets an idle actor answer a call made right after it (4 of 30 here), so
    # shutdown waits for the deaths; each round also reuses the bundles the last one freed.
    for round_ in range(3):
        group = RayWorkerGroup(
            cluster, ray.remote(EchoWorker), {"dp": 4}, actor_kwargs={"tag": f"round{round_}"}
        )
        workers = list(group.workers)
        assert group.shutdown() is True
        for worker in workers:
            with pytest.raises(ray.exceptions.ActorDiedError):
                ray.get(worker.last_seen.remote(), timeout=30)


class BrokenWorker(EchoWorker):
    """Fails while starting (a model that does not load, say)."""

    def __init__(self, tag: str) -> None:
        raise RuntimeError(f"{tag} cannot start")


def test_groups_started_together_come_up_and_a_failed_start_takes_no_actor_with_it(
    local_ray_8cpu: None,
) -> None:
    together = RayVirtualCluster(
        [1], use_gpus=False, num_cpus_per_bundle=0.5, max_colocated_worker_groups=2, name="both"
    )
    try:
        def group(cls: type, tag: str) -> Callable[[], RayWorkerGroup]:
            return lambda: RayWorkerGroup(together, ray.remote(cls), {"dp": 1}, {"tag": tag})

        groups = start_together(group(EchoWorker, "a"), group(EchoWorker, "b"))
        assert [ray.get(g.workers[0].env.remote(["RANK"])) for g in groups] == [{"RANK": "0"}] * 2
        assert [ray.get(g.workers[0].echo.remote("x"))[2] for g in groups] == ["x", "x"]
        for g in groups:
            g.shutdown()

        survivor: list[RayWorkerGroup] = []

        def kept(make: Callable[[], RayWorkerGroup]) -> Callable[[], RayWorkerGroup]:
            return lambda: survivor.append(make()) or survivor[-1]

        with pytest.raises(ray.exceptions.RayActorError, match="broken cannot start"):
            start_together(kept(group(EchoWorker, "ok")), group(BrokenWorker, "broken"))
        (started,) = survivor
        assert started.workers == []  # shut down by start_together
        # neither group still holds the bundle: two groups fit on it again
        together.claim_bundles(1)
        together.claim_bundles(1)
        # a cluster handle still travels to actors (its claims' lock does not)
        copy = ray.cloudpickle.loads(ray.cloudpickle.dumps(together))
        assert copy.world_size() == 1 and copy._claims is not together._claims
    finally:
        together.shutdown()
