"""What bert-finetune reads: the nine GLUE tasks in GLUE's own TSV layouts and from a
save_to_disk folder, custom CSV / TSV / JSON-lines tasks; and what a mistake gets: one line
(unknown task, missing column, labels out of range, an empty file, a misspelt key, no network),
and `--help` listing only the commands' own groups."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from bert_pretrain.errors import DataError
from bert_pretrain.finetune.reading import read_task
from bert_pretrain.finetune.tasks import GLUE_TASKS, TaskConfig
from finetune_support import (pair_examples, pretrained_run, sentence_examples,
                              sentence_task, write_csv, write_glue_task)
from time_limits import hang_limit
from train_support import CHILD_PYTHONPATH, REPO


# The names of the hub's ClassLabel features (nyu-mll/glue), in id order: what the ids of GLUE's
# files mean. A kept classifier's config.json says them (id2label).
HUB_LABEL_NAMES = {
    "cola": ["unacceptable", "acceptable"], "sst2": ["negative", "positive"],
    "mrpc": ["not_equivalent", "equivalent"], "stsb": None,
    "qqp": ["not_duplicate", "duplicate"], "mnli": ["entailment", "neutral", "contradiction"],
    "qnli": ["entailment", "not_entailment"], "rte": ["entailment", "not_entailment"],
    "wnli": ["not_entailment", "entailment"]}


@pytest.mark.parametrize("task", sorted(GLUE_TASKS))
def test_glue_tsv_files_read_as_glue_writes_them(task, tmp_path):
    spec = GLUE_TASKS[task]
    folder = write_glue_task(str(tmp_path), task, n_train=20, n_dev=12)
    # the task's folder, or the GLUE root above it
    for data_dir in (folder, str(tmp_path)):
        data = read_task(TaskConfig(name=task, data_dir=data_dir))
        assert len(data.train) == 20 and [len(v) for v in data.evals.values()] == \
            [12] * len(spec.evals)
        assert sorted(data.evals) == sorted(e.key for e in spec.evals)
        assert (data.train.text_b is None) == (len(spec.hub_columns) == 1)
        assert data.num_labels == spec.num_labels and data.metrics == spec.metrics
        assert data.label_names == HUB_LABEL_NAMES[task]
    if spec.num_labels == 1:
        assert data.train.labels.dtype == np.float32 and data.train.labels.max() == 5.0
    else:
        assert data.train.labels.dtype == np.int64
        assert set(data.train.labels.tolist()) <= set(range(spec.num_labels))
    # labels follow the text (label 1: w0 in the (first) sentence), whatever GLUE's spelling
    first = data.train.text_a
    expected = [int("w0" in s.split()) for s in first]
    got = (data.train.labels > 2.5).astype(int) if spec.num_labels == 1 else data.train.labels
    assert got.tolist() == expected


def test_glue_files_that_start_with_a_byte_order_mark(tmp_path):
    """GLUE's MRPC files are written with a UTF-8 byte order mark before the header's first
    column ('\ufeffQuality'): they read as the files without it."""
    folder = write_glue_task(str(tmp_path), "mrpc", n_train=20, n_dev=12)
    plain = read_task(TaskConfig(name="mrpc", data_dir=folder))
    for name in ("train.tsv", "dev.tsv"):
        path = os.path.join(folder, name)
        text = open(path, encoding="utf-8").read()
        with open(path, "w", encoding="utf-8-sig") as f:
            f.write(text)
        assert open(path, "rb").read(3) == b"\xef\xbb\xbf"
    marked = read_task(TaskConfig(name="mrpc", data_dir=folder))
    assert marked.train.text_a == plain.train.text_a and marked.train.text_b == \
        plain.train.text_b
    assert marked.train.labels.tolist() == plain.train.labels.tolist()
    assert marked.evals[""].labels.tolist() == plain.evals[""].labels.tolist()


def test_tsv_sentences_that_end_with_a_carriage_return(tmp_path):
    """Public copies of SST-2's train.tsv end every sentence with '\r' before the tab. Read
    with universal newlines, each row fell apart into the sentence (skipped: too few fields)
    and a row of an empty sentence with the label (kept): training on empty text. A GLUE
    folder and a custom TSV file read as the same files without the '\r'."""
    folder = write_glue_task(str(tmp_path / "glue"), "sst2", n_train=20, n_dev=12)
    plain = read_task(TaskConfig(name="sst2", data_dir=folder))
    path = os.path.join(folder, "train.tsv")
    lines = open(path, encoding="utf-8").read().splitlines()
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(lines[0] + "\n" + "".join(line.replace("\t", "\r\t") + "\n"
                                          for line in lines[1:]))
    assert open(path, "rb").read().count(b"\r\t") == 20
    marked = read_task(TaskConfig(name="sst2", data_dir=folder))
    assert marked.train.text_a == plain.train.text_a and all(marked.train.text_a)
    assert marked.train.labels.tolist() == plain.train.labels.tolist()
    # a custom task's TSV file: the same rows
    data = read_task(TaskConfig(name="custom", train_file=path, validation_file=path,
                                text_columns=["sentence"], label_column="label"))
    assert data.train.text_a == plain.train.text_a
    assert data.train.labels.tolist() == plain.train.labels.tolist()


def test_custom_files_that_start_with_a_byte_order_mark(tmp_path):
    """A spreadsheet's 'CSV UTF-8' export starts with one too: its first column keeps its
    name."""
    path = write_csv(str(tmp_path / "data.csv"), ["text", "label"], sentence_examples(8, 1))
    text = open(path, encoding="utf-8").read()
    with open(path, "w", encoding="utf-8-sig") as f:
        f.write(text)
    data = read_task(TaskConfig(name="custom", train_file=path, validation_file=path,
                                text_columns=["text"]))
    assert len(data.train) == 8 and data.train.text_a[0] == sentence_examples(8, 1)[0][0]


def test_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = pair_examples(30, 7)

    def split(part):
        return datasets.Dataset.from_dict({"sentence1": [a for a, _, _ in part],
                                           "sentence2": [b for _, b, _ in part],
                                           "label": [1 - y for _, _, y in part], "idx": list(
                                               range(len(part)))})
    datasets.DatasetDict({"train": split(rows[:20]), "validation": split(rows[20:]),
                          "test": split(rows[20:])}).save_to_disk(str(tmp_path / "rte"))
    data = read_task(TaskConfig(name="rte", data_dir=str(tmp_path / "rte")))
    assert len(data.train) == 20 and len(data.evals[""]) == 10
    assert data.train.text_b[3] == rows[3][1] and data.train.labels[3] == 1 - rows[3][2]
    assert data.label_names == ["entailment", "not_entailment"]  # plain ids: GLUE's names
    # a copy whose ClassLabel numbers the classes the other way round keeps its own meaning
    own = datasets.ClassLabel(names=["not_entailment", "entailment"])
    datasets.load_from_disk(str(tmp_path / "rte")).cast_column("label", own).save_to_disk(
        str(tmp_path / "rte2"))
    data = read_task(TaskConfig(name="rte", data_dir=str(tmp_path / "rte2")))
    assert data.label_names == ["not_entailment", "entailment"]
    assert data.train.labels[3] == 1 - rows[3][2]


def test_no_network_is_one_line_that_says_what_to_do(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub (LocalEntryNotFound)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"cannot load nyu-mll/glue/sst2 from the Hugging Face "
                                        r"hub .*pass data_dir=<a GLUE folder with SST-2/"):
        read_task(TaskConfig(name="sst2"))


def test_custom_files_in_every_format(tmp_path):
    rows = sentence_examples(10, 0)
    csv_file = write_csv(str(tmp_path / "a.csv"), ["text", "label"], rows)
    tsv_file = write_csv(str(tmp_path / "a.tsv"), ["text", "label"], rows, delimiter="\t")
    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(f'{{"text": "{s}", "label": {y}}}\n' for s, y in rows)
    for path in (csv_file, tsv_file, str(tmp_path / "a.jsonl")):
        data = read_task(TaskConfig(name="custom", train_file=path, validation_file=path,
                                    text_columns=["text"]))
        assert data.train.text_a == [s for s, _ in rows]
        assert data.train.labels.tolist() == [y for _, y in rows] and data.num_labels == 2
    words = write_csv(str(tmp_path / "w.csv"), ["text", "label"],
                      [("a", "pos"), ("b", "neg"), ("c", "pos")])
    data = read_task(TaskConfig(name="custom", train_file=words, validation_file=words,
                                text_columns=["text"]))
    assert data.label_names == ["neg", "pos"] and data.train.labels.tolist() == [1, 0, 1]


def test_max_train_samples_is_one_fixed_subset(tmp_path):
    overrides = sentence_task(str(tmp_path), n_train=100)
    cfg = {o.split("=")[0].split(".")[-1]: o.split("=", 1)[1] for o in overrides[1:]}
    kwargs = dict(name="custom", train_file=cfg["train_file"],
                  validation_file=cfg["validation_file"], text_columns=["text"])
    a = read_task(TaskConfig(**kwargs, max_train_samples=30))
    b = read_task(TaskConfig(**kwargs, max_train_samples=30))
    whole = read_task(TaskConfig(**kwargs))
    assert a.train.text_a == b.train.text_a and len(a.train) == 30
    assert set(a.train.text_a) < set(whole.train.text_a)
    assert a.train.text_a != whole.train.text_a[:30]  # spread over the file, not its head


# --------------------------------------------------------------------------- one-line errors


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return pretrained_run(str(tmp_path_factory.mktemp("pretrained")))


def error_line(module, args, monkeypatch, capsys) -> str:
    """Run the command's main() with `args`: the one stderr line it exits 2 with."""
    monkeypatch.setattr(sys, "argv", ["prog"] + args)
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _custom(tmp_path, header, rows, *extra):
    path = write_csv(str(tmp_path / "data.csv"), header, rows)
    return ["task=custom", f"task.train_file={path}", f"task.validation_file={path}", *extra]


def _regression(tmp_path, metric, *model):
    """A regression task scored by a classification metric (a short recipe: a config that is
    accepted trains to the end before it is scored)."""
    rows = [(s, 0.5 + 3.0 * y) for s, y in sentence_examples(16, 5)]
    return [*_custom(tmp_path, ["text", "score"], rows, "task.text_columns=[text]",
                     "task.label_column=score", "task.num_labels=1", f"task.metrics=[{metric}]"),
            *model, "recipe.lrs=[1e-3]", "recipe.seeds=[1]", "recipe.epochs=1",
            "recipe.max_length=16"]


@pytest.mark.parametrize("case,expected", [
    ("unknown task", "did you mean task=stsb?"),
    ("unknown task name", "task.name 'sst3' is not a task: use one of cola, sst2"),
    ("missing column", "has no column 'sentence' (it has ['text', 'label']); set "
                       "task.text_columns"),
    ("label out of range", "line 3: label 5 is out of range: the task has 2 classes (0..1)"),
    ("empty file", "data.csv has no examples"),
    ("misspelt key", "did you mean recipe.lrs?"),
    ("no model", "model is not set; pass model="),
    ("missing model", "no such directory"),
    ("bad precision", "trainer.mixed_precision must be one of auto, no, bf16, fp16"),
    ("misspelt pooling", "recipe.pooling must be one of cls, mean, got 'men'"),
    ("layer decay above 1", "recipe.layer_lr_decay must be in (0, 1] (1 = one rate for every "
                            "layer), got 1.5"),
    ("negative re-init", "recipe.reinit_layers must be >= 0, got -1"),
    ("re-init past the layers", "recipe.reinit_layers=3 is more than the 2 encoder layers of "),
    ("a bert-train setting", "'data' is a bert-train setting (conf/train/), not a "
                             "bert-finetune one"),
    ("regression scored by accuracy", "task.metrics: accuracy scores classes; a regression "
                                      "task (task.num_labels=1) is scored by pearson, spearman"),
    ("regression scored by mcc", "task.metrics: mcc scores classes; a regression task"),
    ("the subset's old key", "task.max_train_samples is now max_train_samples, as in "
                             "bert-glue: pass max_train_samples=30"),
    ("the GLUE copy's old key", "task.data_dir is now data_dir, as in bert-glue: pass "
                                "data_dir=glue_data/SST-2"),
    ("a GLUE copy for a custom task", "data_dir is where GLUE tasks are read from; task=custom "
                                      "reads task.train_file"),
])
def test_bert_finetune_mistakes_are_one_line(case, expected, run, tmp_path, monkeypatch,
                                             capsys):
    from bert_pretrain.finetune import cli

    model = [f"model={run}", f"out_dir={tmp_path / 'out'}", "trainer.progress_bar=false"]
    args = {  # (built lazily: the custom cases write the same file)
        "unknown task": lambda: ["task=sts2", *model],
        "unknown task name": lambda: ["task.name=sst3", *model],
        "missing column": lambda: _custom(tmp_path, ["text", "label"], [("w1 w2", 0)],
                                          "task.text_columns=[sentence]", *model),
        "label out of range": lambda: _custom(tmp_path, ["text", "label"],
                                              [("w1", 0), ("w2", 5)],
                                              "task.text_columns=[text]", "task.num_labels=2",
                                              *model),
        "empty file": lambda: _custom(tmp_path, ["text", "label"], [],
                                      "task.text_columns=[text]", *model),
        "misspelt key": lambda: ["recipe.lr=1e-4", *model],
        "no model": lambda: [f"out_dir={tmp_path / 'out'}"],
        "missing model": lambda: [f"model={tmp_path / 'nothing'}", f"out_dir={tmp_path / 'out'}"],
        "bad precision": lambda: ["trainer.mixed_precision=bf17", *model],
        "misspelt pooling": lambda: ["recipe.pooling=men", *model],
        "layer decay above 1": lambda: ["recipe.layer_lr_decay=1.5", *model],
        "negative re-init": lambda: ["recipe.reinit_layers=-1", *model],
        "re-init past the layers": lambda: ["recipe.reinit_layers=3", *model],
        "a bert-train setting": lambda: ["data.dir=prepared/x", *model],
        "regression scored by accuracy": lambda: _regression(tmp_path, "accuracy", *model),
        "regression scored by mcc": lambda: _regression(tmp_path, "mcc", *model),
        "the subset's old key": lambda: ["task.max_train_samples=30", *model],
        "the GLUE copy's old key": lambda: ["task.data_dir=glue_data/SST-2", *model],
        "a GLUE copy for a custom task": lambda: _custom(
            tmp_path, ["text", "label"], [("w1", 0)], "task.text_columns=[text]",
            f"data_dir={tmp_path}", *model),
    }[case]()
    line = error_line(cli, args, monkeypatch, capsys)
    assert line.startswith("bert-finetune: error: ") and expected in line, line


def test_bert_finetune_and_bert_glue_spell_the_subset_and_the_glue_copy_alike(tmp_path):
    """One spelling for both commands (and bert-train's downstream.*): data_dir (a GLUE folder),
    max_train_samples, max_eval_samples at the top level; each reaches the task read."""
    from hydra import compose, initialize_config_dir

    from bert_pretrain.finetune.config import finetune_settings, glue_settings, register

    register()
    write_glue_task(str(tmp_path), "sst2", n_train=20, n_dev=12)
    same = [f"data_dir={tmp_path}", "max_train_samples=8", "max_eval_samples=5"]
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf", "finetune"),
                               version_base="1.3"):
        one = finetune_settings(compose("finetune", ["task=sst2", "model=m", *same]))
        glue = glue_settings(compose("glue", ["models=[m]", "tasks=[sst2]", *same]))
    assert (one.task.data_dir, one.task.max_train_samples, one.task.max_eval_samples) == \
        (glue.data_dir, glue.max_train_samples, glue.max_eval_samples) == (str(tmp_path), 8, 5)
    data = read_task(one.task)  # the GLUE folder, its SST-2/ found, subsets taken
    assert len(data.train) == 8 and [len(v) for v in data.evals.values()] == [5]


@pytest.mark.parametrize("args,expected", [
    (["models=[a]", "tasks=[sst2,foo]"], "tasks: ['foo']: use all, fast"),
    (["models=[a]", "task=sst2"], "did you mean tasks?"),
    (["tasks=fast"], "models is not set"),
    # a bert-train setting, said before this command's look-alike (did you mean data_dir?)
    (["models=[a]", "data.dir=prepared/x"], "'data' is a bert-train setting (conf/train/), "
                                            "not a bert-glue one"),
])
def test_bert_glue_mistakes_are_one_line(args, expected, tmp_path, monkeypatch, capsys):
    from bert_pretrain.finetune import glue

    line = error_line(glue, [*args, f"out_dir={tmp_path}"], monkeypatch, capsys)
    assert line.startswith("bert-glue: error: ") and expected in line, line


def test_bert_train_names_a_fine_tuning_setting(monkeypatch, capsys):
    from bert_pretrain import train

    line = error_line(train, ["task=sst2"], monkeypatch, capsys)
    assert "'task' is a bert-finetune setting (conf/finetune/), not a bert-train one" in line


@pytest.mark.parametrize("module,usage", [("bert_pretrain.finetune", "Usage: bert-finetune"),
                                          ("bert_pretrain.finetune.glue", "Usage: bert-glue")])
def test_help_lists_only_the_commands_own_groups(module, usage):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}, timeout=hang_limit())
    assert r.returncode == 0, r.stderr[-2000:]
    block = r.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    groups = {m.group(1) for m in re.finditer(r"^(\w+): ", block, re.M)}
    assert groups == {"task", "recipe", "trainer"}
    assert usage in r.stdout
