"""``nemo-rl export`` arguments: which policy folder a path names, and one-line errors with exit
code 2 for what is not an exportable checkpoint. (The export itself is tested against the
trained policy in test_megatron_policy_worker.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_bridge.cli import CliError
from megatron_bridge.cli import main as bridge_main
from nemo_rl.cli import main
from nemo_rl.models.policy.export import resolve_policy_dir


def policy_folder(path: Path) -> Path:
    """A folder that looks like a dist checkpoint (its .metadata) without bridge.json."""
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    return path


def test_a_path_names_its_policy_folder(tmp_path):
    for step in (5, 10, 30):
        policy_folder(tmp_path / "ckpts" / f"step_{step}" / "policy")
    (tmp_path / "ckpts" / "sft_warmup").mkdir()
    assert resolve_policy_dir(tmp_path / "ckpts") == tmp_path / "ckpts/step_30/policy"
    assert resolve_policy_dir(tmp_path / "ckpts/step_10") == tmp_path / "ckpts/step_10/policy"
    assert resolve_policy_dir(tmp_path / "ckpts/step_5/policy") == tmp_path / "ckpts/step_5/policy"
    with pytest.raises(CliError, match="not a training checkpoint"):
        resolve_policy_dir(tmp_path / "ckpts/sft_warmup")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "does not exist or is not a folder"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "is not a training checkpoint"),
        (lambda p: policy_folder(p / "old") , "pass --model with the recipe's policy.model_name"),
    ],
)
def test_bad_checkpoints_exit_2_with_one_line(tmp_path, capsys, make, message):
    assert main(["export", str(make(tmp_path)), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nemo-rl export: error: ") and message in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


def test_megatron_bridge_info_explains_a_checkpoint_without_bridge_json(tmp_path, capsys):
    assert bridge_main(["info", str(policy_folder(tmp_path / "policy"))]) == 2
    err = capsys.readouterr().err
    assert "without bridge.json" in err and "nemo-rl export CHECKPOINT HF_OUT --model" in err
