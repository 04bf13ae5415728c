"""Promises that docstrings make and no other test held (issue 32: a docstring that promises
behaviour gets a test of that promise, or loses the promise). Each test names the docstring."""

import json
import os

import pytest

from train_support import train_in_process, write_prepared


class Crash(BaseException):
    """A kill at that point: nothing after it runs (not caught by `except Exception`)."""


def test_plotting_save_writes_a_picture_atomically(tmp_path, monkeypatch):
    """plotting.save: "Write `fig` to `path` (PNG) atomically": a write that fails half-way
    leaves the picture that was there, and no half-written file beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bert_pretrain.tools import plotting

    path = tmp_path / "curves.png"
    plotting.save(plt.figure(), str(path))
    before = path.read_bytes()

    fig = plt.figure()

    def half_then_crash(target, **kwargs):
        with open(target, "wb") as f:
            f.write(before[:100])
        raise Crash

    monkeypatch.setattr(fig, "savefig", half_then_crash)
    with pytest.raises(Crash):
        plotting.save(fig, str(path))
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["curves.png"]
    assert not plt.fignum_exists(fig.number)  # closed all the same


def test_truncate_jsonl_leaves_the_old_log_or_the_new_never_half(tmp_path, monkeypatch):
    """metrics.truncate_jsonl: "a crash here leaves the old log or the new one, never a
    half-written one"; and it keeps the records up to the step, dropping a line cut short."""
    from bert_pretrain.components import metrics

    log = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6))
    log.write_text(text + '{"step": 6, "lo')

    def crash(*args):
        raise Crash

    monkeypatch.setattr(metrics.os, "replace", crash)
    with pytest.raises(Crash):
        metrics.truncate_jsonl(str(log), 3)
    assert log.read_text() == text + '{"step": 6, "lo'  # the old log, whole
    monkeypatch.undo()
    metrics.truncate_jsonl(str(log), 3)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3]


def test_a_failed_run_report_does_not_fail_the_finished_run(tmp_path, monkeypatch, capsys):
    """Trainer._write_report: "a failed picture never fails a finished run": the run ends
    normally, with one warning line that says how to draw the report later."""
    from bert_pretrain.tools import report

    def broken(run_dir):
        raise RuntimeError("no usable font\nsecond line")

    monkeypatch.setattr(report, "write_run_report", broken)
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    run = tmp_path / "run"
    objective = train_in_process(["experiment=smoke", f"data.dir={data}", f"run_dir={run}",
                                  "trainer.max_steps=3", "trainer.report=true"])
    assert objective == objective  # a number: the run finished
    err = capsys.readouterr().err
    assert f"bert-train: warning: no run report (no usable font); draw it later with " \
           f"bert-report {run}" in err.splitlines()
    assert (run / "checkpoints" / "step-00000003").is_dir()


def test_sweep_members_are_not_searched_inside(tmp_path):
    """sweep_summary.find_member_dirs: "The walk does not descend into a member": a member's
    own sub-folders (a nested Hydra run, say) are not members of the sweep."""
    from bert_pretrain.tools.sweep_summary import find_member_dirs

    for member in ("0", "1", "group/2", "0/inner"):
        (tmp_path / member / ".hydra").mkdir(parents=True)
        (tmp_path / member / ".hydra" / "overrides.yaml").write_text("[]\n")
    assert find_member_dirs(tmp_path) == [tmp_path / "0", tmp_path / "1", tmp_path / "group" / "2"]


def test_glue_tsv_rows_without_every_field_are_skipped(tmp_path):
    """reading._read_glue_tsv: "rows without every needed field are skipped (QQP's train file
    has a few)"; the others are read."""
    from bert_pretrain.finetune.reading import read_task
    from bert_pretrain.finetune.tasks import TaskConfig
    from finetune_support import write_glue_task

    folder = write_glue_task(str(tmp_path), "qqp", n_train=12, n_dev=6)
    train = os.path.join(folder, "train.tsv")
    with open(train, encoding="utf-8") as f:
        lines = f.readlines()
    with open(train, "a", encoding="utf-8") as f:  # a row cut after its first question
        f.write("\t".join(lines[1].rstrip("\n").split("\t")[:4]) + "\n")
    data = read_task(TaskConfig(name="qqp", data_dir=folder))
    assert len(data.train) == 12
