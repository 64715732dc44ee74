"""Reward / accuracy curves of a run as a PNG, read from the logger's ``metrics.jsonl``."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from nemo_rl.utils.logger import read_metrics_jsonl


def metric_curve(metrics_path: str | Path, prefix: str, name: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of metric ``prefix/name`` in a ``metrics.jsonl``, in logged order."""
    steps, values = [], []
    for record in read_metrics_jsonl(metrics_path):
        if record["prefix"] == prefix and name in record["metrics"]:
            steps.append(int(record["step"]))
            values.append(float(record["metrics"][name]))
    return steps, values


def plot_training_curves(
    metrics_path: str | Path,
    output_path: str | Path,
    reward: tuple[str, str] = ("train", "reward"),
    accuracy: tuple[str, str] = ("validation", "accuracy"),
) -> Path:
    """Write a PNG of two metric curves against the step (by default the train reward and the
    validation accuracy), titled by their ``prefix/name``.

    Args:
        metrics_path: the ``metrics.jsonl`` written by :class:`nemo_rl.utils.logger.Logger`.
        output_path: the PNG to write (its folder is created).
        reward, accuracy: ``(prefix, name)`` of the two curves.

    Raises:
        ValueError: the file holds neither curve.
    """
    curves = {
        f"{prefix}/{name}": metric_curve(metrics_path, prefix, name)
        for prefix, name in (reward, accuracy)
    }
    if not any(steps for steps, _ in curves.values()):
        raise ValueError(
            f"{metrics_path} holds none of the metrics {sorted(curves)}; nothing to plot"
        )
    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for (label, (steps, values)), marker in zip(curves.items(), ("o", "s"), strict=True):
        if steps:
            axes.plot(steps, values, marker=marker, markersize=3, label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("value")
    axes.set_title(" and ".join(curves))
    axes.grid(alpha=0.3)
    axes.legend()
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output_path, format="png")
    return output_path
