"""The prompts ``nemo-rl eval`` sends are the ones training built for the same row: the README's
"Your own data and reward" pair of recipes (a GRPO recipe with ``data.train_path``, an eval
recipe with only ``data.val_path``, both on the same JSONL) give every row the same prompt
text and token ids. The eval recipe's data used to count as the synthetic task (no
``train_path``), so its prompts got the arithmetic instruction training never added."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.rollout_inputs import load_run_inputs
from nemo_rl.evals.config import EvalMasterConfig
from nemo_rl.evals.eval import prompt_batches
from nemo_rl.utils.config import load_typed_config

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def own_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with the README's prompts file and reward module, on sys.path."""
    rows = [{"instruction": f"Write a long number after {i}.", "allowed": "0123456789"}
            for i in range(6)]
    (tmp_path / "my_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_reward.py").write_text(
        "def score(prompt, response, answer, metadata):\n"
        "    return sum(c in answer for c in response) / max(len(response), 1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def prompt_ids(datum: Any) -> list[int]:
    return torch.cat([m["token_ids"] for m in datum["message_log"]]).tolist()


def prompt_text(datum: Any) -> str:
    return "".join(m["content"] for m in datum["message_log"])


def test_eval_prompts_equal_the_training_prompts_of_the_same_rows(
    own_data: Path, tiny_llama_path: Path
) -> None:
    data = "{prompt_key: instruction, answer_key: allowed, task_name: digits}"
    env = "{math: null, digits: {reward_fn: 'my_reward:score'}}"
    (own_data / "my_recipe.yaml").write_text(
        f"defaults: {REPO / 'configs' / 'grpo_tiny_cpu.yaml'}\n"
        f"data: {data[:-1]}, train_path: my_prompts.jsonl}}\nenv: {env}\n"
        "sft_warmup: {enabled: false}\n"
    )
    (own_data / "my_eval.yaml").write_text(
        f"defaults: {REPO / 'configs' / 'eval_tiny_cpu.yaml'}\n"
        f"generation: {{model_name: {tiny_llama_path}}}\n"
        f"data: {data[:-1]}, val_path: my_prompts.jsonl}}\nenv: {env}\n"
    )
    train_cfg = load_typed_config("my_recipe.yaml", [], GRPOMasterConfig)
    eval_cfg = load_typed_config("my_eval.yaml", ["eval.num_prompts_per_step=4"], EvalMasterConfig)
    inputs = load_run_inputs(train_cfg)
    trained = [inputs.train[i] for i in range(len(inputs.train))]
    batches = prompt_batches(eval_cfg, inputs.tokenizer)
    evaluated = [
        {"message_log": log, "idx": idx}
        for batch in batches for log, idx in zip(batch["message_log"], batch["idx"])
    ]
    assert [d["idx"] for d in evaluated] == [d["idx"] for d in trained] == list(range(6))
    assert [prompt_text(d) for d in evaluated] == [prompt_text(d) for d in trained]
    assert [prompt_ids(d) for d in evaluated] == [prompt_ids(d) for d in trained]
    assert "Write a long number after 3." in prompt_text(trained[3])
    assert "boxed" not in prompt_text(evaluated[3])
