"""Reward-model training end to end on CPU (``nemo-rl rm``'s run on configs/rm_tiny_cpu.yaml):
real Ray and a Megatron worker whose LM head is a scalar score head, the synthetic task's
preference pairs (correct vs off-by-one-or-two answers). One run, several checks: training
raises the pair accuracy on the validation pairs (drawn with another seed; the 25 questions of
operands 0-4 recur) well above chance and lowers the Bradley-Terry loss from about log 2; the
final checkpoint exports as an HF sequence classifier that scores the validation pairs as the
run did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nemo_rl.algorithms import rm
from nemo_rl.algorithms.rm_config import RMMasterConfig
from nemo_rl.utils.config import load_typed_config
from nemo_rl.utils.logger import read_metrics_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Validation metrics by step of the tiny recipe as shipped, and its checkpoint folder."""
    tmp = tmp_path_factory.mktemp("rm")
    cfg = load_typed_config(
        REPO / "configs" / "rm_tiny_cpu.yaml",
        [
            f"logger.log_dir={tmp / 'logs'}",
            "logger.console_enabled=false",
            f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
            "checkpointing.save_period=1000",  # the last step only
            # 128 pairs = 48 + 48 + 32: the last validation batch is padded with masked pairs
            "rm.val_global_batch_size=48",
        ],
        RMMasterConfig,
    )
    assert rm.run(cfg) is None
    records = read_metrics_jsonl(tmp / "logs" / "metrics.jsonl")
    validation = {r["step"]: r["metrics"] for r in records if r["prefix"] == "validation"}
    return {"validation": validation, "checkpoints": tmp / "ckpt", "tmp": tmp, "cfg": cfg}


def test_held_out_pair_accuracy_rises(run: dict[str, Any]) -> None:
    validation = run["validation"]
    start, end = validation[0], validation[max(validation)]
    assert sorted(validation) == [0, 20, 40, 60]
    assert abs(start["loss"] - 0.6931) < 0.01, start  # a near-zero head: -log sigmoid(~0)
    # 128 held-out pairs: the standard error of an accuracy is at most 0.044
    assert end["accuracy"] >= 0.75, validation
    assert end["rewards_chosen_mean"] > end["rewards_rejected_mean"], end
    assert end["loss"] < start["loss"] - 0.1, validation


def test_export_scores_the_validation_pairs_as_the_run_did(run: dict[str, Any]) -> None:
    """The exported HF classifier, on all the run's validation pairs (rows padded with its
    pad_token_id), gives the run's last validation metrics: the validation scored every pair
    once, the last partial batch too, and weighted the batches by their pairs."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from nemo_rl.algorithms.dpo import load_preference_datasets
    from nemo_rl.algorithms.supervised import sft_train_data
    from nemo_rl.data.conversations import preference_collate_fn
    from nemo_rl.models.policy.export import export_checkpoint

    hf = run["tmp"] / "hf"
    export_checkpoint(run["checkpoints"], hf)
    model = AutoModelForSequenceClassification.from_pretrained(hf).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    _, val = load_preference_datasets(run["cfg"], tokenizer)
    data = sft_train_data(preference_collate_fn([val[i] for i in range(len(val))]), 0)
    with torch.no_grad():
        rewards = model(input_ids=data["input_ids"]).logits[:, 0]
    chosen, rejected = rewards[0::2], rewards[1::2]
    end = run["validation"][max(run["validation"])]
    assert model.config.pad_token_id == 0
    assert end["num_valid_samples"] == 2 * len(chosen) == 256
    assert abs(float((chosen > rejected).double().mean()) - end["accuracy"]) <= 1 / len(chosen)
    assert float(chosen.mean()) == pytest.approx(end["rewards_chosen_mean"], abs=1e-4)
    assert float(rejected.mean()) == pytest.approx(end["rewards_rejected_mean"], abs=1e-4)
