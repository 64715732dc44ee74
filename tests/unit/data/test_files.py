"""Own data files: JSONL/JSON/Parquet rows, and errors that name the file, the line or row and
the field."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nemo_rl.data.files import DataError, check_data_file, read_data_file

ROWS = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]


def test_each_format_gives_the_rows(tmp_path: Path) -> None:
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    as_json = tmp_path / "r.json"
    as_json.write_text(json.dumps(ROWS))
    parquet = tmp_path / "r.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    for path in (jsonl, as_json, parquet):
        assert read_data_file(path) == ROWS


def test_malformed_jsonl_line_is_named_file_colon_line(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n{\"prompt\": \"c\",\n")
    with pytest.raises(DataError) as info:
        read_data_file(path)
    assert str(info.value).startswith(f"{path}:3: not valid JSON: ")
    path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(DataError, match=":2: each row must be a JSON object"):
        read_data_file(path)


ROW_81 = '{"instruction": "Write a long number after 1.", "allowed": "0123456789", "n": 1,}'


@pytest.mark.parametrize(
    ("line", "column", "what"),
    [
        # the row cut short (its closing brace lost): the fault is past the last character
        (ROW_81[:-2], "column 80, the end of the line", "Expecting ',' delimiter"),
        (ROW_81[:-3], "column 79, the end of the line", "Expecting value"),
        (ROW_81, "column 81)", "Expecting property name"),  # the '}' after a comma
    ],
)
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_malformed_jsonl_line_names_the_column_of_the_fault(
    tmp_path: Path, line: str, column: str, what: str, newline: str
) -> None:
    """The column is the fault's on the line as an editor shows it (1-based), also when the
    line ends before the JSON does (json counted the line's own newline as a second line and
    said "column 1")."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes((json.dumps(ROWS[0]) + newline + line + newline).encode())
    with pytest.raises(DataError) as info:
        read_data_file(path)
    assert str(info.value).startswith(f"{path}:2: not valid JSON: {what}")
    assert f"({column}" in str(info.value), str(info.value)


def test_json_must_be_an_array_of_objects(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text('{"prompt": "a"}')
    with pytest.raises(DataError, match="must hold an array of row objects, got a dict"):
        read_data_file(path)
    path.write_text('[{"prompt": "a"},\n {"prompt": }]')
    with pytest.raises(DataError, match=f"{path}:2: not valid JSON"):
        read_data_file(path)


def test_check_data_file_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.train_path: file 'nope.jsonl' does not exist "
                                         "\\(relative to the working directory"):
        check_data_file("nope.jsonl", "data.train_path")
    csv = tmp_path / "rows.csv"
    csv.write_text("a\n")
    with pytest.raises(ValueError, match="data.val_path: unsupported data file suffix '.csv'"):
        check_data_file(str(csv), "data.val_path")
