"""Rendering the Ray-on-slurm job script, reading the node count from the recipe, submitting."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from nemo_rl.launch.config import SlurmLaunchConfig
from nemo_rl.launch.scripts import LaunchError
from nemo_rl.launch.slurm import render_sbatch, resolve_shape, submit
from nemo_rl.utils.config import ConfigError

REPO = Path(__file__).resolve().parents[3]
TINY = str(REPO / "configs/grpo_tiny_cpu.yaml")
AWKWARD_COMMAND = ["python", "-c", "print('a b')", "x=$HOME", "semi;colon", "new\nline", ""]


def preamble(script: str) -> str:
    """The rendered script up to the inlined launchers: header, settings, command."""
    return script.split("\n# ---- launchers/")[0]


def run_preamble(script: str, then: str) -> str:
    out = subprocess.run(
        ["bash", "-c", preamble(script) + "\n" + then],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": os.environ["PATH"]},
    )
    return out.stdout


def test_header_lists_every_given_sbatch_option(tmp_path: Path) -> None:
    cfg = SlurmLaunchConfig(
        nodes=2, gpus_per_node=8, cpus_per_node=64, partition="batch", account="acct",
        qos="high", time="04:00:00", job_name="grpo-8b", log_dir=str(tmp_path),
        sbatch_args=["--mem=0", "--dependency=afterany:41"], stop_signal_lead_s=300,
    )
    script = render_sbatch(cfg, ["nemo-rl", "grpo"])
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert header == [
        "#SBATCH --job-name=grpo-8b",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=64",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=batch",
        "#SBATCH --account=acct",
        "#SBATCH --qos=high",
        "#SBATCH --time=04:00:00",
        "#SBATCH --exclusive",
        f"#SBATCH --output={tmp_path}/slurm-%j.out",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --mem=0",
        "#SBATCH --dependency=afterany:41",
    ]
    assert script.startswith("#!/bin/bash\n#SBATCH ")


def test_cpu_job_without_options_asks_for_no_gpus_partition_or_time() -> None:
    script = render_sbatch(SlurmLaunchConfig(nodes=1, gpus_per_node=0, exclusive=False), ["x"])
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert not any(opt in line for line in header for opt in ("gpus", "partition", "time", "excl"))


def test_command_and_environment_survive_quoting(tmp_path: Path) -> None:
    cfg = SlurmLaunchConfig(
        nodes=2, gpus_per_node=0, log_dir=str(tmp_path),
        env=["WANDB_API_KEY", "HF_HOME=/data/hf cache", "NCCL_*"],
        ray_start_args=["--object-store-memory=1000000"],
        container_image="nvcr.io/nvidia/nemo-rl:latest", container_mounts=["/a:/a", "/b:/c"],
    )
    script = render_sbatch(cfg, AWKWARD_COMMAND)
    argv = run_preamble(script, 'printf "%s\\0" "$@"').split("\0")[:-1]
    assert argv == AWKWARD_COMMAND
    settings = run_preamble(
        script,
        'echo "$HF_HOME|$NRL_ENV_PASSTHROUGH|$NRL_CONTAINER_MOUNTS|$NRL_RAY_START_ARGS|$NRL_LOG_DIR'
        '|$NRL_GPUS_PER_NODE|$NRL_ATTACH"',
    )
    assert settings.strip() == (
        f"/data/hf cache|WANDB_API_KEY HF_HOME NCCL_*|/a:/a,/b:/c|--object-store-memory=1000000|"
        f"{tmp_path}|0|0"
    )


def test_whole_script_parses_and_inlines_both_launcher_files() -> None:
    script = render_sbatch(SlurmLaunchConfig(nodes=2, gpus_per_node=8), ["nemo-rl", "grpo"])
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    for name in ("ray_common.sh", "ray_on_slurm.sh"):
        assert (REPO / "launchers" / name).read_text().strip() in script


def test_attach_mode_renders_without_a_command() -> None:
    script = render_sbatch(SlurmLaunchConfig(nodes=2, gpus_per_node=0, attach=True), [])
    assert run_preamble(script, 'echo "$#:$NRL_ATTACH"').strip() == "0:1"
    with pytest.raises(ValueError, match="takes no driver command"):
        render_sbatch(SlurmLaunchConfig(nodes=2, gpus_per_node=0, attach=True), ["x"])
    with pytest.raises(ValueError, match="give the driver command after '--'"):
        render_sbatch(SlurmLaunchConfig(nodes=2, gpus_per_node=0), [])


def test_recipe_gives_nodes_and_gpus() -> None:
    cfg = resolve_shape(SlurmLaunchConfig(), ["nemo-rl", "grpo", "--config", TINY])
    assert (cfg.nodes, cfg.gpus_per_node) == (1, 0)
    gpus = resolve_shape(
        SlurmLaunchConfig(),
        ["/venv/bin/nemo-rl", "grpo", "--config", TINY, "cluster.num_nodes=2",
         "cluster.gpus_per_node=8", "policy.generation.colocated.enabled=false",
         "policy.train_micro_batch_size=8"],  # DP 16: 128 / 16 = 8 samples per rank
    )
    assert (gpus.nodes, gpus.gpus_per_node) == (4, 8)  # generation gets 2 nodes of its own
    # on CPU both clusters share each node's logical CPUs
    cpus = resolve_shape(
        SlurmLaunchConfig(),
        ["nemo-rl", "grpo", "--config", TINY, "cluster.num_nodes=2",
         "policy.generation.colocated.enabled=false"],
    )
    assert (cpus.nodes, cpus.gpus_per_node) == (2, 0)


def test_recipe_mismatch_and_bad_recipes_fail_before_submission() -> None:
    command = ["nemo-rl", "grpo", "--config", TINY, "cluster.num_nodes=2"]
    with pytest.raises(ConfigError, match=r"--nodes 4 does not match the recipe, which needs 2 "
                       r"nodes \(cluster.num_nodes=2\)"):
        resolve_shape(SlurmLaunchConfig(nodes=4), command)
    with pytest.raises(ConfigError, match="--gpus-per-node 8 does not match the recipe's "
                       "cluster.gpus_per_node=0"):
        resolve_shape(SlurmLaunchConfig(gpus_per_node=8), command)
    with pytest.raises(ConfigError, match="unknown key cluster.num_node; did you mean"):
        resolve_shape(SlurmLaunchConfig(), [*command[:4], "cluster.num_node=2"])
    with pytest.raises(ConfigError, match="--nodes is required"):
        resolve_shape(SlurmLaunchConfig(), ["python", "train.py"])
    other = resolve_shape(SlurmLaunchConfig(nodes=3), ["python", "train.py"])
    assert (other.nodes, other.gpus_per_node) == (3, 0)


def test_submit_without_sbatch_says_where_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="sbatch not found on PATH: run this on a slurm login"):
        submit(SlurmLaunchConfig(nodes=1, gpus_per_node=0, log_dir=str(tmp_path)), "#!/bin/bash\n")


def test_chained_jobs_each_wait_for_every_earlier_one_to_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a fake sbatch that records its arguments and answers job ids 101, 102, 103
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/bash\necho "$*" >> {calls}\necho $((100 + $(wc -l < {calls})))\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    cfg = SlurmLaunchConfig(nodes=1, gpus_per_node=0, log_dir=str(tmp_path), chain_jobs=2)
    job = submit(cfg, "#!/bin/bash\n")
    assert (job.job_id, job.chained) == ("101", ("102", "103"))
    script = str(job.script)
    assert calls.read_text().splitlines() == [
        f"--parsable {script}",
        f"--parsable --dependency=afternotok:101 --kill-on-invalid-dep=yes {script}",
        f"--parsable --dependency=afternotok:101:102 --kill-on-invalid-dep=yes {script}",
    ]


def test_requeue_submits_requeueable_appending_jobs_with_their_limit(tmp_path: Path) -> None:
    cfg = SlurmLaunchConfig(nodes=1, gpus_per_node=0, log_dir=str(tmp_path), requeue=True,
                            max_requeues=5)
    script = render_sbatch(cfg, ["nemo-rl", "grpo"])
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert header[-2:] == ["#SBATCH --requeue", "#SBATCH --open-mode=append"]
    assert run_preamble(script, 'echo "$NRL_REQUEUE:$NRL_MAX_REQUEUES"').strip() == "1:5"
    plain = render_sbatch(SlurmLaunchConfig(nodes=1, gpus_per_node=0), ["x"])
    assert "#SBATCH --requeue" not in plain
    assert run_preamble(plain, 'echo "$NRL_REQUEUE"').strip() == "0"
    with pytest.raises(ValueError, match="max_requeues needs requeue"):
        SlurmLaunchConfig(nodes=1, max_requeues=2)
    with pytest.raises(ValueError, match="an --attach job has none"):
        SlurmLaunchConfig(nodes=1, attach=True, requeue=True)
