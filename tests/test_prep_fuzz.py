"""Bad settings and hostile corpora: bert-prep either does its job or stops with one line
(a PrepError; `bert-prep: error: ...`, exit 2), never a traceback.

* Config fuzz: every numeric (and boolean) field of the prep config with wrong types and
  out-of-range values, through the code path of the command line (Hydra compose +
  `build.prep_config`), and a few through the command itself.
* Property-based corpora (hypothesis): arbitrary unicode (control characters, NUL, combining
  marks, right-to-left text, emoji, odd line breaks), empty lines, one-sentence documents, tiny
  corpora; every instance written is checked structurally.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from data_prep.errors import PrepError
from time_limits import hang_limit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BERT_PREP = os.path.join(os.path.dirname(sys.executable), "bert-prep")

NUMERIC = ["seed", "max_seq_length", "max_predictions_per_seq", "masked_lm_prob",
           "short_seq_prob", "random_next_prob", "dupe_factor", "validation_fraction",
           "tokens_per_shard", "num_proc", "tokenize_batch_size", "num_hosts", "host_index",
           "tokenizer.vocab_size", "tokenizer.min_frequency", "tokenizer.limit_alphabet",
           "tokenizer.max_training_sentences", "corpus.max_documents"]
BOOLEAN = ["whole_word_mask", "overwrite", "progress", "tokenizer.do_lower_case",
           "corpus.streaming"]
HUGE = "99999999999999999999999"
BAD_VALUES = ["abc", "1.5", "-1", "1e400", "nan", "-inf", "true", "'[1]'", "'{a: 1}'", "null",
              HUGE]
# (field, value) pairs above that are legitimate settings.
VALID = {("num_proc", "null"), ("host_index", "null"), ("tokenizer.limit_alphabet", "null"),
         ("tokenizer.max_training_sentences", "null"), ("corpus.max_documents", "null"),
         ("num_hosts", HUGE), ("tokenizer.max_training_sentences", HUGE),
         ("corpus.max_documents", HUGE)}


@pytest.fixture(scope="module", autouse=True)
def hydra_once():
    """One Hydra initialisation for the module's ~300 compositions (each would cost ~50 ms)."""
    from hydra import initialize_config_dir
    with initialize_config_dir(os.path.join(REPO, "conf", "prep"), version_base="1.3"):
        yield


def _compose(*overrides):
    from hydra import compose

    from data_prep.build import prep_config
    return prep_config(compose("prep", overrides=list(overrides)))


def _corpus_args(field):
    if field.startswith("corpus.") and field != "corpus.paths":
        return ["corpus=hf", "corpus.name=some/dataset"]
    return ["corpus=text", "corpus.paths=[c.txt]"]


@pytest.mark.parametrize("field", NUMERIC + BOOLEAN)
def test_every_field_rejects_bad_values_in_one_line(field):
    values = BAD_VALUES if field in NUMERIC else ["abc", "1", "0", "1.5", "'[1]'", "null"]
    for value in values:
        args = [*_corpus_args(field), "output_dir=/nonexistent/o", f"{field}={value}"]
        if (field, value) in VALID:
            _compose(*args)
            continue
        with pytest.raises(PrepError) as e:
            _compose(*args)
        msg = str(e.value)
        assert "\n" not in msg, (field, value, msg)
        assert field.split(".")[-1] in msg, (field, value, msg)


@pytest.mark.parametrize("setting, pattern", [
    ("seed=-1", r"seed=-1 must be in \[0, 2\*\*63\)"),
    ("dupe_factor=" + HUGE, r"dupe_factor=9+ must be in \[1, 1000\]"),
    ("num_proc=1e400", r"num_proc=inf is not a valid int"),
    ("masked_lm_prob=nan", r"masked_lm_prob=nan must be in \(0, 1\)"),
    ("short_seq_prob=true", r"short_seq_prob=True is not a valid float"),
    ("tokenizer.limit_alphabet=-1", r"limit_alphabet=-1 must be in \[1, 2\*\*31 - 1\] or null"),
    ("random_next_prob=null", r"random_next_prob=null: it needs a float value \(the default "
                              r"is 0.5\)"),
])
def test_cli_bad_numbers_exit_2(tmp_path, setting, pattern):
    import re
    p = subprocess.run([BERT_PREP, "progress=false", f"output_dir={tmp_path / 'o'}", setting],
                       capture_output=True, text=True, timeout=hang_limit())
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("bert-prep: error: "), p.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert not (tmp_path / "o").exists()


# ---- hostile corpora ---------------------------------------------------------------------------
def check_prepared(out, manifest) -> int:
    """Every instance of every shard is a well-formed [CLS] A [SEP] B [SEP] row; returns the
    number of instances checked."""
    sp = manifest["special_token_ids"]
    V, L = manifest["vocab_size"], manifest["max_seq_length"]
    P = manifest["max_predictions_per_seq"]
    special = {sp[k] for k in ("pad", "cls", "sep", "mask", "unk")}
    n = 0
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            a = {k: np.load(os.path.join(out, shard["path"], k + ".npy"))
                 for k in ("input_ids", "lengths", "segment_a_lengths", "masked_positions",
                           "masked_labels", "next_sentence_labels")}
            ids, lengths, seg_a = a["input_ids"], a["lengths"].astype(int), \
                a["segment_a_lengths"].astype(int)
            N = len(ids)
            assert ids.shape == (N, L) and shard["num_instances"] == N
            assert a["masked_positions"].shape == (N, P) == a["masked_labels"].shape
            assert set(np.unique(a["next_sentence_labels"])) <= {0, 1}
            assert (ids >= 0).all() and (ids < V).all()
            for i in range(N):
                row, n_tok, sa = ids[i], lengths[i], seg_a[i]
                # [CLS] A [SEP] B [SEP] [PAD]...: A and B each hold at least one token.
                assert 3 <= sa <= n_tok - 2 and n_tok <= L, (i, sa, n_tok)
                assert row[0] == sp["cls"] and row[sa - 1] == sp["sep"]
                assert row[n_tok - 1] == sp["sep"] and (row[n_tok:] == sp["pad"]).all()
                body = np.r_[row[1:sa - 1], row[sa:n_tok - 1]]
                assert not np.isin(body, [sp["cls"], sp["sep"], sp["pad"]]).any(), row
                pos, lab = a["masked_positions"][i].astype(int), a["masked_labels"][i]
                k = int((lab != 0).sum())
                assert (lab[k:] == 0).all() and (pos[k:] == 0).all()
                pos, lab = pos[:k], lab[:k]
                assert (np.diff(pos) > 0).all() and ((pos >= 1) & (pos < n_tok)).all()
                assert not np.isin(pos, [sa - 1]).any()
                assert (lab < V).all() and not np.isin(lab, list(special)).any()
                now = row[pos]
                # Each prediction is [MASK], the original token, or a non-special token.
                assert ((now == sp["mask"]) | (now == lab) | ~np.isin(now, list(special))).all()
            n += N
    assert n == manifest["stats"]["num_instances"]
    return n


def prep_or_one_line_error(tmp_path, text: str, *settings_: str):
    """Run the pipeline in-process on `text`; return (manifest, out) or (None, error)."""
    from data_prep.pipeline import run
    import shutil
    corpus = tmp_path / "c.txt"
    corpus.write_text(text, encoding="utf-8", errors="surrogatepass")
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    cfg = _compose("corpus=text", f"corpus.paths=[{corpus}]", f"output_dir={out}",
                   "progress=false", "num_proc=1", "tokenizer.vocab_size=64",
                   "tokenizer.min_frequency=1", "tokens_per_shard=1000", *settings_)
    try:
        return run(cfg), str(out)
    except PrepError as e:
        assert "\n" not in str(e)
        assert not out.exists()          # a refused corpus leaves nothing behind
        return None, str(e)


# Characters that stress the normalizer and pre-tokenizer: C0/C1 controls and NUL, combining
# marks, right-to-left scripts and marks, CJK, emoji and joiners, odd spaces and line breaks.
HOSTILE = ("\x00\x01\x07\x08\x0b\x0c\x1b\x1c\x1f\x7f\x85\x9f\u00a0\u2028\u2029\u200b\u200d"
           "\u200e\u200f\u202e\u2066\ufeff\ufffd\u0301\u0308\u20dd\u05d0\u05e9\u0627\u0644"
           "\u06f1\u4e2d\u6587\u3042\uac00\U0001f600\U0001f469\U0001f3fd\ufe0f\U0001d11e"
           " .?!'\"[]#")
word = st.text(alphabet=st.sampled_from(HOSTILE) | st.characters(codec="utf-8",
               exclude_characters="\n\r"), min_size=0, max_size=12)
sentence = st.lists(word, min_size=0, max_size=12).map(" ".join)
document = st.lists(sentence, min_size=1, max_size=6)
corpus = st.lists(document, min_size=1, max_size=8)


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(docs=corpus, max_seq_length=st.sampled_from([8, 9, 16, 64]),
       whole_word_mask=st.booleans(), validation=st.sampled_from(["0", "0.2"]),
       blank_lines=st.integers(1, 3))
@example(docs=[["a"]], max_seq_length=8, whole_word_mask=False, validation="0", blank_lines=1)
@example(docs=[["\x00"], ["\x00 \x00"]], max_seq_length=8, whole_word_mask=True,
         validation="0", blank_lines=1)
@example(docs=[["x"], ["y"], ["z"], ["w"]], max_seq_length=9, whole_word_mask=False,
         validation="0.2", blank_lines=2)
def test_hostile_corpora_give_valid_instances_or_one_line(tmp_path, docs, max_seq_length,
                                                          whole_word_mask, validation,
                                                          blank_lines):
    text = ("\n" * (blank_lines + 1)).join("\n".join(d) for d in docs) + "\n"
    m, out = prep_or_one_line_error(tmp_path, text, f"max_seq_length={max_seq_length}",
                                    f"max_predictions_per_seq={max_seq_length // 2}",
                                    f"whole_word_mask={str(whole_word_mask).lower()}",
                                    f"validation_fraction={validation}", "dupe_factor=2")
    if m is not None:
        event(f"prepared ({'no' if check_prepared(out, m) == 0 else 'some'} instances)")
    else:
        event(f"refused: {out.split(':')[0]}")


def test_megabyte_lines(tmp_path):
    """1 MB lines: one word of 1 MB (one [UNK]), 1 MB of words, 1 MB of combining marks."""
    lines = ["x" * 1_000_000, " ".join(["word"] * 200_000), "e" + "\u0301" * 500_000]
    text = "\n\n".join(f"Before it.\n{ln}\nAfter it." for ln in lines) + "\n"
    m, out = prep_or_one_line_error(tmp_path, text, "max_seq_length=64",
                                    "validation_fraction=0")
    assert m is not None, out
    assert check_prepared(out, m) > 0


@pytest.mark.parametrize("text", [
    "\x00" * 1000,                                            # NUL bytes only
    "\u202e\u05e9\u05dc\u05d5\u05dd \U0001f600\n\n\u0627\u0644\u0639\u0631\u0628\u064a\u0629 "
    # right-to-left text and emoji
    "\U0001f469\u200d\U0001f4bb\n\n\u05e9\u05dc\u05d5\u05dd\n\n\u0645\u0631\u062d\u0628\u0627\n",
    "\n\n\n\n",                                               # empty lines only
    "one.\n\ntwo.\n",                                         # two one-sentence documents
])
def test_cli_hostile_corpora_never_traceback(tmp_path, text):
    corpus = tmp_path / "c.txt"
    corpus.write_text(text, encoding="utf-8")
    p = subprocess.run([BERT_PREP, "progress=false", "corpus=text", f"corpus.paths=[{corpus}]",
                        f"output_dir={tmp_path / 'o'}", "tokenizer.vocab_size=64",
                        "tokenizer.min_frequency=1", "validation_fraction=0"],
                       capture_output=True, text=True, timeout=hang_limit())
    assert "Traceback" not in p.stderr + p.stdout
    if p.returncode == 0:
        import json
        out = str(tmp_path / "o")
        check_prepared(out, json.loads(open(os.path.join(out, "manifest.json")).read()))
    else:
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1, p.stderr
        assert lines[0].startswith("bert-prep: error: ")
