"""The text of a labelled task's own files, for pretraining on it (task-adaptive pretraining,
Gururangan et al. 2020): CSV, TSV and JSON-lines files as `bert-finetune task=custom` reads them,
or a GLUE task's folder.

Only the columns named as text are read (`corpus.text_columns`, or GLUE's text columns found by
the header): a label column never reaches the tokenizer or the instances.  Each row is one
document and each of its text cells one sentence (a cell with line breaks: one per line), so the
rows of a single-sentence task stay whole and apart.

The formats follow bert-finetune's readers (bert_pretrain/finetune/reading.py), which data_prep
may not import (docs/architecture.md): TSV without quoting (GLUE's files), rows ending at '\\n'
only with a '\\r' at a field's ends dropped (public copies of SST-2's train.tsv end every
sentence with one), CSV with quoting, a byte order mark ignored.
"""
from __future__ import annotations

import csv
import json
import os
from typing import Iterator, Optional

from data_prep.config import TableCorpusConfig
from data_prep.errors import PrepError

# GLUE's text columns by their header names, the longer sets first (a pair task's header also
# holds `sentence1`'s parse columns, which are not text to learn from).
GLUE_TEXT_COLUMNS = (("question1", "question2"), ("#1 String", "#2 String"),
                     ("sentence1", "sentence2"), ("premise", "hypothesis"),
                     ("question", "sentence"), ("sentence",))
FORMATS = (".csv", ".tsv", ".jsonl", ".json")


def table_files(paths: list[str], exclude: Optional[str] = None) -> list[str]:
    """The files to read: a directory is a GLUE task folder and gives its train.tsv only (its
    dev.tsv is what a fine-tune is scored on; name it to include its text)."""
    from data_prep.corpus import resolve_paths
    files = []
    for pattern in paths:
        path = os.path.expanduser(pattern)
        if os.path.isdir(path):
            train = os.path.join(path, "train.tsv")
            if not os.path.isfile(train):
                raise PrepError(f"corpus.paths: {pattern!r} is a folder without train.tsv: "
                                f"pass a GLUE task's folder or name the files")
            files.append(train)
        else:
            files.extend(resolve_paths([pattern], exclude))
    for f in files:
        if os.path.splitext(f)[1].lower() not in FORMATS:
            raise PrepError(f"corpus.paths: {f}: unknown format; corpus=table reads .csv, .tsv "
                            f"and .jsonl files (text files: corpus=text)")
    return files


def _tsv_line(line: str) -> str:
    return "\t".join(field.strip("\r") for field in line.rstrip("\n").split("\t"))


def _rows(path: str) -> Iterator[tuple[int, list]]:
    """(line number, header or row) of a CSV / TSV file; the header comes first."""
    ext = os.path.splitext(path)[1].lower()
    with open(path, encoding="utf-8-sig", newline="\n" if ext == ".tsv" else "") as f:
        if ext == ".tsv":
            reader = csv.reader((_tsv_line(line) for line in f), delimiter="\t",
                                quoting=csv.QUOTE_NONE)
        else:
            reader = csv.reader(f)
        for row in reader:
            yield reader.line_num, row


def _columns(path: str, header: list, wanted: Optional[list]) -> list[int]:
    if wanted is None:
        for names in GLUE_TEXT_COLUMNS:
            if all(n in header for n in names):
                return [header.index(n) for n in names]
        raise PrepError(f"{path}: which columns are text? name them: "
                        f"corpus.text_columns='[{header[0] if header else 'text'}]' (the file's "
                        f"columns: {header})")
    missing = [c for c in wanted if c not in header]
    if missing:
        raise PrepError(f"{path} has no column {missing[0]!r} (it has {header}); fix "
                        f"corpus.text_columns")
    return [header.index(c) for c in wanted]


def _cells_of_table(path: str, wanted: Optional[list]) -> Iterator[list[str]]:
    rows = _rows(path)
    first = next(rows, None)
    if first is None:
        raise PrepError(f"{path} is empty: a table needs a header line naming its columns")
    columns = _columns(path, first[1], wanted)
    for _, row in rows:
        if row:
            yield [row[c] if c < len(row) else "" for c in columns]


def _cells_of_jsonl(path: str, wanted: Optional[list]) -> Iterator[list[str]]:
    if wanted is None:
        raise PrepError(f"{path}: name the fields that hold text: corpus.text_columns='[text]'")
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise PrepError(f"{path} line {n} is not a JSON object ({exc}); write one "
                                f"object per line") from None
            if not isinstance(record, dict):
                raise PrepError(f"{path} line {n} is not a JSON object")
            missing = [c for c in wanted if c not in record]
            if missing:
                raise PrepError(f"{path} line {n} has no field {missing[0]!r} (it has "
                                f"{sorted(record)}); fix corpus.text_columns")
            yield ["" if record[c] is None else str(record[c]) for c in wanted]


def read_table(cfg: TableCorpusConfig, exclude: Optional[str] = None):
    """(starts_document, sentence): a row's text cells, one document per row."""
    for path in table_files(cfg.paths, exclude):
        ext = os.path.splitext(path)[1].lower()
        cells = _cells_of_jsonl if ext in (".jsonl", ".json") else _cells_of_table
        try:
            for row in cells(path, cfg.text_columns):
                new_doc = True
                for cell in row:
                    for line in cell.splitlines():
                        if line.strip():
                            yield new_doc, line.strip()
                            new_doc = False
        except UnicodeDecodeError as exc:
            raise PrepError(f"{path}: not UTF-8 text ({exc.reason}): convert it to UTF-8") \
                from None
