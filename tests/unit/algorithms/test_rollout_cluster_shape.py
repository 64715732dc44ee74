"""How a rollout-trained run divides a node's logical CPUs between its clusters and
environments (:func:`nemo_rl.algorithms.rollout_run._cluster_shape`, on GRPO recipes)."""

from __future__ import annotations

import pytest

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.rollout_run import _cluster_shape


def shape(colocated: bool, cpus: int, env: dict | None = None):
    cfg = GRPOMasterConfig.model_validate(
        {
            "policy": {"generation": {"colocated": {"enabled": colocated}}},
            "cluster": {"cpus_per_node": cpus, "cpu_bundles_per_node": 2},
            **({"env": env} if env else {}),
        }
    )
    return _cluster_shape(cfg), cfg.env.total_cpus


def test_non_colocated_clusters_leave_room_for_every_environment():
    env = {"math": {"num_cpus": 0.5}, "calculator": {"num_cpus": 1.0}}
    (bundles, use_gpus, per_bundle), env_cpus = shape(False, 8, env)
    assert bundles == [2] and not use_gpus and env_cpus == 1.5
    # two clusters of two bundles each, plus the environments, fit the node exactly
    assert 2 * 2 * per_bundle + env_cpus == 8


def test_colocated_cluster_takes_half_the_node():
    (_, _, per_bundle), _ = shape(True, 8)
    assert 2 * per_bundle == 4


@pytest.mark.parametrize("colocated", [True, False])
def test_too_few_cpus_for_the_environments_is_refused(colocated):
    with pytest.raises(ValueError, match=r"cluster.cpus_per_node=1 cannot hold .* \(3 CPUs"):
        shape(colocated, 1, {"math": {"num_cpus": 3.0}})
