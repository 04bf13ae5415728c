"""Training learns from context, not only from token frequencies: on synthetic data where the
context alone tells the masked word (and whether segment B follows A), a short run must beat the
most-frequent-token baseline by far and NSP chance by far.  A falling loss is not enough: a model
whose MLM head saw no context would still lower it by learning the word frequencies."""

import os

import numpy as np
import torch

from train_support import train_in_process, write_context_prepared


def _evaluate(checkpoint_dir, data_dir):
    """(MLM accuracy, most-frequent-label baseline, NSP accuracy) on the validation split,
    computed here from the checkpoint's weights and the .npy files (not from the trainer)."""
    from bert_pretrain.components.checkpoint import load_weights, read_train_state
    from bert_pretrain.components.data import DataConfig, PreparedData, eval_batches
    from bert_pretrain.model import BertConfig, BertForPreTraining

    model = BertForPreTraining(BertConfig.from_dict(read_train_state(checkpoint_dir)
                                                    ["model_config"])).eval()
    load_weights(checkpoint_dir, model)
    right = total = nsp_right = nsp_total = 0
    counts = np.zeros(model.config.vocab_size, np.int64)
    data = PreparedData(data_dir)
    with torch.no_grad():
        for batch in eval_batches(data, DataConfig(dir=data_dir), 128, 1, 0, None):
            out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
            labelled = batch["labels"] != -100
            pred = out.prediction_logits.argmax(-1)
            right += (pred[labelled] == batch["labels"][labelled]).sum().item()
            total += labelled.sum().item()
            np.add.at(counts, batch["labels"][labelled].numpy(), 1)
            nsp = out.seq_relationship_logits.argmax(-1)
            nsp_right += (nsp == batch["next_sentence_label"]).sum().item()
            nsp_total += len(nsp)
    return right / total, counts.max() / total, nsp_right / nsp_total


def test_learns_from_context(tmp_path, one_thread):
    data = write_context_prepared(str(tmp_path / "data"))
    run = str(tmp_path / "run")
    torch.manual_seed(0)
    train_in_process(["experiment=smoke", f"data.dir={data}", f"run_dir={run}",
                      "model.hidden_size=64", "model.num_attention_heads=4",
                      "model.intermediate_size=128", "model.max_position_embeddings=32",
                      "trainer.max_steps=500", "trainer.warmup_steps=50",
                      "trainer.global_batch_size=32", "optim.lr=3e-3",
                      "trainer.eval_every=0", "trainer.checkpoint_every=500",
                      "trainer.log_every=50", "logger=none"])
    mlm, baseline, nsp = _evaluate(os.path.join(run, "checkpoints", "step-00000500"), data)
    print(f"MLM accuracy {mlm:.3f} (most frequent word: {baseline:.3f}), NSP accuracy {nsp:.3f}")
    assert baseline < 0.06
    assert mlm > 0.5
    assert nsp > 0.75
