"""A task's whole fine-tuning grid: every learning rate x seed of the recipe, each a resumable
FineTune in `<out_dir>/lr<lr>-seed<seed>/`, then the medians over seeds, the best learning rate
(by the median of the task's score on its dev set, as the BERT paper chose) and finetune.json.

Layout of out_dir:
    finetune.json             the summary (below), written when every run has finished
    lr3e-05-seed1/            one fine-tune: metrics.jsonl, result.json, checkpoints/ while running
    model/                    (trainer.save_model=best) the best lr's median-seed model: a
                              transformers BertForSequenceClassification directory
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import sys
import time

from . import scoring
from .batches import encode
from .reading import read_task
from .runner import MODEL_DIR, FineTune, Job, Session, _write_json

SUMMARY_FILE = "finetune.json"


def run_name(lr: float, seed: int) -> str:
    return f"lr{lr:g}-seed{seed}"


def prepare_job(s, pretrained, config_yaml: str, say=print) -> Job:
    """Read and tokenise the task for `pretrained`'s tokenizer; the identity of the results."""
    data = read_task(s.task)
    tokenizer = pretrained.tokenizer()
    vocab = pretrained.config.vocab_size
    limit = min(s.recipe.max_length, pretrained.config.max_position_embeddings)
    train = encode(data.train, tokenizer, limit, vocab, f"{data.source} (train)")
    evals = {k: encode(v, tokenizer, limit, vocab, f"{data.source} (eval {k or 'dev'})")
             for k, v in data.evals.items()}
    truncated = float(sum(len(x) >= limit for x in train.ids)) / max(len(train), 1)
    if truncated > 0.05:
        say(f"bert-finetune: note: {100 * truncated:.0f}% of the training examples are cut at "
            f"recipe.max_length={limit} tokens")
    identity = {"model": pretrained.identity(), "source": pretrained.source, "init": s.init,
                "task": dataclasses.asdict(s.task),
                "recipe": {k: v for k, v in dataclasses.asdict(s.recipe).items()
                           if k not in ("lrs", "seeds")}}
    return Job(s, pretrained, data, train, evals, config_yaml, identity)


def run_grid(session: Session, job: Job, out_dir: str, say=print) -> dict:
    """Every (lr, seed) fine-tune of the recipe, then the summary (also written to
    <out_dir>/finetune.json by the main process)."""
    s, data = job.settings, job.data
    recipe = s.recipe
    start = time.perf_counter()
    results = []
    total = len(recipe.lrs) * len(recipe.seeds)
    for lr in recipe.lrs:
        for seed in recipe.seeds:
            run_dir = os.path.join(out_dir, run_name(lr, seed))
            done = len(results) + 1
            result = FineTune(session, job, lr, seed, run_dir).run(
                progress_desc=f"{data.title} {done}/{total} lr {lr:g} seed {seed}")
            results.append(result)
            say(f"bert-finetune: {data.title} lr {lr:g} seed {seed}: {_describe(result)} "
                f"({result['steps']} steps, {result['train_seconds']:.0f} s)")
    summary = summarize(job, results, out_dir, time.perf_counter() - start, session)
    if session.main:
        _keep_models(out_dir, summary, s.trainer.save_model)
        _write_json(os.path.join(out_dir, SUMMARY_FILE), summary)
    session.barrier()
    return summary


def summarize(job: Job, results: list, out_dir: str, seconds: float, session) -> dict:
    """Medians over seeds per lr; the best lr by its median score."""
    s, data = job.settings, job.data
    grid = []
    for lr in s.recipe.lrs:
        runs = [r for r in results if r["lr"] == lr]
        metrics = {k: statistics.median(r["metrics"][k] for r in runs)
                   for k in runs[0]["metrics"]}
        scores = [r["score"] for r in runs]
        grid.append({"lr": lr, "metrics": metrics, "score": scoring.task_score(metrics),
                     "score_range": [min(scores), max(scores)],
                     "runs": [{"seed": r["seed"], "metrics": r["metrics"], "score": r["score"],
                               "train_seconds": r["train_seconds"]} for r in runs]})
    best = max(grid, key=lambda g: g["score"])
    return {
        "task": data.name, "title": data.title, "source": data.source,
        "model": s.model, "checkpoint": job.pretrained.source, "init": s.init,
        "num_train": len(job.train), "num_eval": {k: len(v) for k, v in job.evals.items()},
        "metrics": best["metrics"], "score": best["score"], "best_lr": best["lr"],
        "score_range": best["score_range"], "seeds": list(s.recipe.seeds), "grid": grid,
        "recipe": dataclasses.asdict(s.recipe), "precision": session.precision,
        "processes": session.world, "steps_per_run": results[0]["steps"],
        "train_seconds": round(sum(r["train_seconds"] for r in results), 1),
        "wall_seconds": round(seconds, 1), "out_dir": out_dir,
    }


def median_run(summary: dict) -> dict:
    """The best lr's run whose score is the median (the lower one for an even count)."""
    runs = next(g for g in summary["grid"] if g["lr"] == summary["best_lr"])["runs"]
    ranked = sorted(runs, key=lambda r: r["score"])
    return ranked[(len(ranked) - 1) // 2]


def _keep_models(out_dir: str, summary: dict, policy: str) -> None:
    """save_model=best: the best lr's median-seed model moves to <out_dir>/model, the others
    are deleted (a BERT-base grid would otherwise keep nine 440 MB copies)."""
    if policy != "best":
        return
    keep = os.path.join(out_dir, run_name(summary["best_lr"], median_run(summary)["seed"]),
                        MODEL_DIR)
    target = os.path.join(out_dir, MODEL_DIR)
    if os.path.isdir(keep):
        shutil.rmtree(target, ignore_errors=True)
        os.rename(keep, target)
    for g in summary["grid"]:
        for r in g["runs"]:
            shutil.rmtree(os.path.join(out_dir, run_name(g["lr"], r["seed"]), MODEL_DIR),
                          ignore_errors=True)
    summary["model_dir"] = target if os.path.isdir(target) else None


def _describe(result: dict) -> str:
    return ", ".join(f"{k} {100 * v:.2f}" for k, v in result["metrics"].items())


def describe_summary(summary: dict) -> str:
    """One line: the task's metrics (median over seeds at the best lr), range, the grid."""
    seeds = len(summary["seeds"])
    lo, hi = summary["score_range"]
    grid = ", ".join(f"{g['lr']:g}: {100 * g['score']:.2f}" for g in summary["grid"])
    return (f"{summary['title']}: {_describe(summary)} (median of {seeds} seed(s) at lr "
            f"{summary['best_lr']:g}; score {100 * summary['score']:.2f}, seeds "
            f"{100 * lo:.2f}-{100 * hi:.2f}); by lr: {grid}; {summary['wall_seconds']:.0f} s")


def say_main(session: Session):
    """print on the main process only (the others stay quiet)."""
    def say(line: str) -> None:
        if session.main:
            print(line, flush=True)
            sys.stdout.flush()
    return say
