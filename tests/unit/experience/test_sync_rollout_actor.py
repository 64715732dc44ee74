"""The rollout actor of data-plane GRPO is importable by the path NeMo RL's TQ policy interface
names, ``nemo_rl.experience.sync_rollout_actor.SyncRolloutActor``, and that class is the one
:class:`~nemo_rl.algorithms.grpo_step.data_plane.DataPlaneBatchStore` starts."""

from __future__ import annotations

from typing import Any

import pytest

from nemo_rl.data_plane.config import DataPlaneConfig
from nemo_rl.experience.grouped_rollouts import RolloutRunner
from nemo_rl.models.policy.tq_policy import TQPolicy


def test_the_interface_path_is_the_actor_data_plane_grpo_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    from nemo_rl.algorithms.grpo_step.data_plane import DataPlaneBatchStore
    from nemo_rl.experience.sync_rollout_actor import SyncRolloutActor

    assert SyncRolloutActor.__module__ == "nemo_rl.experience.sync_rollout_actor"

    started: list[tuple[type, tuple[Any, ...]]] = []

    class Handle:
        pass

    def remote(**_options: Any) -> Any:
        """Ray's ``ray.remote(**options)(cls)``, recording the class instead of starting it."""

        def wrap(cls: type) -> Any:
            class ActorClass:
                @staticmethod
                def remote(*args: Any) -> Handle:
                    started.append((cls, args))
                    return Handle()

            return ActorClass

        return wrap

    monkeypatch.setattr(ray, "remote", remote)
    runner = RolloutRunner(
        generation=None, tokenizer=None, task_to_env={}, max_seq_len=64, max_rollout_turns=1,
        pad_token_id=0,
    )
    policy = object.__new__(TQPolicy)  # the store reads only these two attributes when it starts
    policy.tq_partition_id = "train"
    policy.dp_cfg = DataPlaneConfig(enabled=True, backend="ray_object_store")
    store = DataPlaneBatchStore(runner, policy, timer=None)

    assert started == [(SyncRolloutActor, (runner, policy.dp_cfg))]
    assert isinstance(store.actor, Handle)
