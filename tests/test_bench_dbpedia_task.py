"""bench/dbpedia_task.py: the second task of the in-domain table is split as documented (143 rows
of every class held out, nothing in both files, the same files every time) and the files read as
bert-finetune's custom task reads them."""

import collections
import csv
import os
import random
import sys

import pytest

from train_support import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import dbpedia_task  # noqa: E402


def _raw(path, per_class=200):
    rng = random.Random(7)
    rows = [(str(label), f"entity {label} number {i}\tits second sentence , with a comma .")
            for label in range(len(dbpedia_task.CLASSES)) for i in range(per_class)]
    rng.shuffle(rows)
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return rows


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_every_class_holds_out_the_same_share_and_no_text_is_in_both(tmp_path):
    _raw(tmp_path / "raw.csv")
    dbpedia_task.main(["--raw", str(tmp_path / "raw.csv"), "--out", str(tmp_path / "a")])
    train, dev = _read(tmp_path / "a" / "train.csv"), _read(tmp_path / "a" / "dev.csv")
    assert collections.Counter(r["label"] for r in dev) == \
        {name: dbpedia_task.DEV_PER_CLASS for name in dbpedia_task.CLASSES}
    assert collections.Counter(r["label"] for r in train) == \
        {name: 200 - dbpedia_task.DEV_PER_CLASS for name in dbpedia_task.CLASSES}
    assert not {r["text"] for r in train} & {r["text"] for r in dev}
    # the label is the class name of the row's id, and the tab between sentences is a space
    first = next(r for r in train if r["text"].startswith("entity 3 "))
    assert first["label"] == "Athlete" and "\t" not in first["text"]
    assert first["text"].endswith("its second sentence , with a comma .")


def test_the_split_is_the_same_every_time_and_moves_with_the_seed(tmp_path):
    _raw(tmp_path / "raw.csv")
    for out, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        dbpedia_task.main(["--raw", str(tmp_path / "raw.csv"), "--out", str(tmp_path / out),
                           "--seed", seed])
    dev = {out: (tmp_path / out / "dev.csv").read_bytes() for out in "abc"}
    assert dev["a"] == dev["b"] and dev["a"] != dev["c"]


def test_the_files_read_as_a_custom_task(tmp_path):
    from bert_pretrain.finetune.tasks import TaskConfig
    from bert_pretrain.finetune.reading import read_task

    _raw(tmp_path / "raw.csv")
    dbpedia_task.main(["--raw", str(tmp_path / "raw.csv"), "--out", str(tmp_path / "t")])
    data = read_task(TaskConfig(name="custom", train_file=str(tmp_path / "t" / "train.csv"),
                                validation_file=str(tmp_path / "t" / "dev.csv"),
                                text_columns=["text"]))
    assert data.num_labels == 14 and len(data.train) == 14 * (200 - 143)
    assert sorted(data.label_names) == sorted(dbpedia_task.CLASSES)


@pytest.mark.parametrize("row", [["3"], ["14", "text"], ["x", "text"]])
def test_a_file_of_another_shape_is_one_line(tmp_path, row):
    with open(tmp_path / "raw.csv", "w", newline="") as f:
        csv.writer(f).writerows([["1", "fine"], row])
    with pytest.raises(SystemExit, match=r"raw.csv row 2: expected 'label,text'"):
        dbpedia_task.main(["--raw", str(tmp_path / "raw.csv"), "--out", str(tmp_path / "o")])


def test_a_file_that_is_not_utf8_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "raw.csv").write_bytes('1,caf\u00e9 in Paris\n'.encode("latin-1"))
    with pytest.raises(SystemExit, match=r"raw.csv: not UTF-8 text: convert it, e.g. iconv"):
        dbpedia_task.main(["--raw", str(tmp_path / "raw.csv"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
