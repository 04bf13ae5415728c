"""More unlabeled text of SST-2's domain for the in-domain pretraining table
(docs/finetuning-results.md): the 50,000 unlabeled IMDB reviews of Maas et al.'s (2011) Large
Movie Review Dataset (`aclImdb/train/unsup/*.txt`, ai.stanford.edu/~amaas/data/sentiment/) as
JSON lines that bert-prep's `corpus=table` reads beside SST-2's own training text:

    python bench/imdb_corpus.py --aclimdb aclImdb --out data/imdb_unsup.jsonl \
        --check glue_data/SST-2/dev.tsv

One review a row (a document), one sentence a line (split after . ! ? before a capital, a quote
or a bracket, and at the reviews' `<br />` line breaks), files in the byte order of their names
(0_0, 10000_0, 10001_0, ...: the order of the corpus measured), under the field `sentence`, so
that one `corpus.text_columns=[sentence]` reads both this file and SST-2's folder.
Only `train/unsup` is read: no rating or label is ever looked at.

`--check` counts the sentences of an evaluation file (a GLUE .tsv's first column, or one
sentence a line) that share a run of 8 words with the reviews (lowercased, punctuation
ignored): pretraining on a dev set's sentences would flatter the score it is measured by.
Against SST-2's 872 dev sentences: 5 share one 8-word run (e.g. "one of the best films of the
year"), none is contained whole.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

# A sentence ends at . ! or ? followed by space and a capital, a quote or a bracket: reviews are
# written text with ordinary punctuation; "Mr. Smith" splits too, which only makes a shorter line.
# bert-prep's own splitter (data_prep.corpus.split_sentences, blingfire) would do better, but this
# rule is what the published table's corpus was built with, and this script must rebuild that
# corpus byte for byte; packing joins the lines again, so only where an instance may break differs.
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
LINE_BREAK = re.compile(r"<br\s*/?>")
WORDS = re.compile(r"[^a-z0-9]+")
NGRAM = 8


def sentences(review: str) -> list[str]:
    return [s.strip() for para in LINE_BREAK.split(review) if para.strip()
            for s in SENTENCE_END.split(para.strip()) if s.strip()]


def review_files(aclimdb: str) -> list[str]:
    folder = os.path.join(aclimdb, "train", "unsup")
    if not os.path.isdir(folder):
        sys.exit(f"--aclimdb {aclimdb}: no train/unsup folder in it: give the aclImdb folder of "
                 f"the extracted aclImdb_v1.tar.gz")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".txt"))
    if not names:
        sys.exit(f"{folder}: no .txt reviews in it")
    return [os.path.join(folder, n) for n in names]


def write_corpus(files: list[str], out: str) -> tuple[int, int]:
    """Writes the JSON lines (to a temporary name, renamed once complete); returns (reviews,
    sentences)."""
    n_sent = 0
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".partial"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for path in files:
                with open(path, encoding="utf-8") as r:
                    text = sentences(r.read())
                n_sent += len(text)
                f.write(json.dumps({"sentence": "\n".join(text)}) + "\n")
    except UnicodeDecodeError:
        os.remove(tmp)
        sys.exit(f"{path}: not UTF-8 text: is this aclImdb as distributed?")
    os.replace(tmp, out)
    return len(files), n_sent


def _words(text: str) -> list[str]:
    return WORDS.sub(" ", text.lower()).split()


def _ngrams(words: list[str]) -> set:
    return {tuple(words[i:i + NGRAM]) for i in range(len(words) - NGRAM + 1)}


def eval_sentences(path: str) -> list[str]:
    """A GLUE .tsv (header, the sentence in the first column) or one sentence a line."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f]
    if path.endswith(".tsv"):
        lines = [line.split("\t")[0] for line in lines[1:]]
    return [line for line in lines if line.strip()]


def overlap(files: list[str], eval_path: str) -> tuple[int, int, int]:
    """(evaluation sentences, those sharing an 8-word run with the reviews, those whose every
    8-word run is in the reviews)."""
    evals = [_ngrams(_words(s)) for s in eval_sentences(eval_path)]
    wanted = set().union(*evals) if evals else set()
    found = set()
    for path in files:
        with open(path, encoding="utf-8") as r:
            found |= _ngrams(_words(LINE_BREAK.sub(" ", r.read()))) & wanted
    shared = sum(1 for g in evals if g & found)
    whole = sum(1 for g in evals if g and g <= found)
    return len(evals), shared, whole


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aclimdb", required=True, help="the extracted aclImdb folder")
    p.add_argument("--out", required=True, help="the JSON-lines file to write")
    p.add_argument("--check", help="an evaluation file whose sentences must not be pretrained on")
    args = p.parse_args(argv)
    if args.check and not os.path.isfile(args.check):
        sys.exit(f"--check {args.check}: no such file")
    files = review_files(args.aclimdb)
    reviews, n_sent = write_corpus(files, args.out)
    print(f"{args.out}: {reviews:,} reviews, {n_sent:,} sentences")
    if args.check:
        total, shared, whole = overlap(files, args.check)
        print(f"{args.check}: {shared} of {total:,} sentences share an {NGRAM}-word run with "
              f"the reviews, {whole} are contained whole")


if __name__ == "__main__":
    main()
