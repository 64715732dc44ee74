"""An engine's OpenAI-compatible HTTP endpoint during rollouts (``vllm_cfg.expose_http_server``).

:class:`EngineHttpServer` serves ``POST /v1/chat/completions`` and ``POST /v1/completions``
(OpenAI schema, one choice, no streaming) from the event loop of the engine's actor
(:class:`~nemo_rl.models.generation.vllm.async_worker.AsyncVllmGenerationWorker`), so each
request becomes one request of the continuously batched engine, next to the others in flight.
vLLM's own OpenAI serving layer needs its ``AsyncLLM`` engine client, which runs the engine in a
process of its own, out of the refit layer's reach; this thin app over the in-process engine
follows the schema instead.

Rollout id. Every request names its rollout: in the path (``/rollouts/<id>/v1/...``: the base
URL an agent is given already holds it, so any OpenAI client carries it), else the
``X-Rollout-Id`` header, else the body's ``user`` field; a request without one is refused (400).
The endpoint records the prompt and generated token ids, logprobs and weight version of each
request under its rollout (:mod:`nemo_rl.models.generation.http_records`).

Sampling. Responses are sampled as the policy's rollouts are (``policy.generation``'s
temperature, top-p, top-k, stop tokens), whatever the request asks: the training loss assumes
that distribution. A request's ``max_tokens`` (``max_completion_tokens``) can only lower the
configured ``max_new_tokens``. Each request has its own seed, from the engine's seed, the
rollout id and the call's index in the rollout.

Waiting. A request that arrives while the engine sleeps or loads a refit waits (at most
``http_request_timeout_s``, then 503) and is generated with the new weights: a refit waits for
the requests in flight, and new ones wait for the refit. A generation that takes longer than
``http_request_timeout_s`` is answered 504.

Context. A request whose prompt leaves no room to generate under the engine's
``max_model_len`` (a conversation that outgrew it) is answered 400 with the error code
``context_length_exceeded``, as OpenAI's API does: an agent catches it to end the episode
(``openai.BadRequestError`` whose ``code`` is that), which the calculator agent does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

# FastAPI reads the handlers' annotations (postponed: strings) from this module's globals.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from nemo_rl.models.generation.http_records import CallRecord, RolloutRecorder, request_seed
from nemo_rl.models.generation.interfaces import PromptTooLongError
from nemo_rl.models.generation.tool_calls import parse_tool_calls

logger = logging.getLogger(__name__)

# (prompt ids, max new tokens, seed) -> (generated ids, their logprobs, finish reason)
GenerateFn = Callable[[list[int], int, int], Awaitable[tuple[list[int], list[float], str]]]

# Seconds uvicorn may take to stop (it closes connections still open after that).
SHUTDOWN_TIMEOUT_S = 5.0


class RequestError(Exception):
    """A request the endpoint refuses: HTTP ``status``, a message naming the field, and the
    error body's ``code`` (None: the status)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class EngineHttpServer:
    """The endpoint of one engine.

    Args:
        generate: runs one request on the engine (see :data:`GenerateFn`).
        ready: True while the engine may take requests (awake, no refit loading).
        weight_version: the engine's current weight version.
        tokenizer: the engine's tokenizer (chat template, decoding).
        stop_token_ids: ids that end a response (dropped from the returned text).
        max_new_tokens: the configured per-response limit.
        seed: the engine's base sampling seed.
        request_timeout_s: most seconds a request may wait and generate.
        model_name: the ``model`` field of responses.
    """

    def __init__(
        self,
        generate: GenerateFn,
        ready: Callable[[], bool],
        weight_version: Callable[[], int],
        tokenizer: Any,
        stop_token_ids: list[int],
        max_new_tokens: int,
        seed: int,
        request_timeout_s: float,
        model_name: str,
    ) -> None:
        self._generate = generate
        self._ready = ready
        self._weight_version = weight_version
        self.tokenizer = tokenizer
        self.stop_token_ids = set(stop_token_ids)
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.request_timeout_s = request_timeout_s
        self.model_name = model_name
        self.recorder = RolloutRecorder(tokenizer)
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, host: str) -> int:
        """Serve on ``host`` at a free port, on the running event loop; the port.

        Raises:
            RuntimeError: the server did not start within ``SHUTDOWN_TIMEOUT_S`` seconds.
        """
        import uvicorn

        config = uvicorn.Config(
            self._app(), host=host, port=0, log_level="warning", lifespan="off",
            timeout_graceful_shutdown=int(SHUTDOWN_TIMEOUT_S),
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        while not self._server.started:
            if self._task.done() or time.monotonic() > deadline:
                raise RuntimeError(f"the engine's HTTP server did not start on {host}")
            await asyncio.sleep(0.01)
        return int(self._server.servers[0].sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop serving (requests still open get SHUTDOWN_TIMEOUT_S seconds)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, SHUTDOWN_TIMEOUT_S + 1.0)
        except asyncio.TimeoutError:
            self._task.cancel()
        self._server = self._task = None

    # ------------------------------------------------------------------ the app

    def _app(self) -> FastAPI:
        app = FastAPI()

        async def answer(kind: str, request: Request, rollout_id: str | None) -> JSONResponse:
            try:
                body = await request.json()
            except Exception:  # noqa: BLE001 - any unparseable body
                return _error(400, "the request body is not JSON")
            if not isinstance(body, dict):
                return _error(400, "the request body must be a JSON object")
            rid = rollout_id or request.headers.get("x-rollout-id") or body.get("user")
            try:
                if not isinstance(rid, str) or not rid:
                    raise RequestError(
                        400, "no rollout id: use the base URL the rollout gave "
                        "(/rollouts/<id>/v1), the X-Rollout-Id header or the 'user' field",
                    )
                return JSONResponse(await self._complete(kind, rid, body))
            except RequestError as err:
                return _error(err.status, str(err), err.code)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            return await answer("chat", request, None)

        @app.post("/v1/completions")
        async def completions(request: Request) -> JSONResponse:
            return await answer("text", request, None)

        @app.post("/rollouts/{rollout_id}/v1/chat/completions")
        async def rollout_chat(rollout_id: str, request: Request) -> JSONResponse:
            return await answer("chat", request, rollout_id)

        @app.post("/rollouts/{rollout_id}/v1/completions")
        async def rollout_completions(rollout_id: str, request: Request) -> JSONResponse:
            return await answer("text", request, rollout_id)

        @app.get("/v1/models")
        @app.get("/rollouts/{rollout_id}/v1/models")
        async def models(rollout_id: str | None = None) -> JSONResponse:
            return JSONResponse(
                {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}
            )

        return app

    def _prompt(self, kind: str, rid: str, body: dict[str, Any]) -> tuple[list[int], bool]:
        if body.get("stream"):
            raise RequestError(400, "'stream' is not supported; send stream=false")
        if body.get("n", 1) != 1:
            raise RequestError(400, "'n' must be 1 (one choice per request)")
        try:
            if kind == "chat":
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ValueError("'messages' must be a non-empty list")
                return self.recorder.chat_prompt(rid, messages, body.get("tools"))
            return self.recorder.completion_prompt(rid, body.get("prompt"))
        except ValueError as err:
            raise RequestError(400, str(err)) from None

    def _max_tokens(self, body: dict[str, Any]) -> int:
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is None:
            return self.max_new_tokens
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
            raise RequestError(400, f"'max_tokens' must be a positive integer, got {asked!r}")
        return min(asked, self.max_new_tokens)

    async def _wait_until_ready(self, deadline: float) -> None:
        while not self._ready():
            if time.monotonic() > deadline:
                raise RequestError(
                    503, "the engine stayed asleep or in a refit for "
                    f"http_request_timeout_s={self.request_timeout_s:g} s",
                )
            await asyncio.sleep(0.02)

    def _response_text(self, prompt: list[int], ids: list[int]) -> str:
        """The text of ``ids`` as it reads after ``prompt``: decoded in context, so that the
        conversation's text continues the text of the ids (a tokenizer may drop a leading
        space when it decodes ``ids`` alone)."""
        decode = self.recorder.decode
        before, whole = decode(prompt), decode(prompt + ids)
        return whole[len(before):] if whole.startswith(before) else decode(ids)

    async def _complete(self, kind: str, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        """Generate one response for ``body``, record it under ``rid``; the response body."""
        deadline = time.monotonic() + self.request_timeout_s
        max_tokens = self._max_tokens(body)
        await self._wait_until_ready(deadline)
        prompt, extends = self._prompt(kind, rid, body)
        seed = request_seed(self.seed, rid, self.recorder.calls(rid))
        try:
            ids, logprobs, finish = await asyncio.wait_for(
                self._generate(prompt, max_tokens, seed), max(deadline - time.monotonic(), 0.0)
            )
        except asyncio.TimeoutError:
            raise RequestError(
                504, f"no response within http_request_timeout_s={self.request_timeout_s:g} s"
            ) from None
        except PromptTooLongError as err:
            raise RequestError(400, str(err), err.openai_code) from None
        except ValueError as err:
            raise RequestError(400, str(err)) from None
        # read after generating: a refit waits for the requests in flight, so these weights
        # generated the whole response (one that loaded before the request reached the engine
        # included)
        version = self._weight_version()
        text = self._response_text(
            prompt, ids[:-1] if ids and ids[-1] in self.stop_token_ids else ids
        )
        response_id = f"{rid}-{self.recorder.calls(rid)}"
        parsed = parse_tool_calls(text, f"call_{response_id}") if kind == "chat" else None
        content = text if parsed is None else parsed.content
        tool_call_ids = [] if parsed is None else [c["id"] for c in parsed.tool_calls]
        self.recorder.record(
            rid, CallRecord(prompt, ids, logprobs, version, extends, finish), text,
            tool_call_ids, content,
        )
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
        }
        common = {"created": int(time.time()), "model": self.model_name, "usage": usage}
        if parsed is None:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            return {"id": f"cmpl-{response_id}", "object": "text_completion",
                    "choices": [choice], **common}
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
            finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        return {"id": f"chatcmpl-{response_id}", "object": "chat.completion",
                "choices": [choice], **common}


def advertised_host(bind_host: str) -> str:
    """The address agents reach a server bound to ``bind_host`` at: that address, or, for a
    wildcard bind (0.0.0.0, ::), the IP of the node this runs on as Ray knows it (call it on
    the engine's node)."""
    if bind_host in ("0.0.0.0", "::"):
        import ray

        return ray.util.get_node_ip_address()
    return bind_host


def base_url(bind_host: str, port: int) -> str:
    """``http://<address>:<port>`` of a server bound to ``bind_host`` at ``port``
    (:func:`advertised_host`; an IPv6 address in brackets)."""
    host = advertised_host(bind_host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    """An OpenAI-style error body (``code``: None gives the status)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"message": message, "type": kind, "code": status if code is None else code}
    return JSONResponse({"error": body}, status_code=status)
