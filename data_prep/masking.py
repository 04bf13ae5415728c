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


def assemble(tokens: np.ndarray, seg, max_seq_length: int, t: MaskingTables) -> np.ndarray:
    """[N, L] int32 rows: one gather from the token store through a per-cell source index."""
    n, L = len(seg.a_start), max_seq_length
    col = np.arange(L, dtype=np.int64)[None, :]
    a_len = seg.a_len[:, None]
    b_first = a_len + 2                      # column of B's first token
    end = b_first + seg.b_len[:, None]       # column of the final [SEP]
    in_a = (col >= 1) & (col <= a_len)
    in_b = (col >= b_first) & (col < end)
    src = np.where(in_a, seg.a_start[:, None] + col - 1, seg.b_start[:, None] + col - b_first)
    src = np.where(in_a | in_b, src, 0)
    ids = np.asarray(tokens[src.ravel()], np.int32).reshape(n, L)
    ids[~(in_a | in_b)] = t.pad_id
    ids[:, 0] = t.cls_id
    ar = np.arange(n)
    ids[ar, seg.a_len + 1] = t.sep_id
    ids[ar, end[:, 0]] = t.sep_id
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
    P = max_predictions
    ar = np.arange(n)
    cand = ~t.special[ids]
    k = np.minimum(P, np.maximum(1, np.rint(lengths * masked_lm_prob)))
    k = np.minimum(k.astype(np.int64), cand.sum(1))
    if whole_word_mask:
        sel, word = _choose_words(cand, ids, k, t, rng)
    else:
        # The k candidates with the smallest random keys (float64 keys: no ties in practice).
        keys = rng.random((n, L))
        keys[~cand] = 2.0
        threshold = np.sort(keys, axis=1)[ar, np.maximum(k - 1, 0)]
        sel = (keys <= threshold[:, None]) & (k > 0)[:, None]
    # Chosen columns in ascending order, padded with L (a stable radix sort of uint16).
    col = np.arange(L, dtype=np.uint16)
    pos = np.sort(np.where(sel, col, np.uint16(L)), axis=1, kind="stable")[:, :P]
    pos = pos.astype(np.int64)
    valid = pos < L
    pos[~valid] = 0
    original = np.take_along_axis(ids, pos, axis=1)
    if whole_word_mask:   # one draw per word: every piece of a word gets the same treatment
        decide = rng.random((n, L))[ar[:, None], np.take_along_axis(word, pos, axis=1)]
    else:
        decide = rng.random((n, P))
    replacement = t.replacements[rng.integers(0, len(t.replacements), (n, P))]
    is_mask = (decide < 0.8) & valid
    is_random = (decide >= 0.9) & valid
    new = np.where(is_mask, t.mask_id, np.where(is_random, replacement, original))
    flat = (ar[:, None] * L + pos)[valid]
    ids.reshape(-1)[flat] = new[valid]
    labels = np.where(valid, original, 0)
    n_pred = int(valid.sum())
    counts = {"predicted": n_pred, "mask": int(is_mask.sum()), "random": int(is_random.sum()),
              "kept": n_pred - int(is_mask.sum()) - int(is_random.sum())}
    return pos, labels, counts
