"""The ``nemo-rl`` command line: printing the resolved config, config errors, dispatch."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nemo_rl import cli
from nemo_rl.commands import RECIPE_COMMANDS, RecipeCommand
from nemo_rl.algorithms.grpo_config import GRPOMasterConfig
from nemo_rl.utils.checkpoint import CheckpointError
from nemo_rl.utils.errors import ModelNotFoundError

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/grpo_tiny_cpu.yaml")

_received: list[GRPOMasterConfig] = []


def _fake_run(cfg: GRPOMasterConfig) -> int:
    """Stands in for the GRPO entry point: records its argument, returns a telltale code."""
    _received.append(cfg)
    return 7


FAKE_GRPO = RecipeCommand(GRPOMasterConfig, __name__, "_fake_run")


def test_print_config_shows_resolved_override(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        ["grpo", "--config", TINY, "policy.megatron_cfg.tensor_model_parallel_size=2",
         "cluster.cpu_bundles_per_node=2", "--print-config", "grpo.seed=123"]
    )
    out = capsys.readouterr().out
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["policy"]["megatron_cfg"]["tensor_model_parallel_size"] == 2
    assert printed["grpo"]["seed"] == 123
    # Resolved: the recipe's ${policy.max_total_sequence_length} and schema defaults appear.
    assert printed["policy"]["generation"]["vllm_cfg"]["max_model_len"] == 64
    assert printed["loss_fn"]["ratio_clip_max"] == GRPOMasterConfig().loss_fn.ratio_clip_max


def test_print_config_prints_the_memory_plan_as_yaml_comments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    recipe = str(REPO / "configs/grpo_llama3.1_8b_2n8g.yaml")
    assert cli.main(["grpo", "--config", recipe, "--print-config"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["cluster"]["gpu_memory_gb"] == 80.0  # still parses
    config, plan = out.split("# GPU memory plan of meta-llama/Llama-3.1-8B-Instruct", 1)
    lines = plan.splitlines()
    assert all(line.startswith("#") for line in lines[1:])
    assert lines[1].split() == ["#", "GiB", "per", "GPU", "training", "logprobs", "refit",
                                "generation"]
    assert "#   Peak: refit (every GPU), 51.4 of 80.0 GiB (64%): fits" in lines
    # a CPU recipe says it has none
    assert cli.main(["grpo", "--config", TINY, "--print-config"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("# GPU memory plan: none (a CPU run: cluster.gpus_per_node is 0)\n")


def test_a_recipe_over_the_gpu_memory_is_refused_naming_the_largest_term(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The 8 B recipe on 32 GiB GPUs (training needs 34.2 GiB, most of it the fp32 gradient
    buffer), and the 30B-A3B recipe with the gpu_memory_utilization 0.9 it shipped with (its
    refit needs 80.3 GiB, most of it the engine's whole-model weights in that budget)."""
    cases = [
        ("grpo_llama3.1_8b_2n8g.yaml", "cluster.gpu_memory_gb=32",
         "the training phase needs 34.2 GiB per GPU (every GPU), more than "
         "cluster.gpu_memory_gb = 32.0 GiB; its largest term is gradient buffer = 15.0 GiB "
         "(4.01e9 x 4 B (fp32)): raise policy.megatron_cfg.tensor_model_parallel_size or "
         "pipeline_model_parallel_size"),
        ("grpo_qwen3_30b_a3b_2n8g.yaml", "policy.generation.vllm_cfg.gpu_memory_utilization=0.9",
         "the refit phase needs 80.3 GiB per GPU (every GPU), more than cluster.gpu_memory_gb = "
         "80.0 GiB; its largest term is vLLM weights = 56.9 GiB (30.5e9 x 2 B / vLLM TP 1): "
         "lower policy.generation.vllm_cfg.gpu_memory_utilization"),
    ]
    for recipe, override, needle in cases:
        argv = ["grpo", "--config", str(REPO / "configs" / recipe), override, "--print-config"]
        code = cli.main(argv)
        captured = capsys.readouterr()
        assert code == 2 and captured.out == ""
        assert f"  - the GPU memory plan does not fit: {needle}" in captured.err
        assert "Traceback" not in captured.err


def test_tensor_parallel_without_the_ranks_is_refused_before_ray(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """TP=2 on the tiny CPU recipe's one worker slot per node: a config error naming the fix."""
    code = cli.main(
        ["grpo", "--config", TINY, "policy.megatron_cfg.tensor_model_parallel_size=2"]
    )
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert "tensor_model_parallel_size x pipeline_model_parallel_size" in captured.err
    assert "cluster.num_nodes x cluster.cpu_bundles_per_node = 1 x 1" in captured.err


def test_typo_returns_2_with_message(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["grpo", "--config", TINY, "policy.megtron_cfg.tensor_model_parallel_size=2"])
    captured = capsys.readouterr()
    assert code == 2
    assert "unknown key policy.megtron_cfg; did you mean policy.megatron_cfg?" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_typo_in_recipe_returns_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(f"defaults: {TINY}\npolicy:\n  precison: bfloat16\n")
    assert cli.main(["grpo", "--config", str(recipe), "--print-config"]) == 2
    assert "unknown key policy.precison; did you mean policy.precision?" in capsys.readouterr().err


def test_missing_recipe_returns_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["grpo", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_dispatches_validated_config_to_entry_point(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(RECIPE_COMMANDS, "grpo", FAKE_GRPO)
    _received.clear()
    assert cli.main(["grpo", "--config", TINY, "grpo.max_num_steps=3"]) == 7
    (cfg,) = _received
    assert isinstance(cfg, GRPOMasterConfig) and cfg.grpo.max_num_steps == 3
    assert "max_num_steps: 3" in capsys.readouterr().out  # resolved config printed first


def test_print_config_does_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(RECIPE_COMMANDS, "grpo", FAKE_GRPO)
    _received.clear()
    assert cli.main(["grpo", "--config", TINY, "--print-config"]) == 0
    assert _received == []


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["grpo"], ["grpo", "--config", TINY, "--no-such-flag"], ["train"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
    capsys.readouterr()


def test_own_data_errors_exit_2_naming_file_line_or_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Bad own data: a missing file (config time), a malformed line and a row without a field
    its environment needs (data load, before Ray starts): one message each, exit code 2."""
    own = ["sft_warmup.enabled=false", "checkpointing.enabled=false"]
    code = cli.main(["grpo", "--config", TINY, *own, f"data.train_path={tmp_path}/no.jsonl"])
    err = capsys.readouterr().err
    assert code == 2 and f"data.train_path: file '{tmp_path}/no.jsonl' does not exist" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "x", answer: 3}\n')
    code = cli.main(["grpo", "--config", TINY, *own, f"data.train_path={bad}"])
    err = capsys.readouterr().err
    assert code == 2 and f"nemo-rl grpo: config error: {bad}:2: not valid JSON" in err
    assert "Traceback" not in err
    games = tmp_path / "games.jsonl"
    games.write_text('{"prompt": "Guess a number from 1 to 9", "low": 1}\n')
    code = cli.main([
        "grpo", "--config", TINY, *own, f"data.train_path={games}",
        "data.task_name=number_guess", "env.number_guess={}",
    ])
    err = capsys.readouterr().err
    assert code == 2 and f"{games}: row 0 has no field 'secret'" in err


def test_misspelt_task_name_is_refused_at_config_time(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["grpo", "--config", TINY, "data.task_name=maths", "--print-config"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert "data.task_name='maths' names no environment: did you mean 'math'?" in captured.err


def test_plugin_environment_added_by_override(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main([
        "grpo", "--config", TINY, "--print-config", "+env.mine.reward_fn=os.path:join",
        "+env.mine.num_cpus=0.5", "data.task_name=mine",
    ])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert code == 0
    assert printed["env"]["mine"] == {"num_cpus": 0.5, "processor": None, "cls": None,
                                      "reward_fn": "os.path:join", "reward_fns": None,
                                      "answer_fn": None, "agent_fn": None}
    code = cli.main(["grpo", "--config", TINY, "+env.mine.reward_fn=os.path:nope"])
    err = capsys.readouterr().err
    assert code == 2 and "env.mine.reward_fn='os.path:nope': 'os.path' has no attribute" in err


def _raise_in_ray_task(cfg: GRPOMasterConfig) -> int:
    """Stands in for a run whose Ray worker found bad input: the driver sees Ray's wrapper."""
    from ray.exceptions import RayTaskError

    cause = CheckpointError("checkpointing.resume_from: /x is damaged; restore it")
    raise RayTaskError("train", "Traceback (remote) ...", cause).as_instanceof_cause()


def _raise_a_bug(cfg: GRPOMasterConfig) -> int:
    raise ZeroDivisionError("a bug, not bad input")


def _fail_every_refit(cfg: GRPOMasterConfig) -> int:
    from nemo_rl.models.generation.refit.errors import RefitFailed

    raise RefitFailed("the weight refit failed 3 times (policy.refit_max_retries=2): ...")


def test_bad_input_found_while_running_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run-time bad input (here a model path that does not exist, found when the run sets
    up) prints one message naming the field, exit 2; ``--debug`` shows the traceback."""
    argv = ["grpo", "--config", TINY, f"policy.model_name={tmp_path}/no_model",
            "checkpointing.enabled=false", f"logger.log_dir={tmp_path}/logs"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"nemo-rl grpo: error: policy.model_name: model path {tmp_path}/no_model" in err
    assert "Traceback" not in err and "--debug shows the traceback" in err
    with pytest.raises(ModelNotFoundError):
        cli.main([*argv, "--debug"])
    ray_task = RecipeCommand(GRPOMasterConfig, __name__, "_raise_in_ray_task")
    monkeypatch.setitem(RECIPE_COMMANDS, "grpo", ray_task)
    assert cli.main(["grpo", "--config", TINY]) == 2
    err = capsys.readouterr().err
    assert "nemo-rl grpo: error: checkpointing.resume_from: /x is damaged; restore it\n" in err
    assert "remote" not in err
    bug = RecipeCommand(GRPOMasterConfig, __name__, "_raise_a_bug")
    monkeypatch.setitem(RECIPE_COMMANDS, "grpo", bug)
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        cli.main(["grpo", "--config", TINY])
    # a fault the run's retries did not cure: one line too, exit 1
    fault = RecipeCommand(GRPOMasterConfig, __name__, "_fail_every_refit")
    monkeypatch.setitem(RECIPE_COMMANDS, "grpo", fault)
    assert cli.main(["grpo", "--config", TINY]) == 1
    err = capsys.readouterr().err
    assert "nemo-rl grpo: error: the weight refit failed 3 times" in err
    assert "Traceback" not in err
