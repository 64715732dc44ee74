"""Metric logging to the console, a JSONL file, TensorBoard, Weights & Biases and MLflow.

One :class:`Logger` fans every call out to the enabled backends. Metrics are logged as
``{prefix}/{name}`` (``train/reward``, ``validation/accuracy``, ``timing/train/generation``).
The JSONL file ``<log_dir>/metrics.jsonl`` is always written, one line per call::

    {"step": 3, "prefix": "train", "metrics": {"reward": 0.5, "loss": 0.12}}

and :func:`read_metrics_jsonl` reads it back (plots and tests use it). Only scalars are logged
(python/numpy numbers, bools, one-element tensors/arrays); other values are skipped with one
warning per metric name.

The console shows, per :meth:`Logger.log_metrics` call, a compact table on a terminal and one
line (``train step 3: loss=1.880e-09 reward=0.5000``) when written to a file or a pipe; names
and numbers are never cut. With :meth:`Logger.step_progress` a terminal also gets a live
display of the phases a :class:`~nemo_rl.utils.timer.Timer` times during a step.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from nemo_rl.utils.config import ConfigModel
from nemo_rl.utils.timer import PhaseEvent, Timer

METRICS_FILE = "metrics.jsonl"
HYPERPARAMS_FILE = "hyperparams.json"


class WandbConfig(ConfigModel):
    """Weights & Biases run (``logger.wandb``)."""

    project: str = Field(default="nemo-rl", min_length=1, description="W&B project.")
    name: str | None = Field(default=None, description="W&B run name. None: W&B picks one.")
    mode: Literal["online", "offline"] | None = Field(
        default=None,
        description='"offline" writes the run under <log_dir>/wandb without network (upload '
        "later with `wandb sync`). None: the WANDB_MODE environment variable, else online.",
    )


class TensorboardConfig(ConfigModel):
    """TensorBoard event files (``logger.tensorboard``)."""

    log_dir: str | None = Field(
        default=None, description="Folder of the event files. None: <logger.log_dir>/tensorboard."
    )


class MLflowConfig(ConfigModel):
    """MLflow run (``logger.mlflow``)."""

    experiment_name: str = Field(default="nemo-rl", min_length=1, description="MLflow experiment.")
    run_name: str | None = Field(default=None, description="MLflow run name. None: MLflow's.")
    tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI (a server URL, sqlite:///<file> or file:<folder>). "
        "None: a file store in <logger.log_dir>/mlruns (file stores set "
        "MLFLOW_ALLOW_FILE_STORE=true unless it is set).",
    )


class LoggerConfig(ConfigModel):
    """Metric logging (``logger``)."""

    log_dir: str = Field(default="logs", description="Folder for logs and metric files.")
    console_enabled: bool = Field(
        default=True, description="Print a metric table per step and a live phase display."
    )
    tensorboard_enabled: bool = Field(default=False, description="Write TensorBoard events.")
    wandb_enabled: bool = Field(default=False, description="Log to Weights & Biases.")
    mlflow_enabled: bool = Field(default=False, description="Log to MLflow.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="W&B settings.")
    tensorboard: TensorboardConfig = Field(
        default_factory=TensorboardConfig, description="TensorBoard settings."
    )
    mlflow: MLflowConfig = Field(default_factory=MLflowConfig, description="MLflow settings.")


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``: ``[{"step", "prefix", "metrics": {name: value}}]``."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _as_scalar(value: Any) -> float | int | None:
    """``value`` as a python int/float, or None when it is not a single real number.

    Accepts python/numpy numbers and bools (as 0/1) and one-element torch tensors / numpy arrays.
    """
    if hasattr(value, "item") and not isinstance(value, numbers.Number):
        numel = getattr(value, "numel", None)
        size = numel() if callable(numel) else getattr(value, "size", 0)
        if size != 1:
            return None
        value = value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _flatten(params: dict[str, Any], parent: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent}.{key}" if parent else str(key)
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def _format(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isfinite(value) and value != 0 and not 1e-3 <= abs(value) < 1e5:
        return f"{value:.3e}"
    return f"{value:.4f}"


class _TensorboardBackend:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log_metrics(self, metrics: dict[str, float | int], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        table = "\n".join(f"| {k} | {v} |" for k, v in params.items())
        self.writer.add_text("hyperparams", "| key | value |\n|---|---|\n" + table)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandbBackend:
    def __init__(self, cfg: WandbConfig, log_dir: Path) -> None:
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            name=cfg.name,
            dir=str(log_dir),
            mode=cfg.mode,
            reinit="create_new",
            settings=wandb.Settings(console="off", quiet=True),
        )

    def log_metrics(self, metrics: dict[str, float | int], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def close(self) -> None:
        self.run.finish()


class _MLflowBackend:
    # MLflow's log_batch accepts at most this many params per call.
    _PARAMS_PER_BATCH = 100

    def __init__(self, cfg: MLflowConfig, log_dir: Path) -> None:
        from mlflow.tracking import MlflowClient

        uri = cfg.tracking_uri or (log_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless opted in; the database store needs
            # sqlalchemy, which mlflow-skinny lacks.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment_name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(cfg.experiment_name)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=cfg.run_name).info.run_id

    def log_metrics(self, metrics: dict[str, float | int], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(name, float(value), now, step) for name, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(name, str(value)) for name, value in params.items()]
        for start in range(0, len(items), self._PARAMS_PER_BATCH):
            batch = items[start : start + self._PARAMS_PER_BATCH]
            self.client.log_batch(self.run_id, params=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _line(scalars: dict[str, float | int], step: int, prefix: str) -> str:
    """``"{prefix} step {step}: name=value ..."``, names sorted."""
    values = " ".join(f"{name}={_format(value)}" for name, value in sorted(scalars.items()))
    return f"{prefix or 'metrics'} step {step}: {values}"


class Logger:
    """Logs metrics and hyperparameters to every enabled backend (see module docstring).

    Usable as a context manager; :meth:`close` flushes and ends the backends' runs.
    """

    def __init__(self, cfg: LoggerConfig, console: Console | None = None) -> None:
        """Create ``cfg.log_dir`` and start the enabled backends.

        Args:
            console: rich console for the table and progress display. None: a new one (stdout).
        """
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.log_dir / METRICS_FILE
        self._metrics_file = open(self.metrics_path, "a")  # noqa: SIM115 - closed in close()
        self.console = console or Console()
        self._warned: set[str] = set()
        self._backends: list[Any] = []
        if cfg.tensorboard_enabled:
            tb_dir = Path(cfg.tensorboard.log_dir or self.log_dir / "tensorboard")
            self._backends.append(_TensorboardBackend(tb_dir))
        if cfg.wandb_enabled:
            self._backends.append(_WandbBackend(cfg.wandb, self.log_dir))
        if cfg.mlflow_enabled:
            self._backends.append(_MLflowBackend(cfg.mlflow, self.log_dir))
        self._closed = False

    def log_metrics(self, metrics: dict[str, Any], step: int, prefix: str = "") -> None:
        """Log ``metrics`` of ``step`` as ``{prefix}/{name}``; non-scalars are skipped (warned).

        Args:
            metrics: ``{name: scalar}``; names may contain ``/``.
            step: training step (the x axis of every backend).
            prefix: group of the metrics (``"train"``, ``"validation"``, ``"timing/train"``).
        """
        scalars: dict[str, float | int] = {}
        for name, value in metrics.items():
            scalar = _as_scalar(value)
            if scalar is None:
                key = f"{prefix}/{name}" if prefix else name
                if key not in self._warned:
                    self._warned.add(key)
                    warnings.warn(
                        f"metric {key!r} is not a scalar ({type(value).__name__}); it is not "
                        "logged (this warning is shown once per metric)",
                        stacklevel=2,
                    )
                continue
            scalars[name] = scalar
        record = {"step": step, "prefix": prefix, "metrics": scalars}
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()
        named = {(f"{prefix}/{k}" if prefix else k): v for k, v in scalars.items()}
        for backend in self._backends:
            backend.log_metrics(named, step)
        if self.cfg.console_enabled and scalars:
            if self.console.is_terminal:
                self.console.print(self._table(scalars, step, prefix))
            else:  # a log file: one line, never wrapped or cut
                self.console.print(
                    _line(scalars, step, prefix), soft_wrap=True, markup=False, highlight=False
                )

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record a run's (nested) config: flattened to dotted keys, also saved as JSON."""
        flat = _flatten(params)
        (self.log_dir / HYPERPARAMS_FILE).write_text(json.dumps(params, indent=2, default=str))
        for backend in self._backends:
            backend.log_hyperparams(flat)

    @contextmanager
    def step_progress(self, step: int, max_steps: int, timer: Timer) -> Iterator[None]:
        """Show the phases ``timer`` times inside the ``with`` body live on the console.

        Each phase appears as a spinner line while it runs and with its seconds once done.
        Does nothing when the console is disabled.
        """
        if not self.cfg.console_enabled:
            yield
            return
        progress = Progress(
            SpinnerColumn(finished_text="[green]✓"),
            TextColumn("[bold]{task.description}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        tasks: dict[str, TaskID] = {}

        def on_phase(event: PhaseEvent, name: str, seconds: float) -> None:
            label = f"step {step}/{max_steps} {name}"
            if event == "start":
                tasks[name] = progress.add_task(label, total=1)
            elif name in tasks:
                progress.update(tasks[name], completed=1, description=f"{label} ({seconds:.2f} s)")

        timer.add_listener(on_phase)
        try:
            with progress:
                yield
        finally:
            timer.remove_listener(on_phase)

    def _table(self, scalars: dict[str, float | int], step: int, prefix: str) -> Table:
        """Metrics as a compact table of (name, value) pairs, two pairs per row where the
        console is wide enough for the longest ones, else one; cells fold, never cut."""
        title = f"{prefix or 'metrics'} · step {step}"
        table = Table(title=title, title_justify="left", box=None, pad_edge=False)
        widest = max(len(k) + len(_format(v)) for k, v in scalars.items()) + 4
        pairs = 2 if 2 * widest <= self.console.width else 1
        for _ in range(pairs):
            table.add_column(style="cyan", overflow="fold")
            table.add_column(justify="right", overflow="fold")
        items = sorted(scalars.items())
        for start in range(0, len(items), pairs):
            row: list[str] = []
            for name, value in items[start : start + pairs]:
                row += [name, _format(value)]
            table.add_row(*row, *[""] * (2 * pairs - len(row)))
        return table

    def close(self) -> None:
        """Flush and close the JSONL file and every backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for backend in self._backends:
            backend.close()
        self._metrics_file.close()

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
