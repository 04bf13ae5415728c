"""bench/lpft_pilot.py: the head alone trains for the probe's steps (the encoder's weights do
not move, the head's do), then everything, at bert-finetune's schedule over the rest; the
settings join the results' identity; a stopped pilot fine-tune resumes as the uninterrupted."""

import json
import os
import sys

import pytest
import torch

from train_support import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
sys.path.insert(0, os.path.join(REPO, "tests"))
import lpft_pilot  # noqa: E402
from test_bench_uda_pilot import _task  # noqa: E402  (a labelled CSV task and a tiny encoder)

pytest.importorskip("transformers")


def test_the_head_alone_trains_in_the_probe_then_everything(tmp_path, monkeypatch):
    from bert_pretrain.finetune import grid, runner

    seen, log = [], runner.FineTune._log

    def snapshot(self):
        log(self)
        params = dict(self.raw_model.named_parameters())
        seen.append((self.step, self.current_lr,
                     params["bert.encoder.layer.0.attention.self.query.weight"].detach().clone(),
                     params["bert.embeddings.word_embeddings.weight"].detach().clone(),
                     params["classifier.weight"].detach().clone()))

    out = tmp_path / "ft"
    monkeypatch.setattr(runner.FineTune, "_log", snapshot)
    # 24 rows, batch 8, 2 epochs: 6 steps, the first epoch's 3 the probe's
    lpft_pilot.main(["--probe-epochs", "1", "--probe-lr", "5e-3", "--", *_task(tmp_path),
                     "trainer.log_every=1", f"out_dir={out}"])
    assert [s[0] for s in seen] == [1, 2, 3, 4, 5, 6]
    start = seen[0]
    for step, lr, query, words, head in seen[:3]:
        assert lr == 5e-3  # the probe's constant rate
        assert torch.equal(query, seen[0][2]) and torch.equal(words, seen[0][3])
    assert not torch.equal(seen[1][4], start[4])  # the head learns in the probe
    assert not torch.equal(seen[3][2], seen[2][2]) and not torch.equal(seen[3][3], seen[2][3])
    # the rest is bert-finetune's linear schedule over 3 steps (warmup 10% of 3: none)
    assert [round(s[1], 6) for s in seen[3:]] == [1e-3, round(1e-3 * 2 / 3, 6),
                                                   round(1e-3 / 3, 6)]
    # bert-finetune is itself again afterwards; the settings are in the identity
    assert runner.FineTune.train_step.__qualname__ == "FineTune.train_step"
    assert grid.prepare_job.__qualname__ == "prepare_job"
    (result,) = [json.loads(p.read_text()) for p in out.rglob("result.json")]
    assert result["identity"]["lpft_pilot"] == {"probe_epochs": 1.0, "probe_lr": 5e-3}
    assert result["steps"] == 6


def test_frozen_embeddings_stay_as_pretrained_and_the_rest_trains(tmp_path, monkeypatch):
    from bert_pretrain.finetune import runner

    seen, log = [], runner.FineTune._log

    def snapshot(self):
        log(self)
        params = dict(self.raw_model.named_parameters())
        seen.append((self.current_lr,
                     params["bert.embeddings.word_embeddings.weight"].detach().clone(),
                     params["bert.embeddings.LayerNorm.weight"].detach().clone(),
                     params["bert.encoder.layer.0.output.dense.weight"].detach().clone()))

    out = tmp_path / "ft"
    monkeypatch.setattr(runner.FineTune, "_log", snapshot)
    lpft_pilot.main(["--probe-epochs", "0", "--freeze-embeddings", "--", *_task(tmp_path),
                     "trainer.log_every=1", f"out_dir={out}"])
    assert len(seen) == 6
    for _, words, norm, _ in seen[1:]:
        assert torch.equal(words, seen[0][1]) and torch.equal(norm, seen[0][2])
    assert not torch.equal(seen[1][3], seen[0][3])  # the layers train from the first step
    # no probe: bert-finetune's own schedule (6 steps, warmup round(0.6) = 1 step)
    assert [round(s[0], 6) for s in seen] == [round(1e-3 * (6 - k) / 5, 6) if k else 1e-3
                                              for k in range(6)]
    (result,) = [json.loads(p.read_text()) for p in out.rglob("result.json")]
    assert result["identity"]["lpft_pilot"]["freeze_embeddings"] is True


def test_a_probe_as_long_as_the_fine_tune_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"--probe-epochs must be in \[0, recipe.epochs = 2\)"):
        lpft_pilot.main(["--probe-epochs", "2", "--", *_task(tmp_path),
                         f"out_dir={tmp_path / 'ft'}"])
    assert lpft_pilot.probe_steps(0, 2, 6) == 0 and lpft_pilot.probe_steps(1.99, 2, 6) == 5


def test_an_interrupted_pilot_fine_tune_resumes_as_the_uninterrupted_one(tmp_path, monkeypatch):
    """Killed after step 5 with step 4's checkpoint (the probe's 3 steps behind it) and
    resumed; and killed in the probe: the same freezing, the same records and score."""
    from finetune_support import check_interrupted_fine_tune_resumes

    common = [*_task(tmp_path), "trainer.log_every=1", "trainer.checkpoint_every=2",
              "trainer.mixed_precision=no"]
    for probe in ("1", "1.5"):  # probe of steps 1-3; of steps 1-4 (step 4's checkpoint in it)
        check_interrupted_fine_tune_resumes(
            lambda out: lpft_pilot.main(["--probe-epochs", probe, "--", *common,
                                         f"out_dir={out}"]),
            tmp_path / f"ft{probe}", monkeypatch)
