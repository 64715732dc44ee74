"""A group of Ray actors, one per rank, laid out over named parallelism axes.

:class:`RayWorkerGroup` starts one actor per rank of a ``NamedSharding`` built from
``sharding_axes`` (e.g. ``{"pp": 1, "dp": 2, "cp": 1, "tp": 2}``, last axis fastest), placing
rank ``r`` on bundle ``r`` of a :class:`RayVirtualCluster`. Each actor gets the environment of a
``torch.distributed`` rendezvous (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) plus its coordinates (``NEMO_RL_AXES`` = "pp,dp,cp,tp",
``NEMO_RL_<AXIS>_RANK``, ``NEMO_RL_<AXIS>_SIZE``); :func:`sharding_from_env` rebuilds the layout
inside a worker. From the driver's environment only :data:`PASSTHROUGH_ENV_VARS` are forwarded;
anything else a worker needs goes in ``env_vars``.

Output-rank rule for :meth:`RayWorkerGroup.run_all_workers_sharded_data`: of the ranks that
differ only along ``output_is_replicated`` axes, the one whose result is returned has coordinate
``size - 1`` on the ``pp`` axis (the last pipeline stage, which holds the loss and logits) and
coordinate 0 on every other such axis (e.g. ``tp=0``, ``cp=0``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import ray
from ray.actor import ActorClass, ActorHandle
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nemo_rl.distributed.named_sharding import NamedSharding
from nemo_rl.distributed.ray_actors import kill_actors
from nemo_rl.distributed.worker_faults import CallFaults, collective_failure
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster

logger = logging.getLogger(__name__)

# Driver environment variables copied to every worker when set (nothing else is forwarded).
PASSTHROUGH_ENV_VARS: tuple[str, ...] = (
    "PYTHONPATH",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "TORCH_DISTRIBUTED_DEBUG",
    "NEMO_RL_FAULTS",  # test-only fault injection (nemo_rl.utils.fault_injection)
    "NEMO_RL_FAULTS_DIR",
)

# Axes whose output rank is the last coordinate rather than 0 (see the module docstring).
_LAST_COORDINATE_OUTPUT_AXES = frozenset({"pp"})

_RENDEZVOUS_ENV_VARS = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
)


def sharding_from_env(environ: Mapping[str, str] | None = None) -> NamedSharding:
    """Inside a worker: the group's :class:`NamedSharding`, from ``NEMO_RL_AXES`` and
    ``NEMO_RL_<AXIS>_SIZE``. The worker's own coordinates are then
    ``sharding.get_rank_coords(int(os.environ["RANK"]))``."""
    env = os.environ if environ is None else environ
    if "NEMO_RL_AXES" not in env:
        raise RuntimeError(
            "NEMO_RL_AXES is not set; this process was not started by RayWorkerGroup"
        )
    names = env["NEMO_RL_AXES"].split(",")
    return NamedSharding.from_axis_sizes({n: int(env[f"NEMO_RL_{n.upper()}_SIZE"]) for n in names})


class RayWorkerGroup:
    """One Ray actor per rank of ``sharding_axes``, placed on ``cluster``'s bundles in rank order.

    Args:
        cluster: where to place the workers; rank ``r`` uses bundle ``r`` (needs
            ``cluster.world_size() >= prod(sharding_axes.values())``).
        actor_cls: a plain class (made remote here) or a ``ray.remote`` actor class. Resource
            options are set here from ``cluster.worker_resources()``.
        sharding_axes: ordered axis name -> size, outermost first, e.g.
            ``{"pp": 1, "dp": 2, "cp": 1, "tp": 2}``.
        actor_kwargs: keyword arguments of ``actor_cls.__init__`` (the same for every rank).
        env_vars: extra environment for every worker; may not set the rendezvous variables.
        startup_timeout_s: seconds allowed for every actor's ``__init__`` to finish.
        name: what the group's workers are, in messages (``"policy"``: "policy worker rank 1
            on node2 (10.0.0.2) died during train ..."); None: "worker rank 1 ...".

    Raises:
        ValueError: malformed axes, a world larger than the cluster, bundles already holding
            the cluster's ``max_colocated_worker_groups`` groups, or reserved ``env_vars``.
        TypeError: ``actor_cls`` is not a class, or an ``env_vars`` value is not a str.
        TimeoutError: the actors did not all start in time (they are killed again).
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        actor_cls: type | ActorClass,
        sharding_axes: Mapping[str, int],
        actor_kwargs: Mapping[str, Any] | None = None,
        env_vars: Mapping[str, str] | None = None,
        startup_timeout_s: float = 300.0,
        name: str | None = None,
    ) -> None:
        self.label = f"{name} worker" if name else "worker"
        # the latest call: its method and every rank's future (for the fault messages)
        self._call_method = ""
        self._call_futures: list[tuple[int, ray.ObjectRef]] = []
        # a rank died, hung or failed a collective: shutdown kills without the cleanup call
        self._faulted = False
        if not sharding_axes:
            raise ValueError("sharding_axes is empty; give at least one axis, e.g. {'dp': 1}")
        self.sharding = NamedSharding.from_axis_sizes(sharding_axes)
        world_size = self.sharding.world_size
        if world_size > cluster.world_size():
            raise ValueError(
                f"sharding_axes {dict(sharding_axes)} need {world_size} workers but the cluster "
                f"has {cluster.world_size()} bundles; shrink the axes or enlarge the cluster"
            )
        reserved = sorted(
            name
            for name in (env_vars or {})
            if name in _RENDEZVOUS_ENV_VARS or name.startswith("NEMO_RL_")
        )
        if reserved:
            raise ValueError(
                f"env_vars may not set {reserved}: RayWorkerGroup sets the rendezvous and "
                f"NEMO_RL_* variables itself"
            )
        for name, value in (env_vars or {}).items():
            if not isinstance(value, str):
                raise TypeError(f"env_vars[{name!r}] = {value!r} must be a str")
        self.cluster = cluster
        self._side_results: list[tuple[int, ray.ObjectRef]] = []
        cluster.claim_bundles(world_size)
        try:
            self.workers: list[ActorHandle] = self._start(
                actor_cls, dict(actor_kwargs or {}), dict(env_vars or {}), startup_timeout_s
            )
        except BaseException:
            cluster.release_bundles(world_size)
            raise

    # ------------------------------------------------------------------ start-up

    def _start(
        self,
        actor_cls: type | ActorClass,
        actor_kwargs: dict[str, Any],
        env_vars: dict[str, str],
        timeout_s: float,
    ) -> list[ActorHandle]:
        if isinstance(actor_cls, ActorClass):
            remote_cls = actor_cls
        elif isinstance(actor_cls, type):
            remote_cls = ray.remote(actor_cls)
        else:
            raise TypeError(
                f"actor_cls must be a class or a ray.remote actor class, got {actor_cls!r}"
            )
        locations = self.cluster.get_bundle_locations()[: self.sharding.world_size]
        address, port = self.cluster.get_master_address_and_port()
        common = {
            name: os.environ[name] for name in PASSTHROUGH_ENV_VARS if name in os.environ
        }
        common.update(env_vars)
        common.update(
            {
                "WORLD_SIZE": str(self.sharding.world_size),
                "MASTER_ADDR": address,
                "MASTER_PORT": str(port),
                "NEMO_RL_AXES": ",".join(self.sharding.names),
            }
        )
        common.update(
            {f"NEMO_RL_{n.upper()}_SIZE": str(s) for n, s in self.sharding.shape.items()}
        )
        per_node: dict[str, int] = {}
        for location in locations:
            per_node[location.node_id] = per_node.get(location.node_id, 0) + 1
        seen_on_node: dict[str, int] = {}
        workers = []
        for rank, location in enumerate(locations):
            local_rank = seen_on_node.get(location.node_id, 0)
            seen_on_node[location.node_id] = local_rank + 1
            env = dict(common)
            env.update(
                {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local_rank),
                    "LOCAL_WORLD_SIZE": str(per_node[location.node_id]),
                }
            )
            coords = self.sharding.get_rank_coords(rank)
            env.update({f"NEMO_RL_{n.upper()}_RANK": str(c) for n, c in coords.items()})
            threads = self.cluster.cpu_threads(location)
            if threads is not None and "OMP_NUM_THREADS" not in env_vars:
                env["OMP_NUM_THREADS"] = str(threads)
            options = remote_cls.options(
                **self.cluster.worker_resources(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    location.placement_group, location.bundle_index
                ),
                runtime_env={"env_vars": env},
            )
            workers.append(options.remote(**actor_kwargs))
        try:
            ray.get([w.__ray_ready__.remote() for w in workers], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            kill_actors(workers)
            raise TimeoutError(
                f"{len(workers)} workers did not all start within {timeout_s:g} s. Either "
                f"__init__ hangs (e.g. a rendezvous waiting for a missing rank) or the bundles "
                f"are taken: the cluster allows {self.cluster.max_colocated_worker_groups} "
                f"worker group(s) per bundle, each worker asking for "
                f"{self.cluster.worker_resources()}"
            ) from err
        except ray.exceptions.RayError:
            kill_actors(workers)
            raise
        return workers

    # ------------------------------------------------------------------ properties

    def worker_places(self, per_device: bool) -> list[Hashable]:
        """Where each worker runs, in rank order: its Ray node id, or with ``per_device`` its
        bundle (node id, placement group, bundle index: one GPU on a GPU cluster). Worker
        groups on the same cluster's bundles (colocated) share places rank for rank."""
        locations = self.cluster.get_bundle_locations()[: self.world_size]
        if not per_device:
            return [location.node_id for location in locations]
        return [
            (location.node_id, location.placement_group.id.hex(), location.bundle_index)
            for location in locations
        ]

    @property
    def world_size(self) -> int:
        """Number of workers (ranks)."""
        return self.sharding.world_size

    @property
    def dp_size(self) -> int:
        """Size of the ``dp`` axis (1 if there is none): the number of data shards."""
        return self.sharding.get_axis_size("dp") if "dp" in self.sharding.names else 1

    def output_coordinate(self, axis: str) -> int:
        """Coordinate on ``axis`` of the rank whose result is returned when the output is
        replicated over ``axis``: ``size - 1`` for ``pp``, 0 for every other axis."""
        size = self.sharding.get_axis_size(axis)
        return size - 1 if axis in _LAST_COORDINATE_OUTPUT_AXES else 0

    # ------------------------------------------------------------------ dispatch

    def run_all_workers_single_data(
        self, method: str, *args: Any, **kwargs: Any
    ) -> list[ray.ObjectRef]:
        """Call ``method(*args, **kwargs)`` on every worker; one future per rank, in rank order."""
        futures = [self._method(worker, method).remote(*args, **kwargs) for worker in self.workers]
        return self._record_call(method, list(enumerate(futures)))

    def run_all_workers_multiple_data(
        self,
        method: str,
        per_rank_args: Sequence[Sequence[Any]],
        common_kwargs: Mapping[str, Any] | None = None,
    ) -> list[ray.ObjectRef]:
        """Call ``method(*per_rank_args[r], **common_kwargs)`` on rank ``r``; one future per rank.

        Raises:
            ValueError: ``per_rank_args`` does not have one entry per rank.
            TypeError: an entry is not a tuple or list of positional arguments.
        """
        if len(per_rank_args) != self.world_size:
            raise ValueError(
                f"per_rank_args has {len(per_rank_args)} entries but the group has "
                f"{self.world_size} ranks; give one tuple of arguments per rank"
            )
        for rank, args in enumerate(per_rank_args):
            if not isinstance(args, (tuple, list)):
                raise TypeError(
                    f"per_rank_args[{rank}] is a {type(args).__name__}; each entry must be a tuple "
                    f"of positional arguments, e.g. (batch,)"
                )
        kwargs = dict(common_kwargs or {})
        futures = [
            self._method(worker, method).remote(*args, **kwargs)
            for worker, args in zip(self.workers, per_rank_args)
        ]
        return self._record_call(method, list(enumerate(futures)))

    def run_all_workers_sharded_data(
        self,
        method: str,
        data: Sequence[Any],
        in_sharded_axes: Sequence[str] = ("dp",),
        replicate_on_axes: Sequence[str] = ("cp", "tp", "pp"),
        output_is_replicated: Sequence[str] = ("cp", "tp", "pp"),
        common_kwargs: Mapping[str, Any] | None = None,
    ) -> list[ray.ObjectRef]:
        """Call ``method(shard, **common_kwargs)`` on every rank, each with its data shard.

        ``data`` is indexed by the rank's coordinates on ``in_sharded_axes``, in that order (a
        list with one entry per DP shard for the default ``["dp"]``; nested lists for several
        axes). Every rank of a replica (ranks differing only along ``replicate_on_axes``) gets the
        same shard; each shard is put into the object store once. Axes named here but absent from
        the sharding are ignored (they have size 1); every axis of the sharding must be either
        sharded or replicated.

        Returns:
            The futures of the output ranks only: along ``output_is_replicated`` axes one rank per
            replica answers (the last ``pp`` stage, coordinate 0 elsewhere: see the module
            docstring). Ordered row-major by ``in_sharded_axes``, then by any replicated axes
            whose output is not replicated, in sharding order. With the defaults: one future per
            DP shard, in DP order. The other ranks' futures of the latest call are kept to report
            their failures in :meth:`get_all_worker_results`.

        Raises:
            ValueError: axes overlap, leave an axis uncovered, or ``data`` has the wrong shape.
            TypeError: ``data`` is not a (nested) list.
        """
        names = self.sharding.names
        sharded = [a for a in in_sharded_axes if a in names]
        replicated = [a for a in replicate_on_axes if a in names]
        output_replicated = {a for a in output_is_replicated if a in names}
        if set(sharded) & set(replicated):
            raise ValueError(
                f"axes {sorted(set(sharded) & set(replicated))} are in both in_sharded_axes and "
                f"replicate_on_axes; an axis is either sharded or replicated"
            )
        uncovered = [a for a in names if a not in sharded and a not in replicated]
        if uncovered:
            raise ValueError(
                f"axes {uncovered} of the sharding {self.sharding.shape} are in neither "
                f"in_sharded_axes {list(in_sharded_axes)} nor replicate_on_axes "
                f"{list(replicate_on_axes)}; add each to one of them"
            )
        if not output_replicated <= set(replicated):
            raise ValueError(
                f"output_is_replicated axes {sorted(output_replicated - set(replicated))} are not "
                f"in replicate_on_axes; only replicated axes can have replicated output"
            )
        shard_refs = self._put_shards(data, sharded)
        kwargs = dict(common_kwargs or {})
        per_key: dict[tuple[int, ...], ray.ObjectRef] = {}
        self._side_results = []
        every: list[tuple[int, ray.ObjectRef]] = []
        for rank, worker in enumerate(self.workers):
            coords = self.sharding.get_rank_coords(rank)
            shard_key = tuple(coords[a] for a in sharded)
            ref = self._method(worker, method).remote(shard_refs[shard_key], **kwargs)
            every.append((rank, ref))
            if all(coords[a] == self.output_coordinate(a) for a in output_replicated):
                distinct = tuple(coords[a] for a in replicated if a not in output_replicated)
                per_key[shard_key + distinct] = ref
            else:
                self._side_results.append((rank, ref))
        self._record_call(method, every)
        return [per_key[key] for key in sorted(per_key)]

    def _put_shards(self, data: Any, sharded: list[str]) -> dict[tuple[int, ...], ray.ObjectRef]:
        """Object refs of the shards of ``data``, keyed by their coordinates on ``sharded``."""
        refs: dict[tuple[int, ...], ray.ObjectRef] = {}

        def walk(node: Any, depth: int, key: tuple[int, ...]) -> None:
            if depth == len(sharded):
                refs[key] = ray.put(node)
                return
            axis = sharded[depth]
            size = self.sharding.get_axis_size(axis)
            path = "data" + "".join(f"[{i}]" for i in key)
            if not isinstance(node, (list, tuple)):
                raise TypeError(
                    f"{path} is a {type(node).__name__}; it must be a list of {size} shards along "
                    f"axis '{axis}' (e.g. batch.shard_by_batch_size({size}).shards)"
                )
            if len(node) != size:
                raise ValueError(
                    f"{path} has {len(node)} entries but axis '{axis}' has size {size}; give one "
                    f"shard per '{axis}' coordinate"
                )
            for i, child in enumerate(node):
                walk(child, depth + 1, key + (i,))

        walk(data, 0, ())
        return refs

    @staticmethod
    def _method(worker: ActorHandle, method: str) -> Any:
        try:
            return getattr(worker, method)
        except AttributeError as err:
            raise ValueError(f"the worker actor has no method {method!r}") from err

    # ------------------------------------------------------------------ results

    def _record_call(
        self, method: str, futures: list[tuple[int, ray.ObjectRef]]
    ) -> list[ray.ObjectRef]:
        """Remember ``method`` and its ``(rank, future)`` pairs, for the messages of
        :meth:`get_all_worker_results`; the futures, in order."""
        self._call_method = method
        self._call_futures = futures
        return [ref for _, ref in futures]

    def get_all_worker_results(
        self,
        futures: Sequence[ray.ObjectRef],
        timeout_s: float = 3600.0,
        timeout_field: str | None = None,
    ) -> list[Any]:
        """``ray.get`` the futures, waiting at most ``timeout_s`` seconds.

        Args:
            timeout_field: the config key ``timeout_s`` comes from, named in the timeout's
                message.

        Raises:
            WorkerDied: a rank's actor died (its process or node; Ray fails the call at once),
                naming the rank, its node and the call.
            CollectiveFailed: a rank's collective timed out or lost its peer (a peer stopped
                or died), naming that rank, the call, the collective's timeout and the ranks
                that had not answered.
            WorkerTimeout: not all results arrived in time (a ``TimeoutError``), naming the
                ranks that did not answer and any that failed meanwhile (a failed rank usually
                leaves the others waiting in a collective).
            ray.exceptions.RayTaskError: a rank's call raised anything else (its exception is
                the error's ``cause``).
        """
        try:
            return ray.get(list(futures), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            self._faulted = True
            raise self._faults().timed_out(
                futures, timeout_s, timeout_field, self._side_results
            ) from err
        except ray.exceptions.RayActorError as err:
            self._faulted = True
            raise self._faults().died(err) from err
        except ray.exceptions.RayTaskError as err:
            collective = collective_failure(err.cause) if err.cause is not None else None
            if collective is None:
                raise
            self._faulted = True
            raise self._faults().collective_failed(collective, futures) from err

    def _faults(self) -> CallFaults:
        """The wording of the latest call's faults: ranks, their nodes and actors."""
        locations = self.cluster.get_bundle_locations()[: self.world_size]
        return CallFaults(
            self.label,
            [location.node_id for location in locations],
            [worker._actor_id.hex() for worker in self.workers],
            self._call_method,
            self._call_futures,
        )

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, cleanup_method: str | None = None, timeout_s: float = 30.0) -> bool:
        """Stop this group's actors (and only them), returning once they are dead; the cluster's
        bundles stay reserved.

        Args:
            cleanup_method: a worker method to call on every rank first (e.g. to destroy the
                process group); its failure or timeout is logged, not raised. Skipped once
                :meth:`get_all_worker_results` reported a dead, hung or failed rank (the
                others would wait for it in the cleanup's collectives).
            timeout_s: seconds allowed for ``cleanup_method``.

        Returns:
            False if the cleanup method failed, timed out or was skipped, or a killed actor
            still answered 30 s later; True otherwise.
        """
        clean = True
        if self._faulted and cleanup_method is not None:
            logger.warning("%s: %r skipped after a failed rank", self.label, cleanup_method)
            cleanup_method, clean = None, False
        if cleanup_method is not None and self.workers:
            try:
                ray.get(self.run_all_workers_single_data(cleanup_method), timeout=timeout_s)
            except (ray.exceptions.RayError, ValueError) as err:
                logger.warning("cleanup %r failed before killing workers: %s", cleanup_method, err)
                clean = False
        clean = not kill_actors(self.workers) and clean
        if self.workers:
            self.cluster.release_bundles(self.world_size)
        self.workers = []
        self._side_results = []
        self._call_futures = []
        return clean


def start_together(*factories: Callable[[], Any]) -> list[Any]:
    """Call each factory (e.g. the constructor of a policy or of generation engines, which
    start their worker groups and wait for them) in its own thread, so the groups' actors
    import, build and load at the same time; their results in order.

    Raises:
        The first factory's error (in argument order); what the others built is shut down
        first (``shutdown()``), so no actor outlives a failed start.
    """
    with ThreadPoolExecutor(len(factories), thread_name_prefix="start-workers") as pool:
        futures = [pool.submit(factory) for factory in factories]
        wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for future in futures:
            if future.exception() is None:
                future.result().shutdown()
        raise errors[0]
    return [f.result() for f in futures]
