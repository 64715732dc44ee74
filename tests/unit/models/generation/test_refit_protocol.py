"""The weight-sync protocol: one set of verbs, implemented once, with the signatures the
interfaces declare (the end-to-end refit is in test_refit.py)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
from nemo_rl.models.generation.refit import RefitError, refit_policy_generation
from nemo_rl.models.generation.refit.interfaces import (
    RECEIVER_VERBS,
    SENDER_VERBS,
    WeightReceiver,
    WeightSender,
    call_verb,
)
from nemo_rl.models.generation.refit.receiver import RefitReceiver
from nemo_rl.models.generation.refit.sender import RefitSender
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.interfaces import ColocatablePolicyInterface
from nemo_rl.models.policy.lm_policy import Policy


def signature(cls: type, name: str) -> list[tuple[str, object, object]]:
    """Parameters (name, kind, default) and the return annotation of ``cls.name``, with
    annotations as written (every module here uses postponed annotations)."""
    sig = inspect.signature(getattr(cls, name))
    params = [(p.name, p.kind, p.default, str(p.annotation)) for p in sig.parameters.values()]
    return params + [("return", None, None, str(sig.return_annotation))]


REFIT_METHODS = [
    "init_collective",
    "offload_before_refit",
    "offload_after_refit",
    "prepare_refit_info",
    "prepare_weights_for_ipc",
    "get_weights_ipc_handles",
    "broadcast_weights_for_collective",
]


@pytest.mark.parametrize("name", REFIT_METHODS)
def test_policy_refit_methods_have_the_interfaces_signatures_exactly(name):
    assert name in ColocatablePolicyInterface.__abstractmethods__
    assert signature(Policy, name) == signature(ColocatablePolicyInterface, name)


@pytest.mark.parametrize(
    ("implementation", "protocol", "verbs"),
    [(RefitSender, WeightSender, SENDER_VERBS), (RefitReceiver, WeightReceiver, RECEIVER_VERBS)],
)
def test_sender_and_receiver_implement_every_verb_with_its_signature(
    implementation, protocol, verbs
):
    assert verbs == {n for n, v in vars(protocol).items() if inspect.isfunction(v) and n[0] != "_"}
    for verb in verbs:
        assert signature(implementation, verb) == signature(protocol, verb), verb


def test_the_seeds_verbs_are_the_senders_verbs():
    """Every refit verb of the policy interface (all but the memory moves) is a sender verb,
    so the facade, the worker and the sender use one name for it."""
    moves = {"offload_before_refit", "offload_after_refit"}
    assert set(REFIT_METHODS) - moves <= SENDER_VERBS


def test_a_worker_runs_only_the_protocols_verbs():
    receiver = RefitReceiver(lambda *args: [], device=__import__("torch").device("cpu"))
    assert call_verb(receiver, RECEIVER_VERBS, "close_collective") is None
    with pytest.raises(ValueError, match="unknown refit verb 'close'.*update_weights_from"):
        call_verb(receiver, RECEIVER_VERBS, "close")


def test_the_orchestrator_uses_every_verb_of_the_protocol():
    """No verb exists beside the path the driver takes (its sequence names each one)."""
    from nemo_rl.models.generation.refit import orchestrate

    source = inspect.getsource(orchestrate)
    unused = sorted(v for v in SENDER_VERBS | RECEIVER_VERBS if v not in source)
    assert unused == []


def test_refit_settings_come_from_the_policy_config():
    cfg = PolicyConfig(
        refit_buffer_size_gb=0.001,
        refit_timeout_s=30,
        refit_checksums=False,
        generation=GenerationConfig(vllm_cfg=VllmConfig(precision="bfloat16")),
    )
    settings = cfg.refit_settings()
    assert settings.bucket_bytes == int(0.001 * 1024**3) // 64 * 64
    assert (settings.dtype, settings.timeout_s, settings.checksums) == ("bfloat16", 30, False)
    default = PolicyConfig().refit_settings()
    assert (default.bucket_bytes, default.checksums, default.max_retries) == (
        256 * 1024**2, False, 2
    )
    assert PolicyConfig(refit_max_retries=0).refit_settings().max_retries == 0
    with pytest.raises(ValueError, match="refit_max_retries"):
        PolicyConfig(refit_max_retries=-1)
    with pytest.raises(ValueError, match="refit_buffer_size_gb"):
        PolicyConfig(refit_buffer_size_gb=0)


def test_refit_refuses_a_policy_exporting_another_dtype_than_the_engines_run():
    """Checked before any worker is called: a policy configured for float32 engines would
    otherwise stream twice the bytes into bfloat16 engines."""
    policy = SimpleNamespace(cfg=PolicyConfig())  # generation precision: float32
    generation = SimpleNamespace(
        config=GenerationConfig(vllm_cfg=VllmConfig(precision="bfloat16"))
    )
    with pytest.raises(RefitError, match=r"float32 \(policy.generation.vllm_cfg.precision\).*"
                       "engines run in bfloat16"):
        refit_policy_generation(policy, generation, colocated=True)


def test_refit_refuses_adapters_for_engines_that_take_weights():
    """A LoRA policy streaming adapters (``lora_refit: adapter``) into engines built without
    them (or the other way round) is refused before any worker is called."""
    lora = {"megatron_cfg": {"peft": {"enabled": True, "dim": 8}}}
    policy = SimpleNamespace(cfg=PolicyConfig.model_validate(
        {**lora, "generation": {"vllm_cfg": {"lora_refit": "adapter"}}}
    ))
    generation = SimpleNamespace(config=GenerationConfig(), adapters=None)
    with pytest.raises(RefitError, match=r"streams LoRA adapters .*dim=8.* engines serve every "
                       r"weight \(policy.generation.vllm_cfg.lora_refit\)"):
        refit_policy_generation(policy, generation, colocated=True)
    policy = SimpleNamespace(cfg=PolicyConfig.model_validate(lora))  # merged (the default)
    generation.adapters = PolicyConfig.model_validate(
        {**lora, "generation": {"vllm_cfg": {"lora_refit": "adapter"}}}
    ).adapter_serving()
    with pytest.raises(RefitError, match="streams every weight but the engines serve LoRA"):
        refit_policy_generation(policy, generation, colocated=True)


def test_an_engine_serving_adapters_checks_them_against_its_checkpoint():
    checkpoint = {
        "model.layers.0.self_attn.q_proj.weight": (128, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 256),
        "model.norm.weight": (64,),
    }
    receiver = RefitReceiver(
        lambda *args: [], device=torch.device("cpu"), expected_shapes=checkpoint, adapters=True
    )
    f32 = torch.float32
    good = {
        "model.layers.0.self_attn.q_proj.lora_A.weight": ((8, 64), f32),
        "model.layers.0.self_attn.q_proj.lora_B.weight": ((128, 8), f32),
        "model.layers.0.mlp.down_proj.lora_A.weight": ((8, 256), f32),
        "model.layers.0.mlp.down_proj.lora_B.weight": ((64, 8), f32),
    }
    receiver.prepare_refit_info(good)
    assert receiver.info == good
    for bad, needle in (
        ({"model.layers.0.mlp.down_proj.lora_A.weight": ((8, 64), f32)},
         r"down_proj.lora_A.weight \(8, 64\) does not fit its weight \(64, 256\)"),
        ({"model.layers.0.self_attn.q_proj.lora_B.weight": ((64, 8), f32)},
         r"q_proj.lora_B.weight \(64, 8\) does not fit its weight \(128, 64\)"),
        ({"model.layers.1.self_attn.q_proj.lora_A.weight": ((8, 64), f32)},
         "layers.1.self_attn.q_proj.lora_A.weight .* adapts no linear weight"),
        ({"model.norm.lora_A.weight": ((8, 64), f32)}, "norm.lora_A.weight .* adapts no linear"),
        ({"model.layers.0.self_attn.q_proj.weight": ((128, 64), f32)},
         "q_proj.weight .* adapts no linear weight"),
    ):
        with pytest.raises(RefitError, match=needle):
            receiver.prepare_refit_info({**good, **bad})
