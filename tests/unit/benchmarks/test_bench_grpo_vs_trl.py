"""The pure parts of ``benchmarks/bench_grpo_vs_trl.py`` (no GRPO run): the ``--device cuda``
prerequisite check and its exit, both frameworks' settings for each device (ours validated by
our config models, TRL's against ``GRPOConfig``'s fields), the response-length statistics, and
the early-stopping checkpoint of the skewed case (on the tiny Llama: its stop probability and
the lengths it samples)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "benchmarks")]

import bench_grpo_vs_trl as bench  # noqa: E402
import early_stop_model  # noqa: E402
from grpo_vs_trl_task import prompt_texts, read_step_lengths  # noqa: E402


def test_missing_prerequisites_names_each_absent_module_and_the_gpu() -> None:
    absent = {"vllm", "ray", "trl"}
    missing = bench.missing_prerequisites(
        "cuda", importable=lambda m: m not in absent, cuda_available=lambda: False
    )
    assert missing == ["trl", "vllm", "ray", "a CUDA device (torch.cuda.is_available() is False)"]
    message = bench.prerequisite_message("cuda", missing)
    assert "missing trl, vllm, ray, a CUDA device" in message
    assert "pip install -e '.[gpu,bench]'" in message and "\n" not in message
    # cpu needs no GPU; everything importable: nothing missing
    assert bench.missing_prerequisites("cpu", lambda m: True, lambda: False) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="would run the benchmark on this GPU")
def test_cuda_mode_without_a_gpu_exits_2_with_one_message() -> None:
    """This machine has no CUDA device: the harness stops before building anything."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/bench_grpo_vs_trl.py"), "--device", "cuda",
         "--case", "40m"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    # TRL is named too where the bench extra is not installed (CI)
    assert len(lines) == 1 and "--device cuda cannot run here: missing " in lines[0]
    assert "a CUDA device (torch.cuda.is_available() is False)" in lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_our_overrides_validate_for_every_variant(device: str, tmp_path: Path) -> None:
    from nemo_rl.commands import load_recipe, parse_recipe_command
    from nemo_rl.models.model_path import resolve_model_path

    case = bench.CASES["skewed"]
    path = resolve_model_path("tiny-llama")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Write a long number."}) + "\n")
    for variant in bench.VARIANTS:
        overrides = bench.our_overrides(case, device, path, 5, True, tmp_path, variant)
        cfg = load_recipe(parse_recipe_command(
            ["grpo", "--config", str(REPO / "configs/grpo_tiny_cpu.yaml"), *overrides]
        ))
        policy = cfg.policy
        assert policy.generation.max_new_tokens == 128
        assert policy.max_total_sequence_length == 256
        assert cfg.grpo.max_num_steps == 5 and cfg.loss_fn.reference_policy_kl_penalty == 0.01
        lengths_path = str(tmp_path / "lengths.jsonl")
        assert cfg.env.bench.environment_call()[3] == {
            "reward": "leading_digit", "lengths_path": lengths_path
        }
        assert policy.sequence_packing.enabled == (variant in ("ours", "ours_on_policy"))
        assert policy.dynamic_batching.enabled == (variant == "ours_dynamic")
        assert cfg.loss_fn.force_on_policy_ratio == (variant == "ours_on_policy")
        if device == "cpu":
            assert cfg.cluster.gpus_per_node == 0 and policy.precision == "float32"
            assert policy.generation.vllm_cfg.kv_cache_memory_bytes == case.kv_cache_bytes
        else:
            assert cfg.cluster.gpus_per_node == 1 and policy.precision == "bfloat16"
            vllm = policy.generation.vllm_cfg
            assert vllm.precision == "bfloat16" and vllm.kv_cache_memory_bytes is None
            assert vllm.gpu_memory_utilization == bench.GPU_MEMORY_UTILIZATION
            assert not vllm.enforce_eager


def test_trl_settings_per_device(tmp_path: Path) -> None:
    GRPOConfig = pytest.importorskip("trl").GRPOConfig  # the bench extra; CI may lack it

    case = bench.CASES["skewed"]
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    cpu = bench.trl_config_kwargs(case, "cpu", 5, False, str(tmp_path), vllm=False)
    assert GRPOConfig(**cpu).max_completion_length == 128  # a real config on this machine
    cuda = bench.trl_config_kwargs(case, "cuda", 5, False, "out", vllm=True)
    assert set(cuda) <= fields  # bf16 needs a GPU to construct
    assert cuda["use_vllm"] and cuda["vllm_mode"] == "colocate" and cuda["bf16"]
    assert not cuda["use_cpu"] and cuda["vllm_max_model_length"] == case.max_seq_len
    hf = bench.trl_config_kwargs(case, "cuda", 5, False, "out", vllm=False)
    assert "use_vllm" not in hf and hf["bf16"]
    assert not bench.trl_uses_vllm("cpu")


def test_length_stats_and_step_split(tmp_path: Path) -> None:
    steps = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 128], [10] * 9 + [128]]
    stats = bench.length_stats(steps, 128)
    assert stats == dict(median=10, p90=10, max=128, mean=(45 + 128 + 90 + 128) / 20, at_max=1.0)
    record = tmp_path / "lengths.jsonl"
    record.write_text(json.dumps([1, 2, 3]) + "\n" + json.dumps([4, 5, 6]) + "\n")
    assert read_step_lengths(record, 2) == [[1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="6 recorded response lengths are not whole steps of 4"):
        read_step_lengths(record, 4)


def test_parse_args_defaults_and_step_floor() -> None:
    args = bench.parse_args(["--case", "40m", "--also", "padded"])
    assert args.steps == bench.CASES["40m"].steps and args.also == ["padded"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "3"])


@pytest.fixture(scope="module")
def early_stop_tiny(tmp_path_factory) -> Path:
    """The tiny Llama stopping with a 3 % probability, built from a copy in a temporary folder."""
    from nemo_rl.models.model_path import resolve_model_path

    base = tmp_path_factory.mktemp("stop") / "tiny-llama"
    shutil.copytree(resolve_model_path("tiny-llama"), base)
    return early_stop_model.build_early_stop_model(base, 0.03, prompt_texts(16))


def test_early_stop_model_ends_responses_early(early_stop_tiny: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = early_stop_tiny.parent / "tiny-llama"
    assert early_stop_model.build_early_stop_model(
        base, 0.03, prompt_texts(16)
    ) == early_stop_tiny  # built once, then reused
    # the weights are the base's, untouched
    (weights,) = base.glob("*.safetensors")
    for name, tensor in load_file(weights).items():
        assert torch.equal(tensor, load_file(early_stop_tiny / weights.name)[name]), name
    tokenizer = AutoTokenizer.from_pretrained(early_stop_tiny)
    model = AutoModelForCausalLM.from_pretrained(early_stop_tiny, dtype=torch.float32).eval()
    eos, *stops = model.generation_config.eos_token_id
    assert eos == tokenizer.eos_token_id and stops
    assert not any(ch.isdigit() for t in stops for ch in tokenizer.decode([t]))
    stop_set = torch.tensor([eos, *stops])
    # a probe the calibration never saw (other prompts, other random tails): ~3 % per token
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        for t in prompt_texts(48)[32:]
    ]
    ids, prompt_len = early_stop_model.probe_ids(prompts, len(tokenizer))
    ids[:, prompt_len:] = torch.randint(0, len(tokenizer), ids[:, prompt_len:].shape,
                                        generator=torch.Generator().manual_seed(7))
    probs = early_stop_model.next_token_probs(model, ids, prompt_len)[..., stop_set].sum(-1)
    assert 0.02 < probs.mean().item() < 0.045
    assert probs.max().item() < 0.2  # nearly the same everywhere: no position forces a stop
    # sampled with the folder's generation config: most responses short, some run to 64
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                          add_generation_prompt=True, tokenize=False)
            for t in prompt_texts(8)]
    batch = tokenizer(chat * 4, return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(0)
    out = model.generate(**batch, max_new_tokens=64, do_sample=True, top_k=0, top_p=1.0,
                         pad_token_id=tokenizer.pad_token_id)
    ended = torch.isin(out[:, batch["input_ids"].shape[1]:], stop_set)
    lengths = torch.where(ended.any(1), ended.int().argmax(1) + 1, 64)
    assert ended.any(1).float().mean() > 0.7  # P(end within 64) = 1 - 0.97^64 = 0.86
    assert 10 <= lengths.float().median() <= 35  # geometric: median ln 2 / 0.03 = 23
