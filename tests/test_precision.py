"""One precision policy (precision.py): fp16 on CPU gets real loss scaling (torch.amp.GradScaler
on cpu), so a step with inf/nan gradients is skipped and the scale lowered instead of poisoning
the weights; the start-up line says what is done; the scaler's state is in the checkpoint."""

import pytest
import torch

from bert_pretrain.components.precision import SCALER_ROOM, Precision
from test_trainer_rules import _NaNGrad
from train_support import read_metrics, train_in_process, write_prepared


def test_the_policy_decides_autocast_and_scaling():
    fp32, bf16, fp16 = (Precision.resolve(m, "cpu") for m in ("no", "bf16", "fp16"))
    assert fp32.scaler is None and bf16.scaler is None and fp16.scaler is not None
    assert fp16.scaler.is_enabled() and fp16.scaler.get_scale() == 2.0 ** 16
    x = torch.randn(4, 4)
    with bf16.autocast():
        assert (x @ x).dtype == torch.bfloat16
    with fp16.autocast():
        assert (x @ x).dtype == torch.float16
    with fp32.autocast():
        assert (x @ x).dtype == torch.float32
    assert fp16.nonfinite_limit(10) == 10 + SCALER_ROOM and bf16.nonfinite_limit(10) == 10
    assert "GradScaler on cpu" in fp16.describe()


def test_a_step_the_scaler_skips_on_its_own_is_reported_as_skipped():
    """fp16: the grad scaler skips a step whose unscaled gradients hold inf even when the
    caller saw a finite loss (and measured no gradient): step() says it was not applied."""
    fp16 = Precision.resolve("fp16", "cpu")
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    fp16.scale((weight * torch.tensor([1.0, float("inf"), 1.0])).sum()).backward()
    fp16.unscale(optimizer)
    assert fp16.step(optimizer, finite=True) is False
    assert torch.equal(weight.detach(), torch.ones(3)) and fp16.scaler.get_scale() == 2.0 ** 15
    optimizer.zero_grad()
    fp16.scale(weight.sum()).backward()
    fp16.unscale(optimizer)
    assert fp16.step(optimizer, finite=True) is True
    assert torch.allclose(weight.detach(), torch.full((3,), 0.9))


def test_fp16_on_cpu_skips_a_nan_gradient_step_and_lowers_the_scale(tmp_path, monkeypatch,
                                                                     capsys):
    from safetensors.torch import load_file

    from bert_pretrain.model import BertForPreTraining

    data = write_prepared(str(tmp_path / "data"), num_train=48, num_valid=8)
    original, calls = BertForPreTraining.forward, {"n": 0}

    def poisoned(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 2:  # the second training step
                out.mlm_loss = _NaNGrad.apply(out.mlm_loss)
        return out

    monkeypatch.setattr(BertForPreTraining, "forward", poisoned)
    run = tmp_path / "run"
    train_in_process(["experiment=smoke", f"data.dir={data}", f"run_dir={run}",
                      "trainer.eval_every=0", "trainer.max_steps=4", "trainer.checkpoint_every=1",
                      "trainer.keep_last_k=10", "trainer.mixed_precision=fp16"])
    out = capsys.readouterr().out
    assert "precision fp16 autocast with dynamic loss scaling (torch.amp.GradScaler on cpu" in out
    records = [r for r in read_metrics(run) if "loss" in r]
    assert records[1]["loss"] is None and records[1]["nonfinite_steps"] == 1
    assert all(r["loss"] is not None for r in records[2:])
    assert not (run / "checkpoints" / "step-00000002").exists()  # a skipped step is not saved
    for step in (1, 3, 4):
        weights = load_file(str(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values()), step
    scales = [torch.load(run / "checkpoints" / f"step-{s:08d}" / "trainer_state.pt",
                         weights_only=True)["scaler"]["scale"] for s in (1, 3)]
    assert scales[1] == scales[0] / 2  # the scaler backed off after the bad step


# --------------------------------------------------------------------------- fp16 against fp32


def _first_grad_norm(records):
    return next(r["grad_norm"] for r in records if "loss" in r and r["step"] == 1)


def test_fp16_measures_and_clips_the_unscaled_gradient(tmp_path):
    """The loss scale (2^16 at first) is divided out before the gradient norm is measured and
    clipped: the fp16 run's norm is the fp32 run's (to fp16's precision), not 65,536 times it
    (clipping that would shrink the step to almost nothing)."""
    data = write_prepared(str(tmp_path / "data"), num_train=48, num_valid=8)
    norms = {}
    for mode in ("no", "fp16"):
        run = tmp_path / mode
        train_in_process(["experiment=smoke", f"data.dir={data}", f"run_dir={run}",
                          "trainer.eval_every=0", "trainer.max_steps=1", "trainer.log_every=1",
                          "trainer.warmup_steps=0", "trainer.max_grad_norm=0.5",
                          "trainer.checkpoint_every=1", f"trainer.mixed_precision={mode}"])
        norms[mode] = _first_grad_norm(read_metrics(run))
    assert norms["no"] > 0.5 and norms["fp16"] == pytest.approx(norms["no"], rel=0.02)


def test_an_fp16_resume_continues_with_the_saved_loss_scale(tmp_path, monkeypatch):
    """The scale an fp16 run found (halved after a skipped step) travels in the checkpoint: a
    run resumed after it goes on with that scale, as the uninterrupted run does."""
    from bert_pretrain.model import BertForPreTraining
    from bert_pretrain.trainer import Trainer

    data = write_prepared(str(tmp_path / "data"), num_train=48, num_valid=8)
    original = BertForPreTraining.forward
    trainer_step = {"n": 0}

    def poisoned(self, *args, **kwargs):  # the second step's gradient is nan
        out = original(self, *args, **kwargs)
        if self.training and trainer_step["n"] == 1:
            out.mlm_loss = _NaNGrad.apply(out.mlm_loss)
        return out

    real_step = Trainer.train_step

    def step(self):
        trainer_step["n"] = self.step
        return real_step(self)

    monkeypatch.setattr(BertForPreTraining, "forward", poisoned)
    monkeypatch.setattr(Trainer, "train_step", step)
    common = ["experiment=smoke", f"data.dir={data}", "trainer.eval_every=0",
              "trainer.max_steps=5", "trainer.checkpoint_every=1", "trainer.keep_last_k=10",
              "trainer.mixed_precision=fp16"]
    train_in_process([*common, f"run_dir={tmp_path / 'straight'}"])
    real_save = Trainer.save

    def crash_after_step_3(self):
        path = real_save(self)
        if self.step == 3:
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(Trainer, "save", crash_after_step_3)
    with pytest.raises(KeyboardInterrupt):
        train_in_process([*common, f"run_dir={tmp_path / 'resumed'}"])
    monkeypatch.setattr(Trainer, "save", real_save)
    train_in_process([*common, f"run_dir={tmp_path / 'resumed'}", "resume=auto"])

    def scaler(run, s):
        return torch.load(run / "checkpoints" / f"step-{s:08d}" / "trainer_state.pt",
                          weights_only=True)["scaler"]

    assert scaler(tmp_path / "straight", 3)["scale"] == 2.0 ** 15  # halved at step 2
    for s in (4, 5):
        assert scaler(tmp_path / "resumed", s) == scaler(tmp_path / "straight", s), s


# --------------------------------------------------------------------------- fine-tuning


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from finetune_support import pretrained_run, sentence_task

    root = tmp_path_factory.mktemp("finetune")
    return pretrained_run(str(root)), sentence_task(str(root / "task"), n_train=64, n_dev=32)


def _poison_fine_tune_steps(monkeypatch, steps):
    """Give the fine-tuning steps in `steps` (0-based) a nan gradient."""
    from bert_pretrain.finetune.runner import FineTune
    from bert_pretrain.model import BertForSequenceClassification

    current = {"step": -1}
    original = BertForSequenceClassification.forward
    real_step = FineTune.train_step

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.training and current["step"] in steps:
            out.loss = _NaNGrad.apply(out.loss)
        return out

    def step(self):
        current["step"] = self.step
        return real_step(self)

    monkeypatch.setattr(BertForSequenceClassification, "forward", forward)
    monkeypatch.setattr(FineTune, "train_step", step)


def _fine_tune(pretrained, out, *extra):
    from finetune_support import FAST, finetune_in_process

    run, task = pretrained
    return finetune_in_process([*task, f"model={run}", *FAST, "recipe.epochs=1",
                                "trainer.save_model=all", f"out_dir={out}", *extra])


def _fine_tune_records(out):
    import json

    with open(out / "lr0.001-seed1" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_an_fp16_fine_tune_measures_and_clips_the_unscaled_gradient(pretrained, tmp_path,
                                                                    one_thread):
    norms = {}
    for mode in ("no", "fp16"):
        _fine_tune(pretrained, tmp_path / mode, f"trainer.mixed_precision={mode}",
                   "recipe.max_grad_norm=0.5")
        norms[mode] = _first_grad_norm(_fine_tune_records(tmp_path / mode))
    assert norms["no"] > 1e-3 and norms["fp16"] == pytest.approx(norms["no"], rel=0.02)


def test_an_fp16_fine_tune_resumes_with_the_saved_loss_scale(pretrained, tmp_path, monkeypatch,
                                                             one_thread):
    from bert_pretrain.finetune.runner import FineTune
    from finetune_support import kill_fine_tune_at

    _poison_fine_tune_steps(monkeypatch, {1})
    common = ["trainer.mixed_precision=fp16", "trainer.checkpoint_every=3"]
    _fine_tune(pretrained, tmp_path / "straight", *common)
    straight = _fine_tune_records(tmp_path / "straight")
    scales = [r["loss_scale"] for r in straight if "loss" in r]
    assert scales[:3] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15]  # (after each step)
    poisoned_step = kill_fine_tune_at(monkeypatch, 3)  # (right after the save at step 3)
    with pytest.raises(RuntimeError, match="killed"):
        _fine_tune(pretrained, tmp_path / "resumed", *common)
    monkeypatch.setattr(FineTune, "train_step", poisoned_step)
    _fine_tune(pretrained, tmp_path / "resumed", *common)
    resumed = _fine_tune_records(tmp_path / "resumed")
    assert [r.get("loss_scale") for r in resumed] == [r.get("loss_scale") for r in straight]


def test_a_grid_goes_on_past_a_run_that_diverged(pretrained, tmp_path, monkeypatch, capsys,
                                                 one_thread):
    """lr 1e-3 seed 2's gradients are nan: that run stops (fp32: at its first step), the grid
    goes on with the others and writes its summary, where that rate lists seed 2 as diverged
    and is not the best rate; the diverged run leaves no result. When every run diverges the
    command fails with the run's own error, as a single fine-tune always did."""
    import json

    from bert_pretrain.errors import TrainingError
    from bert_pretrain.finetune.runner import FineTune
    from bert_pretrain.model import BertForSequenceClassification

    poisoned, forward, real_step = {"now": False}, BertForSequenceClassification.forward, \
        FineTune.train_step

    def poison(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training and poisoned["now"]:
            out.loss = _NaNGrad.apply(out.loss)
        return out

    def step(self):
        poisoned["now"] = (self.lr, self.seed) == (1e-3, 2) or self.lr == 1e-2
        return real_step(self)

    monkeypatch.setattr(BertForSequenceClassification, "forward", poison)
    monkeypatch.setattr(FineTune, "train_step", step)
    out = tmp_path / "grid"
    summary = _fine_tune(pretrained, out, "trainer.mixed_precision=no",
                         "recipe.lrs=[1e-3,3e-4]", "recipe.seeds=[1,2]")
    said = capsys.readouterr().out
    assert ("lr 0.001 seed 2: diverged: the fine-tuning loss or gradient was non-finite for 1 "
            "consecutive steps (step 1, lr 0.001); lower recipe.lrs or use "
            "trainer.mixed_precision=no; the grid goes on") in said
    assert "0.001: " in said and "(diverged: seed(s) 2)" in said  # the closing line's grid
    assert summary["best_lr"] == 3e-4
    row = summary["grid"][0]
    assert row["lr"] == 1e-3 and row["diverged_seeds"] == [2]
    assert [r["seed"] for r in row["runs"]] == [1]
    assert json.loads((out / "finetune.json").read_text())["grid"] == summary["grid"]
    assert (out / "lr0.001-seed1" / "result.json").exists()
    assert not (out / "lr0.001-seed2" / "result.json").exists()
    record = json.loads((out / "lr0.001-seed2" / "diverged.json").read_text())
    assert (record["lr"], record["seed"], record["step"]) == (1e-3, 2, 1)
    assert not (out / "lr0.001-seed2" / "checkpoints").exists()
    # The same command again trains nothing: the diverged run is read back from its record
    # (resuming it would only diverge again), the finished ones from their results.
    trained = []
    monkeypatch.setattr(FineTune, "train_step", lambda self: trained.append(1) or step(self))
    again = _fine_tune(pretrained, out, "trainer.mixed_precision=no",
                       "recipe.lrs=[1e-3,3e-4]", "recipe.seeds=[1,2]")
    said = capsys.readouterr().out
    assert trained == [] and again["grid"] == summary["grid"]
    assert (f"lr 0.001 seed 2: diverged: the fine-tuning loss or gradient was non-finite for 1 "
            f"consecutive steps (step 1, lr 0.001); lower recipe.lrs or use "
            f"trainer.mixed_precision=no (an earlier run, recorded in "
            f"{out / 'lr0.001-seed2' / 'diverged.json'}; delete {out / 'lr0.001-seed2'} to "
            f"fine-tune it again); the grid goes on") in said
    monkeypatch.setattr(FineTune, "train_step", step)
    with pytest.raises(TrainingError, match=r"^the fine-tuning loss or gradient was non-finite "
                       r"for 1 consecutive steps \(step 1, lr 0.01\)"):
        _fine_tune(pretrained, tmp_path / "all", "trainer.mixed_precision=no",
                   "recipe.lrs=[1e-2]", "recipe.seeds=[1,2]")
    assert "seed 1: diverged" in capsys.readouterr().out


@pytest.mark.parametrize("precision,batch_size", [("fp16", 16), ("fp16", 4), ("no", 16)])
def test_a_fine_tune_that_never_updates_reports_no_score(pretrained, tmp_path, monkeypatch,
                                                         precision, batch_size, one_thread):
    """Every step's gradient is nan. fp16: a short fine-tune (fewer steps than the skips a
    scaler may take) ends with an error instead of a score of its random head; a long one stops
    after the consecutive-skip limit, as pretraining does. fp32 (no scaler to find a scale):
    the first such step stops it."""
    from bert_pretrain.errors import TrainingError
    from bert_pretrain.components.precision import SCALER_ROOM

    _poison_fine_tune_steps(monkeypatch, set(range(1000)))
    steps = 3 * 64 // batch_size  # 3 epochs of 64 examples: 12 or 48 steps
    expected = "non-finite for 1 consecutive steps" if precision == "no" else \
        "no step of the fine-tune was applied" if steps <= 10 + SCALER_ROOM else \
        f"non-finite for {10 + SCALER_ROOM} consecutive steps"
    with pytest.raises(TrainingError, match=expected) as err:
        _fine_tune(pretrained, tmp_path / "out", f"trainer.mixed_precision={precision}",
                   "recipe.epochs=3", f"recipe.batch_size={batch_size}")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out" / "lr0.001-seed1" / "result.json").exists()
