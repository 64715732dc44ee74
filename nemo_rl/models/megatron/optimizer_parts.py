"""The torch-optimizer holders inside a megatron-core optimizer."""

from __future__ import annotations

from typing import Any


def optimizer_parts(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside ``optimizer``: the parts of a chained one (expert
    parallelism splits dense and expert parameters), else ``optimizer`` itself. Each holds its
    torch optimizer as ``.optimizer``."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))
