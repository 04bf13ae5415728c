"""Attention over real tokens only (ModelImpl.varlen_attention): sequences grouped by length,
each group on its own grid, or every sequence at its own length as nested tensors; both equal
to the padded grid to float rounding.  The planner of the groups against a brute-force
optimum, and what `auto` picks on each device."""
import dataclasses
import itertools
import random

import pytest
import torch

from bert_pretrain.model import BertForPreTraining, ModelImpl
from bert_pretrain.model.layout import TokenLayout, plan_groups
from bert_pretrain.model.paths import describe
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


def twins(cfg, mode="groups", **switches):
    torch.manual_seed(0)
    off = BertForPreTraining(cfg, ModelImpl(varlen_attention="off", **switches))
    on = BertForPreTraining(cfg, ModelImpl(varlen_attention=mode, **switches))
    on.load_state_dict(off.state_dict())
    return off, on


def modes_used(model, batch) -> set:
    """The grids the model's attention layers ran on for `batch`."""
    from bert_pretrain.model import attention

    seen = set()
    real = attention.BertSelfAttention.varlen_mode

    def spy(self, *args, **kwargs):
        mode = real(self, *args, **kwargs)
        seen.add(mode)
        return mode

    attention.BertSelfAttention.varlen_mode = spy
    try:
        model(**batch)
    finally:
        attention.BertSelfAttention.varlen_mode = real
    return seen


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
    assert plan_groups([], 4) == []


def plan_cost(groups, lengths, heads, overhead):
    return sum(len(g) * max(lengths[i] for i in g) ** 2 + overhead / heads for g in groups)


def brute_force_cost(lengths, heads, overhead, max_groups):
    """The cheapest split into at most max_groups contiguous runs of the lengths sorted
    longest first (every such split tried)."""
    ls = sorted(lengths, reverse=True)
    best = float("inf")
    for k in range(max_groups):
        for cuts in itertools.combinations(range(1, len(ls)), k):
            bounds = [0, *cuts, len(ls)]
            best = min(best, sum((b - a) * ls[a] ** 2 + overhead / heads
                                 for a, b in zip(bounds, bounds[1:])))
    return best


def test_plan_groups_finds_the_optimum(monkeypatch):
    """Against every contiguous split of the sorted lengths (the optimum lies among them), on
    random batches: the planner's plan costs exactly the optimum, covers every sequence once,
    and its groups come longest first."""
    import bert_pretrain.model.layout as layout

    rng = random.Random(0)
    for _ in range(150):
        overhead = rng.choice([400, 5_000, 50_000])
        monkeypatch.setattr(layout, "GROUP_OVERHEAD", overhead)
        batch = rng.randint(1, 11)
        longest = rng.choice([8, 32, 128])
        lengths = [rng.randint(1, longest) if rng.random() < 0.6 else longest
                   for _ in range(batch)]
        heads = rng.choice([1, 2, 4, 12])
        groups = plan_groups(lengths, heads)
        assert sorted(i for g in groups for i in g) == list(range(batch))
        assert all(g == sorted(g) for g in groups)
        tops = [max(lengths[i] for i in g) for g in groups]
        assert tops == sorted(tops, reverse=True)
        expected = brute_force_cost(lengths, heads, overhead, min(batch, layout.MAX_GROUPS))
        assert plan_cost(groups, lengths, heads, overhead) == pytest.approx(expected, rel=1e-12)


def test_plan_groups_buckets_lengths_past_the_table_size(monkeypatch):
    """More distinct lengths than MAX_LENGTH_BUCKETS: lengths are rounded up to buckets
    (ceil(longest / buckets) tokens wide) and the cost table stays buckets x buckets; the plan
    is then within each sequence's rounding of the optimum.  Fewer distinct lengths are never
    rounded (exact)."""
    import bert_pretrain.model.layout as layout

    monkeypatch.setattr(layout, "GROUP_OVERHEAD", 50_000)
    monkeypatch.setattr(layout, "MAX_LENGTH_BUCKETS", 8)
    tables = []
    real = torch.Tensor.masked_fill_
    monkeypatch.setattr(torch.Tensor, "masked_fill_",
                        lambda self, *a: tables.append(tuple(self.shape)) or real(self, *a))
    rng = random.Random(1)
    lengths = [rng.randint(1, 511) for _ in range(11)] + [512]
    groups = plan_groups(lengths, 8)
    assert tables and all(k <= 8 for shape in tables for k in shape)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    optimum = brute_force_cost(lengths, 8, 50_000, layout.MAX_GROUPS)
    width = 512 // 8
    rounding = 2 * 512 * (width - 1) + (width - 1) ** 2  # (L + w - 1)^2 - L^2 at most
    assert optimum <= plan_cost(groups, lengths, 8, 50_000) <= optimum + len(lengths) * rounding
    tables.clear()
    few = [rng.randint(1, 512) for _ in range(6)]  # 6 distinct lengths: exact
    assert plan_cost(plan_groups(few, 8), few, 8, 50_000) == pytest.approx(
        brute_force_cost(few, 8, 50_000, layout.MAX_GROUPS), rel=1e-12)


def test_bucketed_plan_is_the_optimum_over_bucketed_lengths(monkeypatch):
    """With more distinct lengths than buckets, the planner solves the problem over the
    bucketed lengths exactly: each length rounded UP to a multiple of the bucket width, the
    width ceil(longest / MAX_LENGTH_BUCKETS).  Longest lengths that do not divide evenly, so
    that rounding down (a length or the width) gives other buckets and another plan."""
    import bert_pretrain.model.layout as layout

    monkeypatch.setattr(layout, "MAX_LENGTH_BUCKETS", 8)
    rng = random.Random(3)
    for _ in range(60):
        overhead = rng.choice([400, 5_000, 50_000])
        monkeypatch.setattr(layout, "GROUP_OVERHEAD", overhead)
        longest = rng.choice([67, 101, 333, 509])
        assert longest % 8
        lengths = rng.sample(range(1, longest), 11) + [longest]  # 12 distinct: bucketed
        heads = rng.choice([1, 4, 12])
        width = -(-longest // 8)
        bucketed = [-(-n // width) * width for n in lengths]
        groups = plan_groups(lengths, heads)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        expected = brute_force_cost(bucketed, heads, overhead, layout.MAX_GROUPS)
        assert plan_cost(groups, bucketed, heads, overhead) == pytest.approx(expected,
                                                                           rel=1e-12)


def test_plan_groups_at_a_large_batch_is_a_few_vector_steps(monkeypatch):
    """B=512 with 65 distinct lengths: the plan is the same whatever the order of the batch,
    and the planner's cost table is K x K for the distinct lengths, not B x B (the old
    programme ran O(MAX_GROUPS x B^2) Python steps: 0.6 s at B=512).  Its time is measured by
    bench/bench_planner.py, not here."""
    import bert_pretrain.model.layout as layout

    tables = []
    real = torch.Tensor.masked_fill_
    monkeypatch.setattr(torch.Tensor, "masked_fill_",
                        lambda self, *a: tables.append(tuple(self.shape)) or real(self, *a))
    rng = random.Random(2)
    lengths = [128 if rng.random() < 0.5 else rng.randint(64, 128) for _ in range(512)]
    groups = plan_groups(lengths, 4)
    assert tables == [(len(set(lengths)),) * 2]
    perm = list(range(512))
    rng.shuffle(perm)
    shuffled = plan_groups([lengths[i] for i in perm], 4)
    assert sorted(sorted(perm[i] for i in g) for g in shuffled) == sorted(groups)
    assert all(len(g) for g in groups) and len(groups) <= layout.MAX_GROUPS


CASES = [
    dict(),
    dict(attention="sdpa"),
    dict(attention="eager"),
    dict(sparse_last_layer=False),
    dict(sparse_prediction=False),
    dict(fused_qkv=True),
]


MODELS = [dict(), dict(position_embedding_type="relative_key"),
          dict(position_embedding_type="relative_key_query"), dict(pre_layer_norm=True)]
MODEL_IDS = ["absolute", "relative_key", "relative_key_query", "pre_ln"]


@pytest.mark.parametrize("switches", CASES, ids=lambda s: ",".join(s) or "default")
@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_groups_equal_the_padded_grid(switches, model):
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **model)
    off, on = twins(cfg, "groups", **switches)
    batch = spread_batch(cfg)
    assert modes_used(on, batch) >= {"groups"}
    assert_same_step(off, on, batch)


@pytest.mark.parametrize("switches", CASES, ids=lambda s: ",".join(s) or "default")
@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_nested_equals_the_padded_grid(switches, model):
    """Nested tensors (on CPU SDPA's reference path for them; on CUDA the fused kernels,
    tests/test_cuda.py): equal to the padded grid, the last layer's query subset included.
    Relative positions need a score bias and take the padded grid."""
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **model)
    off, on = twins(cfg, "nested", **switches)
    batch = spread_batch(cfg)
    relative = model.get("position_embedding_type", "absolute") != "absolute"
    assert modes_used(on, batch) == ({"off"} if relative else {"nested"})
    assert_same_step(off, on, batch)


@pytest.mark.parametrize("mode", ["groups", "nested"])
def test_single_sequence_and_equal_lengths(mode):
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    off, on = twins(cfg, mode)
    assert_same_step(off, on, spread_batch(cfg, lengths=[17]))
    assert_same_step(off, on, spread_batch(cfg, lengths=[17, 17, 17]))


def test_nested_with_the_locality_bias_takes_the_padded_grid():
    """The locality start adds a score bias, which the fused variable-length kernels do not
    take: those layers attend on the padded grid, with the same result."""
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    off, on = twins(cfg, "nested")
    for model in (off, on):
        model.set_attention_locality([0.5, 0.25, 0.0, 0.0])
    batch = spread_batch(cfg)
    assert modes_used(on, batch) == {"off"}
    assert_same_step(off, on, batch)


@pytest.mark.parametrize("mode,used", [("groups", "off"), ("nested", "nested")])
def test_holes_in_the_mask(mode, used):
    """Real tokens that are not a prefix (a hole mid-sequence): positions inside a group grid
    would be wrong, so groups fall back to the padded grid; nested tensors hold each
    sequence's real tokens in order (absolute positions come from the embeddings), so they
    still apply.  Equal either way."""
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    off, on = twins(cfg, mode)
    batch = spread_batch(cfg)
    batch["attention_mask"][0, 5] = 0
    batch["labels"][0, 5] = -100
    layout = TokenLayout.build(batch["attention_mask"], len(LENGTHS), 32, unpad=True)
    assert layout.unpadded and not layout.right_padded
    assert modes_used(on, batch) == {used}
    assert_same_step(off, on, batch)


@pytest.mark.parametrize("device,expected", [("cpu", "off"), ("cuda", "off"),
                                             ("mps", "off")])
def test_auto_picks_per_device(device, expected):
    """auto: the padded grid for the attention product on every device (on a GPU with SDPA's
    fused kernels, 6x faster than groups on an H100, issue 30; on a 2-core CPU, still unpadded
    around it, 1.03-1.23x faster than the groups on quiet cores, docs/benchmarks.md); an explicit
    choice stands on every device; without unpadding there is nothing to skip."""
    assert ModelImpl().varlen_attention == "auto"
    assert ModelImpl().resolved_varlen_attention(device) == expected
    assert ModelImpl(varlen_attention="nested").resolved_varlen_attention(device) == "nested"
    assert ModelImpl(varlen_attention="groups").resolved_varlen_attention(device) == "groups"
    assert ModelImpl(unpad=False).resolved_varlen_attention(device) == "off"
    line = describe(ModelImpl(), None, device)
    # (on a GPU the grid is padded, so `off` is no choice of varlen_attention's own)
    assert (f"varlen_attention={expected} (auto on {device})" if device == "cpu"
            else f"varlen_attention={expected}, ") in line
    assert f"attention={'eager' if device == 'cpu' else 'sdpa'} (auto on {device})" in line


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_unpad_auto_per_device(device):
    """auto: unpadded on CPUs, the padded grid on GPUs (1.2x a step at three BERT shapes on an
    H200, docs/gpu.md), except where the attention asked for is over real tokens (groups,
    nested), which needs the unpadded rows on every device; an explicit value stands, and the
    start-up line says which it became."""
    gpu = device != "cpu"
    assert ModelImpl().unpad == "auto"
    assert ModelImpl().resolved_unpad(device) is (not gpu)
    assert ModelImpl().resolved_varlen_attention(device) == "off"
    for varlen in ("groups", "nested"):
        impl = ModelImpl(varlen_attention=varlen)
        assert impl.resolved_unpad(device) is True
        assert impl.resolved_varlen_attention(device) == varlen
    assert ModelImpl(varlen_attention="off").resolved_unpad(device) is (not gpu)
    for value in (True, False):
        assert ModelImpl(unpad=value).resolved_unpad(device) is value
    line = describe(ModelImpl(), None, device)
    assert line.startswith(f"{'padded' if gpu else 'unpadded'} (auto on {device}), ")
    assert describe(ModelImpl(unpad=True), None, device).startswith("unpadded, ")
    with pytest.raises(ValueError, match="impl.unpad must be true, false or auto, got 'yes'"):
        ModelImpl(unpad="yes")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fused_qkv_and_sparse_last_layer_auto_per_device(device):
    """auto: the fused Q/K/V projection and the full last layer on GPUs (1.29x and 1.21x a
    BERT-base training step on an H100, docs/gpu.md), neither on CPUs (measured slower there);
    an explicit value stands on every device, anything else is one clear error."""
    gpu = device != "cpu"
    impl = ModelImpl()
    assert impl.fused_qkv == impl.sparse_last_layer == "auto"
    assert impl.resolved_fused_qkv(device) is gpu
    assert impl.resolved_sparse_last_layer(device) is (not gpu)
    for value in (True, False):
        assert ModelImpl(fused_qkv=value).resolved_fused_qkv(device) is value
        assert ModelImpl(sparse_last_layer=value).resolved_sparse_last_layer(device) is value
    line = describe(impl, None, device)
    assert ("fused qkv (auto on cuda)" in line) is gpu
    assert ("sparse prediction + last layer" in line) is (not gpu)
    with pytest.raises(ValueError, match="impl.fused_qkv must be true, false or auto, got 'yes'"):
        ModelImpl(fused_qkv="yes")


def test_the_layers_run_what_their_device_resolves(monkeypatch):
    """The layers ask the device they run on, not the config's literal `auto`: with the
    resolution patched to what a GPU gets, a CPU step runs the fused [3H, H] projection and the
    full last layer, and computes the same step as the CPU's own choice."""
    import torch.nn.functional as F

    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    batch = make_batch(cfg)
    torch.manual_seed(0)
    reference = BertForPreTraining(cfg, ModelImpl(fused_qkv=False, sparse_last_layer=True))
    model = BertForPreTraining(cfg, ModelImpl())
    model.load_state_dict(reference.state_dict())
    asked, fused = [], []
    monkeypatch.setattr(ModelImpl, "resolved_fused_qkv",
                        lambda self, device: asked.append(("qkv", device)) or True)
    monkeypatch.setattr(ModelImpl, "resolved_sparse_last_layer",
                        lambda self, device: asked.append(("last", device)) or False)
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: fused.append(
        w.shape[0] == 3 * cfg.hidden_size) or linear(x, w, b))
    assert_same_step(reference, model, batch)
    assert ("qkv", "cpu") in asked and ("last", "cpu") in asked
    assert sum(fused) >= cfg.num_hidden_layers  # every layer's Q/K/V in one GEMM


@pytest.mark.parametrize("attention,device,dropout,expected", [
    ("sdpa", "cpu", True, "eager"), ("sdpa", "cpu", False, "sdpa"), ("sdpa", "cuda", True, "sdpa"),
    ("auto", "cpu", False, "eager"), ("eager", "cuda", False, "eager")])
def test_the_start_line_names_the_attention_the_layers_run(attention, device, dropout,
                                                           expected):
    """One rule (paths.attention_path) for the path the layers take and the start-up line:
    `sdpa` with dropout on a CPU runs the explicit product (SDPA's dropout is unfused there),
    and the line says so instead of `sdpa`."""
    impl = ModelImpl(attention=attention)
    assert impl.resolved_attention(device, dropout) == expected
    line = describe(impl, None, device, dropout=dropout)
    assert f"attention={expected}" in line
    assert f"runs padded grid + {'explicit product' if expected == 'eager' else 'sdpa'}" \
        in line
    cfg = tiny_config(attention_probs_dropout_prob=0.1 if dropout else 0.0)
    model = BertForPreTraining(cfg, impl).train()
    layer = model.bert.encoder.layer[0].attention.self
    assert layer._explicit(False, torch.device(device)) == (expected == "eager")


def test_auto_on_cpu_runs_the_padded_grid_and_groups_when_asked():
    """The layers run what `auto` resolves to on a CPU (the padded grid around the unpadded
    rows), and the groups when they are asked for, on the same batch of several lengths."""
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    _, auto = twins(cfg, "auto")
    assert modes_used(auto, spread_batch(cfg)) == {"off"}
    _, groups = twins(cfg, "groups")
    assert modes_used(groups, spread_batch(cfg)) >= {"groups"}


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
    with pytest.raises(ValueError, match="impl.varlen_attention 'yes' is not supported; use "
                                         "one of auto, groups, nested, off"):
        dataclasses.replace(ModelImpl(), varlen_attention="yes")
    # the booleans of earlier configs and checkpoints keep their meaning
    assert ModelImpl(varlen_attention=True).varlen_attention == "groups"
    assert ModelImpl(varlen_attention=False).varlen_attention == "off"
