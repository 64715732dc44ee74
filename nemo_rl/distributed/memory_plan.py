"""Per-GPU memory plan of a run, from its config alone: pure arithmetic, nothing is started.

:func:`plan_memory` lists, for each phase of a GRPO step (or of a supervised step), the bytes
one GPU holds, each a named :class:`Term` that carries its formula and what lowers it. The
phases, and what is resident in each:

* ``training``: the policy's parameters, its fp32 gradient buffer and optimizer state, the
  activations and LM-head logits of one training micro-batch; colocated, also what a sleeping
  vLLM engine keeps.
* ``logprobs`` (runs with the training state on the device): the same static state, the
  logits of one logprob micro-batch and one layer's forward activations.
* ``refit``: colocated, the engine awake (weights and KV cache: its whole
  ``gpu_memory_utilization`` budget; vLLM's ``wake_up`` restores both), the policy's parameters
  (its optimizer state and gradients are offloaded first), and the refit ring; not colocated,
  on the policy's GPUs, the training state and the ring the stream leaves from.
* ``generation``: the engine's budget (its weights, the KV cache as the rest); colocated, also
  what the policy's process keeps (every tensor of it offloaded); not colocated, on the
  engines' GPUs, beside the budget, the ring the stream arrives in.

Colocated, every GPU goes through all four phases and the plan's peak is the largest phase;
not colocated, the policy's GPUs have the first three and the engines' GPUs the last.

Formulas (bytes per GPU; L layers, h hidden, a query heads, g KV heads, d head dim, f FFN,
V' the vocabulary padded as Megatron pads it, E experts of FFN f_e with top-k routing on L_e of
the layers; TP, PP, CP, EP, DP = world / (TP x PP) and the experts' DP_e = world / (TP x EP x
PP)):

* parameters: P = [L (2ha·d + 2hg·d) + (L - L_e) 3hf + L_e hE] / (TP x PP)
  + L_e E 3h f_e / (TP x EP x PP) + V'h / TP (twice with an untied LM head and PP = 1: the
  first stage holds the embedding, the last the head), x 2 B in bf16 (4 in fp32). Norms and
  biases (< 0.1 %) are left out.
* gradients: 4 B per parameter (megatron's DDP buffer reduces in fp32, whatever the
  precision).
* optimizer: Adam's two fp32 moments (SGD's one momentum) and, for 16-bit parameters, an fp32
  master copy: 12 B per parameter in bf16; with ``use_distributed_optimizer`` the dense
  parameters' share is divided by DP and the experts' by DP_e.
* LoRA (``policy.megatron_cfg.peft``): the base parameters are frozen, so the gradient buffer
  and the optimizer state cover the adapters only (A_n, the adapter parameters on the most
  loaded GPU: :meth:`ModelShape.adapter_params` per adapted linear, r (in + out) with the
  TP-split side divided by TP), and the parameters are P + A_n.
* activations (16-bit: 2 B per element), per token of a micro-batch on this rank (tokens / CP),
  per layer, as Megatron's activation-memory estimate (Korthikanti et al. 2022) counts them
  for a SwiGLU, grouped-query model with a fused attention kernel (no [s, s] scores kept):
  attention 2h' + (a + 2g)d/TP + ad/TP (the norm's and QKV projection's inputs, Q/K/V, the
  attention output), dense MLP 2h' + 3f/TP (the norm's and FC1's inputs, FC1's gate and up
  outputs, the SwiGLU output), MoE 2h' + k(2h + 3f_e/TP) (each token's k dispatched copies
  in and out of its experts, balanced routing), where h' = h/TP with sequence parallelism and
  h without. Without recomputation every layer of the stage keeps its activations; with
  ``activation_checkpointing`` (full recomputation, one layer per checkpoint) each layer keeps
  only its input (h' per token) and one layer's full activations are alive during its
  backward. With PP the first stage holds PP micro-batches in flight (1F1B).
* logits: [tokens / CP, V' / TP] in fp32 (the output layer's 16-bit logits and their gradient,
  about as large, or the loss's fp32 statistics), counted on the same GPU as the activations
  (conservative with PP > 1, where the head sits on the last stage); with the LM head fused
  with the logprobs (``policy.logprob_chunk_size``, when smaller than the micro-batch's local
  tokens) twice one chunk's [chunk, V' / TP] in fp32.
* refit ring: :func:`refit_staging_bytes` of the bucket size and the largest record of the
  stream (the embedding, or a MoE layer's stacked experts [E, 2f_e, h]) in the engines' dtype.
* vLLM weights: P_total x its dtype / its TP; KV cache: the rest of its budget
  (``gpu_memory_utilization`` x GPU memory), 2L·g·d x dtype / TP bytes per token.
* runtime allowances (named as such: not formulas, to be checked against a measured peak): a
  training process's CUDA context, NCCL communicators, cuBLAS workspaces and allocator slack
  (:data:`RUNTIME_ALLOWANCE_BYTES`); what a sleeping engine keeps, its CUDA context and graph
  pool (:data:`ASLEEP_ENGINE_BYTES`).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3

# Slots of a refit ring (nemo_rl.models.generation.refit.ring): the writer fills one while the
# engines load the other.
RING_SLOTS = 2

# One training process's CUDA context, NCCL communicator buffers, cuBLAS workspaces and the
# caching allocator's slack (an allowance, compared with measured peaks by the GPU check).
RUNTIME_ALLOWANCE_BYTES = 2 * GiB

# What a vLLM engine keeps on its GPU asleep (sleep level 1: weights offloaded, KV cache
# dropped): its CUDA context and CUDA-graph pool (an allowance).
ASLEEP_ENGINE_BYTES = 1 * GiB

# Megatron keeps master weights and Adam moments in fp32; DDP reduces gradients in fp32.
FP32_BYTES = 4

# Term names, shared by every phase that holds the term (a plan's table has a row per name).
PARAMETERS = "policy parameters"
GRADIENTS = "gradient buffer"
OPTIMIZER = "optimizer state"
ACTIVATIONS = "activations"
LOGITS = "logits"
RUNTIME = "CUDA/NCCL runtime (allowance)"
ENGINE_ASLEEP = "vLLM engine asleep (allowance)"
REFIT_RING = "refit ring"
ENGINE_WEIGHTS = "vLLM weights"
KV_CACHE = "vLLM KV cache"

TRAINING, LOGPROBS, REFIT, GENERATION = "training", "logprobs", "refit", "generation"

_MCFG = "policy.megatron_cfg"
_VLLM = "policy.generation.vllm_cfg"


def refit_staging_bytes(
    bucket_bytes: int, largest_tensor_bytes: int, slots: int = RING_SLOTS
) -> int:
    """Bytes of the refit ring: ``slots`` buckets, each of the configured bucket size or, when
    larger, the largest single tensor of the stream (a tensor is never split across slots).

    Args:
        bucket_bytes: one bucket (``policy.refit_buffer_size_gb`` in bytes).
        largest_tensor_bytes: the largest record of the stream, in the export dtype.
        slots: buckets in the ring.
    """
    return slots * max(bucket_bytes, largest_tensor_bytes)


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers the plan needs (a decoder with grouped-query attention and
    SwiGLU MLPs, dense or mixture-of-experts).

    Attributes:
        num_layers, hidden_size, num_attention_heads, num_kv_heads, head_dim: as config.json.
        ffn_hidden_size: the dense MLP's intermediate size (unused when every layer has
            experts).
        vocab_size: rows of the HF embedding (unpadded).
        tie_word_embeddings: the LM head is the embedding matrix.
        num_experts, moe_ffn_hidden_size, moe_top_k: of each expert layer (0 when dense).
        num_moe_layers: layers whose MLP is experts.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_top_k: int = 0
    num_moe_layers: int = 0

    @property
    def attention_params(self) -> int:
        """One layer's Q, K, V and output projections."""
        q = self.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return 2 * self.hidden_size * q + 2 * self.hidden_size * kv

    @property
    def dense_mlp_params(self) -> int:
        """One dense layer's gate, up and down projections."""
        return 3 * self.hidden_size * self.ffn_hidden_size

    @property
    def expert_params(self) -> int:
        """Every expert of every expert layer (the part expert parallelism splits)."""
        per_expert = 3 * self.hidden_size * self.moe_ffn_hidden_size
        return self.num_moe_layers * self.num_experts * per_expert

    @property
    def dense_layer_params(self) -> int:
        """The decoder layers' parameters outside the experts (attention, dense MLPs,
        routers)."""
        dense_layers = self.num_layers - self.num_moe_layers
        routers = self.num_moe_layers * self.hidden_size * self.num_experts
        attention = self.num_layers * self.attention_params
        return attention + dense_layers * self.dense_mlp_params + routers

    @property
    def total_params(self) -> int:
        """Every parameter of the HF model (unpadded vocabulary; norms and biases left out)."""
        vocab_matrices = 1 if self.tie_word_embeddings else 2  # embedding, LM head
        vocab = vocab_matrices * self.vocab_size * self.hidden_size
        return self.dense_layer_params + self.expert_params + vocab

    def adapter_params(self, linear: str, dim: int, tp: int) -> int:
        """Elements of one rank-``dim`` LoRA adapter ``A [dim, in]``, ``B [out, dim]`` on one
        TP rank: a column-parallel linear (``linear_qkv``, ``linear_fc1``) splits ``B``'s rows
        over the TP ranks, a row-parallel one (``linear_proj``, ``linear_fc2``) ``A``'s
        columns; the other matrix is replicated.

        Args:
            linear: the Megatron linear name of a dense layer.
            dim: the adapters' rank.
            tp: tensor-parallel size.
        """
        h, d = self.hidden_size, self.head_dim
        q, kv, f = self.num_attention_heads * d, self.num_kv_heads * d, self.ffn_hidden_size
        replicated, split = {
            "linear_qkv": (h, q + 2 * kv),
            "linear_proj": (h, q),
            "linear_fc1": (h, 2 * f),
            "linear_fc2": (h, f),
        }[linear]
        return dim * (replicated + split // tp)

    def largest_stream_elements(self) -> int:
        """Elements of the largest record of the refit stream: the embedding / LM head, a
        projection, or a MoE layer's stacked gate and up experts [E, 2f_e, h]."""
        h = self.hidden_size
        candidates = [
            self.vocab_size * h,
            self.num_attention_heads * self.head_dim * h,
            self.ffn_hidden_size * h if self.num_moe_layers < self.num_layers else 0,
            self.num_experts * 2 * self.moe_ffn_hidden_size * h,
        ]
        return max(candidates)


@dataclass(frozen=True)
class TrainingSetup:
    """How the policy trains, as the plan needs it.

    Attributes:
        world_size: GPUs of the policy.
        tp, pp, cp, ep: tensor, pipeline, context and expert parallel sizes.
        sequence_parallel, activation_checkpointing: as ``policy.megatron_cfg``.
        param_bytes: bytes of a parameter and of an activation element (2 bf16/fp16, 4 fp32).
        distributed_optimizer: optimizer state sharded over the data-parallel ranks.
        optimizer_moments: fp32 state tensors per parameter besides the master copy (Adam 2,
            SGD 1).
        micro_batch_tokens: tokens of one training micro-batch (before CP splits them).
        logprob_micro_batch_tokens: tokens of one logprob micro-batch; None: no logprob pass
            (a supervised run).
        padded_vocab_size: embedding rows Megatron allocates for this TP.
        logprob_chunk_size: ``policy.logprob_chunk_size``: the LM head is fused with the
            logprobs and only this many tokens' logits exist at once; None: the full logits.
        adapter_params: LoRA adapter parameters on the most loaded GPU (split by TP and PP),
            the only ones with gradients and optimizer state; None: every parameter trains.
    """

    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    sequence_parallel: bool
    activation_checkpointing: bool
    param_bytes: int
    distributed_optimizer: bool
    optimizer_moments: int
    micro_batch_tokens: int
    logprob_micro_batch_tokens: int | None
    padded_vocab_size: int
    logprob_chunk_size: int | None = None
    adapter_params: int | None = None

    @property
    def dp(self) -> int:
        """Ranks the dense parameters' optimizer state is sharded over (DP x CP)."""
        return self.world_size // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        """Ranks each expert's optimizer state is sharded over."""
        return self.world_size // (self.tp * self.ep * self.pp)


@dataclass(frozen=True)
class GenerationSetup:
    """The vLLM engines, as the plan needs them.

    Attributes:
        tensor_parallel_size: GPUs of one engine.
        gpu_memory_utilization: fraction of each GPU the engine takes.
        weight_bytes: bytes of a weight and of a KV-cache element in the engine's dtype.
        colocated: the engines share the policy's GPUs.
        max_model_len: longest sequence the engine must hold, in tokens.
    """

    tensor_parallel_size: int
    gpu_memory_utilization: float
    weight_bytes: int
    colocated: bool
    max_model_len: int


@dataclass(frozen=True)
class Term:
    """One named amount of memory on a GPU.

    Attributes:
        name: one of the module's term names.
        nbytes: bytes per GPU.
        detail: how they are computed, with the numbers.
        fix: what lowers them (config keys), for the message of a plan that does not fit.
    """

    name: str
    nbytes: int
    detail: str
    fix: str


@dataclass(frozen=True)
class Phase:
    """What one GPU holds during one phase of a step.

    Attributes:
        name: ``training``, ``logprobs``, ``refit`` or ``generation``.
        gpus: which GPUs go through it (``every GPU``, ``policy GPUs``, ``generation GPUs``).
        terms: what is resident then.
    """

    name: str
    gpus: str
    terms: tuple[Term, ...]

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.terms)

    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.nbytes)


class MemoryPlanError(ValueError):
    """A plan that does not fit the declared GPU memory; the message names the largest term
    of the phase that overflows and what to change."""


def gib(nbytes: float) -> str:
    """``12.3`` (GiB, one decimal)."""
    return f"{nbytes / GiB:.1f}"


def _count(n: int) -> str:
    """A parameter count: ``8.03e9`` from a billion on, else with thousands separators."""
    return f"{n / 1e9:.3g}e9" if n >= 1e9 else f"{n:,}"


@dataclass(frozen=True)
class NoMemoryPlan:
    """Why a run has no GPU memory plan (a CPU run, a model whose shape is not here)."""

    reason: str

    def check(self) -> None:
        """Nothing to check."""

    def format(self) -> str:
        return f"GPU memory plan: none ({self.reason})"


@dataclass(frozen=True)
class MemoryPlan:
    """The per-GPU memory of a run, phase by phase.

    Attributes:
        model: the model's name, and where its shape came from.
        gpu_bytes: memory of one GPU (``cluster.gpu_memory_gb``).
        phases: in step order.
        problems: what does not fit besides the phases' totals (the engine's weights beyond
            its budget, a KV cache without room for one ``max_model_len`` sequence).
        notes: figures worth printing beside the table (KV-cache tokens per engine).
    """

    model: str
    gpu_bytes: int
    phases: tuple[Phase, ...]
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def phase(self, name: str) -> Phase:
        """The phase called ``name``.

        Raises:
            KeyError: the plan has no such phase (a supervised run has only ``training``).
        """
        for phase in self.phases:
            if phase.name == name:
                return phase
        raise KeyError(f"the plan has no {name!r} phase: {[p.name for p in self.phases]}")

    def peak(self) -> Phase:
        """The phase holding the most on one GPU."""
        return max(self.phases, key=lambda p: p.total)

    def term(self, phase: str, name: str) -> Term | None:
        """``name``'s term in ``phase`` (None when that phase does not hold it)."""
        return next((t for t in self.phase(phase).terms if t.name == name), None)

    def check(self) -> None:
        """Raise when a phase exceeds the GPU's memory or the engine's budget is too small.

        Raises:
            MemoryPlanError: naming the phase, its total, its largest term and that term's fix
                (or the engine's problem), then the whole plan.
        """
        messages = list(self.problems)
        for phase in self.phases:
            if phase.total > self.gpu_bytes:
                term = phase.largest()
                messages.append(
                    f"the {phase.name} phase needs {gib(phase.total)} GiB per GPU "
                    f"({phase.gpus}), more than cluster.gpu_memory_gb = "
                    f"{gib(self.gpu_bytes)} GiB; its largest term is {term.name} = "
                    f"{gib(term.nbytes)} GiB ({term.detail}): {term.fix}"
                )
        if messages:
            raise MemoryPlanError(
                "the GPU memory plan does not fit: " + "; ".join(messages) + "\n" + self.format()
            )

    def _rows(self) -> list[str]:
        """Term names in first-seen order over the phases."""
        return list(dict.fromkeys(t.name for p in self.phases for t in p.terms))

    def _cell(self, phase: Phase, name: str) -> str:
        term = next((t for t in phase.terms if t.name == name), None)
        return "-" if term is None else gib(term.nbytes)

    def _header(self) -> list[str]:
        """``GiB per GPU`` and the phases (with their GPUs where not every GPU has them all)."""
        every = all(p.gpus == "every GPU" for p in self.phases)
        return ["GiB per GPU", *(p.name if every else f"{p.name} ({p.gpus})" for p in self.phases)]

    def _summary(self) -> str:
        peak = self.peak()
        share = peak.total / self.gpu_bytes
        verdict = "fits" if peak.total <= self.gpu_bytes and not self.problems else "DOES NOT FIT"
        return (
            f"Peak: {peak.name} ({peak.gpus}), {gib(peak.total)} of {gib(self.gpu_bytes)} GiB "
            f"({share:.0%}): {verdict}"
        )

    def format(self) -> str:
        """The plan as text: a table (terms x phases, GiB per GPU), the peak, then how each
        term was computed."""
        header = self._header()
        rows = [[name, *(self._cell(p, name) for p in self.phases)] for name in self._rows()]
        rows.append(["total", *(gib(p.total) for p in self.phases)])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

        def line(cells: list[str]) -> str:
            first = cells[0].ljust(widths[0])
            return "  " + "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:]))])

        return "\n".join([
            f"GPU memory plan of {self.model}:",
            line(header),
            *(line(r) for r in rows),
            "  " + self._summary(),
            *(f"  {n}" for n in self.notes),
            "  terms:",
            *(f"    {d}" for d in self._details()),
        ])

    def _details(self) -> list[str]:
        """``name: detail`` per term, once when every phase holding it computes it alike, else
        ``name (phase): detail`` per phase."""
        lines = []
        for name in self._rows():
            held = [(p.name, t.detail) for p in self.phases for t in p.terms if t.name == name]
            if len({detail for _, detail in held}) == 1:
                lines.append(f"{name}: {held[0][1]}")
            else:
                lines += [f"{name} ({phase}): {detail}" for phase, detail in held]
        return lines

    def markdown(self) -> str:
        """The table and the peak as Markdown (docs/cluster.md shows each shipped recipe's)."""
        header = self._header()
        rows = [[name, *(self._cell(p, name) for p in self.phases)] for name in self._rows()]
        rows.append(["**total**", *(f"**{gib(p.total)}**" for p in self.phases)])
        lines = [
            "| " + " | ".join(header) + " |",
            "|" + "---|" + "---:|" * len(self.phases),
            *("| " + " | ".join(r) + " |" for r in rows),
            "",
            " ".join(f"{line}." for line in (self._summary(), *self.notes)),
        ]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------ terms


def _params_per_gpu(model: ModelShape, t: TrainingSetup) -> tuple[int, int]:
    """(dense parameters, expert parameters) on the most loaded GPU (the first stage's)."""
    vocab_matrices = 1 if model.tie_word_embeddings or t.pp > 1 else 2
    vocab = vocab_matrices * t.padded_vocab_size * model.hidden_size // t.tp
    dense = model.dense_layer_params // (t.tp * t.pp) + vocab
    experts = model.expert_params // (t.tp * t.ep * t.pp)
    return dense, experts


def _layer_elements(model: ModelShape, t: TrainingSetup) -> tuple[float, float]:
    """Activation elements per token of (the attention block plus a dense MLP, the attention
    block plus an expert MLP) on one rank (see the module docstring)."""
    h, tp = model.hidden_size, t.tp
    h_sp = h / tp if t.sequence_parallel else h
    d = model.head_dim
    a, g = model.num_attention_heads, model.num_kv_heads
    attention = 2 * h_sp + (a + 2 * g) * d / tp + a * d / tp
    dense = 2 * h_sp + 3 * model.ffn_hidden_size / tp
    moe = 2 * h_sp + model.moe_top_k * (2 * h + 3 * model.moe_ffn_hidden_size / tp)
    return attention + dense, attention + moe


def _activation_term(model: ModelShape, t: TrainingSetup) -> Term:
    tokens = t.micro_batch_tokens / t.cp
    dense_layer, moe_layer = _layer_elements(model, t)
    dense_layers = model.num_layers - model.num_moe_layers
    widest = moe_layer if model.num_moe_layers else dense_layer
    in_flight = t.pp  # 1F1B: the first stage holds PP micro-batches
    h_sp = model.hidden_size / t.tp if t.sequence_parallel else model.hidden_size
    if t.activation_checkpointing:
        per_token = model.num_layers / t.pp * in_flight * h_sp + widest
        how = (
            f"recompute: each of {model.num_layers}/{t.pp} layers keeps its input x {in_flight} "
            f"micro-batch(es) in flight + one layer's full activations"
        )
    else:
        all_layers = dense_layers * dense_layer + model.num_moe_layers * moe_layer
        per_token = all_layers / t.pp * in_flight
        how = (
            f"no recompute: {model.num_layers}/{t.pp} layers x {in_flight} micro-batch(es) in "
            "flight"
        )
    nbytes = int(tokens * per_token * t.param_bytes)
    split = f"/ CP {t.cp} " if t.cp > 1 else ""
    sp = ", sequence parallel" if t.sequence_parallel else ""
    return Term(
        ACTIVATIONS,
        nbytes,
        f"{t.micro_batch_tokens} tokens {split}per micro-batch, {how}{sp}, "
        f"{t.param_bytes} B per element",
        f"set {_MCFG}.activation_checkpointing=true, fewer tokens per micro-batch "
        "(policy.sequence_packing.train_mb_tokens / policy.train_micro_batch_size), or raise "
        f"{_MCFG}.tensor_model_parallel_size (with sequence_parallel) or context_parallel_size",
    )


def _forward_activation_term(model: ModelShape, t: TrainingSetup, tokens: int) -> Term:
    """One layer's activations of a forward pass without gradients (they are freed layer by
    layer)."""
    dense_layer, moe_layer = _layer_elements(model, t)
    widest = moe_layer if model.num_moe_layers else dense_layer
    nbytes = int(tokens / t.cp * widest * t.param_bytes)
    return Term(
        ACTIVATIONS,
        nbytes,
        f"one layer's forward activations of {tokens} tokens (no backward)",
        "fewer tokens per logprob micro-batch (policy.sequence_packing.logprob_mb_tokens / "
        "policy.logprob_batch_size)",
    )


def _logits_term(t: TrainingSetup, tokens: int, key: str) -> Term:
    split = f" / CP {t.cp}" if t.cp > 1 else ""
    local = tokens // t.cp
    if t.logprob_chunk_size is not None and t.logprob_chunk_size < local:
        # fused LM head: one chunk's fp32 logits, and as much again for the matmul's output
        # and the chunk's gradient in the backward
        chunk = t.logprob_chunk_size
        return Term(
            LOGITS,
            2 * chunk * (t.padded_vocab_size // t.tp) * FP32_BYTES,
            f"2 x [{chunk} tokens (policy.logprob_chunk_size), {t.padded_vocab_size} vocab / "
            f"TP {t.tp}] x 4 B",
            "a smaller policy.logprob_chunk_size",
        )
    return Term(
        LOGITS,
        local * (t.padded_vocab_size // t.tp) * FP32_BYTES,
        f"[{tokens} tokens{split}, {t.padded_vocab_size} vocab / TP {t.tp}] x 4 B",
        f"fewer tokens per micro-batch ({key}) or a larger {_MCFG}.tensor_model_parallel_size",
    )


def _static_terms(model: ModelShape, t: TrainingSetup) -> tuple[Term, ...]:
    """Parameters, gradients and optimizer state of the policy on one GPU (with LoRA, the
    gradients and optimizer state of the adapters only)."""
    dense, experts = _params_per_gpu(model, t)
    params = dense + experts
    split = f"(TP {t.tp} x PP {t.pp})" + (f", experts / (TP x EP {t.ep} x PP)" if experts else "")
    layout_fix = (
        f"raise {_MCFG}.tensor_model_parallel_size or pipeline_model_parallel_size"
        + (" or expert_model_parallel_size" if experts else "")
    )
    master = FP32_BYTES if t.param_bytes < FP32_BYTES else 0
    state = master + t.optimizer_moments * FP32_BYTES
    dp, edp = (t.dp, t.expert_dp) if t.distributed_optimizer else (1, 1)
    opt_fix = (
        f"keep {_MCFG}.optimizer.use_distributed_optimizer=true and give the policy more GPUs "
        f"(a larger data-parallel size), or {layout_fix.removeprefix('raise ')}"
        if t.distributed_optimizer
        else f"set {_MCFG}.optimizer.use_distributed_optimizer=true"
    )
    state_detail = f"{state} B per parameter (fp32 {'master + ' if master else ''}"
    state_detail += f"{t.optimizer_moments} moment(s))"
    if t.adapter_params is None:
        trained = params
        optimizer = dense * state // dp + experts * state // edp
        shards = f"dense / DP {dp}" + (f", experts / DP_e {edp}" if experts else "")
        params_detail = f"{_count(params)} per GPU = model / {split}, {t.param_bytes} B each"
        trained_detail = f"{_count(params)} x 4 B (fp32)"
    else:
        trained = t.adapter_params
        optimizer = trained * state // dp
        shards = f"LoRA adapters only / DP {dp}"
        params_detail = (
            f"{_count(params)} frozen per GPU = model / {split} + {_count(trained)} LoRA "
            f"adapter, {t.param_bytes} B each"
        )
        trained_detail = f"{_count(trained)} LoRA adapter x 4 B (fp32; the base is frozen)"
    return (
        Term(
            PARAMETERS,
            (params + (t.adapter_params or 0)) * t.param_bytes,
            params_detail,
            layout_fix,
        ),
        Term(GRADIENTS, trained * FP32_BYTES, trained_detail, layout_fix),
        Term(OPTIMIZER, optimizer, f"{state_detail}, {shards}", opt_fix),
    )


def _runtime_term() -> Term:
    return Term(
        RUNTIME,
        RUNTIME_ALLOWANCE_BYTES,
        "CUDA context, NCCL communicators, cuBLAS workspaces, allocator slack of the "
        "training process",
        "nothing to change in the config: lower another term",
    )


def _ring_term(model: ModelShape, bucket_bytes: int, export_bytes: int) -> Term:
    largest = model.largest_stream_elements() * export_bytes
    nbytes = refit_staging_bytes(bucket_bytes, largest)
    return Term(
        REFIT_RING,
        nbytes,
        f"{RING_SLOTS} x max(bucket {gib(bucket_bytes)} GiB, largest tensor {gib(largest)} GiB)",
        "lower policy.refit_buffer_size_gb (down to the largest tensor)",
    )


def _engine_terms(model: ModelShape, g: GenerationSetup, gpu_bytes: int) -> tuple[Term, Term]:
    budget = int(g.gpu_memory_utilization * gpu_bytes)
    weights = model.total_params * g.weight_bytes // g.tensor_parallel_size
    return (
        Term(
            ENGINE_WEIGHTS,
            weights,
            f"{_count(model.total_params)} x {g.weight_bytes} B / vLLM TP "
            f"{g.tensor_parallel_size}",
            f"lower {_VLLM}.gpu_memory_utilization (the weights and the KV cache share that "
            "budget; a larger tensor_parallel_size leaves more of a smaller budget to the KV "
            "cache)",
        ),
        Term(
            KV_CACHE,
            max(0, budget - weights),
            f"the rest of the budget {_VLLM}.gpu_memory_utilization {g.gpu_memory_utilization}"
            f" x {gib(gpu_bytes)} GiB = {gib(budget)} GiB",
            f"lower {_VLLM}.gpu_memory_utilization",
        ),
    )


def _kv_bytes_per_token(model: ModelShape, g: GenerationSetup) -> int:
    """KV-cache bytes of one token on one GPU of an engine (KV heads split over its TP, at
    least one per GPU)."""
    heads = max(1, model.num_kv_heads // g.tensor_parallel_size)
    return 2 * model.num_layers * heads * model.head_dim * g.weight_bytes


def _engine_problems(
    model: ModelShape, g: GenerationSetup, weights: Term, kv: Term, gpu_bytes: int
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(problems, notes) of the engine's budget."""
    budget = int(g.gpu_memory_utilization * gpu_bytes)
    if weights.nbytes > budget:
        return (
            f"the vLLM engine's weights, {gib(weights.nbytes)} GiB per GPU ({weights.detail}), "
            f"exceed its budget {_VLLM}.gpu_memory_utilization {g.gpu_memory_utilization} x "
            f"{gib(gpu_bytes)} GiB = {gib(budget)} GiB: raise {_VLLM}.tensor_parallel_size or "
            "gpu_memory_utilization",
        ), ()
    tokens = kv.nbytes // _kv_bytes_per_token(model, g)
    note = (
        f"vLLM KV cache: {_kv_bytes_per_token(model, g) // 1024} KiB per token per GPU -> at "
        f"most {tokens:,} tokens per engine ({tokens // g.max_model_len:,} sequences of "
        f"max_model_len {g.max_model_len})"
    )
    if tokens < g.max_model_len:
        return (
            f"the vLLM KV cache, {gib(kv.nbytes)} GiB per GPU, holds {tokens} tokens, fewer "
            f"than one sequence of {_VLLM}.max_model_len = {g.max_model_len} (vLLM refuses to "
            f"start): raise {_VLLM}.gpu_memory_utilization or tensor_parallel_size",
        ), (note,)
    return (), (note,)


# ------------------------------------------------------------------------------------ plan


def plan_memory(
    model: ModelShape,
    model_name: str,
    training: TrainingSetup,
    generation: GenerationSetup | None,
    refit_bucket_bytes: int,
    gpu_bytes: int,
) -> MemoryPlan:
    """The per-GPU memory plan (see the module docstring for the phases and formulas).

    Args:
        model: the model's shape.
        model_name: how the plan names the model (and where its shape came from).
        training: the policy's layout and batches.
        generation: the vLLM engines; None for a supervised run (one phase: training).
        refit_bucket_bytes: one refit bucket.
        gpu_bytes: memory of one GPU.
    """
    static = _static_terms(model, training)
    runtime = _runtime_term()
    asleep: tuple[Term, ...] = ()
    colocated = generation is not None and generation.colocated
    if colocated:
        asleep = (
            Term(
                ENGINE_ASLEEP,
                ASLEEP_ENGINE_BYTES,
                "CUDA context and graph pool of the sleeping engine (weights offloaded, KV "
                "cache dropped)",
                f"set {_VLLM}.enforce_eager=true (no CUDA graphs)",
            ),
        )
    policy_gpus = "every GPU" if colocated or generation is None else "policy GPUs"
    train = Phase(
        TRAINING,
        policy_gpus,
        (
            *static,
            _activation_term(model, training),
            _logits_term(
                training,
                training.micro_batch_tokens,
                "policy.sequence_packing.train_mb_tokens / policy.train_micro_batch_size",
            ),
            runtime,
            *asleep,
        ),
    )
    if generation is None:
        return MemoryPlan(model_name, gpu_bytes, (train,))
    lp_tokens = training.logprob_micro_batch_tokens or training.micro_batch_tokens
    logprobs = Phase(
        LOGPROBS,
        policy_gpus,
        (
            *static,
            _forward_activation_term(model, training, lp_tokens),
            _logits_term(
                training,
                lp_tokens,
                "policy.sequence_packing.logprob_mb_tokens / policy.logprob_batch_size",
            ),
            runtime,
            *asleep,
        ),
    )
    ring = _ring_term(model, refit_bucket_bytes, generation.weight_bytes)
    weights, kv = _engine_terms(model, generation, gpu_bytes)
    if colocated:
        refit = Phase(REFIT, policy_gpus, (weights, kv, static[0], ring, runtime))
        gen = Phase(GENERATION, policy_gpus, (weights, kv, runtime))
    else:
        refit = Phase(REFIT, policy_gpus, (*static, ring, runtime))
        gen = Phase(GENERATION, "generation GPUs", (weights, kv, ring))
    problems, notes = _engine_problems(model, generation, weights, kv, gpu_bytes)
    return MemoryPlan(
        model_name, gpu_bytes, (train, logprobs, refit, gen), problems=problems, notes=notes
    )
