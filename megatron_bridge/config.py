"""HF ``config.json`` -> Megatron-Core ``TransformerConfig`` and ``GPTModel`` arguments.

:class:`BridgeConfig` holds the HF config (verbatim, so exporting writes it back unchanged),
the family it belongs to, and the vocabulary padding. Parallel sizes are validated here,
before any model is built, with errors naming the config fields involved.
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.families import (
    CAUSAL_LM_SUFFIX,
    SEQUENCE_CLASSIFIER_SUFFIX,
    Family,
    Features,
    ModelDims,
    ParamMapping,
    get_family,
)
from megatron_bridge.families.base import SCORE_HF_NAME, SCORE_TENSOR
from megatron_bridge.families.config_fields import UnsupportedConfigError, check_config
from megatron_bridge.transforms import padded_vocab_size

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``"float32"``/``"fp32"``/``"float16"``/``"fp16"`` -> dtype.

    Raises:
        ValueError: an unknown name; lists the accepted ones.
    """
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    key = aliases.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES) + sorted(aliases)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name config.json and bridge.json use)."""
    return str(dtype).removeprefix("torch.")


@dataclass
class BridgeConfig:
    """Everything needed to build, load and export one model.

    Attributes:
        hf_config: the HF ``config.json`` contents, unchanged.
        make_vocab_size_divisible_by: Megatron pads embedding rows to a multiple of this
            times TP (default 128, Megatron's default).
        padded_vocab_size: embedding rows of an existing Megatron checkpoint; None to derive
            from the vocabulary size, the divisor and TP.
    """

    hf_config: dict[str, Any]
    make_vocab_size_divisible_by: int = 128
    padded_vocab_size: int | None = None

    def __post_init__(self) -> None:
        """Refuse an unsupported architecture, and any config field whose value the
        conversion does not implement (:mod:`megatron_bridge.families.config_fields`).

        Raises:
            ValueError: naming the architecture or the fields (``UnsupportedConfigError``).
        """
        check_config(self.family.architecture, self.family.config_fields, self.hf_config)
        self.resolved  # noqa: B018 - refuse values transformers itself rejects, now

    @functools.cached_property
    def resolved(self) -> dict[str, Any]:
        """The config as transformers reads it: its config class's defaults for the fields
        config.json leaves out (e.g. Mistral's 4096-token window, Qwen2's KV heads) and its
        derived fields (e.g. Qwen2's ``layer_types``). Every model fact is read from here;
        ``hf_config`` stays verbatim for writing back.

        Raises:
            UnsupportedConfigError: transformers' config class rejects the config.
        """
        return self.transformers_config().to_dict()

    def transformers_config(self) -> Any:
        """The config as a transformers config object of the family's class.

        Raises:
            UnsupportedConfigError: the class rejects the config.
        """
        import transformers
        from huggingface_hub.errors import StrictDataclassError

        config_class = getattr(transformers, self.family.hf_config_class)
        try:
            return config_class.from_dict(self.hf_config)
        except (TypeError, ValueError, StrictDataclassError) as err:
            raise UnsupportedConfigError(
                f"transformers' {self.family.hf_config_class} rejects this config.json: {err}"
            ) from err

    @classmethod
    def from_hf(cls, path: str | Path, **kwargs: Any) -> "BridgeConfig":
        """Read ``config.json`` from an HF checkpoint folder.

        Raises:
            FileNotFoundError: no config.json in ``path``.
            ValueError: an unsupported architecture.
        """
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: not an HF checkpoint folder")
        return cls(json.loads(config_file.read_text()), **kwargs)

    # ---- derived model facts -------------------------------------------------------------

    @property
    def family(self) -> Family:
        architectures = self.hf_config.get("architectures") or [None]
        return get_family(architectures[0])

    @property
    def features(self) -> Features:
        """Biases, QK-norm and sliding windows this config selects."""
        return self.family.features(self.resolved)

    def _get(self, key: str, default: Any = None) -> Any:
        return self.resolved.get(key, default)

    @property
    def num_layers(self) -> int:
        return int(self.resolved["num_hidden_layers"])

    @property
    def num_heads(self) -> int:
        return int(self.resolved["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self._get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self._get("head_dim") or self.resolved["hidden_size"] // self.num_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.resolved["vocab_size"])

    @property
    def num_experts(self) -> int:
        """Experts per sparse layer; 0 for a dense model."""
        if self.family.sparse_mlp is None:
            return 0
        return int(self._get("num_local_experts") or self._get("num_experts") or 0)

    @property
    def is_moe(self) -> bool:
        """True when some decoder layer has experts instead of a dense MLP."""
        return any(self.features.sparse_layers)

    @property
    def moe_ffn(self) -> int:
        """An expert's intermediate size; 0 for a dense model."""
        sparse = self.family.sparse_mlp
        return int(self.resolved[sparse.ffn_field]) if sparse and self.is_moe else 0

    @property
    def tie_word_embeddings(self) -> bool:
        """The LM head is the embedding matrix (never for a sequence classifier: it has no LM
        head, whatever its causal LM's config said)."""
        return not self.is_sequence_classifier and bool(self._get("tie_word_embeddings", False))

    @property
    def is_sequence_classifier(self) -> bool:
        """A ``...ForSequenceClassification`` model: the decoder with a score head
        ``[num_labels, hidden]`` (``score.weight``) in place of the LM head."""
        architectures = self.hf_config.get("architectures") or [""]
        return str(architectures[0]).endswith(SEQUENCE_CLASSIFIER_SUFFIX)

    @property
    def num_labels(self) -> int:
        """Rows of a sequence classifier's score head (transformers' ``num_labels``)."""
        return int(self.resolved.get("num_labels", 1))

    def as_sequence_classifier(self, pad_token_id: int, num_labels: int = 1) -> "BridgeConfig":
        """This causal LM as a ``...ForSequenceClassification`` model of ``num_labels`` scores
        (1: a reward model). ``pad_token_id`` is set because transformers' classifier scores
        the last token that is not padding.

        Raises:
            ValueError: the model is not a causal LM.
        """
        arch = self.family.architecture
        if self.is_sequence_classifier or not arch.endswith(CAUSAL_LM_SUFFIX):
            raise ValueError(f"{self.hf_config.get('architectures')} is not a causal LM")
        labels = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        config = {
            **self.hf_config,
            "architectures": [arch.removesuffix(CAUSAL_LM_SUFFIX) + SEQUENCE_CLASSIFIER_SUFFIX],
            "id2label": labels,
            "label2id": {name: int(i) for i, name in labels.items()},
            "pad_token_id": pad_token_id,
        }
        return BridgeConfig(config, self.make_vocab_size_divisible_by, self.padded_vocab_size)

    def rope_parameters(self) -> dict[str, Any]:
        """``{"rope_type": ..., "rope_theta": ..., ...}`` from either HF config layout."""
        params = dict(self._get("rope_parameters") or self._get("rope_scaling") or {})
        params.setdefault("rope_theta", self._get("rope_theta", 10000.0))
        params["rope_type"] = params.get("rope_type", params.get("type", "default"))
        return params

    def padded_vocab(self, tp: int) -> int:
        """Embedding rows for tensor-parallel size ``tp``.

        Raises:
            ValueError: a fixed ``padded_vocab_size`` that ``tp`` does not divide.
        """
        if self.padded_vocab_size is not None:
            if self.padded_vocab_size % tp:
                raise ValueError(
                    f"the checkpoint's padded vocabulary ({self.padded_vocab_size} rows) is not "
                    f"divisible by tp={tp}; pick a tp that divides it"
                )
            return self.padded_vocab_size
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def dims(self, tp: int) -> ModelDims:
        return ModelDims(
            hidden_size=int(self.resolved["hidden_size"]),
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            ffn=int(self.resolved["intermediate_size"]),
            vocab_size=self.vocab_size,
            padded_vocab_size=self.padded_vocab(tp),
            moe_ffn=self.moe_ffn,
            num_experts=self.num_experts,
            num_labels=self.num_labels,
        )

    def plan(self) -> list[ParamMapping]:
        """Every Megatron tensor in export order; a sequence classifier's head last."""
        if not self.is_sequence_classifier:
            return self.family.plan(
                self.num_layers, self.tie_word_embeddings, self.features, self.num_experts
            )
        # The causal LM's plan without its LM head (as when tied), then the score head.
        body = self.family.plan(self.num_layers, True, self.features, self.num_experts)
        return [*body, ParamMapping(SCORE_TENSOR, (SCORE_HF_NAME,), "copy")]

    # ---- validation ----------------------------------------------------------------------

    def validate_parallelism(self, tp: int, pp: int, ep: int = 1) -> None:
        """Check that TP, PP and expert parallelism EP fit this model, before anything is
        built (how many ranks they need: :func:`megatron_bridge.parallel_state.
        check_parallel_sizes`).

        Raises:
            ValueError: naming the config field and the constraint it breaks.
        """
        if tp < 1 or pp < 1 or ep < 1:
            raise ValueError(f"tp, pp and ep must be >= 1, got tp={tp}, pp={pp}, ep={ep}")
        if self.num_heads % tp:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be divisible by tp ({tp}); "
                f"choose a tp that divides it"
            )
        if self.num_kv_heads < tp:
            raise ValueError(
                f"num_key_value_heads ({self.num_kv_heads}) must be >= tp ({tp}): replicating "
                f"KV heads across TP ranks is not supported; use tp <= {self.num_kv_heads}"
            )
        if self.num_kv_heads % tp:
            raise ValueError(
                f"num_key_value_heads ({self.num_kv_heads}) must be divisible by tp ({tp})"
            )
        if int(self.resolved["intermediate_size"]) % tp:
            raise ValueError(
                f"intermediate_size ({self.resolved['intermediate_size']}) must be divisible "
                f"by tp ({tp})"
            )
        if self.num_layers % pp:
            raise ValueError(
                f"num_hidden_layers ({self.num_layers}) must be divisible by pp ({pp})"
            )
        self._validate_experts(tp, ep)
        self.padded_vocab(tp)

    def _validate_experts(self, tp: int, ep: int) -> None:
        """Experts split whole across EP ranks; each expert's MLP split across TP ranks
        (megatron's expert tensor parallelism, whose size here is TP's)."""
        if not self.is_moe:
            if ep > 1:
                raise ValueError(
                    f"expert_model_parallel_size (ep={ep}) > 1 needs a mixture-of-experts "
                    f"model; {self.family.architecture} here has no experts: use ep=1"
                )
            return
        experts = self.num_experts
        if experts % ep:
            raise ValueError(
                f"num_local_experts ({experts}) must be divisible by expert_model_parallel_size "
                f"(ep={ep}); choose an ep that divides it"
            )
        field = self.family.sparse_mlp.ffn_field
        if self.moe_ffn % tp:
            raise ValueError(f"{field} ({self.moe_ffn}) must be divisible by tp ({tp})")

    # ---- Megatron objects ----------------------------------------------------------------

    def transformer_config(
        self, tp: int, pp: int, dtype: torch.dtype = torch.float32, ep: int = 1
    ) -> Any:
        """A Megatron ``TransformerConfig`` for this model at the given parallel sizes.

        Args:
            dtype: parameter dtype (fp32 on CPU for exact comparisons; bf16 for large models).
            ep: expert-parallel size (``expert_model_parallel_size``).
        """
        from megatron.core.transformer import TransformerConfig

        self.validate_parallelism(tp, pp, ep)
        features = self.features
        window = features.window
        dropout = {k: self._get(k) for k in ("attention_dropout", "hidden_dropout") if self._get(k)}
        if dropout:
            warnings.warn(
                f"config.json asks for dropout {dropout}; the Megatron model runs without "
                f"dropout (attention_dropout=0, hidden_dropout=0)",
                stacklevel=2,
            )
        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=int(self.resolved["hidden_size"]),
            ffn_hidden_size=int(self.resolved["intermediate_size"]),
            num_attention_heads=self.num_heads,
            num_query_groups=self.num_kv_heads,
            kv_channels=self.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=float(self._get("rms_norm_eps", 1e-6)),
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            # Megatron switches the o_proj and MLP biases together (add_bias_linear); the
            # layer spec drops the ones this model lacks (megatron_bridge.layer_spec).
            add_bias_linear=features.out_bias or features.mlp_bias,
            add_qkv_bias=features.qkv_bias,
            qk_layernorm=features.qk_layernorm,
            # Megatron's window (left, right) excludes the query itself; HF's includes it.
            window_size=(window - 1, 0) if window else None,
            # Per layer (1-based in Megatron): a true entry uses the window.
            window_attn_skip_freq=(
                [int(s) for s in features.window_layers] if features.window_layers else None
            ),
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            use_cpu_initialization=True,
            # Weights come from the checkpoint: skip random initialisation.
            perform_initialization=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            **self.moe_config(tp, ep),
        )

    def moe_config(self, tp: int, ep: int) -> dict[str, Any]:
        """The ``TransformerConfig`` fields of the experts and router; none for a dense model.

        The router matches transformers': softmax scores in fp32, top-k, renormalised or not
        (``norm_topk_prob``), no capacity limit (no token dropped). The auxiliary
        load-balancing loss is a training choice and stays off here (it never changes the
        logits).
        """
        if not self.is_moe:
            return {}
        features = self.features
        return dict(
            num_moe_experts=self.num_experts,
            moe_ffn_hidden_size=self.moe_ffn,
            moe_router_topk=int(self.resolved["num_experts_per_tok"]),
            # Megatron's layer pattern (1 = experts), per layer; an integer would count
            # from layer 0 where transformers' decoder_sparse_step counts from layer 1.
            moe_layer_freq=[int(s) for s in features.sparse_layers],
            moe_router_score_function="softmax",
            # Top-k of the logits then softmax over those k = renormalised top-k
            # probabilities; softmax first then top-k = the probabilities as they are.
            moe_router_pre_softmax=not features.norm_topk_prob,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            expert_model_parallel_size=ep,
            # Each expert's MLP is split like the dense MLP, across the TP ranks.
            expert_tensor_parallel_size=tp,
        )

    def gpt_model_kwargs(self, tp: int) -> dict[str, Any]:
        """Keyword arguments for ``GPTModel`` besides ``config`` and the layer spec."""
        return dict(
            vocab_size=self.padded_vocab(tp),
            max_sequence_length=int(self._get("max_position_embeddings", 4096)),
            position_embedding_type="rope",
            rotary_base=int(self.rope_parameters()["rope_theta"]),
            share_embeddings_and_output_weights=self.tie_word_embeddings,
            parallel_output=True,
        )

    def rope_inv_freq(self) -> torch.Tensor | None:
        """Inverse RoPE frequencies ``[head_dim / 2]`` for scaled RoPE, None for default RoPE.

        Computed by transformers' own RoPE functions so scaled variants match HF exactly.
        """
        params = self.rope_parameters()
        if params["rope_type"] == "default":
            return None
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](
            self.transformers_config(), "cpu"
        )
        if attention_factor != 1.0:
            raise ValueError(
                f"rope_type {params['rope_type']!r} with attention factor {attention_factor} "
                f"is not supported"
            )
        return inv_freq.float()
