"""Pilot for the in-domain table (docs/finetuning-results.md): consistency training on the
task's unlabeled text during fine-tuning (UDA: Xie, Dai, Hovy, Luong and Le, NeurIPS 2020),
beside bert-finetune's [CLS] classifier.

Each step adds to the labelled batch's cross-entropy a consistency term on a batch of
unlabeled sentences (`--ratio` times the labelled batch): the model's prediction on the clean
sentence (eval mode, no gradient, sharpened with `--temperature`, kept only where its top class
is above `--threshold`) is the target of its prediction on a noised copy, by KL divergence,
weighted `--weight`. The noise is UDA's TF-IDF word replacement at the token level: in each
sentence, tokens of low TF-IDF (uninformative) are replaced with probability proportional to
(the sentence's highest TF-IDF - theirs), `--replace` of them on average, by tokens drawn from
the corpus with probability proportional to (the largest IDF - theirs), i.e. frequent,
uninformative ones. Training-signal annealing (`--tsa linear`) leaves out of the supervised
loss the labelled examples the model already gives more than eta_t to, eta_t rising linearly
from 1 / classes to 1 over the steps, so that few labels are not memorised before the
unlabeled term has taught anything.

The unlabeled text is a .tsv / .csv column (`--unlabeled`, `--column`): SST-2's training
sentences (labels never read). Everything else is bert-finetune's (the same grid, seeds,
recipe, data subset, scoring; its overrides follow `--`); the pilot's settings join the
results' identity, so its out_dir can not be mistaken for a plain fine-tune's:

    python bench/uda_pilot.py --unlabeled glue_data/SST-2/train.tsv --column sentence -- \
        task=sst2 data_dir=glue_data model=runs/dom_sst2_imdb max_train_samples=1000 \
        recipe.layer_lr_decay=0.7 'recipe.lrs=[3e-3]' 'recipe.seeds=[1,2,3]' recipe.epochs=10 \
        recipe.max_length=64 out_dir=ft/uda/1000

A pilot, not a command of the package: one process only; every draw (the unlabeled batch, the
noise, dropout) is seeded by the fine-tune's seed and step, but resuming a stopped fine-tune
through bert-finetune's checkpoints is not tested here.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F

from benchlib import finetune_with_pilot, patch_finetune


def read_column(path: str, column: str) -> list:
    """The `column` of a .tsv (tab) or .csv file; no other column is read."""
    delimiter = "\t" if path.endswith(".tsv") else ","
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=delimiter,
                                quoting=csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL)
        if column not in (reader.fieldnames or []):
            sys.exit(f"uda_pilot: {path} has no {column!r} column (it has "
                     f"{', '.join(reader.fieldnames or [])}); set --column")
        return [row[column].strip() for row in reader if row[column] and row[column].strip()]


class TfidfNoise:
    """UDA's TF-IDF word replacement on token ids (special tokens are never replaced)."""

    def __init__(self, ids: list, vocab_size: int, special: set, replace: float):
        df = np.zeros(vocab_size, dtype=np.float64)
        for x in ids:
            df[np.unique(x)] += 1
        self.idf = np.log((len(ids) + 1) / (df + 1))
        counts = np.zeros(vocab_size, dtype=np.float64)
        for x in ids:
            np.add.at(counts, x, 1)
        allowed = counts > 0
        allowed[list(special)] = False
        weight = np.where(allowed, self.idf.max() - self.idf, 0.0)
        if weight.sum() <= 0:  # every seen token equally rare: draw them uniformly
            weight = allowed.astype(np.float64)
        self.draw_p = weight / weight.sum()
        self.special = np.zeros(vocab_size, dtype=bool)
        self.special[list(special)] = True
        self.replace = replace

    def __call__(self, ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        ids = ids.copy()
        candidates = ~self.special[ids]
        n = int(candidates.sum())
        if n == 0 or self.replace <= 0:
            return ids
        values, counts = np.unique(ids, return_counts=True)
        tf = dict(zip(values.tolist(), (counts / len(ids)).tolist()))
        tfidf = np.array([tf[t] * self.idf[t] for t in ids.tolist()])
        score = np.where(candidates, tfidf[candidates].max() - tfidf, 0.0)
        total = score.sum()
        if total <= 0:  # every candidate equally informative: replace uniformly
            score, total = candidates.astype(np.float64), float(n)
        prob = np.minimum(score * self.replace * n / total, 1.0)
        hit = rng.random(len(ids)) < prob
        if hit.any():
            ids[hit] = rng.choice(len(self.draw_p), size=int(hit.sum()), p=self.draw_p)
        return ids


def tsa_threshold(schedule: str, step: int, total: int, classes: int) -> float:
    """Training-signal annealing: the largest correct-class probability still trained on."""
    if schedule == "none":
        return 1.0
    t = step / max(total, 1)
    alpha = {"linear": t, "log": 1 - math.exp(-t * 5), "exp": math.exp((t - 1) * 5)}[schedule]
    return alpha * (1 - 1 / classes) + 1 / classes


def consistency(clean_logits: torch.Tensor, noised_logits: torch.Tensor, temperature: float,
                threshold: float) -> tuple:
    """Summed KL(sharpened clean || noised) over the confident rows, and how many there were."""
    clean = clean_logits.float()
    keep = F.softmax(clean, dim=-1).max(dim=-1).values > threshold
    target = F.softmax(clean / temperature, dim=-1)
    log_q = F.log_softmax(noised_logits.float(), dim=-1)
    kl = (target * (torch.log(target.clamp_min(1e-12)) - log_q)).sum(dim=-1)
    return (kl * keep).sum(), int(keep.sum())


def install(args):
    """Patch bert-finetune's job (identity) and fine-tune step with the pilot's; returns what
    undoes it (a test runs the pilot inside a process that fine-tunes other things after)."""
    from bert_pretrain.finetune import runner
    from bert_pretrain.finetune.batches import Encoded, collate
    from bert_pretrain.components.optim import set_lr

    settings = {"unlabeled": args.unlabeled, "column": args.column, "weight": args.weight,
                "ratio": args.ratio, "temperature": args.temperature,
                "threshold": args.threshold, "replace": args.replace, "tsa": args.tsa}

    def prepare(job, s, pretrained, say):
        tokenizer = pretrained.tokenizer()
        tokenizer.enable_truncation(min(s.recipe.max_length,
                                        pretrained.config.max_position_embeddings))
        text = read_column(args.unlabeled, args.column)
        wanted = args.ratio * s.recipe.batch_size
        if len(text) < wanted:
            raise SystemExit(f"uda_pilot: {args.unlabeled} has {len(text)} non-empty rows in "
                             f"{args.column!r}; a step draws --ratio x recipe.batch_size = "
                             f"{wanted}: give more unlabeled text or lower --ratio")
        ids = [np.asarray(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(text)]
        special = {tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]",
                                                      "[UNK]")} - {None}
        job.unlabeled = Encoded(ids, [np.zeros_like(x) for x in ids],
                                np.zeros(len(ids), dtype=np.int64))
        job.noise = TfidfNoise(ids, pretrained.config.vocab_size, special, args.replace)
        say(f"uda_pilot: {len(ids):,} unlabeled sentences from {args.unlabeled} "
            f"({args.column}), {settings}")

    def train_step(self):
        s, acc, recipe, job = self.session, self.session.accelerator, self.recipe, self.job
        if s.world != 1:
            raise SystemExit("uda_pilot: one process only")
        self.current_lr = self.lr * self.schedule.factor(self.step)
        set_lr(self.optimizer, self.current_lr)
        (index,) = self.order.micro_batches(self.step)  # recipe.batch_size in one micro batch
        rng = np.random.default_rng([self.seed, self.step, 20201])
        u_index = rng.choice(len(job.unlabeled), size=args.ratio * len(index), replace=False)
        clean = collate(job.unlabeled, u_index)
        clean = {k: v.to(acc.device) for k, v in clean.items() if k != "labels"}
        self.model.eval()  # the target: no dropout, no gradient
        with torch.no_grad(), self.precision.autocast():
            clean_logits = self.model(**clean).logits
        self.model.train()
        noised = Encoded([job.noise(job.unlabeled.ids[i], rng) for i in u_index],
                         [job.unlabeled.types[i] for i in u_index],
                         np.zeros(len(u_index), dtype=np.int64))
        noised = {k: v.to(acc.device) for k, v in collate(noised, np.arange(len(u_index))).items()
                  if k != "labels"}
        torch.manual_seed(runner.dropout_seed(self.seed, self.step, 0))
        inputs = {k: v.to(acc.device) for k, v in collate(job.train, index).items()}
        with self.precision.autocast():
            logits = self.model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
            noised_logits = self.model(**noised).logits
        logits = logits.float()
        ce = F.cross_entropy(logits, inputs["labels"], reduction="none")
        eta = tsa_threshold(args.tsa, self.step, self.order.num_steps, logits.shape[-1])
        correct = F.softmax(logits, dim=-1).gather(1, inputs["labels"][:, None])[:, 0]
        keep = (correct.detach() < eta).float()
        sup = (ce * keep).sum() / max(float(keep.sum()), 1.0)
        kl_sum, _ = consistency(clean_logits, noised_logits, args.temperature, args.threshold)
        loss = sup + args.weight * kl_sum / len(u_index)
        acc.backward(self.precision.scale(loss))
        params = [p for p in self.model.parameters() if p.grad is not None]
        self.precision.unscale(self.optimizer)
        grad_norm = float(acc.clip_grad_norm_(params, recipe.max_grad_norm or math.inf))
        finite = math.isfinite(float(loss.detach())) and math.isfinite(grad_norm)
        applied = self.precision.step(self.optimizer, finite)
        self.optimizer.zero_grad(set_to_none=True)
        # (read on the host: the loop counts the skip and logs the supervised loss)
        return runner.StepNumbers(self.step + 1, float(ce.detach().mean()), grad_norm,
                                  applied), bool(self.stop.requested)

    return patch_finetune("uda_pilot", settings, train_step, prepare)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--unlabeled", required=True, help=".tsv / .csv of unlabeled text")
    p.add_argument("--column", default="sentence")
    p.add_argument("--weight", type=float, default=1.0)
    p.add_argument("--ratio", type=int, default=3, help="unlabeled rows per labelled row")
    p.add_argument("--temperature", type=float, default=0.85)
    p.add_argument("--threshold", type=float, default=0.6)
    p.add_argument("--replace", type=float, default=0.3)
    p.add_argument("--tsa", choices=["none", "linear", "log", "exp"], default="linear")
    finetune_with_pilot("uda_pilot", p, install, argv)


if __name__ == "__main__":
    main()
