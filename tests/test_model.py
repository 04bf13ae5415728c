"""The model against its contract: config validation, shapes, tied weights, learning, and exact
parity with transformers' BertForPreTraining (the reference implementation)."""

import math

import pytest
import torch
import transformers
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from bert_pretrain.model import BertConfig, BertForPreTraining, ModelImpl, build_model

# attention="sdpa": the switches (attention="eager" among them) are checked against SDPA
PLAIN = ModelImpl(sparse_prediction=False, unpad=False, fused_qkv=False, fast_dropout=False,
                  attention="sdpa")


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**kw) -> BertConfig:
    base = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=24)
    return BertConfig(**{**base, **kw})


def make_batch(cfg: BertConfig, batch=4, seq=16, seed=0):
    """Padding of varied lengths, two segments, ~20% labelled real positions, NSP labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([seq, seq - 5, 7, seq - 1][:batch])
    ids = torch.randint(5, cfg.vocab_size, (batch, seq), generator=g)
    ids[:, 0] = 2
    pos = torch.arange(seq)
    mask = (pos[None] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, cfg.pad_token_id)
    seg_a = lengths // 2
    types = ((pos[None] >= seg_a[:, None]) & (mask == 1)).long()
    labelled = (torch.rand(batch, seq, generator=g) < 0.2) & (mask == 1) & (pos[None] > 0)
    labelled[:, 1] = True  # at least one label per sequence
    labels = torch.where(labelled, torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
                         torch.full_like(ids, -100))
    nsp = torch.randint(0, 2, (batch,), generator=g)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels,
                next_sentence_label=nsp)


# ---------------------------------------------------------------------------------- config


@pytest.mark.parametrize("kw, message", [
    (dict(hidden_size=30, num_attention_heads=4), "divisible by model.num_attention_heads"),
    (dict(hidden_act="tanh"), "hidden_act 'tanh' is not supported"),
    (dict(position_embedding_type="rotary"), "position_embedding_type 'rotary'"),
    (dict(vocab_size=None), "vocab_size is null"),
    (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob must be in [0, 1)"),
    (dict(num_hidden_layers=0), "num_hidden_layers must be a positive integer"),
    (dict(pad_token_id=500), "pad_token_id (500) must be a token id"),
])
def test_bad_config_rejected_with_clear_message(kw, message):
    with pytest.raises(ValueError) as err:
        tiny_config(**kw)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_keys_and_impl_values_rejected():
    with pytest.raises(ValueError, match=r"unknown model key\(s\) \['hiden_size'\]"):
        BertConfig.from_dict({"hiden_size": 3})
    with pytest.raises(ValueError, match="impl.attention 'flash'"):
        ModelImpl(attention="flash")
    with pytest.raises(ValueError, match=r"unknown impl key\(s\) \['unpadd'\]"):
        ModelImpl.from_dict({"unpadd": True})


def test_build_model_fills_vocab_from_overrides():
    model = build_model({**tiny_config().to_dict(), "vocab_size": None}, {"unpad": False},
                        vocab_size=50)
    assert model.bert.embeddings.word_embeddings.weight.shape == (50, 32)
    assert model.impl.unpad is False


def test_hf_config_round_trip():
    cfg = tiny_config(hidden_act="gelu_new")
    hf = transformers.BertConfig(**cfg.to_hf_dict())
    for key, value in cfg.to_dict().items():
        if key != "generator_layers":   # a pretraining device: exports hold the encoder alone
            assert getattr(hf, key) == value
    assert "generator_layers" not in tiny_config(generator_layers=1).to_hf_dict()
    with pytest.raises(ValueError, match="pre_layer_norm=true has no transformers"):
        tiny_config(pre_layer_norm=True).to_hf_dict()


# ---------------------------------------------------------------------------- structure


def test_shapes_and_tied_weights():
    cfg = tiny_config()
    model = BertForPreTraining(cfg, PLAIN)
    batch = make_batch(cfg)
    out = model(**batch, output_hidden_states=True)
    assert out.prediction_logits.shape == (4, 16, cfg.vocab_size)
    assert out.seq_relationship_logits.shape == (4, 2)
    assert out.mlm_labels is None
    assert len(out.hidden_states) == cfg.num_hidden_layers + 1
    assert all(h.shape == (4, 16, 32) for h in out.hidden_states)
    assert torch.allclose(out.loss, out.mlm_loss + out.nsp_loss)
    pred = model.cls.predictions
    assert pred.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert pred.decoder.bias is pred.bias
    # One parameter object: the optimizer updates it once, and an update shows in both places.
    names = [n for n, _ in model.named_parameters()]
    assert "cls.predictions.decoder.weight" not in names
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight[3, 0] = 42.0
    assert pred.decoder.weight[3, 0] == 42.0
    # Without labels there are no losses, and logits are dense even with sparse prediction on.
    out = BertForPreTraining(cfg)(batch["input_ids"], batch["attention_mask"])
    assert out.loss is None and out.prediction_logits.shape == (4, 16, cfg.vocab_size)


def test_initialisation_statistics():
    cfg = tiny_config(vocab_size=2000, hidden_size=64, initializer_range=0.05)
    model = BertForPreTraining(cfg)
    emb = model.bert.embeddings.word_embeddings.weight
    assert torch.all(emb[cfg.pad_token_id] == 0)
    assert abs(emb[1:].std().item() - 0.05) < 0.002
    q = model.bert.encoder.layer[0].attention.self.query
    assert abs(q.weight.std().item() - 0.05) < 0.005 and torch.all(q.bias == 0)
    assert torch.all(model.cls.predictions.bias == 0)
    ln = model.bert.encoder.layer[1].output.LayerNorm
    assert torch.all(ln.weight == 1) and torch.all(ln.bias == 0)


@pytest.mark.parametrize("impl", [PLAIN, ModelImpl()], ids=["plain", "default"])
def test_overfits_tiny_batch(impl):
    torch.manual_seed(0)
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForPreTraining(cfg, impl).train()
    batch = make_batch(cfg, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss = model(**batch).loss
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Starts near ln(V) + ln(2) (uniform guesses), ends memorised.
    assert abs(losses[0] - (math.log(cfg.vocab_size) + math.log(2))) < 0.6
    assert losses[-1] < 0.1 * losses[0]


def test_pre_layer_norm_has_final_norm_and_trains():
    cfg = tiny_config(pre_layer_norm=True)
    model = BertForPreTraining(cfg)
    assert "bert.encoder.LayerNorm.weight" in model.state_dict()
    loss = model(**make_batch(cfg)).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert model.bert.encoder.LayerNorm.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------ parity with transformers


def _relative_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        **kwargs):
    """transformers 4.x relative_key(_query) attention (eager), the formulas transformers 5
    removed; written out here as the reference for our SDPA-bias implementation."""
    n = query.shape[-2]
    pos = torch.arange(n)
    table = module.distance_embedding(pos[:, None] - pos[None, :] + module.max_pos - 1)
    scores = query @ key.transpose(-1, -2)
    scores = scores + torch.einsum("bhld,lrd->bhlr", query, table)
    if module.rel_type == "relative_key_query":
        scores = scores + torch.einsum("bhrd,lrd->bhlr", key, table)
    scores = scores * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1)
    return (probs @ value).transpose(1, 2).contiguous(), probs


AttentionInterface.register("test_relative", _relative_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register("test_relative", eager_mask)


def reference_model(cfg: BertConfig, attn_implementation="sdpa"):
    """transformers' BertForPreTraining for `cfg`; for relative position types, the same model
    with transformers 4.x's distance tables attached and no absolute positions."""
    hf_cfg = transformers.BertConfig(**cfg.to_hf_dict())
    if cfg.position_embedding_type == "absolute":
        return transformers.BertForPreTraining._from_config(
            hf_cfg, attn_implementation=attn_implementation).eval()
    hf = transformers.BertForPreTraining._from_config(hf_cfg, attn_implementation="test_relative")
    for layer in hf.bert.encoder.layer:
        attn = layer.attention.self
        attn.distance_embedding = nn.Embedding(2 * cfg.max_position_embeddings - 1,
                                               cfg.head_size)
        attn.max_pos, attn.rel_type = cfg.max_position_embeddings, cfg.position_embedding_type
    hf.bert.embeddings.position_embeddings.register_forward_hook(lambda m, i, o: o * 0)
    return hf.eval()


@pytest.mark.parametrize("position_type", ["absolute", "relative_key", "relative_key_query"])
@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new"])
def test_parity_with_transformers(position_type, hidden_act):
    torch.manual_seed(0)
    cfg = tiny_config(position_embedding_type=position_type, hidden_act=hidden_act)
    ours = BertForPreTraining(cfg, PLAIN).eval()
    hf = reference_model(cfg)
    assert sorted(ours.hf_state_dict()) == sorted(hf.state_dict())
    hf.load_state_dict(ours.hf_state_dict(), strict=True)
    # ... and transformers' state dict (with its unused absolute table) loads into ours.
    BertForPreTraining(cfg, PLAIN).load_state_dict(hf.state_dict(), strict=True)
    batch = make_batch(cfg)
    with torch.no_grad():
        mine, ref = ours(**batch), hf(**batch)
    assert torch.allclose(mine.prediction_logits, ref.prediction_logits, atol=1e-5, rtol=0)
    assert torch.allclose(mine.seq_relationship_logits, ref.seq_relationship_logits, atol=1e-5,
                          rtol=0)
    ref_mlm = nn.functional.cross_entropy(ref.prediction_logits.view(-1, cfg.vocab_size),
                                          batch["labels"].view(-1))
    assert abs(mine.mlm_loss.item() - ref_mlm.item()) < 1e-5
    assert abs(mine.loss.item() - ref.loss.item()) < 1e-5
    # The default (fast) implementation agrees with the reference too.
    fast = BertForPreTraining(cfg).eval()
    fast.load_state_dict(ours.state_dict(), strict=True)
    with torch.no_grad():
        out = fast(**batch)
    assert abs(out.loss.item() - ref.loss.item()) < 1e-5


def test_transformers_weights_load_into_ours():
    cfg = tiny_config()
    hf = reference_model(cfg)
    ours = BertForPreTraining(cfg)
    ours.load_state_dict(hf.state_dict(), strict=True)
    assert torch.equal(ours.cls.predictions.decoder.weight,
                       hf.bert.embeddings.word_embeddings.weight)
    batch = make_batch(cfg, seed=3)
    with torch.no_grad():
        assert abs(ours.eval()(**batch).loss.item() - hf(**batch).loss.item()) < 1e-5


def test_attentions_and_hidden_states_match_transformers():
    cfg = tiny_config()
    ours = BertForPreTraining(cfg).eval()
    hf = reference_model(cfg, attn_implementation="eager")
    hf.load_state_dict(ours.state_dict(), strict=True)
    batch = make_batch(cfg, seed=2)
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        mine = ours(**batch, output_attentions=True, output_hidden_states=True)
        ref = hf(**batch, output_attentions=True, output_hidden_states=True)
    assert len(mine.attentions) == len(ref.attentions) == cfg.num_hidden_layers
    for a, b in zip(mine.attentions, ref.attentions):
        assert a.shape == (4, cfg.num_attention_heads, 16, 16)
        # Queries at padding positions are undefined work; compare the real ones.
        rows = mask[:, None, :, None].expand_as(a)
        assert torch.allclose(a[rows], b[rows], atol=1e-6)
        assert torch.allclose(a.sum(-1)[mask[:, None].expand(-1, a.shape[1], -1)],
                              torch.ones(()), atol=1e-6)
        assert torch.all(a.masked_select(~mask[:, None, None, :]) == 0)
    assert len(mine.hidden_states) == len(ref.hidden_states) == cfg.num_hidden_layers + 1
    for a, b in zip(mine.hidden_states, ref.hidden_states):
        assert torch.allclose(a[mask], b[mask], atol=1e-5)


@pytest.mark.parametrize("position_type", ["absolute", "relative_key", "relative_key_query"])
@pytest.mark.parametrize("pre_layer_norm", [False, True])
def test_every_parameter_takes_part_in_the_forward_pass(position_type, pre_layer_norm):
    """DDP (find_unused_parameters off) stops at step 2 on a parameter that gets no gradient;
    relative position types used to keep an unused absolute position table."""
    cfg = tiny_config(position_embedding_type=position_type, pre_layer_norm=pre_layer_norm)
    model = BertForPreTraining(cfg)
    model(**make_batch(cfg)).loss.backward()
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    assert not unused
    has_table = "bert.embeddings.position_embeddings.weight" in model.state_dict()
    assert has_table == (position_type == "absolute")
    assert "bert.embeddings.position_embeddings.weight" in model.hf_state_dict()
