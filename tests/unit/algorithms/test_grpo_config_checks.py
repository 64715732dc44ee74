"""What GRPOMasterConfig refuses at config time (so ``--print-config`` and ``launch --dry-run``
catch it before Ray starts), each error naming the field and the fix; and config sections built
on their own mean what they mean inside a recipe."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
from nemo_rl.models.policy.config import MegatronConfig, MegatronOptimizerConfig, PolicyConfig
from nemo_rl.utils.config import ConfigError, load_typed_config

TINY = Path(__file__).resolve().parents[3] / "configs" / "grpo_tiny_cpu.yaml"


def load(*overrides: str) -> GRPOMasterConfig:
    return load_typed_config(TINY, list(overrides), GRPOMasterConfig)


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides)
    return str(info.value)


# ------------------------------------------------------------------ parallel layout vs cluster


def test_tensor_parallel_needs_the_cpu_worker_slots() -> None:
    tp2 = "policy.megatron_cfg.tensor_model_parallel_size=2"
    message = refusal(tp2)
    assert "= 2 x 1 x 1 = 2" in message
    assert "change those sizes or cluster.num_nodes x cluster.cpu_bundles_per_node = 1 x 1" in message
    cfg = load(tp2, "cluster.cpu_bundles_per_node=2")  # the README's example
    assert cfg.policy.megatron_cfg.tensor_model_parallel_size == 2


def test_gpu_ranks_come_from_gpus_per_node() -> None:
    message = refusal("cluster.gpus_per_node=6", "policy.megatron_cfg.tensor_model_parallel_size=4")
    assert "cluster.num_nodes x cluster.gpus_per_node = 1 x 6" in message


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        # the tiny Llama: 4 heads, 2 KV heads, 2 layers
        (
            ["policy.megatron_cfg.tensor_model_parallel_size=4", "cluster.cpu_bundles_per_node=4"],
            ["tensor_model_parallel_size=4", "num_key_value_heads (2)"],
        ),
        (
            ["policy.megatron_cfg.pipeline_model_parallel_size=4", "cluster.cpu_bundles_per_node=4"],
            ["pipeline_model_parallel_size=4", "num_hidden_layers (2)"],
        ),
    ],
)
def test_model_divisibility_read_from_config_json(overrides: list[str], needles: list[str]) -> None:
    message = refusal(*overrides)
    for needle in needles:
        assert needle in message


def test_hub_model_not_in_the_cache_skips_only_the_model_checks(
    offline_hub_cache: Path,
) -> None:
    hub = "policy.model_name=nemo-rl-test/not-downloaded"
    tp4 = ["policy.megatron_cfg.tensor_model_parallel_size=4", "cluster.cpu_bundles_per_node=4"]
    assert load(hub, *tp4).policy.megatron_cfg.tensor_model_parallel_size == 4
    assert "cluster.cpu_bundles_per_node = 1 x 1" in refusal(hub, tp4[0])


def test_hub_model_in_the_cache_is_checked(hub_tiny_llama: tuple[str, Path]) -> None:
    name, _ = hub_tiny_llama
    message = refusal(
        f"policy.model_name={name}",
        "policy.megatron_cfg.tensor_model_parallel_size=4",
        "cluster.cpu_bundles_per_node=4",
    )
    assert "num_key_value_heads (2)" in message


def test_sequence_parallel_without_tensor_parallel() -> None:
    message = refusal("policy.megatron_cfg.sequence_parallel=true")
    assert "sequence_parallel=true" in message and "tensor_model_parallel_size > 1" in message


# ------------------------------------------------------------------ learning-rate schedule


def test_constant_schedule_shorter_than_its_warmup_runs() -> None:
    """grpo.max_num_steps=2 with 5 warm-up steps used to crash inside an actor."""
    scheduler = load("grpo.max_num_steps=2").policy.megatron_cfg.scheduler
    assert scheduler.lr_warmup_iters == 5 and scheduler.lr_decay_iters == 6


def test_decaying_schedule_shorter_than_its_warmup_is_refused() -> None:
    message = refusal("grpo.max_num_steps=2", "policy.megatron_cfg.scheduler.lr_decay_style=linear")
    for needle in ("grpo.max_num_steps", "lr_warmup_iters (5)", "set lr_decay_iters"):
        assert needle in message


def test_explicit_decay_horizon_inside_the_warmup_is_refused() -> None:
    message = refusal("policy.megatron_cfg.scheduler.lr_decay_iters=3")
    assert "policy.megatron_cfg.scheduler" in message
    assert "lr_decay_iters (3) must exceed lr_warmup_iters (5)" in message


def test_lr_schedule_overrides_are_validated_by_the_models() -> None:
    optimizer, scheduler = MegatronConfig().lr_schedule({"lr": 1e-3, "lr_decay_iters": 7})
    assert optimizer.lr == 1e-3 and optimizer.min_lr == MegatronOptimizerConfig().min_lr
    assert scheduler.lr_decay_iters == 7
    with pytest.raises(ConfigError, match="did you mean lr_decay_iters"):
        MegatronConfig().lr_schedule({"lr_decay_iter": 7})
    with pytest.raises(ConfigError, match="min_lr"):
        MegatronConfig().lr_schedule({"lr": 1e-6, "min_lr": 1e-3})


# ------------------------------------------------------------------ tasks, checkpoints, features


def test_task_needs_a_configured_environment() -> None:
    message = refusal("data.task_name=maths")
    assert "data.task_name='maths' names no environment: did you mean 'math'?" in message
    assert "configured tasks are ['math']" in message
    message = refusal("data.task_name=number_guess")
    assert "configure env.number_guess" in message
    assert "configure env.math" in refusal("env.math=null")
    cfg = load("data.task_name=number_guess", "env.number_guess={}")
    assert sorted(cfg.env.sections()) == ["math", "number_guess"]


def test_checkpoint_metric_must_be_one_the_loop_records() -> None:
    message = refusal("checkpointing.metric_name=reward")
    assert "checkpointing.metric_name='reward'" in message and "train_reward" in message
    assert load("checkpointing.metric_name=train_reward").checkpointing.metric_name == "train_reward"
    assert load("checkpointing.metric_name=reward", "checkpointing.keep_top_k=null")


def test_generation_engines_must_fit_the_bundles_of_a_node() -> None:
    tp2 = "policy.generation.vllm_cfg.tensor_parallel_size=2"
    message = refusal(tp2)
    assert "1 problem:" in message
    assert (
        "policy.generation.vllm_cfg.tensor_parallel_size=2 does not divide the 1 bundles of a "
        "node (cluster.cpu_bundles_per_node = 1)" in message
    )
    assert "Set it to one of [1]" in message
    # Colocated policy TP=2 and generation TP=2 share the same two bundles.
    cfg = load(
        tp2, "policy.megatron_cfg.tensor_model_parallel_size=2", "cluster.cpu_bundles_per_node=2"
    )
    assert cfg.policy.generation.vllm_cfg.tensor_parallel_size == 2
    assert cfg.policy.generation.colocated.enabled


# ------------------------------------------------------------------ sections on their own


def test_generation_config_alone_means_what_it_means_in_a_recipe() -> None:
    """The Python API builds a GenerationConfig directly: its engine precision is the same
    explicit default as inside a policy (it used to be None, i.e. the checkpoint's bfloat16)."""
    alone = GenerationConfig()
    assert alone.vllm_cfg.precision == "float32"
    assert PolicyConfig().generation == alone
    # The policy section no longer rewrites the generation section it holds.
    assert PolicyConfig(precision="bfloat16").generation.vllm_cfg.precision == "float32"
    assert PolicyConfig(max_total_sequence_length=512).generation.vllm_cfg.max_model_len is None


def test_engine_length_must_cover_the_policy_length() -> None:
    with pytest.raises(ValueError, match=r"max_model_len \(128\) must be >= max_total_sequence_length \(256\)"):
        PolicyConfig(generation=GenerationConfig(vllm_cfg=VllmConfig(max_model_len=128)))


def test_cpu_override_of_the_distributed_optimizer_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from nemo_rl.models.policy.workers.megatron.model_setup import effective_optimizer_config

    given = MegatronOptimizerConfig(use_distributed_optimizer=True)
    with caplog.at_level(logging.WARNING):
        used = effective_optimizer_config(given)
        quiet = effective_optimizer_config(given, announce=False)
    assert used.use_distributed_optimizer is False and quiet == used
    assert given.use_distributed_optimizer is True  # the config object is not changed
    lines = [r.getMessage() for r in caplog.records if "use_distributed_optimizer" in r.getMessage()]
    assert len(lines) == 1 and "overridden to false on CPU" in lines[0]


def test_mixture_task_names_are_checked_at_config_time() -> None:
    games = TINY.parent / "data" / "number_guess_train.jsonl"
    mixture = f"data.train_datasets=[{{path: {games}, task_name: number_gues}}]"
    message = refusal("sft_warmup.enabled=false", mixture, "env.number_guess={}")
    assert "data.train_datasets[0].task_name='number_gues' names no environment: did you " \
           "mean 'number_guess'?" in message


def test_on_policy_ratio_needs_one_optimizer_step_per_rollout() -> None:
    cfg = load()
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    assert load("loss_fn.force_on_policy_ratio=true").loss_fn.force_on_policy_ratio
    message = refusal(
        "loss_fn.force_on_policy_ratio=true", f"policy.train_global_batch_size={samples // 2}"
    )
    assert "loss_fn.force_on_policy_ratio needs exactly one optimizer step per rollout" in message
    assert "set policy.train_global_batch_size to grpo.num_prompts_per_step" in message
    assert f"({samples}), got {samples // 2}" in message


# ------------------------------------------------------------------ async GRPO

ASYNC_OK = (
    "grpo.async_grpo.enabled=true",
    "policy.generation.colocated.enabled=false",
    "loss_fn.use_importance_sampling_correction=true",
)


@pytest.mark.parametrize(
    "change, fix",
    [
        ("policy.generation.colocated.enabled=true", "policy.generation.colocated.enabled=false"),
        ("data_plane.enabled=true", "data_plane.enabled=false"),
        ("grpo.use_dynamic_sampling=true", "grpo.use_dynamic_sampling=false"),
        ("loss_fn.use_importance_sampling_correction=false",
         "loss_fn.use_importance_sampling_correction=true"),
        ("loss_fn.force_on_policy_ratio=true", "loss_fn.force_on_policy_ratio=false"),
    ],
)
def test_async_grpo_refuses_what_it_cannot_run(change: str, fix: str) -> None:
    message = refusal(*ASYNC_OK, change)
    assert "grpo.async_grpo.enabled needs" in message and fix in message


def test_async_grpo_defaults_and_bound_zero_needs_no_mismatch_weight() -> None:
    cfg = load(*ASYNC_OK)
    assert cfg.grpo.async_grpo.max_trajectory_age_steps == 1
    cfg = load(
        "grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false",
        "grpo.async_grpo.max_trajectory_age_steps=0",
    )
    assert not cfg.loss_fn.use_importance_sampling_correction
    assert not load().grpo.async_grpo.enabled


# ------------------------------------------------------------------ GDPO

GDPO = TINY.parent / "grpo_gdpo_tiny_cpu.yaml"
REWARDS = "nemo_rl.environments.arithmetic_rewards"


def test_gdpo_recipe_validates_with_its_two_rewards() -> None:
    cfg = load_typed_config(GDPO, [], GRPOMasterConfig)
    est = cfg.grpo.adv_estimator
    assert (est.name, est.reward_weights, est.use_leave_one_out_baseline) == ("gdpo", [1.0, 0.5], False)
    spec = cfg.env.specs()["arithmetic"]
    assert spec.reward_components == ("reward/correctness", "reward/format")


@pytest.mark.parametrize(
    ("recipe", "overrides", "needles"),
    [
        # the synthetic task's default environment, math, gives one reward
        (TINY, ["grpo.adv_estimator.name=gdpo"],
         ["gdpo needs two or more rewards", "env.math (data.task_name) gives one reward", "reward_fns"]),
        # a reward_fns task with a single function
        (GDPO, ["~env.arithmetic.reward_fns.format"],
         ["env.arithmetic (data.task_name) gives rewards ['reward/correctness']"]),
        (GDPO, ["grpo.adv_estimator.reward_weights=[1.0, 1.0, 1.0]"],
         ["reward_weights has 3 weights but env.arithmetic gives 2 rewards "
          "['reward/correctness', 'reward/format']"]),
        (GDPO, ["grpo.adv_estimator.name=grpo"], ["reward_weights weigh GDPO's rewards, but name is 'grpo'"]),
        (GDPO, [f"+env.arithmetic.reward_fn={REWARDS}:correctness"], ["exactly one of cls", "reward_fns"]),
        (GDPO, [f"env.arithmetic.reward_fns.format={REWARDS}:nope"], ["env.arithmetic.reward_fns.format="]),
        (GDPO, [f"+env.arithmetic.reward_fns.bad/name={REWARDS}:correctness"], ["reward name 'bad/name'"]),
    ],
)
def test_gdpo_refusals_name_the_field(recipe: Path, overrides: list[str], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_typed_config(recipe, overrides, GRPOMasterConfig)
    for needle in needles:
        assert needle in str(info.value)
