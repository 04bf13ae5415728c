"""BertForSequenceClassification: the same logits, loss and gradients as transformers' class of
that name on the same weights, with every speed switch on or off; the encoder comes from a
pretraining state dict."""

import dataclasses

import pytest
import torch

from bert_pretrain.model import (BertConfig, BertForPreTraining, BertForSequenceClassification,
                                 ModelImpl)

transformers = pytest.importorskip("transformers")

CFG = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0)


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 50, (4, 16), generator=g)
    ids[:, 0] = 2
    mask = torch.ones_like(ids)
    for row, length in enumerate((16, 9, 5, 12)):
        mask[row, length:] = 0
    ids = ids * mask
    types = torch.zeros_like(ids)
    types[:, 4:] = 1
    return ids, mask, types * mask


def _theirs(ours, num_labels):
    cfg = transformers.BertConfig(**{**CFG.to_hf_dict(), "num_labels": num_labels,
                                     "architectures": ["BertForSequenceClassification"]})
    model = transformers.BertForSequenceClassification(cfg)
    model.load_state_dict(ours.hf_state_dict(), strict=True)
    return model


@pytest.mark.parametrize("switches", [{}, {"unpad": False}, {"sparse_last_layer": False},
                                      {"varlen_attention": "off"}, {"attention": "sdpa"},
                                      {"varlen_attention": "nested"},
                                      {"varlen_attention": "nested", "sparse_last_layer": False}])
@pytest.mark.parametrize("num_labels", [3, 1])
def test_same_logits_loss_and_gradients_as_transformers(switches, num_labels):
    torch.manual_seed(0)
    ours = BertForSequenceClassification(CFG, num_labels,
                                         dataclasses.replace(ModelImpl(), **switches))
    theirs = _theirs(ours, num_labels)
    ids, mask, types = _inputs()
    labels = torch.tensor([0, 2, 1, 2]) if num_labels > 1 else torch.tensor([0.5, 1.0, 3.0, 2.0])
    a = ours(ids, mask, types, labels=labels)
    b = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-5, rtol=1e-5)
    a.loss.backward()
    b.loss.backward()
    theirs_grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs_grads[name].grad, atol=1e-5, rtol=1e-4,
                                   msg=name)


def test_summed_loss_is_the_mean_times_the_batch():
    torch.manual_seed(0)
    model = BertForSequenceClassification(CFG, 2)
    ids, mask, types = _inputs()
    labels = torch.tensor([0, 1, 1, 0])
    mean = model(ids, mask, types, labels=labels).loss
    total = model(ids, mask, types, labels=labels, loss_reduction="sum").loss
    torch.testing.assert_close(total, mean * 4)


def test_encoder_comes_from_pretraining_and_the_head_is_fresh():
    torch.manual_seed(1)
    pretrained = BertForPreTraining(CFG)
    torch.manual_seed(2)
    model = BertForSequenceClassification(CFG, 2)
    model.load_encoder(pretrained.state_dict())
    ids, mask, types = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(model.bert(ids, mask, types).pooled_output,
                                   pretrained.bert(ids, mask, types).pooled_output)
    assert model.classifier.weight.std().item() == pytest.approx(CFG.initializer_range, rel=0.3)
    assert torch.all(model.classifier.bias == 0)


def test_an_mlm_only_encoder_gets_a_fresh_pooler():
    """RoBERTa's recipe (packing=full_sentences) pretrains no pooler: the classifier takes the
    rest and initialises the pooler, as transformers' class does from a BertForMaskedLM."""
    mlm_only = dataclasses.replace(CFG, next_sentence_prediction=False)
    torch.manual_seed(1)
    pretrained = BertForPreTraining(mlm_only)
    assert not any(k.startswith("bert.pooler.") for k in pretrained.state_dict())
    torch.manual_seed(2)
    model = BertForSequenceClassification(mlm_only, 2)
    assert model.load_encoder(pretrained.state_dict()) is False
    for name, tensor in pretrained.bert.state_dict().items():
        torch.testing.assert_close(model.bert.state_dict()[name], tensor, msg=name)
    assert model.bert.pooler.dense.weight.std().item() == pytest.approx(CFG.initializer_range,
                                                                        rel=0.3)
    ids, mask, types = _inputs()
    out = model(ids, mask, types, labels=torch.tensor([0, 1, 1, 0]))
    assert out.logits.shape == (4, 2) and torch.isfinite(out.loss)
    # A pooler is the only thing allowed to be missing: a state dict without layers is refused.
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_encoder({k: v for k, v in pretrained.state_dict().items()
                            if ".layer.0." not in k})
    assert BertForSequenceClassification(CFG, 2).load_encoder(
        BertForPreTraining(CFG).state_dict()) is True


def _perturbed_pretraining(config):
    """A pretraining model whose every tensor is moved off BERT's initialisation (LayerNorms
    not 1/0, biases not 0), so a tensor put back to a fresh initialisation shows."""
    torch.manual_seed(1)
    pretrained = BertForPreTraining(config)
    with torch.no_grad():
        for p in pretrained.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return pretrained


@pytest.mark.parametrize("pre_ln", [False, True])
@pytest.mark.parametrize("n", [0, 1, 2])
def test_reinit_top_layers_refreshes_those_layers_and_the_pooler_only(n, pre_ln):
    """Zhang et al.'s re-initialisation: layers L-n..L-1 and the pooler get BERT's
    initialisation (weights N(0, 0.02), zero biases, unit LayerNorms); the embeddings, the layers
    below and a pre-LN encoder's final LayerNorm keep the pretrained values."""
    config = dataclasses.replace(CFG, pre_layer_norm=pre_ln)
    pretrained = _perturbed_pretraining(config)
    torch.manual_seed(2)
    model = BertForSequenceClassification(config, 2)
    model.load_encoder(pretrained.state_dict())
    model.reinit_top_layers(n)
    fresh = tuple(f"encoder.layer.{i}." for i in range(CFG.num_hidden_layers - n,
                                                      CFG.num_hidden_layers))
    fresh += ("pooler.",) if n else ()
    theirs = pretrained.bert.state_dict()
    for name, tensor in model.bert.state_dict().items():
        if not name.startswith(fresh):
            assert torch.equal(tensor, theirs[name]), name
        elif "LayerNorm.weight" in name:
            assert torch.all(tensor == 1), name
        elif name.endswith("bias"):
            assert torch.all(tensor == 0), name
        else:
            assert tensor.std().item() == pytest.approx(CFG.initializer_range, rel=0.3), name
            assert tensor.mean().abs().item() < 0.01, name
    assert sum(name.startswith(fresh) for name in theirs) == (
        0 if n == 0 else n * len([k for k in theirs if k.startswith("encoder.layer.0.")]) + 2)


def test_reinit_top_layers_refuses_more_layers_than_the_encoder_has():
    model = BertForSequenceClassification(CFG, 2)
    with pytest.raises(ValueError, match="can re-initialise 0 to 2 layers of this encoder, got 3"):
        model.reinit_top_layers(3)


def test_bad_num_labels():
    with pytest.raises(ValueError, match="num_labels must be a positive integer"):
        BertForSequenceClassification(CFG, 0)


def _mean_head(switches=None):
    torch.manual_seed(0)
    return BertForSequenceClassification(CFG, 3, dataclasses.replace(ModelImpl(),
                                                                     **(switches or {})),
                                         pooling="mean").eval()


@pytest.mark.parametrize("switches", [{}, {"unpad": False}, {"varlen_attention": "off"},
                                      {"varlen_attention": "nested"}])
def test_mean_pooling_is_the_mean_over_real_tokens_whatever_the_padding(switches):
    """Each sequence scored alone, unpadded, and its states averaged by hand gives the logits
    the batch gives; padding the batch further changes nothing."""
    model = _mean_head(switches)
    ids, mask, types = _inputs()
    with torch.no_grad():
        batch = model(ids, mask, types).logits
        wider = torch.nn.functional.pad
        padded = model(wider(ids, (0, 7)), wider(mask, (0, 7)), wider(types, (0, 7))).logits
        for row in range(len(ids)):
            n = int(mask[row].sum())
            alone = model.bert(ids[row:row + 1, :n], None, types[row:row + 1, :n])
            states = alone.layout.to_grid(alone.sequence_output)[0]  # [n, H]
            reference = model.classifier(states.sum(0) / n)
            torch.testing.assert_close(batch[row], reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded, batch, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(batch[0], batch[1])


def test_mean_pooling_trains_no_pooler_and_takes_the_encoder_without_one():
    """No parameter outside what the loss reaches (DDP would wait for its gradient); an NSP
    model's pooler is left out of the load, the rest is taken."""
    model = _mean_head()
    assert model.bert.pooler is None
    pretrained = BertForPreTraining(CFG)
    assert model.load_encoder(pretrained.state_dict()) is False
    for name, tensor in model.bert.state_dict().items():
        torch.testing.assert_close(tensor, pretrained.bert.state_dict()[name], msg=name)
    ids, mask, types = _inputs()
    model.train()
    model(ids, mask, types, labels=torch.tensor([0, 2, 1, 2])).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_cls_head_is_the_default_and_unchanged():
    """pooling="cls" builds, initialises and computes exactly what the head did before the
    option (the transformers parity above covers the default)."""
    torch.manual_seed(0)
    default = BertForSequenceClassification(CFG, 2)
    torch.manual_seed(0)
    cls = BertForSequenceClassification(CFG, 2, pooling="cls")
    assert default.pooling == "cls" and default.bert.pooler is not None
    for (name, a), (_, b) in zip(default.state_dict().items(), cls.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="pooling must be one of cls, mean, got 'max'"):
        BertForSequenceClassification(CFG, 2, pooling="max")
