"""Prompt datasets: rows from the synthetic task, local JSONL/JSON/Parquet files or HF ``datasets``.

Every source ends up as a sequence of row dicts (a list, or a ``datasets.Dataset``), read by
:class:`PromptDataset`, which checks up front that every row has its prompt, names a known task
and holds the fields that task's environment declares, and turns row ``i`` into a
:class:`~nemo_rl.data.interfaces.DatumSpec` with the processor of the row's task.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
from torch.utils.data import Dataset

from nemo_rl.data.files import DataError, read_data_file
from nemo_rl.data.interfaces import DatumSpec, TaskDataProcessFnCallable, TaskDataSpec
from nemo_rl.data.processors import PROCESSORS
from nemo_rl.data.synthetic import (
    SYNTHETIC_ARITHMETIC,
    SYNTHETIC_TASK_NAME,
    default_prompt_template,
    synthetic_arithmetic_sft_rows,
    synthetic_arithmetic_splits,
)
from nemo_rl.data.templates import load_prompt_file

Rows = Sequence[Mapping[str, Any]]


class TaskRows(NamedTuple):
    """How the rows of one task are read: its processor and the fields its environment needs
    (:class:`~nemo_rl.environments.registry.EnvironmentSpec` has the same two attributes and
    is accepted wherever a TaskRows is)."""

    processor: TaskDataProcessFnCallable
    required_fields: tuple[str, ...] = ()


def processor_tasks() -> dict[str, TaskRows]:
    """Each registered processor as a task of the same name, needing no field (what a
    :class:`PromptDataset` reads when it is given no environments' tasks)."""
    return {name: TaskRows(fn) for name, fn in PROCESSORS.items()}


def load_rows(source: str, split: str = "train", subset: Optional[str] = None) -> Rows:
    """Rows of a local ``.jsonl``/``.json``/``.parquet`` file or of an HF dataset.

    A local file is read by :func:`nemo_rl.data.files.read_data_file` (a bad line is named as
    file:line); any other ``source`` goes to ``datasets.load_dataset`` as a hub name or a local
    dataset folder (``subset`` is its config name).

    Raises:
        nemo_rl.data.files.DataError: an unsupported suffix or a line that does not parse.
    """
    path = Path(source)
    if path.is_file():
        return read_data_file(path)
    import datasets

    return datasets.load_dataset(source, subset, split=split)


def _column(rows: Rows, key: str) -> Sequence[Any]:
    """Values of field ``key`` per row (None where missing)."""
    column_names = getattr(rows, "column_names", None)
    if column_names is not None:
        return rows[key] if key in column_names else [None] * len(rows)
    return [row.get(key) for row in rows]


def _present_fields(row: Mapping[str, Any]) -> list[str]:
    return sorted(k for k, v in dict(row).items() if v is not None)


def check_rows_have(
    rows: Rows, key: str, config_key: str, source: str, allow_null: bool = False
) -> None:
    """Raise if some row lacks field ``key`` (missing, or null unless ``allow_null``).

    Raises:
        DataError: naming the first bad row index, the field, ``config_key`` and ``source``.
    """
    column_names = getattr(rows, "column_names", None)
    if allow_null and column_names is not None:
        bad = [] if key in column_names else [0]
    elif allow_null:
        bad = [idx for idx, row in enumerate(rows) if key not in row][:1]
    else:
        bad = [idx for idx, value in enumerate(_column(rows, key)) if value is None][:1]
    if bad:
        null_hint = " (or to null for none)" if allow_null else ""
        raise DataError(
            f"{source}: row {bad[0]} has no field {key!r} ({config_key}); its fields are "
            f"{_present_fields(rows[bad[0]])}. Fix the row or set {config_key} to the field "
            f"holding it{null_hint}"
        )


class PromptDataset(Dataset):
    """Rows turned into :class:`DatumSpec` on access by each row's task processor.

    Args:
        rows: row dicts (a list or a ``datasets.Dataset``).
        tokenizer: HF tokenizer.
        task_data_spec: default task name, prompt template and system prompt.
        max_seq_length: prompts longer than this (tokens) are cut and get loss_multiplier 0.
        prompt_key: field holding the prompt: a text, or a list of ``{"role", "content"}``
            messages (chat format); checked on every row here.
        answer_key: field holding the ground truth, or None when the task has none.
        source: name of the rows' origin for error messages (a path or dataset name).
        tasks: ``{task name: TaskRows}`` of the run's environments; every row's task (its
            ``task_name`` field, else ``task_data_spec["task_name"]``) must be one, and the
            row must have the task's required fields (both checked here). None: the
            registered processors as tasks (:func:`processor_tasks`).
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
        tasks: Optional[Mapping[str, TaskRows]] = None,
    ) -> None:
        check_rows_have(rows, prompt_key, "data.prompt_key", source)
        self.rows = rows
        self.tokenizer = tokenizer
        self.task_data_spec = task_data_spec
        self.max_seq_length = max_seq_length
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.source = source
        self.tasks = dict(processor_tasks() if tasks is None else tasks)
        self._check_tasks()

    def _task_of(self, idx: int, row: Mapping[str, Any]) -> str:
        """Task name of row ``idx``.

        Raises:
            DataError: the task is not one of ``self.tasks``.
        """
        task = row.get("task_name") or self.task_data_spec["task_name"]
        if task not in self.tasks:
            origin = "its task_name field" if row.get("task_name") else "data.task_name"
            raise DataError(
                f"{self.source}: row {idx}: task {task!r} (from {origin}) has no environment "
                f"(configured tasks: {sorted(self.tasks)}); fix the row or configure env.{task}"
            )
        return task

    def _check_tasks(self) -> None:
        """Every row names a known task and has the fields that task's environment needs."""
        for idx in range(len(self.rows)):
            row = self.canonical_row(idx)
            task = self._task_of(idx, row)
            for name in self.tasks[task].required_fields:
                if row.get(name) is None:
                    mapped = {"prompt": "data.prompt_key", "answer": "data.answer_key"}.get(name)
                    hint = (
                        f" (read from the field {getattr(self, name + '_key')!r}, set by {mapped})"
                        if mapped
                        else ""
                    )
                    raise DataError(
                        f"{self.source}: row {idx} has no field {name!r}{hint}, which the "
                        f"environment of task {task!r} needs; its fields are "
                        f"{_present_fields(self.rows[idx])}. Add it to every row of the task"
                    )

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
        processor = self.tasks[self._task_of(idx, row)].processor
        return processor(row, self.task_data_spec, self.tokenizer, max_seq_length, idx)

    def __getitem__(self, idx: int) -> DatumSpec:
        return self._process(idx, self.max_seq_length)

    def prompt_length(self, idx: int) -> int:
        """Tokens of row ``idx``'s prompt before any truncation."""
        return self._process(idx, sys.maxsize)["length"]


class MixedPromptDataset(Dataset):
    """Several :class:`PromptDataset` mixed by weight into one epoch of ``sum(len)`` rows.

    Dataset ``i`` contributes ``round(weight_i / sum(weights) * total)`` rows (the last one
    takes the rounding remainder): its rows in a seeded random order, cycled when it has fewer.
    Item ``k`` is the datum of that row with ``idx`` = k, so indices stay unique in a batch.

    Args:
        datasets: the datasets, each already checked (prompts, tasks, required fields).
        weights: positive weight per dataset.
        seed: seed of each dataset's row order.
    """

    def __init__(self, datasets: Sequence[PromptDataset], weights: Sequence[float], seed: int):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        total = sum(len(d) for d in datasets)
        counts = [round(w / sum(weights) * total) for w in weights[:-1]]
        counts.append(total - sum(counts))
        self.datasets = list(datasets)
        self.index: list[tuple[int, int]] = []
        for i, (dataset, count) in enumerate(zip(datasets, counts)):
            generator = torch.Generator().manual_seed(seed + i)
            order = torch.randperm(len(dataset), generator=generator).tolist()
            self.index += [(i, order[j % len(order)]) for j in range(count)]
        self.counts = counts
        self.source = " + ".join(f"{d.source} x{c}" for d, c in zip(datasets, counts))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, k: int) -> DatumSpec:
        i, row = self.index[k]
        datum = self.datasets[i][row]
        datum["idx"] = k
        return datum

    def prompt_length(self, k: int) -> int:
        """Tokens of item ``k``'s prompt before any truncation."""
        i, row = self.index[k]
        return self.datasets[i].prompt_length(row)


def check_prompt_lengths(
    dataset: PromptDataset | MixedPromptDataset,
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


def build_task_data_spec(data_cfg: Any, synthetic_rows: Optional[bool] = None) -> TaskDataSpec:
    """The task spec of a :class:`~nemo_rl.algorithms.rollout_config.DataConfig`: its task name,
    the prompt template of ``prompt_file`` (the synthetic task's default instruction when the
    rows are synthetic and no file is set) and the system prompt of ``system_prompt_file``.

    ``synthetic_rows``: whether the rows the spec renders are the synthetic task's; None: the
    training rows' (``data_cfg.uses_synthetic``). A row of a file gets the same prompt in
    every split and command (an eval recipe with only ``val_path`` renders it as the
    training recipe with ``train_path`` did)."""
    prompt = load_prompt_file(data_cfg.prompt_file, "data.prompt_file")
    synthetic = data_cfg.uses_synthetic if synthetic_rows is None else synthetic_rows
    if prompt is None and synthetic:
        prompt = default_prompt_template(data_cfg.synthetic.answer_format)
    return TaskDataSpec(
        task_name=data_cfg.task_name or SYNTHETIC_TASK_NAME,
        prompt=prompt,
        system_prompt=load_prompt_file(data_cfg.system_prompt_file, "data.system_prompt_file"),
    )


class Split(NamedTuple):
    """Rows of one split, where they came from, and whether they use the canonical keys (the
    synthetic task's generated rows do; they alone get its default instruction)."""

    rows: Rows
    source: str
    canonical_keys: bool = False


def load_data_splits(data_cfg: Any) -> tuple[Split, Optional[Split]]:
    """(train split, validation split or None) of a DataConfig.

    ``train_path`` / ``val_path`` are read whenever they are set, whatever ``dataset_name``
    says. Otherwise ``"synthetic_arithmetic"`` generates the task (both splits; its validation
    split only goes with its own training split), and any other ``dataset_name`` is loaded
    from HF ``datasets`` (``dataset_subset``, ``train_split``, ``val_split``).
    """
    synthetic = data_cfg.dataset_name == SYNTHETIC_ARITHMETIC
    generated = synthetic_arithmetic_splits(data_cfg.synthetic) if data_cfg.uses_synthetic else None
    if data_cfg.train_datasets:
        train = Split([], "data.train_datasets")  # mixed by setup_datasets
    elif data_cfg.train_path is not None:
        train = Split(load_rows(data_cfg.train_path), data_cfg.train_path)
    elif generated is not None:
        train = Split(generated[0], SYNTHETIC_ARITHMETIC, canonical_keys=True)
    else:
        rows = load_rows(data_cfg.dataset_name, data_cfg.train_split, data_cfg.dataset_subset)
        train = Split(rows, data_cfg.dataset_name)
    if data_cfg.val_path is not None:
        val: Optional[Split] = Split(load_rows(data_cfg.val_path), data_cfg.val_path)
    elif generated is not None:
        val = Split(generated[1], f"{SYNTHETIC_ARITHMETIC} (val)", canonical_keys=True)
    elif data_cfg.val_split is not None and not synthetic:
        rows = load_rows(data_cfg.dataset_name, data_cfg.val_split, data_cfg.dataset_subset)
        val = Split(rows, f"{data_cfg.dataset_name} ({data_cfg.val_split})")
    else:
        val = None
    return train, val


def setup_datasets(
    data_cfg: Any,
    tokenizer: Any,
    tasks: Optional[Mapping[str, TaskRows]] = None,
    seed: int = 0,
) -> tuple[PromptDataset | MixedPromptDataset, Optional[PromptDataset], TaskDataSpec]:
    """Train and validation :class:`PromptDataset` of a DataConfig (prompts cut at
    ``data.max_input_seq_length``, which must be set) and their task spec; the training set
    is a :class:`MixedPromptDataset` when ``data.train_datasets`` lists several sources (each
    with its own keys and task).

    ``tokenizer`` renders with its chat template when it has one (see
    :mod:`nemo_rl.data.templates`); ``tasks`` are the run's environments' tasks, anything with
    ``processor`` and ``required_fields`` by task name (the
    :class:`~nemo_rl.environments.registry.EnvironmentSpec` of
    :meth:`nemo_rl.environments.config.EnvConfigs.specs`); None: the registered processors as
    tasks. ``seed`` orders the rows a mixture draws from each dataset.

    Raises:
        nemo_rl.data.files.DataError: a file that does not parse, a row without its prompt,
            without the field a renamed ``answer_key`` names (the default ``"answer"`` may be
            absent: rows without answers), with an unknown task or without a field its task's
            environment needs.
    """
    if data_cfg.max_input_seq_length is None:
        raise ValueError(
            "data.max_input_seq_length is unset; set it (GRPOMasterConfig fills it from "
            "policy.max_total_sequence_length)"
        )
    spec = build_task_data_spec(data_cfg)
    train_split, val_split = load_data_splits(data_cfg)

    def make(split: Split, source_cfg: Any = None, where: str = "data") -> PromptDataset:
        prompt_key = getattr(source_cfg, "prompt_key", None) or data_cfg.prompt_key
        answer_key = getattr(source_cfg, "answer_key", None) or data_cfg.answer_key
        if answer_key not in (None, "answer") and not split.canonical_keys:
            # A renamed answer column must exist; the default may be absent (no answers).
            answer_where = where if getattr(source_cfg, "answer_key", None) else "data"
            check_rows_have(
                split.rows, answer_key, f"{answer_where}.answer_key", split.source, allow_null=True
            )
        split_spec = build_task_data_spec(data_cfg, synthetic_rows=split.canonical_keys)
        task_name = getattr(source_cfg, "task_name", None)
        if task_name is not None:
            split_spec = TaskDataSpec(**{**split_spec, "task_name": task_name})
        return PromptDataset(
            split.rows,
            tokenizer,
            split_spec,
            data_cfg.max_input_seq_length,
            prompt_key="prompt" if split.canonical_keys else prompt_key,
            answer_key="answer" if split.canonical_keys else answer_key,
            source=split.source,
            tasks=tasks,
        )

    val = None if val_split is None else make(val_split)
    if not data_cfg.train_datasets:
        return make(train_split), val, spec
    parts = [
        make(Split(load_rows(s.path, s.split, s.subset), s.path), s, f"data.train_datasets[{i}]")
        for i, s in enumerate(data_cfg.train_datasets)
    ]
    weights = [s.weight for s in data_cfg.train_datasets]
    return MixedPromptDataset(parts, weights, seed), val, spec


def setup_synthetic_sft_dataset(data_cfg: Any, tokenizer: Any, num_rows: int) -> PromptDataset:
    """Warm-start rows of the synthetic task: the same prompts as :func:`setup_datasets`'s
    training split, each followed by its correct reply as an assistant message (task "sft").

    Raises:
        ValueError: when ``data.dataset_name`` is not the synthetic task.
    """
    if not data_cfg.uses_synthetic:
        raise ValueError(
            f"the SFT warm-start set exists for data.dataset_name={SYNTHETIC_ARITHMETIC!r} "
            f"without data.train_path only (got {data_cfg.dataset_name!r}, train_path "
            f"{data_cfg.train_path!r})"
        )
    spec = build_task_data_spec(data_cfg)
    return PromptDataset(
        synthetic_arithmetic_sft_rows(data_cfg.synthetic, num_rows),
        tokenizer,
        TaskDataSpec(task_name="sft", prompt=spec["prompt"], system_prompt=spec["system_prompt"]),
        data_cfg.max_input_seq_length,
        source=f"{SYNTHETIC_ARITHMETIC} (sft)",
    )


def setup_demonstration_dataset(
    data_cfg: Any, path: str, tokenizer: Any, response_key: str = "response"
) -> PromptDataset:
    """Warm-start rows of a demonstrations file: each row's prompt (``data.prompt_key``,
    rendered with the GRPO prompts' template and system prompt) followed by its reference
    reply (``response_key``) as an assistant message (task "sft", whatever the row's own
    ``task_name``).

    Raises:
        nemo_rl.data.files.DataError: a line that does not parse, or a row without its prompt
            or its reply (naming the file, row and field).
    """
    rows = load_rows(path)
    check_rows_have(rows, response_key, "sft_warmup.response_key", path)
    demos = [
        {**{k: v for k, v in dict(row).items() if k != "task_name"}, "response": row[response_key]}
        for row in rows
    ]
    spec = build_task_data_spec(data_cfg)
    return PromptDataset(
        demos,
        tokenizer,
        TaskDataSpec(task_name="sft", prompt=spec["prompt"], system_prompt=spec["system_prompt"]),
        data_cfg.max_input_seq_length,
        prompt_key=data_cfg.prompt_key,
        answer_key=data_cfg.answer_key,
        source=path,
    )
