"""Import: a directory written by transformers' save_pretrained becomes our model (strict load),
computes the same pretraining loss as transformers on the same batch, and is checked against the
prepared data before training continues from it."""

import json
import os
import warnings

import pytest
import torch

from bert_pretrain.errors import CheckpointError, DataError
from bert_pretrain.components.hf_import import check_against_data, is_hf_model_dir, read_hf_model
from bert_pretrain.model import BertConfig, BertForPreTraining
from train_support import write_prepared

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=64, hidden_act="gelu")


def _save(tmp_path, cls=None, name="hf", vocab_from=None, **config):
    torch.manual_seed(0)
    model = (cls or transformers.BertForPreTraining)(transformers.BertConfig(**{**TINY, **config}))
    # a non-trivial bias so a forgotten decoder.bias tie would show
    if hasattr(model, "cls"):
        with torch.no_grad():
            model.cls.predictions.bias.normal_()
    out = str(tmp_path / name)
    model.save_pretrained(out)
    if vocab_from:
        tok = transformers.BertTokenizerFast(vocab_from, do_lower_case=True)
        tok.save_pretrained(out)
    return model.eval(), out


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(5, 64, (4, 16))
    ids[:, 0] = 2
    mask = torch.ones_like(ids)
    mask[2, 10:] = 0
    types = torch.zeros_like(ids)
    types[:, 8:] = 1
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    labels[:, 9] = ids[:, 9]
    ids[:, 3] = 4
    nsp = torch.tensor([0, 1, 1, 0])
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels,
                next_sentence_label=nsp)


def _ours(path):
    config, state = read_hf_model(path)
    model = BertForPreTraining(BertConfig.from_dict(config))
    model.load_state_dict(state, strict=True)
    return model.eval()


def test_imported_model_has_transformers_loss(tmp_path):
    theirs, path = _save(tmp_path)
    assert is_hf_model_dir(path)
    ours = _ours(path)
    batch = _batch()
    with torch.no_grad():
        a = ours(**batch)
        b = theirs(**batch)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-5, rtol=1e-5)
    assert a.loss.item() > 0.1  # a real loss, not two zeros
    # the tied decoder came from the word embeddings
    assert torch.equal(ours.cls.predictions.decoder.weight,
                       theirs.bert.embeddings.word_embeddings.weight)


def test_pytorch_model_bin_is_read_with_weights_only(tmp_path):
    theirs, path = _save(tmp_path)
    state = {k: v for k, v in theirs.state_dict().items() if "decoder" not in k}
    os.remove(os.path.join(path, "model.safetensors"))
    torch.save(state, os.path.join(path, "pytorch_model.bin"))
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(_ours(path)(**batch).loss, theirs(**batch).loss,
                                   atol=1e-5, rtol=1e-5)


def test_encoder_only_checkpoint_gets_fresh_heads_with_a_warning(tmp_path):
    theirs, path = _save(tmp_path, cls=transformers.BertModel)
    with pytest.warns(UserWarning, match="freshly initialised"):
        ours = _ours(path)
    ids = _batch()["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(ours.bert(ids).sequence_output,
                                   theirs(input_ids=ids).last_hidden_state, atol=1e-5, rtol=1e-5)


def test_masked_lm_checkpoint_keeps_its_mlm_head(tmp_path):
    theirs, path = _save(tmp_path, cls=transformers.BertForMaskedLM)
    with pytest.warns(UserWarning, match="seq_relationship"):
        ours = _ours(path)
    batch = _batch()
    with torch.no_grad():
        ref = theirs(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     token_type_ids=batch["token_type_ids"], labels=batch["labels"]).loss
        torch.testing.assert_close(ours(**{**batch, "next_sentence_label": None}).loss, ref,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu_fast"}, "hidden_act 'gelu_fast' is not supported"),
    ({"is_decoder": True}, "is_decoder=True is not supported"),
    ({"model_type": "roberta"}, "'roberta' model"),
])
def test_unsupported_configs_are_one_line_errors(tmp_path, change, message):
    _, path = _save(tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(change)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=message) as info:
        read_hf_model(path)
    assert "\n" not in str(info.value)


def test_a_config_that_is_not_a_json_object_is_a_one_line_error(tmp_path):
    _, path = _save(tmp_path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump([TINY], f)
    with pytest.raises(CheckpointError, match="config.json is not a JSON object; pass a "
                                              "transformers BERT directory") as info:
        read_hf_model(path)
    assert "\n" not in str(info.value)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a transformers model directory"):
        read_hf_model(str(tmp_path))


def test_check_against_data(tmp_path):
    prepared = write_prepared(str(tmp_path / "prep"), num_train=8, num_valid=4, seq=32)
    vocab = os.path.join(prepared, "tokenizer", "vocab.txt")
    _, good = _save(tmp_path, name="good", vocab_from=vocab)
    config, _ = read_hf_model(good)
    assert check_against_data(good, config, prepared) == []
    # another vocabulary of the same size: named, with the bert-prep command that fixes it
    other = tmp_path / "other_vocab.txt"
    tokens = open(vocab).read().split("\n")
    tokens[10], tokens[11] = tokens[11], tokens[10]
    other.write_text("\n".join(tokens))
    _, swapped = _save(tmp_path, name="swapped", vocab_from=str(other))
    with pytest.raises(DataError, match=r"token 10: 'w6' vs the data's 'w5'.*"
                                        r"bert-prep tokenizer.vocab_file=") as info:
        check_against_data(swapped, read_hf_model(swapped)[0], prepared)
    assert "\n" not in str(info.value)
    _, bigger = _save(tmp_path, name="bigger", vocab_size=80)
    with pytest.raises(DataError, match="vocab_size 80 vs the data's 64"):
        check_against_data(bigger, read_hf_model(bigger)[0], prepared)
    _, short = _save(tmp_path, name="short", vocab_from=vocab, max_position_embeddings=16)
    with pytest.raises(DataError, match="max_position_embeddings 16 < the data's "
                                        "max_seq_length 32"):
        check_against_data(short, read_hf_model(short)[0], prepared)
    _, bare = _save(tmp_path, name="bare")  # no tokenizer files: cannot check identity
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        notes = check_against_data(bare, read_hf_model(bare)[0], prepared)
    assert notes and "cannot check" in notes[0]
