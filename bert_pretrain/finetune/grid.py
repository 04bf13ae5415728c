"""A task's whole fine-tuning grid: every learning rate x seed of the recipe, each a resumable
FineTune in `<out_dir>/lr<lr>-seed<seed>/`, then the medians over seeds, the best learning rate
(by the median of the task's score on its dev set, as the BERT paper chose) and finetune.json.

Layout of out_dir:
    .hydra/                   the record of the command that wrote finetune.json (of the first
                              one, until then)
    identity.json             what the grid is of (identity.py): the pretrained model's content
                              hash, init, the task and its data's hash, the recipe but for its
                              rates and seeds (so that adding seeds reuses the finished runs); an
                              out_dir that holds another grid is left as it is and this one goes
                              beside it (<out_dir>-2, ...)
    finetune.json             the summary (below), written when every run has finished; a
                              run that diverged (non-finite loss or gradient) is no error of
                              the grid: its lr's row lists it in `diverged_seeds`, and such an
                              lr is never the best one
    lr3e-05-seed1/            one fine-tune: identity.json, metrics.jsonl, result.json (or
                              diverged.json: why; a rerun reports it from there), checkpoints/
                              while running
    model/                    (trainer.save_model=best) the best lr's median-seed model: a
                              transformers BertForSequenceClassification directory, with the
                              identity of its fine-tune.  When a rerun (other seeds or rates)
                              makes another run the median, the model there goes back to its own
                              run's folder, and the new median's takes its place (fine-tuned
                              again if an earlier grid did not keep it: the same command gives
                              the same model)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import statistics
import sys
import time

from ..command_record import write_record
from ..errors import ConfigError, TrainingError
from . import scoring
from .batches import encode
from .identity import claim, holds, read_identity
from .reading import read_task
from .runner import MODEL_DIR, Diverged, FineTune, Job, Session, _write_json, run_identity

SUMMARY_FILE = "finetune.json"
# Where a task's data is, not what it is: the data's hash stands for it in the identity.
TASK_PATHS = ("data_dir", "train_file", "validation_file")


def run_name(lr: float, seed: int) -> str:
    return f"lr{lr:g}-seed{seed}"


def prepare_job(s, pretrained, config_yaml: str, say=print, *, precision: str) -> Job:
    """Read and tokenise the task for `pretrained`'s tokenizer; the identity of the results
    (`precision`: the session's resolved precision, which rounds the results its own way)."""
    layers = pretrained.config.num_hidden_layers
    if s.recipe.reinit_layers > layers:
        raise ConfigError(f"recipe.reinit_layers={s.recipe.reinit_layers} is more than the "
                          f"{layers} encoder layers of {pretrained.source}: use 0 to {layers}")
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
    identity = {"model": pretrained.identity(), "init": s.init,
                "task": {k: v for k, v in dataclasses.asdict(s.task).items()
                         if k not in TASK_PATHS},
                "data": data_sha256(data), "precision": precision,
                "recipe": {k: v for k, v in dataclasses.asdict(s.recipe).items()
                           if k not in ("lrs", "seeds")
                           # the defaults of later options are what results
                           # before them were of
                           and (k, v) not in (("pooling", "cls"), ("layer_lr_decay", 1.0),
                                              ("reinit_layers", 0))}}
    return Job(s, pretrained, data, train, evals, config_yaml, identity)


def data_sha256(data) -> str:
    """A hash of the examples a fine-tune trains and is scored on (texts and labels)."""
    digest = hashlib.sha256()
    for key, part in [("train", data.train), *sorted(data.evals.items())]:
        digest.update(f"{key}\0{len(part)}\0".encode())
        for column in (part.text_a, part.text_b or []):
            for text in column:
                digest.update(text.encode("utf-8", "surrogatepass") + b"\0")
        digest.update(part.labels.dtype.str.encode() + part.labels.tobytes())
    return digest.hexdigest()


def run_grid(session: Session, job: Job, out_dir: str, say=print) -> dict:
    """Every (lr, seed) fine-tune of the recipe, then the summary (also written to
    <out_dir>/finetune.json by the main process). `out_dir` is claimed for the job's identity
    (identity.py): the summary's out_dir is where it went."""
    out_dir, lock = _claim_and_lock(session, job, out_dir, say)
    try:
        return _run_grid(session, job, out_dir, say)
    finally:
        if lock is not None:
            lock.release()


def _claim_and_lock(session: Session, job: Job, out_dir: str, say):
    """The main process claims out_dir for the job's identity (another identity goes beside)
    and locks it: a second command of the same identity at once (which the claim lets in)
    stops in one line instead of writing the same runs along.  Every process gets the folder,
    or the error."""
    from ..components.folder_lock import lock_folder
    from ..errors import UserError

    claimed, lock = (None, None), None
    if session.main:
        try:
            claimed = (claim(out_dir, job.identity, "a fine-tune",
                             lambda m: say(f"bert-finetune: note: {m}")), None)
            lock = lock_folder(claimed[0], "bert-finetune")
            write_record(claimed[0], job.config_yaml)  # the record goes with the results
        except UserError as exc:
            claimed = (None, str(exc))
    out_dir, error = session.broadcast(claimed)
    if error is not None:
        raise UserError(error)
    return out_dir, lock


def _run_grid(session: Session, job: Job, out_dir: str, say) -> dict:
    s, data = job.settings, job.data
    recipe = s.recipe
    start = time.perf_counter()
    results, runs, last_divergence = [], {}, None
    total = len(recipe.lrs) * len(recipe.seeds)
    for lr in recipe.lrs:
        for seed in recipe.seeds:
            run = FineTune(session, job, lr, seed, os.path.join(out_dir, run_name(lr, seed)))
            done = len(results) + 1
            try:
                result = run.run(progress_desc=f"{data.title} {done}/{total} lr {lr:g} seed "
                                               f"{seed}")
            except Diverged as exc:
                # A rate too high for this seed is a result of the grid, not the end of it:
                # the other runs still say which rate is best (on an H200, lr 2e-3 diverged in
                # 2 of 3 seeds and the command lost the third).  Nothing of it is scored.
                last_divergence = exc
                results.append({"lr": lr, "seed": seed, "diverged": str(exc)})
                say(f"bert-finetune: {data.title} lr {lr:g} seed {seed}: diverged: {exc}; "
                    f"the grid goes on")
                continue
            results.append(result)
            runs[lr, seed] = run
            say(f"bert-finetune: {data.title} lr {lr:g} seed {seed}: {_describe(result)} "
                f"({result['steps']} steps, {result['train_seconds']:.0f} s)")
    if all("diverged" in r for r in results):
        raise last_divergence  # (one run: the error it always was)
    summary = summarize(job, results, out_dir, time.perf_counter() - start, session)
    if s.trainer.save_model == "best":
        summary["model_dir"] = _keep_median_model(session, job, summary, runs, say)
    if session.main:  # (a rerun of the same grid with other seeds rewrites both)
        _write_json(os.path.join(out_dir, SUMMARY_FILE), summary)
        write_record(out_dir, job.config_yaml, replace=True)
    session.barrier()
    return summary


def summarize(job: Job, results: list, out_dir: str, seconds: float, session) -> dict:
    """Medians over seeds per lr; the best lr by its median score, among the lrs none of
    whose seeds diverged (a result {"lr", "seed", "diverged": why}): a rate that diverges
    for some seeds is not one to recommend, whatever its other seeds scored."""
    s, data = job.settings, job.data
    grid = []
    for lr in s.recipe.lrs:
        runs = [r for r in results if r["lr"] == lr and "diverged" not in r]
        row = {"lr": lr, "metrics": None, "score": None, "score_range": None}
        if runs:
            metrics = {k: statistics.median(r["metrics"][k] for r in runs)
                       for k in runs[0]["metrics"]}
            scores = [r["score"] for r in runs]
            row.update(metrics=metrics, score=scoring.task_score(metrics),
                       score_range=[min(scores), max(scores)])
        row["runs"] = [{"seed": r["seed"], "metrics": r["metrics"], "score": r["score"],
                        "train_seconds": r["train_seconds"]} for r in runs]
        diverged = [r["seed"] for r in results if r["lr"] == lr and "diverged" in r]
        if diverged:
            row["diverged_seeds"] = diverged
        grid.append(row)
    whole = [g for g in grid if "diverged_seeds" not in g]
    if not whole:
        raise TrainingError(
            "every lr of the grid diverged in at least one seed ("
            + "; ".join(f"lr {g['lr']:g}: seed(s) {', '.join(map(str, g['diverged_seeds']))}"
                        for g in grid) + "): no rate to recommend; lower recipe.lrs or use "
            "trainer.mixed_precision=no (the finished runs' results stay in their folders)")
    best = max(whole, key=lambda g: g["score"])
    results = [r for r in results if "diverged" not in r]
    return {
        "task": data.name, "title": data.title, "source": data.source,
        "model": s.model, "checkpoint": job.pretrained.source, "init": s.init,
        "num_train": len(job.train), "num_eval": {k: len(v) for k, v in job.evals.items()},
        "metrics": best["metrics"], "score": best["score"], "best_lr": best["lr"],
        "score_range": best["score_range"], "seeds": list(s.recipe.seeds), "grid": grid,
        "recipe": dataclasses.asdict(s.recipe), "precision": session.precision,
        "processes": session.world, "steps_per_run": results[0]["steps"],
        "train_seconds": round(sum(r["train_seconds"] for r in results), 1),
        "wall_seconds": round(seconds, 1), "out_dir": out_dir, "identity": job.identity,
    }


def median_run(summary: dict) -> dict:
    """The best lr's run whose score is the median (the lower one for an even count)."""
    runs = next(g for g in summary["grid"] if g["lr"] == summary["best_lr"])["runs"]
    ranked = sorted(runs, key=lambda r: r["score"])
    return ranked[(len(ranked) - 1) // 2]


def _keep_median_model(session: Session, job: Job, summary: dict, runs: dict, say) -> str:
    """save_model=best: <out_dir>/model becomes the best lr's median-seed model, and the other
    models this command wrote are deleted (a BERT-base grid would otherwise keep nine 440 MB
    copies).  A model that model/ held for another run goes back to that run's folder; the
    median's, when an earlier grid did not keep it, is fine-tuned again. Returns model/."""
    lr, seed = summary["best_lr"], median_run(summary)["seed"]
    wanted, median = run_identity(job, lr, seed), runs[lr, seed]
    target = os.path.join(summary["out_dir"], MODEL_DIR)
    missing = session.broadcast(session.main and not holds(target, wanted) and
                                not os.path.isdir(os.path.join(median.run_dir, MODEL_DIR)))
    if missing:  # (every process takes part in the fine-tune)
        say(f"bert-finetune: lr {lr:g} seed {seed} is the median now and an earlier grid did "
            f"not keep its model: fine-tuning it again")
        again = median.run(progress_desc=f"{job.data.title} lr {lr:g} seed {seed} (model)",
                           rebuild=True)
        saved = median_run(summary)["metrics"]
        if again["metrics"] != saved:
            say(f"bert-finetune: warning: lr {lr:g} seed {seed} fine-tuned again scores "
                f"{_describe(again)}, its first fine-tune {_describe({'metrics': saved})} "
                f"(another machine or precision?); {target} is the new one")
    if session.main:
        if not holds(target, wanted):
            if os.path.isdir(target):
                _move_back(target, summary["out_dir"], say)
            os.rename(os.path.join(median.run_dir, MODEL_DIR), target)
        for run in runs.values():
            if run.trained:
                shutil.rmtree(os.path.join(run.run_dir, MODEL_DIR), ignore_errors=True)
    return target


def _move_back(model_dir: str, out_dir: str, say) -> None:
    """Put the model in `model_dir` back into the folder of the fine-tune it is of (its
    identity says which), or, if it has none, beside it: never deleted."""
    identity = read_identity(model_dir)
    if identity is not None and "lr" in identity and "seed" in identity:
        home = claim(os.path.join(out_dir, run_name(identity["lr"], identity["seed"])), identity)
        dest = os.path.join(home, MODEL_DIR)
        if os.path.isdir(dest):  # (the same fine-tune's model twice: one is enough)
            shutil.rmtree(model_dir)
            return
    else:
        n = 2
        while os.path.lexists(f"{model_dir}-{n}"):
            n += 1
        dest = f"{model_dir}-{n}"
    os.rename(model_dir, dest)
    say(f"bert-finetune: note: {model_dir} held another run's model (no longer the median): "
        f"moved to {dest}")


def _describe(result: dict) -> str:
    return ", ".join(f"{k} {100 * v:.2f}" for k, v in result["metrics"].items())


def describe_summary(summary: dict) -> str:
    """One line: the task's metrics (median over seeds at the best lr), range, the grid."""
    seeds = len(summary["seeds"])
    lo, hi = summary["score_range"]
    grid = ", ".join(f"{g['lr']:g}: " + (f"{100 * g['score']:.2f}" if g["score"] is not None
                                          else "-") +
                     (f" (diverged: seed(s) {', '.join(map(str, g['diverged_seeds']))})"
                      if "diverged_seeds" in g else "") for g in summary["grid"])
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
