"""Corpus sources: each turns its input into one stream of sentences.

Every reader yields ``(starts_document, sentence)`` pairs, one sentence at a time, so that no
reader ever holds more than one paragraph (text sources) or one row (datasets) in memory: the
rest of the pipeline streams, whatever the corpus size.  Sentences are stripped; empty ones are
never yielded.

Sources (``corpus.source``):
  text       BERT's format: one sentence per line, a blank line between documents; every file
             also starts a new document.
  documents  plain paragraph text; a document is a file (``document_per=file``) or a block
             between blank lines (``document_per=blank_line``); paragraphs are split into
             sentences by blingfire (a compiled finite-state segmenter: fast and accurate on
             abbreviations, decimals and quotes, where a regex is not).
  hf         any Hugging Face dataset through `datasets` (hub name, builder + data_files, or a
             save_to_disk directory), one document per row, streaming or not.
  builtin    Python's own documentation (see `builtin_corpus`), no download.
"""
from __future__ import annotations

import codecs
import glob
import os
from typing import Iterable, Iterator, Optional

from data_prep.config import (BuiltinCorpusConfig, DocumentsCorpusConfig, HFCorpusConfig,
                              TextCorpusConfig)
from data_prep.errors import PrepError

Sentence = tuple[bool, str]


def resolve_paths(patterns: list[str], exclude: Optional[str] = None) -> list[str]:
    """Files named by paths, globs or directories (recursively, hidden files skipped), sorted
    within each pattern so the corpus order never depends on the file system.  Files under
    `exclude` (the output dir, when it sits inside a corpus directory) are never corpus."""
    files: list[str] = []
    for pattern in patterns:
        pattern = os.path.expanduser(pattern)
        if glob.has_magic(pattern):
            matched = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matched:
                raise PrepError(f"corpus.paths: {pattern!r} matches no files: check the pattern")
            files.extend(matched)
        elif os.path.isdir(pattern):
            found = []
            for root, dirs, names in os.walk(pattern):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found.extend(os.path.join(root, n) for n in names if not n.startswith("."))
            if not found:
                raise PrepError(f"corpus.paths: directory {pattern!r} holds no files")
            files.extend(sorted(found))
        elif os.path.isfile(pattern):
            files.append(pattern)
        else:
            raise PrepError(f"corpus.paths: no such file or directory: {pattern!r}")
    if exclude:
        ex = os.path.abspath(exclude)
        files = [f for f in files if os.path.commonpath([os.path.abspath(f), ex]) != ex]
    return files


def _not_utf8(path: str, exc: UnicodeDecodeError) -> PrepError:
    """Locate the first invalid byte (line and byte offset) for the message."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, line = 0, 1
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                bad = offset + e.start
                line += chunk[:e.start].count(b"\n")
                return PrepError(f"{path}: not UTF-8 text (invalid byte 0x{chunk[e.start]:02x} "
                                 f"at line {line}, byte {bad}): convert it, e.g. "
                                 f"`iconv -f latin1 -t utf-8`")
            offset += len(chunk)
            line += chunk.count(b"\n")
    return PrepError(f"{path}: not UTF-8 text ({exc.reason}): convert it to UTF-8")


def _lines(path: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8", newline=None) as f:
            yield from f
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    except OSError as e:
        raise PrepError(f"{path}: cannot read it ({e.strerror})") from None


def read_text(cfg: TextCorpusConfig, exclude: Optional[str] = None) -> Iterator[Sentence]:
    for path in resolve_paths(cfg.paths, exclude):
        new_doc = True
        for line in _lines(path):
            line = line.strip()
            if line:
                yield new_doc, line
                new_doc = False
            else:
                new_doc = True


def split_sentences(paragraph: str) -> list[str]:
    """blingfire on one paragraph (hard line breaks inside it are joined first)."""
    import blingfire
    text = " ".join(paragraph.split())
    if not text:
        return []
    return [s for s in blingfire.text_to_sentences(text).split("\n") if s.strip()]


def paragraphs(lines: Iterable[str]) -> Iterator[tuple[bool, str]]:
    """(follows_a_blank_line, paragraph) for blocks of non-blank lines."""
    block: list[str] = []
    blank_before = True
    for line in lines:
        if line.strip():
            block.append(line)
        elif block:
            yield blank_before, " ".join(block)
            block = []
            blank_before = True
    if block:
        yield blank_before, " ".join(block)


def _sentences_of_document(paras: Iterable[str]) -> Iterator[Sentence]:
    new_doc = True
    for para in paras:
        for s in split_sentences(para):
            yield new_doc, s
            new_doc = False


def read_documents(cfg: DocumentsCorpusConfig,
                   exclude: Optional[str] = None) -> Iterator[Sentence]:
    for path in resolve_paths(cfg.paths, exclude):
        if cfg.document_per == "file":
            yield from _sentences_of_document(p for _, p in paragraphs(_lines(path)))
        else:
            for _, para in paragraphs(_lines(path)):
                yield from _sentences_of_document([para])


def _load_hf(cfg: HFCorpusConfig):
    import datasets
    name = os.path.expanduser(cfg.name)
    saved = os.path.isdir(name) and any(
        os.path.exists(os.path.join(name, f))
        for f in ("state.json", "dataset_dict.json", "dataset_info.json"))
    try:
        if saved and not os.path.exists(os.path.join(name, "README.md")) \
                and not cfg.data_files:
            ds = datasets.load_from_disk(name)
            if isinstance(ds, datasets.DatasetDict):
                if cfg.split not in ds:
                    raise PrepError(f"corpus.split={cfg.split!r} is not in {name!r}: it has "
                                    f"{sorted(ds)}")
                ds = ds[cfg.split]
            if cfg.streaming:
                ds = ds.to_iterable_dataset()
        else:
            ds = datasets.load_dataset(name, cfg.config, split=cfg.split,
                                       streaming=cfg.streaming, data_files=cfg.data_files,
                                       revision=cfg.revision, cache_dir=cfg.cache_dir)
    except PrepError:
        raise
    except Exception as e:  # datasets raises many types; all mean "cannot load what you named"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PrepError(f"cannot load dataset corpus.name={cfg.name!r} (config={cfg.config!r}, "
                        f"split={cfg.split!r}): {first}") from None
    return ds


def read_hf(cfg: HFCorpusConfig, exclude: Optional[str] = None) -> Iterator[Sentence]:
    ds = _load_hf(cfg)
    columns = getattr(ds, "column_names", None)
    if columns is not None and cfg.text_column not in columns:
        raise PrepError(f"corpus.text_column={cfg.text_column!r} is not a column of "
                        f"{cfg.name!r}: it has {columns}")
    remaining = cfg.max_documents
    for batch in ds.iter(batch_size=256):
        if cfg.text_column not in batch:
            raise PrepError(f"corpus.text_column={cfg.text_column!r} is not a column of "
                            f"{cfg.name!r}: it has {sorted(batch)}")
        for text in batch[cfg.text_column]:
            if remaining is not None:
                if remaining == 0:
                    return
                remaining -= 1
            if text is None:
                continue
            if not isinstance(text, str):
                raise PrepError(f"corpus.text_column={cfg.text_column!r} holds "
                                f"{type(text).__name__}, not text: name a string column")
            if cfg.sentence_split == "lines":
                new_doc = True
                for line in text.split("\n"):
                    if line.strip():
                        yield new_doc, line.strip()
                        new_doc = False
            else:
                yield from _sentences_of_document(p for _, p in paragraphs(text.split("\n")))


def read_builtin(cfg: BuiltinCorpusConfig, exclude: Optional[str] = None) -> Iterator[Sentence]:
    from data_prep.builtin_corpus import builtin_documents
    for doc in builtin_documents(cfg.include_topics, cfg.include_docstrings):
        yield from _sentences_of_document(doc)


READERS = {"text": read_text, "documents": read_documents, "hf": read_hf,
           "builtin": read_builtin}


def read_corpus(cfg, exclude: Optional[str] = None) -> Iterator[Sentence]:
    return READERS[cfg.source](cfg, exclude)


def fingerprint(cfg, exclude: Optional[str] = None) -> dict:
    """What identifies the input, for the resume check (file sizes and times for files)."""
    if cfg.source in ("text", "documents"):
        files = resolve_paths(cfg.paths, exclude)
        return {"files": [[os.path.abspath(p), os.path.getsize(p), int(os.path.getmtime(p))]
                          for p in files]}
    if cfg.source == "builtin":
        import sys
        return {"python": sys.version.split()[0]}
    return {}
