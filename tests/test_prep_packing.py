"""MLM-only packed data (packing=full_sentences / doc_sentences) on the tagged corpus, whose every
word is one token: the instances equal a sentence-by-sentence reference packing of the
documents, lose and repeat no token, and the manifest says what the arrays hold."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from prep_arrays import PACKED_FILES, load_manifest, load_split, unmasked

from data_prep.config import PrepConfig
from data_prep.errors import PrepError
from data_prep.pipeline import run

L = 64


def _prep(prep_compose, corpus, vocab, out, packing, *extra):
    return run(prep_compose("corpus=text", f"corpus.paths=[{corpus}]", f"output_dir={out}",
                            f"tokenizer.vocab_file={vocab}", f"max_seq_length={L}",
                            f"packing={packing}", "dupe_factor=2", "validation_fraction=0.1",
                            "num_proc=1", "max_predictions_per_seq=10", *extra))


@pytest.fixture(scope="module", params=["full_sentences", "doc_sentences"])
def packed(request, prep_compose, prep_tagged, tmp_path_factory):
    corpus, vocab = prep_tagged
    out = str(tmp_path_factory.mktemp("prep_packed") / "out")
    _prep(prep_compose, corpus, vocab, out, request.param)
    return request.param, out


def _documents(out, corpus, split):
    """The split's documents as lists of sentences of token ids (one token per word), from the
    corpus text and the plan's document list."""
    vocab = open(f"{out}/tokenizer/vocab.txt", encoding="utf-8").read().split("\n")
    index = {t: i for i, t in enumerate(vocab)}
    docs = [[[index[w] for w in line.split()] for line in d.split("\n") if line.strip()]
            for d in open(corpus, encoding="utf-8").read().strip().split("\n\n")]
    return [docs[d] for d in np.load(f"{out}/.work/plan/{split}_docs.npy")]


def _reference(docs, cross_documents):
    """Whole sentences, sentence by sentence: one that fits joins the instance (a new document
    costs a [SEP] more); one that does not starts the next instance; one longer than an
    instance is cut into instance-sized pieces.  Returns instances as lists of runs."""
    out, runs, used = [], [], 1                     # used: tokens so far, [CLS] included

    def close():
        nonlocal runs, used
        if runs:
            out.append(runs)
        runs, used = [], 1
    for doc in docs:
        new_run = True
        for sentence in doc:
            rest = list(sentence)
            while rest:
                cost = len(rest) + (1 if new_run else 0)
                if used + cost <= L:
                    if new_run:
                        runs.append([])
                        used += 1
                    runs[-1] += rest
                    used += len(rest)
                    rest, new_run = [], False
                elif runs:
                    close()
                    new_run = True
                else:                               # longer than an instance
                    runs.append(rest[:L - 2])
                    rest = rest[L - 2:]
                    used = L
                    close()
        if not cross_documents:
            close()
    close()
    return out


def _instances(a, sp):
    """Unmasked instances as lists of runs (the tokens between [CLS] / [SEP]s)."""
    ids, lengths = unmasked(a), a["lengths"].astype(np.int64)
    out = []
    for row, n in zip(ids, lengths):
        assert row[0] == sp["cls"] and row[n - 1] == sp["sep"] and (row[n:] == sp["pad"]).all()
        cut = [0] + np.flatnonzero(row[:n] == sp["sep"]).tolist()
        assert all(b - a > 1 for a, b in zip(cut, cut[1:])), "an empty run"
        out.append([row[a + 1:b].tolist() for a, b in zip(cut, cut[1:])])
    return out


@pytest.mark.parametrize("split", ["train", "validation"])
def test_instances_equal_a_reference_packing(packed, prep_tagged, split):
    packing, out = packed
    m = load_manifest(out)
    shards = m["splits"][split]["shards"]
    copies = 2 if split == "train" else 1          # one work unit: a shard per dupe copy
    assert len(shards) == copies
    for s in shards:                               # no NSP files in an MLM-only shard
        assert sorted(os.listdir(os.path.join(out, s["path"]))) == sorted(
            [f + ".npy" for f in PACKED_FILES] + ["stats.json"])
    want = _reference(_documents(out, prep_tagged[0], split), packing == "full_sentences")
    got = _instances(load_split(out, split, PACKED_FILES, slice(0, 1)), m["special_token_ids"])
    assert got == want
    least = 5 if split == "train" else 1
    if packing == "doc_sentences":
        assert all(len(runs) == 1 for runs in got)
    else:
        assert sum(len(runs) > 1 for runs in got) >= least   # instances that span documents
    # Sentences longer than an instance are cut (the tagged corpus has many): full instances.
    assert sum(sum(map(len, runs)) + len(runs) + 1 == L for runs in got) >= least


def test_dupe_copies_hold_the_same_text_with_other_masks(packed):
    _, out = packed
    first, second = (load_split(out, "train", PACKED_FILES, slice(i, i + 1)) for i in (0, 1))
    assert np.array_equal(unmasked(first), unmasked(second))
    assert not np.array_equal(first["masked_positions"], second["masked_positions"])


def test_manifest_says_mlm_only_and_reports_what_the_arrays_hold(packed):
    packing, out = packed
    m = load_manifest(out)
    assert (m["format_version"], m["objective"], m["packing"]) == (2, "mlm", packing)
    a = load_split(out, "train", PACKED_FILES)
    sp = m["special_token_ids"]
    lengths = a["lengths"].astype(np.int64)
    predicted = (a["masked_positions"] > 0).sum()
    st = m["splits"]["train"]["stats"]
    assert "nsp_random_fraction" not in st
    assert st["num_instances"] == len(lengths)
    assert st["masked_fraction"] == pytest.approx(predicted / lengths.sum(), abs=1e-5)
    assert st["masked_fraction"] == pytest.approx(0.15, abs=0.01)
    assert st["fraction_at_max_length"] == pytest.approx((lengths == L).mean(), abs=1e-6)
    ids = a["input_ids"].astype(np.int64)
    seps = (ids == sp["sep"]).sum(1)                # one per run: documents per instance
    assert st["documents_per_instance"] == pytest.approx(seps.mean(), abs=1e-5)
    assert (st["documents_per_instance"] == 1.0) == (packing == "doc_sentences")


def test_token_stream_is_kept_whole_across_work_units(prep_compose, prep_tagged, tmp_path):
    """Small work units (many shards): the runs, read in shard order, are the training
    documents' tokens in corpus order, each exactly once, and a run never spans documents."""
    corpus, vocab = prep_tagged
    out = str(tmp_path / "out")
    _prep(prep_compose, corpus, vocab, out, "full_sentences", "tokens_per_shard=1000",
          "dupe_factor=1")
    m = load_manifest(out)
    assert len(m["splits"]["train"]["shards"]) > 3
    runs = [r for inst in _instances(load_split(out, "train", PACKED_FILES),
                                     m["special_token_ids"]) for r in inst]
    docs = _documents(out, corpus, "train")
    assert [t for r in runs for t in r] == [t for d in docs for s in d for t in s]
    vocab_list = open(f"{out}/tokenizer/vocab.txt", encoding="utf-8").read().split("\n")
    for r in runs:        # every d<i> tag of a run names the same document
        assert len({vocab_list[t] for t in r if vocab_list[t].startswith("d")}) <= 1


def test_output_is_deterministic_and_resumes_identically(prep_compose, prep_tagged, tmp_path):
    corpus, vocab = prep_tagged
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _prep(prep_compose, corpus, vocab, one, "full_sentences", "tokens_per_shard=2000")
    _prep(prep_compose, corpus, vocab, two, "full_sentences", "tokens_per_shard=2000",
          "num_proc=2")
    # A prep that stopped after some shards: the re-run builds the rest, the same bytes.
    shutil.rmtree(os.path.join(two, "train", "shard-00001"))
    os.remove(os.path.join(two, "manifest.json"))
    _prep(prep_compose, corpus, vocab, two, "full_sentences", "tokens_per_shard=2000")
    for split in ("train", "validation"):
        a, b = (load_split(d, split, PACKED_FILES) for d in (one, two))
        for f in PACKED_FILES:
            assert np.array_equal(a[f], b[f]), (split, f)
    ma, mb = (json.load(open(os.path.join(d, "manifest.json"))) for d in (one, two))
    assert ma["stats"] == mb["stats"] and ma["key"] == mb["key"]


def test_packing_settings(prep_compose, tmp_path):
    base = ["corpus=text", "corpus.paths=[x.txt]", f"output_dir={tmp_path}"]
    with pytest.raises(PrepError, match="packing='pairs' is not one of auto, nsp_pairs, "
                                        "full_sentences, doc_sentences"):
        prep_compose(*base, "packing=pairs")
    nsp = prep_compose(*base)
    # BERT's format keeps the key it had before packing existed (its preps resume) ...
    assert "packing" not in nsp.result_dict()
    # ... and NSP-only settings do not change a packed prep's key.
    a = prep_compose(*base, "packing=full_sentences").result_dict()
    b = prep_compose(*base, "packing=full_sentences", "short_seq_prob=0.5",
                     "random_next_prob=0.2").result_dict()
    assert a == b and a["packing"] == "full_sentences"
    assert isinstance(nsp, PrepConfig) and nsp.next_sentence_prediction


def test_one_document_is_enough_for_mlm_only(prep_compose, tmp_path):
    """NSP needs a random other document; packed data does not."""
    corpus = tmp_path / "one.txt"
    corpus.write_text("\n".join(f"sentence number {i} of the only document ." for i in range(50)))
    base = ["corpus=text", f"corpus.paths=[{corpus}]", "tokenizer.vocab_size=100",
            "validation_fraction=0", "num_proc=1"]
    with pytest.raises(PrepError, match="next-sentence prediction needs a random other"):
        run(prep_compose(*base, f"output_dir={tmp_path / 'nsp'}"))
    with pytest.raises(PrepError, match="the corpus has 1 document: a validation split needs "
                                        "1 document held out and training 1 more"):
        run(prep_compose(*base, f"output_dir={tmp_path / 'held'}", "packing=doc_sentences",
                         "validation_fraction=0.1"))
    m = run(prep_compose(*base, f"output_dir={tmp_path / 'mlm'}", "packing=doc_sentences"))
    assert m["splits"]["train"]["num_instances"] > 0
    assert m["splits"]["validation"] == {"num_instances": 0, "shards": [], "num_documents": 0,
                                         "stats": m["splits"]["validation"]["stats"]}
