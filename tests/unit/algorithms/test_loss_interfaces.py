"""The loss enums carry NeMo RL's values and every loss satisfies the LossFunction protocol."""

from __future__ import annotations

from nemo_rl.algorithms.loss import (
    ClippedPGLossFn,
    DistillationLossFn,
    DPOLossFn,
    DraftCrossEntropyLoss,
    LossFunction,
    LossInputType,
    LossType,
    MseValueLossFn,
    NLLLoss,
    PreferenceLossFn,
)


def test_enum_values() -> None:
    assert {t.name: t.value for t in LossType} == {"TOKEN_LEVEL": "token_level", "SEQUENCE_LEVEL": "sequence_level"}
    assert {t.name: t.value for t in LossInputType} == {
        "LOGIT": "logit",
        "LOGPROB": "logprob",
        "REWARD": "reward",
        "VALUE": "value",
        "DISTILLATION": "distillation",
        "DRAFT": "draft",
    }


def test_losses_follow_protocol() -> None:
    pg_cfg = {
        "reference_policy_kl_penalty": 0.0,
        "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.2,
        "ratio_clip_c": None,
        "use_on_policy_kl_approximation": False,
        "use_importance_sampling_correction": False,
        "token_level_loss": True,
    }
    dpo_cfg = {
        "reference_policy_kl_penalty": 0.1,
        "preference_loss_weight": 1.0,
        "sft_loss_weight": 0.0,
        "preference_average_log_probs": False,
        "sft_average_log_probs": False,
    }
    losses = {
        ClippedPGLossFn(pg_cfg): LossInputType.LOGPROB,
        NLLLoss(): LossInputType.LOGPROB,
        DPOLossFn(dpo_cfg): LossInputType.LOGPROB,
        PreferenceLossFn(): LossInputType.REWARD,
        MseValueLossFn({"scale": 0.4, "cliprange": 0.2}): LossInputType.VALUE,
        DistillationLossFn({"kl_type": "forward"}): LossInputType.DISTILLATION,
        DraftCrossEntropyLoss(): LossInputType.DRAFT,
    }
    for loss, input_type in losses.items():
        assert isinstance(loss, LossFunction)
        assert loss.input_type is input_type
        assert isinstance(loss.loss_type, LossType)
    assert ClippedPGLossFn({**pg_cfg, "token_level_loss": False}).loss_type is LossType.SEQUENCE_LEVEL
