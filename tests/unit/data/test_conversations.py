"""Chat rows and preference pairs: the assistant tokens the loss sees, pair layout, errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nemo_rl.data.conversations import (
    ChatDataset,
    PreferenceDataset,
    preference_collate_fn,
    preference_triple,
)
from nemo_rl.data.files import DataError
from nemo_rl.data.llm_message_utils import message_logs_to_flat
from nemo_rl.data.templates import render_conversation_texts

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 1 + 1?"},
    {"role": "assistant", "content": "2"},
]


def test_conversation_texts_give_the_assistant_only_its_reply(chat_tokenizer: Any) -> None:
    texts = render_conversation_texts(chat_tokenizer, CHAT)
    assert "".join(t for _, t in texts) == chat_tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert [t for r, t in texts if r == "assistant"] == ["5<|im_end|>\n", "2<|im_end|>\n"]
    # the assistant header belongs to the message before the reply
    assert texts[1] == ("user", "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_rows_mask_exactly_the_assistant_tokens(chat_tokenizer: Any) -> None:
    datum = ChatDataset([{"messages": CHAT}], chat_tokenizer, max_seq_length=256)[0]
    flat = message_logs_to_flat([datum["message_log"]], chat_tokenizer.pad_token_id)
    ids, mask = flat["input_ids"][0], flat["token_mask"][0].bool()
    expected = chat_tokenizer("5<|im_end|>\n2<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert ids[mask].tolist() == expected
    assert datum["loss_multiplier"] == 1.0 and datum["length"] == len(ids)


def test_a_cut_conversation_is_kept_out_of_the_loss(chat_tokenizer: Any) -> None:
    datum = ChatDataset([{"messages": CHAT}], chat_tokenizer, max_seq_length=12)[0]
    assert datum["loss_multiplier"] == 0.0 and datum["length"] == 12


def test_chat_rows_errors_name_the_row_and_field(chat_tokenizer: Any) -> None:
    with pytest.raises(DataError, match=r"train.jsonl: row 1 has no field 'messages' \(data.chat_key\)"):
        ChatDataset([{"messages": CHAT}, {"text": "x"}], chat_tokenizer, 64, source="train.jsonl")
    only_user = ChatDataset([{"messages": CHAT[:2]}], chat_tokenizer, 64, source="t.jsonl")
    with pytest.raises(DataError, match="t.jsonl: row 0: the conversation has no assistant"):
        only_user[0]
    bad = ChatDataset([{"messages": [{"role": "user"}]}], chat_tokenizer, 64, source="t.jsonl")
    with pytest.raises(DataError, match="t.jsonl: row 0: message 0 must be"):
        bad[0]


def test_plain_tokenizer_is_refused_for_chat_data(plain_tokenizer: Any) -> None:
    with pytest.raises(DataError, match="chat template"):
        ChatDataset([{"messages": CHAT}], plain_tokenizer, 64)[0]


def test_both_preference_formats_give_the_same_triple() -> None:
    flat = {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}
    nemo = {
        "context": [{"role": "user", "content": "What is 2 + 3?"}],
        "completions": [
            {"rank": 1, "completion": [{"role": "assistant", "content": "6"}]},
            {"rank": 0, "completion": [{"role": "assistant", "content": "5"}]},
        ],
    }
    keys = ("prompt", "chosen", "rejected")
    assert preference_triple(flat, keys, "x") == preference_triple(nemo, keys, "x")
    with pytest.raises(DataError, match=r"p.jsonl: row 3: no field 'rejected'"):
        PreferenceDataset([flat] * 3 + [{"prompt": "a", "chosen": "b"}], None, 64, source="p.jsonl")


def test_preference_batch_puts_chosen_before_rejected(chat_tokenizer: Any) -> None:
    rows = [
        {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"},
        {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3 " * 40},
    ]
    pairs = PreferenceDataset(rows, chat_tokenizer, max_seq_length=40)
    batch = preference_collate_fn([pairs[0], pairs[1]])
    replies = [log[-1]["content"] for log in batch["message_log"]]
    assert replies[:3] == ["5<|im_end|>\n", "6<|im_end|>\n", "2<|im_end|>\n"]
    # the second pair's rejected reply is cut: both of its rows leave the loss
    assert torch.equal(batch["loss_multiplier"], torch.tensor([1.0, 1.0, 0.0, 0.0]))
