"""Assemble `[CLS] A [SEP] B [SEP]` rows and apply the masked-LM masks, a whole shard at once.

Google's `create_masked_lm_predictions`, vectorised over [N, L] arrays:
  * num_to_predict = min(max_predictions_per_seq, max(1, round(length * masked_lm_prob))),
    length counting [CLS] and [SEP] like Google;
  * candidates are all tokens except special ones ([CLS] [SEP] [PAD] [MASK] [UNK] and bracketed
    placeholders such as [unused0]): a special token is never predicted;
  * positions are picked uniformly at random among candidates; with whole-word masking, whole
    words (a token plus its '##' continuations) are picked in random order, skipping a word that
    would exceed the budget, as Google does;
  * each picked token becomes [MASK] (80%), stays (10%) or becomes a random token (10%).  With
    whole-word masking that choice is made once per word (Google draws it per sub-token), and
    random tokens are drawn from non-special ids only (Google can insert [CLS], [unused5] ...).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class MaskingTables:
    """Per-vocabulary lookup tables, built once per process."""
    special: np.ndarray          # bool [V]: never predicted, never a random replacement
    continuation: np.ndarray     # bool [V]: '##' pieces
    replacements: np.ndarray     # int32: ids a random replacement is drawn from
    pad_id: int
    cls_id: int
    sep_id: int
    mask_id: int


def _ranges(starts: np.ndarray, lens: np.ndarray):
    """(row, offset-within-range) of every element of the concatenated ranges."""
    total = int(lens.sum())
    rows = np.repeat(np.arange(len(lens)), lens)
    within = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    return rows, within, np.repeat(starts, lens) + within


def assemble(tokens: np.ndarray, seg, max_seq_length: int, t: MaskingTables) -> np.ndarray:
    n = len(seg.a_start)
    ids = np.full((n, max_seq_length), t.pad_id, np.int32)
    ids[:, 0] = t.cls_id
    rows, within, src = _ranges(seg.a_start, seg.a_len)
    ids[rows, 1 + within] = tokens[src]
    rows, within, src = _ranges(seg.b_start, seg.b_len)
    ids[rows, seg.a_len[rows] + 2 + within] = tokens[src]
    ar = np.arange(n)
    ids[ar, seg.a_len + 1] = t.sep_id
    ids[ar, seg.a_len + seg.b_len + 2] = t.sep_id
    return ids


def _choose_words(cand: np.ndarray, ids: np.ndarray, k: np.ndarray, t: MaskingTables,
                  rng: np.random.Generator):
    """Whole-word selection.  Returns (selected [N, L], word index [N, L])."""
    n, L = cand.shape
    prev = np.zeros_like(cand)
    prev[:, 1:] = cand[:, :-1]
    starts = cand & (~t.continuation[ids] | ~prev)
    word = np.cumsum(starts, axis=1) - 1
    word = np.where(cand, word, 0)
    n_words = starts.sum(1)
    keys = rng.random((n, L))
    keys[np.arange(L)[None, :] >= n_words[:, None]] = 2.0
    order = np.argsort(keys, axis=1)
    rows = np.repeat(np.arange(n), L).reshape(n, L)
    word_len = np.bincount((rows * L + word)[cand], minlength=n * L).reshape(n, L)
    taken = np.zeros(n, np.int64)
    chosen = np.zeros((n, L), bool)
    ar = np.arange(n)
    for r in range(int(n_words.max(initial=0))):
        w = order[:, r]
        wl = word_len[ar, w]
        # Google's loop: a word that does not fit in the budget is skipped, later ones may fit.
        take = (r < n_words) & (taken + wl <= k)
        taken += np.where(take, wl, 0)
        chosen[ar, w] = take
        if not ((taken < k) & (r + 1 < n_words)).any():
            break
    return cand & chosen[rows, word], word


def mask_rows(ids: np.ndarray, lengths: np.ndarray, masked_lm_prob: float,
              max_predictions: int, whole_word_mask: bool, t: MaskingTables,
              rng: np.random.Generator):
    """Mask `ids` in place.  Returns (positions [N, P], labels [N, P], counts dict)."""
    n, L = ids.shape
    cand = ~t.special[ids]
    k = np.minimum(max_predictions, np.maximum(1, np.rint(lengths * masked_lm_prob)))
    k = np.minimum(k.astype(np.int64), cand.sum(1))
    if whole_word_mask:
        sel, word = _choose_words(cand, ids, k, t, rng)
    else:
        keys = rng.random((n, L))
        keys[~cand] = 2.0
        order = np.argsort(keys, axis=1)
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(L)[None, :].repeat(n, 0), axis=1)
        sel = rank < k[:, None]
    r_idx, c_idx = np.nonzero(sel)                 # row-major: positions ascending per row
    count = sel.sum(1)
    slot = np.arange(len(r_idx)) - np.repeat(np.cumsum(count) - count, count)
    original = ids[r_idx, c_idx]
    if whole_word_mask:
        decide = rng.random((n, L))[r_idx, word[r_idx, c_idx]]   # one draw per word
    else:
        decide = rng.random(len(r_idx))
    replacement = t.replacements[rng.integers(0, len(t.replacements), len(r_idx))]
    is_mask = decide < 0.8
    is_random = decide >= 0.9
    ids[r_idx, c_idx] = np.where(is_mask, t.mask_id, np.where(is_random, replacement, original))
    positions = np.zeros((n, max_predictions), np.int64)
    labels = np.zeros((n, max_predictions), np.int64)
    positions[r_idx, slot] = c_idx
    labels[r_idx, slot] = original
    counts = {"predicted": int(len(r_idx)), "mask": int(is_mask.sum()),
              "random": int(is_random.sum()), "kept": int((~is_mask & ~is_random).sum())}
    return positions, labels, counts
