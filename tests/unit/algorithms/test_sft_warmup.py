"""SFT warm-start data and its config checks (the warm start itself runs in the functional
GRPO test: tests/functional/test_grpo.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.supervised import sft_train_data
from nemo_rl.data.datasets import setup_synthetic_sft_dataset
from nemo_rl.data.llm_message_utils import rl_collate_fn


def test_sft_train_data_trains_on_replies_of_untruncated_rows(tiny_llama_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    cfg = GRPOMasterConfig()
    rows = setup_synthetic_sft_dataset(cfg.data, tokenizer, 4)
    batch = rl_collate_fn([rows[i] for i in range(4)])
    batch["loss_multiplier"][2] = 0.0  # as the processor marks a truncated row
    data = sft_train_data(batch, pad_token_id=0)
    assert data["sample_mask"].tolist() == [1.0, 1.0, 0.0, 1.0]
    for row, log in enumerate(batch["message_log"]):
        reply = log[-1]["token_ids"]
        n = int(data["input_lengths"][row])
        assert n == sum(m["token_ids"].numel() for m in log)
        assert torch.equal(data["input_ids"][row, n - reply.numel() : n], reply)
        assert data["token_mask"][row].sum() == reply.numel()
        assert data["token_mask"][row, n - reply.numel() : n].eq(1).all()


def test_warmup_has_its_own_schedule_and_batch_default() -> None:
    cfg = GRPOMasterConfig.model_validate(
        {
            "grpo": {"max_num_steps": 10},
            "sft_warmup": {"enabled": True, "num_steps": 30, "lr": 2e-3, "min_lr": 5e-4},
        }
    )
    # GRPO's schedule covers the GRPO steps only; the warm start restarts from its own
    assert cfg.policy.megatron_cfg.scheduler.lr_decay_iters == 10
    assert cfg.sft_warmup.lr_schedule() == {
        "lr": 2e-3,
        "min_lr": 5e-4,
        "lr_decay_style": "linear",
        "lr_warmup_iters": 0,
        "lr_decay_iters": 30,
    }
    assert cfg.sft_warmup.global_batch_size == cfg.policy.train_global_batch_size
    with pytest.raises(ValueError, match=r"sft_warmup.min_lr \(0.01\) must be <= sft_warmup.lr"):
        GRPOMasterConfig.model_validate({"sft_warmup": {"lr": 1e-3, "min_lr": 1e-2}})


def test_warmup_needs_the_synthetic_task() -> None:
    with pytest.raises(ValueError, match="sft_warmup.enabled needs demonstrations: set "
                                         "sft_warmup.train_path"):
        GRPOMasterConfig.model_validate(
            {"sft_warmup": {"enabled": True}, "data": {"dataset_name": "my/dataset"}}
        )
