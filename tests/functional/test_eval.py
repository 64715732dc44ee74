"""Export and evaluation of a trained checkpoint, end to end on CPU.

A tiny GRPO run (from the session's SFT-warmed tiny Llama, ``sft_warm_tiny_llama``, which
answers some of the synthetic task's problems right; a short in-run SFT warm start;
then one GRPO step validated with greedy decoding, checkpointed), colocated at policy TP=2
with generation TP=2 (each vLLM engine
spans both CPU bundles), is evaluated with ``nemo-rl eval``'s code on its checkpoint
folder (exported to HF on the fly, served by vLLM): with the validation's sampling settings
(greedy, the same prompts in the same batches) the accuracy is the one the validation logged,
and every response equals the greedy continuation of the Megatron model loaded from the saved
policy folder (the trained weights as the policy holds them), token for token as
``samples.jsonl`` records them (with the prompt's ids and the engine's logprobs); the
responses cut at ``max_new_tokens`` are the summary's ``num_truncated``. The run's first step also shows
that the refit of the warm-started weights reached both engine ranks: vLLM's logprobs agree with
the TP=2 policy's (token_mult_prob_error ~ 1) and the step is on-policy (ratio 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_rl.evals.config import EvalMasterConfig
from nemo_rl.evals.eval import run_eval
from nemo_rl.utils.logger import read_metrics_jsonl

from tiny_grpo import WARMUP, megatron_greedy, run_grpo, tiny_grpo_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

VAL_PROMPTS, VAL_BATCH, MAX_NEW_TOKENS = 16, 8, 8


@pytest.fixture(scope="module")
def trained(tmp_path_factory, sft_warm_tiny_llama) -> Path:
    """The run's folder: logs/ and ckpt/ (step_1 after warm start + one GRPO step), trained
    at policy TP=2 / generation TP=2 from the SFT-warmed model (shared with
    test_lora_recipes.py, so some validation answers are right). The run's own short warm
    start (WARMUP, at sft_warmup's lr 1e-3) moves the weights off the checkpoint the engines
    load, so only a refit that reaches both engine ranks leaves the first step on-policy."""
    tmp = tmp_path_factory.mktemp("trained")
    cfg = tiny_grpo_config(
        tmp / "logs",
        sft_warm_tiny_llama,
        grpo={"max_num_steps": 1, "val_period": 1, "val_greedy": True,
              "max_val_samples": VAL_PROMPTS, "val_batch_size": VAL_BATCH},
        sft_warmup=WARMUP,
        data={"synthetic": {"max_operand": 4, "num_val": VAL_PROMPTS}},
        checkpointing={"enabled": True, "checkpoint_dir": str(tmp / "ckpt"), "save_period": 1},
        tensor_parallel=2,
    )
    run_grpo(cfg)
    (tmp / "data.json").write_text(cfg.data.model_dump_json())
    return tmp


def eval_config(trained: Path) -> EvalMasterConfig:
    """Greedy, one sample per prompt, the validation's prompts and batches."""
    return EvalMasterConfig.model_validate({
        "eval": {"num_prompts_per_step": VAL_BATCH, "max_num_prompts": VAL_PROMPTS,
                 "save_path": str(trained / "eval")},
        "generation": {
            "model_name": str(trained / "ckpt"),
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": 0.0,
            "vllm_cfg": {"precision": "float32", "max_model_len": 64,
                         "kv_cache_memory_bytes": 16 * 1024**2, "enforce_eager": True},
        },
        "data": json.loads((trained / "data.json").read_text()),
        "cluster": {"cpus_per_node": 8},
    })


@pytest.fixture(scope="module")
def evaluated(trained) -> dict[str, float]:
    return run_eval(eval_config(trained))


def test_tp2_engines_after_refit_agree_with_the_tp2_policy(trained):
    (train,) = [
        r["metrics"] for r in read_metrics_jsonl(trained / "logs" / "metrics.jsonl")
        if r["prefix"] == "train"
    ]
    assert abs(train["probs_ratio"] - 1.0) < 1e-5
    assert abs(train["token_mult_prob_error"] - 1.0) < 1e-3
    layout = json.loads((trained / "ckpt" / "step_1" / "policy" / "layout.json").read_text())
    assert layout["tp"] == 2, layout


def test_eval_of_the_checkpoint_reproduces_its_last_validation(trained, evaluated):
    (validation,) = [
        r["metrics"] for r in read_metrics_jsonl(trained / "logs" / "metrics.jsonl")
        if r["prefix"] == "validation"
    ]
    assert validation["num_samples"] == evaluated["num_samples"] == VAL_PROMPTS
    assert evaluated["accuracy"] == validation["accuracy"]
    assert evaluated["pass@1"] == evaluated["accuracy"]
    summary = json.loads((trained / "eval" / "summary.json").read_text())
    assert summary == evaluated
    lines = (trained / "eval" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == VAL_PROMPTS


def test_exported_model_on_vllm_answers_as_the_saved_policy_greedily(trained, evaluated):
    from transformers import AutoTokenizer

    from nemo_rl.data.datasets import setup_datasets

    cfg = eval_config(trained)
    policy_dir = trained / "ckpt" / "step_1" / "policy"
    tokenizer = AutoTokenizer.from_pretrained(policy_dir / "hf_assets")
    _, val, _ = setup_datasets(cfg.data, tokenizer)
    prompts = [torch.cat([m["token_ids"] for m in val[i]["message_log"]]) for i in range(VAL_PROMPTS)]
    expected = megatron_greedy(policy_dir, prompts, tokenizer.eos_token_id, MAX_NEW_TOKENS)
    records = [json.loads(line) for line in (trained / "eval" / "samples.jsonl").read_text().splitlines()]
    records.sort(key=lambda r: r["prompt_index"])
    assert [r["response"] for r in records] == [tokenizer.decode(ids) for ids in expected]
    assert [r["response_token_ids"] for r in records] == expected
    assert [r["prompt_token_ids"] for r in records] == [ids.tolist() for ids in prompts]
    for r in records:
        assert len(r["response_logprobs"]) == len(r["response_token_ids"])
        assert all(-1e4 < lp <= 0.0 for lp in r["response_logprobs"]), r["response_logprobs"]
    cut = [len(ids) == MAX_NEW_TOKENS and ids[-1] != tokenizer.eos_token_id for ids in expected]
    assert [r["truncated"] for r in records] == cut
    assert evaluated["num_truncated"] == sum(cut)
