"""Which HF ``config.json`` fields a conversion implements, and the refusal of the rest.

A field that changes the computation and is silently ignored converts a model into a
different one (e.g. dropped attention biases, or full attention where the model slides a
window). So every family lists each field it understands with a check: the check returns
None when the conversion implements the field's value, else the reason it cannot. A field
no family check lists is refused. :func:`check_config` applies them; its error names the
field, the value and what to do.

The lists cover every field of the installed transformers' config classes for every
family (a unit test asserts it, so a transformers upgrade that adds one fails a test until
it is classified), the fields every ``PretrainedConfig`` carries, and legacy generation
fields older transformers versions wrote into config.json.
"""

from __future__ import annotations

from typing import Any, Mapping

from megatron_bridge.families.base import FieldCheck, Features


class UnsupportedConfigError(ValueError):
    """A config.json field whose value the conversion does not implement."""


def accepted(_value: Any, _config: Mapping[str, Any]) -> None:
    """Implemented for any value: sizes the conversion reads, or fields that do not change
    the model's outputs (token ids, labels, metadata, dropout: see :data:`INERT`)."""
    return None


def only(*allowed: Any, fix: str) -> FieldCheck:
    """Implemented for the values in ``allowed`` only."""

    def check(value: Any, _config: Mapping[str, Any]) -> str | None:
        if value in allowed:
            return None
        return f"only {' or '.join(repr(a) for a in allowed)} is supported; {fix}"

    return check


def refused(reason: str) -> FieldCheck:
    """Never implemented, whatever the value (its presence changes the model)."""

    def check(_value: Any, _config: Mapping[str, Any]) -> str:
        return reason

    return check


def empty(value: Any, _config: Mapping[str, Any]) -> str | None:
    return None if not value else "a non-empty value changes the model and is not supported"


# RoPE variants whose inverse frequencies are computed by Megatron ("default") or by
# transformers' own functions and written into Megatron's rotary embedding.
ROPE_TYPES = ("default", "linear", "llama3")
# Keys of rope_parameters / rope_scaling the supported variants read.
_ROPE_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings",
}


def rope(value: Any, _config: Mapping[str, Any]) -> str | None:
    """``rope_parameters`` / ``rope_scaling`` (a dict or null) and legacy ``rope_theta``."""
    if value is None or isinstance(value, (int, float)):
        return None
    if not isinstance(value, Mapping):
        return f"expected a mapping, got {type(value).__name__}"
    rope_type = value.get("rope_type", value.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        return f"rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}"
    if value.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial_rotary_factor != 1.0 (RoPE on part of each head) is not supported"
    if value.get("attention_factor", 1.0) != 1.0:
        return "attention_factor != 1.0 (scaled attention logits) is not supported"
    unknown = sorted(set(value) - _ROPE_KEYS - {"partial_rotary_factor", "attention_factor"})
    if unknown:
        return f"keys {unknown} are not supported for rope_type {rope_type!r}"
    return None


def layer_types(value: Any, config: Mapping[str, Any]) -> str | None:
    """Per-layer attention kinds: a list of "full_attention" / "sliding_attention"."""
    if value is None:
        return None
    kinds = {"full_attention", "sliding_attention"}
    if not isinstance(value, list) or not set(value) <= kinds:
        return f"expected a list of {sorted(kinds)}"
    if len(value) != config.get("num_hidden_layers"):
        return f"has {len(value)} entries for num_hidden_layers={config.get('num_hidden_layers')}"
    return None


def positive_or_null(value: Any, _config: Mapping[str, Any]) -> str | None:
    if value is None or (isinstance(value, int) and value > 0):
        return None
    return "expected a positive number of tokens or null"


# Fields that do not change a causal LM's outputs: identity and bookkeeping, token ids,
# task labels, output switches, the dtype label (the tensors' own dtype is what counts),
# initialisation, the KV cache switch, dropout (training and verification here run without
# dropout; BridgeConfig warns when a config asks for it), and the generation defaults that
# transformers 4.x wrote into config.json.
INERT = (
    "_name_or_path", "architectures", "model_type", "transformers_version", "auto_map",
    "dtype", "torch_dtype", "use_bfloat16", "initializer_range", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params",
    "tokenizer_class", "prefix", "output_attentions", "output_hidden_states", "return_dict",
    "torchscript", "tf_legacy_loss", "chunk_size_feed_forward", "is_decoder",
    "attention_dropout", "hidden_dropout", "pretraining_tp",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
)

# Sizes and switches every family here reads (checked for consistency elsewhere: shapes
# against the tensors, parallel sizes against the heads).
SIZES = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "tie_word_embeddings",
)

COMMON_FIELDS: dict[str, FieldCheck] = {
    **{name: accepted for name in INERT + SIZES},
    "hidden_act": only("silu", fix="the MLP is SwiGLU with silu"),
    "rope_parameters": rope,
    "rope_scaling": rope,
    "rope_theta": rope,
    "is_encoder_decoder": only(False, fix="encoder-decoder models are not supported"),
    "add_cross_attention": only(False, fix="cross-attention is not supported"),
    "cross_attention_hidden_size": only(None, fix="cross-attention is not supported"),
    "tie_encoder_decoder": only(False, fix="encoder-decoder models are not supported"),
    "pruned_heads": empty,
    "quantization_config": refused(
        "quantized checkpoints are not supported; convert the unquantized (bf16/fp32) one"
    ),
}

# Mixture-of-experts sizes (``num_experts`` is transformers' alias of ``num_local_experts``),
# and the router's auxiliary load-balancing loss: its switch and coefficient enter the
# training loss, never the logits.
MOE_FIELDS: dict[str, FieldCheck] = {
    "num_local_experts": accepted,
    "num_experts": accepted,
    "num_experts_per_tok": accepted,
    "output_router_logits": accepted,
    "router_aux_loss_coef": accepted,
}

# Qwen2/Qwen3 sliding windows: on for layers >= max_window_layers (or as layer_types says)
# when use_sliding_window is true.
QWEN_WINDOW_FIELDS: dict[str, FieldCheck] = {
    "use_sliding_window": only(True, False, fix="use a boolean"),
    "sliding_window": positive_or_null,
    "max_window_layers": accepted,
    "layer_types": layer_types,
}
# transformers' Qwen2Config/Qwen3Config default for max_window_layers.
QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28


def qwen_window(config: Mapping[str, Any]) -> tuple[int | None, tuple[bool, ...] | None]:
    """``(window, window_layers)`` of a Qwen2/Qwen3 config (see :class:`Features`), as
    transformers reads it: no window unless ``use_sliding_window`` and ``sliding_window``
    are set; then ``layer_types`` if given, else layers from ``max_window_layers`` on."""
    window = config.get("sliding_window")
    if not config.get("use_sliding_window") or not window:
        return None, None
    num_layers = int(config["num_hidden_layers"])
    kinds = config.get("layer_types")
    if kinds is None:
        first = config.get("max_window_layers", QWEN_DEFAULT_MAX_WINDOW_LAYERS)
        sliding = tuple(i >= first for i in range(num_layers))
    else:
        sliding = tuple(kind == "sliding_attention" for kind in kinds)
    if not any(sliding):
        return None, None
    return int(window), None if all(sliding) else sliding


def check_config(
    architecture: str, fields: Mapping[str, FieldCheck], config: Mapping[str, Any]
) -> None:
    """Refuse any config field the family does not implement with its value.

    Raises:
        UnsupportedConfigError: naming every offending field, its value and the reason.
    """
    problems = []
    for name in sorted(config):
        check = fields.get(name)
        if check is None:
            problems.append(
                f"{name}={config[name]!r}: not a field the {architecture} conversion "
                f"implements, so it may change the model's outputs (if it does not, delete it "
                f"from config.json)"
            )
            continue
        reason = check(config[name], config)
        if reason:
            problems.append(f"{name}={config[name]!r}: {reason}")
    if problems:
        raise UnsupportedConfigError(
            f"config.json of this {architecture} checkpoint cannot be converted exactly: "
            + "; ".join(problems)
        )


__all__ = [
    "COMMON_FIELDS",
    "Features",
    "MOE_FIELDS",
    "QWEN_WINDOW_FIELDS",
    "UnsupportedConfigError",
    "accepted",
    "check_config",
    "only",
    "qwen_window",
]
