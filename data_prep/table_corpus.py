"""The text of a labelled task's own files, for pretraining on it (task-adaptive pretraining,
Gururangan et al. 2020): CSV, TSV and JSON-lines files as `bert-finetune task=custom` reads them,
or a GLUE task's folder.

Only the columns named as text are read (`corpus.text_columns`, or GLUE's text columns found by
the header): a label column never reaches the tokenizer or the instances.  Each row is one
document and each of its text cells one sentence (a cell with line breaks: one per line), so the
rows of a single-sentence task stay whole and apart.

The files are read by the rules bert-finetune reads them by (TSV without quoting, CSV with it,
a byte order mark ignored): one reader, bert_pretrain/components/table_files.py, holds them.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional

from bert_pretrain.components.table_files import (EXTENSIONS, TableFileError,
                                                  is_json_lines, json_records, table_rows)
from data_prep.config import TableCorpusConfig
from data_prep.errors import PrepError

# GLUE's text columns by their header names, the longer sets first (a pair task's header also
# holds `sentence1`'s parse columns, which are not text to learn from).
GLUE_TEXT_COLUMNS = (("question1", "question2"), ("#1 String", "#2 String"),
                     ("sentence1", "sentence2"), ("premise", "hypothesis"),
                     ("question", "sentence"), ("sentence",))


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
        if os.path.splitext(f)[1].lower() not in EXTENSIONS:
            raise PrepError(f"corpus.paths: {f}: unknown format; corpus=table reads .csv, .tsv "
                            f"and .jsonl files (text files: corpus=text)")
    return files


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
    rows = table_rows(path)
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
    for n, record in json_records(path):
        missing = [c for c in wanted if c not in record]
        if missing:
            raise PrepError(f"{path} line {n} has no field {missing[0]!r} (it has "
                            f"{sorted(record)}); fix corpus.text_columns")
        yield ["" if record[c] is None else str(record[c]) for c in wanted]


def read_table(cfg: TableCorpusConfig, exclude: Optional[str] = None):
    """(starts_document, sentence): a row's text cells, one document per row."""
    for path in table_files(cfg.paths, exclude):
        cells = _cells_of_jsonl if is_json_lines(path) else _cells_of_table
        try:
            for row in cells(path, cfg.text_columns):
                new_doc = True
                for cell in row:
                    for line in cell.splitlines():
                        if line.strip():
                            yield new_doc, line.strip()
                            new_doc = False
        except TableFileError as exc:   # not UTF-8, not JSON: the reader says which line
            raise PrepError(str(exc)) from None
