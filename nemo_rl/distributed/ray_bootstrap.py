"""Start or join a Ray cluster, bounded in time and bound to loopback when local.

``init_ray()`` with no address starts a private single-node cluster on 127.0.0.1 (no
dashboard, no auth token, a small object store, as many logical CPUs as asked for: Ray
schedules by logical CPUs, so 8 on a 2-core machine lets several light actors coexist).
With an address it joins that cluster, first checking within ``connect_timeout_s`` that the
address answers, so a wrong ``RAY_ADDRESS`` fails fast with a ``ConnectionError`` instead of
hanging. ``shutdown_ray()`` undoes only what ``init_ray`` did, and only at the last of nested
calls: each ``init_ray`` is paired with one ``shutdown_ray``, so a run started inside a Ray
session someone opened before (a notebook's ``init_ray()``, a test's held cluster) leaves that
session running when it finishes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
DEFAULT_OBJECT_STORE_BYTES = 512 * 1024**2

# Environment every process of a local cluster needs: no auth token file, and no advertising
# of the machine's outward address (keeps the node on 127.0.0.1).
_LOCAL_CLUSTER_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}


@dataclass(frozen=True)
class RayHandle:
    """What ``init_ray`` set up.

    Attributes:
        address: GCS address of the cluster, "host:port".
        node_ip: address this driver's node advertises (127.0.0.1 for a local cluster).
        started_cluster: True if ``init_ray`` started the cluster processes itself.
        owns_connection: True if ``init_ray`` called ``ray.init`` (so ``shutdown_ray`` may
            disconnect); False when Ray had already been initialised by someone else.
    """

    address: str
    node_ip: str
    started_cluster: bool
    owns_connection: bool


_current: RayHandle | None = None
# init_ray calls not yet paired with a shutdown_ray; the last shutdown_ray disconnects.
_open_calls = 0
# Names of the _LOCAL_CLUSTER_ENV variables init_ray exported (and shutdown_ray removes).
_env_added: list[str] = []


def _probe(address: str, timeout_s: float) -> None:
    """Open and close a TCP connection to a "host:port" address.

    Raises:
        ConnectionError: the address is malformed, unresolvable, refuses or times out.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConnectionError(f"Ray address {address!r} is not of the form host:port")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as err:
        raise ConnectionError(
            f"cannot reach a Ray cluster at {address!r} within {timeout_s:g} s ({err}). "
            f"Check that the Ray head is up (`ray start --head`) and the address is right, or "
            f"unset RAY_ADDRESS / pass address=None to start a local cluster."
        ) from err


def _node_ip() -> str:
    """The NodeManagerAddress of the node this driver runs on."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    raise RuntimeError(f"Ray node {node_id} of this driver is missing from ray.nodes()")


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    temp_dir: str | None = None,
    runtime_env: dict[str, Any] | None = None,
    object_store_memory: int = DEFAULT_OBJECT_STORE_BYTES,
    connect_timeout_s: float = 10.0,
) -> RayHandle:
    """Start a local Ray cluster on 127.0.0.1 or connect to an existing one.

    Idempotent: if Ray is already initialised in this process, returns the current handle
    without touching the cluster (the arguments are then ignored, with a log line). Calls nest:
    every call, the first or a repeated one, is undone by one :func:`shutdown_ray`.

    Args:
        address: GCS address "host:port" of a running cluster (or "auto" for the one
            started on this machine by ``ray start``); None uses ``$RAY_ADDRESS`` if set,
            else starts a local cluster. Ray Client ("ray://") addresses are not supported.
        num_cpus: logical CPUs of the local cluster (default: Ray's, the core count).
            May exceed the physical cores. Only for a local cluster.
        num_gpus: GPUs of the local cluster (default: Ray's detection). Only for a local cluster.
        temp_dir: Ray's session/log folder for a local cluster (default /tmp/ray). Keep it
            short: Unix socket paths inside it are limited to ~107 bytes.
        runtime_env: Ray runtime environment for the job (env_vars, working_dir, ...).
        object_store_memory: object store size in bytes for a local cluster.
        connect_timeout_s: seconds allowed for the TCP check of ``address``; once that
            answers, joining is bounded by Ray's own GCS timeouts.

    Returns:
        A :class:`RayHandle` describing the cluster and what this call started.

    Raises:
        ConnectionError: ``address`` (or ``$RAY_ADDRESS``) does not answer in time.
        ValueError: local-cluster-only options given together with an address, a Ray
            Client address, or an address other than the cluster this process is already
            connected to.
    """
    import ray

    global _current, _open_calls
    if ray.is_initialized():
        if _current is None:
            _current = RayHandle(
                address=ray.get_runtime_context().gcs_address,
                node_ip=_node_ip(),
                started_cluster=False,
                owns_connection=False,
            )
        if address not in (None, "auto", _current.address):
            raise ValueError(
                f"Ray is already initialised in this process for {_current.address}, not the "
                f"requested address {address!r}; call shutdown_ray() first"
            )
        logger.info("Ray already initialised (%s); reusing it", _current.address)
        _open_calls += 1
        return _current

    from_env = address is None and bool(os.environ.get("RAY_ADDRESS"))
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        local_only = {"num_cpus": num_cpus, "num_gpus": num_gpus, "temp_dir": temp_dir}
        given = sorted(name for name, value in local_only.items() if value is not None)
        if given:
            raise ValueError(
                f"{given} only apply when starting a local cluster, but address={address!r} "
                f"was given{' via RAY_ADDRESS' if from_env else ''}; drop them or the address"
            )
        if address.startswith("ray://"):
            raise ValueError(
                f"Ray Client addresses ({address!r}) are not supported; give the GCS address "
                f"host:port of the head node (port 6379 by default)"
            )
        if address != "auto":
            _probe(address, connect_timeout_s)
        try:
            ray.init(address=address, runtime_env=runtime_env)
        except ConnectionError as err:
            raise ConnectionError(
                f"could not join the Ray cluster at {address!r}: {err}. Check the head node is "
                f"up, or unset RAY_ADDRESS to start a local cluster."
            ) from err
        _current = RayHandle(
            address=ray.get_runtime_context().gcs_address,
            node_ip=_node_ip(),
            started_cluster=False,
            owns_connection=True,
        )
        _open_calls = 1
        return _current

    _set_local_cluster_env()
    with _loopback_node_ip():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            object_store_memory=object_store_memory,
            include_dashboard=False,
            _node_ip_address=LOOPBACK,
            _temp_dir=temp_dir,
            runtime_env=runtime_env,
        )
    _current = RayHandle(
        address=ray.get_runtime_context().gcs_address,
        node_ip=_node_ip(),
        started_cluster=True,
        owns_connection=True,
    )
    _open_calls = 1
    if _current.node_ip != LOOPBACK:
        shutdown_ray()
        raise RuntimeError(
            f"the local Ray node advertises {_current.node_ip!r}, not {LOOPBACK}; this Ray "
            f"version ignores {_LOCAL_CLUSTER_ENV}: update nemo_rl.distributed.ray_bootstrap"
        )
    return _current


def _set_local_cluster_env() -> None:
    """Export :data:`_LOCAL_CLUSTER_ENV` (unless the user set those variables) for the Ray
    processes about to start; :func:`shutdown_ray` removes what was added here."""
    for name, value in _LOCAL_CLUSTER_ENV.items():
        if name not in os.environ:
            os.environ[name] = value
            _env_added.append(name)


@contextlib.contextmanager
def _loopback_node_ip() -> Iterator[None]:
    """Make ``ray.init`` keep 127.0.0.1 as the node address.

    Ray replaces a 127.0.0.1 node address by the machine's outward address unless multi-node
    clusters are disabled, a flag Ray reads from the environment once, when ``ray`` is first
    imported. ``ray`` is often imported before ``init_ray`` runs (by vLLM, for instance), so the
    flag is cleared for the duration of ``ray.init`` and restored afterwards.
    """
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextlib.contextmanager
def local_cluster_settings() -> Iterator[None]:
    """Within the block, Ray processes started on this machine by other means than
    :func:`init_ray` (``ray.cluster_utils.Cluster`` nodes in tests) get the settings of a local
    cluster: :data:`_LOCAL_CLUSTER_ENV` exported (unless the user set those variables; what
    was added is removed at exit) and node addresses kept on loopback. Keep the block open
    while such a cluster runs and this process is connected to it."""
    added = [name for name in _LOCAL_CLUSTER_ENV if name not in os.environ]
    os.environ.update({name: _LOCAL_CLUSTER_ENV[name] for name in added})
    try:
        with _loopback_node_ip():
            yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def shutdown_ray() -> None:
    """Undo one :func:`init_ray` call; the last open one disconnects from (and, if ``init_ray``
    started it, stops) the Ray cluster.

    Never disconnects when Ray was initialised by someone other than :func:`init_ray`; does
    nothing when no ``init_ray`` call is open.
    """
    import ray

    global _current, _open_calls
    if _current is None:
        return
    _open_calls -= 1
    if _open_calls > 0:
        return
    if _current.owns_connection and ray.is_initialized():
        ray.shutdown()
    _current = None
    while _env_added:
        os.environ.pop(_env_added.pop(), None)


@contextlib.contextmanager
def ray_cluster(**init_kwargs: Any) -> Iterator[RayHandle]:
    """Context manager form: ``with ray_cluster(num_cpus=8) as handle: ...``: one
    :func:`init_ray` on entry, its :func:`shutdown_ray` on exit (so the cluster stops on exit
    only if this ``with`` block started it)."""
    handle = init_ray(**init_kwargs)
    try:
        yield handle
    finally:
        shutdown_ray()
