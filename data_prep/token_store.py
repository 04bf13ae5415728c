"""The tokenized corpus on disk: flat token ids plus sentence and document offsets.

The corpus is tokenized once, streaming, in large batches (`encoder.py`: each distinct word
chunk is encoded once, by the Rust tokenizer on all threads), and appended to three flat files
under ``<output_dir>/.work/tokens/``:

  tokens.bin     all token ids, sentence after sentence (uint16 or int32)
  sent_off.bin   int64 [num_sentences + 1]: token offset of each sentence
  doc_off.bin    int64 [num_documents + 1]: sentence offset of each document

Instance creation reads them through `np.memmap`, so memory does not grow with the corpus and
`dupe_factor` copies reuse one tokenization.  The directory is written as ``tokens.tmp`` and
renamed when complete: a crash mid-way leaves nothing that looks finished.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from data_prep.errors import PrepError, os_error


@dataclass
class TokenStore:
    tokens: np.ndarray      # [num_tokens]
    sent_off: np.ndarray    # [num_sentences + 1] int64
    doc_off: np.ndarray     # [num_documents + 1] int64

    @property
    def num_documents(self) -> int:
        return len(self.doc_off) - 1

    @property
    def num_sentences(self) -> int:
        return len(self.sent_off) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def doc_num_tokens(self) -> np.ndarray:
        return np.diff(self.sent_off[self.doc_off])

    @classmethod
    def open(cls, directory: str) -> "TokenStore":
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)

        def mm(name, dtype, n):
            if n == 0:
                return np.zeros(0, dtype)
            return np.memmap(os.path.join(directory, name), dtype=dtype, mode="r", shape=(n,))
        return cls(mm("tokens.bin", meta["dtype"], meta["num_tokens"]),
                   mm("sent_off.bin", np.int64, meta["num_sentences"] + 1),
                   mm("doc_off.bin", np.int64, meta["num_documents"] + 1))


def read_blocks(arr: np.ndarray, starts, lens, gap_bytes: int = 4096):
    """The ranges ``[s, s + n)`` of `arr`, read as few blocks: returns ``(buf, pos)`` where
    ``buf[pos[i]:pos[i] + lens[i]] == arr[starts[i]:starts[i] + lens[i]]``.

    Ranges that overlap or lie closer than `gap_bytes` share one block, so `buf` is at most the
    ranges' total length plus the small gaps: never the span between far-apart ranges (a work
    unit whose documents are spread over the corpus, e.g. validation documents, would otherwise
    read a span that grows with the corpus).  For a memory map, blocks are read with pread()
    instead of through the mapping: random reads across a large corpus (random-next segments)
    would otherwise leave every page they touched in the process's resident set."""
    starts = np.asarray(starts, np.int64)
    lens = np.asarray(lens, np.int64)
    if not len(starts):
        return np.zeros(0, arr.dtype), np.zeros(0, np.int64)
    size = arr.dtype.itemsize
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], starts[order] + lens[order]
    reach = np.maximum.accumulate(e)
    new = np.concatenate([[True], s[1:] > reach[:-1] + gap_bytes // size])
    heads = np.flatnonzero(new)
    block_s = s[heads]
    block_e = np.maximum.reduceat(e, heads)
    if isinstance(arr, np.memmap) and arr.filename is not None:
        buf = np.empty(int((block_e - block_s).sum()), arr.dtype)
        view = memoryview(buf).cast("B")
        fd = os.open(arr.filename, os.O_RDONLY)
        try:
            at = 0
            for bs, be in zip(block_s.tolist(), block_e.tolist()):
                n, where = (be - bs) * size, arr.offset + bs * size
                while n:      # straight into the buffer; a regular file reads in one go
                    got = os.preadv(fd, [view[at:at + n]], where)
                    if got == 0:
                        raise PrepError(f"{arr.filename} is shorter than its meta.json says: "
                                        "delete the output_dir's .work/tokens and re-run")
                    at, n, where = at + got, n - got, where + got
        finally:
            os.close(fd)
    else:
        a = np.asarray(arr)
        buf = np.concatenate([a[bs:be] for bs, be in zip(block_s.tolist(), block_e.tolist())])
    block_at = np.cumsum(block_e - block_s) - (block_e - block_s)   # block offsets in buf
    block_of = np.cumsum(new) - 1
    pos = np.empty_like(starts)
    pos[order] = block_at[block_of] + (s - block_s[block_of])
    return buf, pos


def read_ranges(arr: np.ndarray, starts, lens, gap_bytes: int = 4096) -> np.ndarray:
    """``concatenate([arr[s:s + n] for s, n in zip(starts, lens)])``, read by `read_blocks`."""
    lens = np.asarray(lens, np.int64)
    buf, pos = read_blocks(arr, starts, lens, gap_bytes)
    if not len(pos):
        return buf
    first = np.cumsum(lens) - lens
    idx = np.arange(int(lens.sum())) - np.repeat(first - pos, lens)
    return buf[idx]


def is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "meta.json"))


# Worker side of parallel tokenization: one encoder (and its chunk cache) per process.
_ENCODER = None


def _init_encoder(tokenizer_json: str, dtype: str) -> None:
    global _ENCODER
    from data_prep.workers import init_worker_process
    init_worker_process()
    # A fork()ed child must not use the Rust thread pool of its parent; each worker encodes
    # on one thread and the workers run side by side.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    from data_prep.encoder import CorpusEncoder
    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True
    _ENCODER = CorpusEncoder(tok, dtype)


def _encode(texts: list[str]):
    return _ENCODER.encode(texts)


def _batches(sentences, batch_size: int):
    texts: list[str] = []
    flags: list[bool] = []
    for flag, text in sentences:
        texts.append(text)
        flags.append(flag)
        if len(texts) >= batch_size:
            yield texts, flags
            texts, flags = [], []
    if texts:
        yield texts, flags


def _encoded(sentences, tokenizer, dtype: str, batch_size: int, num_proc: int):
    """(ids, lengths, flags) per batch, in corpus order.

    Up to 2 processes, the batches are encoded here, the Rust tokenizer using num_proc threads
    for the distinct chunks: measured on 2 cores, this costs 30% less CPU than 2 worker
    processes (which each warm their own chunk cache and pickle their batches) and is faster
    under load.  With more processes, the Python side of encoding becomes the bottleneck, and
    the batches go to num_proc worker processes, at most 2 per worker in flight so memory
    stays bounded.  The output is identical either way."""
    if num_proc <= 2:
        from data_prep.encoder import CorpusEncoder
        encoder = CorpusEncoder(tokenizer, dtype)
        for texts, flags in _batches(sentences, batch_size):
            yield (*encoder.encode(texts), flags)
        return
    import collections
    import multiprocessing as mp
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with mp.get_context(method).Pool(num_proc, _init_encoder,
                                     (tokenizer.to_str(), dtype)) as pool:
        pending: collections.deque = collections.deque()
        for texts, flags in _batches(sentences, batch_size):
            pending.append((pool.apply_async(_encode, (texts,)), flags))
            if len(pending) >= 2 * num_proc:
                res, fl = pending.popleft()
                yield (*res.get(), fl)
        while pending:
            res, fl = pending.popleft()
            yield (*res.get(), fl)


def tokenize_corpus(sentences: Iterator[tuple[bool, str]], tokenizer, directory: str,
                    dtype: str, batch_size: int, progress: bool = True,
                    num_proc: int = 1) -> TokenStore:
    """Stream (starts_document, text) pairs through the tokenizer into `directory`."""
    import socket

    from bert_pretrain.components.progress import progress_bar
    tmp = f"{directory}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    ftok = open(os.path.join(tmp, "tokens.bin"), "wb")
    fsent = open(os.path.join(tmp, "sent_off.bin"), "wb")
    fdoc = open(os.path.join(tmp, "doc_off.bin"), "wb")
    np.zeros(1, np.int64).tofile(fsent)
    state = {"tokens": 0, "sentences": 0, "documents": 0, "pending_start": False}
    bar = progress_bar(desc="tokenize", unit="sent", enabled=progress)

    def write(ids: np.ndarray, lens: np.ndarray, flags: list[bool]) -> None:
        keep = np.flatnonzero(lens)
        # A sentence that tokenizes to nothing is dropped; if it started a document, the next
        # kept sentence starts it instead (so documents are never lost or merged).
        c = np.cumsum(np.asarray(flags, np.int64))
        if len(keep):
            before = np.concatenate([[0], c[keep[:-1]]])
            starts = (c[keep] - before) > 0
            starts[0] |= state["pending_start"]
            state["pending_start"] = bool(c[-1] - c[keep[-1]] > 0)
            doc_starts = state["sentences"] + np.flatnonzero(starts)
            doc_starts.astype(np.int64).tofile(fdoc)
            state["documents"] += len(doc_starts)
            ids.tofile(ftok)
            (state["tokens"] + np.cumsum(lens[keep])).astype(np.int64).tofile(fsent)
            state["tokens"] += int(lens.sum())
            state["sentences"] += len(keep)
        else:
            state["pending_start"] = state["pending_start"] or bool(c[-1] > 0)
        bar.update(len(flags))

    try:
        for ids, lens, flags in _encoded(sentences, tokenizer, dtype, batch_size, num_proc):
            write(ids, lens, flags)
        np.array([state["sentences"]], np.int64).tofile(fdoc)
        for f in (ftok, fsent, fdoc):
            f.close()
    except BaseException as e:
        for f in (ftok, fsent, fdoc):
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):   # disk full while writing the tokenized corpus
            raise os_error(e, "writing the tokenized corpus (.work/tokens)",
                           os.path.dirname(os.path.abspath(tmp))) from None
        raise
    finally:
        bar.close()
    if state["tokens"] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PrepError("the corpus holds no text (no sentence produced a token): check "
                        "corpus.paths / the dataset and its text column")
    meta = {"dtype": dtype, "num_tokens": state["tokens"], "num_sentences": state["sentences"],
            "num_documents": state["documents"]}
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f)
    try:
        os.rename(tmp, directory)
    except OSError:   # another host finished the same (identical) tokenization first
        shutil.rmtree(tmp, ignore_errors=True)
    return TokenStore.open(directory)
