"""The plan: which documents are held out, and how each split is cut into work units.

A work unit is a run of ~`tokens_per_shard` tokens of one split, cut at sentence boundaries,
made of pieces ``(document, first_sentence, end_sentence, index_in_split)``.  Unit `u` of split `s` with dupe
copy `k` is one output shard, built with its own RNG seeded by ``(seed, s, u, k)``: the output
depends on the config only, never on `num_proc` or on which machine builds which shard, and a
resumed run skips finished shards one by one.

Validation documents are drawn by a seeded permutation of whole documents, until they hold
`validation_fraction` of the tokens, and at least two of them (a random-next segment for a
validation instance comes from another *validation* document; MLM-only data needs one).  A
corpus of few large documents therefore gives a larger validation share than asked (two
Gutenberg books of 13 are ~15%); split such books into chapters, or set validation_fraction=0.
"""
from __future__ import annotations

import os
from array import array
from dataclasses import dataclass

import numpy as np

from data_prep.errors import PrepError
from data_prep.token_store import TokenStore

SPLITS = ("train", "validation")
SPLIT_IDS = {"train": 0, "validation": 1}


@dataclass
class SplitPlan:
    name: str
    docs: np.ndarray          # sorted document ids of the split
    pieces: np.ndarray        # [num_pieces, 4] int64: document, first sentence, end sentence,
                              # and the document's index in `docs`
    unit_off: np.ndarray      # [num_units + 1] offsets into pieces
    dupe_factor: int

    @property
    def num_units(self) -> int:
        return len(self.unit_off) - 1

    @property
    def num_shards(self) -> int:
        return self.num_units * self.dupe_factor

    def shard(self, index: int) -> tuple[int, int]:
        """(unit, dupe) of a shard: shards run through all units for dupe 0, then dupe 1..."""
        return index % self.num_units, index // self.num_units

    def unit_pieces(self, unit: int) -> np.ndarray:
        return self.pieces[self.unit_off[unit]:self.unit_off[unit + 1]]

    def save(self, directory: str) -> None:
        for key in ("docs", "pieces", "unit_off"):
            np.save(os.path.join(directory, f"{self.name}_{key}.npy"), getattr(self, key))

    @classmethod
    def load(cls, directory: str, name: str, dupe_factor: int, mmap: bool = True) -> "SplitPlan":
        mode = "r" if mmap else None
        arrs = [np.load(os.path.join(directory, f"{name}_{k}.npy"), mmap_mode=mode)
                for k in ("docs", "pieces", "unit_off")]
        return cls(name, *arrs, dupe_factor=dupe_factor)


def choose_validation_docs(doc_tokens: np.ndarray, fraction: float, seed: int,
                           next_sentence_prediction: bool = True,
                           more_documents: str = "give more documents") -> np.ndarray:
    """Held-out documents; with NSP each split needs two (a random-next segment comes from
    another document of the same split), MLM-only packed data needs one.  `more_documents`:
    how this corpus gets more of them (its source's rule, said in the error)."""
    n = len(doc_tokens)
    if n < 2 and next_sentence_prediction:
        raise PrepError(f"the corpus has {n} document: next-sentence prediction needs a random "
                        f"other document; {more_documents}")
    if fraction == 0:
        return np.zeros(0, np.int64)
    least = 2 if next_sentence_prediction else 1
    if n < 2 * least:
        def docs(k: int) -> str:
            return f"{k} document{'s' if k != 1 else ''}"
        raise PrepError(f"the corpus has {docs(n)}: a validation split needs {docs(least)} "
                        f"held out and training {least} more; {more_documents}, or set "
                        "validation_fraction=0")
    order = np.random.default_rng(np.random.SeedSequence([seed, 7919])).permutation(n)
    cum = np.cumsum(doc_tokens[order])
    k = int(np.searchsorted(cum, fraction * cum[-1], side="left")) + 1
    k = min(max(k, least), n - least)
    return np.sort(order[:k])


def cut_units(store: TokenStore, docs: np.ndarray, tokens_per_unit: int) -> tuple:
    """Greedy cut of the split's documents (in order) into units of ~tokens_per_unit tokens.
    Pieces are collected in compact int64 arrays (24 bytes per piece), not Python tuples."""
    sent_off, doc_off = np.asarray(store.sent_off), np.asarray(store.doc_off)
    p_doc, p_first, p_end, p_pos = array("q"), array("q"), array("q"), array("q")
    unit_off = array("q", [0])
    filled = 0
    for lo in range(0, len(docs), 1 << 16):           # documents in blocks: bounded temporaries
        block = np.asarray(docs[lo:lo + (1 << 16)], np.int64)
        firsts, ends = doc_off[block].tolist(), doc_off[block + 1].tolist()
        for pos, (d, s0, s1) in enumerate(zip(block.tolist(), firsts, ends), start=lo):
            while s0 < s1:
                room = tokens_per_unit - filled
                if int(sent_off[s1] - sent_off[s0]) <= room:
                    cut = s1
                else:  # cut inside the document at the first sentence boundary past the room
                    cut = int(np.searchsorted(sent_off, sent_off[s0] + room, side="left"))
                    cut = min(max(cut, s0 + 1), s1)
                p_doc.append(d)
                p_first.append(s0)
                p_end.append(cut)
                p_pos.append(pos)
                filled += int(sent_off[cut] - sent_off[s0])
                s0 = cut
                if filled >= tokens_per_unit:
                    unit_off.append(len(p_doc))
                    filled = 0
    if unit_off[-1] != len(p_doc):
        unit_off.append(len(p_doc))
    pieces = np.stack([np.frombuffer(a, np.int64) if len(a) else np.zeros(0, np.int64)
                       for a in (p_doc, p_first, p_end, p_pos)], axis=1)
    return pieces, np.frombuffer(unit_off, np.int64).copy()


def make_plan(store: TokenStore, validation_fraction: float, tokens_per_shard: int,
              dupe_factor: int, seed: int, next_sentence_prediction: bool = True,
              more_documents: str = "give more documents") -> dict[str, SplitPlan]:
    doc_tokens = store.doc_num_tokens()
    val = choose_validation_docs(doc_tokens, validation_fraction, seed, next_sentence_prediction,
                                 more_documents)
    is_val = np.zeros(store.num_documents, bool)
    is_val[val] = True
    plans = {}
    # Validation is masked once: a second mask of the same held-out text adds no information.
    for name, docs, dupes in (("train", np.flatnonzero(~is_val), dupe_factor),
                              ("validation", val, 1)):
        docs = docs.astype(np.int64)
        pieces, unit_off = cut_units(store, docs, tokens_per_shard)
        plans[name] = SplitPlan(name, docs, pieces, unit_off, dupes)
    return plans
