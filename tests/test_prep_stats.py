"""Statistics of the prepared data on a real corpus (13 Gutenberg books), within the issue's
tolerances, measured from the arrays (not taken from the manifest)."""
from __future__ import annotations

import numpy as np
import pytest
from prep_arrays import load_manifest, load_split, measured_stats, unmasked

from conftest import GUTENBERG
from data_prep.pipeline import run


@pytest.fixture(scope="module")
def gutenberg_prep(prep_compose, prep_gutenberg_vocab, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("prep_gut") / "out")
    run(prep_compose("corpus=text", f"corpus.paths=[{GUTENBERG}]", f"output_dir={out}",
                     f"tokenizer.vocab_file={prep_gutenberg_vocab}", "dupe_factor=2",
                     "num_proc=2"))
    return out


def test_statistics_within_tolerance(gutenberg_prep):
    m = load_manifest(gutenberg_prep)
    a = load_split(gutenberg_prep, "train")
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


def test_structure_on_real_text(gutenberg_prep):
    m = load_manifest(gutenberg_prep)
    sp = m["special_token_ids"]
    a = load_split(gutenberg_prep, "train")
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


def test_validation_split_is_held_out_by_document(gutenberg_prep):
    m = load_manifest(gutenberg_prep)
    train, val = m["splits"]["train"], m["splits"]["validation"]
    assert val["num_documents"] >= 2 and train["num_documents"] >= 2
    assert train["num_documents"] + val["num_documents"] == m["counts"]["num_documents"] == 13
    a_train = unmasked(load_split(gutenberg_prep, "train"))
    a_val = unmasked(load_split(gutenberg_prep, "validation"))
    # Windows of 12 tokens from validation never occur in training (books do not overlap).
    def windows(x):
        v = np.lib.stride_tricks.sliding_window_view(x[:, 1:13], 12, axis=1)[:, 0]
        return {r.tobytes() for r in v}
    assert not windows(a_val) & windows(a_train)
