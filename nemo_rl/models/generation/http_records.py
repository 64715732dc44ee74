"""What an engine's HTTP endpoint records per rollout, and how a request's prompt reuses it.

Every request carries a rollout id; the engine's :class:`RolloutRecorder` keeps, per rollout,
one :class:`CallRecord` per request in arrival order: the prompt token ids the engine was
given, the token ids it generated with their logprobs, and the weight version that generated
them. Nothing is re-tokenised from text afterwards: the rollout builds the training sample
from these ids (:mod:`nemo_rl.experience.agent_rollouts`).

Continuing a conversation. An agent sends the whole conversation again with each request (the
OpenAI chat schema has no other way). Rendering it with the chat template and tokenising the
text would not give back the ids the engine generated: the same text has several tokenisations,
and tool calls come back from the client as structured ``tool_calls`` that the template renders
its own way. So :meth:`RolloutRecorder.chat_prompt` renders the conversation, and when the text
begins with the text of the rollout's previous call (its prompt and response, decoded), reuses
that call's ids as they were and tokenises only the new text after them (the tool results, the
next user message, the generation prompt). An assistant message the endpoint returned is
rendered from the exact text the engine generated (found by its tool-call ids, or equal
content), so the agent's copy of it lines up. The call then *extends* the previous one; a call
that does not (the agent rewrote the history) starts a new chain.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from nemo_rl.models.generation.tool_calls import render_tool_calls


@dataclass
class CallRecord:
    """One request of a rollout.

    Attributes:
        prompt_ids: token ids the engine was given.
        generated_ids: token ids it generated (including a final stop token).
        logprobs: the engine's logprob of each generated token (same length).
        weight_version: the engine's weight version while it generated.
        extends_previous: ``prompt_ids`` begins with the previous call's prompt and generated
            ids of this rollout.
        finish_reason: "stop" or "length".
    """

    prompt_ids: list[int]
    generated_ids: list[int]
    logprobs: list[float]
    weight_version: int
    extends_previous: bool
    finish_reason: str


@dataclass
class _Rollout:
    calls: list[CallRecord] = field(default_factory=list)
    # the exact text of each returned assistant message, by its first tool-call id or content
    texts_by_call_id: dict[str, str] = field(default_factory=dict)


def request_seed(base_seed: int, rollout_id: str, call: int) -> int:
    """A 63-bit sampling seed for call ``call`` of rollout ``rollout_id``."""
    key = f"{base_seed}:{rollout_id}:{call}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _text_of(content: Any) -> str:
    """A message's content as text (OpenAI content parts: their text joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


class RolloutRecorder:
    """Per-rollout records of one engine's endpoint (one event loop; no locking).

    Args:
        tokenizer: the engine's tokenizer (its chat template renders chat requests).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._rollouts: dict[str, _Rollout] = {}

    def calls(self, rollout_id: str) -> int:
        """Requests recorded for ``rollout_id`` so far."""
        rollout = self._rollouts.get(rollout_id)
        return 0 if rollout is None else len(rollout.calls)

    def decode(self, ids: list[int]) -> str:
        """``ids`` as text, special tokens kept, spaces as they are."""
        return self.tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _continue(self, rollout_id: str, text: str, add_special_tokens: bool) -> tuple[list[int], bool]:
        """Token ids of prompt ``text``: the previous call's ids plus the new text's, when
        ``text`` begins with that call's decoded prompt and response; else ``text`` tokenised.
        Second: whether it extends the previous call."""
        rollout = self._rollouts.get(rollout_id)
        if rollout is not None and rollout.calls:
            last = rollout.calls[-1]
            chain = last.prompt_ids + last.generated_ids
            chain_text = self.decode(chain)
            if text.startswith(chain_text):
                return chain + self._encode(text[len(chain_text):], False), True
        return self._encode(text, add_special_tokens), False

    def chat_prompt(
        self, rollout_id: str, messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> tuple[list[int], bool]:
        """Prompt ids of a chat request (see the module docstring) and whether it extends the
        rollout's previous call.

        Raises:
            ValueError: a message is not an object with a role, or the template fails.
        """
        rollout = self._rollouts.get(rollout_id) or _Rollout()
        rendered = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] is not an object with a string 'role'")
            content = _text_of(message.get("content"))
            tool_calls = message.get("tool_calls") or []
            if message["role"] == "assistant":
                key = tool_calls[0].get("id") if tool_calls else content
                if key in rollout.texts_by_call_id:
                    content = rollout.texts_by_call_id[key]
                elif tool_calls:
                    content = render_tool_calls(content, tool_calls)
            rendered.append({"role": message["role"], "content": content})
        kwargs = {"tools": tools} if tools else {}
        try:
            text = self.tokenizer.apply_chat_template(
                rendered, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as err:  # noqa: BLE001 - a template error is the request's fault
            raise ValueError(f"the chat template failed on these messages: {err}") from None
        return self._continue(rollout_id, text, add_special_tokens=False)

    def completion_prompt(self, rollout_id: str, prompt: Any) -> tuple[list[int], bool]:
        """Prompt ids of a completion request (text, or a list of token ids used as given)
        and whether it extends the rollout's previous call.

        Raises:
            ValueError: the prompt is neither a string nor a list of token ids.
        """
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            rollout = self._rollouts.get(rollout_id)
            last = rollout.calls[-1] if rollout and rollout.calls else None
            chain = [] if last is None else last.prompt_ids + last.generated_ids
            return list(prompt), bool(chain) and prompt[: len(chain)] == chain
        if isinstance(prompt, str) and prompt:
            return self._continue(rollout_id, prompt, add_special_tokens=True)
        raise ValueError("'prompt' must be a non-empty string or a list of token ids (one prompt)")

    def record(self, rollout_id: str, call: CallRecord, text: str, tool_call_ids: list[str],
               content: str) -> None:
        """Keep ``call``; ``text`` is the exact response text, ``tool_call_ids`` / ``content``
        what the endpoint returned for it (how a later request's copy is recognised)."""
        rollout = self._rollouts.setdefault(rollout_id, _Rollout())
        rollout.calls.append(call)
        rollout.texts_by_call_id[tool_call_ids[0] if tool_call_ids else content] = text

    def take(self, rollout_ids: list[str]) -> dict[str, list[CallRecord]]:
        """The records of ``rollout_ids`` (an empty list for one with none), forgotten here."""
        return {rid: self._rollouts.pop(rid, _Rollout()).calls for rid in rollout_ids}
