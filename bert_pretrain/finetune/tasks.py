"""What a fine-tuning task is: the nine GLUE tasks (their columns on the hub and in GLUE's own TSV
files, label sets, official metrics) and `TaskConfig`, the `task` settings (`conf/finetune/task/`),
which also describe any sentence or sentence-pair task read from CSV / TSV / JSON-lines files."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

METRICS = ("accuracy", "f1", "mcc", "pearson", "spearman")
"""f1: of the positive class (label 1), as GLUE scores MRPC and QQP; mcc: Matthews correlation."""
REGRESSION_METRICS = ("pearson", "spearman")
"""The metrics of a regression task's predicted values (the others count classes)."""


@dataclass(frozen=True)
class EvalSplit:
    key: str
    """The suffix of its metric names when a task has several (MNLI: m, mm), else ''."""
    hub: str
    """The split's name on the hub / in a save_to_disk folder."""
    tsv: str
    """GLUE's file for it."""


@dataclass(frozen=True)
class GlueTask:
    name: str
    """The hub's config name (and `task=` option): sst2, mnli, ..."""
    title: str
    """GLUE's name, the folder of its TSV files and the table's column (SST-2, MNLI, ...)."""
    hub_columns: Tuple[str, ...]
    """Text columns on the hub (one: sentence task, two: sentence pair)."""
    tsv_columns: Tuple[str, ...]
    """The same columns in GLUE's TSV files (names in their header, or indices for CoLA's
    header-less files)."""
    tsv_label: str
    num_labels: int
    """1: regression (STS-B's 0-5 similarity)."""
    metrics: Tuple[str, ...]
    label_names: Tuple[str, ...] = ()
    """The classes' names in the hub's id order (its ClassLabel feature; none for STS-B's
    score): what a kept classifier's config.json says instead of LABEL_0, LABEL_1, ..."""
    tsv_labels_are_words: bool = False
    """Whether the TSV files write labels as those names (MNLI, QNLI, RTE) or as ids."""
    tsv_header: bool = True
    evals: Tuple[EvalSplit, ...] = (EvalSplit("", "validation", "dev.tsv"),)


GLUE_TASKS = {t.name: t for t in (
    GlueTask("cola", "CoLA", ("sentence",), ("3",), "1", 2, ("mcc",),
             ("unacceptable", "acceptable"), tsv_header=False),
    GlueTask("sst2", "SST-2", ("sentence",), ("sentence",), "label", 2, ("accuracy",),
             ("negative", "positive")),
    GlueTask("mrpc", "MRPC", ("sentence1", "sentence2"), ("#1 String", "#2 String"), "Quality",
             2, ("f1", "accuracy"), ("not_equivalent", "equivalent")),
    GlueTask("stsb", "STS-B", ("sentence1", "sentence2"), ("sentence1", "sentence2"), "score",
             1, ("pearson", "spearman")),
    GlueTask("qqp", "QQP", ("question1", "question2"), ("question1", "question2"),
             "is_duplicate", 2, ("f1", "accuracy"), ("not_duplicate", "duplicate")),
    GlueTask("mnli", "MNLI", ("premise", "hypothesis"), ("sentence1", "sentence2"),
             "gold_label", 3, ("accuracy",), ("entailment", "neutral", "contradiction"),
             tsv_labels_are_words=True,
             evals=(EvalSplit("m", "validation_matched", "dev_matched.tsv"),
                    EvalSplit("mm", "validation_mismatched", "dev_mismatched.tsv"))),
    GlueTask("qnli", "QNLI", ("question", "sentence"), ("question", "sentence"), "label", 2,
             ("accuracy",), ("entailment", "not_entailment"), tsv_labels_are_words=True),
    GlueTask("rte", "RTE", ("sentence1", "sentence2"), ("sentence1", "sentence2"), "label", 2,
             ("accuracy",), ("entailment", "not_entailment"), tsv_labels_are_words=True),
    # (WNLI's ids run the other way round from RTE's and QNLI's: 1 is entailment)
    GlueTask("wnli", "WNLI", ("sentence1", "sentence2"), ("sentence1", "sentence2"), "label", 2,
             ("accuracy",), ("not_entailment", "entailment")),
)}
# The order of the BERT paper's GLUE table (Devlin et al. 2019, Table 1), WNLI last: GLUE's
# average leaves it out, as the paper and every anchor since did (its dev set is adversarial).
TABLE_ORDER = ("mnli", "qqp", "qnli", "sst2", "cola", "stsb", "mrpc", "rte", "wnli")
# Small tasks (minutes each on a CPU for a BERT-mini): the quick look for small budgets.
FAST_SUBSET = ("sst2", "mrpc", "rte", "stsb", "cola")
NOT_AVERAGED = ("wnli",)
CUSTOM = "custom"


# Where the examples come from and how many are used: top-level keys of bert-finetune and
# bert-glue alike (bert-train's downstream.* too), copied into TaskConfig by their settings.
SUBSET_KEYS = ("data_dir", "max_train_samples", "max_eval_samples")


@dataclass
class TaskConfig:
    """`conf/finetune/task/`: what to fine-tune on."""

    name: str = "???"
    """A GLUE task (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli) or custom (files)."""
    data_dir: Optional[str] = None
    """GLUE tasks: a local copy, either a GLUE folder holding the task's (SST-2/, ...) or the
    task's own folder (train.tsv, dev.tsv, as GLUE's download script writes them), each also as
    a `datasets` save_to_disk folder; null = the Hugging Face hub (nyu-mll/glue, needs a
    network). Users set it as bert-finetune's and bert-glue's top-level `data_dir` (SUBSET_KEYS);
    this and the two below are not keys of the task group."""
    train_file: Optional[str] = None
    """custom: the training examples (.csv, .tsv, or .jsonl / .json with one object a line)."""
    validation_file: Optional[str] = None
    """custom: the examples to score (same format)."""
    text_columns: List[str] = field(default_factory=list)
    """custom: one column (a sentence task) or two (a sentence-pair task)."""
    label_column: str = "label"
    """custom: the label column: integers 0..num_labels-1, words (see label_names) or, for
    regression, numbers."""
    num_labels: Optional[int] = None
    """custom: classes; 1 = regression; null = the number of distinct labels in train_file."""
    label_names: Optional[List[str]] = None
    """custom: labels given as words, in id order (null with word labels: sorted)."""
    metrics: List[str] = field(default_factory=list)
    """custom: from accuracy, f1, mcc, pearson, spearman; empty = accuracy (classes) or
    pearson + spearman (regression). The task's score is their mean."""
    max_train_samples: Optional[int] = None
    """Fine-tune on this many training examples (a fixed random subset, the same for every
    seed, learning rate and model); null = all."""
    max_eval_samples: Optional[int] = None
    """Score on the first N examples of each evaluation split; null = all."""

    def __post_init__(self) -> None:
        if self.name == "???":  # the schema's placeholder (Hydra fills it in before validating)
            return
        if self.name != CUSTOM and self.name not in GLUE_TASKS:
            import difflib

            close = difflib.get_close_matches(str(self.name), [*GLUE_TASKS, CUSTOM], n=1)
            raise ValueError(f"task.name {self.name!r} is not a task: use one of "
                             f"{', '.join(GLUE_TASKS)} or custom (your own files)"
                             + (f"; did you mean {close[0]}?" if close else ""))
        for key in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1 or null, got {value}")
        if self.name != CUSTOM:
            return
        for key in ("train_file", "validation_file"):
            if not getattr(self, key):
                raise ValueError(f"task=custom needs task.{key}=<.csv, .tsv or .jsonl file>")
        if len(self.text_columns) not in (1, 2):
            raise ValueError(f"task.text_columns must name one column (sentence task) or two "
                             f"(sentence pair), got {list(self.text_columns)}")
        if self.num_labels is not None and self.num_labels < 1:
            raise ValueError(f"task.num_labels must be >= 1 (1 = regression) or null, got "
                             f"{self.num_labels}")
        bad = [m for m in self.metrics if m not in METRICS]
        if bad:
            raise ValueError(f"task.metrics: {bad} not known; use some of {', '.join(METRICS)}")
        if self.num_labels == 1:  # (a regression task is one only by task.num_labels=1)
            classes = [m for m in self.metrics if m not in REGRESSION_METRICS]
            if classes:
                raise ValueError(f"task.metrics: {', '.join(classes)} scores classes; a "
                                 f"regression task (task.num_labels=1) is scored by "
                                 f"{', '.join(REGRESSION_METRICS)}")
        if self.label_names is not None and self.num_labels not in (None, len(self.label_names)):
            raise ValueError(f"task.label_names has {len(self.label_names)} names but "
                             f"task.num_labels is {self.num_labels}")

    @property
    def glue(self) -> Optional[GlueTask]:
        return GLUE_TASKS.get(self.name)

    @property
    def title(self) -> str:
        return self.glue.title if self.glue else CUSTOM


def resolve_tasks(tasks) -> list:
    """`all`, `fast` or a list of GLUE task names -> the names, in the table's order."""
    if isinstance(tasks, str):
        if tasks == "all":
            return list(TABLE_ORDER)
        if tasks == "fast":
            return [t for t in TABLE_ORDER if t in FAST_SUBSET]
        tasks = [tasks]
    unknown = [t for t in tasks if t not in GLUE_TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks: {unknown or 'none given'}: use all, fast "
                         f"({', '.join(FAST_SUBSET)}) or a list of {', '.join(TABLE_ORDER)}")
    return [t for t in TABLE_ORDER if t in tasks]
