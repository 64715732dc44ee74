"""What DistillationMasterConfig refuses at config time (before Ray starts), each error naming
the field and the fix: a teacher with another vocabulary, a top-k larger than the vocabulary,
layouts the top-k scoring does not support."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl.algorithms.distillation_config import DistillationMasterConfig
from nemo_rl.utils.config import ConfigError, load_typed_config
from random_checkpoints import copy_with_another_vocab_size

RECIPE = Path(__file__).resolve().parents[3] / "configs" / "distillation_tiny_cpu.yaml"


def load(*overrides: str) -> DistillationMasterConfig:
    return load_typed_config(RECIPE, list(overrides), DistillationMasterConfig)


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides)
    return str(info.value)


def test_teacher_with_the_students_tokenizer_passes(tiny_llama_path: Path) -> None:
    cfg = load(
        f"teacher.model_name={tiny_llama_path}", "distillation.topk_logits_k=1024",
        "loss_fn.zero_outside_topk=false",
    )
    assert cfg.loop is cfg.distillation
    loop = cfg.distillation
    optimizer_steps = loop.num_prompts_per_step * loop.num_generations_per_prompt // (
        cfg.policy.train_global_batch_size
    )
    assert cfg.policy.megatron_cfg.scheduler.lr_decay_iters == loop.max_num_steps * optimizer_steps


def test_teacher_with_another_vocabulary_is_refused(tiny_llama_path: Path, tmp_path: Path) -> None:
    other = copy_with_another_vocab_size(tiny_llama_path, tmp_path / "other")
    message = refusal(f"teacher.model_name={other}")
    assert "teacher.model_name" in message and "same tokenizer" not in message
    assert "use a teacher with the student's tokenizer" in message


def test_topk_larger_than_the_vocabulary_is_refused(tiny_llama_path: Path) -> None:
    teacher = f"teacher.model_name={tiny_llama_path}"
    whole = refusal(teacher, "distillation.topk_logits_k=1025", "loss_fn.zero_outside_topk=false")
    assert "distillation.topk_logits_k (1025) must be <= 1024" in whole
    # a tail outside the top-k needs at least one token outside it
    message = refusal(teacher, "distillation.topk_logits_k=1024", "loss_fn.zero_outside_topk=true")
    assert "must be <= 1023" in message


@pytest.mark.parametrize("section", ["policy", "teacher"])
def test_packing_and_context_parallel_are_refused(section: str) -> None:
    message = refusal(f"{section}.sequence_packing.enabled=true")
    assert f"set {section}.sequence_packing.enabled=false" in message


def test_teacher_layout_must_fit_the_cluster() -> None:
    message = refusal("teacher.megatron_cfg.tensor_model_parallel_size=2")
    assert "cluster.num_nodes x cluster.cpu_bundles_per_node" in message
