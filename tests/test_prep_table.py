"""bert-prep from a labelled task's own files (corpus=table): only the text columns reach the
prepared data, never the label column; a GLUE folder gives its train.tsv; packing=auto packs the
rows MLM-only; a missing or misnamed column is one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data_prep.errors import PrepError
from data_prep.pipeline import run
from time_limits import hang_limit

# the console script of the Python running the suite (a GPU machine has no .venv in the checkout)
BERT_PREP = os.path.join(os.path.dirname(sys.executable), "bert-prep")
WORDS = ("the film is good bad long short funny dull warm cold plot actor story scene ending "
         "music slow great poor fine").split()
# The labels are words of letters the text never uses (q, x, z): if any label reached the
# tokenizer or the instances, a piece with one of them would be in the vocabulary or the data.
LEAK = set("qxz")


def _label(i: int) -> str:
    return "zq" + "x" * (i % 7 + 1) + "qz" + str(i)


def _rows(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [(" ".join(rng.choice(WORDS, size=8)), " ".join(rng.choice(WORDS, size=6)),
             _label(i)) for i in range(n)]


def _write(path, rows, fmt: str) -> str:
    path = str(path)
    if fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for a, b, y in rows:
                f.write(json.dumps({"review": a, "summary": b, "label": y}) + "\n")
        return path
    sep = "\t" if fmt == "tsv" else ","
    with open(path, "w", encoding="utf-8") as f:
        f.write(sep.join(["review", "summary", "label"]) + "\n")
        f.writelines(sep.join(r) + "\n" for r in rows)
    return path


def _prep(prep_compose, out, *overrides):
    return run(prep_compose("corpus=table", f"output_dir={out}", "tokenizer.vocab_size=300",
                            "tokenizer.min_frequency=1", "max_seq_length=32", "dupe_factor=1",
                            "validation_fraction=0.1", *overrides))


def _prepared_pieces(out) -> set:
    """Every piece of the vocabulary and every token the instances hold (masks written back)."""
    vocab = open(os.path.join(out, "tokenizer", "vocab.txt"), encoding="utf-8").read().split()
    used = set()
    for split in ("train", "validation"):
        for shard in sorted(os.listdir(os.path.join(out, split))):
            d = os.path.join(out, split, shard)
            ids = np.load(os.path.join(d, "input_ids.npy")).astype(np.int64)
            labels = np.load(os.path.join(d, "masked_labels.npy")).astype(np.int64)
            used |= set(ids.ravel().tolist()) | set(labels.ravel().tolist())
    return set(vocab), {vocab[i] for i in used}


def _leaks(pieces) -> list:
    return sorted(p for p in pieces if LEAK & set(p))


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_labels_never_reach_the_prepared_data(prep_compose, tmp_path, fmt):
    path = _write(tmp_path / f"train.{fmt}", _rows(60, 1), fmt)
    m = _prep(prep_compose, tmp_path / "out", f"corpus.paths=[{path}]",
              "corpus.text_columns=[review,summary]")
    assert m["packing"] == "full_sentences"      # packing=auto for the rows of a table
    assert m["counts"]["num_documents"] == 60 and m["counts"]["num_sentences"] == 120
    vocab, used = _prepared_pieces(tmp_path / "out")
    assert "film" in used and _leaks(vocab) == [] and _leaks(used) == []
    # the check can fail: named as text, the label column does reach the data
    _prep(prep_compose, tmp_path / "leaky", f"corpus.paths=[{path}]",
          "corpus.text_columns=[review,label]")
    vocab, used = _prepared_pieces(tmp_path / "leaky")
    assert _leaks(vocab) and _leaks(used)


def test_a_glue_folder_gives_its_training_text(prep_compose, tmp_path, capfd):
    """A GLUE task's folder: its train.tsv, text columns found by the header (RTE's sentence1,
    sentence2), the label and index columns left out; dev.tsv (what a fine-tune is scored on)
    is not read."""
    folder = tmp_path / "RTE"
    folder.mkdir()
    for name, seed in (("train.tsv", 1), ("dev.tsv", 2)):
        rows = _rows(40, seed)
        if name == "dev.tsv":   # dev text that would show if it were read
            rows = [(a + " qqdevqq", b, y) for a, b, y in rows]
        with open(folder / name, "w", encoding="utf-8", newline="") as f:
            f.write("index\tsentence1\tsentence2\tlabel\n")
            # '\r' before a tab, as public copies of SST-2's train.tsv have it
            f.writelines(f"{i}\t{a}\r\t{b}\t{y}\n" for i, (a, b, y) in enumerate(rows))
    m = _prep(prep_compose, tmp_path / "out", f"corpus.paths=[{folder}]")
    assert "packing=full_sentences (auto:" in capfd.readouterr().out
    assert m["counts"]["num_documents"] == 40 and m["counts"]["num_sentences"] == 80
    vocab, used = _prepared_pieces(tmp_path / "out")
    assert _leaks(vocab) == [] and _leaks(used) == []
    assert not any(p.isdigit() for p in vocab)     # nor the index column


def test_text_corpora_keep_nsp_pairs(prep_compose, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("\n\n".join("\n".join(" ".join(r[:2]) for r in _rows(6, d))
                                for d in range(6)), encoding="utf-8")
    m = run(prep_compose("corpus=text", f"corpus.paths=[{text}]", f"output_dir={tmp_path / 'o'}",
                         "tokenizer.vocab_size=100", "tokenizer.min_frequency=1",
                         "max_seq_length=32", "dupe_factor=1", "validation_fraction=0"))
    assert m["packing"] == "nsp_pairs"


def test_nsp_pairs_of_one_sentence_rows_warn_that_the_balance_is_off(prep_compose, tmp_path,
                                                                    capfd):
    """Asked for NSP pairs, a table of one-sentence rows can only pair most of them at random:
    bert-prep says so (with the share and what to do) instead of writing a 60-80% random-next
    set silently; documents of many sentences keep the asked 50% and no warning."""
    rows = _rows(300, 3)
    path = _write(tmp_path / "train.csv", rows, "csv")
    m = _prep(prep_compose, tmp_path / "rows", f"corpus.paths=[{path}]",
              "corpus.text_columns=[review]", "packing=nsp_pairs")
    err = capfd.readouterr().err
    got = m["stats"]["nsp_random_fraction"]
    assert got > 0.6
    said = [line for line in err.splitlines() if "random-next" in line]
    assert len(said) == 1 and "packing=full_sentences" in said[0]
    assert said[0].startswith(f"bert-prep: warning: {got:.1%} of the NSP pairs are random-next, "
                              f"not the 50% asked")
    # run again (already complete): the same warning, with the table
    _prep(prep_compose, tmp_path / "rows", f"corpus.paths=[{path}]",
          "corpus.text_columns=[review]", "packing=nsp_pairs")
    assert "random-next, not the 50% asked" in capfd.readouterr().err
    # the same sentences as documents of 10: the balance holds, nothing said
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join("\n".join(a for a, _, _ in rows[i:i + 10])
                                for i in range(0, len(rows), 10)), encoding="utf-8")
    m = _prep(prep_compose, tmp_path / "docs", f"corpus.paths=[{text}]", "corpus=text")
    assert m["packing"] == "nsp_pairs" and abs(m["stats"]["nsp_random_fraction"] - 0.5) < 0.1
    assert "random-next" not in capfd.readouterr().err


def test_column_mistakes_are_one_line(prep_compose, tmp_path):
    csv_file = _write(tmp_path / "train.csv", _rows(10, 1), "csv")
    jsonl = _write(tmp_path / "train.jsonl", _rows(10, 1), "jsonl")
    for path, columns, said in (
            (csv_file, "[reveiw]", "has no column 'reveiw' (it has ['review', 'summary', "
                                   "'label']); fix corpus.text_columns"),
            (jsonl, "[review,text]", "line 1 has no field 'text'"),
            (csv_file, None, "which columns are text? name them"),
            (jsonl, None, "name the fields that hold text")):
        extra = [f"corpus.text_columns={columns}"] if columns else []
        with pytest.raises(PrepError, match=said.replace("[", r"\[").replace("(", r"\(")
                           .replace(")", r"\)").replace("]", r"\]").replace("?", r"\?")):
            _prep(prep_compose, tmp_path / "out", f"corpus.paths=[{path}]", *extra)
        assert not os.path.exists(tmp_path / "out")     # nothing left behind
    # on the command line: one line, exit 2
    p = subprocess.run([BERT_PREP, "corpus=table", f"corpus.paths=[{csv_file}]",
                        "corpus.text_columns=[reveiw]", f"output_dir={tmp_path / 'cli'}"],
                       capture_output=True, text=True, timeout=hang_limit())
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [
        f"bert-prep: error: {csv_file} has no column 'reveiw' (it has ['review', 'summary', "
        f"'label']); fix corpus.text_columns"]
