"""Checkpoint folders with atomic finalisation and top-k retention, plus RNG state helpers.

Layout under ``checkpointing.checkpoint_dir``::

    step_<n>/                    a finished checkpoint of training step n
        training_info.json       {"step": n, <metric name>: value, ...}
        policy/                  the caller's model/optimizer/scheduler (POLICY_DIR)
        train_dataloader.pt      the caller's dataloader state_dict (DATALOADER_STATE_FILE)
        rng_state.pt             python/numpy/torch RNG states (RNG_STATE_FILE, save_rng_state)
    tmp_step_<n>/                a checkpoint being written; never read, removed on restart
    old_step_<n>/                step n's previous checkpoint while step n is re-saved

Saving is: ``path = manager.init_tmp_checkpoint(step, info)``, the caller writes its state into
``path``, then ``manager.finalize_checkpoint(path)`` renames it to ``step_<n>`` (one rename, so
a crash leaves either the old or the new checkpoint, never a half-written ``step_<n>``) and
deletes the checkpoints outside the top ``keep_top_k`` by ``metric_name``; the latest one is
always kept so a run can resume.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field

from nemo_rl.utils.config import ConfigModel

TRAINING_INFO_FILE = "training_info.json"
POLICY_DIR = "policy"
DATALOADER_STATE_FILE = "train_dataloader.pt"
RNG_STATE_FILE = "rng_state.pt"

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = "tmp_step_"
_OLD_PREFIX = "old_"


class CheckpointingConfig(ConfigModel):
    """Checkpoint saving and retention (``checkpointing``)."""

    enabled: bool = Field(default=False, description="Save checkpoints.")
    checkpoint_dir: str = Field(default="checkpoints", description="Folder checkpoints go to.")
    metric_name: str = Field(
        default="val_reward",
        min_length=1,
        description="Key of training_info (a validation metric) that ranks checkpoints.",
    )
    higher_is_better: bool = Field(
        default=True, description="Whether a larger metric_name is a better checkpoint."
    )
    keep_top_k: int | None = Field(
        default=3,
        ge=1,
        description="Checkpoints kept, best by metric_name, plus always the latest. "
        "None: keep all (metric_name is then not needed).",
    )
    save_period: int = Field(default=10, ge=1, description="Save every this many steps.")


class CheckpointManager:
    """Creates, finalises, prunes and finds the checkpoints of one run (see module docstring)."""

    def __init__(self, cfg: CheckpointingConfig) -> None:
        """Open ``cfg.checkpoint_dir`` (created if missing) and clean up after a crash.

        Unfinished ``tmp_step_*`` folders are deleted; an ``old_step_<n>`` left by a crash in
        the middle of re-saving step n is restored when ``step_<n>`` is missing, else deleted.
        """
        self.cfg = cfg
        self.checkpoint_dir = Path(cfg.checkpoint_dir)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.checkpoint_dir.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(stale)
        for old in self.checkpoint_dir.glob(f"{_OLD_PREFIX}*"):
            final = self.checkpoint_dir / old.name.removeprefix(_OLD_PREFIX)
            if final.exists():
                shutil.rmtree(old)
            else:
                os.replace(old, final)

    def init_tmp_checkpoint(self, step: int, training_info: dict[str, Any]) -> Path:
        """Create ``tmp_step_<step>/`` holding ``training_info.json``; return it for the caller.

        Args:
            step: training step the checkpoint is taken after (>= 0).
            training_info: JSON-serialisable facts of the step; must hold ``metric_name``
                when ``keep_top_k`` is set. ``"step"`` is added.

        Raises:
            KeyError: ``training_info`` lacks ``checkpointing.metric_name``.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        if self.cfg.keep_top_k is not None and self.cfg.metric_name not in training_info:
            raise KeyError(
                f"checkpointing.metric_name {self.cfg.metric_name!r} is not in the checkpoint's "
                f"training_info (keys: {sorted(training_info)}); validate before saving, set "
                "checkpointing.metric_name to one of those keys, or checkpointing.keep_top_k=null"
            )
        path = self.checkpoint_dir / f"{_TMP_PREFIX}{step}"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir()
        info = {**training_info, "step": step}
        (path / TRAINING_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
        return path

    def finalize_checkpoint(self, tmp_path: str | Path) -> Path:
        """Rename ``tmp_step_<n>`` to ``step_<n>`` (replacing an older ``step_<n>``), then prune.

        Returns:
            The final ``step_<n>`` path.
        """
        tmp_path = Path(tmp_path)
        in_dir = tmp_path.parent.resolve() == self.checkpoint_dir.resolve()
        if not in_dir or not tmp_path.name.startswith(_TMP_PREFIX):
            raise ValueError(
                f"{tmp_path} is not a folder made by init_tmp_checkpoint in {self.checkpoint_dir}"
            )
        final = self.checkpoint_dir / f"step_{tmp_path.name.removeprefix(_TMP_PREFIX)}"
        if final.exists():
            # Re-saving a step (after a resume): move the old one aside so the swap is two renames.
            old = self.checkpoint_dir / f"{_OLD_PREFIX}{final.name}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            os.replace(tmp_path, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp_path, final)
        self._prune()
        return final

    def checkpoints(self) -> list[Path]:
        """Finished ``step_<n>`` folders, oldest step first."""
        found = []
        for path in self.checkpoint_dir.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return [path for _, path in sorted(found)]

    def get_latest_checkpoint_path(self) -> Path | None:
        """The finished checkpoint of the highest step, or None when there is none."""
        found = self.checkpoints()
        return found[-1] if found else None

    def get_best_checkpoint_path(self) -> Path | None:
        """The finished checkpoint best by ``metric_name`` (ties: the later step), or None.

        Checkpoints whose training_info lacks the metric (saved with ``keep_top_k=null``) are
        not candidates.
        """
        ranked = self._ranked()
        return ranked[0] if ranked else None

    @staticmethod
    def load_training_info(checkpoint_path: str | Path) -> dict[str, Any]:
        """The ``training_info.json`` of a checkpoint folder."""
        return json.loads((Path(checkpoint_path) / TRAINING_INFO_FILE).read_text())

    def _ranked(self) -> list[Path]:
        """Checkpoints holding ``metric_name``, best first (NaN ranks last)."""
        name, sign = self.cfg.metric_name, 1.0 if self.cfg.higher_is_better else -1.0
        scored = []
        for path in self.checkpoints():
            info = self.load_training_info(path)
            if name in info:
                value = float(info[name])
                score = -math.inf if math.isnan(value) else sign * value
                scored.append((score, int(info["step"]), path))
        scored.sort(key=lambda item: (item[0], item[1]), reverse=True)
        return [path for _, _, path in scored]

    def _prune(self) -> None:
        if self.cfg.keep_top_k is None:
            return
        keep = set(self._ranked()[: self.cfg.keep_top_k])
        latest = self.get_latest_checkpoint_path()
        keep.add(latest)
        for path in self.checkpoints():
            if path not in keep:
                shutil.rmtree(path)


def save_rng_state(path: str | Path) -> None:
    """Save the python ``random``, numpy global and torch (CPU, and CUDA if present) RNG states."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    torch.save(state, path)


def load_rng_state(path: str | Path) -> None:
    """Restore the RNG states written by :func:`save_rng_state`."""
    # Our own file, holding python/numpy tuples that the weights-only unpickler refuses.
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
