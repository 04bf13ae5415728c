"""Test support for fine-tuning: a tiny pretrained run, tasks whose labels depend on the text
(so an encoder must read it to beat the majority class), GLUE-format copies of such tasks, and
fine-tuning settings for seconds-long runs."""

from __future__ import annotations

import csv
import json
import os
import random
import zlib

from train_support import train_in_process, write_prepared

WORDS = [f"w{i}" for i in range(29)]  # write_prepared's vocabulary (vocab_size=64)
KEY = "w0"


def pretrained_run(root: str) -> str:
    """A bert-train run of the smoke experiment (2 layers x 32) on synthetic data: a
    pretrained tiny encoder with a WordPiece vocabulary of w0..w28 (and ##p pieces)."""
    prepared = write_prepared(os.path.join(root, "prep"), num_train=64, num_valid=8)
    run = os.path.join(root, "run")
    train_in_process(["experiment=smoke", f"data.dir={prepared}", f"run_dir={run}",
                      "trainer.max_steps=20", "trainer.checkpoint_every=20",
                      "trainer.eval_every=0"])
    return run


def _sentence(rng: random.Random, has_key: bool) -> str:
    words = rng.sample(WORDS[1:], rng.randint(4, 9))
    if has_key:
        words[rng.randrange(len(words))] = KEY
    return " ".join(words)


def sentence_examples(n: int, seed: int) -> list:
    """(sentence, label): label 1 iff the sentence holds w0; balanced classes."""
    rng = random.Random(seed)
    return [(_sentence(rng, i % 2 == 1), i % 2) for i in range(n)]


def pair_examples(n: int, seed: int) -> list:
    """(first, second, label): label 1 iff w0 is in the FIRST sentence; the second holds w0
    half the time whatever the label, so the model must tell the segments apart."""
    rng = random.Random(seed)
    return [(_sentence(rng, i % 2 == 1), _sentence(rng, rng.random() < 0.5), i % 2)
            for i in range(n)]


def write_csv(path: str, header: list, rows: list, delimiter: str = ",") -> str:
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_jsonl(path: str, keys: list, rows: list) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(dict(zip(keys, row))) + "\n")
    return path


def sentence_task(root: str, n_train: int = 256, n_dev: int = 128) -> list:
    """task=custom overrides for the sentence task, as CSV files."""
    os.makedirs(root, exist_ok=True)
    train = write_csv(os.path.join(root, "train.csv"), ["text", "label"],
                      sentence_examples(n_train, 1))
    dev = write_csv(os.path.join(root, "dev.csv"), ["text", "label"],
                    sentence_examples(n_dev, 2))
    return ["task=custom", f"task.train_file={train}", f"task.validation_file={dev}",
            "task.text_columns=[text]"]


def pair_task(root: str, n_train: int = 384, n_dev: int = 128) -> list:
    """task=custom overrides for the sentence-pair task, as JSON lines with word labels."""
    os.makedirs(root, exist_ok=True)
    names = ["other", "first"]
    rows = [(a, b, names[y]) for a, b, y in pair_examples(n_train, 3)]
    dev = [(a, b, names[y]) for a, b, y in pair_examples(n_dev, 4)]
    keys = ["premise", "hypothesis", "relation"]
    train_file = write_jsonl(os.path.join(root, "train.jsonl"), keys, rows)
    dev_file = write_jsonl(os.path.join(root, "dev.jsonl"), keys, dev)
    return ["task=custom", f"task.train_file={train_file}", f"task.validation_file={dev_file}",
            "task.text_columns=[premise,hypothesis]", "task.label_column=relation",
            "task.label_names=[other,first]"]


# Seconds-long fine-tunes: one lr, one seed, fp32 (tests compare to 1e-5 and CI machines
# differ in bf16 units), no progress bar.
FAST = ["recipe.lrs=[1e-3]", "recipe.seeds=[1]", "recipe.batch_size=16", "recipe.epochs=4",
        "recipe.max_length=32", "recipe.dropout=0.0", "trainer.mixed_precision=no",
        "trainer.progress_bar=false", "trainer.log_every=1", "trainer.eval_batch_size=32"]


def kill_fine_tune_at(monkeypatch, step: int):
    """Make every fine-tune stop with RuntimeError('killed') when it reaches `step` (as a kill
    would, after the checkpoints saved before it). Returns the train_step it wraps, to put
    back with monkeypatch.setattr(FineTune, "train_step", ...)."""
    from bert_pretrain.finetune.runner import FineTune

    real_step = FineTune.train_step

    def killed_at(self):
        if self.step == step:
            raise RuntimeError("killed")
        return real_step(self)

    monkeypatch.setattr(FineTune, "train_step", killed_at)
    return real_step


def compose_finetune(overrides: list, config_name: str = "finetune"):
    from hydra import compose, initialize_config_dir

    from bert_pretrain.finetune.cli import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def finetune_in_process(overrides: list) -> dict:
    """bert-finetune in this process (same code after Hydra); returns the grid's summary."""
    from omegaconf import OmegaConf

    from bert_pretrain.finetune.cli import finetune
    from bert_pretrain.finetune.config import finetune_settings

    cfg = compose_finetune(overrides)
    return finetune(finetune_settings(cfg), OmegaConf.to_yaml(cfg, resolve=True))


def glue_in_process(overrides: list) -> dict:
    from omegaconf import OmegaConf

    from bert_pretrain.finetune.config import glue_settings
    from bert_pretrain.finetune.glue import run_glue

    cfg = compose_finetune(overrides, "glue")
    return run_glue(glue_settings(cfg), OmegaConf.to_yaml(cfg, resolve=True))


# --------------------------------------------------------------------------- GLUE's own files


def write_glue_task(root: str, task: str, n_train: int = 64, n_dev: int = 32) -> str:
    """GLUE's TSV files for `task` (its header, columns and label words, as GLUE's download
    script writes them), filled with the test tasks: sentence tasks from sentence_examples,
    pair tasks from pair_examples, STS-B with a 0-5 score. Returns the task's folder."""
    from bert_pretrain.finetune.tasks import GLUE_TASKS

    spec = GLUE_TASKS[task]
    folder = os.path.join(root, spec.title)
    os.makedirs(folder, exist_ok=True)
    for split in ["train.tsv"] + [e.tsv for e in spec.evals]:
        n = n_train if split == "train.tsv" else n_dev
        seed = zlib.crc32(f"{task}/{split}".encode())
        if len(spec.hub_columns) == 1:
            examples = [(s, None, y) for s, y in sentence_examples(n, seed)]
        else:
            examples = pair_examples(n, seed)
        rows = []
        for a, b, y in examples:
            if spec.num_labels == 1:
                label = f"{5.0 * y:.1f}" if y else f"{random.Random(a).uniform(0, 2):.2f}"
            elif spec.tsv_labels_are_words:
                label = spec.label_names[y % spec.num_labels]
            else:
                label = str(y)
            rows.append(_glue_row(task, a, b, label))
        with open(os.path.join(folder, split), "w", encoding="utf-8") as f:
            if spec.tsv_header:
                f.write("\t".join(_glue_header(task)) + "\n")
            f.writelines("\t".join(r) + "\n" for r in rows)
    return folder


def _glue_header(task: str) -> list:
    return {
        "sst2": ["sentence", "label"],
        "mrpc": ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
        "stsb": ["index", "genre", "filename", "year", "old_index", "source1", "source2",
                 "sentence1", "sentence2", "score"],
        "qqp": ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
        "mnli": ["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
                 "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1",
                 "sentence2", "label1", "gold_label"],
        "qnli": ["index", "question", "sentence", "label"],
        "rte": ["index", "sentence1", "sentence2", "label"],
        "wnli": ["index", "sentence1", "sentence2", "label"],
    }[task]


def _glue_row(task: str, a: str, b, label: str) -> list:
    if task == "cola":
        return ["gj04", label, "*" if label == "0" else "", a]  # no header in CoLA's files
    if task == "sst2":
        return [a, label]
    if task == "mrpc":
        return [label, "1", "2", a, b]
    if task == "stsb":
        return ["0", "main-captions", "MSRvid", "2012test", "0001", "none", "none", a, b, label]
    if task == "qqp":
        return ["0", "1", "2", a, b, label]
    if task == "mnli":
        return ["0", "1", "1e", "fiction", "(x)", "(y)", "(ROOT x)", "(ROOT y)", a, b, label,
                label]
    return ["0", a, b, label]


def check_interrupted_fine_tune_resumes(run, out, monkeypatch) -> None:
    """`run(out_dir)` fine-tunes one lr and seed for 6 steps with trainer.log_every=1 and
    trainer.checkpoint_every=2 (a pilot's command, say). Killed after step 5, with step 4's
    checkpoint on disk, the same command continues from step 4 (not over from the start) to
    the records and score of a run never interrupted."""
    from bert_pretrain.finetune.runner import FineTune

    def records(folder):
        (path,) = folder.rglob("metrics.jsonl")
        return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
                for line in path.read_text().splitlines()]

    def score(folder):
        (path,) = folder.rglob("result.json")
        return json.loads(path.read_text())["score"]

    run(out / "straight")
    log, logged = FineTune._log, []

    def killed_after_step_5(self):
        log(self)
        if self.step == 5:
            raise RuntimeError("killed")

    def counted(self):
        logged.append(self.step)
        log(self)

    with monkeypatch.context() as m:
        m.setattr(FineTune, "_log", killed_after_step_5)
        try:
            run(out / "resumed")
        except SystemExit:  # (Hydra reports the error and exits 1)
            pass
        else:
            raise AssertionError("the fine-tune was not interrupted")
    assert [p.name for p in (out / "resumed").rglob("step-*")] == ["step-00000004"]
    with monkeypatch.context() as m:
        m.setattr(FineTune, "_log", counted)
        run(out / "resumed")
    assert logged == [5, 6]  # continued from step 4, not started over
    assert len(records(out / "straight")) == 7  # 6 steps and the score
    assert records(out / "resumed") == records(out / "straight")
    assert score(out / "resumed") == score(out / "straight")
