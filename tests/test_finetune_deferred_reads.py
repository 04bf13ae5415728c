"""bert-finetune's deferred reads (trainer.defer_reads, as bert-train's): one process with
torch's fused AdamW leaves each step's loss, gradient norm and skip decision on the device until
the next log, checkpoint or end. On the CPU these tests check that a step reads nothing back,
and that a fine-tune logs, skips, stops, saves, resumes and scores exactly as the same
fine-tune reading every step."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from bert_pretrain.errors import TrainingError
from finetune_support import FAST, finetune_in_process, kill_fine_tune_at, pretrained_run, \
    sentence_task
from test_trainer_rules import _NaNGrad

READ_EVERY_STEP = "trainer.defer_reads=false"
RUN = "lr0.001-seed1"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    return pretrained_run(str(root)), sentence_task(str(root / "task"), n_train=192)


def fine_tune(setup, out, *extra):
    run, task = setup
    # 192 sentences, batch 16: 12 steps an epoch; log and checkpoint steps that do not line up
    return finetune_in_process([*task, f"model={run}", *FAST, "recipe.epochs=1",
                                "trainer.save_model=all", "trainer.log_every=5",
                                "trainer.checkpoint_every=4", f"out_dir={out}", *extra])


def records(out):
    with open(out / RUN / "metrics.jsonl") as f:
        return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in f]


def watch_steps(monkeypatch):
    """Record, for each step, whether its numbers came back unread (device tensors), and any
    read of a float or bool tensor's value made during the step (a wait on a GPU)."""
    from bert_pretrain.finetune.runner import FineTune

    seen, reads, real_step = [], [], FineTune.train_step
    names = ("item", "__float__", "__bool__", "tolist")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def guarded(name):
        def read(self, *args, **kwargs):
            if self.dtype.is_floating_point or self.dtype == torch.bool:
                reads.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    def step(self):
        with monkeypatch.context() as m:
            for name in names:
                m.setattr(torch.Tensor, name, guarded(name))
            numbers, stopping = real_step(self)
        seen.append(isinstance(numbers.loss, torch.Tensor))
        return numbers, stopping

    monkeypatch.setattr(FineTune, "train_step", step)
    return seen, reads


@pytest.mark.parametrize("extra", [
    [], ["trainer.micro_batch_size=4"], ["trainer.mixed_precision=bf16"],
], ids=["fp32", "accumulation", "bf16"])
def test_a_deferred_fine_tune_logs_and_scores_as_one_reading_every_step(
        setup, tmp_path, monkeypatch, extra):
    seen, reads = watch_steps(monkeypatch)
    # (the padded layout, a GPU's default: the CPU's unpadded one plans from a host copy)
    extra = ["+impl.unpad=false", *extra]
    deferred = fine_tune(setup, tmp_path / "deferred", *extra)
    assert seen == [True] * 12 and reads == []  # nothing read inside a step
    seen.clear()
    read = fine_tune(setup, tmp_path / "read", *extra, READ_EVERY_STEP)
    assert seen == [False] * 12 and "item" in reads
    assert records(tmp_path / "deferred") == records(tmp_path / "read")
    assert [r["step"] for r in records(tmp_path / "read") if "loss" in r] == [5, 10, 12]
    assert deferred["score"] == read["score"]
    a = load_file(str(tmp_path / "deferred" / RUN / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "read" / RUN / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", [[], [READ_EVERY_STEP]], ids=["deferred", "read"])
def test_a_resume_from_inside_a_log_window_logs_as_the_uninterrupted_fine_tune(
        setup, tmp_path, monkeypatch, mode):
    """Killed in step 7 (step 4's checkpoint on disk, steps 5 and 6 lost): the resumed
    fine-tune's step-5 record averages steps 1-5, as the uninterrupted one's does (steps 1-4
    come from the checkpoint), and it ends with the same records and weights."""
    straight = fine_tune(setup, tmp_path / "straight", *mode)
    real_step = kill_fine_tune_at(monkeypatch, 6)
    with pytest.raises(RuntimeError, match="killed"):
        fine_tune(setup, tmp_path / "resumed", *mode)
    from bert_pretrain.finetune.runner import FineTune

    monkeypatch.setattr(FineTune, "train_step", real_step)
    resumed = fine_tune(setup, tmp_path / "resumed", *mode)
    assert records(tmp_path / "resumed") == records(tmp_path / "straight")
    assert resumed["score"] == straight["score"]
    a = load_file(str(tmp_path / "straight" / RUN / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / RUN / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", [[], [READ_EVERY_STEP]], ids=["deferred", "read"])
def test_a_non_finite_step_inside_a_window_stops_before_anything_after_it_is_saved(
        setup, tmp_path, monkeypatch, mode):
    """Step 5's gradient is nan (fp32: the first such step stops a fine-tune). Reading every
    step stops there; deferring skips the update on the device and stops at the next settle,
    the checkpoint of step 8, before saving it. Both name step 5, save nothing after step 4's
    checkpoint (the weights as step 4 left them), and record the divergence at step 5 in place
    of a resume state."""
    from bert_pretrain.finetune.runner import FineTune
    from bert_pretrain.model import BertForSequenceClassification

    current, forward, real_step = {}, BertForSequenceClassification.forward, FineTune.train_step

    def poisoned(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training and current["step"] == 4:  # (0-based: the fifth step)
            out.loss = _NaNGrad.apply(out.loss)
        return out

    def step(self):
        current["step"] = self.step
        before = [p.detach().clone() for p in self.raw_model.parameters()]
        out = real_step(self)
        if self.step == 4:  # the poisoned step is skipped where it runs: weights as they were
            current["unchanged"] = all(torch.equal(a, p) for a, p in
                                       zip(before, self.raw_model.parameters()))
        return out

    saved, real_save = [], FineTune.save

    def save(self):
        path = real_save(self)
        saved.append(os.path.basename(path))
        return path

    monkeypatch.setattr(BertForSequenceClassification, "forward", poisoned)
    monkeypatch.setattr(FineTune, "train_step", step)
    monkeypatch.setattr(FineTune, "save", save)
    with pytest.raises(TrainingError, match=r"non-finite for 1 consecutive steps \(step 5, "):
        fine_tune(setup, tmp_path / "out", "trainer.log_every=100", *mode)
    assert saved == ["step-00000004"] and current["unchanged"]
    assert not (tmp_path / "out" / RUN / "result.json").exists()
    assert json.loads((tmp_path / "out" / RUN / "diverged.json").read_text())["step"] == 5
    assert not (tmp_path / "out" / RUN / "checkpoints").exists()
