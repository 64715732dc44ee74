"""Reading local data files (JSONL, JSON, Parquet) into row dicts, with errors that say where.

A bad line is reported as ``file:line`` (lines counted from 1, as editors do) with the parse
error; every problem is a :class:`DataError`, a :class:`~nemo_rl.utils.config.ConfigError`, so
the ``nemo-rl`` command reports it in one line and exits 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from nemo_rl.utils.config import ConfigError


class DataError(ConfigError):
    """Data that cannot be used as configured; the message names the file, row and field."""


def _check_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(
            f"{where}: each row must be a JSON object ({{\"prompt\": ...}}), got a "
            f"{type(value).__name__}"
        )
    return value


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One JSON object per line; blank lines are skipped.

    Raises:
        DataError: ``path:line`` of the first line that is not a JSON object, with the
            parse error and its column (1-based, as editors count).
    """
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            # Without its newline: json would count a fault past the line's end as "line 2,
            # column 1" of the text.
            text = line.rstrip("\r\n")
            try:
                value = json.loads(text)
            except json.JSONDecodeError as err:
                end = ", the end of the line" if err.pos >= len(text) else ""
                raise DataError(
                    f"{path}:{lineno}: not valid JSON: {err.msg} (column {err.pos + 1}{end}); "
                    "fix or remove the line"
                ) from None
            rows.append(_check_object(value, f"{path}:{lineno}"))
    return rows


def read_json(path: Path) -> list[dict[str, Any]]:
    """A JSON array of objects.

    Raises:
        DataError: ``path:line`` of a parse error, or a top level that is not an array of
            objects.
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(value, list):
        raise DataError(
            f"{path}: a .json data file must hold an array of row objects, got a "
            f"{type(value).__name__} (use .jsonl for one object per line)"
        )
    return [_check_object(row, f"{path}: row {i}") for i, row in enumerate(value)]


def read_parquet(path: Path) -> list[dict[str, Any]]:
    """The rows of a Parquet file.

    Raises:
        DataError: the file is not readable Parquet.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable Parquet file: {err}") from None


# File suffix -> its reader.
FILE_READERS: dict[str, Callable[[Path], list[dict[str, Any]]]] = {
    ".jsonl": read_jsonl,
    ".json": read_json,
    ".parquet": read_parquet,
}


def check_data_file(path: str, field: str) -> None:
    """Raise ValueError (naming ``field``) unless ``path`` is an existing file of a supported
    suffix; the config models call it so a wrong path fails before anything starts."""
    file = Path(path)
    if not file.is_file():
        where = "" if file.is_absolute() else f" (relative to the working directory {Path.cwd()})"
        raise ValueError(f"{field}: file {path!r} does not exist{where}; fix the path")
    if file.suffix.lower() not in FILE_READERS:
        raise ValueError(
            f"{field}: unsupported data file suffix {file.suffix!r} of {path!r}; use one of "
            f"{sorted(FILE_READERS)}"
        )


def read_data_file(path: Path) -> list[dict[str, Any]]:
    """Rows of a local ``.jsonl``/``.json``/``.parquet`` file.

    Raises:
        DataError: an unsupported suffix, or a file that does not parse (naming file:line).
    """
    reader = FILE_READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(
            f"{path}: unsupported data file suffix {path.suffix!r}; use one of "
            f"{sorted(FILE_READERS)}"
        )
    return reader(path)
