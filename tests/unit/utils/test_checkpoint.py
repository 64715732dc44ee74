"""CheckpointManager: atomic finalize, top-k + latest retention, best/latest lookup, RNG state."""

import json
import random

import numpy as np
import pytest
import torch

from nemo_rl.utils.checkpoint import (
    CheckpointingConfig,
    CheckpointManager,
    load_rng_state,
    save_rng_state,
)


def _manager(tmp_path, **overrides):
    cfg = CheckpointingConfig(
        enabled=True, checkpoint_dir=str(tmp_path / "ckpt"), metric_name="val_reward", **overrides
    )
    return CheckpointManager(cfg)


def _save(manager, step, value):
    path = manager.init_tmp_checkpoint(step, {"val_reward": value})
    (path / "policy").mkdir()
    (path / "policy" / "weights.bin").write_bytes(b"w" * step)
    return manager.finalize_checkpoint(path)


def test_tmp_checkpoint_is_invisible_until_finalized(tmp_path):
    manager = _manager(tmp_path)
    tmp = manager.init_tmp_checkpoint(5, {"val_reward": 0.5, "epoch": 1})
    assert tmp.name == "tmp_step_5"
    assert json.loads((tmp / "training_info.json").read_text()) == {
        "step": 5,
        "val_reward": 0.5,
        "epoch": 1,
    }
    assert manager.get_latest_checkpoint_path() is None
    final = manager.finalize_checkpoint(tmp)
    assert final.name == "step_5" and not tmp.exists()
    assert manager.get_latest_checkpoint_path() == final
    assert manager.load_training_info(final)["step"] == 5


def test_keeps_top_k_plus_latest(tmp_path):
    manager = _manager(tmp_path, keep_top_k=2)
    for step, value in [(1, 0.1), (2, 0.9), (3, 0.5), (4, 0.7), (5, 0.2)]:
        _save(manager, step, value)
    assert [p.name for p in manager.checkpoints()] == ["step_2", "step_4", "step_5"]
    assert manager.get_best_checkpoint_path().name == "step_2"
    assert manager.get_latest_checkpoint_path().name == "step_5"
    latest_weights = manager.get_latest_checkpoint_path() / "policy" / "weights.bin"
    assert latest_weights.read_bytes() == b"w" * 5


def test_lower_is_better_and_keep_all(tmp_path):
    manager = _manager(tmp_path, keep_top_k=1, higher_is_better=False)
    for step, value in [(1, 3.0), (2, 1.0), (3, 2.0)]:
        _save(manager, step, value)
    assert [p.name for p in manager.checkpoints()] == ["step_2", "step_3"]
    assert manager.get_best_checkpoint_path().name == "step_2"

    keep_all = _manager(tmp_path / "all", keep_top_k=None)
    for step in range(1, 5):
        keep_all.finalize_checkpoint(keep_all.init_tmp_checkpoint(step, {}))
    assert len(keep_all.checkpoints()) == 4


def test_missing_metric_names_it(tmp_path):
    manager = _manager(tmp_path)
    with pytest.raises(KeyError, match="checkpointing.metric_name 'val_reward'.*'loss'"):
        manager.init_tmp_checkpoint(1, {"loss": 0.3})


def test_restart_removes_unfinished_and_resave_replaces(tmp_path):
    manager = _manager(tmp_path)
    _save(manager, 1, 0.1)
    crashed = manager.init_tmp_checkpoint(2, {"val_reward": 0.2})
    (crashed / "partial").write_text("half")
    reopened = _manager(tmp_path)
    assert not crashed.exists()
    assert [p.name for p in reopened.checkpoints()] == ["step_1"]
    # Re-saving step 1 after a resume replaces it whole.
    tmp = reopened.init_tmp_checkpoint(1, {"val_reward": 0.4})
    final = reopened.finalize_checkpoint(tmp)
    assert reopened.load_training_info(final)["val_reward"] == 0.4
    assert not (final / "policy").exists()
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_1"]


def test_rng_state_roundtrip(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    save_rng_state(tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    load_rng_state(tmp_path / "rng.pt")
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert torch.equal(got[2], expected[2])


def test_crash_during_resave_restores_previous(tmp_path):
    manager = _manager(tmp_path)
    final = _save(manager, 3, 0.3)
    final.rename(final.parent / "old_step_3")  # as if killed between the two renames
    reopened = _manager(tmp_path)
    assert [p.name for p in reopened.checkpoints()] == ["step_3"]
    assert reopened.load_training_info(reopened.get_latest_checkpoint_path())["val_reward"] == 0.3
