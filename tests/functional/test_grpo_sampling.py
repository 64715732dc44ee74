"""GRPO trains on the distribution the engines sample from (docs/algorithms.md,
"Sampling-consistent logprobs"): the tiny colocated run of tests/tiny_grpo.py, one step from
the checkpoint's weights, sampling at temperature 0.7 with top-p 0.9 (the policy's LM head fused
with its logprobs, ``policy.logprob_chunk_size``), and at 0.7 with top-k 20 (the output layer's
full logits).

The first step is on-policy: the importance ratio is 1 (within 1e-5) and the engine's logprobs
agree with the trainer's (``token_mult_prob_error`` within 1e-3 of 1), the tolerances
test_grpo.py uses at temperature 1. Agreement alone would also hold if both sides scored the
unscaled distribution, so the step's training batch is also checked against Hugging Face
transformers on the same checkpoint (an independent implementation): vLLM's
``generation_logprobs`` and the trainer's ``prev_logprobs`` of every generated token equal
``log softmax`` of the logits divided by 0.7, truncated as vLLM truncates (top-k, then top-p
over the rest: a token goes when the tokens at least as likely hold ``1 - top_p`` of the
mass, or fewer), and renormalised; the reference policy's logprobs (the same weights at step 1)
equal the temperature-scaled distribution without truncation; and they all differ from the
unscaled distribution's by far more than the tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.algorithms.grpo_step.in_memory import InMemoryBatchStore
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.utils.logger import read_metrics_jsonl

from sampling_reference import sampling_logits
from tiny_grpo import run_grpo, tiny_grpo_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

TEMPERATURE = 0.7
RUNS = {"top_p": {"top_p": 0.9}, "top_k": {"top_k": 20}}
# the LM head fused with the logprobs (the default, chunks of 1024 tokens) for top-p; the
# output layer's full logits for top-k
LOGPROB_CHUNK_SIZE = {"top_p": 1024, "top_k": None}
# test_grpo.py's tolerances at temperature 1
RATIO_TOL, MULT_PROB_TOL = 1e-5, 1e-3
# float32 Megatron / vLLM / transformers on the same weights
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tmp_path_factory, tiny_llama_path) -> tuple[dict[str, Any], BatchedDataDict, str]:
    """(the first train step's metrics, its training batch, the run's name)."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    data = tiny_grpo_config(root / "logs", tiny_llama_path, grpo={"max_num_steps": 1}).model_dump()
    data["policy"]["generation"].update(temperature=TEMPERATURE, **RUNS[name])
    data["policy"]["logprob_chunk_size"] = LOGPROB_CHUNK_SIZE[name]
    cfg = GRPOMasterConfig.model_validate(data)
    trained: list[BatchedDataDict] = []
    train = InMemoryBatchStore.train

    def record(store: InMemoryBatchStore, batch: BatchedDataDict, loss_fn: Any) -> Any:
        trained.append(BatchedDataDict(batch))
        return train(store, batch, loss_fn)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InMemoryBatchStore, "train", record)
        run_grpo(cfg)
    records = read_metrics_jsonl(root / "logs" / "metrics.jsonl")
    (first,) = [r["metrics"] for r in records if r["prefix"] == "train"]
    (batch,) = trained
    return first, batch, name


def hf_logprobs(model_path: Path, batch: BatchedDataDict, top_k: int | None, top_p: float,
                temperature: float) -> torch.Tensor:
    """``[B, S]`` logprob of every token given the ones before (0 at position 0) under
    transformers' logits divided by ``temperature``, then top-k / top-p truncated as vLLM
    does, and renormalised (-inf outside the kept set)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    out = torch.zeros(ids.shape, dtype=torch.float32)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            n = int(lengths[i])
            logits = model(ids[i : i + 1, :n]).logits[0, :-1].float()
            logp = sampling_logits(logits, temperature, top_k, top_p).log_softmax(dim=-1)
            out[i, 1:n] = logp.gather(-1, ids[i, 1:n, None])[:, 0]
    return out


def test_first_step_at_temperature_with_truncation_is_on_policy(run) -> None:
    first, _, name = run
    assert abs(first["probs_ratio"] - 1.0) < RATIO_TOL, (name, first["probs_ratio"])
    assert abs(first["token_mult_prob_error"] - 1.0) < MULT_PROB_TOL, (
        name, first["token_mult_prob_error"]
    )


def test_engine_and_trainer_score_the_sampling_distribution(run, tiny_llama_path) -> None:
    _, batch, name = run
    settings = {"top_k": None, "top_p": 1.0, **RUNS[name]}
    sampled = hf_logprobs(tiny_llama_path, batch, temperature=TEMPERATURE, **settings)
    scaled = hf_logprobs(tiny_llama_path, batch, None, 1.0, TEMPERATURE)
    unscaled = hf_logprobs(tiny_llama_path, batch, None, 1.0, 1.0)
    mask = (batch["token_mask"] * batch["sample_mask"][:, None]) > 0
    assert mask.sum() > 0 and torch.isfinite(sampled[mask]).all()
    for key in ("generation_logprobs", "prev_logprobs"):
        torch.testing.assert_close(
            batch[key][mask], sampled[mask], rtol=0, atol=LOGPROB_TOL, msg=f"{name}: {key}"
        )
    torch.testing.assert_close(
        batch["reference_policy_logprobs"][mask], scaled[mask], rtol=0, atol=LOGPROB_TOL
    )
    # the checks above tell the three distributions apart
    for other in (scaled, unscaled):
        assert (sampled[mask] - other[mask]).abs().max() > 10 * LOGPROB_TOL
