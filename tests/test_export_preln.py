"""Pre-LN models in transformers: bert-export writes them as RoBERTa-PreLayerNorm, which stock
transformers loads (RobertaPreLayerNormForMaskedLM, AutoModel, AutoModelForMaskedLM,
AutoModelForSequenceClassification, pipeline("fill-mask")) and computes the same logits as our
model; a RoBERTa-PreLayerNorm directory that transformers itself made is read back exactly."""

import json
import os

import pytest
import torch

from bert_pretrain.components import checkpoint_manager as cm
from bert_pretrain.components import hf_prelayernorm
from bert_pretrain.components.hf_import import read_hf_model
from bert_pretrain.errors import UserError
from bert_pretrain.model import BertConfig, BertForPreTraining
from bert_pretrain.tools.export import export
from test_export import _cli, _fake_checkpoint, _inputs, _load_reports, _ours, _prepared
from train_support import train_in_process

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def preln_run(tmp_path_factory):
    """A pre-LN bert-train run with NSP (the smoke data has sentence pairs)."""
    root = tmp_path_factory.mktemp("export_preln")
    run = str(root / "run")
    train_in_process(["experiment=smoke", f"data.dir={_prepared(root)}", f"run_dir={run}",
                      "model.hidden_act=gelu", "model.pre_layer_norm=true"])
    return run


def test_masked_lm_and_encoder_exports_compute_what_our_model_computes(preln_run, tmp_path):
    import logging

    used = cm.latest_checkpoint(preln_run)
    ours = _ours(used)
    assert ours.config.pre_layer_norm
    ids, mask, types = _inputs()
    keep = mask.bool()
    mlm_dir, enc_dir = str(tmp_path / "mlm"), str(tmp_path / "enc")
    export(preln_run, mlm_dir, head="masked-lm")
    export(preln_run, enc_dir, head="encoder")
    with open(os.path.join(mlm_dir, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "roberta-prelayernorm"
    assert config["architectures"] == ["RobertaPreLayerNormForMaskedLM"]
    # RoBERTa numbers real tokens from pad_token_id + 1: the table grows by that many rows
    assert config["max_position_embeddings"] == \
        ours.config.max_position_embeddings + ours.config.pad_token_id + 1
    messages, handler = _load_reports()
    try:
        with torch.no_grad():
            a = ours(ids, attention_mask=mask, token_type_ids=types)
            mlm = transformers.AutoModelForMaskedLM.from_pretrained(mlm_dir).eval()
            assert type(mlm).__name__ == "RobertaPreLayerNormForMaskedLM"
            b = mlm(input_ids=ids, attention_mask=mask, token_type_ids=types)
            torch.testing.assert_close(b.logits[keep], a.prediction_logits[keep], atol=1e-5,
                                       rtol=1e-5)
            enc = transformers.AutoModel.from_pretrained(enc_dir).eval()
            assert type(enc).__name__ == "RobertaPreLayerNormModel"
            c = enc(input_ids=ids, attention_mask=mask, token_type_ids=types,
                    output_hidden_states=True)
            ours_enc = ours.bert(ids, mask, types, output_hidden_states=True)
            # every layer's output as transformers gives it: the last one is last_hidden_state,
            # after the final LayerNorm (transformers 5 ties the two)
            assert len(c.hidden_states) == len(ours_enc.hidden_states) == \
                ours.config.num_hidden_layers + 1
            for theirs, mine in zip(c.hidden_states, ours_enc.hidden_states):
                torch.testing.assert_close(theirs[keep], mine[keep], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(c.last_hidden_state[keep],
                                       ours_enc.layout.to_grid(ours_enc.sequence_output)[keep],
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(c.pooler_output, ours_enc.pooled_output, atol=1e-5,
                                       rtol=1e-5)
            # the weights were trained (a fresh init would not match)
            fresh = transformers.RobertaPreLayerNormForMaskedLM(mlm.config).eval()
            assert not torch.allclose(fresh(input_ids=ids).logits, mlm(input_ids=ids).logits,
                                      atol=1e-3)
        # each head's directory holds exactly its class's keys: no load report
        assert not [m for m in messages if "UNEXPECTED" in m or "MISSING" in m], messages
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    transformers.pipeline("fill-mask", model=mlm_dir)("w1 [MASK] w3")
    tokenizer = transformers.AutoTokenizer.from_pretrained(mlm_dir)
    assert tokenizer("w1 w2")["input_ids"] == [2, 6, 7, 3]
    # RoBERTa's classification head on the trained encoder, ready to fine-tune: it trains
    clf = transformers.AutoModelForSequenceClassification.from_pretrained(enc_dir, num_labels=3)
    torch.testing.assert_close(clf.roberta_prelayernorm.embeddings.word_embeddings.weight,
                               ours.bert.embeddings.word_embeddings.weight)
    loss = clf(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 2])).loss
    loss.backward()
    assert clf.classifier.out_proj.weight.grad is not None and torch.isfinite(loss)


def test_round_trip_gives_the_same_weights_and_an_nsp_model_needs_a_head(preln_run, tmp_path):
    with pytest.raises(UserError, match="next-sentence head.*--head masked-lm"):
        export(preln_run, str(tmp_path / "full"))
    assert not os.path.exists(tmp_path / "full")
    out = str(tmp_path / "rt")
    used = export(preln_run, out, head="masked-lm")
    config, state = read_hf_model(out, next_sentence_prediction=False)
    ours = _ours(used)
    assert BertConfig.from_dict(config) == BertConfig.from_dict(
        {**ours.config.to_dict(), "next_sentence_prediction": False})
    original = ours.state_dict()
    # everything but the NSP head and the pooler (the MLM export has neither) comes back
    assert state.keys() == {k for k in original
                            if not k.startswith(("cls.seq_relationship.", "bert.pooler."))}
    for key, value in state.items():
        assert torch.equal(value, original[key]), key


def test_mlm_only_model_exports_by_default_and_the_cli_says_what_loads_it(tmp_path):
    source = _fake_checkpoint(str(tmp_path / "mlm_only"), pre_layer_norm=True,
                              next_sentence_prediction=False)
    out = str(tmp_path / "out")
    r = _cli(source, out)
    assert r.returncode == 0, r.stderr
    assert "RobertaPreLayerNormForMaskedLM" in r.stdout and "pre-LN" in r.stdout
    config, state = read_hf_model(out)
    model = BertForPreTraining(BertConfig.from_dict(config))
    model.load_state_dict(state, strict=True)
    assert model.config.pre_layer_norm and not model.config.next_sentence_prediction


def test_what_roberta_prelayernorm_cannot_hold_is_refused_in_one_line(tmp_path):
    relative = _fake_checkpoint(str(tmp_path / "rel"), pre_layer_norm=True,
                                position_embedding_type="relative_key")
    r = _cli(relative, str(tmp_path / "o1"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "absolute positions only" in r.stderr
    relu = _fake_checkpoint(str(tmp_path / "relu"), pre_layer_norm=True, hidden_act="relu")
    with pytest.raises(UserError, match="always applies GELU.*--head encoder"):
        export(relu, str(tmp_path / "o2"), head="masked-lm")
    export(relu, str(tmp_path / "o3"), head="encoder")  # the encoder alone is exact
    assert not os.path.exists(tmp_path / "o1") and not os.path.exists(tmp_path / "o2")


def test_a_roberta_prelayernorm_made_by_transformers_reads_back_exactly(tmp_path):
    """The mapping checked against transformers' own model, not only against our export: pad id
    1 (RoBERTa's; positions start at 2), one token type, padding inside the batch."""
    config = transformers.RobertaPreLayerNormConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=40, pad_token_id=1, type_vocab_size=1,
        hidden_act="gelu")
    torch.manual_seed(0)
    theirs = transformers.RobertaPreLayerNormForMaskedLM(config).eval()
    with torch.no_grad():  # LayerNorms and biases away from 1 and 0, so a swapped name shows
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    theirs.save_pretrained(str(tmp_path / "hf"))
    values, state = read_hf_model(str(tmp_path / "hf"))
    assert values["pre_layer_norm"] and values["max_position_embeddings"] == 38
    ours = BertForPreTraining(BertConfig.from_dict(values))
    ours.load_state_dict(state, strict=True)
    ours.eval()
    ids = torch.randint(4, 64, (3, 12))
    ids[:, 0] = 0
    mask = torch.ones_like(ids)
    ids[1, 8:], mask[1, 8:] = 1, 0
    keep = mask.bool()
    with torch.no_grad():
        expected = theirs(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).prediction_logits
    torch.testing.assert_close(got[keep], expected[keep], atol=1e-5, rtol=1e-5)


def test_key_names_map_both_ways():
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, pre_layer_norm=True)
    for key in BertForPreTraining(config).state_dict():
        hf_key = hf_prelayernorm.to_hf_key(key)
        if key.startswith("cls.seq_relationship."):
            assert hf_key is None
            continue
        assert hf_prelayernorm.from_hf_key(hf_key) == key
    layer = "bert.encoder.layer.1."
    assert hf_prelayernorm.to_hf_key(layer + "attention.output.LayerNorm.weight") == \
        "roberta_prelayernorm.encoder.layer.1.attention.LayerNorm.weight"
    assert hf_prelayernorm.to_hf_key(layer + "output.LayerNorm.bias") == \
        "roberta_prelayernorm.encoder.layer.1.intermediate.LayerNorm.bias"
    assert hf_prelayernorm.to_hf_key("bert.encoder.LayerNorm.weight") == \
        "roberta_prelayernorm.LayerNorm.weight"


def test_a_fine_tuned_pre_ln_classifier_loads_in_transformers_with_the_same_logits(tmp_path,
                                                                                   one_thread):
    """bert-finetune on a pre-LN encoder keeps a model that transformers loads as
    RoBERTa-PreLayerNorm's ForSequenceClassification (our pooler is its head's dense, our
    classifier its out_proj), with its labels' names, no load report, and the logits of our
    model (pairs, padding, token types) on the whole dev set; load_classifier reads the
    directory back as the model that scored what the grid reported."""
    import logging

    import numpy as np

    from bert_pretrain.finetune.batches import collate, encode
    from bert_pretrain.finetune.export import load_classifier
    from bert_pretrain.finetune.pretrained import load_pretrained
    from bert_pretrain.finetune.reading import read_task
    from bert_pretrain.finetune.tasks import TaskConfig
    from finetune_support import FAST, finetune_in_process, pair_task
    from train_support import write_prepared

    prepared = write_prepared(str(tmp_path / "prep"), num_train=64, num_valid=8)
    run = str(tmp_path / "run")
    train_in_process(["experiment=smoke", f"data.dir={prepared}", f"run_dir={run}",
                      "trainer.max_steps=20", "trainer.eval_every=0",
                      "model.pre_layer_norm=true", "model.hidden_act=gelu"])
    task = pair_task(str(tmp_path / "task"))
    summary = finetune_in_process([*task, f"model={run}", *FAST, "recipe.epochs=2",
                                   f"out_dir={tmp_path / 'out'}"])
    model_dir = str(tmp_path / "out" / "model")
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "roberta-prelayernorm"
    assert config["architectures"] == ["RobertaPreLayerNormForSequenceClassification"]
    assert config["id2label"] == {"0": "other", "1": "first"}

    cfg = {o.split("=", 1)[0].split(".")[-1]: o.split("=", 1)[1] for o in task[1:]}
    dev = read_task(TaskConfig(name="custom", train_file=cfg["train_file"],
                               validation_file=cfg["validation_file"],
                               text_columns=["premise", "hypothesis"], label_column="relation",
                               label_names=["other", "first"])).evals[""]
    encoded = encode(dev, load_pretrained(run).tokenizer(), 32, 10 ** 6, "dev")
    batch = collate(encoded, np.arange(len(dev)))
    ours = load_classifier(model_dir)
    messages, handler = _load_reports()
    try:
        theirs = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert type(theirs).__name__ == "RobertaPreLayerNormForSequenceClassification"
    assert not [m for m in messages if "UNEXPECTED" in m or "MISSING" in m], messages
    assert bool((batch["attention_mask"] == 0).any()) and bool(batch["token_type_ids"].any())
    with torch.no_grad():
        a = ours(**batch).logits
        b = theirs.eval()(**batch).logits
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    accuracy = float((a.argmax(-1).numpy() == dev.labels).mean())
    assert accuracy == pytest.approx(summary["metrics"]["accuracy"], abs=1e-9)
    label = transformers.pipeline("text-classification", model=model_dir)("w1 w0 w2")[0]["label"]
    assert label in ("other", "first")
