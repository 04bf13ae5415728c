"""Export: transformers loads the exported directory and computes the same logits."""

import os
import subprocess
import sys

import pytest
import torch

from bert_pretrain import checkpoint as ckpt
from bert_pretrain.export import export
from bert_pretrain.errors import UserError
from bert_pretrain.model import BertConfig, BertForPreTraining
from train_support import REPO, train_in_process, write_prepared

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint from bert-train, with a tokenizer transformers can read."""
    root = tmp_path_factory.mktemp("export")
    prepared = write_prepared(str(root / "prep"), num_train=32, num_valid=8)
    tok = transformers.BertTokenizerFast(
        vocab_file=os.path.join(prepared, "tokenizer", "vocab.txt"), do_lower_case=True)
    tok.save_pretrained(os.path.join(prepared, "tokenizer"))
    run = str(root / "run")
    train_in_process(["experiment=smoke", f"data.dir={prepared}", f"run_dir={run}",
                      "trainer.max_steps=3", "model.hidden_act=gelu"])
    return ckpt.latest_checkpoint(run)


def test_exported_model_matches_in_transformers(trained, tmp_path):
    out = export(trained, str(tmp_path / "hf"))
    ours = BertForPreTraining(BertConfig.from_dict(ckpt.read_train_state(trained)["model_config"]))
    ckpt.load_weights(trained, ours)
    ours.eval()
    theirs = transformers.BertForPreTraining.from_pretrained(out).eval()
    torch.manual_seed(0)
    ids = torch.randint(5, 64, (3, 12))
    ids[:, 0] = 2
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, token_type_ids=types)
        b = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
    keep = mask.bool()
    torch.testing.assert_close(a.prediction_logits[keep], b.prediction_logits[keep],
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.seq_relationship_logits, b.seq_relationship_logits,
                               atol=1e-4, rtol=1e-4)
    # the weights were trained (not a fresh init that would also match)
    fresh = transformers.BertForPreTraining(theirs.config).eval()
    with torch.no_grad():
        c = fresh(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert not torch.allclose(c.prediction_logits, b.prediction_logits, atol=1e-3)
    tokenizer = transformers.BertTokenizerFast.from_pretrained(out)
    assert tokenizer.convert_tokens_to_ids("[MASK]") == 4
    assert tokenizer("w1 w2")["input_ids"][0] == 2


def test_export_cli_and_errors(trained, tmp_path):
    out = str(tmp_path / "cli")
    r = subprocess.run([sys.executable, "-m", "bert_pretrain.export", trained, out], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert {"config.json", "model.safetensors", "vocab.txt"} <= set(os.listdir(out))
    r = subprocess.run([sys.executable, "-m", "bert_pretrain.export", trained, out], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("bert-export: error:")
    assert "not empty" in r.stderr
    with pytest.raises(UserError, match="not a checkpoint"):
        export(str(tmp_path), str(tmp_path / "x"))
