"""Ranks laid out over named parallelism axes.

A :class:`NamedSharding` is an integer array of global ranks whose dimensions are named axes.
With axes ``("pp", "dp", "cp", "tp")`` and shape ``(PP, DP, CP, TP)`` filled by
``np.arange(world_size)``, ``tp`` varies fastest, so consecutive ranks form a TP group
(Megatron-Core's order). The class answers the questions a worker group asks of that layout:
which ranks hold given coordinates, where a rank sits, and which ranks communicate along an axis.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

_AXIS_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class NamedSharding:
    """Global ranks arranged in an array with one named dimension per parallelism axis.

    Args:
        layout: integer array of shape ``[size(names[0]), size(names[1]), ...]`` holding every
            rank ``0 .. world_size-1`` exactly once.
        names: one axis name per dimension of ``layout`` (lowercase identifiers, unique).

    Raises:
        TypeError: ``layout`` is not an integer array.
        ValueError: the names do not match the dimensions, repeat, are not lowercase
            identifiers, or the layout is not a permutation of ``0 .. world_size-1``.
    """

    def __init__(self, layout: np.ndarray | Sequence, names: Sequence[str]) -> None:
        array = np.asarray(layout)
        if array.size and not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"layout must hold integer ranks, got dtype {array.dtype}")
        names = list(names)
        if array.ndim != len(names):
            raise ValueError(
                f"layout has {array.ndim} dimensions {array.shape} but names has {len(names)} "
                f"entries {names}; give one axis name per layout dimension"
            )
        for name in names:
            if not isinstance(name, str) or not _AXIS_NAME.match(name):
                raise ValueError(
                    f"axis name {name!r} is invalid; use a lowercase identifier such as 'dp'"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"axis names {names} repeat; each axis needs a unique name")
        for name, size in zip(names, array.shape):
            if size < 1:
                raise ValueError(f"axis '{name}' has size {size}; every axis needs size >= 1")
        if not np.array_equal(np.sort(array, axis=None), np.arange(array.size)):
            raise ValueError(
                f"layout must contain every rank 0..{array.size - 1} exactly once, got "
                f"{array.ravel().tolist()}"
            )
        self._layout = array.astype(np.int64)
        self._layout.setflags(write=False)
        self._names = names
        # coords[rank] = position of that rank in the layout, one entry per axis.
        self._coords = np.empty((array.size, array.ndim), dtype=np.int64)
        for position in np.ndindex(*array.shape):
            self._coords[self._layout[position]] = position

    @classmethod
    def from_axis_sizes(cls, axis_sizes: Mapping[str, int]) -> NamedSharding:
        """Ranks ``0 .. prod(sizes)-1`` in row-major order over ``axis_sizes`` (last axis fastest).

        Raises:
            ValueError: a size is not a positive int (the message names the axis).
        """
        for name, size in axis_sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"axis '{name}' has size {size!r}; sizes must be positive ints")
        shape = tuple(axis_sizes.values())
        return cls(np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape), list(axis_sizes))

    @property
    def names(self) -> list[str]:
        """Axis names, outermost first."""
        return list(self._names)

    @property
    def layout(self) -> np.ndarray:
        """The (read-only) rank array, one dimension per axis."""
        return self._layout

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in axis order."""
        return dict(zip(self._names, self._layout.shape))

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return int(self._layout.size)

    def get_axis_size(self, name: str) -> int:
        """Size of axis ``name``."""
        return int(self._layout.shape[self._axis_index(name)])

    def get_rank_coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on every axis, e.g. ``{"dp": 1, "tp": 0}``.

        Raises:
            ValueError: ``rank`` is outside ``[0, world_size)``.
        """
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return {name: int(c) for name, c in zip(self._names, self._coords[rank])}

    def get_ranks(self, **coords: int) -> list[int]:
        """Ranks whose coordinates equal the given ones, e.g. ``get_ranks(dp=1)``.

        Axes not named are free; the result lists ranks in layout (row-major) order over them.

        Raises:
            ValueError: an axis is unknown or a coordinate is outside ``[0, size)``.
        """
        index: list[int | slice] = [slice(None)] * len(self._names)
        for name, value in coords.items():
            axis = self._axis_index(name)
            size = self._layout.shape[axis]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"coordinate {name}={value!r} must be an int")
            if not 0 <= value < size:
                raise ValueError(
                    f"coordinate {name}={value} is outside [0, {size}) of axis '{name}'"
                )
            index[axis] = int(value)
        return [int(r) for r in np.ravel(self._layout[tuple(index)])]

    def get_ranks_by_axis(self, name: str) -> list[list[int]]:
        """The communication groups along axis ``name``.

        Each group holds the ranks that share every coordinate except ``name``, ordered by their
        ``name`` coordinate; groups are listed in row-major order of the other axes. E.g. for
        axes (dp=2, tp=2): ``get_ranks_by_axis("tp") == [[0, 1], [2, 3]]`` (TP groups) and
        ``get_ranks_by_axis("dp") == [[0, 2], [1, 3]]`` (DP groups).
        """
        axis = self._axis_index(name)
        moved = np.moveaxis(self._layout, axis, -1)
        return moved.reshape(-1, self._layout.shape[axis]).tolist()

    def _axis_index(self, name: str) -> int:
        if name not in self._names:
            raise ValueError(f"axis '{name}' is unknown; this sharding has axes {self._names}")
        return self._names.index(name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NamedSharding):
            return NotImplemented
        return self._names == other._names and np.array_equal(self._layout, other._layout)

    def __hash__(self) -> int:
        return hash((tuple(self._names), self._layout.tobytes(), self._layout.shape))

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in self.shape.items())
        return f"NamedSharding({axes})"
