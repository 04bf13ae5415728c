"""Typed, validated schema of the prep config (`conf/prep/prep.yaml` + `conf/prep/corpus/*.yaml`).

Hydra composes the YAML; `PrepConfig.from_dict` turns the result into these dataclasses and
`__post_init__` validates every field, so a bad value fails before any work starts, with a
one-line `PrepError` that names the field and the fix.

Settings that change the output (seed, lengths, probabilities, shard size, ...) are kept apart
from `num_proc` and `tokenize_batch_size`, which only change speed: the output is byte-identical
whatever their values (tested).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from data_prep.errors import PrepError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PACKINGS = ("nsp_pairs", "full_sentences", "doc_sentences")
# Sources whose documents are independent short texts (the rows of a labelled file): no next
# sentence to predict, so `packing=auto` packs them MLM-only, whole sentences (RoBERTa).
ROW_SOURCES = ("table",)
# Upper bounds that keep a typo from starting work that cannot finish: 1000 copies of every
# shard, or a process per CPU of a very large machine, is far beyond any real use.
MAX_DUPE_FACTOR = 1000
MAX_NUM_PROC = 1024


def _paths(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise PrepError(f"{where} must be a path or a list of paths, got {value!r}: "
                    f"pass e.g. {where}='[data/*.txt]'")


@dataclass
class TextCorpusConfig:
    """BERT's text format: one sentence per line, a blank line between documents."""
    paths: list[str] = field(default_factory=list)   # files, globs or directories
    source: str = "text"

    def __post_init__(self):
        self.paths = _paths(self.paths, "corpus.paths")
        if not self.paths:
            raise PrepError("corpus.paths is empty: pass the text to prepare, e.g. "
                            "corpus.paths='[data/wiki/*.txt]'")


@dataclass
class DocumentsCorpusConfig:
    """Plain paragraph text, split into sentences by blingfire."""
    paths: list[str] = field(default_factory=list)
    # "file": each file is one document; "blank_line": blank lines separate documents.
    document_per: str = "file"
    source: str = "documents"

    def __post_init__(self):
        self.paths = _paths(self.paths, "corpus.paths")
        if not self.paths:
            raise PrepError("corpus.paths is empty: pass the documents to prepare, e.g. "
                            "corpus.paths='[data/docs/]'")
        if self.document_per not in ("file", "blank_line"):
            raise PrepError(f"corpus.document_per={self.document_per!r} is not one of "
                            "'file', 'blank_line'")


@dataclass
class HFCorpusConfig:
    """A Hugging Face dataset, one document per row, loaded through `datasets`."""
    name: Optional[str] = None        # hub name ("wikimedia/wikipedia"), a builder ("parquet",
                                      # "json", "text") or a local dir (save_to_disk or files)
    config: Optional[str] = None      # the dataset's config / subset ("20231101.en")
    split: str = "train"
    text_column: str = "text"
    streaming: bool = False
    data_files: Any = None            # for builders like "parquet": a path, glob or list
    revision: Optional[str] = None
    cache_dir: Optional[str] = None   # where `datasets` caches (default: ~/.cache/huggingface)
    max_documents: Optional[int] = None   # take only the first N rows (quick trials)
    # How a row's text becomes sentences: "blingfire" (paragraph text) or "lines" (already one
    # sentence per line).
    sentence_split: str = "blingfire"
    source: str = "hf"

    def __post_init__(self):
        if not self.name:
            raise PrepError("corpus.name is not set: pass a dataset name or local path, e.g. "
                            "corpus.name=wikimedia/wikipedia corpus.config=20231101.en")
        if not self.text_column:
            raise PrepError("corpus.text_column is empty: name the column that holds the text")
        if self.max_documents is not None and self.max_documents < 1:
            raise PrepError(f"corpus.max_documents={self.max_documents} must be >= 1 or null")
        if self.sentence_split not in ("blingfire", "lines"):
            raise PrepError(f"corpus.sentence_split={self.sentence_split!r} is not one of "
                            "'blingfire', 'lines'")


@dataclass
class BuiltinCorpusConfig:
    """Documentation shipped with Python: pydoc topics and standard-library docstrings, and
    optionally the docstrings of installed packages (`packages`)."""
    include_topics: bool = True
    include_docstrings: bool = True
    packages: list = field(default_factory=list)
    """Top-level names of installed packages whose modules' docstrings are added, one document
    per module (e.g. [torch]: 5 MB of English for torch 2.13), read with `ast`, never imported."""
    source: str = "builtin"

    def __post_init__(self):
        if isinstance(self.packages, str):
            self.packages = [self.packages]
        if not isinstance(self.packages, (list, tuple)) or \
                not all(isinstance(p, str) and p for p in self.packages):
            raise PrepError(f"corpus.packages must be a list of package names, got "
                            f"{self.packages!r}: pass e.g. corpus.packages='[torch]'")
        from data_prep.builtin_corpus import package_dir

        for name in self.packages:
            if not name.isidentifier():
                raise PrepError(f"corpus.packages: {name!r} is not a top-level package name "
                                f"(e.g. torch, numpy)")
            package_dir(name)  # not installed: one line now, before any work
        self.packages = list(self.packages)
        if not (self.include_topics or self.include_docstrings or self.packages):
            raise PrepError("the builtin corpus is empty: set corpus.include_topics=true or "
                            "corpus.include_docstrings=true, or name corpus.packages")


@dataclass
class TableCorpusConfig:
    """A labelled task's own files, their text only: CSV, TSV or JSON-lines files (what
    `bert-finetune task=custom` reads) or a GLUE task's folder (its train.tsv). Only the text
    columns are read, never a label; each row is one document, each text cell a sentence."""
    paths: list[str] = field(default_factory=list)
    # The columns that hold text. null: GLUE's text columns, found by the files' header
    # (sentence; sentence1 + sentence2; question + sentence; question1 + question2; ...).
    text_columns: Optional[list] = None
    source: str = "table"

    def __post_init__(self):
        self.paths = _paths(self.paths, "corpus.paths")
        if not self.paths:
            raise PrepError("corpus.paths is empty: pass the task's files or GLUE folder, e.g. "
                            "corpus.paths='[data/reviews/train.csv]'")
        if self.text_columns is not None:
            if isinstance(self.text_columns, str):
                self.text_columns = [self.text_columns]
            if not isinstance(self.text_columns, (list, tuple)) or not self.text_columns or \
                    not all(isinstance(c, str) and c for c in self.text_columns):
                raise PrepError(f"corpus.text_columns={self.text_columns!r}: name the text "
                                f"columns, e.g. corpus.text_columns='[review]'")
            self.text_columns = list(self.text_columns)


CORPUS_CONFIGS = {"text": TextCorpusConfig, "documents": DocumentsCorpusConfig,
                  "hf": HFCorpusConfig, "builtin": BuiltinCorpusConfig,
                  "table": TableCorpusConfig}


def _corpus_schema(cfg):
    return CORPUS_CONFIGS.get(str(cfg.get("corpus", {}).get("source")))


@dataclass
class TokenizerConfig:
    # Reuse an existing vocabulary instead of training one: a vocab.txt, a tokenizer.json, or a
    # directory holding either (e.g. the tokenizer/ dir of an earlier prep).
    vocab_file: Optional[str] = None
    vocab_size: int = 30522           # when training
    min_frequency: int = 2            # when training
    limit_alphabet: Optional[int] = 1000   # when training: at most this many initial characters
    # When training: use only the corpus's first N sentences (null: all).  The trainer holds a
    # count per distinct word, so on a huge corpus a prefix bounds its memory and time.
    max_training_sentences: Optional[int] = None
    do_lower_case: bool = True        # also strips accents, like BERT's uncased models

    def __post_init__(self):
        if self.vocab_file is None:
            if not 64 <= self.vocab_size <= 2 ** 31 - 1:
                raise PrepError(f"tokenizer.vocab_size={self.vocab_size} is too small: use at "
                                "least 64 (BERT uses 30522)")
            if not 1 <= self.min_frequency <= 2 ** 32 - 1:
                raise PrepError(f"tokenizer.min_frequency={self.min_frequency} must be in "
                                "[1, 2**32 - 1]")
            if (self.limit_alphabet is not None
                    and not 1 <= self.limit_alphabet <= 2 ** 31 - 1):
                raise PrepError(f"tokenizer.limit_alphabet={self.limit_alphabet} must be in "
                                "[1, 2**31 - 1] or null (no limit)")
            if self.max_training_sentences is not None and self.max_training_sentences < 1:
                raise PrepError(f"tokenizer.max_training_sentences="
                                f"{self.max_training_sentences} must be >= 1 or null")


@dataclass
class PrepConfig:
    corpus: Any
    output_dir: Optional[str] = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # --- settings that change the output -------------------------------------------------------
    # What an instance is. nsp_pairs: BERT's `[CLS] A [SEP] B [SEP]` with a next-sentence label.
    # MLM only, no NSP label (RoBERTa): full_sentences packs whole sentences up to
    # max_seq_length, running on into the next document with a [SEP] between documents
    # (RoBERTa's FULL-SENTENCES); doc_sentences stops at the end of each document
    # (DOC-SENTENCES: shorter instances at document ends).
    # auto: full_sentences for the rows of a table (corpus=table), nsp_pairs otherwise.
    packing: str = "auto"
    seed: int = 12345
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    random_next_prob: float = 0.5
    whole_word_mask: bool = False
    dupe_factor: int = 5
    # Fraction of tokens held out (whole documents) for validation; 0 disables the split.
    validation_fraction: float = 0.01
    # Work-unit size: each unit of ~this many tokens (cut at sentence boundaries) times each
    # dupe copy becomes one shard with its own seeded RNG.
    tokens_per_shard: int = 1_000_000
    # --- settings that change only speed / where the work runs ---------------------------------
    num_proc: Optional[int] = None          # worker processes; null = all CPUs
    tokenize_batch_size: int = 8192         # sentences per tokenizers.encode_batch call
    num_hosts: int = 1                      # split the shards over this many machines...
    host_index: Optional[int] = None        # ...this one writes shards i with i % num_hosts == it
    overwrite: bool = False                 # delete an existing prep in output_dir first
    progress: bool = True                   # tqdm progress bars

    def __post_init__(self):
        if not self.output_dir:
            raise PrepError("output_dir is not set: pass output_dir=prepared/<name>")
        # what `packing=auto` chose, for the start-up line (None: the user chose)
        self.packing_auto = None
        if self.packing == "auto":
            self.packing = "full_sentences" if getattr(self.corpus, "source", None) in \
                ROW_SOURCES else "nsp_pairs"
            self.packing_auto = self.packing
        if self.packing not in PACKINGS:
            raise PrepError(f"packing={self.packing!r} is not one of auto, {', '.join(PACKINGS)} "
                            "(nsp_pairs: BERT's MLM + NSP pairs; full_sentences, doc_sentences: "
                            "MLM only, as RoBERTa)")
        if not 0 <= self.seed < 2 ** 63:
            raise PrepError(f"seed={self.seed} must be in [0, 2**63)")
        L = self.max_seq_length
        if not isinstance(L, int) or L < 8:
            raise PrepError(f"max_seq_length={L} is too short: use at least 8 (BERT uses 128 "
                            "then 512)")
        if L > 65535:
            raise PrepError(f"max_seq_length={L} is too long: at most 65535")
        if not 1 <= self.max_predictions_per_seq <= L:
            raise PrepError(f"max_predictions_per_seq={self.max_predictions_per_seq} must be in "
                            f"[1, max_seq_length={L}] (BERT: 20 at 128, 80 at 512)")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise PrepError(f"masked_lm_prob={self.masked_lm_prob} must be in (0, 1) "
                            "(BERT uses 0.15)")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise PrepError(f"short_seq_prob={self.short_seq_prob} must be in [0, 1]")
        if not 0.0 <= self.random_next_prob <= 1.0:
            raise PrepError(f"random_next_prob={self.random_next_prob} must be in [0, 1]")
        if not 1 <= self.dupe_factor <= MAX_DUPE_FACTOR:
            raise PrepError(f"dupe_factor={self.dupe_factor} must be in [1, {MAX_DUPE_FACTOR}] "
                            "(BERT uses 10)")
        if not 0.0 <= self.validation_fraction < 0.5:
            raise PrepError(f"validation_fraction={self.validation_fraction} must be in [0, 0.5)")
        if not 1000 <= self.tokens_per_shard <= 2 ** 40:
            raise PrepError(f"tokens_per_shard={self.tokens_per_shard} must be in [1000, 2**40]")
        if self.num_proc is None:
            self.num_proc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else (os.cpu_count() or 1)
        if not 1 <= self.num_proc <= MAX_NUM_PROC:
            raise PrepError(f"num_proc={self.num_proc} must be in [1, {MAX_NUM_PROC}] (null: "
                            "all CPUs)")
        if not 1 <= self.tokenize_batch_size <= 2 ** 20:
            raise PrepError(f"tokenize_batch_size={self.tokenize_batch_size} must be in "
                            "[1, 2**20] (sentences held in memory at once)")
        if self.num_hosts < 1:
            raise PrepError(f"num_hosts={self.num_hosts} must be >= 1")
        if self.host_index is not None and not 0 <= self.host_index < self.num_hosts:
            raise PrepError(f"host_index={self.host_index} must be in [0, num_hosts="
                            f"{self.num_hosts})")

    # Which fields change the output: used for the resume check and the manifest.
    SPEED_ONLY = ("num_proc", "tokenize_batch_size", "num_hosts", "host_index", "overwrite",
                  "progress")

    @classmethod
    def from_dict(cls, d: dict) -> "PrepConfig":
        d = dict(d)
        d.pop("hydra", None)
        corpus = d.pop("corpus", None)
        if not isinstance(corpus, dict) or "source" not in corpus:
            raise PrepError("no corpus chosen: pass corpus=text|documents|hf|builtin|table")
        source = corpus["source"]
        if source not in CORPUS_CONFIGS:
            raise PrepError(f"corpus.source={source!r} is not one of {sorted(CORPUS_CONFIGS)}")
        tok = d.pop("tokenizer", None) or {}
        return cls(corpus=_build(CORPUS_CONFIGS[source], corpus, "corpus"),
                   tokenizer=_build(TokenizerConfig, tok, "tokenizer"),
                   **_check_keys(cls, d, ""))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def next_sentence_prediction(self) -> bool:
        return self.packing == "nsp_pairs"

    def result_dict(self) -> dict:
        """The settings that determine the output (what a resumed run must agree on)."""
        d = self.to_dict()
        for k in self.SPEED_ONLY + ("output_dir",):
            d.pop(k)
        if self.next_sentence_prediction:
            # Left out at its default, so that a prep begun before packing existed keeps its key
            # (a re-run resumes it, or finds it complete).
            d.pop("packing")
        else:   # NSP-only settings do not change packed output
            d.pop("short_seq_prob")
            d.pop("random_next_prob")
        return d


def _check_keys(cls, d: dict, prefix: str) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        known = ", ".join(sorted(prefix + n for n in names))
        raise PrepError(f"unknown setting {prefix}{unknown[0]}: the known ones are {known}")
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        v = d[f.name]
        want = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        kind = want.replace("Optional[", "").rstrip("]")
        if v is None:
            if kind in ("int", "float", "bool", "str") and not want.startswith("Optional["):
                default = f.default if f.default is not dataclasses.MISSING else None
                raise PrepError(f"{prefix}{f.name}=null: it needs a {kind} value (the default "
                                f"is {default!r})")
            continue
        bad = ((kind == "int" and (not isinstance(v, int) or isinstance(v, bool)))
               or (kind == "float" and (not isinstance(v, (int, float)) or isinstance(v, bool)))
               or (kind == "bool" and not isinstance(v, bool))
               or (kind == "str" and not isinstance(v, str)))
        if bad:
            raise PrepError(f"{prefix}{f.name}={v!r} is not a valid {kind}")
        if want == "float":
            d[f.name] = float(v)
    return d


def _build(cls, d: dict, prefix: str):
    return cls(**_check_keys(cls, dict(d), prefix + "."))


# bert-prep's free-form sub-trees and the dataclasses whose fields they take, for the command
# line's 'did you mean' (bert_pretrain.cli_errors.precheck)
PREP_SCHEMAS = {"corpus": _corpus_schema, "tokenizer": TokenizerConfig}
