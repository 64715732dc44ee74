"""On-policy distillation end to end on CPU (``nemo-rl distillation``'s run on
configs/distillation_tiny_cpu.yaml): the teacher is made as the recipe says (``nemo-rl sft``'s
run on the synthetic task's correct replies, then ``nemo-rl export``), the student is a fresh
tiny Llama sampling with vLLM. One run, several checks: the student's KL to the teacher falls,
its validation accuracy rises, the checkpoints hold what a resume needs, every logged metric is
in the glossary; and a run stopped after step ``STEPS - 1`` (its checkpoint alone), resumed,
repeats the uninterrupted run's last step and validation (exact resume)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nemo_rl.algorithms import distillation, sft
from nemo_rl.algorithms.distillation_config import DistillationMasterConfig
from nemo_rl.algorithms.sft_config import SFTMasterConfig
from nemo_rl.models.policy.export import export_checkpoint
from nemo_rl.utils.checkpoint import DATALOADER_STATE_FILE, POLICY_DIR, RNG_STATE_FILE
from nemo_rl.utils.config import load_typed_config
from nemo_rl.utils.logger import read_metrics_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray_8cpu")]

REPO = Path(__file__).resolve().parents[2]
TEACHER_STEPS = 100
STEPS = 20


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The teacher (SFT, exported), then the recipe with it, logging and saving under a
    temporary folder."""
    tmp = tmp_path_factory.mktemp("distill")
    teacher_cfg = load_typed_config(
        REPO / "configs" / "sft_tiny_cpu.yaml",
        [
            f"sft.max_num_steps={TEACHER_STEPS}",
            "sft.max_num_epochs=100",
            "sft.val_period=0",
            "sft.val_at_start=false",
            f"checkpointing.save_period={TEACHER_STEPS}",
            "checkpointing.keep_top_k=null",
            f"checkpointing.checkpoint_dir={tmp / 'teacher_ckpt'}",
            f"logger.log_dir={tmp / 'teacher_logs'}",
            "logger.console_enabled=false",
        ],
        SFTMasterConfig,
    )
    assert sft.run(teacher_cfg) is None
    export_checkpoint(tmp / "teacher_ckpt", tmp / "teacher")
    cfg = load_typed_config(
        REPO / "configs" / "distillation_tiny_cpu.yaml",
        [
            f"teacher.model_name={tmp / 'teacher'}",
            *student_overrides(tmp),
        ],
        DistillationMasterConfig,
    )
    assert distillation.run(cfg) is None
    return tmp


def student_overrides(root: Path) -> list[str]:
    """A run of STEPS steps logging and saving under ``root``, keeping the checkpoints of steps
    STEPS - 1 and STEPS."""
    return [
        f"distillation.max_num_steps={STEPS}",
        f"checkpointing.save_period={STEPS - 1}",
        "checkpointing.keep_top_k=null",
        f"logger.log_dir={root / 'logs'}",
        "logger.console_enabled=false",
        f"checkpointing.checkpoint_dir={root / 'ckpt'}",
    ]


@pytest.fixture(scope="module")
def resumed_run(distill_run: Path) -> Path:
    """The run as if stopped after step STEPS - 1 (that checkpoint only), resumed to STEPS."""
    root = distill_run / "resumed"
    shutil.copytree(
        distill_run / "ckpt", root / "ckpt", ignore=shutil.ignore_patterns(f"step_{STEPS}")
    )
    cfg = load_typed_config(
        REPO / "configs" / "distillation_tiny_cpu.yaml",
        [f"teacher.model_name={distill_run / 'teacher'}", *student_overrides(root)],
        DistillationMasterConfig,
    )
    assert distillation.run(cfg) is None
    return root


def _records(run: Path, prefix: str) -> dict[int, dict[str, float]]:
    records = read_metrics_jsonl(run / "logs" / "metrics.jsonl")
    return {r["step"]: r["metrics"] for r in records if r["prefix"] == prefix}


def test_kl_to_the_teacher_falls(distill_run: Path) -> None:
    train = _records(distill_run, "train")
    assert sorted(train) == list(range(1, STEPS + 1))
    kl = [train[s]["forward_kl"] for s in sorted(train)]
    assert sum(kl[-3:]) / 3 < 0.3 * kl[0], kl
    assert all(m["loss"] == pytest.approx(m["forward_kl"]) for m in train.values())
    assert all(m["num_valid_samples"] == 16 for m in train.values())  # the last optimizer step's


def test_validation_accuracy_rises(distill_run: Path) -> None:
    val = _records(distill_run, "validation")
    assert sorted(val) == [0, 10, STEPS]
    accuracy = [val[s]["accuracy"] for s in sorted(val)]
    # the fresh student answers none of the 128; on this machine 10 after 20 steps
    assert accuracy[0] == 0.0 and accuracy[-1] >= 4 / 128, accuracy


def test_checkpoint_holds_policy_loader_rng(distill_run: Path) -> None:
    folder = distill_run / "ckpt" / f"step_{STEPS}"
    assert (folder / POLICY_DIR).is_dir()
    for name in (DATALOADER_STATE_FILE, RNG_STATE_FILE):
        assert (folder / name).is_file(), name


def test_every_logged_metric_is_in_the_glossary(distill_run: Path) -> None:
    glossary = (REPO / "docs" / "metrics.md").read_text()
    records = read_metrics_jsonl(distill_run / "logs" / "metrics.jsonl")
    logged = {n for r in records for n in r["metrics"]}
    assert not {n for n in logged if f"`{n}`" not in glossary and f"`{n.split('/')[-1]}`" not in glossary}


def test_resumed_run_repeats_the_uninterrupted_last_step(distill_run: Path, resumed_run: Path) -> None:
    resumed, expected = _records(resumed_run, "train"), _records(distill_run, "train")
    assert sorted(resumed) == [STEPS]  # it started after step STEPS - 1
    for name in ("loss", "forward_kl", "reverse_kl", "grad_norm", "reward"):
        assert resumed[STEPS][name] == pytest.approx(expected[STEPS][name], rel=1e-5, abs=1e-6), name
    val = _records(resumed_run, "validation")[STEPS]
    assert val["accuracy"] == _records(distill_run, "validation")[STEPS]["accuracy"]
