"""Statistics of the prepared data on a real corpus (the builtin one: Python's documentation,
572 documents, ~2M tokens with dupe_factor=4), within the issue's tolerances, measured from the
arrays (not taken from the manifest)."""
from __future__ import annotations

import numpy as np
import pytest
from prep_arrays import load_manifest, load_split, measured_stats, unmasked

from data_prep.pipeline import run


@pytest.fixture(scope="module")
def builtin_prep(prep_compose, prep_builtin_text, prep_vocab, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("prep_builtin_out") / "out")
    run(prep_compose("corpus=text", f"corpus.paths=[{prep_builtin_text[0]}]",
                     f"output_dir={out}", f"tokenizer.vocab_file={prep_vocab}", "dupe_factor=4",
                     "num_proc=2"))
    return out, prep_builtin_text[1]


def test_statistics_within_tolerance(builtin_prep):
    out, num_docs = builtin_prep
    m = load_manifest(out)
    a = load_split(out, "train")
    assert len(a["lengths"]) > 15000
    got = measured_stats(a, m["special_token_ids"]["mask"])
    assert got["masked_fraction"] == pytest.approx(0.15, abs=0.005)
    assert got["mask_token_fraction"] == pytest.approx(0.80, abs=0.01)
    assert got["kept_fraction"] == pytest.approx(0.10, abs=0.01)
    assert got["random_token_fraction"] == pytest.approx(0.10, abs=0.01)
    assert got["nsp_random_fraction"] == pytest.approx(0.50, abs=0.01)
    # The manifest reports what the arrays hold.
    st = m["splits"]["train"]["stats"]
    for key, value in got.items():
        assert st[key] == pytest.approx(value, abs=2e-3), key
    assert st["num_instances"] == len(a["lengths"])
    assert st["mean_seq_length"] == pytest.approx(a["lengths"].mean(), abs=1e-3)
    assert st["fraction_at_max_length"] == pytest.approx((a["lengths"] == 128).mean(), abs=1e-6)
    assert m["stats"]["num_instances"] == sum(s["num_instances"]
                                             for s in m["splits"].values())


def test_structure_on_real_text(builtin_prep):
    out, num_docs = builtin_prep
    m = load_manifest(out)
    sp = m["special_token_ids"]
    a = load_split(out, "train")
    ids, L, A = a["input_ids"].astype(np.int64), a["lengths"].astype(np.int64), \
        a["segment_a_lengths"].astype(np.int64)
    n, width = ids.shape
    ar = np.arange(n)
    assert width == m["max_seq_length"] == 128
    assert (L <= 128).all() and (A >= 3).all() and (L - A >= 2).all()
    assert (ids[:, 0] == sp["cls"]).all()
    assert (ids[ar, A - 1] == sp["sep"]).all() and (ids[ar, L - 1] == sp["sep"]).all()
    col = np.arange(width)[None, :]
    assert (ids[col >= L[:, None]] == sp["pad"]).all()
    inner = (col > 0) & (col < L[:, None] - 1) & (col != (A - 1)[:, None])
    assert not np.isin(ids[inner], [sp["cls"], sp["sep"], sp["pad"]]).any()
    pos = a["masked_positions"].astype(np.int64)
    sel = pos > 0
    both = sel[:, 1:] & sel[:, :-1]
    assert (np.diff(pos, axis=1)[both] > 0).all()                      # ascending, distinct
    assert not (~sel[:, :-1] & sel[:, 1:]).any()                       # padding slots at the end
    assert (sel.sum(1) >= 1).all() and (sel.sum(1) <= m["max_predictions_per_seq"]).all()
    rows = np.repeat(ar, pos.shape[1]).reshape(pos.shape)
    assert (pos[sel] < L[rows[sel]]).all() and (pos[sel] != A[rows[sel]] - 1).all()
    labels = a["masked_labels"].astype(np.int64)
    assert not np.isin(labels[sel], list(sp.values())).any()       # no special token predicted
    assert (labels[~sel] == 0).all()
    shown = ids[rows[sel], pos[sel]]
    assert not np.isin(shown, [sp["cls"], sp["sep"], sp["pad"], sp["unk"]]).any()
    # The unmasked sequence has no [MASK] left.
    assert not (unmasked(a)[col < L[:, None]] == sp["mask"]).any()


def test_validation_split_is_held_out_by_document(builtin_prep):
    out, num_docs = builtin_prep
    m = load_manifest(out)
    train, val = m["splits"]["train"], m["splits"]["validation"]
    assert val["num_documents"] >= 2 and train["num_documents"] >= 2
    assert train["num_documents"] + val["num_documents"] == m["counts"]["num_documents"] == num_docs
    a_train = unmasked(load_split(out, "train"))
    a_val = unmasked(load_split(out, "validation"))
    # Windows of 16 tokens (inside the first segment) from validation rows.  Python's docs repeat
    # themselves (boilerplate, and modules with a pure-Python twin such as _pyio / io), so ~11%
    # of the windows recur in other documents; a leaked validation document would put nearly
    # all of them in training.
    def windows(x, seg_a):
        w = np.lib.stride_tricks.sliding_window_view(x, 16, axis=1)
        ok = np.arange(w.shape[1])[None, :] + 16 < seg_a[:, None]
        return {r.tobytes() for r in w[ok]}
    val = windows(a_val, load_split(out, "validation")["segment_a_lengths"].astype(np.int64))
    shared = val & windows(a_train, load_split(out, "train")["segment_a_lengths"]
                           .astype(np.int64))
    assert len(val) > 1000
    print(f"{len(shared)} of {len(val)} validation windows occur in training")
    assert len(shared) < 0.25 * len(val)
