"""Typed config of rollout generation (``policy.generation``), NeMo RL key names.

Every default lives here, so a :class:`GenerationConfig` built on its own (as the Python API
does) means what it means inside a recipe; :class:`nemo_rl.models.policy.config.PolicyConfig`
only checks that the two sections agree where they must.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from nemo_rl.distributed.sampling import TrainingSamplingParams
from nemo_rl.utils.config import ConfigModel

Precision = Literal["float32", "bfloat16", "float16"]


class VllmConfig(ConfigModel):
    """Settings of the vLLM engines that generate rollouts."""

    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="Bundles (GPUs, or CPU worker slots) one vLLM engine is sharded over, all on "
        "one node: it must divide the bundles of every node. Replicas = bundles / this. Each "
        "engine runs its ranks with vLLM's multiprocessing executor (nemo_rl.models.generation."
        "placement).",
    )
    gpu_memory_utilization: float = Field(
        default=0.6,
        gt=0.0,
        le=1.0,
        description="Fraction (0, 1] of each GPU's memory vLLM may take for weights, activations "
        "and KV cache. Ignored on CPU, where kv_cache_memory_bytes sizes the cache.",
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        gt=0,
        description="KV-cache size in bytes (needed on CPU). None: vLLM sizes the cache itself "
        "(from gpu_memory_utilization on GPU).",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="Longest sequence (prompt + generation) the engine accepts, in tokens; "
        "inside a policy it must be >= policy.max_total_sequence_length (recipes write "
        "${policy.max_total_sequence_length}). None: the model's own limit (its config.json "
        "max_position_embeddings), vLLM's default.",
    )
    enforce_eager: bool = Field(
        default=False,
        description="Run the model eagerly (no CUDA graphs / torch.compile): faster start-up, "
        "slower decoding. On CPU it also runs the sampler helpers vLLM would compile eagerly "
        "(TORCHDYNAMO_DISABLE=1 in the engine's processes), saving each engine a compile at "
        "its first request.",
    )
    precision: Precision = Field(
        default="float32",
        description="Weight and activation dtype of the engine. Keep it equal to "
        "policy.precision: a lower engine precision than the trainer's widens the gap between "
        "their logprobs (which the importance-sampling terms of the loss then see).",
    )
    lora_refit: Literal["merged", "adapter"] = Field(
        default="merged",
        description="How the weights of a LoRA policy (policy.megatron_cfg.peft.enabled) reach "
        "the engines at each refit. 'merged': every weight, W + (alpha / dim) * B A, through "
        "the refit stream, the engine serving a plain model. 'adapter': the engine keeps the "
        "base weights it loaded at start and is built with vLLM's LoRA support "
        "(enable_lora, max_lora_rank from peft.dim); each refit streams only the adapters' "
        "A and B tensors, which the engine installs in memory as a new vLLM LoRA adapter that "
        "every later request uses; only with LoRA. On CPU 'adapter' refits 12x faster but "
        "generates 1.8x slower per token, so 'merged' is the default (benchmarks/"
        "bench_lora_refit.py, docs/performance.md).",
    )
    async_engine: bool = Field(
        default=False,
        description="Serve every sample's turn as its own request on a continuously batched "
        "engine, so that in multi-turn rollouts a sample goes on to its next turn as soon as "
        "its environment answers instead of waiting for the whole batch's turn "
        "(nemo_rl.experience.async_engine_rollouts). Greedy results equal the batched path's. Worth it "
        "when environment answers or response lengths vary across samples; single-turn "
        "rollouts gain nothing.",
    )
    expose_http_server: bool = Field(
        default=False,
        description="During rollouts, serve each engine over an OpenAI-compatible HTTP endpoint "
        "(/v1/chat/completions, /v1/completions) so that an agent plug-in (env.<task>.agent_fn) "
        "drives the episode; the server records every prompt and generated token id with its "
        "logprob, and the rollout trains on those ids (docs/agents.md). Implies the "
        "continuously batched engine of async_engine.",
    )
    http_server_host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="Address the engines' HTTP servers bind to. 127.0.0.1: reachable only from "
        "the engine's own node (agents run in environment actors, which must then share it). "
        "On a multi-node cluster set 0.0.0.0 (or a node's interface address): every server then "
        "advertises its node's IP to the agents (docs/agents.md).",
    )
    http_request_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Seconds one HTTP request may wait for the engine (for a refit or sleep to "
        "end, then for its generation) before it is answered with an error (503/504).",
    )

class ColocatedConfig(ConfigModel):
    """Placement of the generation engines relative to the policy workers."""

    enabled: bool = Field(
        default=True,
        description="Share the policy workers' devices, swapping training state out while "
        "generating; False places the engines on devices of their own.",
    )


class GenerationConfig(ConfigModel):
    """Sampling settings of rollout generation and the engine that runs it."""

    backend: Literal["vllm"] = Field(default="vllm", description="Generation engine.")
    max_new_tokens: int = Field(
        default=128,
        ge=1,
        description="Most tokens generated per response (also bounded by the room left in "
        "policy.max_total_sequence_length after the prompt).",
    )
    temperature: float = Field(
        default=1.0,
        ge=0.0,
        description="Sampling temperature: the engines sample from softmax(logits / "
        "temperature), and the trained policy's logprobs (previous, current, reference) use "
        "the same scaled distribution (docs/algorithms.md, sampling-consistent logprobs). 0 is "
        "greedy decoding: evaluation only; a trained policy refuses it.",
    )
    top_p: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling: keep the smallest set of most likely tokens (after "
        "temperature and top_k) whose probability reaches top_p, renormalised. The policy's "
        "previous and current logprobs use the same truncated distribution; the reference "
        "policy's and the KL term's keep only the temperature. 1.0: off.",
    )
    top_k: int | None = Field(
        default=None,
        ge=1,
        description="Keep the k most likely tokens (after temperature), renormalised; the "
        "policy's previous and current logprobs use the same truncated distribution, as with "
        "top_p. None: off.",
    )
    stop_token_ids: list[int] | None = Field(
        default=None,
        description="Token ids that end a response besides the tokenizer's EOS. None: EOS only.",
    )
    stop_strings: list[str] | None = Field(
        default=None, description="Strings that end a response when generated. None: none."
    )
    colocated: ColocatedConfig = Field(
        default_factory=ColocatedConfig, description="Placement of the generation engines."
    )
    max_engine_restarts: int = Field(
        default=3,
        ge=0,
        description="Times each vLLM engine may die (its actor, or one of its tensor-parallel "
        "ranks) and be restarted on its bundles during a run: the restarted engine takes the "
        "policy's weights and the generation batch it broke is redone. One more death stops "
        "the run with exit code 75 (rerunning resumes from the newest checkpoint), naming the "
        "engine and its node. A rerun counts from 0 again. 0: the first death stops the run.",
    )
    startup_timeout_s: float = Field(
        default=600.0,
        gt=0.0,
        description="Seconds the vLLM engines have to start (their actors, the model load, "
        "CUDA graphs), at the run's start and when a dead or hung engine is restarted; past "
        "it the run stops naming the engine and its node (exit 75).",
    )
    generate_timeout_s: float = Field(
        default=3600.0,
        gt=0.0,
        description="Seconds one generation call may take on an engine (a rollout turn's "
        "batch, or one sample's turn with vllm_cfg.async_engine). An engine that gives no "
        "result within it counts as hung: unless it then answers a health check within "
        "call_timeout_s it is restarted like a dead one (max_engine_restarts) and the batch "
        "redone; otherwise the run stops with one line naming the engine, its node and the "
        "call (exit 75).",
    )
    call_timeout_s: float = Field(
        default=600.0,
        gt=0.0,
        description="Seconds the driver waits for the engines to answer any other call: waking "
        "up or going to sleep, taking the refit info, leaving the refit group, reporting "
        "their weight version, a health check. An engine that does not answer a health check "
        "within it counts as hung (restarted like a dead one); any other call past it stops "
        "the run with one line naming the engine, its node and the call (exit 75).",
    )
    vllm_cfg: VllmConfig = Field(default_factory=VllmConfig, description="vLLM engine settings.")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unmatched_sampling(cls, data: Any) -> Any:
        """Refuse vLLM sampling settings the trainer's logprobs cannot follow, by name."""
        if isinstance(data, dict):
            for key in UNMATCHED_SAMPLING_KEYS:
                if key in data:
                    raise ValueError(
                        f"{key} is not supported: the engines would sample from a distribution "
                        "the trained policy's logprobs cannot reproduce (they follow "
                        "temperature, top_p and top_k only); remove the key"
                    )
        return data

    def training_sampling(self) -> TrainingSamplingParams:
        """The distribution the trained policy's logprobs follow (this config's temperature,
        top-k and top-p).

        Raises:
            ValueError: temperature 0 (greedy decoding has no distribution to train on).
        """
        return TrainingSamplingParams(self.temperature, self.top_k, self.top_p)


# vLLM sampling settings (and NeMo RL's ``bad_words``) that change the sampled distribution in
# ways the trainer's logprobs do not reproduce; refused when a config sets them.
UNMATCHED_SAMPLING_KEYS = (
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "bad_words",
    "logit_bias",
)
