"""Config fields: every field a family implements is listed, everything else is refused with
its name and value, and the features (biases, windows) are read as transformers reads them."""

from __future__ import annotations

import json

import pytest

from mb_fixtures import SIZES, tiny_bridge
from megatron_bridge import BridgeConfig
from megatron_bridge.families import FAMILIES
from megatron_bridge.families.config_fields import UnsupportedConfigError

_bridge = tiny_bridge


@pytest.mark.parametrize(
    "config_class, architecture",
    [
        ("LlamaConfig", "LlamaForCausalLM"),
        ("Qwen2Config", "Qwen2ForCausalLM"),
        ("Qwen3Config", "Qwen3ForCausalLM"),
        ("MistralConfig", "MistralForCausalLM"),
        ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        ("MixtralConfig", "MixtralForCausalLM"),
    ],
)
def test_every_field_of_the_transformers_config_is_classified(config_class, architecture):
    # A transformers upgrade that adds a field fails here until the family lists it.
    import transformers

    config = getattr(transformers, config_class)(num_hidden_layers=2)
    fields = set(config.to_dict())
    unlisted = sorted(fields - set(FAMILIES[architecture].config_fields))
    assert not unlisted, f"{architecture}: classify {unlisted} in its config_fields"
    # And the saved config.json of a default model converts as it is.
    BridgeConfig(json.loads(config.to_json_string()) | {"architectures": [architecture]})


REFUSED = [
    ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4,
                                              "factor": 4.0}}, "rope_type 'yarn'"),
    ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("LlamaForCausalLM", {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_type 'dynamic'"),
    ("LlamaForCausalLM", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("LlamaForCausalLM", {"query_pre_attn_scalar": 64}, "query_pre_attn_scalar=64"),
    ("LlamaForCausalLM", {"sliding_window": 8}, "sliding_window=8"),
    ("LlamaForCausalLM", {"attention_bias": "yes"}, "attention_bias='yes'"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "fp8"}}, "quantized"),
    ("LlamaForCausalLM", {"pruned_heads": {"0": [1]}}, "pruned_heads"),
    ("MistralForCausalLM", {"mlp_bias": True}, "mlp_bias=True"),
    ("Qwen2ForCausalLM", {"use_mrope": True}, "use_mrope=True"),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 4,
                          "layer_types": ["full_attention"]}, "layer_types"),
    ("Qwen3ForCausalLM", {"layer_types": ["full_attention", "chunked_attention"]},
     "layer_types"),
]


@pytest.mark.parametrize("architecture, fields, message", REFUSED)
def test_fields_that_would_change_the_outputs_are_refused(architecture, fields, message):
    with pytest.raises(UnsupportedConfigError, match="cannot be converted exactly") as err:
        _bridge(architecture, **fields)
    assert message in str(err.value) and architecture in str(err.value)


def test_every_offending_field_is_named_at_once():
    with pytest.raises(UnsupportedConfigError) as err:
        _bridge("LlamaForCausalLM", hidden_act="relu", attn_logit_softcapping=50.0)
    assert "hidden_act='relu'" in str(err.value)
    assert "attn_logit_softcapping=50.0" in str(err.value)


@pytest.mark.parametrize(
    "architecture, fields, expected",
    [
        ("LlamaForCausalLM", {"attention_bias": True},
         dict(qkv_bias=True, out_bias=True, mlp_bias=False)),
        ("LlamaForCausalLM", {"mlp_bias": True}, dict(qkv_bias=False, mlp_bias=True)),
        ("Qwen2ForCausalLM", {}, dict(qkv_bias=True, out_bias=False, window=None)),
        # Qwen2.5's shipped configs: a window size and max_window_layers, but switched off.
        ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 32768,
                              "max_window_layers": 21}, dict(window=None)),
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 6,
                              "max_window_layers": 1},
         dict(window=6, window_layers=(False, True))),
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 6,
                              "max_window_layers": 2}, dict(window=None)),
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 6,
                              "layer_types": ["sliding_attention", "full_attention"]},
         dict(window=6, window_layers=(True, False), qk_layernorm=True)),
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 6,
                              "max_window_layers": 0}, dict(window=6, window_layers=None)),
        ("MistralForCausalLM", {"sliding_window": 5}, dict(window=5, window_layers=None)),
        ("MistralForCausalLM", {"sliding_window": None}, dict(window=None)),
        # A field config.json leaves out means what transformers' default says: Mistral
        # slides a 4096-token window unless sliding_window is null.
        ("MistralForCausalLM", {}, dict(window=4096, window_layers=None)),
    ],
)
def test_features_are_read_as_transformers_reads_them(architecture, fields, expected):
    features = _bridge(architecture, **fields).features
    for key, value in expected.items():
        assert getattr(features, key) == value, key


def test_window_layers_match_transformers_layer_types(family_checkpoints):
    from transformers import AutoConfig

    for name in ("qwen2_window", "qwen3_bias_window", "mistral"):
        path = family_checkpoints[name]
        bridge = BridgeConfig.from_hf(path)
        hf = AutoConfig.from_pretrained(path)
        kinds = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
        sliding = tuple(k == "sliding_attention" for k in kinds)
        window_layers = bridge.features.window_layers or (True,) * hf.num_hidden_layers
        assert bridge.features.window == hf.sliding_window, name
        assert window_layers == sliding, name
        config = bridge.transformer_config(1, 1)
        assert config.window_size == (hf.sliding_window - 1, 0), name


def test_dropout_in_the_config_is_announced_not_applied():
    with pytest.warns(UserWarning, match="without dropout"):
        config = _bridge("LlamaForCausalLM", attention_dropout=0.1).transformer_config(1, 1)
    assert config.attention_dropout == 0.0 and config.hidden_dropout == 0.0


def test_fields_config_json_leaves_out_take_the_transformers_defaults():
    # Qwen3Config's head_dim defaults to 128 and Qwen2Config's KV heads to 32, not to
    # hidden_size / heads and the query heads: read as transformers reads them.
    assert _bridge("Qwen3ForCausalLM", drop=("head_dim",)).head_dim == 128
    qwen2 = _bridge("Qwen2ForCausalLM", drop=("num_key_value_heads",), num_attention_heads=32)
    assert qwen2.num_kv_heads == 32 and SIZES["num_key_value_heads"] != 32
