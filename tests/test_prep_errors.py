"""Bad input: a one-line `bert-prep: error: ...` naming the problem and the fix, exit status 2,
no traceback, and no output dir that training would accept."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from data_prep.errors import PrepError
from data_prep.pipeline import run
from time_limits import hang_limit

BERT_PREP = os.path.join(os.path.dirname(sys.executable), "bert-prep")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BERT_PREP, "progress=false", *args], capture_output=True, text=True,
                          timeout=hang_limit())


def assert_one_line_error(p: subprocess.CompletedProcess, pattern: str) -> None:
    import re
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("tokenize")]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("bert-prep: error: "), lines[0]
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in p.stderr + p.stdout


def test_cli_bad_inputs(tmp_path):
    out = tmp_path / "out"
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Première ligne.\nCafé crème.\n".encode("latin-1"))
    gz = tmp_path / "cut.txt.gz"
    gz.write_bytes(__import__("gzip").compress(b"A line.\n" * 1000)[:40])
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("not a directory\n")
    cases = [
        (["corpus=text", f"corpus.paths=[{tmp_path / 'nope.txt'}]"],
         r"no such file or directory: .*nope\.txt"),
        (["corpus=text", f"corpus.paths=[{latin1}]"],
         r"latin1\.txt: not UTF-8 text \(invalid byte 0xe8 at line 1, byte 5\): convert it"),
        (["max_seq_length=5"], r"max_seq_length=5 is too short: use at least 8"),
        (["masked_lm_prob=1.5"], r"masked_lm_prob=1.5 must be in \(0, 1\)"),
        (["+colour=blue"], r"unknown setting colour"),
        (["max_seq_length=abc"], r"max_seq_length='abc' is not a valid int"),
        (["corpus=nope"], r"Could not find 'corpus/nope'; Available options in 'corpus': "
                          r"builtin, documents, hf, table, text"),
        (["max_seq_lenght=64"], r"Could not override 'max_seq_lenght'"),
        (["corpus=text", f"corpus.paths=[{gz}]"],
         r"cut\.txt\.gz: corrupt or truncated gzip data .*check it, e\.g\. `gzip -t"),
    ]
    for args, pattern in cases:
        p = cli(f"output_dir={out}", *args)
        assert_one_line_error(p, pattern)
        assert not out.exists(), args
    p = cli()
    assert_one_line_error(p, r"output_dir is not set: pass output_dir=")
    p = cli(f"output_dir={a_file}")
    assert_one_line_error(p, r"output_dir='.*a_file\.txt' is an existing file, not a "
                             r"directory: choose a directory path \(nothing was written\)")
    p = cli(f"output_dir={a_file}/sub")
    assert_one_line_error(p, r"a part of the path is a file, not a directory: choose another "
                             r"output_dir")
    assert a_file.read_text() == "not a directory\n"


@pytest.mark.parametrize("setting, pattern", [
    ("masked_lm_prob=0", r"masked_lm_prob=0.0 must be in \(0, 1\)"),
    ("masked_lm_prob=1", r"masked_lm_prob=1.0 must be in \(0, 1\)"),
    ("max_seq_length=7", r"max_seq_length=7 is too short"),
    ("max_predictions_per_seq=0", r"max_predictions_per_seq=0 must be in \[1, "),
    ("dupe_factor=0", r"dupe_factor=0 must be in \[1, 1000\]"),
    ("validation_fraction=0.7", r"validation_fraction=0.7 must be in"),
    ("tokenizer.vocab_size=10", r"vocab_size=10 is too small"),
    ("corpus.paths=[]", r"corpus.paths is empty"),
    ("num_hosts=2 host_index=2", r"host_index=2 must be in \[0, num_hosts=2\)"),
])
def test_bad_settings(prep_compose, tmp_path, setting, pattern):
    with pytest.raises(PrepError, match=pattern):
        prep_compose("corpus=text", f"corpus.paths=[{tmp_path}]", f"output_dir={tmp_path}/o",
                     *setting.split())


def _text(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


@pytest.mark.parametrize("text, pattern", [
    ("", r"the corpus holds no text"),
    ("\n\n   \n\t\n", r"the corpus holds no text"),
    ("One sentence.\nAnother one.\nA third.\n",
     r"the corpus has 1 document: .*with corpus=text a blank line \(or a new file\) ends a doc"),
    ("a.\n\nb.\n\nc.\n", r"the corpus has 3 documents: .*validation_fraction=0"),
])
def test_bad_corpora(prep_compose, tmp_path, text, pattern):
    corpus = _text(tmp_path, "c.txt", text)
    out = tmp_path / "out"
    cfg = prep_compose("corpus=text", f"corpus.paths=[{corpus}]", f"output_dir={out}",
                       "tokenizer.vocab_size=64", "tokenizer.min_frequency=1")
    with pytest.raises(PrepError, match=pattern):
        run(cfg)
    assert not out.exists()


def test_one_big_file_of_documents_is_told_what_to_type(prep_compose, tmp_path):
    """corpus=documents makes a file one document: one big file with blank lines between its
    documents is one document there, and the error names the setting that splits it (which
    then works), not corpus=text's rule."""
    corpus = _text(tmp_path, "big.txt", "".join(
        f"Document {i} starts here. It has a second sentence about topic {i}.\n\n"
        for i in range(8)))
    out = tmp_path / "out"
    args = ("corpus=documents", f"corpus.paths=[{corpus}]", f"output_dir={out}",
            "tokenizer.vocab_size=64", "tokenizer.min_frequency=1", "validation_fraction=0")
    with pytest.raises(PrepError, match=r"the corpus has 1 document: .*with corpus=documents "
                                        r"each file is one document: .*add "
                                        r"corpus.document_per=blank_line$"):
        run(prep_compose(*args))
    assert not out.exists()
    split = run(prep_compose(*args, "corpus.document_per=blank_line"))
    assert split["counts"]["num_documents"] == 8


def test_vocab_without_special_tokens(prep_compose, tmp_path):
    corpus = _text(tmp_path, "c.txt", "a b.\n\nc d.\n")
    vocab = _text(tmp_path, "vocab.txt", "[PAD]\n[UNK]\n[CLS]\na\nb\nc\nd\n.\n")
    p = cli("corpus=text", f"corpus.paths=[{corpus}]", f"output_dir={tmp_path / 'out'}",
            f"tokenizer.vocab_file={vocab}")
    assert_one_line_error(p, r"vocab\.txt lacks the special token\(s\) \[SEP\] \[MASK\]: add")
    assert not (tmp_path / "out").exists()


def test_output_dir_that_is_not_ours_is_never_touched(prep_compose, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    corpus = _text(tmp_path, "c.txt", "a b.\n\nc d.\n\ne f.\n\ng h.\n")
    with pytest.raises(PrepError, match="exists and is not a bert-prep output"):
        run(prep_compose("corpus=text", f"corpus.paths=[{corpus}]",
                         f"output_dir={tmp_path / 'out'}", "overwrite=true"))
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"


def test_output_dir_inside_the_corpus_is_not_read(prep_compose, tmp_path):
    _text(tmp_path, "c.txt", "a b.\n\nc d.\n\ne f.\n\ng h.\n")
    cfg = prep_compose("corpus=text", f"corpus.paths=[{tmp_path}]",
                       f"output_dir={tmp_path / 'out'}", "tokenizer.vocab_size=64",
                       "tokenizer.min_frequency=1", "validation_fraction=0")
    m = run(cfg)
    assert m["counts"]["num_documents"] == 4 and m["counts"]["num_sentences"] == 4
    assert run(cfg)["stats"] == m["stats"]     # its own output is still not corpus on a re-run
