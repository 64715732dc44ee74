"""The node registration check run inside slurm jobs (its success path runs in
tests/functional/test_slurm_launcher.py against a real two-node cluster)."""

from __future__ import annotations

import pytest

from nemo_rl.distributed.ray_bootstrap import ray_cluster
from nemo_rl.launch import exit_codes
from nemo_rl.launch.wait_for_nodes import main, registered_slurm_nodes, wait_for_nodes


def test_unreachable_head_exits_with_nodes_missing(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--address", "127.0.0.1:1", "--nodes", "node1,node2", "--timeout-s", "2"])
    assert code == exit_codes.NODES_MISSING
    assert "cannot reach a Ray cluster at '127.0.0.1:1'" in capsys.readouterr().err


def test_missing_nodes_are_named_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with ray_cluster(num_cpus=1):
        assert registered_slurm_nodes() == {}  # a node without the slurm_node: resource
        with pytest.raises(TimeoutError) as info:
            wait_for_nodes(["node1", "node2"], timeout_s=0.5, poll_s=0.1)
    assert str(info.value).startswith(
        "Ray nodes of slurm node(s) node1, node2 did not register with the head within 0.5 s "
        "(registered: none)"
    )
