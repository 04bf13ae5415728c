"""The loss of a step is the loss of the global batch, whatever the split into processes and
micro-batches: 1 process x 16, 1 process x 4 x 4 accumulation, 2 processes x 8 (accelerate
launch) and 2 processes x 4 x 2 accumulation (torchrun) give the same loss at every step within
1e-6 and the same final weights within 1e-5 (max abs), with static and with dynamic masking.

Before the global-batch loss, each micro-batch's MLM loss was averaged over its own predicted
tokens: 1 x 16 and 2 x 8 differed from the first step (4.4e-4 in the mean over 8 steps)."""
from __future__ import annotations

import pytest
from safetensors.torch import load_file

from test_distributed import TOL, run, train_accelerate, train_records, train_torchrun
from train_support import write_prepared

# Dropout off: masks are drawn per micro-batch, so with dropout the splits differ by design.
SETTINGS = ["trainer.max_steps=8", "trainer.global_batch_size=16", "trainer.eval_every=0",
            "trainer.checkpoint_every=8", "trainer.warmup_steps=2",
            "model.hidden_dropout_prob=0", "model.attention_probs_dropout_prob=0"]
LOSS_TOL, WEIGHT_TOL = 1e-6, 1e-5
assert TOL >= LOSS_TOL


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    # Rows of very different lengths and mask counts: per-micro-batch averaging would show.
    return write_prepared(str(tmp_path_factory.mktemp("prepared") / "data"), num_train=64,
                          num_valid=8, seq=48, max_pred=8)


def one_process(run_dir, *overrides: str):
    import sys

    return run([sys.executable, "-m", "bert_pretrain.train", "experiment=smoke",
                "trainer.log_every=1", "trainer.progress_bar=false", f"run_dir={run_dir}",
                *overrides], {"OMP_NUM_THREADS": "1"})


def final_weights(run_dir) -> dict:
    return load_file(str(run_dir / "checkpoints" / "step-00000008" / "model.safetensors"))


@pytest.mark.parametrize("masking", [
    "static", pytest.param("dynamic", marks=pytest.mark.slow)])
def test_same_training_for_every_split_of_the_global_batch(prepared, tmp_path, masking):
    common = [f"data.dir={prepared}", f"data.masking={masking}", *SETTINGS]
    runs = {
        "1x16": tmp_path / "a", "1x4x4": tmp_path / "b", "2x8": tmp_path / "c",
        "2x4x2": tmp_path / "d",
    }
    r = one_process(runs["1x16"], *common)
    assert "global batch 16 = 1 x 16 x 1 accumulation" in r.stdout
    one_process(runs["1x4x4"], *common, "trainer.micro_batch_size=4")
    r = train_accelerate(2, *common, f"run_dir={runs['2x8']}")
    assert "global batch 16 = 2 x 8 x 1 accumulation" in r.stdout
    r = train_torchrun(2, *common, f"run_dir={runs['2x4x2']}", "trainer.micro_batch_size=4")
    assert "global batch 16 = 2 x 4 x 2 accumulation" in r.stdout

    reference = train_records(runs["1x16"])
    assert sorted(reference) == list(range(1, 9))
    ref_weights = final_weights(runs["1x16"])
    for name, run_dir in runs.items():
        records = train_records(run_dir)
        for step in range(1, 9):
            for key in ("loss", "mlm_loss", "nsp_loss"):
                assert abs(records[step][key] - reference[step][key]) <= LOSS_TOL, \
                    (name, step, key, records[step][key], reference[step][key])
            assert records[step]["tokens_seen"] == reference[step]["tokens_seen"], name
        weights = final_weights(run_dir)
        worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
        assert worst <= WEIGHT_TOL, (name, worst)
    # The model did train (the comparison is not between untouched initialisations).
    assert reference[8]["loss"] < reference[1]["loss"]


def test_loss_is_token_weighted_over_the_global_batch(prepared):
    """The logged MLM loss equals the sum of token losses over all predicted tokens of the
    batch divided by their number, recomputed here from the model and the stream."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from bert_pretrain.components.data import DataConfig, PreparedData, TrainStream
    from bert_pretrain.model import BertConfig, BertForPreTraining

    data = PreparedData(prepared)
    cfg = BertConfig(vocab_size=data.vocab_size, hidden_size=32, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForPreTraining(cfg)
    whole = TrainStream(data, DataConfig(dir=prepared), 1, 16, 16, 1, 0).next_step()[0]
    parts = TrainStream(data, DataConfig(dir=prepared), 1, 16, 4, 1, 0).next_step()
    inputs = {k: v for k, v in whole.items() if k != "num_tokens"}
    with torch.no_grad():
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).prediction_logits
        keep = inputs["labels"] != -100
        expected = F.cross_entropy(logits[keep], inputs["labels"][keep]).item()
        sums = [model(**{k: v for k, v in p.items() if k != "num_tokens"},
                      loss_reduction="sum").mlm_loss.item() for p in parts]
        counts = [int((p["labels"] != -100).sum()) for p in parts]
        means = [model(**{k: v for k, v in p.items() if k != "num_tokens"}).mlm_loss.item()
                 for p in parts]
    assert sum(sums) / sum(counts) == pytest.approx(expected, abs=1e-5)
    # Counts differ between micro-batches, so the mean of per-micro-batch means is another
    # number: the test data would expose the old definition.
    assert len(set(counts)) > 1
    assert abs(float(np.mean(means)) - expected) > 1e-4
