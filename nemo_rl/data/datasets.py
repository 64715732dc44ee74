"""Prompt datasets: rows from the synthetic task, local JSONL/Parquet files or HF ``datasets``.

Every source ends up as a sequence of row dicts (a list, or a ``datasets.Dataset``), read by
:class:`PromptDataset`, which checks the configured prompt field up front and turns row ``i``
into a :class:`~nemo_rl.data.interfaces.DatumSpec` with the row's task processor.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from torch.utils.data import Dataset

from nemo_rl.data.interfaces import DatumSpec, TaskDataSpec
from nemo_rl.data.processors import get_processor
from nemo_rl.data.synthetic import (
    SYNTHETIC_ARITHMETIC,
    SYNTHETIC_TASK_NAME,
    default_prompt_template,
    synthetic_arithmetic_sft_rows,
    synthetic_arithmetic_splits,
)
from nemo_rl.data.templates import load_prompt_file

# File suffix -> the `datasets` builder that reads it.
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

Rows = Sequence[Mapping[str, Any]]


def load_rows(source: str, split: str = "train", subset: Optional[str] = None) -> Rows:
    """Rows of a local ``.jsonl``/``.json``/``.parquet`` file or of an HF dataset.

    Both go through ``datasets.load_dataset``: a local file with the builder of its suffix, any
    other ``source`` as a hub name or a local dataset folder (``subset`` is its config name).

    Raises:
        ValueError: for a local file of an unsupported suffix.
    """
    import datasets

    path = Path(source)
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"{source}: unsupported data file suffix {path.suffix!r}; use one of "
                f"{sorted(_FILE_BUILDERS)}"
            )
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    return datasets.load_dataset(source, subset, split=split)


def _column(rows: Rows, key: str) -> Sequence[Any]:
    """Values of field ``key`` per row (None where missing)."""
    column_names = getattr(rows, "column_names", None)
    if column_names is not None:
        return rows[key] if key in column_names else [None] * len(rows)
    return [row.get(key) for row in rows]


def check_rows_have(rows: Rows, key: str, config_key: str, source: str) -> None:
    """Raise if some row lacks field ``key`` (missing or null).

    Raises:
        KeyError: naming the first bad row index, the field, ``config_key`` and ``source``.
    """
    for idx, value in enumerate(_column(rows, key)):
        if value is None:
            present = sorted(k for k, v in dict(rows[idx]).items() if v is not None)
            raise KeyError(
                f"{source}: row {idx} has no field {key!r} ({config_key}); its fields are "
                f"{present}. Fix the row or set {config_key} to the field holding it"
            )


class PromptDataset(Dataset):
    """Rows turned into :class:`DatumSpec` on access by each row's task processor.

    Args:
        rows: row dicts (a list or a ``datasets.Dataset``).
        tokenizer: HF tokenizer.
        task_data_spec: default task name, prompt template and system prompt.
        max_seq_length: prompts longer than this (tokens) are cut and get loss_multiplier 0.
        prompt_key: field holding the prompt text; checked on every row here.
        answer_key: field holding the ground truth, or None when the task has none.
        source: name of the rows' origin for error messages (a path or dataset name).
    """

    def __init__(
        self,
        rows: Rows,
        tokenizer: Any,
        task_data_spec: TaskDataSpec,
        max_seq_length: int,
        prompt_key: str = "prompt",
        answer_key: Optional[str] = "answer",
        source: str = "dataset",
    ) -> None:
        check_rows_have(rows, prompt_key, "data.prompt_key", source)
        self.rows = rows
        self.tokenizer = tokenizer
        self.task_data_spec = task_data_spec
        self.max_seq_length = max_seq_length
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.source = source

    def __len__(self) -> int:
        return len(self.rows)

    def canonical_row(self, idx: int) -> dict[str, Any]:
        """Row ``idx`` with its prompt under ``"prompt"`` and its answer under ``"answer"``."""
        row = dict(self.rows[idx])
        row["prompt"] = row[self.prompt_key]
        if self.answer_key is not None and row.get(self.answer_key) is not None:
            row["answer"] = row[self.answer_key]
        return row

    def _process(self, idx: int, max_seq_length: int) -> DatumSpec:
        if not 0 <= idx < len(self):
            raise IndexError(f"row {idx} out of range for {self.source} of {len(self)} rows")
        row = self.canonical_row(idx)
        task_name = row.get("task_name") or self.task_data_spec["task_name"]
        try:
            processor = get_processor(task_name)
        except KeyError as err:
            raise KeyError(f"{self.source}: row {idx}: {err.args[0]}") from None
        return processor(row, self.task_data_spec, self.tokenizer, max_seq_length, idx)

    def __getitem__(self, idx: int) -> DatumSpec:
        return self._process(idx, self.max_seq_length)

    def prompt_length(self, idx: int) -> int:
        """Tokens of row ``idx``'s prompt before any truncation."""
        return self._process(idx, sys.maxsize)["length"]


def check_prompt_lengths(
    dataset: PromptDataset,
    max_seq_len: int,
    config_key: str = "policy.max_total_sequence_length",
    allow_truncation: bool = False,
    max_rows: Optional[int] = None,
) -> dict[str, int]:
    """Check that prompts leave room to generate within ``max_seq_len`` tokens.

    Args:
        dataset: the prompts.
        max_seq_len: token budget of prompt plus generation (the value of ``config_key``).
        config_key: the config field named in the error.
        allow_truncation: when True only fail if no prompt fits; over-long prompts are then
            truncated and masked from the loss by the processors.
        max_rows: check only the first this many rows (None: all).

    Returns:
        ``{"min_prompt_tokens", "max_prompt_tokens", "num_too_long", "num_checked"}``.

    Raises:
        ValueError: naming ``config_key``, the longest prompt's row and its length.
    """
    n = len(dataset) if max_rows is None else min(max_rows, len(dataset))
    if n == 0:
        raise ValueError(f"{dataset.source} has no rows")
    lengths = [dataset.prompt_length(i) for i in range(n)]
    longest = max(range(n), key=lengths.__getitem__)
    too_long = sum(length >= max_seq_len for length in lengths)
    if too_long == n or (too_long and not allow_truncation):
        raise ValueError(
            f"{config_key} ({max_seq_len}) leaves no room to generate for {too_long} of {n} "
            f"prompts of {dataset.source}: row {longest} has {lengths[longest]} prompt tokens "
            f"(shortest {min(lengths)}). Raise {config_key} above {lengths[longest]} or "
            "shorten the prompts"
        )
    return {
        "min_prompt_tokens": min(lengths),
        "max_prompt_tokens": lengths[longest],
        "num_too_long": too_long,
        "num_checked": n,
    }


def build_task_data_spec(data_cfg: Any) -> TaskDataSpec:
    """The task spec of a :class:`~nemo_rl.algorithms.grpo_config.DataConfig`: its task name,
    the prompt template of ``prompt_file`` (the synthetic task's default instruction when unset)
    and the system prompt of ``system_prompt_file``."""
    prompt = load_prompt_file(data_cfg.prompt_file, "data.prompt_file")
    if prompt is None and data_cfg.dataset_name == SYNTHETIC_ARITHMETIC:
        prompt = default_prompt_template(data_cfg.synthetic.answer_format)
    return TaskDataSpec(
        task_name=data_cfg.task_name or SYNTHETIC_TASK_NAME,
        prompt=prompt,
        system_prompt=load_prompt_file(data_cfg.system_prompt_file, "data.system_prompt_file"),
    )


def load_data_splits(data_cfg: Any) -> tuple[Rows, Optional[Rows], str]:
    """(train rows, validation rows or None, source name) of a DataConfig.

    ``dataset_name == "synthetic_arithmetic"`` generates the task; otherwise ``train_path`` /
    ``val_path`` are read when set, and ``dataset_name`` is loaded from HF ``datasets``
    (``dataset_subset``, ``train_split``, ``val_split``) for a split without a path.
    """
    if data_cfg.dataset_name == SYNTHETIC_ARITHMETIC:
        train, val = synthetic_arithmetic_splits(data_cfg.synthetic)
        return train, val, SYNTHETIC_ARITHMETIC
    if data_cfg.train_path is not None:
        train, source = load_rows(data_cfg.train_path), data_cfg.train_path
    else:
        train = load_rows(data_cfg.dataset_name, data_cfg.train_split, data_cfg.dataset_subset)
        source = data_cfg.dataset_name
    if data_cfg.val_path is not None:
        val = load_rows(data_cfg.val_path)
    elif data_cfg.val_split is not None:
        val = load_rows(data_cfg.dataset_name, data_cfg.val_split, data_cfg.dataset_subset)
    else:
        val = None
    return train, val, source


def setup_datasets(
    data_cfg: Any, tokenizer: Any
) -> tuple[PromptDataset, Optional[PromptDataset], TaskDataSpec]:
    """Train and validation :class:`PromptDataset` of a DataConfig (prompts cut at
    ``data.max_input_seq_length``, which must be set) and their task spec.

    ``tokenizer`` renders with its chat template when it has one (see
    :mod:`nemo_rl.data.templates`)."""
    if data_cfg.max_input_seq_length is None:
        raise ValueError(
            "data.max_input_seq_length is unset; set it (GRPOMasterConfig fills it from "
            "policy.max_total_sequence_length)"
        )
    spec = build_task_data_spec(data_cfg)
    train_rows, val_rows, source = load_data_splits(data_cfg)
    synthetic = data_cfg.dataset_name == SYNTHETIC_ARITHMETIC

    def make(rows: Rows, name: str) -> PromptDataset:
        return PromptDataset(
            rows,
            tokenizer,
            spec,
            data_cfg.max_input_seq_length,
            # The synthetic rows always use the canonical keys.
            prompt_key="prompt" if synthetic else data_cfg.prompt_key,
            answer_key="answer" if synthetic else data_cfg.answer_key,
            source=name,
        )

    train = make(train_rows, source if data_cfg.train_path is None else data_cfg.train_path)
    val = None if val_rows is None else make(val_rows, data_cfg.val_path or f"{source} (val)")
    return train, val, spec


def setup_synthetic_sft_dataset(data_cfg: Any, tokenizer: Any, num_rows: int) -> PromptDataset:
    """Warm-start rows of the synthetic task: the same prompts as :func:`setup_datasets`'s
    training split, each followed by its correct reply as an assistant message (task "sft").

    Raises:
        ValueError: when ``data.dataset_name`` is not the synthetic task.
    """
    if data_cfg.dataset_name != SYNTHETIC_ARITHMETIC:
        raise ValueError(
            f"the SFT warm-start set exists for data.dataset_name={SYNTHETIC_ARITHMETIC!r} only "
            f"(got {data_cfg.dataset_name!r})"
        )
    spec = build_task_data_spec(data_cfg)
    return PromptDataset(
        synthetic_arithmetic_sft_rows(data_cfg.synthetic, num_rows),
        tokenizer,
        TaskDataSpec(task_name="sft", prompt=spec["prompt"], system_prompt=spec["system_prompt"]),
        data_cfg.max_input_seq_length,
        source=f"{SYNTHETIC_ARITHMETIC} (sft)",
    )
