"""Checkpoint folders with atomic finalisation and top-k retention, plus RNG state helpers.

Layout under ``checkpointing.checkpoint_dir``::

    step_<n>/                    a finished checkpoint of training step n
        training_info.json       {"step": n, <metric name>: value, ...}
        policy/                  the caller's model/optimizer/scheduler (POLICY_DIR)
        train_dataloader.pt      the caller's dataloader state_dict (DATALOADER_STATE_FILE)
        rng_state.pt             python/numpy/torch RNG states (RNG_STATE_FILE, save_rng_state)
        manifest.json            every other file's size and checksum, written last
    tmp_step_<n>/                a checkpoint being written; never read, removed on restart
    old_step_<n>/                step n's previous checkpoint while step n is re-saved
    damaged_step_<n>/            a checkpoint that failed verification, moved aside (kept)

Saving is: ``path = manager.init_tmp_checkpoint(step, info)``, the caller writes its state into
``path``, then ``manager.finalize_checkpoint(path)`` seals it (every file and folder fsynced,
then ``manifest.json``; see :mod:`nemo_rl.utils.checkpoint_manifest`), renames it to
``step_<n>`` (one rename, so a crash leaves either the old or the new checkpoint, never a
half-written ``step_<n>``), fsyncs the checkpoint folder so the rename survives a machine crash,
and deletes the checkpoints outside the top ``keep_top_k`` by ``metric_name``; the latest one is
always kept so a run can resume.

Resuming is ``manager.resume_checkpoint()``: ``checkpointing.resume_from`` if set (refused when
damaged), else the newest ``step_<n>`` that matches its manifest (``verify_on_resume``); each
newer damaged one (or one without a manifest) costs one warning line and is moved aside.
``manager.start_resume_check()`` runs that check in the background while the run sets up.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator

from nemo_rl.utils.checkpoint_manifest import VerifyMode, fsync_path, seal_folder, verify_folder
from nemo_rl.utils.config import ConfigModel
from nemo_rl.utils.errors import InputError

logger = logging.getLogger(__name__)

TRAINING_INFO_FILE = "training_info.json"
POLICY_DIR = "policy"
DATALOADER_STATE_FILE = "train_dataloader.pt"
RNG_STATE_FILE = "rng_state.pt"

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = "tmp_step_"
_OLD_PREFIX = "old_"
_DAMAGED_PREFIX = "damaged_"
_SAVE_BY = re.compile(r"^(\d+):(\d{2}):(\d{2}):(\d{2})$")
# Signals a run cannot catch: naming them in stop_signals would do nothing.
_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}


class CheckpointError(InputError, RuntimeError):
    """A checkpoint the run must load (named by ``checkpointing.resume_from``, or the SFT warm
    start's folder) is missing or damaged."""


def parse_save_by(text: str) -> int:
    """Seconds in a ``"DD:HH:MM:SS"`` duration (days, hours < 24, minutes < 60, seconds < 60).

    Raises:
        ValueError: ``text`` is not in that format.
    """
    match = _SAVE_BY.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not DD:HH:MM:SS (e.g. '00:03:35:00')")
    days, hours, minutes, seconds = (int(g) for g in match.groups())
    if hours >= 24 or minutes >= 60 or seconds >= 60:
        raise ValueError(f"{text!r}: hours must be < 24, minutes and seconds < 60")
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


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
    verify_on_resume: VerifyMode = Field(
        default="checksums",
        description="How a checkpoint is checked against its manifest before it is loaded: "
        "'checksums' re-reads and hashes every file (catches any damage), 'sizes' compares "
        "file sizes only (catches truncation, costs no read).",
    )
    resume_from: int | str | None = Field(
        default=None,
        description="Resume from this checkpoint instead of the newest intact one: a step "
        "number (step_<n> under checkpoint_dir) or a checkpoint folder. A damaged or missing "
        "one stops the run with a message. None: the newest intact checkpoint, if any.",
    )
    checkpoint_must_save_by: str | None = Field(
        default=None,
        description="Wall time 'DD:HH:MM:SS' after the training loop starts by which the last "
        "checkpoint must be saved (e.g. '00:03:35:00' in a 4-hour job). After each step the "
        "loop estimates whether one more step and a save still fit (the longest step and save "
        "so far); if not, it saves and stops with exit code 75 (resumable). None: no limit.",
    )
    stop_signals: list[str] = Field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1"],
        description="Signals that make the driver finish the current step, save it and stop "
        "(exit code 75); the same signal again stops at once without saving. SIGUSR1 is what "
        "`nemo-rl launch slurm --stop-signal-lead-s N` (sbatch --signal=B:USR1@N) sends ahead "
        "of the time limit (docs/cluster.md).",
    )

    @field_validator("resume_from")
    @classmethod
    def _check_resume_from(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"resume_from={value}: a step number must be >= 0")
        if isinstance(value, str) and not value:
            raise ValueError("resume_from is empty: give a step number or a checkpoint folder")
        return value

    @field_validator("checkpoint_must_save_by")
    @classmethod
    def _check_save_by(cls, value: str | None) -> str | None:
        if value is not None and parse_save_by(value) <= 0:
            raise ValueError(f"checkpoint_must_save_by={value!r} must be more than zero")
        return value

    @field_validator("stop_signals")
    @classmethod
    def _check_signals(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in signal.Signals.__members__ or name in _UNCATCHABLE:
                raise ValueError(
                    f"stop_signals: {name!r} is not a signal a process can catch; use names "
                    "such as SIGTERM, SIGUSR1, SIGUSR2, SIGINT"
                )
        return value

    @model_validator(mode="after")
    def _check_needs_enabled(self) -> CheckpointingConfig:
        for name in ("resume_from", "checkpoint_must_save_by"):
            if getattr(self, name) is not None and not self.enabled:
                raise ValueError(
                    f"checkpointing.{name} is set but checkpointing.enabled is false; enable "
                    f"checkpointing or unset {name}"
                )
        return self

    def must_save_by_seconds(self) -> int | None:
        """``checkpoint_must_save_by`` in seconds (None when unset)."""
        if self.checkpoint_must_save_by is None:
            return None
        return parse_save_by(self.checkpoint_must_save_by)


class CheckpointManager:
    """Creates, finalises, prunes and finds the checkpoints of one run (see module docstring)."""

    def __init__(self, cfg: CheckpointingConfig) -> None:
        """Open ``cfg.checkpoint_dir`` (created if missing) and clean up after a crash.

        Unfinished ``tmp_step_*`` folders are deleted; an ``old_step_<n>`` left by a crash in
        the middle of re-saving step n is restored when ``step_<n>`` is missing, else deleted.
        """
        self.cfg = cfg
        self._pending_resume: Future[Path | None] | None = None
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
        """Seal ``tmp_step_<n>`` (fsync, manifest), rename it to ``step_<n>`` (replacing an older
        ``step_<n>``), fsync the checkpoint folder, then prune.

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
        seal_folder(tmp_path)
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
        fsync_path(self.checkpoint_dir)
        self._prune()
        return final

    def start_resume_check(self) -> None:
        """Start :meth:`resume_checkpoint`'s verification in a background thread, so that it
        overlaps the rest of a run's set-up (Ray, workers, engines; hashing releases the GIL);
        :meth:`resume_checkpoint` then waits for it."""
        if self._pending_resume is None:
            executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-verify")
            self._pending_resume = executor.submit(self._find_resume_checkpoint)
            executor.shutdown(wait=False)  # the submitted check still runs to its end

    def resume_checkpoint(self) -> Path | None:
        """The checkpoint to resume from (see the module docstring), verified; None for none.
        Waits for the check :meth:`start_resume_check` started, if any.

        Raises:
            CheckpointError: ``resume_from`` names a missing or damaged checkpoint.
        """
        if self._pending_resume is not None:
            pending, self._pending_resume = self._pending_resume, None
            return pending.result()
        return self._find_resume_checkpoint()

    def _find_resume_checkpoint(self) -> Path | None:
        mode = self.cfg.verify_on_resume
        if self.cfg.resume_from is not None:
            path = self._resume_from_path()
            problem = verify_folder(path, mode)
            if problem is not None:
                raise CheckpointError(
                    f"checkpointing.resume_from={self.cfg.resume_from!r}: {path} is damaged: "
                    f"{problem}; name another checkpoint, or unset resume_from to resume from "
                    "the newest intact one"
                )
            return path
        for path in reversed(self.checkpoints()):
            problem = verify_folder(path, mode)
            if problem is None:
                return path
            aside = self._move_aside(path)
            logger.warning(
                "checkpoint %s is damaged: %s; moved to %s, trying the previous one",
                path, problem, aside.name,
            )
        return None

    def _resume_from_path(self) -> Path:
        """The folder ``resume_from`` names (a step under checkpoint_dir, or a path)."""
        target = self.cfg.resume_from
        path = (
            self.checkpoint_dir / f"step_{target}" if isinstance(target, int) else Path(target)
        )
        if not path.is_dir():
            steps = [p.name for p in self.checkpoints()]
            raise CheckpointError(
                f"checkpointing.resume_from={target!r}: {path} does not exist (checkpoints in "
                f"{self.checkpoint_dir}: {steps or 'none'})"
            )
        return path

    def _move_aside(self, path: Path) -> Path:
        """Rename a damaged checkpoint to ``damaged_<name>`` (``.1``, ``.2``... if taken)."""
        aside = path.with_name(_DAMAGED_PREFIX + path.name)
        n = 0
        while aside.exists():
            n += 1
            aside = path.with_name(f"{_DAMAGED_PREFIX}{path.name}.{n}")
        os.replace(path, aside)
        return aside

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
