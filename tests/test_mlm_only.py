"""MLM-only training pieces: the reader on bert-prep's packed output (no NSP labels, one segment),
the model without pooler and NSP head (transformers' BertForMaskedLM, exactly), its export form,
and evaluation without NSP."""

import contextlib
import json
import os

import numpy as np
import pytest
import torch

from bert_pretrain.components.data import DataConfig, PreparedData, TrainStream, collate, eval_batches
from bert_pretrain.errors import DataError
from bert_pretrain.components.evaluation import evaluate
from bert_pretrain.model import BertConfig, BertForPreTraining, ModelImpl
from train_support import write_prepared

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def packed(prep_compose, prep_tagged, tmp_path_factory):
    """bert-prep's MLM-only output (full sentences, 64 tokens) of the tagged corpus."""
    from data_prep.pipeline import run

    corpus, vocab = prep_tagged
    out = str(tmp_path_factory.mktemp("mlm_only") / "out")
    run(prep_compose("corpus=text", f"corpus.paths=[{corpus}]", f"output_dir={out}",
                     f"tokenizer.vocab_file={vocab}", "max_seq_length=64",
                     "packing=full_sentences", "dupe_factor=1", "validation_fraction=0.1",
                     "num_proc=1", "max_predictions_per_seq=10"))
    return out


def _stream(root, masking="static", world=1, rank=0, batch=8):
    return TrainStream(PreparedData(root), DataConfig(dir=root, masking=masking), seed=3,
                       global_batch_size=batch, micro_batch_size=2,
                       world_size=world, rank=rank)


# ---------------------------------------------------------------------------------- reading


def test_reader_knows_mlm_only_data(packed, tmp_path):
    data = PreparedData(packed)
    assert (data.objective, data.has_nsp) == ("mlm", False)
    assert data.next_sentence_prediction(None) is False
    with pytest.raises(DataError, match="model.next_sentence_prediction=true but .* is MLM-only "
                                        "data .*packing=full_sentences"):
        data.next_sentence_prediction(True)
    old = PreparedData(write_prepared(str(tmp_path / "old"), num_train=8, num_valid=4))
    assert "objective" not in old.manifest       # data written before MLM-only existed
    assert (old.objective, old.has_nsp) == ("mlm_nsp", True)
    assert old.next_sentence_prediction(None) is True
    assert old.next_sentence_prediction(False) is False   # MLM-only model on pair data


@pytest.mark.parametrize("change, message", [
    ({"format_version": 3}, "has format_version 3, this trainer reads 1 and 2; re-run bert-prep"),
    ({"objective": "sop"}, "has objective 'sop', this trainer reads mlm_nsp and mlm"),
])
def test_unknown_formats_are_refused_in_one_line(tmp_path, change, message):
    root = write_prepared(str(tmp_path / "p"), num_train=8, num_valid=4)
    path = os.path.join(root, "manifest.json")
    manifest = json.load(open(path))
    json.dump({**manifest, **change}, open(path, "w"))
    with pytest.raises(DataError, match=message):
        PreparedData(root)


def test_static_batches_have_one_segment_and_no_nsp_label(packed):
    data = PreparedData(packed)
    split = data.split("train")
    assert "next_sentence_labels" not in split.shards[0]
    idx = np.arange(min(40, split.num_instances))
    rows = split.gather(idx)
    batch = collate(rows, 8)
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert not batch["token_type_ids"].any()
    assert batch["attention_mask"].sum(1).tolist() == rows["lengths"].tolist()
    for i in range(len(idx)):
        k = int((rows["masked_positions"][i] > 0).sum())
        pos = rows["masked_positions"][i, :k].tolist()
        assert (batch["labels"][i] != -100).nonzero().squeeze(1).tolist() == pos
        assert batch["labels"][i, pos].tolist() == rows["masked_labels"][i, :k].tolist()
    evals = list(eval_batches(data, DataConfig(dir=packed), 4, 1, 0, None))
    assert evals and all("next_sentence_label" not in b for b in evals)


def test_dynamic_masking_of_mlm_only_data_matches_across_world_sizes(packed):
    one = _stream(packed, "dynamic")
    two = [_stream(packed, "dynamic", world=2, rank=r) for r in range(2)]
    predicted = tokens = 0
    for _ in range(5):
        a = one.next_step()
        b = [x for s in two for x in s.next_step()]
        assert len(a) == len(b) == 4
        for x, y in zip(a, b):
            assert set(x) == {"input_ids", "attention_mask", "token_type_ids", "labels",
                              "num_tokens"}
            for key in ("input_ids", "labels", "token_type_ids"):
                assert torch.equal(x[key], y[key])
            predicted += int((x["labels"] != -100).sum())
            tokens += x["num_tokens"]
    assert predicted / tokens == pytest.approx(0.15, abs=0.02)


# ---------------------------------------------------------------------------------- model


def _config(nsp=False, **kw):
    return BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=24,
                      next_sentence_prediction=nsp, **kw)


def _batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, cfg.vocab_size, (3, 12), generator=g)
    ids[:, 0] = 2
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, 3:6] = ids[:, 3:6]
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
            "labels": labels}


def test_mlm_only_model_is_transformers_bert_for_masked_lm():
    torch.manual_seed(0)
    cfg = _config(hidden_act="gelu")
    ours = BertForPreTraining(cfg, ModelImpl(sparse_prediction=False, unpad=False)).eval()
    assert ours.bert.pooler is None and ours.cls.seq_relationship is None
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**cfg.to_hf_dict())).eval()
    assert sorted(ours.hf_state_dict()) == sorted(hf.state_dict())
    hf.load_state_dict(ours.hf_state_dict(), strict=True)
    batch = _batch(cfg)
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        mine, ref = ours(**batch), hf(**batch)
    torch.testing.assert_close(mine.prediction_logits[keep], ref.logits[keep], atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(mine.loss, ref.loss, atol=1e-5, rtol=1e-5)
    assert mine.nsp_loss is None and mine.seq_relationship_logits is None
    assert cfg.to_hf_dict()["architectures"] == ["BertForMaskedLM"]
    assert _config(nsp=True).to_hf_dict()["architectures"] == ["BertForPreTraining"]


@pytest.mark.parametrize("impl", [ModelImpl(), ModelImpl(sparse_prediction=False, unpad=False)])
def test_every_parameter_of_an_mlm_only_model_gets_a_gradient(impl):
    """DDP (find_unused_parameters off) stops on a parameter the loss does not reach: an MLM-only
    model keeps no pooler or NSP head."""
    cfg = _config()
    model = BertForPreTraining(cfg, impl)
    model(**_batch(cfg)).loss.backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    with pytest.raises(ValueError, match="no NSP head .*pass no next_sentence_label"):
        model(**_batch(cfg), next_sentence_label=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="next_sentence_prediction must be true or false"):
        _config(nsp="no")


def _export_like(model, out):
    """What bert-export writes (export.py): config.json from to_hf_dict, the state dict without
    the tied keys transformers does not save."""
    from safetensors.torch import save_file

    from bert_pretrain.tools.export import TIED_KEYS

    os.makedirs(out)
    save_file({k: v.contiguous() for k, v in model.hf_state_dict().items()
               if k not in TIED_KEYS}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(model.config.to_hf_dict(), f)


def test_export_of_an_mlm_only_model_loads_as_bert_for_masked_lm(tmp_path):
    from bert_pretrain.components.hf_import import read_hf_model

    torch.manual_seed(1)
    cfg = _config(hidden_act="gelu")
    ours = BertForPreTraining(cfg).eval()
    out = str(tmp_path / "hf")
    _export_like(ours, out)
    hf, info = transformers.BertForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    batch = _batch(cfg, seed=4)
    keep = batch["attention_mask"].bool()
    inputs = {k: v for k, v in batch.items() if k != "labels"}   # dense logits
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(**inputs).logits[keep],
                                   ours(**inputs).prediction_logits[keep], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hf(**batch).loss, ours(**batch).loss, atol=1e-5, rtol=1e-5)
    # ... and it imports back (continued pretraining, bert-predict) as the same MLM-only model.
    config, state = read_hf_model(out)
    assert config["next_sentence_prediction"] is False
    back = BertForPreTraining(BertConfig.from_dict(config))
    back.load_state_dict(state, strict=True)
    # An MLM + NSP export imported as an MLM-only model leaves its pooler and NSP head out.
    nsp_out = str(tmp_path / "nsp")
    _export_like(BertForPreTraining(_config(nsp=True, hidden_act="gelu")), nsp_out)
    with pytest.warns(UserWarning, match="ignoring 4 tensor"):
        config, state = read_hf_model(nsp_out, next_sentence_prediction=False)
    BertForPreTraining(BertConfig.from_dict(config)).load_state_dict(state, strict=True)


# ---------------------------------------------------------------------------------- evaluation


class _OneProcess:
    device = torch.device("cpu")

    def autocast(self):
        return contextlib.nullcontext()

    def reduce(self, x, reduction):
        return x


@pytest.mark.parametrize("data_nsp, model_nsp", [(False, False), (True, False), (True, True)])
def test_evaluation_scores_nsp_only_where_data_and_model_have_it(packed, tmp_path, data_nsp,
                                                                 model_nsp):
    root = write_prepared(str(tmp_path / "p"), num_train=8, num_valid=12) if data_nsp else packed
    data = PreparedData(root)
    model = BertForPreTraining(BertConfig(vocab_size=data.vocab_size, hidden_size=32,
                                          num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=64,
                                          next_sentence_prediction=model_nsp))
    result = evaluate(model, _OneProcess(), eval_batches(data, DataConfig(dir=root), 4, 1, 0, 12),
                      mask_id=data.special["mask"])
    assert result["eval_mlm_loss"] > 0 and 0 <= result["eval_mlm_accuracy"] <= 1
    has_nsp = {"eval_nsp_loss", "eval_nsp_accuracy", "eval_nsp_accuracy_balanced"} <= set(result)
    assert has_nsp == (data_nsp and model_nsp)
    assert not any(k.startswith("eval_nsp") for k in result) or has_nsp


def test_predict_refuses_nsp_on_an_mlm_only_model_in_one_line(tmp_path):
    from bert_pretrain.errors import UserError
    from bert_pretrain.tools.predict import Predictor

    out = str(tmp_path / "hf")
    _export_like(BertForPreTraining(_config()), out)
    vocab = os.path.join(out, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] +
                          [f"w{i}" for i in range(92)]) + "\n")
    transformers.BertTokenizerFast(vocab, do_lower_case=True).save_pretrained(out)
    predictor = Predictor(out)
    assert len(predictor.fill_mask("w1 [MASK] w2", 3)["masks"][0]["predictions"]) == 3
    with pytest.raises(UserError, match="trained without next-sentence prediction .*use "
                                        "fill-mask"):
        predictor.nsp("w1 w2", "w3")
