"""PPO end to end on CPU (``nemo-rl ppo``'s run on configs/ppo_tiny_cpu.yaml, shrunk to 8
prompts a step): a 1-step run, then the same run with ``ppo.max_num_steps=2`` resumes from
its step-1 checkpoint, policy and critic. Checks: every step logs the critic's ``critic/*``
figures and the policy's loss; the checkpoints hold the critic next to the policy; the
critic's optimizer step count continues from the checkpoint (2 steps' worth after the resumed
step, not 1), as the policy's does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl.algorithms import ppo
from nemo_rl.algorithms.ppo_config import PPOMasterConfig
from nemo_rl.utils.checkpoint import POLICY_DIR
from nemo_rl.utils.config import load_typed_config
from nemo_rl.utils.logger import read_metrics_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 8
EPOCHS = 2
CRITIC_KEYS = {"critic/loss", "critic/grad_norm", "critic/lr", "critic/vf_clipfrac",
               "critic/values_mean", "critic/returns_mean", "critic/explained_var"}


def run_to(root: Path, steps: int) -> None:
    """The recipe, 8 prompts a step (one optimizer step per epoch), ``steps`` steps, saving
    each under ``root``."""
    cfg = load_typed_config(
        REPO / "configs" / "ppo_tiny_cpu.yaml",
        [
            f"ppo.num_prompts_per_step={PROMPTS}",
            f"ppo.ppo_epochs={EPOCHS}",
            f"ppo.max_num_steps={steps}",
            "ppo.val_period=0",
            "ppo.val_at_start=false",
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
    assert ppo.run(cfg) is None


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ppo")
    run_to(root, 1)
    run_to(root, 2)
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
    train = {r["step"]: r["metrics"] for r in records if r["prefix"] == "train"}
    assert sorted(train) == [1, 2]
    for metrics in train.values():
        assert CRITIC_KEYS <= set(metrics), sorted(metrics)
        assert {"loss", "grad_norm", "reward", "token_mult_prob_error"} <= set(metrics)
        assert metrics["critic/loss"] > 0
        assert 0.0 <= metrics["critic/vf_clipfrac"] <= 1.0


def test_every_logged_metric_is_in_the_glossary(resumed: Path) -> None:
    glossary = (REPO / "docs" / "metrics.md").read_text()
    records = read_metrics_jsonl(resumed / "logs" / "metrics.jsonl")
    logged = {n for r in records for n in r["metrics"]}
    assert not {n for n in logged if f"`{n}`" not in glossary and f"`{n.split('/')[-1]}`" not in glossary}
