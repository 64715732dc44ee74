"""Tests for nemo_rl.distributed.ray_bootstrap against a real local Ray cluster (~15 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from nemo_rl.distributed.ray_bootstrap import (
    LOOPBACK,
    RayHandle,
    _loopback_node_ip,
    init_ray,
    local_cluster_settings,
    ray_cluster,
    shutdown_ray,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
# Values before any test ran, to check init_ray/shutdown_ray leave the environment as found.
_ENV_BEFORE = {
    name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
}


@pytest.fixture
def no_ray_address(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make sure no RAY_ADDRESS leaks in, and that Ray is down after the test either way."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    yield
    shutdown_ray()
    if ray.is_initialized():
        ray.shutdown()


@ray.remote(num_cpus=0.5)
def _square_and_where(x: int) -> tuple[int, str]:
    return x * x, ray.util.get_node_ip_address()


def test_local_cluster_on_loopback(no_ray_address: None) -> None:
    with ray_cluster(num_cpus=4) as handle:
        assert handle.started_cluster and handle.owns_connection
        assert handle.node_ip == LOOPBACK
        assert handle.address.startswith(f"{LOOPBACK}:")
        nodes = ray.nodes()
        assert len(nodes) == 1 and nodes[0]["Alive"]
        assert nodes[0]["NodeManagerAddress"] == LOOPBACK
        assert ray.cluster_resources()["CPU"] == 4.0
        assert ray.cluster_resources()["object_store_memory"] == 512 * 1024**2
        assert ray.get([_square_and_where.remote(i) for i in range(4)]) == [
            (i * i, LOOPBACK) for i in range(4)
        ]
        # Idempotent: a second call reuses the running cluster ...
        assert init_ray(num_cpus=8) is handle
        assert init_ray(address=handle.address) is handle
        assert ray.cluster_resources()["CPU"] == 4.0
        # ... and calls nest: their shutdown_ray calls leave the outer block's cluster running
        shutdown_ray()
        shutdown_ray()
        assert ray.is_initialized() and ray.get(_square_and_where.remote(2)) == (4, LOOPBACK)
        # ... but never stands in silently for a different cluster.
        with pytest.raises(ValueError, match=r"already initialised .* not the requested address '127\.0\.0\.1:1'"):
            init_ray(address="127.0.0.1:1")

        # A second driver joins the same cluster by address; its shutdown only disconnects it.
        joined = _join_from_subprocess(handle.address)
        assert joined == {"node_ip": LOOPBACK, "cpus": 4.0, "started_cluster": False}
        assert ray.get(_square_and_where.remote(3)) == (9, LOOPBACK)
    assert not ray.is_initialized()
    # Environment exported for the cluster is removed again (unless the user had set it).
    assert {name: os.environ.get(name) for name in _ENV_BEFORE} == _ENV_BEFORE


def _join_from_subprocess(address: str) -> dict:
    """Run ``init_ray(address=...)`` in a fresh Python process and report what it saw."""
    script = textwrap.dedent(
        f"""
        import json, ray
        from nemo_rl.distributed.ray_bootstrap import init_ray, shutdown_ray
        handle = init_ray(address={address!r})
        result = {{"node_ip": handle.node_ip, "cpus": ray.cluster_resources()["CPU"],
                   "started_cluster": handle.started_cluster}}
        shutdown_ray()
        print("RESULT" + json.dumps(result))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line.removeprefix("RESULT"))


def test_ray_started_elsewhere_is_left_alone(
    no_ray_address: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Someone else's plain ray.init (kept on loopback the same way init_ray does).
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    with _loopback_node_ip():
        ray.init(
            num_cpus=1,
            include_dashboard=False,
            object_store_memory=100 * 1024**2,
            _node_ip_address=LOOPBACK,
        )
    assert ray.nodes()[0]["NodeManagerAddress"] == LOOPBACK
    handle = init_ray()
    assert isinstance(handle, RayHandle)
    assert not handle.started_cluster and not handle.owns_connection
    shutdown_ray()
    assert ray.is_initialized()
    ray.shutdown()


def test_local_cluster_settings_hold_inside_the_block_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray._private import ray_constants

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")  # the user's value is kept
    flag = ray_constants.ENABLE_RAY_CLUSTER
    with local_cluster_settings():
        assert os.environ["RAY_AUTH_MODE"] == "disabled"
        assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
        assert ray_constants.ENABLE_RAY_CLUSTER is False  # node addresses stay on loopback
    assert "RAY_AUTH_MODE" not in os.environ
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    assert ray_constants.ENABLE_RAY_CLUSTER is flag


def test_unreachable_address_raises_connection_error(no_ray_address: None) -> None:
    with pytest.raises(ConnectionError, match=r"127\.0\.0\.1:1") as info:
        init_ray(address="127.0.0.1:1", connect_timeout_s=5.0)
    assert "RAY_ADDRESS" in str(info.value)
    assert not ray.is_initialized()


def test_unreachable_address_from_env_raises(
    no_ray_address: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ConnectionError, match=r"127\.0\.0\.1:1"):
        init_ray(connect_timeout_s=5.0)


def test_malformed_address_raises(no_ray_address: None) -> None:
    with pytest.raises(ConnectionError, match="host:port"):
        init_ray(address="no-port-here")


def test_local_options_with_address_raise(no_ray_address: None) -> None:
    with pytest.raises(ValueError, match="num_cpus"):
        init_ray(address="127.0.0.1:6379", num_cpus=4)


def test_ray_client_address_raises(no_ray_address: None) -> None:
    with pytest.raises(ValueError, match="ray://"):
        init_ray(address="ray://127.0.0.1:10001")
