"""Masking: determinism across num_proc, whole-word masking decided per word."""
from __future__ import annotations

import filecmp
import os

import numpy as np
import pytest
from prep_arrays import FILES, load_split, unmasked

from data_prep.pipeline import run


def _prep(prep_compose, corpus, vocab, out, *extra):
    return run(prep_compose("corpus=text", f"corpus.paths=[{corpus}]", f"output_dir={out}",
                            f"tokenizer.vocab_file={vocab}", "dupe_factor=3",
                            "tokens_per_shard=50000", *extra))


def test_output_identical_for_any_num_proc(prep_compose, prep_small,
                                           prep_vocab, tmp_path):
    m1 = _prep(prep_compose, prep_small, prep_vocab, tmp_path / "a",
               "num_proc=1")
    # num_proc=3 also takes the worker-process tokenization path (<= 2 tokenizes in-process).
    m2 = _prep(prep_compose, prep_small, prep_vocab, tmp_path / "b",
               "num_proc=3", "tokenize_batch_size=1000")
    shards = [s["path"] for sp in m1["splits"].values() for s in sp["shards"]]
    assert len(shards) > 6
    assert shards == [s["path"] for sp in m2["splits"].values() for s in sp["shards"]]
    for s in shards:
        for f in FILES:
            assert filecmp.cmp(tmp_path / "a" / s / f"{f}.npy", tmp_path / "b" / s / f"{f}.npy",
                               shallow=False), f"{s}/{f} differs"
    assert m1["stats"] == m2["stats"]
    # ... and the seed does change it.
    m3 = _prep(prep_compose, prep_small, prep_vocab, tmp_path / "c",
               "num_proc=2", "seed=7")
    a1 = np.load(tmp_path / "a" / shards[0] / "input_ids.npy")
    a3 = np.load(tmp_path / "c" / shards[0] / "input_ids.npy")
    assert a1.shape != a3.shape or not np.array_equal(a1, a3)
    assert m3["stats"]["num_instances"] > 0


def test_dupes_mask_the_same_text_differently(prep_compose, prep_small, prep_vocab, tmp_path):
    m = _prep(prep_compose, prep_small, prep_vocab, tmp_path, "num_proc=2")
    assert m["dupe_factor"] == 3
    # Train shards run through every unit for copy 0, then copy 1, then copy 2 (data_prep/plan.py).
    shards = m["splits"]["train"]["shards"]
    assert len(shards) % 3 == 0
    k = len(shards) // 3
    copies = []
    for c in range(3):
        parts = [{f: np.load(tmp_path / s["path"] / f"{f}.npy") for f in FILES}
                 for s in shards[c * k:(c + 1) * k]]
        copies.append({f: np.concatenate([p[f] for p in parts]) for f in FILES})
    for c in range(3):
        # Each copy covers the same text (within the randomness of segment boundaries) ...
        assert copies[c]["lengths"].astype(np.int64).sum() == pytest.approx(
            copies[0]["lengths"].astype(np.int64).sum(), rel=0.05)
    # ... but no copy repeats another: rows holding the very same text carry other masks.
    rows = [{r.tobytes(): i for i, r in enumerate(unmasked(a))} for a in copies]
    for c1, c2 in ((0, 1), (0, 2), (1, 2)):
        a1, a2 = copies[c1], copies[c2]
        assert a1["input_ids"].shape != a2["input_ids"].shape or \
            not np.array_equal(a1["input_ids"], a2["input_ids"])
        same_text = set(rows[c1]) & set(rows[c2])
        assert len(same_text) >= 20, "too few identical rows to compare masks"
        same_mask = sum(np.array_equal(a1["masked_positions"][rows[c1][t]],
                                       a2["masked_positions"][rows[c2][t]]) for t in same_text)
        assert same_mask <= 0.1 * len(same_text)


@pytest.fixture(scope="module")
def wwm(prep_compose, prep_small, prep_vocab, tmp_path_factory):
    out = tmp_path_factory.mktemp("prep_wwm") / "out"
    m = _prep(prep_compose, prep_small, prep_vocab, out, "num_proc=2",
              "whole_word_mask=true")
    vocab = open(os.path.join(prep_vocab, "vocab.txt"), encoding="utf-8").read()
    cont = np.array([t.startswith("##") for t in vocab.split("\n")[:-1]])
    return m, load_split(str(out), "train"), cont


def test_whole_word_masking_takes_whole_words_and_decides_per_word(wwm):
    m, a, cont = wwm
    sp = m["special_token_ids"]
    n_words = {"mask": 0, "kept": 0, "random": 0}
    mixed = n_multi = 0
    for i in range(len(a["lengths"])):
        L = int(a["lengths"][i])
        pos = a["masked_positions"][i]
        lab = a["masked_labels"][i]
        orig = a["input_ids"][i, :L].astype(np.int64).copy()
        shown = orig.copy()
        picked = np.zeros(L, bool)
        picked[pos[pos > 0]] = True
        orig[pos[pos > 0]] = lab[pos > 0]
        # Words: a token and the '##' pieces that follow it (inside one segment).
        special = np.isin(orig, list(sp.values()))
        starts = ~special & (~cont[orig] | np.r_[True, special[:-1]])
        word = np.cumsum(starts) - 1
        for w in np.unique(word[~special]):
            toks = np.flatnonzero((word == w) & ~special)
            sel = picked[toks]
            assert sel.all() or not sel.any(), f"row {i}: word partly predicted"
            if not sel.any():
                continue
            kinds = {"mask" if s == sp["mask"] else "kept" if s == o else "random"
                     for s, o in zip(shown[toks], orig[toks])}
            if len(toks) > 1:
                n_multi += 1
                mixed += len(kinds) > 1
            n_words[sorted(kinds)[0]] += 1
    total = sum(n_words.values())
    assert n_multi > 500
    # A random replacement can equal the original by chance (1 in 8k): nearly never mixed.
    assert mixed <= 0.002 * n_multi
    assert n_words["mask"] / total == pytest.approx(0.8, abs=0.015)
    assert n_words["kept"] / total == pytest.approx(0.1, abs=0.015)
    assert n_words["random"] / total == pytest.approx(0.1, abs=0.015)


def test_whole_word_masking_rate(wwm):
    m, a, _ = wwm
    pred = (a["masked_positions"] > 0).sum()
    assert pred / a["lengths"].astype(np.int64).sum() == pytest.approx(0.15, abs=0.01)
    assert m["masking"]["whole_word_mask"] is True
