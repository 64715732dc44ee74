"""CheckpointManager: atomic finalize with a manifest, top-k + latest retention, best/latest
lookup, verified resume (fallback, resume_from), config checks, RNG state."""

import json
import random

import numpy as np
import pytest
import torch

from nemo_rl.utils.checkpoint import (
    CheckpointError,
    CheckpointingConfig,
    CheckpointManager,
    load_rng_state,
    parse_save_by,
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


# ---- manifest, verified resume, resume_from ---------------------------------------------------


def test_finalized_checkpoint_has_manifest_of_every_file(tmp_path):
    manager = _manager(tmp_path)
    final = _save(manager, 2, 0.2)
    manifest = json.loads((final / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["policy/weights.bin", "training_info.json"]
    assert manifest["files"]["policy/weights.bin"]["size"] == 2
    assert manager.resume_checkpoint() == final


def _damage(path, how):
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:  # flip one bit in the middle: same size, other content
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :])


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_newest_falls_back_with_one_warning(tmp_path, caplog, how):
    manager = _manager(tmp_path, keep_top_k=None)
    for step in (4, 8):
        _save(manager, step, 0.1)
    _damage(tmp_path / "ckpt" / "step_8" / "policy" / "weights.bin", how)
    with caplog.at_level("WARNING", logger="nemo_rl.utils.checkpoint"):
        resumed = manager.resume_checkpoint()
    assert resumed == tmp_path / "ckpt" / "step_4"
    (record,) = caplog.records
    problem = {"truncate": "has 4 bytes, the manifest says 8", "flip": "has checksum"}[how]
    assert f"step_8 is damaged: policy/weights.bin {problem}" in record.getMessage()
    # moved aside, not deleted; no longer a checkpoint
    assert (tmp_path / "ckpt" / "damaged_step_8" / "policy" / "weights.bin").exists()
    assert [p.name for p in manager.checkpoints()] == ["step_4"]


def test_sizes_mode_skips_checksums(tmp_path):
    manager = _manager(tmp_path, keep_top_k=None, verify_on_resume="sizes")
    final = _save(manager, 8, 0.1)
    _damage(final / "policy" / "weights.bin", "flip")
    assert manager.resume_checkpoint() == final  # same size: not seen without checksums


def test_folder_without_manifest_is_not_a_checkpoint(tmp_path, caplog):
    manager = _manager(tmp_path, keep_top_k=None)
    _save(manager, 1, 0.1)
    (tmp_path / "ckpt" / "step_2" / "policy").mkdir(parents=True)  # copied in, never sealed
    (tmp_path / "ckpt" / "step_2" / "training_info.json").write_text('{"step": 2}')
    with caplog.at_level("WARNING", logger="nemo_rl.utils.checkpoint"):
        assert manager.resume_checkpoint() == tmp_path / "ckpt" / "step_1"
    assert "no manifest.json" in caplog.text
    assert (tmp_path / "ckpt" / "damaged_step_2").is_dir()


def test_all_damaged_resumes_from_scratch_and_names_do_not_collide(tmp_path):
    manager = _manager(tmp_path, keep_top_k=None)
    for _ in range(2):  # the same step damaged twice: the second goes to damaged_step_3.1
        final = _save(manager, 3, 0.1)
        (final / "manifest.json").unlink()
        assert manager.resume_checkpoint() is None
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "damaged_step_3", "damaged_step_3.1"
    ]


def test_resume_from_step_or_folder(tmp_path):
    first = _manager(tmp_path, keep_top_k=None)
    step_3, _ = _save(first, 3, 0.1), _save(first, 6, 0.1)
    assert _manager(tmp_path, keep_top_k=None, resume_from=3).resume_checkpoint() == step_3
    by_path = _manager(tmp_path, keep_top_k=None, resume_from=str(step_3))
    assert by_path.resume_checkpoint() == step_3


def test_resume_from_refuses_damaged_or_missing(tmp_path):
    manager = _manager(tmp_path, keep_top_k=None)
    final = _save(manager, 3, 0.1)
    _damage(final / "policy" / "weights.bin", "truncate")
    with pytest.raises(CheckpointError, match=r"resume_from=3: .*step_3 is damaged: "
                       r"policy/weights.bin has 1 bytes, the manifest says 3"):
        _manager(tmp_path, keep_top_k=None, resume_from=3).resume_checkpoint()
    assert final.is_dir()  # a checkpoint the user named is left where it is
    with pytest.raises(CheckpointError, match=r"resume_from=7: .*step_7 does not exist"):
        _manager(tmp_path, keep_top_k=None, resume_from=7).resume_checkpoint()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("checkpoint_must_save_by", "03:35:00", "is not DD:HH:MM:SS"),
        ("checkpoint_must_save_by", "00:24:00:00", "hours must be < 24"),
        ("checkpoint_must_save_by", "00:00:00:00", "must be more than zero"),
        ("stop_signals", ["SIGKILL"], "not a signal a process can catch"),
        ("stop_signals", ["USR1"], "not a signal a process can catch"),
        ("resume_from", -1, "must be >= 0"),
        ("verify_on_resume", "none", "checksums"),
    ],
)
def test_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        CheckpointingConfig(enabled=True, **{field: value})


@pytest.mark.parametrize(
    ("field", "value"), [("resume_from", 3), ("checkpoint_must_save_by", "00:03:35:00")]
)
def test_keys_that_need_checkpointing_enabled(field, value):
    with pytest.raises(ValueError, match=f"checkpointing.{field} is set but checkpointing.enabled"):
        CheckpointingConfig(**{field: value})


def test_save_by_in_seconds():
    assert parse_save_by("01:02:03:04") == ((24 + 2) * 60 + 3) * 60 + 4
    cfg = CheckpointingConfig(enabled=True, checkpoint_must_save_by="00:03:35:00")
    assert cfg.must_save_by_seconds() == 3 * 3600 + 35 * 60
    assert CheckpointingConfig().must_save_by_seconds() is None


def test_background_check_gives_the_same_answer_and_its_errors(tmp_path, caplog):
    manager = _manager(tmp_path, keep_top_k=None)
    _save(manager, 4, 0.1)
    _damage(_save(manager, 8, 0.1) / "policy" / "weights.bin", "truncate")
    with caplog.at_level("WARNING", logger="nemo_rl.utils.checkpoint"):
        manager.start_resume_check()
        assert manager.resume_checkpoint() == tmp_path / "ckpt" / "step_4"
    assert "step_8 is damaged" in caplog.text
    named = _manager(tmp_path, keep_top_k=None, resume_from=9)
    named.start_resume_check()
    with pytest.raises(CheckpointError, match="resume_from=9"):
        named.resume_checkpoint()
