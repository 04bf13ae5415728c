"""MLM-only instances of one work unit: whole sentences packed up to `max_seq_length` (RoBERTa).

An instance is ``[CLS] run [SEP] run [SEP] ... run [SEP]``, where a run is a stretch of
consecutive sentences of one document.  Sentences are added while they fit; the first that does
not fit starts the next instance, so no sentence is split across instances, except one longer
than a whole instance, which is cut into instance-sized pieces (the alternative, dropping it,
would lose text; truncating it, too).
  * full_sentences (RoBERTa's FULL-SENTENCES): at the end of a document the instance goes on
    with the next document of the unit; the [SEP] after the run marks the boundary.
  * doc_sentences (DOC-SENTENCES): an instance holds one run, and ends with its document.  The
    last instance of a document is usually short.
Documents follow in corpus order, within a work unit (plan.py): each unit ends its last instance,
so the output does not depend on how units are dealt to processes.  Packing draws no random
numbers: dupe copies of a unit hold the same instances with other masks.

As in instances.py, the loop handles only token offsets (a few bisections per instance); the
tokens are gathered and the rows assembled for the whole shard at once (`assemble_packed`).
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from data_prep.masking import MaskingTables


@dataclass
class Packed:
    """Runs [start, start + len) of the token store; instance i is runs off[i]:off[i + 1]."""
    run_start: np.ndarray    # int64
    run_len: np.ndarray      # int64, >= 1
    off: np.ndarray          # int64 [num_instances + 1]

    @property
    def num_instances(self) -> int:
        return len(self.off) - 1

    def lengths(self) -> np.ndarray:
        """Tokens of each instance: [CLS], then each run and its [SEP]."""
        if not self.num_instances:
            return np.zeros(0, np.int64)
        return 1 + np.add.reduceat(self.run_len + 1, self.off[:-1])

    def doc_boundaries(self) -> int:
        """[SEP]s inside instances that separate two documents (runs after the first)."""
        return len(self.run_len) - self.num_instances


def pack_unit(pieces: np.ndarray, sent_off: np.ndarray, max_seq_length: int,
              cross_documents: bool) -> Packed:
    """Instances of the pieces (document, first sentence, end sentence, ...) of one unit;
    `sent_off` is the token store's sentence offsets."""
    capacity = max_seq_length - 1          # after [CLS]; each run costs its length + its [SEP]
    sent_off = np.asarray(sent_off)
    starts: list[int] = []
    lens: list[int] = []
    off = [0]
    room = capacity

    def close() -> None:
        nonlocal room
        if room < capacity:
            off.append(len(starts))
            room = capacity

    for _, s0, s1, _ in np.asarray(pieces).tolist():
        bounds = sent_off[s0:s1 + 1].tolist()      # sentence boundaries of the piece
        t, end = bounds[0], bounds[-1]
        while t < end:
            fit = room - 1                          # tokens this run may have
            # The furthest sentence boundary the run can reach (t may lie inside a sentence
            # that was cut: then its end is the first boundary).
            b = bounds[bisect_right(bounds, t + fit) - 1] if fit > 0 else t
            if b <= t:
                if room < capacity:                 # the next sentence needs a new instance
                    close()
                    continue
                b = t + fit                         # longer than an instance: cut it
            starts.append(t)
            lens.append(b - t)
            room -= b - t + 1
            t = b
        if not cross_documents:
            close()
    close()
    return Packed(np.array(starts, np.int64), np.array(lens, np.int64), np.array(off, np.int64))


def assemble_packed(buf: np.ndarray, pos: np.ndarray, packed: Packed, max_seq_length: int,
                    t: MaskingTables) -> np.ndarray:
    """[N, L] int32 rows; run r's tokens are buf[pos[r]:pos[r] + run_len[r]]."""
    n, L = packed.num_instances, max_seq_length
    ids = np.full((n, L), t.pad_id, np.int32)
    if not n:
        return ids
    ids[:, 0] = t.cls_id
    run_len = packed.run_len
    per_instance = np.diff(packed.off)
    instance = np.repeat(np.arange(n), per_instance)
    cost = run_len + 1
    before = np.cumsum(cost) - cost                 # cost of all earlier runs (any instance)
    col = 1 + before - np.repeat(before[packed.off[:-1]], per_instance)   # run's first column
    within = np.arange(int(run_len.sum())) - np.repeat(np.cumsum(run_len) - run_len, run_len)
    ids[np.repeat(instance, run_len), np.repeat(col, run_len) + within] = \
        buf[np.repeat(pos, run_len) + within]
    ids[instance, col + run_len] = t.sep_id
    return ids
