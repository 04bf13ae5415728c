"""Reading a task's examples: GLUE from the Hugging Face hub (`datasets`), from a save_to_disk
folder or from GLUE's own TSV files; custom tasks from CSV, TSV or JSON-lines files.

Every problem with the data (a missing file or column, a label outside the task's range, an
empty file, no network for the hub) is one DataError line naming the file and what to change.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..components.table_files import TableFileError, is_json_lines, json_records, table_rows
from ..errors import DataError
from .tasks import CUSTOM, GlueTask, TaskConfig

HUB_DATASET = "nyu-mll/glue"
SUBSET_SEED = 0x5EED5  # the training subset is the same for every seed, lr and model


@dataclass
class Examples:
    text_a: list
    text_b: Optional[list]
    """None for a sentence task."""
    labels: np.ndarray
    """int64 class ids, or float32 values for regression."""

    def __len__(self) -> int:
        return len(self.text_a)

    def subset(self, index) -> "Examples":
        index = np.asarray(index, dtype=np.int64)
        return Examples([self.text_a[i] for i in index],
                        None if self.text_b is None else [self.text_b[i] for i in index],
                        self.labels[index])


@dataclass
class TaskData:
    name: str
    title: str
    train: Examples
    evals: dict
    """{split key: Examples}: '' for the one evaluation split of most tasks; MNLI: m, mm."""
    num_labels: int
    metrics: tuple
    label_names: Optional[list]
    source: str
    """Where the examples came from, for messages and results."""

    @property
    def regression(self) -> bool:
        return self.num_labels == 1


def read_task(cfg: TaskConfig) -> TaskData:
    data = _read_custom(cfg) if cfg.name == CUSTOM else _read_glue(cfg)
    if cfg.max_train_samples is not None and cfg.max_train_samples < len(data.train):
        rng = np.random.default_rng(SUBSET_SEED)
        data.train = data.train.subset(np.sort(rng.choice(len(data.train),
                                                          cfg.max_train_samples, replace=False)))
    if cfg.max_eval_samples is not None:
        data.evals = {k: v.subset(np.arange(min(len(v), cfg.max_eval_samples)))
                      for k, v in data.evals.items()}
    return data


# --------------------------------------------------------------------------- GLUE


def _read_glue(cfg: TaskConfig) -> TaskData:
    task = cfg.glue
    where = cfg.data_dir
    names = list(task.label_names) or None
    if where is None:
        (splits, names), source = _from_hub(task), f"{HUB_DATASET}/{task.name} (hub)"
    else:
        folder = _task_folder(where, task)
        if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
            (splits, names), source = _from_disk(folder, task), folder
        else:
            splits = {s: _read_glue_tsv(os.path.join(folder, f), task)
                      for s, f in [("train", "train.tsv")] + [(e.key, e.tsv) for e in task.evals]}
            source = folder
    evals = {e.key: splits[e.key] for e in task.evals}
    return TaskData(task.name, task.title, splits["train"], evals, task.num_labels,
                    task.metrics, names, source)


def _task_folder(where: str, task: GlueTask) -> str:
    """The task's own folder, or its sub-folder of a GLUE root (GLUE's name or the hub's)."""
    if not os.path.isdir(where):
        raise DataError(f"data_dir {where}: no such directory; pass a GLUE folder (with "
                        f"{task.title}/), GLUE's {task.title} folder (train.tsv, dev.tsv) or a "
                        f"datasets save_to_disk folder")
    for candidate in (where, os.path.join(where, task.title), os.path.join(where, task.name)):
        if os.path.isfile(os.path.join(candidate, "train.tsv")) or \
                os.path.isfile(os.path.join(candidate, "dataset_dict.json")):
            return candidate
    raise DataError(f"{where} holds neither GLUE's {task.title} files (train.tsv, "
                    f"{', '.join(e.tsv for e in task.evals)}) nor a datasets save_to_disk folder "
                    f"(dataset_dict.json), nor a {task.title}/ or {task.name}/ folder with them")


def _from_hub(task: GlueTask) -> tuple:
    import logging

    import datasets

    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # without a network: no 'Retrying in 8s' lines before ours
    try:
        ds = datasets.load_dataset(HUB_DATASET, task.name)
    except Exception as exc:  # no network, a proxy, a renamed dataset: one line, a way out
        reason = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"cannot load {HUB_DATASET}/{task.name} from the Hugging Face hub "
                        f"({reason[:200]}); without a network pass data_dir=<a GLUE folder "
                        f"with {task.title}/ (train.tsv, dev.tsv) or save_to_disk folders>") \
            from None
    finally:
        hub_log.setLevel(level)
    return _dataset_splits(ds, task, f"{HUB_DATASET}/{task.name}")


def _from_disk(folder: str, task: GlueTask) -> tuple:
    import datasets

    try:
        ds = datasets.load_from_disk(folder)
    except Exception as exc:
        raise DataError(f"cannot read the save_to_disk folder {folder} "
                        f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") \
            from None
    return _dataset_splits(ds, task, folder)


def _dataset_splits(ds, task: GlueTask, source: str) -> tuple:
    """({split key: Examples}, the label names): a copy's own ClassLabel names say what its
    ids mean (a copy that numbers the classes otherwise keeps its meaning); GLUE's without."""
    out, names = {}, list(task.label_names) or None
    for key, split in [("train", "train")] + [(e.key, e.hub) for e in task.evals]:
        if split not in ds:
            raise DataError(f"{source} has no {split!r} split (it has {sorted(ds)})")
        part = ds[split]
        missing = [c for c in (*task.hub_columns, "label") if c not in part.column_names]
        if missing:
            raise DataError(f"{source} split {split!r} has no column(s) {missing} (it has "
                            f"{part.column_names}); is it GLUE's {task.name}?")
        texts = [list(part[c]) for c in task.hub_columns]
        dtype = np.float32 if task.num_labels == 1 else np.int64
        labels = np.asarray(part["label"], dtype=dtype)
        _check_range(labels, task.num_labels, f"{source} split {split!r}")
        out[key] = Examples(texts[0], texts[1] if len(texts) == 2 else None, labels)
        own = getattr(part.features["label"], "names", None)
        if key == "train" and own and len(own) == task.num_labels:
            names = [str(n) for n in own]
    return out, names


def _read_glue_tsv(path: str, task: GlueTask) -> Examples:
    """GLUE's TSV files as its download script writes them: no quoting (quote characters are
    text), a header except CoLA's; rows without every needed field are skipped (QQP's train
    file has a few), as transformers' GLUE processors do."""
    rows = list(_tsv_rows(path))
    if task.tsv_header:
        header, rows = (rows[0] if rows else []), rows[1:]
        columns = []
        for name in (*task.tsv_columns, task.tsv_label):
            if name not in header:
                raise DataError(f"{path} has no column {name!r} in its header ({header}); is "
                                f"it GLUE's {task.title} {os.path.basename(path)}?")
            columns.append(header.index(name))
    else:
        columns = [int(c) for c in (*task.tsv_columns, task.tsv_label)]
    need = max(columns) + 1
    kept = [(n, r) for n, r in enumerate(rows, 2 if task.tsv_header else 1) if len(r) >= need]
    if len(kept) < len(rows):
        print(f"bert-finetune: warning: {path}: skipped {len(rows) - len(kept)} row(s) without "
              f"all {need} fields", file=sys.stderr)
    if not kept:
        raise DataError(f"{path} has no examples")
    texts = [[r[c] for _, r in kept] for c in columns[:-1]]
    words = task.label_names if task.tsv_labels_are_words else None
    labels = [_label(r[columns[-1]], task.num_labels, words, path, n)
              for n, r in kept]
    return Examples(texts[0], texts[1] if len(texts) == 2 else None,
                    np.asarray(labels, dtype=np.float32 if task.num_labels == 1 else np.int64))


def _tsv_rows(path: str):
    """The fields of each row, read as bert-prep reads them (components/table_files.py holds
    why: MRPC's byte order mark, the '\\r's of public SST-2 copies)."""
    try:
        for _, fields in table_rows(path):
            yield fields
    except FileNotFoundError:
        raise DataError(f"{path} is missing; pass the task's complete folder") from None
    except TableFileError as exc:
        raise DataError(str(exc)) from None
    except OSError as exc:
        raise DataError(f"cannot read {path} ({exc})") from None


def _label(value, num_labels: int, names, path: str, line: int):
    """One label as a class id (range-checked) or, for regression, a number."""
    text = str(value).strip()
    if num_labels == 1:
        try:
            return float(text)
        except ValueError:
            raise DataError(f"{path} line {line}: label {text!r} is not a number (a regression "
                            f"task)") from None
    if names is not None and text in names:
        return names.index(text)
    try:
        label = int(text)
    except ValueError:
        known = f" (known: {', '.join(names)})" if names else ""
        raise DataError(f"{path} line {line}: label {text!r} is not a class id{known}; set "
                        f"task.label_names for word labels") from None
    if not 0 <= label < num_labels:
        raise DataError(f"{path} line {line}: label {label} is out of range: the task has "
                        f"{num_labels} classes (0..{num_labels - 1}); fix the file or set "
                        f"task.num_labels")
    return label


def _check_range(labels: np.ndarray, num_labels: int, where: str) -> None:
    if num_labels > 1 and len(labels) and (labels.min() < 0 or labels.max() >= num_labels):
        bad = int(labels[(labels < 0) | (labels >= num_labels)][0])
        raise DataError(f"{where}: label {bad} is out of range (0..{num_labels - 1}); test "
                        f"splits carry no labels (-1): score a split with labels")


# --------------------------------------------------------------------------- custom files


def _records(path: str):
    """(line number, dict) for each example of a .csv, .tsv or .jsonl/.json file; a table row's
    column that the row is too short for is None (_read_table says which line)."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    try:
        if is_json_lines(path):
            yield from json_records(path)
            return
        rows = table_rows(path)
        header = next(rows, (0, []))[1]
        for n, row in rows:
            yield n, dict(zip(header, row + [None] * (len(header) - len(row))))
    except TableFileError as exc:
        raise DataError(str(exc)) from None


def _read_table(path: str, cfg: TaskConfig) -> tuple:
    """(texts per column, raw labels, line numbers)."""
    columns = [*cfg.text_columns, cfg.label_column]
    texts, labels, lines = [[] for _ in cfg.text_columns], [], []
    for n, record in _records(path):
        missing = [c for c in columns if c not in record]
        if missing:
            raise DataError(f"{path} has no column {missing[0]!r} (it has "
                            f"{list(record)}); set task.text_columns / "
                            f"task.label_column")
        for column, values in zip(cfg.text_columns, texts):
            value = record[column]
            if value is None:
                raise DataError(f"{path} line {n}: no value for column {column!r}")
            values.append(str(value))
        labels.append(record[cfg.label_column])
        lines.append(n)
    if not labels:
        raise DataError(f"{path} has no examples; give it a header line and one example a "
                        f"line")
    return texts, labels, lines


def _read_custom(cfg: TaskConfig) -> TaskData:
    train = _read_table(cfg.train_file, cfg)
    valid = _read_table(cfg.validation_file, cfg)
    names = list(cfg.label_names) if cfg.label_names is not None else None
    num_labels = cfg.num_labels
    if num_labels != 1 and names is None and not all(_is_int(v) for v in train[1]):
        names = sorted({str(v).strip() for v in train[1]})
    if num_labels is None:
        num_labels = len(names) if names is not None else \
            max(int(str(v).strip()) for v in train[1]) + 1
        if num_labels < 2:
            raise DataError(f"{cfg.train_file}: every label is {train[1][0]!r}: a classifier "
                            f"needs two classes (set task.num_labels=1 for regression)")
    parts = []
    for path, (texts, raw, lines) in ((cfg.train_file, train), (cfg.validation_file, valid)):
        labels = [_label(v, num_labels, names, path, n) for v, n in zip(raw, lines)]
        parts.append(Examples(texts[0], texts[1] if len(texts) == 2 else None,
                              np.asarray(labels, np.float32 if num_labels == 1 else np.int64)))
    metrics = tuple(cfg.metrics) or (("pearson", "spearman") if num_labels == 1
                                     else ("accuracy",))
    if num_labels != 2 and "f1" in metrics:
        raise DataError(f"task.metrics: f1 scores the positive class of a two-class task; this "
                        f"one has {num_labels} label(s)")
    # its name in messages and tables: the data's folder (data/reviews/train.csv: reviews)
    title = os.path.basename(os.path.dirname(os.path.abspath(cfg.train_file))) or \
        os.path.splitext(os.path.basename(cfg.train_file))[0]
    return TaskData(CUSTOM, title, parts[0],
                    {"": parts[1]}, num_labels, metrics, names, cfg.train_file)


def _is_int(value) -> bool:
    try:
        int(str(value).strip())
        return True
    except ValueError:
        return False
