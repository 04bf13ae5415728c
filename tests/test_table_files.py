"""One reader for a labelled task's files (bert_pretrain/components/table_files.py), held through
both commands that read them: `bert-prep corpus=table` (its sentences) and `bert-finetune
task=custom` (its examples) read the same file alike, and what neither can read is one line of
each command's own error."""
from __future__ import annotations

import pytest

from bert_pretrain.errors import DataError
from bert_pretrain.finetune.reading import read_task
from bert_pretrain.finetune.tasks import TaskConfig
from data_prep.config import TableCorpusConfig
from data_prep.errors import PrepError
from data_prep.table_corpus import read_table

PAIRS = [('"quoted" at the start', "first summary"), ("plain words", "second summary"),
         ("a third one", '"x" marks')]
COMMANDS = ("bert-prep", "bert-finetune")


def read_rows(command: str, path: str, columns: list) -> list:
    """The text a command reads from the file, row by row: bert-prep's documents (each a list
    of sentences) or bert-finetune's examples (each a list of its texts)."""
    if command == "bert-prep":
        rows = []
        for new_doc, sentence in read_table(TableCorpusConfig(paths=[path],
                                                              text_columns=columns)):
            if new_doc:
                rows.append([])
            rows[-1].append(sentence)
        return rows
    data = read_task(TaskConfig(name="custom", train_file=path, validation_file=path,
                                text_columns=columns, label_column="label")).train
    return [list(texts) for texts in zip(data.text_a, *([data.text_b] if data.text_b else []))]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_windows_tsv_with_carriage_returns_and_a_byte_order_mark(tmp_path, command):
    """Every rule of a TSV file at once: a byte order mark before the first column's name,
    '\\r\\n' line ends (the last column's name and cells end with '\\r'), a '\\r' before a tab
    (public SST-2 copies) and quote characters that are text (GLUE's files)."""
    path = tmp_path / "train.tsv"
    path.write_bytes(("\ufefftext\tlabel\tsummary\r\n" + "".join(
        f"{a}\r\t{i % 2}\t{b}\r\n" for i, (a, b) in enumerate(PAIRS))).encode("utf-8"))
    assert read_rows(command, str(path), ["text", "summary"]) == [list(p) for p in PAIRS]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_csv_file_quotes_and_may_start_with_a_byte_order_mark(tmp_path, command):
    path = tmp_path / "train.csv"
    path.write_text('\ufefftext,label\n"one, with a comma",1\n"two\nlines",0\n',
                    encoding="utf-8")
    two = ["two", "lines"] if command == "bert-prep" else ["two\nlines"]  # a sentence a line
    assert read_rows(command, str(path), ["text"]) == [["one, with a comma"], two]


@pytest.mark.parametrize("command", COMMANDS)
def test_json_lines_skip_blank_lines(tmp_path, command):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "one", "label": 1}\n\n  \n{"text": "two", "label": 0}\n',
                    encoding="utf-8-sig")
    assert read_rows(command, str(path), ["text"]) == [["one"], ["two"]]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name, content, said", [
    pytest.param("train.jsonl", b'{"text": "one", "label": 1}\n\n[1, 2]\n',
                 r"train\.jsonl line 3 is not a JSON object$", id="json-array"),
    pytest.param("train.jsonl", b'{"text": "one", "label": 1}\n{"text": \n',
                 r"train\.jsonl line 2 is not a JSON object \(.*\); write one object per line$",
                 id="json-cut"),
    pytest.param("train.csv", "text,label\ncaf\u00e9,1\n".encode("latin-1"),
                 r"train\.csv: not UTF-8 text \(.*\): convert it to UTF-8$", id="csv-latin1"),
    pytest.param("train.tsv", "text\tlabel\ncaf\u00e9\t1\n".encode("latin-1"),
                 r"train\.tsv: not UTF-8 text \(.*\): convert it to UTF-8$", id="tsv-latin1"),
    pytest.param("train.csv", b'text,label\n"' + b"x" * 200_000 + b'",1\n',
                 r"train\.csv line 2: not readable as CSV \(field larger than field limit",
                 id="csv-huge-field"),
    pytest.param("train.txt", b"text,label\none,1\n",
                 r"train\.txt: unknown format.* \.csv, \.tsv (and|or) \.jsonl", id="txt"),
])
def test_what_neither_command_can_read_is_one_line_of_its_own_error(tmp_path, command, name,
                                                                      content, said):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(PrepError if command == "bert-prep" else DataError, match=said) as caught:
        read_rows(command, str(path), ["text"])
    assert "\n" not in str(caught.value)
