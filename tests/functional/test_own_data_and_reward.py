"""The README's "Your own data and reward" example, run as written: a JSONL of own prompts and a
reward function in a module of its own (written here, imported by the Ray actors through
PYTHONPATH) train through ``nemo-rl grpo`` with recipe keys only and the reward rises; then
``nemo-rl export`` turns the last checkpoint into an HF folder and ``nemo-rl eval`` reports
pass@1, pass@2 and maj@2 (over the answers the example's ``answer_fn`` extracts) on it with
vLLM. The recipes sit in a folder outside the repository and name the shipped configs they
build on by name. Eval's prompts are training's for the same rows, token for token, and its
samples record the response token ids with their logprobs. Greedy, the exported folder (in
transformers) continues every prompt as the saved policy does (the Megatron model loaded from
the checkpoint's policy folder).

The task (answer in digits, scored by the share of digit characters) is unlike the built-in
arithmetic: no math-verify, no warm start, a random tiny model. On this machine the sampled
reward averages 0.0033 over steps 1-5 and 0.020 over steps 16-20 (0.0037, 0.0021, ... 0.0183,
0.0258); the check asks for a threefold rise of the 5-step mean.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.data.datasets import setup_datasets
from nemo_rl.evals.config import EvalMasterConfig
from nemo_rl.utils.config import load_typed_config

from tiny_grpo import megatron_greedy, train_records

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Your own data and reward"


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block of the README section, in order."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index(SECTION)
    section = text[start : text.index("\n## ", start + len(SECTION))]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.DOTALL)


def test_readme_example_trains_exports_and_evaluates_own_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = readme_blocks()
    assert [lang for lang, _ in blocks] == ["python", "yaml", "yaml", "bash"]
    for lang, code in blocks[:3]:
        name = code.splitlines()[0].removeprefix("# ").strip()  # "# my_reward.py"
        (tmp_path / name).write_text(code, encoding="utf-8")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),  # this checkout's nemo_rl, below the example's "."
    }
    run = subprocess.run(
        ["bash", "-e", "-c", blocks[3][1]], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    records = train_records(tmp_path / "results" / "digits" / "logs")
    assert sorted(records) == list(range(1, 21))
    assert all(m["rollout/env_errors"] == 0 for m in records.values())
    rewards = [records[step]["reward"] for step in range(1, 21)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > 3 * first and last > 0.01, rewards

    # the evaluation of the exported last step: 16 prompts x 4 samples
    summary = json.loads((tmp_path / "results/digits/eval/summary.json").read_text())
    assert summary["num_prompts"] == 16 and summary["num_samples"] == 16 * 4
    assert {"pass@1", "pass@2", "maj@2"} <= set(summary)
    assert 0.0 <= summary["pass@1"] <= summary["pass@2"] <= 1.0
    assert summary["num_truncated"] >= 0
    samples = [json.loads(line) for line in
               (tmp_path / "results/digits/eval/samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16 * 4
    for sample in samples:  # maj@2 voted over what answer_fn extracted
        digits = "".join(ch for ch in sample["response"] if ch.isdigit()) or None
        assert sample["answer"] == digits
        assert len(sample["response_logprobs"]) == len(sample["response_token_ids"]) > 0

    # eval's prompts are the ones training built for the same rows (the README's two recipes)
    monkeypatch.chdir(tmp_path)  # the recipe's relative paths
    monkeypatch.syspath_prepend(str(tmp_path))  # its reward module
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "results/digits/hf")
    train_cfg = load_typed_config("my_recipe.yaml", [], GRPOMasterConfig)
    train, _, _ = setup_datasets(train_cfg.data, tokenizer, train_cfg.env.specs())
    for sample in samples:
        trained = train[sample["prompt_index"]]["message_log"]
        assert sample["prompt_token_ids"] == torch.cat([m["token_ids"] for m in trained]).tolist()
        assert sample["prompt"] == "".join(m["content"] for m in trained)
        assert tokenizer.decode(sample["response_token_ids"]) == sample["response"]

    # greedy, the exported folder answers as the checkpoint's policy (vLLM served it above)
    cfg = load_typed_config("my_eval.yaml", [], EvalMasterConfig)
    policy_dir = tmp_path / "results/digits/checkpoints/step_20/policy"
    _, val, _ = setup_datasets(cfg.data, tokenizer, cfg.env.specs())
    prompts = [torch.cat([m["token_ids"] for m in val[i]["message_log"]]) for i in range(8)]
    new_tokens = cfg.generation.max_new_tokens
    expected = megatron_greedy(policy_dir, prompts, tokenizer.eos_token_id, new_tokens)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "results/digits/hf")
    for ids, want in zip(prompts, expected):
        with torch.no_grad():
            out = exported.generate(
                ids[None], max_new_tokens=new_tokens, do_sample=False,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
            )
        assert out[0, ids.numel():].tolist() == want
