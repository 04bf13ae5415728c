"""A second task of another kind for the in-domain pretraining table (docs/finetuning-results.md):
DBpedia's 14 topic classes as a custom CSV task, split into train.csv and dev.csv.

The input is a public 14,000-row subset of Zhang et al.'s (2015) DBpedia ontology classification
set, 1,000 entity descriptions per class, as `label,text` rows with labels 0..13 in the original
class order and the text already word-tokenized (sentences joined by tabs), e.g. the file
`data/dbpedia/train.csv` of github.com/KEAML-JLU/DeepTextClustering (commit b84d28c):

    python bench/dbpedia_task.py --raw dbpedia_train.csv --out data/dbpedia

writes `text,label` files with the class names as labels, the same 143 rows of every class held
out as dev.csv (2,002 rows; seed 0) and the other 857 in train.csv (11,998), both shuffled. No
text is in both. bert-finetune reads them as `task=custom ... 'task.text_columns=[text]'` and
bert-prep pretrains on train.csv's text (`corpus=table`), never on dev.csv.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import random
import sys

# Zhang et al. (2015), classes.txt of dbpedia_csv, in label order
CLASSES = ("Company", "EducationalInstitution", "Artist", "Athlete", "OfficeHolder",
           "MeanOfTransportation", "Building", "NaturalPlace", "Village", "Animal", "Plant",
           "Album", "Film", "WrittenWork")
DEV_PER_CLASS = 143   # 2,002 dev rows: a dev set as large as 1/7 of the data, equal per class


def split(rows: list[tuple[str, str]], seed: int = 0) -> tuple[list, list]:
    """(train, dev) lists of (text, class name), dev holding DEV_PER_CLASS rows of each class."""
    by_class = collections.defaultdict(list)
    for label, text in rows:
        by_class[int(label)].append(" ".join(text.replace("\t", " ").split()))
    rng = random.Random(seed)
    train, dev = [], []
    for label in sorted(by_class):
        texts = by_class[label]
        rng.shuffle(texts)
        dev += [(t, CLASSES[label]) for t in texts[:DEV_PER_CLASS]]
        train += [(t, CLASSES[label]) for t in texts[DEV_PER_CLASS:]]
    rng.shuffle(train)
    rng.shuffle(dev)
    return train, dev


def read_raw(path: str) -> list[tuple[str, str]]:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = [tuple(r) for r in csv.reader(f) if r]
    except UnicodeDecodeError:
        sys.exit(f"{path}: not UTF-8 text: convert it, e.g. "
                 f"iconv -f latin1 -t utf-8")
    except csv.Error as e:
        sys.exit(f"{path}: not a CSV file ({e})")
    bad = next((n for n, r in enumerate(rows, 1)
                if len(r) != 2 or not r[0].isdigit() or int(r[0]) >= len(CLASSES)), None)
    if bad is not None:
        sys.exit(f"{path} row {bad}: expected 'label,text' with a label 0..{len(CLASSES) - 1}")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--raw", required=True, help="the label,text CSV of the DBpedia subset")
    p.add_argument("--out", required=True, help="folder for train.csv and dev.csv")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not os.path.isfile(args.raw):
        sys.exit(f"--raw {args.raw}: no such file")
    train, dev = split(read_raw(args.raw), args.seed)
    os.makedirs(args.out, exist_ok=True)
    for name, rows in (("train.csv", train), ("dev.csv", dev)):
        with open(os.path.join(args.out, name), "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows(rows)
    print(f"{args.out}: train.csv {len(train):,} rows, dev.csv {len(dev):,} rows, "
          f"{len(CLASSES)} classes")


if __name__ == "__main__":
    main()
