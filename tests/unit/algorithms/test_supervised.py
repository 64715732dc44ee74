"""A supervised step and validation on a fake policy: what reaches Policy.train (pairs double
the batch sizes, DPO's reference logprobs, eval mode for validation) and how validation
averages its batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.algorithms import supervised
from nemo_rl.algorithms.dpo import dpo_algorithm, load_preference_datasets
from nemo_rl.algorithms.dpo_config import DPOMasterConfig
from nemo_rl.algorithms.supervised import SupervisedRun, validation_batches
from nemo_rl.data.conversations import preference_collate_fn
from nemo_rl.utils.config import load_typed_config
from nemo_rl.utils.timer import Timer

RECIPE = Path(__file__).resolve().parents[3] / "configs" / "dpo_tiny_cpu.yaml"


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_llama_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_path)


class FakePolicy:
    """Records train calls; reference logprobs are -1 per token; metric ``loss`` per call from
    a list."""

    def __init__(self, losses: list[float]) -> None:
        self.calls: list[dict[str, Any]] = []
        self.losses = losses

    def get_reference_policy_logprobs(self, data: Any) -> dict[str, torch.Tensor]:
        return {"reference_logprobs": -torch.ones(data["input_ids"].shape)}

    def train(self, data: Any, loss_fn: Any, eval_mode: bool = False, gbs: int = 0, mbs: int = 0) -> dict[str, Any]:
        self.calls.append({"data": data, "eval_mode": eval_mode, "gbs": gbs, "mbs": mbs})
        loss = self.losses[len(self.calls) - 1]
        return {"loss": [loss], "grad_norm": [None if eval_mode else 1.5], "lr": [1e-3],
                "metrics": {"accuracy": [loss / 10]}}


def make_run(chat_tokenizer: Any, losses: list[float]) -> SupervisedRun:
    cfg = load_typed_config(
        RECIPE,
        ["data.synthetic.num_train=8", "data.synthetic.num_val=8", "policy.train_global_batch_size=4",
         "policy.train_micro_batch_size=2", "dpo.val_global_batch_size=4", "dpo.val_micro_batch_size=2"],
        DPOMasterConfig,
    )
    _, val = load_preference_datasets(cfg, chat_tokenizer)
    return SupervisedRun(
        cfg=cfg, algorithm=dpo_algorithm(cfg), pad_token_id=chat_tokenizer.pad_token_id,
        policy=FakePolicy(losses), cluster=None, train_loader=None,
        val_batches=validation_batches(val, cfg.dpo, preference_collate_fn, "dpo"),
        logger=None, timer=Timer(), checkpointer=None, max_num_steps=2,
    )


def test_dpo_step_trains_pairs_with_reference_logprobs(chat_tokenizer: Any) -> None:
    run = make_run(chat_tokenizer, [0.5])
    train, _ = load_preference_datasets(run.cfg, chat_tokenizer)
    batches = iter([preference_collate_fn([train[i] for i in range(4)])])
    metrics = supervised.train_step(run, batches)
    (call,) = run.policy.calls
    assert (call["gbs"], call["mbs"], call["eval_mode"]) == (8, 4, False)  # rows: 2 per pair
    data = call["data"]
    assert data["input_ids"].shape[0] == 8
    assert torch.equal(data["reference_policy_logprobs"], -torch.ones(data["input_ids"].shape))
    assert metrics == {"accuracy": 0.05, "loss": 0.5, "grad_norm": 1.5, "lr": 1e-3}


def test_validation_averages_its_batches_in_eval_mode(chat_tokenizer: Any) -> None:
    run = make_run(chat_tokenizer, [0.4, 0.8])
    assert len(run.val_batches) == 2  # 8 pairs in batches of 4
    metrics = supervised.validate(run)
    assert [c["eval_mode"] for c in run.policy.calls] == [True, True]
    assert [(c["gbs"], c["mbs"]) for c in run.policy.calls] == [(8, 4), (8, 4)]
    assert abs(metrics["loss"] - 0.6) < 1e-12 and abs(metrics["accuracy"] - 0.06) < 1e-12
