"""One precision policy (precision.py): fp16 on CPU gets real loss scaling (torch.amp.GradScaler
on cpu), so a step with inf/nan gradients is skipped and the scale lowered instead of poisoning
the weights; the start-up line says what is done; the scaler's state is in the checkpoint."""

import torch

from bert_pretrain.precision import SCALER_ROOM, Precision
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
