"""Prompt datasets from the synthetic task, JSONL/Parquet files and HF dataset folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.rollout_config import DataConfig
from nemo_rl.data.dataloader import StatefulPromptLoader
from nemo_rl.data.datasets import (
    PromptDataset,
    check_prompt_lengths,
    check_rows_have,
    load_rows,
    setup_datasets,
    setup_synthetic_sft_dataset,
)
from nemo_rl.data.files import DataError
from nemo_rl.data.interfaces import TaskDataSpec
from nemo_rl.data.llm_message_utils import message_logs_to_flat, rl_collate_fn

ROWS = [{"question": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(6)]
SPEC = TaskDataSpec(task_name="math", prompt=None, system_prompt=None)


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl_parquet_and_dataset_folder_give_the_same_rows(tmp_path: Path) -> None:
    jsonl = _jsonl(tmp_path / "train.jsonl", ROWS)
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    folder = tmp_path / "my_dataset"  # a dataset name resolved like a hub name
    folder.mkdir()
    _jsonl(folder / "train.jsonl", ROWS)
    for source in (jsonl, parquet, folder):
        assert [dict(r) for r in load_rows(str(source))] == ROWS


def test_unsupported_suffix(tmp_path: Path) -> None:
    csv = tmp_path / "rows.csv"
    csv.write_text("a\n1\n")
    with pytest.raises(ValueError, match="unsupported data file suffix '.csv'"):
        load_rows(str(csv))


def test_custom_keys(chat_tokenizer: Any, tmp_path: Path) -> None:
    rows = load_rows(str(_jsonl(tmp_path / "t.jsonl", ROWS)))
    ds = PromptDataset(
        rows, chat_tokenizer, SPEC, 128, prompt_key="question", answer_key="solution"
    )
    assert len(ds) == 6
    datum = ds[2]
    assert datum["idx"] == 2 and datum["extra_env_info"] == {"ground_truth": "3"}
    assert "What is 2 + 1?" in datum["message_log"][0]["content"]


@pytest.mark.parametrize("from_file", [False, True])
def test_row_without_prompt_names_row_and_key(
    chat_tokenizer: Any, tmp_path: Path, from_file: bool
) -> None:
    rows: Any = [dict(r) for r in ROWS]
    del rows[4]["question"]
    rows[4]["query"] = "What is 4 + 1?"
    source = "rows"
    if from_file:
        source = str(_jsonl(tmp_path / "bad.jsonl", rows))
        rows = load_rows(source)
    with pytest.raises(DataError, match=r"row 4 has no field 'question' \(data.prompt_key\)"):
        PromptDataset(rows, chat_tokenizer, SPEC, 128, prompt_key="question", source=source)


def test_unknown_task_in_a_row_is_refused_when_the_data_loads(chat_tokenizer: Any) -> None:
    rows = [{"prompt": "p", "answer": "1"}, {"prompt": "p", "answer": "1", "task_name": "chess"}]
    message = (
        "mix.jsonl: row 1: task 'chess' \\(from its task_name field\\) has no environment "
        "\\(configured tasks: \\['math', 'prompt', 'reward_fn', 'sft'\\]\\)"
    )
    with pytest.raises(DataError, match=message):
        PromptDataset(rows, chat_tokenizer, SPEC, 64, source="mix.jsonl")


def test_check_rows_have_on_lists() -> None:
    check_rows_have([{"a": 1}], "a", "data.answer_key", "x")
    with pytest.raises(DataError, match="row 1 has no field 'a' .*fields are \\['b'\\]"):
        check_rows_have([{"a": 1}, {"b": 2}], "a", "data.answer_key", "x")


def test_check_prompt_lengths(chat_tokenizer: Any) -> None:
    rows = [
        {"prompt": "What is 1 + 1?", "answer": "2"},
        {"prompt": "What is 1 + 1? " * 5, "answer": "2"},
    ]
    ds = PromptDataset(rows, chat_tokenizer, SPEC, 16)
    short, long = ds.prompt_length(0), ds.prompt_length(1)
    assert short < long and ds[1]["length"] == 16 and ds[1]["loss_multiplier"] == 0.0
    stats = check_prompt_lengths(ds, long + 1)
    assert stats == {
        "min_prompt_tokens": short,
        "max_prompt_tokens": long,
        "num_too_long": 0,
        "num_checked": 2,
    }
    message = f"policy.max_total_sequence_length \\({long}\\).*row 1 has {long}"
    with pytest.raises(ValueError, match=message):
        check_prompt_lengths(ds, long)
    assert check_prompt_lengths(ds, long, allow_truncation=True)["num_too_long"] == 1
    with pytest.raises(ValueError, match="data.max_input_seq_length \\(4\\).*2 of 2"):
        check_prompt_lengths(ds, 4, "data.max_input_seq_length", allow_truncation=True)


def test_default_config_is_the_synthetic_task(chat_tokenizer: Any) -> None:
    cfg = GRPOMasterConfig()
    train, val, spec = setup_datasets(cfg.data, chat_tokenizer)
    assert cfg.data.dataset_name == "synthetic_arithmetic"
    assert len(train) == cfg.data.synthetic.num_train and len(val) == cfg.data.synthetic.num_val
    assert spec["task_name"] == "math"
    assert "Give the answer as \\boxed{N}." in train[0]["message_log"][0]["content"]
    check_prompt_lengths(train, cfg.policy.max_total_sequence_length)
    loader = StatefulPromptLoader(train, cfg.grpo.num_prompts_per_step, seed=cfg.grpo.seed)
    batch = next(iter(loader))
    assert batch.size == cfg.grpo.num_prompts_per_step
    for log, info in zip(batch["message_log"], batch["extra_env_info"]):
        a, b = log[0]["content"].split("What is ")[1].split("?")[0].split(" + ")
        assert info["ground_truth"] == str(int(a) + int(b))


def test_files_templates_and_system_prompt(chat_tokenizer: Any, tmp_path: Path) -> None:
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("Solve: {}", encoding="utf-8")
    system_file = tmp_path / "system.txt"
    system_file.write_text("You add numbers.", encoding="utf-8")
    cfg = DataConfig(
        dataset_name="local",
        train_path=str(_jsonl(tmp_path / "train.jsonl", ROWS)),
        val_path=str(_jsonl(tmp_path / "val.jsonl", ROWS[:2])),
        prompt_key="question",
        answer_key="solution",
        prompt_file=str(prompt_file),
        system_prompt_file=str(system_file),
        max_input_seq_length=128,
    )
    train, val, spec = setup_datasets(cfg, chat_tokenizer)
    assert (len(train), len(val)) == (6, 2)
    log = train[1]["message_log"]
    assert [m["role"] for m in log] == ["system", "user"]
    assert log[0]["content"] == "<|im_start|>system\nYou add numbers.<|im_end|>\n"
    assert log[1]["content"] == (
        "<|im_start|>user\nSolve: What is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_hf_name_split_and_missing_val(chat_tokenizer: Any, tmp_path: Path) -> None:
    folder = tmp_path / "hub_like"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", ROWS)
    _jsonl(folder / "test.jsonl", ROWS[:3])
    cfg = DataConfig(
        dataset_name=str(folder), prompt_key="question", answer_key="solution",
        val_split="test", max_input_seq_length=64,
    )
    train, val, _ = setup_datasets(cfg, chat_tokenizer)
    assert (len(train), len(val)) == (6, 3)
    no_val = cfg.model_copy(update={"val_split": None})
    assert setup_datasets(no_val, chat_tokenizer)[1] is None


def test_synthetic_sft_set_masks_exactly_the_reply(chat_tokenizer: Any) -> None:
    cfg = GRPOMasterConfig()
    sft = setup_synthetic_sft_dataset(cfg.data, chat_tokenizer, 8)
    train, _, _ = setup_datasets(cfg.data, chat_tokenizer)
    batch = rl_collate_fn([sft[i] for i in range(len(sft))])
    flat = message_logs_to_flat(batch["message_log"], chat_tokenizer.pad_token_id)
    for row in range(8):
        prompt_log = train[row]["message_log"]
        assert batch["message_log"][row][:-1][0]["content"] == prompt_log[0]["content"]
        n = int(flat["input_lengths"][row])
        reply = chat_tokenizer.decode(flat["input_ids"][row, :n][flat["token_mask"][row, :n] == 1])
        answer = batch["extra_env_info"][row]["ground_truth"]
        assert reply == f"\\boxed{{{answer}}}<|im_end|>"
    with pytest.raises(ValueError, match="data.dataset_name='synthetic_arithmetic' without"):
        setup_synthetic_sft_dataset(DataConfig(dataset_name="x", max_input_seq_length=8), None, 1)


def test_train_path_is_read_whatever_dataset_name_says(chat_tokenizer: Any, tmp_path: Path) -> None:
    path = str(_jsonl(tmp_path / "own.jsonl", ROWS))
    cfg = DataConfig(  # dataset_name keeps its default, "synthetic_arithmetic"
        train_path=path, prompt_key="question", answer_key="solution", max_input_seq_length=64
    )
    train, val, spec = setup_datasets(cfg, chat_tokenizer)
    assert len(train) == 6 and train.source == path and val is None
    assert spec["prompt"] is None  # no synthetic answer-format instruction on own prompts
    assert "What is 2 + 1?" in train[2]["message_log"][-1]["content"]
    assert train[2]["extra_env_info"] == {"ground_truth": "3"}


def test_chat_format_rows(chat_tokenizer: Any) -> None:
    rows = [{"messages": [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Sum 1 1"},
    ], "answer": "2"}]
    ds = PromptDataset(rows, chat_tokenizer, SPEC, 128, prompt_key="messages")
    log = ds[0]["message_log"]
    assert [m["role"] for m in log] == ["system", "user", "assistant", "user"]
    assert "".join(m["content"] for m in log) == chat_tokenizer.apply_chat_template(
        rows[0]["messages"], tokenize=False, add_generation_prompt=True
    )
    bad = [{"messages": [{"role": "user"}], "answer": "2"}]
    with pytest.raises(ValueError, match="message 0 must be"):
        PromptDataset(bad, chat_tokenizer, SPEC, 128, prompt_key="messages")[0]


def test_rows_must_hold_what_their_environment_declares(chat_tokenizer: Any) -> None:
    from nemo_rl.environments.config import EnvConfigs

    tasks = EnvConfigs.model_validate({"number_guess": {}}).specs()
    spec = TaskDataSpec(task_name="number_guess", prompt=None, system_prompt=None)
    rows = [{"prompt": "Guess 1-9", "secret": 3}, {"prompt": "Guess 1-9", "low": 1}]
    with pytest.raises(DataError) as info:
        PromptDataset(rows, chat_tokenizer, spec, 64, source="games.jsonl", tasks=tasks)
    assert str(info.value) == (
        "games.jsonl: row 1 has no field 'secret', which the environment of task "
        "'number_guess' needs; its fields are ['low', 'prompt']. Add it to every row of the task"
    )
    mixed = [{"prompt": "Guess", "secret": 3}, {"prompt": "1+1", "task_name": "math"}]
    with pytest.raises(DataError, match="row 1 has no field 'answer' \\(read from the field "
                                        "'answer', set by data.answer_key\\)"):
        PromptDataset(mixed, chat_tokenizer, spec, 64, source="mix", tasks=tasks)
    ok = PromptDataset(mixed[:1], chat_tokenizer, spec, 64, tasks=tasks)
    assert ok[0]["extra_env_info"] == {"secret": 3} and ok[0]["task_name"] == "number_guess"


def test_an_answer_key_naming_no_field_of_the_rows_is_refused(
    chat_tokenizer: Any, tmp_path: Path
) -> None:
    """A renamed answer column must be a field of every row (null: that row has no answer),
    as the prompt column must; before, a typo trained with answer None everywhere."""
    from nemo_rl.environments.config import EnvConfigs

    tasks = EnvConfigs.model_validate({"number_guess": {}}).specs()
    rows = [{"question": f"Guess {i}", "secret": i, "allowed": "0123"} for i in range(3)]
    rows[2]["allowed"] = None
    path = str(_jsonl(tmp_path / "own.jsonl", rows))
    base = {"prompt_key": "question", "task_name": "number_guess", "max_input_seq_length": 64}
    with pytest.raises(DataError) as info:
        setup_datasets(DataConfig(train_path=path, answer_key="alowed", **base), chat_tokenizer, tasks)
    assert str(info.value) == (
        f"{path}: row 0 has no field 'alowed' (data.answer_key); its fields are ['allowed', "
        "'question', 'secret']. Fix the row or set data.answer_key to the field holding it "
        "(or to null for none)"
    )
    del rows[1]["allowed"]
    _jsonl(tmp_path / "own.jsonl", rows)
    with pytest.raises(DataError, match="own.jsonl: row 1 has no field 'allowed'"):
        setup_datasets(DataConfig(train_path=path, answer_key="allowed", **base), chat_tokenizer, tasks)
    mixed = DataConfig(train_datasets=[{"path": path, "answer_key": "allowed"}], **base)
    with pytest.raises(DataError, match="row 1 has no field 'allowed' "
                                        "\(data.train_datasets\[0\].answer_key\)"):
        setup_datasets(mixed, chat_tokenizer, tasks)
    val = str(_jsonl(tmp_path / "val.jsonl", [{"question": "Guess", "secret": 1}]))
    ok = str(_jsonl(tmp_path / "ok.jsonl", rows[:1]))
    with pytest.raises(DataError, match="val.jsonl: row 0 has no field 'allowed'"):
        setup_datasets(DataConfig(train_path=ok, val_path=val, answer_key="allowed", **base),
                       chat_tokenizer, tasks)
    # the default 'answer' may be absent (rows without answers), a null answer is no answer
    train, _, _ = setup_datasets(DataConfig(train_path=path, **base), chat_tokenizer, tasks)
    assert "answer" not in train.canonical_row(0)
    rows[1]["allowed"] = None
    _jsonl(tmp_path / "own.jsonl", rows)
    train, _, _ = setup_datasets(DataConfig(train_path=path, answer_key="allowed", **base),
                                 chat_tokenizer, tasks)
    assert [train.canonical_row(i).get("answer") for i in range(3)] == ["0123", None, None]


def test_missing_data_file_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="data.train_path: file 'missing.jsonl' does not exist"):
        DataConfig(train_path="missing.jsonl")


def test_datasets_mixed_by_weight_with_their_own_keys_and_tasks(
    chat_tokenizer: Any, tmp_path: Path
) -> None:
    from nemo_rl.environments.config import EnvConfigs

    sums = _jsonl(tmp_path / "sums.jsonl", ROWS)  # question / solution, task math
    games = _jsonl(tmp_path / "games.jsonl", [{"prompt": f"Guess {i}", "secret": i} for i in range(4)])
    cfg = DataConfig(
        train_datasets=[
            {"path": str(sums), "weight": 3.0, "prompt_key": "question", "answer_key": "solution"},
            {"path": str(games), "weight": 1.0, "task_name": "number_guess"},
        ],
        max_input_seq_length=64,
    )
    assert not cfg.uses_synthetic
    tasks = EnvConfigs.model_validate({"number_guess": {}}).specs()
    train, val, _ = setup_datasets(cfg, chat_tokenizer, tasks, seed=5)
    assert val is None and len(train) == 10 and train.counts == [8, 2]  # 3:1 of 6 + 4 rows
    items = [train[k] for k in range(len(train))]
    assert [d["idx"] for d in items] == list(range(10))
    assert [d["task_name"] for d in items] == ["math"] * 8 + ["number_guess"] * 2
    truths = sorted(d["extra_env_info"]["ground_truth"] for d in items[:8])
    assert set(truths) == {str(i + 1) for i in range(6)}  # every row once, two repeated
    assert all("secret" in d["extra_env_info"] for d in items[8:])
    assert train.prompt_length(9) == len(items[9]["message_log"][0]["token_ids"]) + sum(
        len(m["token_ids"]) for m in items[9]["message_log"][1:]
    )
    again, _, _ = setup_datasets(cfg, chat_tokenizer, tasks, seed=5)
    assert again.index == train.index
    with pytest.raises(ValueError, match="data.train_datasets and data.train_path both"):
        DataConfig(train_datasets=[{"path": str(sums)}], train_path=str(sums))
    with pytest.raises(ValueError, match="data.train_datasets\\[\\].path: file 'x.jsonl' does"):
        DataConfig(train_datasets=[{"path": "x.jsonl"}])


def test_demonstrations_file_for_the_warm_start(chat_tokenizer: Any, tmp_path: Path) -> None:
    from nemo_rl.data.datasets import setup_demonstration_dataset

    demos = _jsonl(tmp_path / "demos.jsonl", [
        {"question": "What is 2 * 3?", "reply": "<calc>2 * 3</calc>", "task_name": "calculator"},
    ])
    cfg = DataConfig(prompt_key="question", task_name="calculator", max_input_seq_length=64)
    ds = setup_demonstration_dataset(cfg, str(demos), chat_tokenizer, response_key="reply")
    datum = ds[0]
    assert datum["task_name"] == "sft"
    assert datum["message_log"][-1]["role"] == "assistant"
    assert datum["message_log"][-1]["content"] == "<calc>2 * 3</calc><|im_end|>"
    with pytest.raises(DataError, match="row 0 has no field 'response' \\(sft_warmup.response_key\\)"):
        setup_demonstration_dataset(cfg, str(demos), chat_tokenizer)
