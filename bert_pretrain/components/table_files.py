"""A labelled task's CSV, TSV and JSON-lines files, read by one set of rules for both commands
that read them: bert-finetune (task=custom, GLUE's TSV files) and bert-prep (corpus=table, their
text columns). One reader, so a file pretrained on reads the same when it is fine-tuned on.

- TSV has no quoting (GLUE's files: a quote character is text). Rows end at '\\n' only and a
  '\\r' at either end of a field is dropped: public copies of SST-2's train.tsv end every sentence
  with '\\r' before the tab, where a universal-newline or csv reader ends the row, so the
  sentence became a short row and the label a row of its own with an empty sentence.
- CSV quotes as spreadsheets write it (a quoted field may hold commas and line breaks).
- A UTF-8 byte order mark is ignored: GLUE's MRPC files and a spreadsheet's "CSV UTF-8" start
  with one, which would otherwise be part of the first column's name.
- JSON lines: one object per line; blank lines are skipped.

What these rules cannot read is a TableFileError, one line naming the file; each command
re-raises it as its own error. Which columns are text or labels is the callers' business.
"""
from __future__ import annotations

import csv
import json
import os
from typing import Iterator, Optional

JSON_LINES = (".jsonl", ".json")
EXTENSIONS = (".csv", ".tsv", *JSON_LINES)


class TableFileError(ValueError):
    """A file that cannot be read as a table; the message is one line naming the file."""


def is_json_lines(path: str) -> bool:
    """True for a .jsonl / .json file, False for .csv / .tsv; another extension is an error."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise TableFileError(f"{path}: unknown format {ext or '(no extension)'}; use .csv, "
                             f".tsv or .jsonl")
    return ext in JSON_LINES


def table_rows(path: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) of each row of a .csv or .tsv file, the header first; blank rows
    are skipped. A missing file raises FileNotFoundError (each command says what to pass)."""
    if os.path.splitext(path)[1].lower() == ".tsv":
        for n, line in enumerate(_lines(path, newline="\n"), 1):
            fields = [field.strip("\r") for field in line.rstrip("\n").split("\t")]
            if fields != [""]:
                yield n, fields
        return
    reader = csv.reader(_lines(path, newline=""))   # newline="": quoted line breaks stay text
    try:
        for row in reader:
            if row:
                yield reader.line_num, row
    except csv.Error as exc:   # e.g. a field over csv's size limit: one line, not a traceback
        raise TableFileError(f"{path} line {reader.line_num}: not readable as CSV ({exc})") \
            from None


def json_records(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSON-lines file."""
    for n, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise TableFileError(f"{path} line {n} is not a JSON object ({exc}); write one "
                                 f"object per line") from None
        if not isinstance(record, dict):
            raise TableFileError(f"{path} line {n} is not a JSON object")
        yield n, record


def _lines(path: str, newline: Optional[str] = None) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8-sig", newline=newline) as f:
            yield from f
    except UnicodeDecodeError as exc:
        raise TableFileError(f"{path}: not UTF-8 text ({exc.reason}): convert it to UTF-8") \
            from None
