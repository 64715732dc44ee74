"""The published ``config.json`` values of the hub models the shipped GPU recipes train.

A check made when a recipe loads reads the model's config.json when it is here without a download
(:func:`nemo_rl.models.model_path.local_model_path`). The GPU recipes name hub models that are usually
not downloaded on the machine a run is prepared on, so their architecture numbers are kept here,
keyed by hub name: the GPU memory plan (:mod:`nemo_rl.models.policy.gpu_memory`) then has a
shape for every shipped recipe. Only the fields those checks read are listed, each as the model's
config.json states it; a model that is here is always read from its own file instead.
"""

from __future__ import annotations

from typing import Any

PUBLISHED_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-1.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 28, "hidden_size": 1536,
        "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
        "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "meta-llama/Llama-3.1-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 128256, "tie_word_embeddings": False,
    },
    "meta-llama/Llama-3.1-70B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 80, "hidden_size": 8192,
        "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
        "vocab_size": 128256, "tie_word_embeddings": False,
    },
    "Qwen/Qwen2.5-32B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 64, "hidden_size": 5120,
        "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 27648,
        "vocab_size": 152064, "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 48, "hidden_size": 2048,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
        "vocab_size": 151936,
    },
}
