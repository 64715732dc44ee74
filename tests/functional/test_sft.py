"""SFT end to end on CPU (``nemo-rl sft``'s run on configs/sft_tiny_cpu.yaml): real Ray and a
Megatron worker, the synthetic task's conversations. One run, several checks: the
validation loss falls at every validation, the checkpoints hold what a resume needs, every
logged metric is in the glossary; and one step with ``policy.sequence_packing.enabled`` (the
conversations packed into bins, no padding) has the unpacked run's first-step loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nemo_rl.algorithms import sft
from nemo_rl.algorithms.sft_config import SFTMasterConfig
from nemo_rl.utils.checkpoint import DATALOADER_STATE_FILE, POLICY_DIR, RNG_STATE_FILE
from nemo_rl.utils.config import load_typed_config
from nemo_rl.utils.logger import read_metrics_jsonl
from nemo_rl.utils.run_config import RUN_CONFIG_FILE

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny recipe as shipped, logging and saving under a temporary folder."""
    tmp = tmp_path_factory.mktemp("sft")
    cfg = load_typed_config(
        REPO / "configs" / "sft_tiny_cpu.yaml",
        [
            f"logger.log_dir={tmp / 'logs'}",
            "logger.console_enabled=false",
            f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
        ],
        SFTMasterConfig,
    )
    assert sft.run(cfg) is None
    return tmp


@pytest.fixture(scope="module")
def packed_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe with sequence packing for 3 steps (the fewest its warm-up allows), no
    validation, no save; its first step is compared (before any update: the learning-rate
    schedule, which follows max_num_steps, does not enter)."""
    tmp = tmp_path_factory.mktemp("sft_packed")
    cfg = load_typed_config(
        REPO / "configs" / "sft_tiny_cpu.yaml",
        [
            "policy.sequence_packing.enabled=true",
            "sft.max_num_steps=3",
            "sft.val_at_start=false",
            "sft.val_period=0",
            "checkpointing.enabled=false",
            f"logger.log_dir={tmp / 'logs'}",
            "logger.console_enabled=false",
        ],
        SFTMasterConfig,
    )
    assert sft.run(cfg) is None
    return tmp


def _train_records(run: Path) -> list[dict[str, float]]:
    return [r["metrics"] for r in read_metrics_jsonl(run / "logs" / "metrics.jsonl") if r["prefix"] == "train"]


def test_packed_first_step_has_the_unpacked_loss(sft_run: Path, packed_step: Path) -> None:
    packed, unpacked = _train_records(packed_step)[0], _train_records(sft_run)[0]
    assert packed["loss"] == pytest.approx(unpacked["loss"], abs=1e-5)
    assert packed["grad_norm"] == pytest.approx(unpacked["grad_norm"], rel=1e-4)
    assert packed["num_valid_samples"] == unpacked["num_valid_samples"] == 32


def test_validation_loss_falls(sft_run: Path) -> None:
    records = read_metrics_jsonl(sft_run / "logs" / "metrics.jsonl")
    val = {r["step"]: r["metrics"]["loss"] for r in records if r["prefix"] == "validation"}
    assert sorted(val) == [0, 10, 20, 30, 40]
    losses = [val[s] for s in sorted(val)]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0], losses
    train = [r["metrics"] for r in records if r["prefix"] == "train"]
    assert len(train) == 40 and all(math.isfinite(m["grad_norm"]) for m in train)
    assert all(m["num_valid_samples"] == 32 for m in train)


def test_checkpoints_hold_policy_loader_rng_and_recipe(sft_run: Path) -> None:
    steps = sorted(p.name for p in (sft_run / "ckpt").glob("step_*"))
    assert steps == ["step_20", "step_40"]
    for step in steps:
        folder = sft_run / "ckpt" / step
        assert (folder / POLICY_DIR).is_dir()
        for name in (RUN_CONFIG_FILE, DATALOADER_STATE_FILE, RNG_STATE_FILE):
            assert (folder / name).is_file(), name


def test_every_logged_metric_is_in_the_glossary(sft_run: Path) -> None:
    glossary = (REPO / "docs" / "metrics.md").read_text()
    logged = {n for r in read_metrics_jsonl(sft_run / "logs" / "metrics.jsonl") for n in r["metrics"]}
    assert not {n for n in logged if f"`{n}`" not in glossary}
