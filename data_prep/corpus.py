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
  table      a labelled task's files (CSV, TSV, JSON lines, a GLUE folder): their text columns
             only, one document per row (see `table_corpus`).

Files of the text and documents sources may be compressed: gzip, bzip2 and xz always, zstd when
the `zstandard` package is installed.  The format is told by the file's first bytes, whatever
its name, and the text is decompressed as it streams.  Archives (zip, tar, 7z) are refused:
they hold several files, which should be extracted and named.
"""
from __future__ import annotations

import codecs
import glob
import io
import os
from typing import IO, Iterable, Iterator, Optional

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


def _compression(head: bytes) -> Optional[str]:
    """The compression format of a file from its first bytes (None: not compressed)."""
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    # "BZh" + block size, then the pi (block) or sqrt(pi) (end of stream) magic: plain text
    # could start with "BZh", never with these 10 bytes.
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] in (b"1AY&SY", b"\x17rE8P\x90"):
        return "bz2"
    if head.startswith(b"\xfd7zXZ\x00"):
        return "xz"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "zstd"
    return None


_ARCHIVES = ((b"PK\x03\x04", "a zip archive", "unzip"), (b"PK\x05\x06", "a zip archive", "unzip"),
             (b"7z\xbc\xaf\x27\x1c", "a 7z archive", "7z x"),
             (b"Rar!\x1a\x07", "a rar archive", "unrar x"))


def _refuse_archive(path: str, head: bytes, compressed: Optional[str]) -> None:
    for magic, what, tool in _ARCHIVES:
        if head.startswith(magic):
            raise PrepError(f"{path} is {what}, not text: extract it (`{tool}`) and name the "
                            "extracted files in corpus.paths")
    if head[257:262] == b"ustar":
        inner = f"{compressed}-compressed " if compressed else ""
        raise PrepError(f"{path} is a {inner}tar archive, not text: extract it (`tar xf`) and "
                        "name the extracted files in corpus.paths")


def open_binary(path: str) -> tuple[IO[bytes], Optional[str]]:
    """The file's bytes, decompressed as they are read, and the compression found."""
    f = open(path, "rb")
    try:
        head = f.read(512)
        f.seek(0)
        kind = _compression(head)
        if kind is None:
            _refuse_archive(path, head, None)
            return f, None
        if kind == "gzip":
            import gzip
            stream = gzip.GzipFile(fileobj=f)
        elif kind == "bz2":
            import bz2
            stream = bz2.BZ2File(f)
        elif kind == "xz":
            import lzma
            stream = lzma.LZMAFile(f)
        else:
            try:
                import zstandard
            except ImportError:
                raise PrepError(f"{path} is zstd-compressed and the zstandard package is not "
                                f"installed: decompress it (`zstd -d {path}`) or `pip install "
                                "zstandard`") from None
            stream = io.BufferedReader(_ZstdFrames(f, zstandard))
        _refuse_archive(path, stream.peek(512)[:512], kind)
        return stream, kind
    except PrepError:
        f.close()
        raise
    except Exception as e:
        f.close()
        raise _corrupt(path, kind, e) from None


class _ZstdFrames(io.RawIOBase):
    """The zstd frames of a file, one after another, decoded as they are read.

    zstandard's own stream_reader ends quietly where a file is cut off inside a frame: it
    returns what it decoded so far, so a truncated download would be read as a shorter corpus.
    Here the end of the file inside a frame is an EOFError, as gzip, bz2 and xz report it."""

    def __init__(self, f: IO[bytes], zstandard):
        self._f, self._zstandard = f, zstandard
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._in_frame = False      # bytes of the current frame fed, its end not reached
        self._out, self._at = b"", 0   # decoded bytes, and how many of them were read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._at == len(self._out):
            self._out, self._at = b"", 0
            data = self._f.read(1 << 16)
            if not data:
                if self._in_frame:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            while data:
                self._in_frame = True
                self._out += self._frame.decompress(data)
                if not self._frame.eof:
                    break
                # a frame ended: what follows it is the next frame (zstd files may hold many)
                data, self._in_frame = self._frame.unused_data, False
                self._frame = self._zstandard.ZstdDecompressor().decompressobj()
        n = min(len(buffer), len(self._out) - self._at)
        buffer[:n] = memoryview(self._out)[self._at:self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def _corrupt(path: str, kind: Optional[str], exc: BaseException) -> PrepError:
    if kind is None and isinstance(exc, OSError):
        return PrepError(f"{path}: cannot read it ({exc.strerror or exc})")
    reason = (str(exc).splitlines() or [type(exc).__name__])[0]
    return PrepError(f"{path}: corrupt or truncated {kind} data ({reason}): check it, e.g. "
                     f"`{_TEST_COMMAND.get(kind, kind)} {path}`, or replace it")


_TEST_COMMAND = {"gzip": "gzip -t", "bz2": "bzip2 -t", "xz": "xz -t", "zstd": "zstd -t"}


def _not_utf8(path: str, exc: UnicodeDecodeError) -> PrepError:
    """Locate the first invalid byte (line and byte offset) for the message."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, line = 0, 1
    f, kind = open_binary(path)
    where = f"{kind}-compressed, " if kind else ""
    with f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                bad = offset + e.start
                line += chunk[:e.start].count(b"\n")
                return PrepError(f"{path}: not UTF-8 text ({where}invalid byte "
                                 f"0x{chunk[e.start]:02x} at line {line}, byte {bad}): convert "
                                 "it, e.g. `iconv -f latin1 -t utf-8`")
            offset += len(chunk)
            line += chunk.count(b"\n")
    return PrepError(f"{path}: not UTF-8 text ({where}{exc.reason}): convert it to UTF-8")


def _lines(path: str) -> Iterator[str]:
    kind = None
    try:
        raw, kind = open_binary(path)
        with io.TextIOWrapper(raw, encoding="utf-8", newline=None) as f:
            yield from f
    except PrepError:
        raise
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    except OSError as e:    # an unreadable file, or bad gzip / bz2 data
        raise _corrupt(path, kind, e) from None
    except Exception as e:
        # Decoder errors of compressed data: EOFError (truncated), zlib.error, LZMAError,
        # ZstdError.  In plain text any other exception is a bug: keep its traceback.
        if kind is None:
            raise
        raise _corrupt(path, kind, e) from None


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

    from bert_pretrain.components.progress import on_terminal
    if not on_terminal():  # its tqdm bars would fill a log file with carriage returns
        datasets.disable_progress_bars()
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
    for doc in builtin_documents(cfg.include_topics, cfg.include_docstrings,
                                 tuple(cfg.packages)):
        yield from _sentences_of_document(doc)


def _read_table(cfg, exclude: Optional[str] = None) -> Iterator[Sentence]:
    from data_prep.table_corpus import read_table
    return read_table(cfg, exclude)


READERS = {"text": read_text, "documents": read_documents, "hf": read_hf,
           "builtin": read_builtin, "table": _read_table}


def read_corpus(cfg, exclude: Optional[str] = None) -> Iterator[Sentence]:
    return READERS[cfg.source](cfg, exclude)


def fingerprint(cfg, exclude: Optional[str] = None) -> dict:
    """What identifies the input, for the resume check (file sizes and times for files)."""
    if cfg.source in ("text", "documents", "table"):
        if cfg.source == "table":
            from data_prep.table_corpus import table_files
            files = table_files(cfg.paths, exclude)
        else:
            files = resolve_paths(cfg.paths, exclude)
        return {"files": [[os.path.abspath(p), os.path.getsize(p), int(os.path.getmtime(p))]
                          for p in files]}
    if cfg.source == "builtin":
        import sys

        from data_prep.builtin_corpus import package_version
        return {"python": sys.version.split()[0],
                **{f"package {name}": package_version(name) for name in cfg.packages}}
    return {}


def how_to_get_more_documents(cfg) -> str:
    """What to type for more documents from this corpus (said when it has too few): where
    its source ends a document, and the setting that ends them elsewhere."""
    source = getattr(cfg, "source", "")
    if source == "documents" and cfg.document_per == "file":
        return ("with corpus=documents each file is one document: give several files, or, for "
                "one big file with a blank line between documents, add "
                "corpus.document_per=blank_line")
    if source == "documents":
        return ("with corpus.document_per=blank_line a blank line ends a document: put one "
                "between your documents")
    if source == "text":
        return ("with corpus=text a blank line (or a new file) ends a document: put one between "
                "your documents, or use corpus=documents for files of paragraphs")
    return "give more documents (one per row)"
