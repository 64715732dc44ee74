"""A checkpoint's config.yaml, and the resume check against it: a changed model, LoRA adapters
or data is refused naming each key and both values; a changed parallel layout or learning rate
is not."""

from __future__ import annotations

import pytest
import yaml

from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.utils.config import ConfigError
from nemo_rl.utils.run_config import RUN_CONFIG_FILE, check_resume, save_run_config


def config(**sections) -> GRPOMasterConfig:
    base = {"policy": {"model_name": "tiny-llama"}, "cluster": {"cpu_bundles_per_node": 2}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return GRPOMasterConfig.model_validate(base)


def test_saved_config_is_the_resolved_recipe(tmp_path):
    cfg = config(grpo={"max_num_steps": 7})
    save_run_config(tmp_path, cfg)
    saved = yaml.safe_load((tmp_path / RUN_CONFIG_FILE).read_text())
    assert saved == cfg.model_dump(mode="json")


def test_same_recipe_and_changed_layout_resume(tmp_path):
    save_run_config(tmp_path, config())
    check_resume(tmp_path, config())
    tp2 = {"megatron_cfg": {"tensor_model_parallel_size": 2}, "model_name": "tiny-llama"}
    check_resume(tmp_path, config(policy=tp2, grpo={"max_num_steps": 20}))


def test_changed_model_is_refused_naming_it(tmp_path):
    save_run_config(tmp_path, config())
    with pytest.raises(ConfigError) as err:
        check_resume(tmp_path, config(policy={"model_name": "tiny-qwen2"}))
    assert "policy.model_name: 'tiny-llama' -> 'tiny-qwen2'" in str(err.value)
    assert "checkpointing.checkpoint_dir" in str(err.value)


def test_changed_data_is_refused_naming_every_key(tmp_path):
    save_run_config(tmp_path, config())
    mine = tmp_path / "mine.jsonl"  # data.train_path must exist to validate
    mine.write_text('{"prompt": "p", "answer": "1"}\n')
    changed = config(data={"train_path": str(mine), "synthetic": {"max_operand": 4}})
    with pytest.raises(ConfigError) as err:
        check_resume(tmp_path, changed)
    message = str(err.value)
    assert f"data.train_path: None -> '{mine}'" in message
    assert "data.synthetic.max_operand: 9 -> 4" in message
    assert "policy.model_name" not in message


def test_changed_lora_adapters_are_refused_a_checkpoint_without_them_is_not(tmp_path):
    lora = {"model_name": "tiny-llama", "megatron_cfg": {"peft": {"enabled": True, "dim": 8}}}
    save_run_config(tmp_path, config(policy=lora))
    check_resume(tmp_path, config(policy=lora))
    for peft, change in (
        ({"enabled": True, "dim": 4}, "policy.megatron_cfg.peft.dim: 8 -> 4"),
        ({}, "policy.megatron_cfg.peft.enabled: True -> False"),
    ):
        changed = config(policy={"model_name": "tiny-llama", "megatron_cfg": {"peft": peft}})
        with pytest.raises(ConfigError, match=change.replace(".", r"\.")):
            check_resume(tmp_path, changed)
    # saved before the key existed: its config.yaml has no peft section
    saved = config().model_dump(mode="json")
    del saved["policy"]["megatron_cfg"]["peft"]
    (tmp_path / RUN_CONFIG_FILE).write_text(yaml.safe_dump(saved))
    check_resume(tmp_path, config())


def test_checkpoint_without_config_is_not_checked(tmp_path):
    check_resume(tmp_path, config(policy={"model_name": "tiny-qwen2"}))


def test_nemo_rl_grpo_refuses_to_resume_on_other_data_before_starting(tmp_path, capsys):
    """The check runs first thing in setup: exit 2 and one line, no Ray, no model."""
    from pathlib import Path

    from nemo_rl.cli import main
    from nemo_rl.commands import load_recipe, parse_recipe_command

    recipe = Path(__file__).resolve().parents[3] / "configs" / "grpo_tiny_cpu.yaml"
    ckpt = tmp_path / "ckpt"
    args = ["grpo", "--config", str(recipe), f"checkpointing.checkpoint_dir={ckpt}",
            f"logger.log_dir={tmp_path / 'logs'}"]
    (ckpt / "step_10").mkdir(parents=True)
    save_run_config(ckpt / "step_10", load_recipe(parse_recipe_command(args)))
    assert main([*args, "data.synthetic.max_operand=6"]) == 2
    # (after the one-line note on megatron-core's fallbacks, where TransformerEngine is absent)
    lines = [line for line in capsys.readouterr().err.splitlines() if "TransformerEngine" not in line]
    assert len(lines) == 2 and lines[1] == "(--debug shows the traceback)"
    assert lines[0].startswith("nemo-rl grpo: config error: cannot resume from ")
    assert "data.synthetic.max_operand: 4 -> 6" in lines[0]
