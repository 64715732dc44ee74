"""Direct Preference Optimisation: the ``nemo-rl dpo`` command.

Each step trains :class:`~nemo_rl.algorithms.loss.DPOLossFn` on a batch of preference pairs
(:class:`~nemo_rl.data.conversations.PreferenceDataset`; the chosen row of each pair directly
before its rejected row) against the frozen reference policy (the model's initial weights,
kept by the policy workers), in the shared supervised run (:mod:`nemo_rl.algorithms.supervised`).
Validation reports the same metrics (``loss``, ``accuracy``, ``rewards_chosen_mean``,
``rewards_rejected_mean``...) on the validation pairs without updates.
"""

from __future__ import annotations

from typing import Any

from nemo_rl.algorithms import supervised
from nemo_rl.algorithms.dpo_config import DPOMasterConfig, PreferenceMasterConfig
from nemo_rl.algorithms.loss import DPOLossFn
from nemo_rl.algorithms.supervised import SupervisedAlgorithm
from nemo_rl.data.conversations import PreferenceDataset, preference_collate_fn
from nemo_rl.data.datasets import Rows, load_rows
from nemo_rl.data.synthetic import SYNTHETIC_ARITHMETIC, synthetic_preference_rows


def load_preference_datasets(
    cfg: PreferenceMasterConfig, tokenizer: Any
) -> tuple[PreferenceDataset, PreferenceDataset | None]:
    """(training set, validation set or None) of a DPO or RM run: ``data.train_path`` /
    ``data.val_path``, or the synthetic task's pairs (training rows from
    ``data.synthetic.seed``, validation rows from ``seed + 1``).

    Raises:
        nemo_rl.data.files.DataError: a line that does not parse, or a row without its prompt,
            chosen or rejected reply (naming the file, row and field).
    """
    data, max_len = cfg.data, cfg.policy.max_total_sequence_length

    def dataset(rows: Rows, source: str) -> PreferenceDataset:
        return PreferenceDataset(rows, tokenizer, max_len, data.keys, source)

    if data.train_path is None:
        syn = data.synthetic
        return (
            dataset(synthetic_preference_rows(syn, syn.num_train, syn.seed), SYNTHETIC_ARITHMETIC),
            dataset(synthetic_preference_rows(syn, syn.num_val, syn.seed + 1), SYNTHETIC_ARITHMETIC),
        )
    train = dataset(load_rows(data.train_path), data.train_path)
    val = dataset(load_rows(data.val_path), data.val_path) if data.val_path is not None else None
    return train, val


def dpo_algorithm(cfg: DPOMasterConfig) -> SupervisedAlgorithm:
    """DPO as a supervised algorithm: its loss (the ``dpo`` section's loss keys), two rows per
    pair, reference logprobs unless ``reference_free``."""
    return SupervisedAlgorithm(
        section="dpo",
        loss_fn=DPOLossFn(cfg.dpo),
        rows_per_sample=2,
        needs_reference=not cfg.dpo.reference_free,
        plot_curves=(("train", "loss"), ("validation", "accuracy")),
    )


def check_preference_inputs(cfg: PreferenceMasterConfig) -> None:
    """``nemo-rl launch slurm``'s checks of a DPO or RM run's data
    (:func:`supervised.check_inputs`)."""
    supervised.check_inputs(cfg, lambda tok: load_preference_datasets(cfg, tok))


def run_preference_command(cfg: PreferenceMasterConfig, algorithm: SupervisedAlgorithm) -> int | None:
    """A command training ``algorithm`` on the preference pairs ``cfg.data`` names (DPO, RM).

    Returns:
        None when the run finished; 75 when it saved and stopped early.
    """
    return supervised.run_command(
        supervised.setup(
            cfg, algorithm, lambda tok: load_preference_datasets(cfg, tok), preference_collate_fn
        )
    )


def run(cfg: DPOMasterConfig) -> int | None:
    """``nemo-rl dpo``: DPO on preference pairs against the frozen initial policy.

    Returns:
        None when the run finished; 75 when it saved and stopped early.
    """
    return run_preference_command(cfg, dpo_algorithm(cfg))
