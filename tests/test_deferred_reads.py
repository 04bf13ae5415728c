"""Deferred reads: a one-process run with torch's fused AdamW leaves each step's loss, gradient
norm and skip decision on the device until the next log, checkpoint or stop, so that a GPU
need not finish a step before the host prepares the next. These tests check, on the CPU, that
a step reads nothing from its tensors, and that a run logs, skips, stops and saves exactly what
the same run reading every step does."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from bert_pretrain.errors import TrainingError
from test_trainer_rules import _NaNGrad
from train_support import read_metrics, train_in_process, write_prepared

TIMING = ("tokens_per_s", "elapsed_s")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=48, num_valid=8)


def overrides(data, run_dir, *extra):
    # log and checkpoint steps that do not line up, so steps wait unsettled across both
    return ["experiment=smoke", f"data.dir={data}", f"run_dir={run_dir}",
            "trainer.log_every=4", "trainer.checkpoint_every=3", "trainer.eval_every=5",
            "trainer.keep_last_k=10", *extra]


READ_EVERY_STEP = "trainer.defer_reads=false"


def without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def make_trainer(data, run_dir, *extra):
    from omegaconf import OmegaConf

    from bert_pretrain.config import settings
    from bert_pretrain.trainer import Trainer
    from train_support import compose

    cfg = compose(overrides(data, run_dir, "trainer.mixed_precision=no", *extra))
    return Trainer(settings(cfg), OmegaConf.to_container(cfg, resolve=True), "")


def test_a_deferred_step_reads_nothing_back_until_settled(tmp_path, synthetic, monkeypatch):
    """Any read of a float or bool tensor's value in a step would be a wait for a GPU; with the
    padded layout (a GPU's default) a step makes none, and the MLM head is given its row count
    from the host. The results hold tensors until settled, and settling gives the numbers the
    same steps read one by one give."""
    reads = []

    def guard(m, name):
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, **kwargs):
            if self.dtype.is_floating_point or self.dtype == torch.bool:
                reads.append(name)
            return original(self, *args, **kwargs)

        m.setattr(torch.Tensor, name, guarded)

    def three_steps(run_dir, *extra):
        trainer = make_trainer(synthetic, run_dir, "impl.unpad=false", *extra)
        try:
            with monkeypatch.context() as m:
                for name in ("item", "__float__", "__bool__", "tolist"):
                    guard(m, name)
                results = [trainer.train_step() for _ in range(3)]
            held = [isinstance(v, torch.Tensor) for v in results[0]._held.values()]
            numbers = [(r.loss, r.mlm_loss, r.nsp_loss, r.grad_norm, r.updated) for r in results]
            return trainer.defer_reads, held, numbers
        finally:
            trainer.close()

    import bert_pretrain.model.bert as bert

    counts, gather = [], bert.labelled_rows

    def counted(flat_labels, count=None):
        counts.append(count)
        return gather(flat_labels, count)

    monkeypatch.setattr(bert, "labelled_rows", counted)
    deferred, held, numbers = three_steps(tmp_path / "deferred")
    assert deferred and all(held) and reads == []
    # the MLM head gathers its rows at the count the trainer took from the batch on the host
    assert len(counts) == 3 and all(isinstance(c, int) and c > 0 for c in counts)
    assert all(isinstance(x, float) for row in numbers for x in row[:4])
    # the same steps reading every step: reads in each step, the same numbers
    deferred, held, read = three_steps(tmp_path / "read", READ_EVERY_STEP)
    assert not deferred and not any(held) and "item" in reads
    assert numbers == read


@pytest.mark.parametrize("precision,extra", [
    ("no", []), ("bf16", []),
    ("no", ["trainer.micro_batch_size=2"]),   # 4 micro-batches a step: their sums deferred
    ("no", ["model.generator_layers=1"]),      # ELECTRA: the discriminator's loss joins
    # ELECTRA on the padded grid (a GPU's default): its real tokens picked at the host's count
    ("no", ["model.generator_layers=1", "impl.unpad=false"]),
], ids=["fp32", "bf16", "accumulation", "electra", "electra-padded"])
def test_a_deferred_run_logs_saves_and_resumes_as_one_reading_every_step(
        tmp_path, synthetic, precision, extra):
    deferred, read = tmp_path / "deferred", tmp_path / "read"
    common = ["trainer.max_steps=10", f"trainer.mixed_precision={precision}", *extra]
    train_in_process(overrides(synthetic, deferred, *common))
    train_in_process(overrides(synthetic, read, *common, READ_EVERY_STEP))
    assert without_timing(read_metrics(deferred)) == without_timing(read_metrics(read))
    assert [r["step"] for r in read_metrics(deferred) if "loss" in r] == [4, 8, 10]
    saved = sorted(os.listdir(deferred / "checkpoints"))
    assert saved == sorted(os.listdir(read / "checkpoints"))
    for name in [n for n in saved if n.startswith("step-")]:
        a = load_file(str(deferred / "checkpoints" / name / "model.safetensors"))
        b = load_file(str(read / "checkpoints" / name / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), name
        sa = torch.load(deferred / "checkpoints" / name / "optimizer.pt", weights_only=False)
        sb = torch.load(read / "checkpoints" / name / "optimizer.pt", weights_only=False)
        assert all(torch.equal(sa["state"][i][k], sb["state"][i][k])
                   for i in sa["state"] for k in sa["state"][i]), name

    # Resumed from step 6, mid-window (steps 5-6 were settled into the saved log window when
    # it was written): the same records and weights as the uninterrupted run.
    resumed = tmp_path / "resumed"
    shutil.copytree(deferred / "checkpoints" / "step-00000006",
                    resumed / "checkpoints" / "step-00000006")
    train_in_process(overrides(synthetic, resumed, *common, "resume=auto"))
    after = [r for r in without_timing(read_metrics(resumed)) if "loss" in r]
    assert after == [r for r in without_timing(read_metrics(deferred))
                     if "loss" in r and r["step"] > 6]
    a = load_file(str(resumed / "checkpoints" / "step-00000010" / "model.safetensors"))
    b = load_file(str(deferred / "checkpoints" / "step-00000010" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def poison_training_steps(monkeypatch, steps):
    from bert_pretrain.model import BertForPreTraining

    original, calls = BertForPreTraining.forward, {"n": 0}

    def poisoned(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.training:
            calls["n"] += 1
            if calls["n"] in steps:  # one micro-batch per step
                out.mlm_loss = _NaNGrad.apply(out.mlm_loss)
        return out

    monkeypatch.setattr(BertForPreTraining, "forward", poisoned)


def test_a_skipped_step_is_skipped_on_the_device(tmp_path, synthetic, monkeypatch):
    """A NaN gradient at step 2, inside a log window: the fused optimizer leaves the weights and
    its moments as they were, the window's averages leave the step out, and the weights equal
    those of the run that read every step."""
    runs = {}
    for name in ("deferred", "read"):
        with monkeypatch.context() as m:
            poison_training_steps(m, {2})
            runs[name] = tmp_path / name
            train_in_process(overrides(synthetic, runs[name], "trainer.max_steps=6",
                                       "trainer.max_grad_norm=null",
                                       *([READ_EVERY_STEP] if name == "read" else [])))
    records = [r for r in read_metrics(runs["deferred"]) if "loss" in r]
    assert without_timing(records) == without_timing(
        [r for r in read_metrics(runs["read"]) if "loss" in r])
    assert records[0]["step"] == 4 and "nonfinite_steps" not in records[0]
    a = load_file(str(runs["deferred"] / "checkpoints" / "step-00000006" / "model.safetensors"))
    b = load_file(str(runs["read"] / "checkpoints" / "step-00000006" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = torch.load(runs["deferred"] / "checkpoints" / "step-00000006" / "optimizer.pt",
                       weights_only=False)["state"]
    assert {float(s["step"]) for s in state.values()} == {5.0}  # 6 steps, one skipped


def test_non_finite_steps_stop_a_deferred_run_at_the_next_settle(tmp_path, synthetic,
                                                                 monkeypatch):
    """Steps 4-9 non-finite with a limit of 2: the limit is reached at step 5. The run reading
    every step stops there; the deferred run finds it at its next settle (the checkpoint at
    step 6, after the evaluation at step 5), names step 5 too and also saves nothing after
    step 3."""
    for name in ("deferred", "read"):
        with monkeypatch.context() as m:
            poison_training_steps(m, {4, 5, 6, 7, 8, 9})
            with pytest.raises(TrainingError, match=r"non-finite for 2 consecutive steps "
                                                    r"\(step 5\); last good checkpoint: "
                                                    r".*step-00000003"):
                train_in_process(overrides(synthetic, tmp_path / name, "trainer.max_steps=12",
                                           "trainer.max_grad_norm=null",
                                           "trainer.max_nonfinite_steps=2",
                                           *([READ_EVERY_STEP] if name == "read" else [])))
        assert sorted(n for n in os.listdir(tmp_path / name / "checkpoints")
                      if n.startswith("step-")) == ["step-00000003"]
    evaluated = {name: [r["step"] for r in read_metrics(tmp_path / name) if "eval_mlm_loss" in r]
                 for name in ("deferred", "read")}
    assert evaluated == {"deferred": [5], "read": []}
