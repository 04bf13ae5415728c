"""Attention over real tokens only (ModelImpl.varlen_attention): sequences grouped by length,
each group on its own grid, equal to the padded grid to float rounding."""
import dataclasses

import pytest
import torch

from bert_pretrain.model import BertForPreTraining, ModelImpl
from bert_pretrain.model.layout import TokenLayout, plan_groups
from test_model_impl import make_batch, run_step, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread", "cheap_groups")


@pytest.fixture
def cheap_groups(monkeypatch):
    """The tiny test sequences (<= 32 tokens) are too short for a group to pay off under the
    real cost model; a cheap group makes the planner split them, so grouping is exercised."""
    import bert_pretrain.model.layout as layout

    monkeypatch.setattr(layout, "GROUP_OVERHEAD", 400)

LENGTHS = [32, 32, 31, 9, 7, 5, 3, 20]  # several groups at 4 heads (checked below)


def spread_batch(cfg, lengths=LENGTHS, seq=32):
    batch = make_batch(cfg, batch=len(lengths), seq=seq)
    pos = torch.arange(seq)
    mask = (pos[None] < torch.tensor(lengths)[:, None]).long()
    batch["attention_mask"] = mask
    batch["input_ids"] = batch["input_ids"].masked_fill(mask == 0, 0)
    batch["token_type_ids"] = batch["token_type_ids"] * mask
    batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    return batch


def assert_same_step(off, on, batch, atol=1e-5):
    """Same switches but varlen: same outputs (both sparse or both dense) and gradients."""
    ref, ref_grads = run_step(off, batch)
    out, grads = run_step(on, batch)
    for name in ("loss", "mlm_loss", "nsp_loss", "seq_relationship_logits", "prediction_logits"):
        a, b = getattr(out, name), getattr(ref, name)
        if name == "prediction_logits" and out.mlm_labels is None:  # dense: real positions
            real = batch["attention_mask"].bool()
            a, b = a[real], b[real]
        assert torch.allclose(a, b, atol=atol, rtol=0), name
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, ref_grads[name], atol=atol, rtol=0), name


def twins(cfg, **switches):
    torch.manual_seed(0)
    off = BertForPreTraining(cfg, ModelImpl(varlen_attention=False, **switches))
    on = BertForPreTraining(cfg, ModelImpl(varlen_attention=True, **switches))
    on.load_state_dict(off.state_dict())
    return off, on


def test_the_test_batch_makes_several_groups():
    layout = TokenLayout.build(torch.tensor([[1] * n + [0] * (32 - n) for n in LENGTHS]),
                               len(LENGTHS), 32, unpad=True)
    groups = layout.attention_groups(4)
    assert len(groups) >= 3
    assert sorted(sum((g.token_rows.tolist() for g in groups), [])) == list(range(sum(LENGTHS)))


def test_plan_groups_partitions_by_length(monkeypatch):
    import bert_pretrain.model.layout as layout

    monkeypatch.setattr(layout, "GROUP_OVERHEAD", 50_000)  # the real cost model
    assert plan_groups([128] * 8, 4) == [list(range(8))]
    groups = plan_groups([128, 10, 128, 12, 128, 11, 128, 9] * 4, 4)
    assert len(groups) == 2
    assert {frozenset(g) for g in groups} == {frozenset(range(0, 32, 2)),
                                              frozenset(range(1, 32, 2))}
    # one long and many short sequences: never worse than one padded grid by the cost model
    lengths = [128] + [16] * 31
    groups = plan_groups(lengths, 4)
    assert sorted(i for g in groups for i in g) == list(range(32))
    assert any(max(lengths[i] for i in g) == 16 for g in groups)


CASES = [
    dict(),
    dict(attention="sdpa"),
    dict(attention="eager"),
    dict(sparse_last_layer=False),
    dict(sparse_prediction=False),
    dict(fused_qkv=True),
]


@pytest.mark.parametrize("switches", CASES, ids=lambda s: ",".join(s) or "default")
@pytest.mark.parametrize("model", [dict(), dict(position_embedding_type="relative_key"),
                                   dict(position_embedding_type="relative_key_query"),
                                   dict(pre_layer_norm=True)],
                         ids=["absolute", "relative_key", "relative_key_query", "pre_ln"])
def test_varlen_equals_the_padded_grid(switches, model):
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **model)
    off, on = twins(cfg, **switches)
    assert_same_step(off, on, spread_batch(cfg))


def test_single_sequence_and_equal_lengths():
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    off, on = twins(cfg)
    assert_same_step(off, on, spread_batch(cfg, lengths=[17]))
    assert_same_step(off, on, spread_batch(cfg, lengths=[17, 17, 17]))


def test_holes_in_the_mask_keep_the_padded_grid():
    """Real tokens that are not a prefix (a hole mid-sequence): positions inside the group grid
    would be wrong, so attention stays on the padded grid, still equal."""
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      position_embedding_type="relative_key")
    off, on = twins(cfg)
    batch = spread_batch(cfg)
    batch["attention_mask"][0, 5] = 0
    batch["labels"][0, 5] = -100
    layout = TokenLayout.build(batch["attention_mask"], len(LENGTHS), 32, unpad=True)
    assert layout.unpadded and layout.lengths is None
    assert_same_step(off, on, batch)


def test_training_with_dropout_runs_and_learns_the_same_shape():
    """With dropout the masks differ from the padded path's (other shapes), as any speed switch
    that changes the grid; the step runs and gives finite gradients for every parameter."""
    cfg = tiny_config()
    _, on = twins(cfg)
    out = on(**spread_batch(cfg))
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for n, p in on.named_parameters() if "position_embeddings" not in n)


def test_switch_is_validated():
    with pytest.raises(ValueError, match="impl.varlen_attention must be true or false"):
        dataclasses.replace(ModelImpl(), varlen_attention="yes")
