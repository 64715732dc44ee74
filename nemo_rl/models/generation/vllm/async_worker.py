"""A generation replica that serves requests one by one as they come (``vllm_cfg.async_engine``).

:class:`AsyncVllmGenerationWorker` is the batched :class:`VllmGenerationWorker` (same engine,
sampling parameters, output tensors, sleep and weight refit) with an asynchronous
:meth:`~AsyncVllmGenerationWorker.generate`: Ray runs the actor on an event loop, every call's
rows become engine requests at once, and one stepping task drives the engine while any request
is unfinished. A call that arrives while others are being generated joins the running batch at
the next engine step (continuous batching) and returns as soon as its own rows finish, so a
multi-turn rollout can send a sample's next turn while the rest of the batch is still
generating (:func:`nemo_rl.experience.async_rollouts.run_async_multi_turn_rollout`).

Why not ``vllm.v1.engine.async_llm.AsyncLLM``: in vLLM 0.32 it always runs the engine core in a
spawned process (``AsyncMPClient``; there is no in-process async client), which costs a second
vLLM import and model load per engine and puts the model out of the refit layer's reach:
weights would be pickled over ZMQ instead of loaded by reference from the refit buffer. Driving the in-process v1 engine
(``LLM.llm_engine``: ``add_request``/``step``, the calls ``LLM.generate`` makes) from the
event loop gives the same per-request scheduling and keeps refit and sleep as they are.

Steps run on the event-loop thread, so the actor's synchronous methods (refit verbs, sleep,
wake-up) run between two engine steps, never during one; sleeping or committing new weights
while requests are unfinished is refused (their tokens would mix two sets of weights).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.vllm.vllm_worker import VllmGenerationWorker, _assemble_outputs


class AsyncVllmGenerationWorker(VllmGenerationWorker):
    """A generation replica whose :meth:`generate` calls run concurrently on one engine
    (constructor arguments: :class:`VllmGenerationWorker`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Requests waiting to enter the engine at the next step: (prompt ids, SamplingParams,
        # the future their RequestOutput resolves).
        self._incoming: list[tuple[list[int], Any, asyncio.Future[Any]]] = []
        # Request id (as given to the engine, which reports outputs under it) -> the future of
        # a request inside the engine.
        self._running: dict[str, asyncio.Future[Any]] = {}
        self._stepper: asyncio.Task[None] | None = None
        self._request_ids = itertools.count()

    @property
    def requests_in_flight(self) -> int:
        """Requests submitted and not finished yet."""
        return len(self._incoming) + len(self._running)

    async def generate(
        self,
        data: BatchedDataDict[Any],
        greedy: bool = False,
        seeds: Sequence[int] | None = None,
    ) -> BatchedDataDict[Any]:
        """:meth:`VllmGenerationWorker.generate` (same arguments and GenerationOutputSpec
        result), returning when this call's rows are done, whatever else the engine runs."""
        prompts, params = self._requests(data, greedy, seeds)
        results = await asyncio.gather(*(self._submit(p, sp) for p, sp in zip(prompts, params)))
        return _assemble_outputs(prompts, results, data["input_ids"].shape[1], self.pad_token_id)

    async def _submit(self, prompt: list[int], params: Any) -> Any:
        """Queue one request for the engine; its final ``RequestOutput``."""
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate: no partial outputs
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._incoming.append((prompt, params, future))
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.create_task(self._step_until_idle())
        return await future

    async def _step_until_idle(self) -> None:
        """Add the queued requests and step the engine, between steps letting the event loop
        take new calls, until no request is left; a failing step fails every request."""
        from vllm import TokensPrompt

        engine = self.llm.llm_engine
        try:
            while self._incoming or self._running:
                for prompt, params, future in self._incoming:
                    request_id = f"async-{next(self._request_ids)}"
                    engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
                    self._running[request_id] = future
                self._incoming.clear()
                for output in engine.step():
                    if output.finished:
                        self._running.pop(output.request_id).set_result(output)
                await asyncio.sleep(0)
        except Exception as error:  # noqa: BLE001 - handed to every waiting caller
            unfinished = list(self._running)
            for _, _, future in self._incoming:
                future.set_exception(error)
            for future in self._running.values():
                future.set_exception(error)
            self._incoming.clear()
            self._running.clear()
            if unfinished:
                engine.abort_request(unfinished)

    def _refuse_while_generating(self, action: str) -> None:
        if self.requests_in_flight:
            raise RuntimeError(
                f"cannot {action} while {self.requests_in_flight} requests are being generated; "
                "wait for the rollout to finish first"
            )

    def sleep(self) -> bool:
        """:meth:`VllmGenerationWorker.sleep`, refused while requests are unfinished."""
        self._refuse_while_generating("put the engine to sleep")
        return super().sleep()

    def _load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """:meth:`VllmGenerationWorker._load_weights`, refused while requests are unfinished."""
        self._refuse_while_generating("load new weights")
        super()._load_weights(weights)
