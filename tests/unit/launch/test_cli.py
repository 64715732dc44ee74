"""``nemo-rl launch``: option parsing, errors naming the flag, dry run."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl import cli
from nemo_rl.launch.cli import flag_name
from nemo_rl.launch.config import SlurmLaunchConfig

REPO = Path(__file__).resolve().parents[3]
TINY = str(REPO / "configs/grpo_tiny_cpu.yaml")


def launch(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["launch", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_flags_follow_field_names() -> None:
    assert flag_name("gpus_per_node", SlurmLaunchConfig) == "--gpus-per-node"
    assert flag_name("sbatch_args", SlurmLaunchConfig) == "--sbatch-arg"
    assert flag_name("container_mounts", SlurmLaunchConfig) == "--container-mount"
    assert flag_name("env", SlurmLaunchConfig) == "--env"


def test_dry_run_prints_the_script_for_the_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = launch(
        ["slurm", "--dry-run", "--partition", "batch", "--time", "30", "--env", "HF_HOME=/hf",
         "--env", "WANDB_API_KEY", "--no-exclusive", "--", "nemo-rl", "grpo", "--config", TINY,
         "grpo.seed=3"],
        capsys,
    )
    assert code == 0, err
    assert out.startswith("#!/bin/bash\n")
    assert "#SBATCH --nodes=1\n" in out and "#SBATCH --partition=batch\n" in out
    assert "#SBATCH --exclusive" not in out
    assert "export HF_HOME=/hf\n" in out
    assert "NRL_ENV_PASSTHROUGH='HF_HOME WANDB_API_KEY'\n" in out
    assert f"set -- nemo-rl grpo --config {TINY} grpo.seed=3\n" in out


def test_dry_run_prints_the_recipes_memory_plan_beside_the_script(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The plan goes to stderr: stdout stays the job script (``> job.sh; sbatch job.sh``)."""
    recipe = str(REPO / "configs/grpo_llama3.1_70b_16n8g.yaml")
    code, out, err = launch(
        ["slurm", "--dry-run", "--", "nemo-rl", "grpo", "--config", recipe], capsys
    )
    assert code == 0, err
    assert out.startswith("#!/bin/bash\n") and "#SBATCH --nodes=16\n" in out
    assert "memory plan" not in out
    assert "GPU memory plan of meta-llama/Llama-3.1-70B-Instruct" in err
    assert "  Peak: refit (every GPU), 62.3 of 80.0 GiB (78%): fits" in err.splitlines()
    # the same recipe on GPUs declared smaller is refused before anything is queued
    code, out, err = launch(
        ["slurm", "--dry-run", "--", "nemo-rl", "grpo", "--config", recipe,
         "cluster.gpu_memory_gb=60"], capsys
    )
    assert code == 2 and out == ""
    assert "the GPU memory plan does not fit: the training phase needs 60.1 GiB" in err


def test_option_errors_name_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = launch(
        ["slurm", "--nodes", "0", "--time", "2h", "--env", "A B", "--", "python", "x.py"], capsys
    )
    assert code == 2 and out == ""
    assert "nemo-rl launch slurm: invalid options: 3 problems:" in err
    assert "  - --nodes: got 0; Input should be greater than or equal to 1" in err
    assert "  - --time: got '2h'; '2h' is not a slurm time" in err
    assert "  - --env: got ['A B']; 'A B' is not a variable name" in err
    code, _, err = launch(
        ["slurm", "--nodes", "1", "--container-mount", "/a:/a", "--", "x"], capsys
    )
    assert code == 2
    assert "container_mounts / container_workdir need container_image; add --container-image" in err


def test_recipe_errors_surface_before_submission(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = launch(
        ["slurm", "--dry-run", "--", "nemo-rl", "grpo", "--config", TINY, "polcy.precision=x"],
        capsys,
    )
    assert code == 2
    assert err.startswith("nemo-rl launch slurm: unknown key polcy; did you mean policy?")
    code, _, err = launch(
        ["slurm", "--dry-run", "--", "nemo-rl", "grpo", "--config", TINY, "--no-such-flag"],
        capsys,
    )
    assert code == 2
    assert "unrecognized arguments: --no-such-flag" in err  # argparse's usage error, then ours
    assert "nemo-rl launch slurm: cannot parse the driver command 'nemo-rl grpo" in err


@pytest.mark.parametrize(
    ("recipe", "overrides", "needle"),
    [
        (TINY, ["policy.megatron_cfg.tensor_model_parallel_size=2"], "cluster.cpu_bundles_per_node"),
        (TINY, ["grpo.max_num_steps=2", "policy.megatron_cfg.scheduler.lr_decay_style=cosine"],
         "lr_warmup_iters (5)"),
        (str(REPO / "configs/grpo_qwen2.5_32b_4n8g.yaml"),
         ["policy.generation.vllm_cfg.tensor_parallel_size=3"],
         "policy.generation.vllm_cfg.tensor_parallel_size=3 does not divide the 8 bundles"),
    ],
)
def test_dry_run_refuses_what_would_fail_after_ray_starts(
    capsys: pytest.CaptureFixture[str], recipe: str, overrides: list[str], needle: str
) -> None:
    code, out, err = launch(
        ["slurm", "--dry-run", "--", "nemo-rl", "grpo", "--config", recipe, *overrides], capsys
    )
    assert code == 2 and out == ""
    assert "1 problem:" in err and needle in err


def test_dry_run_reads_the_recipes_data_before_queueing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The driver's input checks run before the job is queued: a malformed data line (file and
    line named), a row without a field its environment needs; a hub model that is not here
    still has its local data files parsed."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "x", answer: 3}\n')
    games = tmp_path / "games.jsonl"
    games.write_text('{"prompt": "Guess a number from 1 to 9", "low": 1}\n')
    own = ["sft_warmup.enabled=false"]
    cases = [
        ([f"data.train_path={bad}"], f"{bad}:2: not valid JSON"),
        ([f"data.train_path={games}", "data.task_name=number_guess", "env.number_guess={}"],
         f"{games}: row 0 has no field 'secret'"),
        ([f"data.train_path={bad}", "policy.model_name=some-org/not-cached-here"],
         f"{bad}:2: not valid JSON"),
    ]
    for overrides, needle in cases:
        code, out, err = launch(
            ["slurm", "--dry-run", "--", "nemo-rl", "grpo", "--config", TINY, *own, *overrides],
            capsys,
        )
        assert code == 2 and out == "" and needle in err, err
        assert "Traceback" not in err


def test_command_is_required_and_excludes_attach(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = launch(["slurm", "--nodes", "2"], capsys)
    assert (code, err.strip()) == (
        2, "nemo-rl launch slurm: give the driver command after '--' (or use --attach)"
    )
    code, _, err = launch(["slurm", "--nodes", "2", "--attach", "--", "python"], capsys)
    assert "--attach starts an interactive job and takes no driver command" in err
    code, out, _ = launch(["slurm", "--nodes", "2", "--attach", "--dry-run"], capsys)
    assert code == 0 and "NRL_ATTACH=1\n" in out and "\nset --\n" in out
    code, _, err = launch(["local"], capsys)
    assert (code, err.strip()) == (2, "nemo-rl launch local: give the command to run after '--'")


@pytest.mark.parametrize(
    ("command", "row", "needle"),
    [
        ("sft", '{"conversation": []}', "row 0 has no field 'messages'"),
        ("dpo", '{"prompt": "What is 1 + 1?", "chosen": "2"}', "row 0: no field 'rejected'"),
        ("rm", '{"prompt": "What is 1 + 1?", "chosen": "2"}', "row 0: no field 'rejected'"),
    ],
)
def test_dry_run_reads_sft_dpo_and_rm_data_before_queueing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, row: str, needle: str
) -> None:
    recipe = str(REPO / f"configs/{command}_tiny_cpu.yaml")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"x": 1}\n{"x": 2,\n')
    missing = tmp_path / "missing.jsonl"
    missing.write_text(row + "\n")
    for path, expected in ((broken, f"{broken}:2: not valid JSON"), (missing, needle)):
        code, out, err = launch(
            ["slurm", "--dry-run", "--", "nemo-rl", command, "--config", recipe,
             f"data.train_path={path}"],
            capsys,
        )
        assert code == 2 and out == "" and expected in err, err
        assert "Traceback" not in err
