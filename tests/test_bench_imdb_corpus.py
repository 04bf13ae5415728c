"""bench/imdb_corpus.py: the unlabeled IMDB reviews become one document a review and one line a
sentence, only train/unsup is read (never a labelled folder), bert-prep reads the file beside a
GLUE folder with one text column, and the dev-overlap check finds a planted sentence."""

import json
import os
import sys

import pytest

from train_support import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import imdb_corpus  # noqa: E402

REVIEWS = {
    "0_0.txt": "A fine film. I liked it!<br /><br />Would watch again? \"Yes\" and (twice).",
    "1_0.txt": "Dull plot; the cast was wasted.",
    "10_0.txt": "The best films of the year with its exploration of the obstacles to happiness.",
}


def _aclimdb(root):
    unsup = root / "aclImdb" / "train" / "unsup"
    unsup.mkdir(parents=True)
    for name, text in REVIEWS.items():
        (unsup / name).write_text(text, encoding="utf-8")
    # A labelled review whose words must never reach the corpus.
    (root / "aclImdb" / "train" / "pos").mkdir()
    (root / "aclImdb" / "train" / "pos" / "0_10.txt").write_text("labelled secret words")
    return root / "aclImdb"


def test_one_review_a_row_one_sentence_a_line_in_the_names_byte_order(tmp_path):
    imdb_corpus.main(["--aclimdb", str(_aclimdb(tmp_path)), "--out", str(tmp_path / "c.jsonl")])
    rows = [json.loads(line)["sentence"] for line in open(tmp_path / "c.jsonl")]
    assert rows[0].split("\n") == ["A fine film.", "I liked it!", "Would watch again?",
                                   "\"Yes\" and (twice)."]
    # the names' byte order (0_0, 10_0, 1_0), not numeric: the order of the measured corpus
    assert rows[1:] == [REVIEWS["10_0.txt"], REVIEWS["1_0.txt"]]
    assert "secret" not in (tmp_path / "c.jsonl").read_text()
    assert not (tmp_path / "c.jsonl.partial").exists()


def test_the_dev_overlap_check_counts_a_planted_sentence(tmp_path, capsys):
    dev = tmp_path / "dev.tsv"
    dev.write_text("sentence\tlabel\n"
                   "the best films of the year with its exploration of the obstacles .\t1\n"
                   "one of the best films of the year .\t1\n"  # 8 words: none shared
                   "nothing here is in any review at all , not one bit of it .\t0\n")
    imdb_corpus.main(["--aclimdb", str(_aclimdb(tmp_path)), "--out", str(tmp_path / "c.jsonl"),
                      "--check", str(dev)])
    assert "1 of 3 sentences share an 8-word run with the reviews, 1 are contained whole" \
        in capsys.readouterr().out


def test_bert_prep_reads_it_beside_a_glue_folder_with_one_text_column(tmp_path):
    from data_prep.config import TableCorpusConfig
    from data_prep.table_corpus import read_table

    imdb_corpus.main(["--aclimdb", str(_aclimdb(tmp_path)), "--out", str(tmp_path / "c.jsonl")])
    sst2 = tmp_path / "SST-2"
    sst2.mkdir()
    (sst2 / "train.tsv").write_text("sentence\tlabel\na charming film .\t1\n")
    (sst2 / "dev.tsv").write_text("sentence\tlabel\na dev sentence .\t0\n")
    cfg = TableCorpusConfig(paths=[str(sst2), str(tmp_path / "c.jsonl")],
                            text_columns=["sentence"])
    docs = []
    for new_doc, sentence in read_table(cfg):
        if new_doc:
            docs.append([])
        docs[-1].append(sentence)
    assert docs == [["a charming film ."],
                    ["A fine film.", "I liked it!", "Would watch again?", "\"Yes\" and (twice)."],
                    [REVIEWS["10_0.txt"]], [REVIEWS["1_0.txt"]]]


@pytest.mark.parametrize("make", ["nothing", "empty", "latin1"])
def test_a_wrong_folder_is_one_line_and_leaves_no_file(tmp_path, make):
    root = tmp_path / "aclImdb"
    if make != "nothing":
        (root / "train" / "unsup").mkdir(parents=True)
    if make == "latin1":
        (root / "train" / "unsup" / "0_0.txt").write_bytes("caf\u00e9".encode("latin-1"))
    expected = {"nothing": "no train/unsup folder in it", "empty": "no .txt reviews in it",
                "latin1": "0_0.txt: not UTF-8 text"}[make]
    with pytest.raises(SystemExit, match=expected):
        imdb_corpus.main(["--aclimdb", str(root), "--out", str(tmp_path / "c.jsonl")])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("c.jsonl")]
