"""PPO end to end on CPU (``nemo-rl ppo``'s run on configs/ppo_tiny_cpu.yaml, shrunk to 8
prompts a step), one set-up for everything: the run trains 2 steps, saving each; its step-2
checkpoint is then removed, so the newest is step 1 while the live policy and critic are a step
ahead, and the command's body (``run_in_memory``) resumes from step 1, policy and critic, and
trains step 2 again. Checks: every step logs the critic's ``critic/*`` figures and the policy's
loss; the checkpoints hold the critic next to the policy; the critic's and the policy's
optimizer step counts at the new step 2 continue from the step-1 checkpoint (4 optimizer
steps, where continuing from the live models would give 6). The run also has VAPO's returns lambda (``gae_lambda_value``) and NLL
(``positive_example_nll_weight``) on, so their paths run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nemo_rl.algorithms import ppo, rollout_run
from nemo_rl.algorithms.ppo_config import PPOMasterConfig
from nemo_rl.algorithms.rollout_command import run_in_memory, train_in_memory
from nemo_rl.utils.checkpoint import POLICY_DIR
from nemo_rl.utils.config import load_typed_config
from nemo_rl.utils.logger import read_metrics_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 8
EPOCHS = 2
CRITIC_KEYS = {"critic/loss", "critic/grad_norm", "critic/lr", "critic/vf_clipfrac",
               "critic/values_mean", "critic/values_min", "critic/values_max",
               "critic/returns_mean", "critic/explained_var"}


def config(root: Path) -> PPOMasterConfig:
    """The recipe, 8 prompts a step (one optimizer step per epoch), 2 steps, saving each under
    ``root``."""
    return load_typed_config(
        REPO / "configs" / "ppo_tiny_cpu.yaml",
        [
            f"ppo.num_prompts_per_step={PROMPTS}",
            f"ppo.ppo_epochs={EPOCHS}",
            "ppo.max_num_steps=2",
            "ppo.val_period=0",
            "ppo.val_at_start=false",
            "ppo.adv_estimator.gae_lambda_value=1.0",
            "loss_fn.positive_example_nll_weight=0.1",
            f"policy.train_global_batch_size={PROMPTS}",
            f"policy.train_micro_batch_size={PROMPTS}",
            f"policy.logprob_batch_size={PROMPTS}",
            "checkpointing.save_period=1",
            "checkpointing.keep_top_k=null",
            f"checkpointing.checkpoint_dir={root / 'ckpt'}",
            f"logger.log_dir={root / 'logs'}",
            "logger.console_enabled=false",
        ],
        PPOMasterConfig,
    )


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ppo")
    components = ppo.setup(config(root))
    try:
        train_in_memory(components, components.train_step, components.resumed)
    except BaseException:
        components.value.shutdown()
        rollout_run.shutdown(components)
        raise
    shutil.rmtree(root / "ckpt" / "step_2")
    assert run_in_memory(
        components, components.train_step, [components.value], ppo.CURVES, components.resumed
    ) is None
    return root


def optimizer_step(folder: Path) -> int:
    return json.loads((folder / "layout.json").read_text())["optimizer_step"]


def test_resume_restores_the_critic(resumed: Path) -> None:
    ckpt = resumed / "ckpt"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_1", "step_2"]
    for step in (1, 2):
        folder = ckpt / f"step_{step}"
        # one optimizer step per epoch; the resumed run's critic continued from step 1's
        assert optimizer_step(folder / ppo.VALUE_DIR) == EPOCHS * step
        assert optimizer_step(folder / POLICY_DIR) == EPOCHS * step


def test_every_step_logs_critic_and_policy(resumed: Path) -> None:
    records = read_metrics_jsonl(resumed / "logs" / "metrics.jsonl")
    # step 2 twice: the first pass, then the resumed run's (from step 1, not on to step 3)
    assert [r["step"] for r in records if r["prefix"] == "train"] == [1, 2, 2]
    train = {r["step"]: r["metrics"] for r in records if r["prefix"] == "train"}
    for metrics in train.values():
        assert CRITIC_KEYS <= set(metrics), sorted(metrics)
        assert {"loss", "grad_norm", "reward", "token_mult_prob_error"} <= set(metrics)
        assert metrics["critic/loss"] > 0
        assert 0.0 <= metrics["critic/vf_clipfrac"] <= 1.0
        assert metrics["critic/values_min"] <= metrics["critic/values_mean"] <= metrics["critic/values_max"]
        assert metrics["critic/values_min"] < metrics["critic/values_max"]
        assert "positive_nll_loss" in metrics  # the VAPO NLL ran (it needs the rewards)
        # NeMo RL's advantage figures; whitened advantages have mean ~0
        assert metrics["advantages/min"] < metrics["advantages/mean"] < metrics["advantages/max"]
        assert abs(metrics["advantages/mean"]) < 1e-5


def test_every_logged_metric_is_in_the_glossary(resumed: Path) -> None:
    glossary = (REPO / "docs" / "metrics.md").read_text()
    records = read_metrics_jsonl(resumed / "logs" / "metrics.jsonl")
    logged = {n for r in records for n in r["metrics"]}
    assert not {n for n in logged if f"`{n}`" not in glossary and f"`{n.split('/')[-1]}`" not in glossary}
