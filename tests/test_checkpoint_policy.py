"""Checkpoints stay right in every order of events (checkpoint_manager.py): the run's line, not
the highest step number, is what resume=auto, bert-export, bert-predict and bert-report follow;
a resume from an older checkpoint moves the newer ones aside; retention keeps valid checkpoints
of the line and never the one just written; an interrupted re-save is repaired before the
search; and the logging window survives a resume, so metrics.jsonl matches an uninterrupted
run's."""

import json
import os
import shutil

import pytest

from bert_pretrain.components import checkpoint as ckpt
from bert_pretrain.components import checkpoint_manager as cm
from bert_pretrain.errors import CheckpointError
from train_support import read_metrics, train_in_process, write_prepared

TIMING = ("tokens_per_s", "elapsed_s")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=64, num_valid=8)


def _train(data, run, *extra):
    return train_in_process(["experiment=smoke", f"data.dir={data}", f"run_dir={run}",
                             "trainer.eval_every=0", "trainer.warmup_steps=1", *extra])


def _flip(file):
    raw = bytearray(open(file, "rb").read())
    raw[len(raw) // 2] ^= 0x10
    open(file, "wb").write(bytes(raw))


def _steps(run):
    return [s for s, _ in cm.list_checkpoints(str(run))]


def _training_records(run):
    return {r["step"]: {k: v for k, v in r.items() if k not in TIMING}
            for r in read_metrics(str(run)) if "loss" in r}


def test_a_damaged_newest_checkpoint_never_makes_a_new_save_disappear(data, tmp_path, capsys):
    """keep_last_k=1 after resume=auto skipped a damaged step 8: the saves of the new line are
    kept (the damaged one does not hold the only slot), the end message names a checkpoint that
    exists, and the next resume=auto continues from it."""
    run = tmp_path / "run"
    _train(data, run, "trainer.max_steps=8", "trainer.checkpoint_every=4",
           "trainer.keep_last_k=5")
    _flip(os.path.join(cm.checkpoints_root(str(run)), "step-00000008", "optimizer.pt"))
    capsys.readouterr()
    _train(data, run, "trainer.max_steps=7", "trainer.checkpoint_every=1",
           "trainer.keep_last_k=1", "resume=auto")
    out = capsys.readouterr()
    final = [ln.split("checkpoint: ", 1)[1] for ln in out.out.splitlines()
             if ln.strip().startswith("checkpoint: ")]
    assert final and final[-1].endswith("step-00000007") and os.path.isdir(final[-1])
    assert _steps(run) == [7]
    assert "skipping damaged checkpoint" in out.err and "step-00000008 (damaged)" in out.err
    assert cm.latest_checkpoint(str(run)) == final[-1]
    _train(data, run, "trainer.max_steps=9", "trainer.checkpoint_every=1",
           "trainer.keep_last_k=1", "resume=auto")
    assert f"resumed from {final[-1]}" in capsys.readouterr().out


def test_a_resume_from_an_older_checkpoint_is_a_branch_that_everything_follows(data, tmp_path,
                                                                               capsys):
    """Train to 12 at lr 1e-3, resume from step 4 at lr 1e-2 and stop at 9: step 9 is the
    newest (not step 12), for resume=auto, bert-export, bert-predict and bert-report; the old
    line's checkpoints are moved aside with a copy of its metrics, not deleted."""
    from bert_pretrain.tools.export import export
    from bert_pretrain.tools.model_loading import load_model
    from bert_pretrain.tools.report import read_run

    run = tmp_path / "run"
    root = cm.checkpoints_root(str(run))
    _train(data, run, "trainer.max_steps=12", "trainer.checkpoint_every=4",
           "trainer.keep_last_k=5", "optim.lr=1e-3")
    old = _training_records(run)
    capsys.readouterr()
    _train(data, run, "trainer.max_steps=9", "trainer.checkpoint_every=4",
           "trainer.keep_last_k=5", "optim.lr=1e-2", f"resume={root}/step-00000004")
    err = capsys.readouterr().err
    moved = [ln for ln in err.splitlines() if "starts a new line" in ln]
    assert len(moved) == 1 and "step-00000008, step-00000012 were moved to" in moved[0], err
    assert _steps(run) == [4, 8, 9]
    aside = [n for n in os.listdir(root) if n.startswith(cm.ABANDONED_PREFIX)]
    assert len(aside) == 1
    kept = os.path.join(root, aside[0])
    assert sorted(os.listdir(kept)) == ["metrics.jsonl", "step-00000008", "step-00000012"]
    assert ckpt.verify_checkpoint(os.path.join(kept, "step-00000012"))["step"] == 12
    assert max(r["step"] for r in read_metrics(kept) if "loss" in r) == 12  # the old line's log
    newest = os.path.join(root, "step-00000009")
    assert cm.latest_checkpoint(str(run)) == newest
    assert load_model(str(run)).source == newest                      # bert-predict RUN_DIR
    assert export(str(run), str(tmp_path / "hf")) == newest           # bert-export RUN_DIR
    assert read_run(str(run)).checkpoint == newest                    # bert-report RUN_DIR
    records = _training_records(run)
    assert sorted(records) == list(range(1, 10))
    assert all(records[s] == old[s] for s in range(1, 5))             # the shared history
    assert records[5]["lr"] != old[5]["lr"]                           # the branch's own
    state = ckpt.read_train_state(newest)
    assert state["parent"] == "step-00000008"
    assert ckpt.read_train_state(os.path.join(root, "step-00000008"))["parent"] == \
        "step-00000004"
    _train(data, run, "trainer.max_steps=10", "trainer.checkpoint_every=4",
           "trainer.keep_last_k=5", "optim.lr=1e-2", "resume=auto")
    assert f"resumed from {newest}" in capsys.readouterr().out


def test_resume_from_another_runs_checkpoint_branches_into_the_new_run_dir(data, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    _train(data, first, "trainer.max_steps=6", "trainer.checkpoint_every=3",
           "trainer.keep_last_k=5")
    source = os.path.join(cm.checkpoints_root(str(first)), "step-00000003")
    _train(data, second, "trainer.max_steps=5", "trainer.checkpoint_every=1",
           "trainer.keep_last_k=5", f"resume={source}")
    assert _steps(first) == [3, 6]  # the source run is untouched
    assert _steps(second) == [4, 5]
    assert ckpt.read_train_state(cm.latest_checkpoint(str(second)))["step"] == 5
    assert ckpt.read_train_state(os.path.join(cm.checkpoints_root(str(second)),
                                              "step-00000004"))["parent"] == \
        os.path.abspath(source)


def test_retention_keeps_valid_checkpoints_of_the_line(tmp_path):
    """keep_last_k counts valid checkpoints: a damaged one never takes a valid one's place, and
    the one just written is kept whatever the others are."""
    from test_checkpoint import SMALL, _save
    from bert_pretrain.model import BertConfig, BertForPreTraining

    model = BertForPreTraining(BertConfig(**SMALL))
    run = str(tmp_path / "run")
    manager = cm.CheckpointManager(run, keep_last_k=2)
    for step in (1, 2):
        _save_with(manager, step, model)
    _flip(os.path.join(cm.checkpoints_root(run), "step-00000002", "model.safetensors"))
    ckpt._verified.clear()  # (as a new process would: the damage happened after the write)
    _save_with(manager, 3, model)
    assert _steps(run) == [1, 2, 3]  # step 2 is damaged: 1 and 3 are the two valid ones
    _save_with(manager, 4, model)
    assert _steps(run) == [3, 4]
    assert _save(run, 5, model, keep=1) and _steps(run) == [5]


def _save_with(manager, step, model):
    import torch

    return manager.save(step, model=model,
                        optimizer_state=torch.optim.AdamW(model.parameters()).state_dict(),
                        extra_state={}, train_state={"model_config": model.config.to_dict()},
                        config_yaml="seed: 1\n", tokenizer_dir=None)


def test_the_line_is_found_without_its_pointer_and_after_a_save_killed_before_it(tmp_path,
                                                                                  capsys):
    from test_checkpoint import SMALL
    from bert_pretrain.model import BertConfig, BertForPreTraining

    model = BertForPreTraining(BertConfig(**SMALL))
    run = str(tmp_path / "run")
    root = cm.checkpoints_root(run)
    manager = cm.CheckpointManager(run)
    for step in (2, 4):
        _save_with(manager, step, model)
    pointer = json.load(open(os.path.join(root, cm.POINTER)))
    assert [e["name"] for e in pointer["line"]] == ["step-00000002", "step-00000004"]
    # a save killed between writing step 6 and rewriting the pointer: step 6 is still newest
    json_before = open(os.path.join(root, cm.POINTER)).read()
    _save_with(manager, 6, model)
    open(os.path.join(root, cm.POINTER), "w").write(json_before)
    assert cm.latest_checkpoint(run).endswith("step-00000006")
    # a lost pointer: the highest valid step
    os.remove(os.path.join(root, cm.POINTER))
    assert cm.latest_checkpoint(run).endswith("step-00000006")
    # a damaged pointer: said once, then the highest valid step
    open(os.path.join(root, cm.POINTER), "w").write("{not json")
    capsys.readouterr()
    assert cm.latest_checkpoint(run).endswith("step-00000006")
    assert "latest.json is unreadable" in capsys.readouterr().err


def test_an_interrupted_resave_is_repaired_before_resume_auto_searches(data, tmp_path, capsys):
    """Killed between the two renames of a re-save, the only good copy of step 4 is
    .old-step-00000004: resume=auto puts it back and continues from it (not from step 0, which
    would also have emptied metrics.jsonl)."""
    run = tmp_path / "run"
    _train(data, run, "trainer.max_steps=4", "trainer.checkpoint_every=4",
           "trainer.keep_last_k=5")
    path = os.path.join(cm.checkpoints_root(str(run)), "step-00000004")
    os.rename(path, os.path.join(cm.checkpoints_root(str(run)), ".old-step-00000004"))
    os.makedirs(os.path.join(cm.checkpoints_root(str(run)), ".tmp-step-00000004"))
    capsys.readouterr()
    _train(data, run, "trainer.max_steps=6", "trainer.checkpoint_every=4",
           "trainer.keep_last_k=5", "resume=auto")
    assert f"resumed from {path}" in capsys.readouterr().out
    assert sorted(_training_records(run)) == list(range(1, 7))


def test_a_resumed_run_logs_exactly_what_an_uninterrupted_run_logs(data, tmp_path,
                                                                   monkeypatch):
    """The checkpoint at step 3 falls inside a 4-step logging window: the record at step 4 after
    the resume averages steps 1-4, as the uninterrupted run's does (the window's sums are in
    the checkpoint). Timing fields aside, metrics.jsonl is the same."""
    from bert_pretrain.trainer import Trainer

    common = ["trainer.max_steps=8", "trainer.checkpoint_every=3", "trainer.log_every=4",
              "trainer.keep_last_k=5", "trainer.eval_every=4"]
    _train(data, tmp_path / "straight", *common)
    real_save = Trainer.save

    def crash_after_first_save(self):
        real_save(self)
        raise KeyboardInterrupt  # like a kill -9 right after the save at step 3

    monkeypatch.setattr(Trainer, "save", crash_after_first_save)
    with pytest.raises(KeyboardInterrupt):
        _train(data, tmp_path / "resumed", *common)
    monkeypatch.undo()
    _train(data, tmp_path / "resumed", *common, "resume=auto")
    strip = [{k: v for k, v in r.items() if k not in TIMING}
             for r in read_metrics(str(tmp_path / "straight"))]
    again = [{k: v for k, v in r.items() if k not in TIMING}
             for r in read_metrics(str(tmp_path / "resumed"))]
    assert again == strip


class FakeClock:
    """A stand-in for the trainer's `time` module whose clock moves only when read (a
    millisecond a reading) or told to (`sleep`): what a test measures with it does not depend on
    how fast or how busy the machine is."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.001
        return self.now

    monotonic = time = perf_counter

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_tokens_per_s_counts_training_time_only(data, tmp_path, monkeypatch):
    """An evaluation between two logged records (here 1,000 s long, on the fake clock) shows
    neither in the tokens/s of the record after it nor in the training time (elapsed_s, which
    a time budget spends): both count the training steps only."""
    from bert_pretrain import trainer as trainer_module
    from bert_pretrain.trainer import Trainer

    clock = FakeClock()
    monkeypatch.setattr(trainer_module, "time", clock)
    real = Trainer.run_evaluation

    def slow_evaluation(self, *args, **kwargs):
        clock.sleep(1000.0)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "run_evaluation", slow_evaluation)
    _train(data, tmp_path / "run", "trainer.max_steps=4", "trainer.log_every=2",
           "trainer.eval_every=2")
    records = {r["step"]: r for r in read_metrics(str(tmp_path / "run")) if "loss" in r}
    seconds = (records[4]["tokens_seen"] - records[2]["tokens_seen"]) / records[4]["tokens_per_s"]
    assert 0 < seconds < 1.0  # the window's two steps: a few readings of the clock each
    assert records[4]["elapsed_s"] < 1.0  # the 1,000 s evaluation is not training time
    assert clock.now > 1000.0  # (the evaluation did take its 1,000 s)


def test_begin_moves_nothing_when_resuming_the_newest(tmp_path):
    from test_checkpoint import SMALL
    from bert_pretrain.model import BertConfig, BertForPreTraining

    model = BertForPreTraining(BertConfig(**SMALL))
    run = str(tmp_path / "run")
    manager = cm.CheckpointManager(run)
    for step in (1, 2):
        _save_with(manager, step, model)
    again = cm.CheckpointManager(run)
    assert again.begin(again.find("auto")) == []
    assert again.line == ["step-00000001", "step-00000002"]
    shutil.rmtree(cm.checkpoints_root(run))
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        again.find(os.path.join(cm.checkpoints_root(run), "step-00000001"))
