"""NSP instances of one work unit: Google's `create_instances_from_document`, minus its bugs.

The Python loop below handles only sentence indices and token offsets (ints); tokens are gathered
and masked later for the whole shard at once (`masking.py`).  Semantics follow Google's
create_pretraining_data.py:
  * sentences are added to a chunk until it reaches a target length (`max_seq_length - 3`, or
    with probability `short_seq_prob` a random length in [2, max]);
  * segment A is the chunk's first 1..n-1 sentences (a random split), B the rest ("actual
    next"), or with probability `random_next_prob` B is drawn from a random other document and
    the unused sentences of the chunk are put back;
  * `truncate_seq_pair` then trims the longer segment, one token at a time, from the front or
    the back at random.
What we do differently, on purpose:
  * the random document is never the chunk's own document (Google can pick it);
  * a single-sentence chunk is not forced to random-next (Google's bias: 58.5% random-next on
    Wikipedia): B is then taken from the document's following sentences.  Only when no
    following sentence exists is the instance forced random, and the next free choice that
    would be random is made "actual next" instead, so the output stays at `random_next_prob`;
  * the short target length is drawn per instance, not once per document (Google shortens a
    whole document at a time; per instance makes `short_seq_prob` the fraction of instances);
  * truncation draws the front/back trims as one binomial per segment: the same distribution as
    Google's token-by-token coin flips, vectorised.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from data_prep.token_store import read_ranges


@dataclass
class Segments:
    """Token ranges [start, start + len) of each instance's segments in the token store."""
    a_start: np.ndarray
    a_len: np.ndarray
    b_start: np.ndarray
    b_len: np.ndarray
    is_random_next: np.ndarray   # bool
    doc: np.ndarray              # document of segment A
    b_doc: np.ndarray            # document of segment B


def _uniforms(rng: np.random.Generator):
    """Endless stream of U[0,1) Python floats, drawn from `rng` in blocks (fast in a loop)."""
    while True:
        yield from rng.random(4096).tolist()


def create_instances(pieces: np.ndarray, sent_off: np.ndarray, doc_off: np.ndarray,
                     split_docs: np.ndarray, max_seq_length: int, short_seq_prob: float,
                     random_next_prob: float, rng: np.random.Generator) -> Segments:
    """Instances of the pieces (document, first sentence, end sentence, index in split_docs)
    of one unit.  `sent_off`/`doc_off` are the token store's offsets, `split_docs` the sorted
    documents of the split (random-next segments come from these only), `rng` the unit's."""
    max_tokens = max_seq_length - 3          # room for [CLS] A [SEP] B [SEP]
    u = _uniforms(rng).__next__
    a0, a1, b0, b1, rand, docs = [], [], [], [], [], []
    r_draw, r_start, r_target = [], [], []   # random-next B is resolved after the loop
    debt = 0   # instances forced to random-next, still to be given back as actual-next
    n_docs = len(split_docs)
    sent_off_file = sent_off                  # random reads go through read_ranges (pread)
    sent_off = np.asarray(sent_off)           # plain ndarray views: no memmap indexing overhead
    pieces = np.asarray(pieces)
    doc_ends = np.asarray(doc_off)[pieces[:, 0] + 1].tolist() if len(pieces) else []

    doc_pos = []                              # index of each instance's document in split_docs
    for (d, s0, s1, pos), doc_end in zip(pieces.tolist(), doc_ends):
        off = sent_off[s0:s1 + 1].tolist()  # off[k]: token offset of sentence s0 + k
        n = s1 - s0
        start = 0
        while start < n:
            target = max_tokens if u() >= short_seq_prob else 2 + int(u() * (max_tokens - 1))
            # The chunk grows sentence by sentence until it reaches the target length or the
            # end of the piece: its last sentence i is found by bisection.
            i = bisect_left(off, off[start] + target, start + 1) - 1
            if i >= n:
                i = n - 1
            n_chunk = i - start + 1
            a_end = start + 1 if n_chunk == 1 else start + 1 + int(u() * (n_chunk - 1))
            random_next = u() < random_next_prob
            can_follow = n_chunk >= 2 or s0 + i + 1 < doc_end
            if random_next and debt > 0 and can_follow:
                random_next, debt = False, debt - 1
            elif not random_next and not can_follow:
                random_next, debt = True, debt + 1
            a0.append(off[start])
            a1.append(off[a_end])
            docs.append(d)
            doc_pos.append(pos)
            rand.append(random_next)
            if random_next:
                r_draw.append(u())
                r_start.append(u())
                r_target.append(target - (off[a_end] - off[start]))
                b0.append(-1)
                b1.append(-1)
                start = a_end              # the unused sentences go back to the document
            elif n_chunk >= 2:
                b0.append(off[a_end])
                b1.append(off[i + 1])
                start = i + 1
            else:
                # One long sentence: B is the following sentences of the same document, up to
                # the target length (at least one sentence), possibly past this unit's piece.
                first = s0 + i + 1
                b_first = int(sent_off[first])
                want = b_first + max(target - (off[i + 1] - off[start]), 1)
                # Every sentence has a token, so B needs at most max_tokens sentences.
                window = sent_off[first:min(first + max_tokens, doc_end) + 1]
                end = first + int(np.searchsorted(window, want, side="left"))
                end = min(max(end, first + 1), doc_end)
                b0.append(b_first)
                b1.append(int(sent_off[end]))
                start = end - s0

    a0, a1 = np.array(a0, np.int64), np.array(a1, np.int64)
    b0, b1 = np.array(b0, np.int64), np.array(b1, np.int64)
    rand = np.array(rand, bool)
    docs = np.array(docs, np.int64)
    b_doc = docs.copy()
    if rand.any():
        # Random-next B: a document other than A's (an index drawn among the n-1 others), a
        # random first sentence, then sentences up to the remaining target length.
        # Reads anywhere in the corpus: through read_ranges, in sentence windows.
        idx = np.flatnonzero(rand)
        own = np.array(doc_pos, np.int64)[idx]        # A's document's index in split_docs
        pick = (np.array(r_draw) * (n_docs - 1)).astype(np.int64)
        pick += pick >= own
        # (Document-level arrays, 16 bytes per document, are read through the mapping.)
        rdoc = np.asarray(split_docs[pick], np.int64)
        first_s, end_s = np.asarray(doc_off[rdoc]), np.asarray(doc_off[rdoc + 1])
        s = first_s + (np.array(r_start) * (end_s - first_s)).astype(np.int64)
        # sent_off[s .. s + max_tokens] (within the document) holds B's end: every sentence
        # has at least one token.
        width = np.minimum(s + max_tokens, end_s) - s + 1           # >= 2
        win = read_ranges(sent_off_file, s, width)
        row0 = np.cumsum(width) - width
        start_tok = win[row0]
        want = start_tok + np.maximum(np.array(r_target, np.int64), 1)
        j = np.arange(len(win)) - np.repeat(row0, width)
        hit = (win >= np.repeat(want, width)) & (j >= 1)
        first_hit = np.minimum.reduceat(np.where(hit, j, np.iinfo(np.int64).max), row0)
        j_end = np.where(first_hit == np.iinfo(np.int64).max, width - 1, first_hit)
        b0[idx], b1[idx] = start_tok, win[row0 + j_end]
        b_doc[idx] = rdoc
    a_start, a_len, b_start, b_len = truncate_pairs(a0, a1 - a0, b0, b1 - b0, max_tokens, rng)
    return Segments(a_start, a_len, b_start, b_len, rand, docs, b_doc)


def truncate_pairs(a_start, a_len, b_start, b_len, max_tokens: int, rng: np.random.Generator):
    """Vectorised `truncate_seq_pair`: while too long, trim one token of the longer segment
    (B on a tie) from its front or back with equal odds."""
    excess = np.maximum(a_len + b_len - max_tokens, 0)
    gap = np.abs(a_len - b_len)
    first = np.minimum(excess, gap)                    # the longer one alone, down to a tie
    rest = np.maximum(excess - gap, 0)                 # then alternately, B first
    cut_a = np.where(a_len > b_len, first, 0) + rest // 2
    cut_b = np.where(a_len > b_len, 0, first) + (rest + 1) // 2
    front_a = rng.binomial(cut_a, 0.5)
    front_b = rng.binomial(cut_b, 0.5)
    return a_start + front_a, a_len - cut_a, b_start + front_b, b_len - cut_b
