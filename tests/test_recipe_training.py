"""The recipe switches through the trainer (issue 26): exact resume inside a batch warmup and
inside a warmup-stable-decay decay, a decay branched from a stable checkpoint into its own run
directory equals a run planned that way, 1 and 2 processes train the same through the warmup, the
scheduled masking rate is what the steps used, and MLM-only data trains a model that exports as
BertForMaskedLM. (The pieces alone: test_recipe_schedules.py, test_mlm_only.py,
test_prep_packing.py.)"""

import os

import pytest
import torch
from safetensors.torch import load_file

from bert_pretrain.components import checkpoint_manager as cm
from train_support import read_metrics, train_in_process, write_prepared

TIMING = ("tokens_per_s", "elapsed_s")
# smoke's tiny model, batch warmup 8 -> 32 over 8 x 8 = 64 samples of 32 tokens each
RAMP = ["data.masking=dynamic", "data.batch_warmup_start=8",
        "data.batch_warmup_tokens=2048", "trainer.global_batch_size=32"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=96, num_valid=16)


def _train(data, run, *extra):
    return train_in_process(["experiment=smoke", f"data.dir={data}", f"run_dir={run}",
                             "trainer.eval_every=0", "trainer.log_every=1",
                             "trainer.keep_last_k=0", *extra])


def _records(run):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(str(run))]


def _weights(run, step):
    return load_file(os.path.join(cm.checkpoints_root(str(run)), f"step-{step:08d}",
                                  "model.safetensors"))


def _crash_after_save_at(monkeypatch, step):
    """Make the run die (as with kill -9) right after its checkpoint at `step`."""
    from bert_pretrain.trainer import Trainer

    real = Trainer.save

    def save(self):
        path = real(self)
        if self.step == step:
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(Trainer, "save", save)


@pytest.mark.parametrize("recipe, crash_at", [
    (RAMP, 3),                                                      # inside the batch warmup
    (["scheduler=wsd", "scheduler.decay_steps=4"], 6),              # inside the decay
    (["data.masking=dynamic", "data.masked_lm_prob=0.15", "data.masked_lm_prob_start=0.4"], 3),
])
def test_resume_inside_a_schedule_is_exact(data, tmp_path, monkeypatch, recipe, crash_at):
    common = [*recipe, "trainer.max_steps=8", "trainer.warmup_steps=2",
              "trainer.checkpoint_every=1"]
    _train(data, tmp_path / "straight", *common)
    _crash_after_save_at(monkeypatch, crash_at)
    with pytest.raises(KeyboardInterrupt):
        _train(data, tmp_path / "resumed", *common)
    monkeypatch.undo()
    _train(data, tmp_path / "resumed", *common, "resume=auto")
    a, b = _weights(tmp_path / "straight", 8), _weights(tmp_path / "resumed", 8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _records(tmp_path / "resumed") == _records(tmp_path / "straight")


def test_batch_warmup_and_its_lr_scaling_are_what_the_steps_used(data, tmp_path):
    _train(data, tmp_path / "run", *RAMP, "data.batch_warmup_lr_scaling=linear",
           "trainer.max_steps=10", "trainer.warmup_steps=1", "scheduler=constant",
           "trainer.checkpoint_every=100")
    steps = [r for r in read_metrics(str(tmp_path / "run")) if "loss" in r]
    sizes = [r["global_batch_size"] for r in steps]
    # 64 samples of warmup (2,048 tokens of 32-token rows), in steps of the start size
    assert sizes == [8, 8, 8, 16, 16, 24, 32, 32, 32, 32]
    for r in steps:  # constant schedule: lr = peak x batch / final (linear scaling)
        assert r["lr"] == pytest.approx(1e-3 * r["global_batch_size"] / 32)


def test_masking_rate_schedule_is_what_the_steps_used(data, tmp_path):
    _train(data, tmp_path / "run", "data.masking=dynamic", "data.masked_lm_prob=0.15",
           "data.masked_lm_prob_start=0.3", "trainer.max_steps=10", "trainer.warmup_steps=1",
           "trainer.checkpoint_every=100")
    rates = [r["masked_lm_prob"] for r in read_metrics(str(tmp_path / "run")) if "loss" in r]
    # linear from 0.3 at progress 0 to 0.15 at the end: step k (1-based) used progress (k-1)/10
    assert rates == pytest.approx([0.3 - 0.15 * k / 10 for k in range(10)])


def test_a_decay_branched_from_a_stable_checkpoint_equals_a_run_planned_that_way(data,
                                                                                 tmp_path):
    """The documented command: resume a stable-phase checkpoint of a long WSD run into a new
    run_dir with trainer.max_steps=S+N: the long run stays as it is, and the branch is the run
    that had been planned with max_steps=S+N from the start."""
    wsd = ["scheduler=wsd", "scheduler.decay_steps=4", "trainer.warmup_steps=2",
           "trainer.checkpoint_every=2"]
    _train(data, tmp_path / "long", *wsd, "trainer.max_steps=16")
    stable = os.path.join(cm.checkpoints_root(str(tmp_path / "long")), "step-00000006")
    _train(data, tmp_path / "decay6", *wsd, "trainer.max_steps=10", f"resume={stable}")
    _train(data, tmp_path / "planned", *wsd, "trainer.max_steps=10")
    a, b = _weights(tmp_path / "decay6", 10), _weights(tmp_path / "planned", 10)
    assert all(torch.equal(a[k], b[k]) for k in a)
    lr = {r["step"]: r["lr"] for r in read_metrics(str(tmp_path / "decay6")) if "loss" in r}
    # the history up to step 6 is the long run's; the decay's 4 steps are the last 4
    assert lr[6] == lr[7] == pytest.approx(1e-3) and lr[10] < lr[9] < lr[8] < lr[7]
    assert sorted(os.listdir(cm.checkpoints_root(str(tmp_path / "long")))) == \
        [cm.POINTER] + [f"step-{s:08d}" for s in range(2, 17, 2)]


def test_a_branch_with_another_max_steps_names_the_masking_rate_it_jumps_to(data, tmp_path,
                                                                           capsys):
    """A masking-rate schedule follows step / max_steps: a decay branched off with another
    max_steps cannot equal a run planned that way (the long run's history used the long
    schedule's rates), and its rate moves at the branch point. The resume's warning says so
    with the rates before and after, as it does for the learning rate."""
    recipe = ["scheduler=wsd", "scheduler.decay_steps=4", "trainer.warmup_steps=2",
              "trainer.checkpoint_every=2", "data.masking=dynamic", "data.masked_lm_prob=0.15",
              "data.masked_lm_prob_start=0.3"]
    _train(data, tmp_path / "long", *recipe, "trainer.max_steps=16")
    stable = os.path.join(cm.checkpoints_root(str(tmp_path / "long")), "step-00000006")
    capsys.readouterr()
    _train(data, tmp_path / "decay6", *recipe, "trainer.max_steps=10", f"resume={stable}")
    warning = [ln for ln in capsys.readouterr().err.splitlines() if "changed settings" in ln]
    assert len(warning) == 1, warning
    before, after = 0.3 - 0.15 * 6 / 16, 0.3 - 0.15 * 6 / 10
    assert f"masking rate at step 6: {before:.3g} -> {after:.3g}" in warning[0]
    assert "learning rate at step" not in warning[0]  # (the WSD rate itself does not move)
    rates = {r["step"]: r["masked_lm_prob"] for r in read_metrics(str(tmp_path / "decay6"))
             if "loss" in r}
    assert rates[6] == pytest.approx(0.3 - 0.15 * 5 / 16)  # the long run's, up to the branch
    assert rates[7] == pytest.approx(after)                 # then the branch's own schedule


def test_one_and_two_processes_train_the_same_through_the_batch_warmup(data, tmp_path):
    from test_distributed import train_1proc, train_accelerate

    common = [f"data.dir={data}", *RAMP, "trainer.max_steps=8", "trainer.warmup_steps=2",
              "trainer.micro_batch_size=4"]
    train_1proc(*common, f"run_dir={tmp_path / 'one'}")
    train_accelerate(2, *common, f"run_dir={tmp_path / 'two'}")
    one, two = (_records(tmp_path / n) for n in ("one", "two"))
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        assert a.get("global_batch_size") == b.get("global_batch_size")
        assert a.get("tokens_seen") == b.get("tokens_seen")
        for key in ("loss", "mlm_loss", "nsp_loss", "eval_mlm_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-5), (a["step"], key)


def test_mlm_only_data_trains_an_mlm_only_model_that_exports_as_bert_for_masked_lm(
        prep_compose, prep_tagged, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from data_prep.pipeline import run as prep

    from bert_pretrain.tools.export import export

    corpus, vocab = prep_tagged
    out = str(tmp_path / "packed")
    prep(prep_compose("corpus=text", f"corpus.paths=[{corpus}]", f"output_dir={out}",
                      f"tokenizer.vocab_file={vocab}", "max_seq_length=64",
                      "packing=full_sentences", "dupe_factor=1", "validation_fraction=0.1",
                      "num_proc=1", "max_predictions_per_seq=10"))
    run = tmp_path / "run"
    capsys.readouterr()
    _train(out, run, "model.max_position_embeddings=64", "model.type_vocab_size=1",
           "trainer.max_steps=4", "trainer.warmup_steps=1", "trainer.checkpoint_every=4",
           "trainer.eval_every=4")
    said = capsys.readouterr().out
    assert "MLM only (no NSP head: the data has no sentence pairs)" in said
    assert "NSP accuracy" not in said
    records = read_metrics(str(run))
    assert all("nsp_loss" not in r and "eval_nsp_accuracy" not in r for r in records)
    assert all(r["mlm_loss"] > 0 for r in records if "loss" in r)
    export(str(run), str(tmp_path / "hf"))
    model = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / "hf"))
    assert not hasattr(model.bert, "pooler") or model.bert.pooler is None
    with pytest.raises(Exception, match="objective=eval_loss needs next-sentence prediction"):
        _train(out, tmp_path / "run2", "model.max_position_embeddings=64",
               "model.type_vocab_size=1", "trainer.max_steps=4", "trainer.warmup_steps=1",
               "objective=eval_loss")
