"""Fast corpus encoding: tokenize each distinct space-separated chunk once.

BERT's normalizer (clean-up, accent stripping, lower-casing) works character by character and
its pre-tokenizer always splits at a space, so the ids of a sentence are exactly the ids of its
``text.split(" ")`` chunks, concatenated.  Natural text repeats its words (Zipf): the 6 MB
Gutenberg corpus has 1.2 M chunks but only 94 k distinct ones, so encoding each distinct chunk
once with the Rust tokenizer and gathering the rest in numpy is ~4x faster than encoding every
sentence.  The cache is bounded (200 k chunks, ~25 MB; cleared when full), so memory does not
grow with the corpus.  Tokenizers whose pipeline does not split at spaces this way (a
byte-level or Metaspace pre-tokenizer, say) fall back to plain `encode_batch_fast`.  Exactness
is tested against `encode_batch` on real text, accents, CJK and control characters included.
"""
from __future__ import annotations

import itertools
import json

import numpy as np

_SPACE_SPLITTING_PRE = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}
_CHAR_LOCAL_NORM = {"BertNormalizer", "Lowercase", "NFD", "NFKD", "StripAccents", "Strip"}


def space_split_is_exact(tokenizer) -> bool:
    spec = json.loads(tokenizer.to_str())

    def ok(node, allowed):
        if node is None:
            return True
        if node.get("type") == "Sequence":
            key = "normalizers" if "normalizers" in node else "pretokenizers"
            return all(ok(n, allowed) for n in node.get(key, []))
        return node.get("type") in allowed
    pre = spec.get("pre_tokenizer")
    return (pre is not None and ok(pre, _SPACE_SPLITTING_PRE)
            and ok(spec.get("normalizer"), _CHAR_LOCAL_NORM))


class CorpusEncoder:
    """encode(texts) -> (flat ids, per-text lengths), without special tokens."""

    def __init__(self, tokenizer, dtype, max_cache: int = 200_000):
        self.tokenizer = tokenizer
        self.dtype = np.dtype(dtype)
        self.max_cache = max_cache
        self.cached = space_split_is_exact(tokenizer)
        self._reset()

    def _reset(self) -> None:
        self.index: dict[str, int] = {}
        self.tokens = np.zeros(0, self.dtype)      # ids of all cached chunks, back to back
        self.offsets = np.zeros(1, np.int64)       # chunk i: tokens[offsets[i]:offsets[i+1]]

    def _plain(self, texts: list[str]):
        encs = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        lens = np.fromiter((len(e.ids) for e in encs), np.int64, count=len(encs))
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), self.dtype,
                          count=int(lens.sum()))
        return ids, lens

    def _encode_chunks(self, chunks: list[str], per_text: int = 2048):
        """Ids of distinct chunks: joined by spaces into long texts (one Encoding per text is
        far cheaper than one per chunk), then split back by each token's character offset."""
        texts, starts = [], []
        for i in range(0, len(chunks), per_text):
            part = chunks[i:i + per_text]
            texts.append(" ".join(part))
            lens = np.fromiter(map(len, part), np.int64, count=len(part)) + 1
            starts.append(np.cumsum(lens) - lens)
        encs = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        ids, owner = [], []
        base = 0
        for enc, st in zip(encs, starts):
            ids.append(np.array(enc.ids, self.dtype))
            if len(enc.ids):
                first = np.array(enc.offsets, np.int64).reshape(-1, 2)[:, 0]
                owner.append(base + np.searchsorted(st, first, side="right") - 1)
            base += len(st)
        ids = np.concatenate(ids) if ids else np.zeros(0, self.dtype)
        owner = np.concatenate(owner) if owner else np.zeros(0, np.int64)
        return ids, np.bincount(owner, minlength=len(chunks))

    def encode(self, texts: list[str]):
        if not self.cached:
            return self._plain(texts)
        chunks = " ".join(texts).split(" ")
        n_chunks = np.fromiter(map(_count_spaces, texts), np.int64, count=len(texts)) + 1
        index = self.index
        # Registration order of new chunks does not matter (each is encoded on its own terms).
        new = set(chunks).difference(index)
        if len(index) + len(new) > self.max_cache:
            self._reset()
            index = self.index
            new = set(chunks)
        if new:
            new = sorted(new)
            ids, lens = self._encode_chunks(new)
            base = len(index)
            index.update(zip(new, range(base, base + len(new))))
            self.tokens = np.concatenate([self.tokens, ids])
            self.offsets = np.concatenate([self.offsets, self.offsets[-1] + np.cumsum(lens)])
        cid = np.fromiter(map(index.__getitem__, chunks), np.int64, count=len(chunks))
        starts = self.offsets[cid]
        clen = self.offsets[cid + 1] - starts
        total = int(clen.sum())
        src = np.arange(total) - np.repeat(np.cumsum(clen) - clen - starts, clen)
        tok_end = np.concatenate([[0], np.cumsum(clen)])[np.cumsum(n_chunks)]
        lens = np.diff(np.concatenate([[0], tok_end]))
        return self.tokens[src], lens


def _count_spaces(text: str) -> int:
    return text.count(" ")
