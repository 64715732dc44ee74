"""Bradley-Terry reward-model training: the ``nemo-rl rm`` command.

The policy is built with a scalar score head in place of its LM head
(``policy.reward_model_cfg.enabled``; :mod:`nemo_rl.models.policy.workers.megatron.reward_head`):
the reward of a row is the head's value at its last real token. Each step trains
:class:`~nemo_rl.algorithms.loss.PreferenceLossFn`, ``-log sigmoid(r_chosen - r_rejected)``, on a
batch of preference pairs (the data and loading of DPO, :func:`~nemo_rl.algorithms.dpo.
load_preference_datasets`; the chosen row of each pair directly before its rejected row) in the
shared supervised run (:mod:`nemo_rl.algorithms.supervised`); no reference policy. Validation
reports the same metrics (``loss``, ``accuracy``, ``rewards_chosen_mean``,
``rewards_rejected_mean``) on the validation pairs without updates. A checkpoint exports
(``nemo-rl export``) as an HF ``...ForSequenceClassification`` model with one label, which
:class:`~nemo_rl.environments.reward_model_environment.RewardModelEnvironment` serves as a GRPO
reward.
"""

from __future__ import annotations

from nemo_rl.algorithms.dpo import run_preference_command
from nemo_rl.algorithms.loss import PreferenceLossFn
from nemo_rl.algorithms.rm_config import RMMasterConfig
from nemo_rl.algorithms.supervised import SupervisedAlgorithm

RM_ALGORITHM = SupervisedAlgorithm(
    section="rm",
    loss_fn=PreferenceLossFn(),
    rows_per_sample=2,
    needs_reference=False,
    plot_curves=(("train", "loss"), ("validation", "accuracy")),
)
"""The reward model as a supervised algorithm: the Bradley-Terry loss, two rows per pair."""


def run(cfg: RMMasterConfig) -> int | None:
    """``nemo-rl rm``: train a Bradley-Terry reward model on preference pairs.

    Returns:
        None when the run finished; 75 when it saved and stopped early.
    """
    return run_preference_command(cfg, RM_ALGORITHM)
