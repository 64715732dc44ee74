"""Logger: JSONL, console, TensorBoard readback, wandb offline run file, MLflow file store; plot."""

import io
import json
import struct
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from nemo_rl.utils.logger import Logger, LoggerConfig, read_metrics_jsonl
from nemo_rl.utils.plot import metric_curve, plot_training_curves
from nemo_rl.utils.timer import Timer


def _console():
    return Console(file=io.StringIO(), width=100, force_terminal=False)


def test_jsonl_console_and_nonscalar_warning_once(tmp_path):
    console = _console()
    cfg = LoggerConfig(log_dir=str(tmp_path))
    with Logger(cfg, console=console) as logger:
        with pytest.warns(UserWarning, match="'train/hist' is not a scalar"):
            logger.log_metrics(
                {
                    "reward": 0.5,
                    "n": np.int64(3),
                    "t": torch.tensor(2.5),
                    "ok": True,
                    "hist": [1, 2],
                },
                step=1,
                prefix="train",
            )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            logger.log_metrics({"reward": 0.75, "hist": torch.ones(3)}, step=2, prefix="train")
    records = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    assert records == [
        {"step": 1, "prefix": "train", "metrics": {"reward": 0.5, "n": 3, "t": 2.5, "ok": 1}},
        {"step": 2, "prefix": "train", "metrics": {"reward": 0.75}},
    ]
    out = console.file.getvalue()
    # not a terminal: one line per call
    assert "train step 2: reward=0.7500\n" in out


def test_console_never_cuts_a_name_or_a_number(tmp_path):
    """A log file gets one complete line per call; a narrow terminal folds cells instead of
    ending them with an ellipsis."""
    metrics = {
        "rollout/total_generated_tokens": 965.0,
        "loss": 1.88e-09,
        "rollout/mean_generated_tokens_per_sample": 7.5391,
        "token_mult_prob_error": 1.000012,
    }
    to_file = _console()
    with Logger(LoggerConfig(log_dir=str(tmp_path / "a")), console=to_file) as logger:
        logger.log_metrics(metrics, step=4, prefix="train")
    lines = to_file.file.getvalue().splitlines()
    assert lines == [
        "train step 4: loss=1.880e-09 rollout/mean_generated_tokens_per_sample=7.5391 "
        "rollout/total_generated_tokens=965.0000 token_mult_prob_error=1.0000"
    ]
    for width in (60, 30):  # one pair per row; then too narrow even for that: cells fold
        terminal = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
        with Logger(LoggerConfig(log_dir=str(tmp_path / f"b{width}")), console=terminal) as logger:
            logger.log_metrics(metrics, step=4, prefix="train")
        out = terminal.file.getvalue()
        assert "…" not in out and "1.880e-09" in out
        if width == 60:
            assert all(name in out for name in metrics)


def test_step_progress_shows_phases(tmp_path):
    console = _console()
    timer = Timer()
    with Logger(LoggerConfig(log_dir=str(tmp_path)), console=console) as logger:
        with logger.step_progress(3, 10, timer):
            with timer.time("generation"):
                pass
            with timer.time("policy_training"):
                pass
        with timer.time("after"):  # listener removed after the with
            pass
    out = console.file.getvalue()
    assert "step 3/10 generation" in out and "step 3/10 policy_training" in out
    assert "after" not in out


def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggerConfig(log_dir=str(tmp_path), console_enabled=False, tensorboard_enabled=True)
    with Logger(cfg) as logger:
        logger.log_hyperparams({"grpo": {"seed": 7}})
        for step, value in [(1, 0.25), (2, 0.5)]:
            logger.log_metrics({"reward": value}, step=step, prefix="train")
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("train/reward")
    assert [(e.step, e.value) for e in events] == [(1, 0.25), (2, 0.5)]


def _wandb_records(run_file: Path):
    """Protobuf records of a .wandb file (LevelDB log format after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def test_wandb_offline_run_holds_logged_values(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggerConfig(log_dir=str(tmp_path), console_enabled=False, wandb_enabled=True)
    cfg.wandb.mode = "offline"
    cfg.wandb.name = "unit"
    with Logger(cfg) as logger:
        logger.log_hyperparams({"grpo": {"seed": 7}})
        logger.log_metrics({"reward": 0.25}, step=1, prefix="train")
        logger.log_metrics({"reward": 0.5}, step=2, prefix="train")
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's writer process may still be flushing the file after finish() returns (seen
    # once under heavy load): read until both steps are there, for at most 60 s.
    deadline = time.monotonic() + 60
    while True:
        history, config = [], {}
        for record in _wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                if "train/reward" in items:
                    history.append((items["_step"], items["train/reward"]))
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        if len(history) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert history == [(1, 0.25), (2, 0.5)]
    assert config["grpo.seed"] == 7


def test_mlflow_file_store_holds_values(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # restored after the test

    cfg = LoggerConfig(log_dir=str(tmp_path), console_enabled=False, mlflow_enabled=True)
    cfg.mlflow.experiment_name = "unit"
    with Logger(cfg) as logger:
        logger.log_hyperparams({"policy": {"lr": 1e-5}, "tag": "x"})
        logger.log_metrics({"accuracy": 0.5}, step=0, prefix="validation")
        logger.log_metrics({"accuracy": 0.75}, step=4, prefix="validation")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("unit")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params == {"policy.lr": "1e-05", "tag": "x"}
    history = client.get_metric_history(run.info.run_id, "validation/accuracy")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.5), (4, 0.75)]


def test_plot_writes_png_from_jsonl(tmp_path):
    with Logger(LoggerConfig(log_dir=str(tmp_path), console_enabled=False)) as logger:
        for step in range(1, 6):
            logger.log_metrics({"reward": step / 10}, step=step, prefix="train")
            if step % 2 == 0:
                logger.log_metrics({"accuracy": step / 5}, step=step, prefix="validation")
    metrics = tmp_path / "metrics.jsonl"
    assert metric_curve(metrics, "validation", "accuracy") == ([2, 4], [0.4, 0.8])
    png = plot_training_curves(metrics, tmp_path / "plots" / "curves.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_without_curves_is_an_error(tmp_path):
    with Logger(LoggerConfig(log_dir=str(tmp_path), console_enabled=False)) as logger:
        logger.log_metrics({"loss": 1.0}, step=1, prefix="train")
    with pytest.raises(ValueError, match="holds none of the metrics"):
        plot_training_curves(tmp_path / "metrics.jsonl", tmp_path / "c.png")
