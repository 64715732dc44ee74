"""Task processors: DatumSpec fields, truncation, SFT rows, the processor registry."""

from __future__ import annotations

from typing import Any

import pytest

from nemo_rl.utils.plugins import PluginError

from nemo_rl.data.files import DataError
from nemo_rl.data.interfaces import TaskDataSpec
from nemo_rl.data.processors import (
    get_processor,
    math_data_processor,
    message_log_length,
    prompt_only_processor,
    reward_fn_processor,
    sft_data_processor,
)

SPEC = TaskDataSpec(
    task_name="math", prompt="{} Give the answer as \\boxed{{N}}.", system_prompt=None
)


def test_math_processor(chat_tokenizer: Any) -> None:
    row = {"prompt": "What is 3 + 4?", "answer": 7}
    datum = math_data_processor(row, SPEC, chat_tokenizer, 256, 5)
    assert datum["extra_env_info"] == {"ground_truth": "7"}
    assert datum["idx"] == 5 and datum["task_name"] == "math" and datum["stop_strings"] is None
    assert datum["loss_multiplier"] == 1.0
    assert datum["length"] == message_log_length(datum["message_log"]) < 256
    assert "What is 3 + 4? Give the answer as \\boxed{N}." in datum["message_log"][0]["content"]


def test_row_task_name_wins(chat_tokenizer: Any) -> None:
    row = {"prompt": "p", "answer": "1", "task_name": "other"}
    assert math_data_processor(row, SPEC, chat_tokenizer, 64, 0)["task_name"] == "other"


def test_math_processor_without_answer(chat_tokenizer: Any) -> None:
    with pytest.raises(KeyError, match="row 9 .*data.answer_key"):
        math_data_processor({"prompt": "p"}, SPEC, chat_tokenizer, 64, 9)


def test_overlong_prompt_is_truncated_and_masked(chat_tokenizer: Any) -> None:
    row = {"prompt": "What is 3 + 4?", "answer": "7"}
    full = math_data_processor(row, SPEC, chat_tokenizer, 10_000, 0)
    cut = math_data_processor(row, SPEC, chat_tokenizer, full["length"] - 5, 0)
    assert cut["loss_multiplier"] == 0.0
    assert cut["length"] == full["length"] - 5 == message_log_length(cut["message_log"])
    kept = full["message_log"][0]["token_ids"][:-5]
    assert cut["message_log"][0]["token_ids"].tolist() == kept.tolist()
    exact = math_data_processor(row, SPEC, chat_tokenizer, full["length"], 0)
    assert exact["loss_multiplier"] == 1.0


def test_prompt_only_processor_passes_fields(chat_tokenizer: Any) -> None:
    datum = prompt_only_processor({"prompt": "Guess", "target": 42}, SPEC, chat_tokenizer, 64, 1)
    assert datum["extra_env_info"] == {"target": 42}


def test_sft_processor(chat_tokenizer: Any) -> None:
    row = {"prompt": "What is 3 + 4?", "answer": "7", "response": "\\boxed{7}"}
    datum = sft_data_processor(row, SPEC, chat_tokenizer, 256, 0)
    reply = datum["message_log"][-1]
    assert reply["role"] == "assistant" and reply["content"] == "\\boxed{7}<|im_end|>"
    assert reply["token_ids"][-1].item() == chat_tokenizer.eos_token_id
    assert datum["length"] == message_log_length(datum["message_log"])
    assert datum["extra_env_info"] == {"ground_truth": "7"}
    short = sft_data_processor(row, SPEC, chat_tokenizer, datum["length"] - 1, 0)
    assert short["loss_multiplier"] == 0.0 and short["length"] == datum["length"] - 1


def test_sft_reply_as_messages_trains_the_assistant_turns_only(chat_tokenizer: Any) -> None:
    """An agent's exchange: the tool result between the assistant turns is context (the
    ``token_mask`` leaves it out), and the whole renders as the chat template renders it."""
    from nemo_rl.data.llm_message_utils import message_logs_to_flat

    reply = [
        {"role": "assistant", "content": "<tool_call>3 + 4</tool_call>"},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "\\boxed{7}"},
    ]
    row = {"prompt": "What is 3 + 4?", "answer": "7", "response": reply}
    datum = sft_data_processor(row, SPEC, chat_tokenizer, 256, 0)
    log = datum["message_log"]
    assert [m["role"] for m in log] == ["user", "assistant", "tool", "assistant"]
    whole = chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": SPEC["prompt"].format(row["prompt"])}, *reply],
        tokenize=False,
    )
    assert "".join(m["content"] for m in log) == whole
    assert log[2]["content"] == "<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    flat = message_logs_to_flat([log], chat_tokenizer.pad_token_id)
    trained = flat["input_ids"][0][flat["token_mask"][0].bool()]
    assert chat_tokenizer.decode(trained) == (
        "<tool_call>3 + 4</tool_call><|im_end|>\n\\boxed{7}<|im_end|>\n"
    )
    assert datum["length"] == message_log_length(log)
    with pytest.raises(DataError, match="row 3: 'response' has no assistant message"):
        sft_data_processor({**row, "response": [reply[1]]}, SPEC, chat_tokenizer, 256, 3)


def test_processor_by_name_or_import_path() -> None:
    assert get_processor("math") is math_data_processor
    path = "nemo_rl.data.processors:prompt_only_processor"
    assert get_processor(path) is prompt_only_processor
    with pytest.raises(KeyError, match="env.x.processor='chess': no data processor.*registered"):
        get_processor("chess", "env.x.processor")
    with pytest.raises(PluginError, match="cannot be called as processor\\(datum_dict"):
        get_processor("os.path:basename", "env.x.processor")


def test_reward_fn_processor_keeps_the_raw_prompt_answer_and_other_fields(
    chat_tokenizer: Any,
) -> None:
    row = {"prompt": "Name a fruit", "answer": None, "task_name": "t", "colour": "red"}
    datum = reward_fn_processor(row, SPEC, chat_tokenizer, 64, 0)
    assert datum["extra_env_info"] == {
        "prompt": "Name a fruit", "answer": None, "metadata": {"colour": "red"}
    }


def test_reward_fn_metadata_holds_renamed_prompt_and_answer_columns(chat_tokenizer: Any) -> None:
    """What the README says: ``metadata`` is every field of the row but prompt, answer and
    task_name, so the columns data.prompt_key / answer_key name are in it under their names."""
    from nemo_rl.data.datasets import PromptDataset, processor_tasks

    rows = [{"instruction": "Write digits.", "allowed": "0123", "level": 2}]
    spec = TaskDataSpec(task_name="reward_fn", prompt=None, system_prompt=None)
    dataset = PromptDataset(rows, chat_tokenizer, spec, 64, prompt_key="instruction",
                            answer_key="allowed", tasks=processor_tasks())
    assert dataset[0]["extra_env_info"] == {
        "prompt": "Write digits.", "answer": "0123",
        "metadata": {"instruction": "Write digits.", "allowed": "0123", "level": 2},
    }
