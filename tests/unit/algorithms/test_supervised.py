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
                "metrics": {"accuracy": [loss / 10],
                            "num_valid_samples": [float(data["sample_mask"].sum())]}}


def make_run(chat_tokenizer: Any, losses: list[float], num_val: int = 8) -> SupervisedRun:
    cfg = load_typed_config(
        RECIPE,
        ["data.synthetic.num_train=8", f"data.synthetic.num_val={num_val}",
         "policy.train_global_batch_size=4", "policy.train_micro_batch_size=2",
         "dpo.val_global_batch_size=4", "dpo.val_micro_batch_size=2"],
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
    assert metrics == {"accuracy": 0.05, "num_valid_samples": 8.0, "loss": 0.5, "grad_norm": 1.5,
                       "lr": 1e-3}


def test_validation_averages_its_batches_in_eval_mode(chat_tokenizer: Any) -> None:
    run = make_run(chat_tokenizer, [0.4, 0.8])
    assert len(run.val_batches) == 2  # 8 pairs in batches of 4
    metrics = supervised.validate(run)
    assert [c["eval_mode"] for c in run.policy.calls] == [True, True]
    assert [(c["gbs"], c["mbs"]) for c in run.policy.calls] == [(8, 4), (8, 4)]
    assert abs(metrics["loss"] - 0.6) < 1e-12 and abs(metrics["accuracy"] - 0.06) < 1e-12
    assert metrics["num_valid_samples"] == 16  # every row of the 8 pairs


def test_validation_scores_every_pair_with_the_last_batch_padded(chat_tokenizer: Any) -> None:
    """``val_batches: 0`` scores the whole set: 10 pairs in batches of 4 are 3 batches, the
    last one's 2 pairs padded to a whole batch with masked copies (sample_mask 0: in no loss,
    no metric, no count); the metrics are the per-pair means over all 10 pairs."""
    run = make_run(chat_tokenizer, [0.4, 0.8, 0.2], num_val=10)
    assert run.cfg.dpo.val_batches == 0
    assert len(run.val_batches) == 3
    scored = [i for b in run.val_batches for i, m in zip(b["idx"], b["loss_multiplier"]) if m > 0]
    assert sorted(set(scored)) == list(range(10)) and len(scored) == 20  # chosen + rejected
    metrics = supervised.validate(run)
    masks = [c["data"]["sample_mask"].tolist() for c in run.policy.calls]
    assert masks[:2] == [[1.0] * 8] * 2 and masks[2] == [1.0] * 4 + [0.0] * 4
    assert [c["gbs"] for c in run.policy.calls] == [8, 8, 8]
    assert metrics["num_valid_samples"] == 20
    assert abs(metrics["loss"] - (0.4 * 8 + 0.8 * 8 + 0.2 * 4) / 20) < 1e-12
    run = make_run(chat_tokenizer, [0.4], num_val=2)  # fewer pairs than one batch
    assert len(run.val_batches) == 1 and run.val_batches[0]["loss_multiplier"].tolist() == [1.0] * 4 + [0.0] * 4
