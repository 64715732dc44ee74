"""Config machinery: defaults inheritance, overrides, interpolation, typed validation errors."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import BaseModel, Field

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.environments.config import EnvConfigs
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.utils.config import (
    ConfigError,
    ConfigModel,
    config_to_yaml,
    load_config,
    load_typed_config,
    parse_value,
    schema_defaults,
)

REPO = Path(__file__).resolve().parents[3]


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- defaults inheritance -----------------------------------------------------------------


def test_defaults_two_levels_child_wins(tmp_path: Path) -> None:
    write(tmp_path, "base/root.yaml", "a: {x: 1, y: 1, z: 1}\nlst: [1, 2, 3]\nonly_root: r\n")
    write(tmp_path, "base/mid.yaml", "defaults: root.yaml\na: {y: 2, z: 2}\nlst: [9]\n")
    child = write(tmp_path, "child.yaml", "defaults: base/mid.yaml\na: {z: 3}\n")
    assert load_config(child) == {
        "a": {"x": 1, "y": 2, "z": 3},
        "lst": [9],  # lists are replaced, not concatenated
        "only_root": "r",
    }


def test_defaults_list_later_parent_wins(tmp_path: Path) -> None:
    write(tmp_path, "p1.yaml", "k: one\nfrom1: 1\nshared: {a: 1}\n")
    write(tmp_path, "p2.yaml", "k: two\nfrom2: 2\nshared: {b: 2}\n")
    child = write(tmp_path, "c.yaml", "defaults: [p1.yaml, p2.yaml]\nown: 3\n")
    assert load_config(child) == {
        "k": "two",
        "from1": 1,
        "from2": 2,
        "shared": {"a": 1, "b": 2},
        "own": 3,
    }


def test_diamond_defaults_are_not_a_cycle(tmp_path: Path) -> None:
    write(tmp_path, "d.yaml", "v: d\n")
    write(tmp_path, "b.yaml", "defaults: d.yaml\nb: 1\n")
    write(tmp_path, "c.yaml", "defaults: d.yaml\nc: 1\n")
    top = write(tmp_path, "a.yaml", "defaults: [b.yaml, c.yaml]\n")
    assert load_config(top) == {"v": "d", "b": 1, "c": 1}


def test_defaults_cycle_names_the_files(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", "defaults: b.yaml\nx: 1\n")
    write(tmp_path, "b.yaml", "defaults: a.yaml\ny: 1\n")
    with pytest.raises(ConfigError, match="defaults cycle") as info:
        load_config(a)
    assert "a.yaml" in str(info.value) and "b.yaml" in str(info.value)


def test_self_cycle_and_missing_parent(tmp_path: Path) -> None:
    me = write(tmp_path, "me.yaml", "defaults: me.yaml\n")
    with pytest.raises(ConfigError, match="defaults cycle"):
        load_config(me)
    orphan = write(tmp_path, "orphan.yaml", "defaults: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="defaults: 'nowhere.yaml' names no file") as info:
        load_config(orphan)
    assert f"{tmp_path / 'nowhere.yaml'}, {REPO / 'configs' / 'nowhere.yaml'}" in str(info.value)


def test_defaults_name_a_shipped_config_from_any_folder(tmp_path: Path) -> None:
    """A recipe outside the repository names a config of configs/ by its file name, with or
    without ".yaml"; a file of that name next to the recipe wins; a path with a folder is
    relative to the recipe's folder only; a miss lists every file tried."""
    shipped = load_config(REPO / "configs" / "grpo_tiny_cpu.yaml")
    for name in ("grpo_tiny_cpu", "grpo_tiny_cpu.yaml", "[grpo_tiny_cpu]"):
        mine = write(tmp_path / "elsewhere", "mine.yaml", f"defaults: {name}\ngrpo: {{seed: 7}}\n")
        assert load_config(mine) == {**shipped, "grpo": {**shipped["grpo"], "seed": 7}}, name
    write(tmp_path / "elsewhere", "grpo_tiny_cpu.yaml", "own: 1\n")
    assert load_config(mine) == {"own": 1, "grpo": {"seed": 7}}
    nested = write(tmp_path / "a", "b.yaml", "defaults: configs/grpo_tiny_cpu.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_config(nested)
    assert str(info.value) == (
        f"{nested}: defaults: 'configs/grpo_tiny_cpu.yaml' names no file; tried "
        f"{tmp_path / 'a' / 'configs' / 'grpo_tiny_cpu.yaml'} (a path is relative to the "
        "recipe's folder; name a config of the repository's configs/ by its file name alone, "
        "e.g. defaults: grpo_tiny_cpu); did you mean 'grpo_tiny_cpu'?"
    )
    typo = write(tmp_path / "a", "c.yaml", "defaults: grpo_tiny_cpx\n")
    with pytest.raises(ConfigError) as info:
        load_config(typo)
    tried = [tmp_path / "a" / "grpo_tiny_cpx", tmp_path / "a" / "grpo_tiny_cpx.yaml",
             REPO / "configs" / "grpo_tiny_cpx", REPO / "configs" / "grpo_tiny_cpx.yaml"]
    assert f"tried {', '.join(map(str, tried))} (" in str(info.value)


def test_bad_yaml_is_a_config_error(tmp_path: Path) -> None:
    dup = write(tmp_path, "dup.yaml", "a: 1\na: 2\n")
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        load_config(dup)
    scalar = write(tmp_path, "scalar.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(scalar)


# --- overrides ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2", 2),
        ("-3", -3),
        ("0.5", 0.5),
        ("1e-5", 1e-5),
        ("5E3", 5000.0),
        ("true", True),
        ("False", False),
        ("null", None),
        ("[1, 2.5, x]", [1, 2.5, "x"]),
        ("{a: 1}", {"a": 1}),
        ("hello", "hello"),
        ("'2'", "2"),
        ("", ""),
    ],
)
def test_parse_value(text: str, expected: object) -> None:
    value = parse_value(text)
    assert value == expected and type(value) is type(expected)


def test_overrides_set_add_delete(tmp_path: Path) -> None:
    recipe = write(
        tmp_path,
        "r.yaml",
        "policy: {megatron_cfg: {tensor_model_parallel_size: 1}, lr: 0.1, flag: false}\n"
        "lst: [a, b]\ngone: 1\n",
    )
    cfg = load_config(
        recipe,
        [
            "policy.megatron_cfg.tensor_model_parallel_size=2",
            "policy.lr=1e-5",
            "policy.flag=true",
            "lst=[1, 2, 3]",
            "+new.key=1",
            "~gone",
            "policy.megatron_cfg=null",
        ],
    )
    assert cfg == {
        "policy": {"megatron_cfg": None, "lr": 1e-5, "flag": True},
        "lst": [1, 2, 3],
        "new": {"key": 1},
    }


def test_overrides_apply_in_order_and_index_lists(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", "a: 1\nlst: [x, y]\n")
    assert load_config(recipe, ["a=2", "a=3", "lst.1=z"]) == {"a": 3, "lst": ["x", "z"]}


def test_unknown_override_key_suggests_nearest(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", "policy: {megatron_cfg: {tensor_model_parallel_size: 1}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(recipe, ["policy.megtron_cfg.tensor_model_parallel_size=2"])
    assert "unknown key policy.megtron_cfg; did you mean policy.megatron_cfg?" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(recipe, ["policy.megatron_cfg.tensor_parallel_size=2"])
    message = str(info.value)
    assert "did you mean policy.megatron_cfg.tensor_model_parallel_size?" in message
    assert "'+'" in message  # tells how to add a key on purpose


def test_override_errors(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", "a: 1\nsec: {beta: 2}\n")
    with pytest.raises(ConfigError, match="already exists; drop the '\\+'"):
        load_config(recipe, ["+a=2"])
    with pytest.raises(ConfigError, match="unknown key sec.betta; did you mean sec.beta"):
        load_config(recipe, ["~sec.betta"])
    with pytest.raises(ConfigError, match="unknown key sec.c; valid keys at sec: beta"):
        load_config(recipe, ["~sec.c"])
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_config(recipe, ["a"])
    with pytest.raises(ConfigError, match="a is not a section: it holds 1"):
        load_config(recipe, ["a.b=1"])
    with pytest.raises(ConfigError, match="takes no '=value'"):
        load_config(recipe, ["~a=1"])


# --- interpolation --------------------------------------------------------------------------


def test_interpolation_resolves_after_overrides(tmp_path: Path) -> None:
    write(tmp_path, "base.yaml", "policy: {max_total_sequence_length: 256, mbs: 4}\n")
    recipe = write(
        tmp_path,
        "r.yaml",
        "defaults: base.yaml\n"
        "gen: {max_model_len: '${policy.max_total_sequence_length}'}\n"
        "tokens: '${mul:${policy.max_total_sequence_length},${policy.mbs}}'\n",
    )
    assert load_config(recipe)["gen"]["max_model_len"] == 256
    cfg = load_config(recipe, ["policy.max_total_sequence_length=512"])
    assert cfg["gen"]["max_model_len"] == 512
    assert cfg["tokens"] == 2048


def test_broken_interpolation_names_the_key(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", "a: 1\nb: {c: '${a_typo}'}\n")
    with pytest.raises(ConfigError, match="at b.c"):
        load_config(recipe)


# --- typed validation -----------------------------------------------------------------------


class _Inner(ConfigModel):
    mode: Literal["fast", "slow"] = Field(default="fast", description="test mode")
    count: int = Field(default=1, ge=1, description="test count")


class _Outer(ConfigModel):
    inner: _Inner = Field(default_factory=_Inner, description="test inner")
    name: str = Field(description="required test name")


def test_schema_defaults_leave_out_required_fields() -> None:
    assert schema_defaults(_Outer) == {"inner": {"mode": "fast", "count": 1}}


def test_typed_config_fills_schema_defaults_and_allows_schema_keys(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", "inner: {count: 3}\n")
    cfg = load_typed_config(recipe, ["name=x", "inner.mode=slow"], _Outer)
    assert cfg == _Outer(inner=_Inner(mode="slow", count=3), name="x")


def test_typo_in_yaml_key_suggests_nearest(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", "policy:\n  megtron_cfg:\n    sequence_parallel: true\n")
    with pytest.raises(ConfigError) as info:
        load_typed_config(recipe, [], GRPOMasterConfig)
    message = str(info.value)
    assert "unknown key policy.megtron_cfg" in message
    assert "did you mean policy.megatron_cfg?" in message


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", "name: n\ninner: {zzzzzz: 1}\n")
    expected = r"unknown key inner.zzzzzz; valid keys at inner: count, mode"
    with pytest.raises(ConfigError, match=expected):
        load_typed_config(recipe, [], _Outer)


def test_bad_literal_lists_allowed_values_and_path(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", "policy: {megatron_cfg: {optimizer: {optimizer: adamw}}}\n")
    with pytest.raises(ConfigError) as info:
        load_typed_config(recipe, ["policy.precision=fp8"], GRPOMasterConfig)
    message = str(info.value)
    assert "2 problems" in message
    optimizer = "policy.megatron_cfg.optimizer.optimizer"
    assert f"{optimizer}: got 'adamw'; allowed values: 'adam' or 'sgd'" in message
    precisions = "'float32', 'bfloat16' or 'float16'"
    assert f"policy.precision: got 'fp8'; allowed values: {precisions}" in message


def test_bound_and_type_errors_name_path_and_value(tmp_path: Path) -> None:
    recipe = write(
        tmp_path, "r.yaml", "grpo: {num_generations_per_prompt: 0, max_num_steps: '5'}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_typed_config(recipe, ["loss_fn.ratio_clip_min=-0.1"], GRPOMasterConfig)
    message = str(info.value)
    bound = "Input should be greater than or equal to 1"
    assert f"grpo.num_generations_per_prompt: got 0; {bound}" in message
    assert "grpo.max_num_steps: got '5'; Input should be a valid integer" in message
    assert "loss_fn.ratio_clip_min: got -0.1" in message


def test_unknown_override_key_against_schema(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", "policy: {model_name: tiny-llama}\n")
    with pytest.raises(ConfigError) as info:
        load_typed_config(recipe, ["policy.megatron_cfg.tensor_paralel_size=2"], GRPOMasterConfig)
    assert "did you mean policy.megatron_cfg.tensor_model_parallel_size?" in str(info.value)
    # A key the recipe does not state but the schema declares needs no '+'.
    tp = "policy.megatron_cfg.tensor_model_parallel_size=2"
    cfg = load_typed_config(recipe, [tp, "cluster.cpu_bundles_per_node=2"], GRPOMasterConfig)
    assert cfg.policy.megatron_cfg.tensor_model_parallel_size == 2


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        (
            ["policy.train_global_batch_size=30", "policy.train_micro_batch_size=4"],
            ["policy:", "train_global_batch_size (30)", "train_micro_batch_size (4)"],
        ),
        (
            ["policy.dynamic_batching.enabled=true", "policy.sequence_packing.enabled=true"],
            ["dynamic_batching.enabled", "sequence_packing.enabled"],
        ),
        (
            ["grpo.num_prompts_per_step=3"],
            ["grpo.num_prompts_per_step", "policy.train_global_batch_size (32)"],
        ),
        (
            ["grpo.num_generations_per_prompt=1", "grpo.num_prompts_per_step=32"],
            ["use_leave_one_out_baseline", "num_generations_per_prompt"],
        ),
        (
            ["policy.megatron_cfg.optimizer.min_lr=1.0", "policy.megatron_cfg.optimizer.lr=0.1"],
            ["policy.megatron_cfg.optimizer:", "min_lr (1.0)", "lr (0.1)"],
        ),
        (
            ["cluster.gpus_per_node=6", "policy.megatron_cfg.tensor_model_parallel_size=4"],
            ["cluster.gpus_per_node", "tensor_model_parallel_size"],
        ),
        (
            ["policy.generation.vllm_cfg.max_model_len=128"],
            ["generation.vllm_cfg.max_model_len (128)", "max_total_sequence_length (256)"],
        ),
    ],
)
def test_cross_field_errors_name_the_fields(
    tmp_path: Path, overrides: list[str], fields: list[str]
) -> None:
    recipe = write(tmp_path, "r.yaml", "")
    with pytest.raises(ConfigError) as info:
        load_typed_config(recipe, overrides, GRPOMasterConfig)
    for field in fields:
        assert field in str(info.value)


def test_derived_fields_follow_their_source(tmp_path: Path) -> None:
    recipe = write(
        tmp_path, "r.yaml", "policy: {model_name: /ckpt/m, max_total_sequence_length: 512}\n"
    )
    cfg = load_typed_config(
        recipe, ["policy.precision=bfloat16", "policy.train_micro_batch_size=2"], GRPOMasterConfig
    )
    policy = cfg.policy
    assert policy.tokenizer.name == "/ckpt/m"
    assert policy.dynamic_batching.train_mb_tokens == 512 * 2
    assert policy.sequence_packing.logprob_mb_tokens == 512 * policy.logprob_batch_size
    assert cfg.data.max_input_seq_length == 512
    # 8 prompts x 4 generations / 32 per optimizer step = 1 optimizer step per GRPO step.
    assert policy.megatron_cfg.scheduler.lr_decay_iters == cfg.grpo.max_num_steps


def test_resolved_yaml_round_trips(tmp_path: Path) -> None:
    cfg = load_typed_config(REPO / "configs/grpo_tiny_cpu.yaml", ["grpo.seed=7"], GRPOMasterConfig)
    dumped = config_to_yaml(cfg)
    again = GRPOMasterConfig.model_validate(yaml.safe_load(dumped))
    assert again == cfg and again.grpo.seed == 7


def test_tiny_cpu_recipe_values() -> None:
    cfg = load_typed_config(REPO / "configs/grpo_tiny_cpu.yaml", [], GRPOMasterConfig)
    assert cfg.policy.model_name == "tiny-llama"
    assert cfg.cluster.gpus_per_node == 0
    assert cfg.policy.generation.vllm_cfg.kv_cache_memory_bytes == 32 * 2**20
    assert cfg.policy.max_total_sequence_length == 64
    assert cfg.policy.generation.vllm_cfg.max_model_len == 64
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    assert samples == cfg.policy.train_global_batch_size == 128  # one optimizer step per step
    assert cfg.sft_warmup.enabled and cfg.sft_warmup.global_batch_size == 32
    assert cfg.policy.megatron_cfg.scheduler.lr_decay_iters == cfg.grpo.max_num_steps


def _all_models(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[type[BaseModel]]:
    """``model`` and every model class reachable through its field annotations."""
    seen.add(model)
    for field in model.model_fields.values():
        pending = [field.annotation]
        while pending:
            annotation = pending.pop()
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                if annotation not in seen:
                    _all_models(annotation, seen)
            else:
                pending.extend(typing.get_args(annotation))
    return seen


def test_every_schema_field_is_documented_and_strict() -> None:
    models = _all_models(GRPOMasterConfig, set())
    assert PolicyConfig in models and len(models) >= 15
    # env takes plug-in sections by task name (validated as PluginEnvConfig, whose own extra
    # keys are the plug-in class's keyword arguments, checked against its signature)
    open_models = {EnvConfigs}
    for model in models:
        expected = "allow" if model in open_models else "forbid"
        assert model.model_config.get("extra") == expected, model.__name__
        for name, field in model.model_fields.items():
            assert field.description and len(field.description) > 8, f"{model.__name__}.{name}"
