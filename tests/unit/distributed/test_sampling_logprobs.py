"""Logprobs under the engines' sampling distribution (temperature, top-k, top-p) against plain
torch (``sampling_reference``: vLLM's sampler written out), float32, with their gradients:

* the fused LM head (``token_logprobs`` with ``sampling``, chunks of 1, 7 and all tokens; with
  truncation each chunk runs under activation checkpointing), one rank and TP=2 over gloo;
* the un-fused path's truncated logprobs (``masked_logprobs`` of logits divided by the
  temperature, as the Megatron worker calls it) at TP=2, including top-p whose nucleus does
  not fit the gathered candidates (``widen``);
* the settings: ``TrainingSamplingParams``, ``policy.generation``'s refusals (temperature 0 for
  a trained policy, vLLM settings the trainer cannot follow), and the -inf handling of tokens
  outside the trainer's set.

A target outside the kept set scores -inf and back-propagates nothing; the reference's upstream
gradient is zeroed there (its log-softmax would pass one to the kept logits).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from layout_ports import gloo_ranks, run_two_ranks
from nemo_rl.distributed.fused_lm_head import token_logprobs
from nemo_rl.distributed.model_utils import masked_logprobs
from nemo_rl.distributed.sampling import PLAIN_SAMPLING, TrainingSamplingParams
from nemo_rl.models.generation.config import UNMATCHED_SAMPLING_KEYS, GenerationConfig
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.utils.config import ConfigError, ConfigModel, validate_config

from sampling_reference import sampling_logits

TOL = dict(rtol=1e-5, atol=1e-5)
N, H, V = 23, 16, 64
SETTINGS = {
    "temperature": TrainingSamplingParams(0.7),
    "top_p": TrainingSamplingParams(0.7, top_p=0.9),
    "top_k": TrainingSamplingParams(1.3, top_k=5),
    "top_k_top_p": TrainingSamplingParams(0.7, top_k=9, top_p=0.8),
}


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Hidden ``[N, H]``, weight ``[V, H]`` (logits of order 3: peaked enough that top-p cuts),
    targets ``[N]`` (half of them the argmax, so most lie in the kept set) and an upstream
    gradient ``[N]``."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen)
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::2] = (hidden @ weight.t()).argmax(-1)[::2]
    return hidden, weight, targets, torch.randn(N, generator=gen)


def _reference(hidden, weight, targets, grad, sampling: TrainingSamplingParams):
    """(logprobs, d hidden, d weight) in plain torch."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = sampling_logits(hidden @ weight.t(), sampling.temperature, sampling.top_k, sampling.top_p)
    out = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    kept_grad = torch.where(torch.isfinite(out), grad, torch.zeros_like(grad))
    return (out.detach(), *torch.autograd.grad((out.masked_fill(out.isinf(), 0) * kept_grad).sum(), (hidden, weight)))


def _fused(hidden, weight, targets, grad, start, group, chunk, sampling):
    """The same through the fused LM head on this rank's ``weight`` rows."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = token_logprobs(hidden, weight, targets, start, group, chunk, sampling=sampling)
    finite = torch.where(out.isinf(), torch.zeros_like(out), out)
    return (out.detach(), *torch.autograd.grad((finite * grad).sum(), (hidden, weight)))


def _assert_same(got, expected, what: str) -> None:
    for name, a, b in zip(("logprobs", "d hidden", "d weight"), got, expected):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {name}: {m}")


@pytest.mark.parametrize("chunk", [1, 7, None])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fused_lm_head_scores_the_sampling_distribution(setting: str, chunk: int | None) -> None:
    hidden, weight, targets, grad = _inputs()
    sampling = SETTINGS[setting]
    expected = _reference(hidden, weight, targets, grad, sampling)
    if sampling.truncates:  # the settings cut: some targets lie outside, most inside
        assert 0 < int(expected[0].isinf().sum()) < N // 2
    _assert_same(_fused(hidden, weight, targets, grad, 0, None, chunk, sampling), expected, setting)


def test_fused_lm_head_inference_only_equals_and_builds_no_graph() -> None:
    hidden, weight, targets, grad = _inputs()
    for setting, sampling in SETTINGS.items():
        out = token_logprobs(hidden.requires_grad_(), weight, targets, 0, None, 4, True, sampling)
        assert out.grad_fn is None, setting
        torch.testing.assert_close(out, _reference(hidden.detach(), weight, targets, grad, sampling)[0], **TOL)


def test_plain_sampling_is_the_unscaled_path_bit_for_bit() -> None:
    hidden, weight, targets, grad = _inputs()
    assert PLAIN_SAMPLING.is_plain and TrainingSamplingParams(1.0, None, 1.0) == PLAIN_SAMPLING
    plain = _fused(hidden, weight, targets, grad, 0, None, 7, PLAIN_SAMPLING)
    logits = hidden.clone().requires_grad_() @ weight.t()
    expected = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(plain[0], expected.detach(), rtol=1e-6, atol=1e-6)
    default = token_logprobs(hidden, weight, targets, 0, None, 7)
    assert torch.equal(plain[0], default)


# ---------------------------------------------------------------- two gloo ranks

def _tp_rank(rank: int, _model_path: str, _out_dir: str, port: int) -> dict:
    """This rank's results: fused ("fused", setting) and un-fused ("unfused", setting)."""
    with gloo_ranks(rank, port):
        hidden, weight, targets, grad = _inputs(1)
        half = V // 2
        start = rank * half
        shard = weight[start : start + half]
        group = dist.group.WORLD
        results = {}
        for name, sampling in SETTINGS.items():
            results["fused", name] = _fused(hidden, shard, targets, grad, start, group, 5, sampling)
            if sampling.truncates:
                # the un-fused path: [1, N + 1] positions, position t + 1 scored from t
                logits = (hidden @ shard.t() / sampling.temperature)[None].requires_grad_()
                padded = torch.cat([logits, logits.new_zeros(1, 1, half)], dim=1)
                ids = torch.cat([targets.new_zeros(1), targets])[None]
                out = masked_logprobs(
                    padded, ids, start, start + half, group, sampling.top_k, sampling.top_p,
                    top_p_candidates=2, widen=True,
                )[0, 1:]
                finite = torch.where(out.isinf(), torch.zeros_like(out), out)
                (d_logits,) = torch.autograd.grad((finite * grad).sum(), (logits,))
                results["unfused", name] = (out.detach(), d_logits[0])
        return results


def test_two_tensor_parallel_ranks_score_the_sampling_distribution(tmp_path: Path) -> None:
    by_rank = run_two_ranks(_tp_rank, "", tmp_path)
    hidden, weight, targets, grad = _inputs(1)
    half = V // 2
    for rank, results in enumerate(by_rank):
        rows = slice(rank * half, (rank + 1) * half)
        for name, sampling in SETTINGS.items():
            out, d_hidden, d_weight = _reference(hidden, weight, targets, grad, sampling)
            got = results["fused", name]
            torch.testing.assert_close(got[0], out, **TOL)
            torch.testing.assert_close(got[2], d_weight[rows], **TOL)  # this rank's rows
            if not sampling.truncates:
                continue
            logits = (hidden @ weight.t()).requires_grad_()
            ref = sampling_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            ref_out = ref.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
            kept = torch.where(torch.isfinite(ref_out), grad, torch.zeros_like(grad))
            (d_logits,) = torch.autograd.grad((ref_out.masked_fill(ref_out.isinf(), 0) * kept).sum(), (logits,))
            unfused_out, unfused_grad = results["unfused", name]
            torch.testing.assert_close(unfused_out, ref_out.detach(), **TOL)
            # d (logits / T) on this rank's shard of the scaled logits
            torch.testing.assert_close(unfused_grad * (1 / sampling.temperature), d_logits[:, rows], **TOL)
    # each rank's d hidden is its share: the two sum to the whole
    shares = [results["fused", "top_k_top_p"][1] for results in by_rank]
    expected = _reference(hidden, weight, targets, grad, SETTINGS["top_k_top_p"])[1]
    torch.testing.assert_close(shares[0] + shares[1], expected, **TOL)


# ---------------------------------------------------------------- settings

def test_training_sampling_params_follow_the_generation_config() -> None:
    cfg = GenerationConfig(temperature=0.7, top_p=0.9, top_k=20)
    assert cfg.training_sampling() == TrainingSamplingParams(0.7, 20, 0.9)
    assert cfg.training_sampling().truncates
    assert cfg.training_sampling().untruncated() == TrainingSamplingParams(0.7)
    assert GenerationConfig().training_sampling() == PLAIN_SAMPLING
    with pytest.raises(ValueError, match="temperature must be > 0"):
        TrainingSamplingParams(0.0)


def test_a_trained_policy_refuses_greedy_temperature() -> None:
    with pytest.raises(ConfigError, match=r"policy: generation\.temperature is 0 \(greedy"):
        validate_config({"policy": {"generation": {"temperature": 0}}}, _PolicyOnly)
    assert PolicyConfig(generation={"temperature": 0.5}).generation.temperature == 0.5
    assert GenerationConfig(temperature=0).temperature == 0  # evaluation decodes greedily


@pytest.mark.parametrize("key", UNMATCHED_SAMPLING_KEYS)
def test_unmatched_vllm_sampling_settings_are_refused_by_name(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"policy\.generation: {key} is not supported"):
        validate_config({"policy": {"generation": {key: 0.1}}}, _PolicyOnly)


class _PolicyOnly(ConfigModel):
    """A config with only a ``policy`` section (for the dotted paths of the messages)."""

    policy: PolicyConfig


def test_tokens_outside_the_sampled_set_score_zero_with_a_warning(caplog) -> None:
    from nemo_rl.models.policy.workers.megatron.forward import zero_outside_sampled_set

    logprobs = torch.tensor([[0.0, -1.0, -torch.inf, -torch.inf], [0.0, -torch.inf, -2.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])
    with caplog.at_level(logging.WARNING):
        out = zero_outside_sampled_set(logprobs, mask, "the previous logprobs")
    assert torch.equal(out, torch.tensor([[0.0, -1.0, 0.0, 0.0], [0.0, 0.0, -2.0, 0.0]]))
    assert "2 of 5 sampled tokens lie outside" in caplog.text
    assert "the previous logprobs" in caplog.text
