"""Pilot for the in-domain table (docs/finetuning-results.md): an unsupervised SimCSE phase
(Gao, Yao and Chen, EMNLP 2021) after in-domain MLM, to train the pooled [CLS] vector that
bert-finetune's classifier reads (an MLM-only model has no trained pooler).

Each sentence of a batch is encoded twice with dropout as the only difference; the loss is
InfoNCE over the batch (cosine similarity / temperature, the other sentences as negatives) on
the pooler's output (dense + tanh over [CLS]), so the pooler is trained too. The text is
unlabeled: a GLUE single-sentence .tsv's `sentence` column (its label column is never read) and
JSON lines with a `sentence` field (bench/imdb_corpus.py's reviews).

    bert-export --head encoder runs/dom_sst2_imdb exp/dom_sst2_imdb
    python bench/simcse_pilot.py exp/dom_sst2_imdb exp/dom_sst2_imdb_simcse \
        --tsv glue_data/SST-2/train.tsv --jsonl data/imdb_unsup.jsonl --steps 150 --lr 1e-4
    bert-finetune task=sst2 model=exp/dom_sst2_imdb_simcse ...

A pilot, not a command of the package: it runs transformers' BertModel (the test extra), in
fp32, on one process, and writes a transformers directory that bert-finetune reads.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import time


def read_text(tsv: str, jsonl: str, share: float, seed: int) -> tuple:
    """SST-2's rows of 3 words or more, and as many review pieces again (share 0.5): a review
    is split at '. ' and kept in pieces of 3 to 60 words (bench/imdb_corpus.py puts one
    sentence a line, so most pieces are whole short reviews)."""
    rng = random.Random(seed)
    rows = []
    with open(tsv, newline="") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        if "sentence" not in (reader.fieldnames or []):
            sys.exit(f"simcse_pilot: {tsv} has no 'sentence' column (a GLUE single-sentence .tsv)")
        for row in reader:
            text = row["sentence"].strip()
            if len(text.split()) >= 3:
                rows.append(text)
    pieces = []
    if jsonl:
        with open(jsonl) as f:
            for line in f:
                row = json.loads(line)
                if "sentence" not in row:
                    sys.exit(f"simcse_pilot: a row of {jsonl} has no 'sentence' field "
                             "(bench/imdb_corpus.py writes one)")
                review = row["sentence"].replace("<br />", " ")
                pieces += [p.strip() for p in review.split(". ") if 3 <= len(p.split()) <= 60]
    rng.shuffle(pieces)
    wanted = int(len(rows) * share / (1 - share)) if share < 1 else len(pieces)
    text = rows + pieces[:wanted]
    rng.shuffle(text)
    return text, len(rows), min(wanted, len(pieces))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="an exported encoder (bert-export --head encoder)")
    ap.add_argument("out", help="a new directory for the model after the phase")
    ap.add_argument("--tsv", required=True)
    ap.add_argument("--jsonl", default="")
    ap.add_argument("--jsonl_share", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--temperature", type=float, default=0.05)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--max_length", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if os.path.exists(a.out):
        sys.exit(f"simcse_pilot: {a.out} exists: name a new directory")
    if not os.path.isfile(os.path.join(a.src, "config.json")):
        sys.exit(f"simcse_pilot: {a.src} has no config.json: pass a transformers BERT directory "
                 "(bert-export --head encoder <run> <dir>)")
    for name in (a.tsv, a.jsonl):
        if name and not os.path.isfile(name):
            sys.exit(f"simcse_pilot: {name} not found")
    if a.steps < 1 or a.batch < 2 or not 0 <= a.jsonl_share <= 1:
        sys.exit("simcse_pilot: --steps must be >= 1, --batch >= 2 (the other sentences are the "
                 "negatives), --jsonl_share in [0, 1]")

    import torch
    import torch.nn.functional as F
    from transformers import BertModel, BertTokenizerFast

    torch.manual_seed(a.seed)
    text, n_rows, n_pieces = read_text(a.tsv, a.jsonl, a.jsonl_share, a.seed)
    print(f"simcse_pilot: {n_rows} rows + {n_pieces} review pieces", flush=True)
    tok = BertTokenizerFast.from_pretrained(a.src)
    model = BertModel.from_pretrained(a.src, hidden_dropout_prob=a.dropout,
                                      attention_probs_dropout_prob=a.dropout)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / a.steps)
    labels = torch.arange(a.batch)
    start, pos = time.time(), 0
    for step in range(a.steps):
        if pos + a.batch > len(text):
            random.Random(a.seed + step).shuffle(text)
            pos = 0
        batch = text[pos:pos + a.batch]
        pos += a.batch
        enc = tok(batch + batch, padding=True, truncation=True, max_length=a.max_length,
                  return_tensors="pt")
        z = model(**enc).pooler_output
        z1, z2 = z[:a.batch], z[a.batch:]
        sim = F.cosine_similarity(z1.unsqueeze(1), z2.unsqueeze(0), dim=-1) / a.temperature
        loss = F.cross_entropy(sim, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == a.steps - 1:
            acc = (sim.argmax(1) == labels).float().mean().item()
            print(f"step {step} loss {loss.item():.3f} pair accuracy {acc:.2f} "
                  f"{time.time() - start:.0f}s", flush=True)
    # The saved config keeps the source's dropout: the phase's is for the two views only.
    with open(os.path.join(a.src, "config.json")) as f:
        src_config = json.load(f)
    model.config.hidden_dropout_prob = src_config["hidden_dropout_prob"]
    model.config.attention_probs_dropout_prob = src_config["attention_probs_dropout_prob"]
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    print(f"simcse_pilot: wrote {a.out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
