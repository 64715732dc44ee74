"""The engines' OpenAI-compatible endpoint over real HTTP on 127.0.0.1, with the ``openai``
client, in front of a scripted generator (the engine-backed path: tests/unit/experience/
test_agent_rollouts.py). The generator answers with token ids that are *not* the tokenizer's
own tokenisation of their text, so re-tokenised text would differ from them:

* a tool-call round trip: the chat response carries ``tool_calls``, and the next request's
  prompt holds the first request's prompt and generated ids unchanged (the training sample
  assembled from the records has the generated ids token for token);
* a malformed tool call comes back as an ``invalid_tool_call`` call, not an error;
* the rollout id rules (path, header, ``user``; none: 400);
* a request waits while the engine is not ready (sleep, refit), and gets 503 after its timeout;
* a conversation that outgrows the engine's context gets OpenAI's ``context_length_exceeded``
  400, and the calculator agent ends its episode on it with reward 0 instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from nemo_rl.environments import calculator_agent
from nemo_rl.experience.agent_rollouts import chain_message_log, trained_chain
from nemo_rl.models.generation.interfaces import PromptTooLongError
from nemo_rl.models.generation.tool_calls import INVALID_TOOL_CALL
from nemo_rl.models.generation.vllm.http_server import EngineHttpServer, base_url

CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "2 * 3"}}</tool_call>'


def char_by_char(tokenizer: Any, text: str) -> list[int]:
    """Ids of ``text`` tokenised one character at a time (decodes to ``text``; not the
    tokenizer's own tokenisation of it)."""
    return [i for ch in text for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]


class ScriptedEngine:
    """Answers request ``k`` with ``replies[k]`` (ids, logprob -0.5 each; an exception is
    raised instead); keeps the prompts."""

    def __init__(self, replies: list[list[int] | Exception]) -> None:
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.ready = True
        self.ready_when_generating: list[bool] = []

    async def generate(self, prompt: list[int], max_tokens: int, seed: int):
        self.prompts.append(prompt)
        self.ready_when_generating.append(self.ready)
        ids = self.replies.pop(0)
        if isinstance(ids, Exception):
            raise ids
        return ids, [-0.5] * len(ids), "stop"


@contextlib.contextmanager
def serving(engine: ScriptedEngine, tokenizer: Any, timeout_s: float = 30.0) -> Iterator[
    tuple[str, EngineHttpServer]
]:
    """The endpoint over ``engine`` on 127.0.0.1 (its own event loop thread), until exit."""
    server = EngineHttpServer(
        generate=engine.generate, ready=lambda: engine.ready, weight_version=lambda: 7,
        tokenizer=tokenizer, stop_token_ids=[tokenizer.eos_token_id], max_new_tokens=64,
        seed=0, request_timeout_s=timeout_s, model_name="tiny",
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1"), loop).result(10)
        yield f"http://127.0.0.1:{port}", server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_path)


def client(base_url: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", timeout=30, max_retries=0, **kwargs)


def test_tool_call_round_trip_trains_the_generated_ids(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    first = char_by_char(tokenizer, "Sure. " + CALL) + [eos]
    second = char_by_char(tokenizer, "<answer>6</answer>") + [eos]
    canonical = tokenizer("Sure. " + CALL, add_special_tokens=False)["input_ids"] + [eos]
    assert first != canonical  # re-tokenising the text would not give the generated ids
    engine = ScriptedEngine([first, second])
    with serving(engine, tokenizer) as (url, server):
        api = client(f"{url}/rollouts/r1/v1")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 * 3?"}]
        reply = api.chat.completions.create(model="tiny", messages=messages)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
        (call,) = choice.message.tool_calls
        assert call.function.name == "calc" and call.function.arguments == (
            '{"expression": "2 * 3"}'
        )
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "6"},
        ]
        reply = api.chat.completions.create(model="tiny", messages=messages)
        assert reply.choices[0].message.content == "<answer>6</answer>"
        records = server.recorder.take(["r1"])["r1"]
    assert [r.extends_previous for r in records] == [False, True]
    assert records[1].prompt_ids[: len(records[0].prompt_ids) + len(first)] == (
        records[0].prompt_ids + first
    )
    assert engine.prompts == [r.prompt_ids for r in records]
    assert {r.weight_version for r in records} == {7}
    log, cut = chain_message_log(trained_chain(records), tokenizer, max_seq_len=1024)
    assert not cut
    assert [m["role"] for m in log] == ["user", "assistant", "tool", "assistant"]
    assert log[1]["token_ids"].tolist() == first and log[3]["token_ids"].tolist() == second
    assert log[1]["generation_logprobs"].tolist() == [-0.5] * len(first)
    assert "<|im_start|>tool\n6<|im_end|>" in log[2]["content"]
    flat = [i for m in log for i in m["token_ids"].tolist()]
    assert flat == records[1].prompt_ids + second


def test_a_malformed_tool_call_is_returned_not_refused(tokenizer: Any) -> None:
    bad = char_by_char(tokenizer, '<tool_call>{"name": "calc", "arguments": {</tool_call>')
    with serving(ScriptedEngine([bad]), tokenizer) as (url, _):
        reply = client(f"{url}/rollouts/r2/v1").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == INVALID_TOOL_CALL
    assert "not valid JSON" in call.function.arguments


def test_rollout_id_from_path_header_or_user_field(tokenizer: Any) -> None:
    ids = char_by_char(tokenizer, "ok")
    with serving(ScriptedEngine([ids, ids]), tokenizer) as (url, server):
        with pytest.raises(openai.BadRequestError, match="no rollout id"):
            client(f"{url}/v1").completions.create(model="tiny", prompt="hi")
        client(f"{url}/v1", default_headers={"X-Rollout-Id": "h"}).completions.create(
            model="tiny", prompt="hi"
        )
        client(f"{url}/v1").completions.create(model="tiny", prompt="hi", user="u")
        taken = server.recorder.take(["h", "u", "none"])
    assert [len(taken[k]) for k in ("h", "u", "none")] == [1, 1, 0]
    assert taken["h"][0].generated_ids == ids


def test_a_request_waits_for_the_engine_then_times_out(tokenizer: Any) -> None:
    ids = char_by_char(tokenizer, "ok")
    engine = ScriptedEngine([ids])
    engine.ready = False
    with serving(engine, tokenizer, timeout_s=1.0) as (url, _):
        api = client(f"{url}/rollouts/r3/v1")
        with pytest.raises(openai.InternalServerError, match="asleep or in a refit"):
            api.completions.create(model="tiny", prompt="hi")
        assert engine.prompts == []  # nothing reached the engine while it was not ready
        opener = threading.Timer(0.3, lambda: setattr(engine, "ready", True))
        opener.start()
        reply = api.completions.create(model="tiny", prompt="hi")
        assert reply.choices[0].text == "ok"
        assert engine.ready_when_generating == [True]  # it waited for the engine


def test_a_conversation_over_the_context_ends_the_calculator_episode(tokenizer: Any) -> None:
    # the engine's own message (vllm_worker) for a prompt that leaves no room to generate
    full = PromptTooLongError("row 0: the prompt has 265 tokens, leaving no room to generate "
                              "within the engine's max_model_len=224")
    bad = char_by_char(tokenizer, '<tool_call>{"name": "calc", "arg</tool_call>')
    engine = ScriptedEngine([bad, full, full])
    row = {"prompt": "What is 2 * 3?", "answer": "6"}
    with serving(engine, tokenizer) as (url, server):
        assert calculator_agent.run(f"{url}/rollouts/r4/v1", row) == 0.0
        with pytest.raises(openai.BadRequestError, match="max_model_len=224") as refused:
            client(f"{url}/rollouts/r5/v1").completions.create(model="tiny", prompt="hi")
        records = server.recorder.take(["r4", "r5"])
    assert refused.value.code == "context_length_exceeded"
    # the failed call was answered, the next request refused: the episode's one call is trained
    assert len(engine.prompts) == 3 and [len(records[k]) for k in ("r4", "r5")] == [1, 0]
    assert records["r4"][0].generated_ids == bad


def test_base_url_of_a_bound_address_puts_ipv6_in_brackets() -> None:
    # a wildcard bind advertises the node's IP (tests/functional/test_grpo_two_nodes.py)
    assert base_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert base_url("10.1.2.3", 41) == "http://10.1.2.3:41"
    assert base_url("::1", 8000) == "http://[::1]:8000"
