"""What a rollout-trained run (GRPO, distillation) reads before anything starts: the model
folder, its tokenizer, the prompts.

:func:`load_run_inputs` is the first part of their ``setup`` (then
:func:`~nemo_rl.algorithms.rollout_run.start_rollout_run`);
:func:`check_run_inputs` runs the same reads for ``nemo-rl launch slurm``, so bad data is
refused before the job waits in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from nemo_rl.algorithms.rollout_config import RolloutMasterConfig


@dataclass(frozen=True)
class RunInputs:
    """A run's model folder, tokenizer (``pad_token_id``: its pad token, else EOS) and prompt
    datasets (``val`` None without a validation split)."""

    model_path: str
    tokenizer: Any
    pad_token_id: int
    train: Any
    val: Optional[Any]


def load_run_inputs(cfg: RolloutMasterConfig) -> RunInputs:
    """Resolve ``policy.model_name``, load its tokenizer, and load and check every prompt row.

    Raises:
        ModelNotFoundError: ``policy.model_name`` names no model here or on the hub.
        DataError: a data file that does not parse, a row without its prompt, task or a field
            its environment needs, or a prompt too long for ``policy.max_total_sequence_length``.
    """
    from transformers import AutoTokenizer

    from nemo_rl.data.datasets import check_prompt_lengths, setup_datasets
    from nemo_rl.models.model_path import resolve_model_path

    model_path = resolve_model_path(cfg.policy.model_name, field="policy.model_name")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train, val, _ = setup_datasets(cfg.data, tokenizer, cfg.env.specs(), cfg.loop.seed)
    check_prompt_lengths(train, cfg.policy.max_total_sequence_length)
    return RunInputs(model_path, tokenizer, pad, train, val)


def check_run_inputs(cfg: RolloutMasterConfig) -> None:
    """The checks of :func:`load_run_inputs` that this machine can make without a download:
    all of them when the model is here (a local folder, a tiny model, a cached hub snapshot);
    otherwise the local data files are parsed (their rows are checked on the cluster, with the
    tokenizer).

    Raises:
        DataError: as :func:`load_run_inputs`.
    """
    from nemo_rl.data.files import read_data_file
    from nemo_rl.models.model_path import local_model_path

    if local_model_path(cfg.policy.model_name) is not None:
        load_run_inputs(cfg)
        return
    data = cfg.data
    sources = [data.train_path, data.val_path, *(s.path for s in data.train_datasets)]
    for source in sources:
        if source is not None and Path(source).is_file():
            read_data_file(Path(source))
