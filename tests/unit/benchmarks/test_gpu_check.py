"""``scripts/gpu_check.sh --dry-run``: the GPU check's code paths on CPU at toy sizes, with the
packages the GPU machine lacks hidden, so the script cannot rot before a GPU runs it.

One dry run (module fixture) serves every assertion; it takes about 40 s on 2 quiet cores
(five processes import torch and megatron-core).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    out = tmp_path_factory.mktemp("gpu_check") / "results.json"
    proc = run(["bash", str(SCRIPT), "--dry-run", "--steps", "2", "--json", str(out)], 600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, {r["name"]: r for r in json.loads(out.read_text())}


@pytest.mark.slow
def test_every_check_passes_and_says_so(dry_run):
    proc, results = dry_run
    assert sorted(results) == sorted(["train_step", "offload", "resume", "logprobs", "ipc_refit"])
    for name, r in results.items():
        assert r["status"] == "PASS", r
        assert f"[PASS] {name}: " in proc.stdout
    assert "5 passed, 0 failed, 0 skipped" in proc.stdout


@pytest.mark.slow
def test_train_step_reports_mfu_of_real_steps(dry_run):
    numbers = dry_run[1]["train_step"]["numbers"]
    assert len(numbers["step_times_s"]) == 3  # one warm-up + --steps 2
    assert len(numbers["losses"]) == 3 and all(math.isfinite(x) for x in numbers["losses"])
    # positive and finite; not < 1: the dry run's toy matmul peak, measured on a loaded CI
    # machine, can be below what the step reached a moment later
    assert 0 < numbers["mfu"] < math.inf
    assert numbers["tokens"] == 4 * 64


@pytest.mark.slow
def test_train_step_prints_the_memory_plan_beside_the_measured_peak(dry_run):
    """The plan's training phase for the trained model (fp32 in a dry run): its parameter term
    counts the worker's parameters but the norms' vectors; the peak is measured only on CUDA."""
    from nemo_rl.distributed.memory_plan import PARAMETERS, RUNTIME

    result = dry_run[1]["train_step"]
    memory, params = result["numbers"]["memory"], result["numbers"]["parameters"]
    planned = memory["plan_terms"][PARAMETERS] // 4
    assert 0 < params - planned <= 0.01 * params  # norms: 5 x 128 of ~557k parameters
    assert memory["plan_bytes"] == sum(
        v for k, v in memory["plan_terms"].items() if k != RUNTIME
    )
    assert memory["peak_allocated_bytes"] is None  # no CUDA in a dry run
    assert "memory: peak not measured without CUDA; the plan's training phase" in result["summary"]


@pytest.mark.slow
def test_offload_restores_parameters_and_counts_bytes(dry_run):
    numbers = dry_run[1]["offload"]["numbers"]
    assert numbers["restored_equal"] is True
    # Adam keeps two fp32 moments (and fp32 main params) per parameter: more than the params.
    assert numbers["bytes"]["optimizer_and_grads"] > numbers["bytes"]["params"] > 0
    assert math.isfinite(numbers["loss"])


@pytest.mark.slow
def test_resume_repeats_the_step_after_the_checkpoint(dry_run):
    numbers = dry_run[1]["resume"]["numbers"]
    assert math.isfinite(numbers["loss_saver"])
    assert numbers["loss_loader"] == numbers["loss_saver"]  # CPU fp32: bit for bit
    assert numbers["max_param_diff"] == 0.0


@pytest.mark.slow
def test_logprobs_of_both_sides_are_equal_on_cpu(dry_run):
    numbers = dry_run[1]["logprobs"]["numbers"]
    assert numbers["shape"] == [4, 64]
    assert numbers["max_abs_diff"] == 0.0  # same device, same code: bit for bit


@pytest.mark.slow
def test_ipc_refit_moves_every_tensor_byte(dry_run):
    import torch

    from benchmarks.bench_ipc_refit_transport import llama_tensors

    numbers = dry_run[1]["ipc_refit"]["numbers"]
    tensors = llama_tensors(1, 128, torch.device("cpu"), vocab=1024)
    assert numbers["nbytes"] == sum(t.numel() * t.itemsize for t in tensors.values())
    assert numbers["num_tensors"] == len(tensors)
    assert len(numbers["ratios"]) == 1 and numbers["ratios"][0] > 0


def test_without_cuda_the_check_stops_with_a_message():
    proc = run([sys.executable, "-m", "benchmarks.gpu_check"], 300)
    assert proc.returncode != 0
    assert "no CUDA device here" in proc.stderr and "--dry-run" in proc.stderr


def test_hidden_modules_look_uninstalled():
    code = (
        "import importlib.util, sys\n"
        "from benchmarks.gpu_check import hide_modules\n"
        "hide_modules(('yaml',))\n"
        "assert importlib.util.find_spec('yaml') is None\n"
        "try:\n    import yaml.constructor\nexcept ModuleNotFoundError:\n    print('hidden')\n"
    )
    proc = run([sys.executable, "-c", code], 60)
    assert proc.stdout.strip() == "hidden", proc.stderr


def test_vs_transformers_prints_each_ratio_and_the_missed_targets():
    from benchmarks.gpu_check_vs_transformers import GPU_SHAPES, compare

    gib = 2**30
    ours = dict(uniform_train=0.4, uniform_logprobs=0.1, long_train=0.5, skewed_train=0.2,
                peak_memory=50 * gib)
    theirs = dict(uniform_train=0.5, uniform_logprobs=0.1, long_train=0.5, skewed_train=0.5,
                  peak_memory=40 * gib)
    ok, summary, numbers = compare(ours, theirs, GPU_SHAPES, 700e12, dry_run=False)
    assert not ok and numbers["missed"] == ["uniform_logprobs", "peak_memory"]
    assert "uniform_train 0.400 / 0.500 s = 0.80" in summary
    assert "peak_memory 50.000 / 40.000 GiB = 1.25" in summary
    assert numbers["ratios"]["skewed_train"] == pytest.approx(0.4)
    # the Qwen2.5-1.5B shape's 160 TFLOP for 8 x 2048 tokens in 0.4 s of a 700 TFLOP/s peak
    assert numbers["mfu"]["ours"] == pytest.approx(0.573, abs=0.005)
    assert summary.endswith("(missed: uniform_logprobs, peak_memory)")


@pytest.mark.slow
def test_vs_transformers_dry_run_measures_both_sides(tmp_path):
    out = tmp_path / "vs.json"
    proc = run(["bash", str(SCRIPT), "--dry-run", "--only", "vs_transformers", "--steps", "1",
                "--json", str(out)], 600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {r["name"]: r for r in json.loads(out.read_text())}
    result = results.pop("vs_transformers")
    assert result["status"] == "PASS", result
    assert {r["status"] for r in results.values()} == {"SKIP"}  # the others, not named
    numbers = result["numbers"]
    for case in ("uniform_train", "uniform_logprobs", "long_train", "skewed_train"):
        assert numbers["ratios"][case] > 0, case
    assert numbers["ratios"]["peak_memory"] is None  # no CUDA in a dry run
    assert "[PASS] vs_transformers: ours / transformers: uniform_train " in proc.stdout
    assert "1 passed, 0 failed, 5 skipped" in proc.stdout
