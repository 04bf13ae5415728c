"""Export: stock transformers loads the exported directory (as BertForPreTraining,
BertForMaskedLM, AutoModel, AutoModelForSequenceClassification and AutoTokenizer) and computes
the same logits as our model; models it cannot represent are refused in one line."""

import json
import os
import stat
import subprocess
import sys
import warnings

import pytest
import torch

from bert_pretrain.components import checkpoint as ckpt
from bert_pretrain.components import checkpoint_manager as cm
from bert_pretrain.tools import export as export_mod
from bert_pretrain.errors import UserError
from bert_pretrain.tools.export import export
from bert_pretrain.components.hf_import import read_hf_model
from bert_pretrain.model import BertConfig, BertForPreTraining
from train_support import REPO, train_in_process, write_prepared

transformers = pytest.importorskip("transformers")


def _prepared(root):
    prepared = write_prepared(str(root / "prep"), num_train=32, num_valid=8)
    tok = transformers.BertTokenizerFast(  # positional: vocab_file in 4.x, vocab in 5.x
        os.path.join(prepared, "tokenizer", "vocab.txt"), do_lower_case=True)
    tok.save_pretrained(os.path.join(prepared, "tokenizer"))
    return prepared


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A bert-train run directory (checkpoints at steps 3 and 6), with a tokenizer transformers
    can read."""
    root = tmp_path_factory.mktemp("export")
    run = str(root / "run")
    train_in_process(["experiment=smoke", f"data.dir={_prepared(root)}", f"run_dir={run}",
                      "model.hidden_act=gelu"])
    return run


def _inputs():
    torch.manual_seed(0)
    ids = torch.randint(5, 64, (3, 12))
    ids[:, 0] = 2
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    return ids, mask, types


def _ours(checkpoint):
    model = BertForPreTraining(BertConfig.from_dict(ckpt.read_train_state(checkpoint)
                                                    ["model_config"]))
    ckpt.load_weights(checkpoint, model)
    return model.eval()


def test_export_of_a_run_loads_in_every_transformers_class(run, tmp_path, capsys):
    out = str(tmp_path / "hf")
    used = export(run, out)
    assert used == cm.latest_checkpoint(run) and used.endswith("step-00000006")
    ours = _ours(used)
    ids, mask, types = _inputs()
    keep = mask.bool()
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, token_type_ids=types)
        pre = transformers.BertForPreTraining.from_pretrained(out).eval()
        b = pre(input_ids=ids, attention_mask=mask, token_type_ids=types)
        torch.testing.assert_close(b.prediction_logits[keep], a.prediction_logits[keep],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.seq_relationship_logits, a.seq_relationship_logits,
                                   atol=1e-5, rtol=1e-5)
        mlm = transformers.BertForMaskedLM.from_pretrained(out).eval()
        c = mlm(input_ids=ids, attention_mask=mask, token_type_ids=types)
        torch.testing.assert_close(c.logits[keep], a.prediction_logits[keep], atol=1e-5,
                                   rtol=1e-5)
        enc = transformers.AutoModel.from_pretrained(out).eval()
        assert type(enc).__name__ == "BertModel"
        d = enc(input_ids=ids, attention_mask=mask, token_type_ids=types)
        ours_enc = ours.bert(ids, mask, types)
        torch.testing.assert_close(d.pooler_output, ours_enc.pooled_output, atol=1e-5, rtol=1e-5)
        # the weights were trained (a fresh init would not match)
        fresh = transformers.BertForPreTraining(pre.config).eval()
        assert not torch.allclose(fresh(input_ids=ids).prediction_logits,
                                  pre(input_ids=ids).prediction_logits, atol=1e-3)
    # A new classifier on the trained encoder, ready to fine-tune: it trains.
    clf = transformers.AutoModelForSequenceClassification.from_pretrained(out, num_labels=3)
    torch.testing.assert_close(clf.bert.embeddings.word_embeddings.weight,
                               ours.bert.embeddings.word_embeddings.weight)
    labels = torch.tensor([0, 1, 2])
    loss = clf(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert clf.classifier.weight.grad is not None and torch.isfinite(loss)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.convert_tokens_to_ids("[MASK]") == 4
    assert tokenizer("w1 w2")["input_ids"] == [2, 6, 7, 3]
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(out):  # what the user's umask gives any new file
        assert stat.S_IMODE(os.stat(os.path.join(out, name)).st_mode) == 0o666 & ~umask, name


def test_export_of_a_checkpoint(run, tmp_path):
    first = cm.list_checkpoints(run)[0][1]
    out = str(tmp_path / "hf3")
    assert export(first, out) == first
    theirs = transformers.BertForPreTraining.from_pretrained(out).eval()
    ids, mask, types = _inputs()
    with torch.no_grad():
        a = _ours(first)(ids, attention_mask=mask, token_type_ids=types)
        b = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
    torch.testing.assert_close(b.seq_relationship_logits, a.seq_relationship_logits,
                               atol=1e-5, rtol=1e-5)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "bert_pretrain.tools.export", *args], cwd=REPO,
                          capture_output=True, text=True)


def test_export_cli_and_errors(run, tmp_path):
    out = str(tmp_path / "cli")
    r = _cli(run, out)
    assert r.returncode == 0, r.stderr
    assert "step-00000006" in r.stdout
    assert {"config.json", "model.safetensors", "vocab.txt"} <= set(os.listdir(out))
    r = _cli(run, out)
    assert r.returncode == 2 and r.stderr.startswith("bert-export: error:")
    assert "not empty" in r.stderr and r.stderr.count("\n") == 1
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    r = _cli(run, str(a_file))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is a file" in r.stderr, r.stderr
    r = _cli(str(tmp_path / "nope"), str(tmp_path / "y"))
    assert r.returncode == 2 and "no such directory" in r.stderr and r.stderr.count("\n") == 1
    with pytest.raises(UserError, match="neither a run directory"):
        export(str(tmp_path), str(tmp_path / "x"))


def _fake_checkpoint(root, **model):
    """A checkpoint of a model variant, written by the checkpoint writer bert-train uses."""
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, **model)
    cm.CheckpointManager(root, keep_last_k=1).save(
        1, model=BertForPreTraining(config), optimizer_state={}, extra_state={},
        train_state={"model_config": config.to_dict()}, config_yaml="", tokenizer_dir=None)
    return root


def test_export_refuses_what_transformers_cannot_compute(tmp_path, monkeypatch):
    # (pre-LN models export as RoBERTa-PreLayerNorm: tests/test_export_preln.py)
    relative = _fake_checkpoint(str(tmp_path / "rel"), position_embedding_type="relative_key")
    monkeypatch.setattr(export_mod, "_installed_transformers_major", lambda: 5)
    with pytest.raises(UserError, match=r"needs transformers < 5"):
        export(relative, str(tmp_path / "o2"))
    # transformers 4.x computes relative positions: exported, position type kept in config.json
    monkeypatch.setattr(export_mod, "_installed_transformers_major", lambda: 4)
    export(relative, str(tmp_path / "o3"))
    with open(tmp_path / "o3" / "config.json") as f:
        assert json.load(f)["position_embedding_type"] == "relative_key"
    # ... and it comes back (bert-predict, trainer.init_from) as the relative-position model,
    # the absolute table transformers 4.x holds (and never reads) dropped without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config, state = read_hf_model(str(tmp_path / "o3"))
    model = BertForPreTraining(BertConfig.from_dict(config))
    model.load_state_dict(state, strict=True)
    assert model.config.position_embedding_type == "relative_key"


def test_round_trip_export_then_import_gives_the_same_weights(run, tmp_path):
    out = str(tmp_path / "rt")
    used = export(run, out)
    config, state = read_hf_model(out)
    ours = _ours(used)
    assert BertConfig.from_dict(config) == ours.config
    original = ours.state_dict()
    assert state.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(state[key], value), key


def _load_reports():
    """Everything transformers logs (its load report among it), as a list that fills up."""
    import logging

    messages = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    return messages, handler


def test_head_choice_loads_without_a_report_of_unexpected_keys(run, tmp_path):
    """--head masked-lm: BertForMaskedLM and pipeline('fill-mask') find exactly their keys, so
    transformers prints no load report (the default export shows the pooler and NSP head as
    UNEXPECTED there, which users read as an error); --head encoder: BertModel, likewise."""
    import logging

    used = cm.latest_checkpoint(run)
    ours = _ours(used)
    ids, mask, types = _inputs()
    keep = mask.bool()
    mlm_dir, enc_dir, full = (str(tmp_path / n) for n in ("mlm", "enc", "full"))
    export(run, mlm_dir, head="masked-lm")
    export(run, enc_dir, head="encoder")
    export(run, full)
    messages, handler = _load_reports()
    try:
        with torch.no_grad():
            mlm = transformers.BertForMaskedLM.from_pretrained(mlm_dir).eval()
            torch.testing.assert_close(
                mlm(input_ids=ids, attention_mask=mask, token_type_ids=types).logits[keep],
                ours(ids, attention_mask=mask, token_type_ids=types).prediction_logits[keep],
                atol=1e-5, rtol=1e-5)
            transformers.pipeline("fill-mask", model=mlm_dir)("w1 [MASK] w3")
            enc = transformers.AutoModel.from_pretrained(enc_dir).eval()
            assert type(enc).__name__ == "BertModel"
            torch.testing.assert_close(
                enc(input_ids=ids, attention_mask=mask, token_type_ids=types).pooler_output,
                ours.bert(ids, mask, types).pooled_output, atol=1e-5, rtol=1e-5)
        assert not [m for m in messages if "UNEXPECTED" in m or "MISSING" in m], messages
        transformers.BertForMaskedLM.from_pretrained(full)  # the default: documented
        assert [m for m in messages if "UNEXPECTED" in m]
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert json.load(open(os.path.join(mlm_dir, "config.json")))["architectures"] == \
        ["BertForMaskedLM"]
