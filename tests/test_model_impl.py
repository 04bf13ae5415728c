"""Speed switches (ModelImpl) against the plain path: same losses, logits and gradients."""

import dataclasses

import pytest
import torch

from bert_pretrain.model import BertConfig, BertForPreTraining, ModelImpl

# attention="sdpa": the switches (attention="eager" among them) are checked against SDPA
PLAIN = ModelImpl(sparse_prediction=False, unpad=False, fused_qkv=False, fast_dropout=False,
                  attention="sdpa")


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**kw) -> BertConfig:
    base = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=32)
    return BertConfig(**{**base, **kw})


def make_batch(cfg: BertConfig, batch=5, seq=20, seed=0):
    """Random lengths (some full), two segments, ~15% labelled real positions."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 3, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    pos = torch.arange(seq)
    mask = (pos[None] < lengths[:, None]).long()
    ids = torch.randint(5, cfg.vocab_size, (batch, seq), generator=g).masked_fill(mask == 0, 0)
    types = ((pos[None] >= (lengths // 2)[:, None]) & (mask == 1)).long()
    labelled = (torch.rand(batch, seq, generator=g) < 0.15) & (mask == 1) & (pos[None] > 0)
    labelled[:, 1] = True
    labels = torch.where(labelled, torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
                         torch.full_like(ids, -100))
    nsp = torch.randint(0, 2, (batch,), generator=g)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels,
                next_sentence_label=nsp)


def run_step(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same_step(reference, candidate, batch, atol=1e-5):
    ref_out, ref_grads = run_step(reference, batch)
    out, grads = run_step(candidate, batch)
    for name in ("loss", "mlm_loss", "nsp_loss", "seq_relationship_logits"):
        assert torch.allclose(getattr(out, name), getattr(ref_out, name), atol=atol, rtol=0), name
    labelled = batch["labels"] != -100
    dense_rows = ref_out.prediction_logits[labelled]
    if out.mlm_labels is not None:
        assert torch.equal(out.mlm_labels, batch["labels"][labelled])
        assert torch.allclose(out.prediction_logits, dense_rows, atol=atol, rtol=0)
    else:
        # Dense logits: every real position, not only the labelled ones.
        real = torch.ones_like(labelled) if batch.get("attention_mask") is None \
            else batch["attention_mask"].bool()
        assert torch.allclose(out.prediction_logits[real], ref_out.prediction_logits[real],
                              atol=atol, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=atol, rtol=1e-4), name


def twin(cfg, impl, source):
    model = BertForPreTraining(cfg, impl).train()
    model.load_state_dict(source.state_dict())
    return model


@pytest.mark.parametrize("switches", [
    dict(sparse_prediction=True, sparse_last_layer=False),
    dict(sparse_prediction=True, sparse_last_layer=True),
    dict(unpad=True),
    dict(fused_qkv=True),
    dict(attention="eager"),
    dict(sparse_prediction=True, unpad=True, fused_qkv=True),
], ids=lambda s: "+".join(s))
@pytest.mark.parametrize("position_type", ["absolute", "relative_key", "relative_key_query"])
def test_switch_equals_plain_path(switches, position_type):
    # Dropout off: the layouts draw different random masks, which is fine in training but would
    # make the comparison meaningless (fast dropout is compared with its masks replayed below).
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      position_embedding_type=position_type)
    torch.manual_seed(0)
    plain = BertForPreTraining(cfg, PLAIN).train()
    fast = twin(cfg, dataclasses.replace(PLAIN, **switches), plain)
    assert_same_step(plain, fast, make_batch(cfg))


@pytest.mark.parametrize("attention,sdpa_calls", [("auto", False), ("sdpa", True),
                                                  ("eager", False)])
@pytest.mark.parametrize("varlen", [False, True])
def test_auto_attention_takes_the_explicit_path_on_cpu(attention, sdpa_calls, varlen,
                                                       monkeypatch):
    """impl.attention=auto (the default) runs the explicit product on CPU, where SDPA's flash
    kernel is the slower one without dropout (bf16: 1.16-1.21x per training step); sdpa still
    runs SDPA; the results are the plain path's either way."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    plain = BertForPreTraining(cfg, PLAIN).train()
    impl = ModelImpl(attention=attention, varlen_attention=varlen)
    candidate = twin(cfg, impl, plain)
    calls.clear()
    candidate(**make_batch(cfg)).loss.backward()
    assert bool(calls) == sdpa_calls
    assert ModelImpl().attention == "auto"
    assert_same_step(plain, twin(cfg, impl, plain), make_batch(cfg))


@pytest.mark.parametrize("switches", [
    dict(),
    dict(sparse_prediction=True, unpad=True),
], ids=lambda s: "+".join(["fast_dropout", *s]))
@pytest.mark.parametrize("position_type", ["absolute", "relative_key"])
def test_fast_dropout_equals_torch_dropout_with_the_same_masks(switches, position_type,
                                                              monkeypatch):
    """At p > 0 (where dropout is not the identity): the fast-dropout model records the masks
    it draws; the same model with torch's dropout (attention on the explicit eager path, so its
    dropout goes through F.dropout too) replays them.  Outputs and gradients must agree."""
    from bert_pretrain.model import dropout as dropout_mod

    cfg = tiny_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                      position_embedding_type=position_type)
    torch.manual_seed(0)
    ref = BertForPreTraining(cfg, dataclasses.replace(PLAIN, attention="eager", **switches))
    fast = twin(cfg, dataclasses.replace(PLAIN, fast_dropout=True, **switches), ref.train())
    masks = []
    fast_apply = dropout_mod._CpuDropout.apply

    def record(x, p):
        y = fast_apply(x, p)
        masks.append((y != 0) | (x == 0))    # where x is 0 either choice gives 0
        return y

    def replay(x, p, training=True, inplace=False):
        assert training and p > 0
        return x * masks.pop(0) / (1 - p)

    batch = make_batch(cfg, seed=3)
    monkeypatch.setattr(dropout_mod._CpuDropout, "apply", staticmethod(record))
    out, grads = run_step(fast, batch)
    n = len(masks)
    assert n == 3 * cfg.num_hidden_layers + 1       # embeddings, attention probs, 2 residuals
    dropped = sum((~m).sum().item() for m in masks) / sum(m.numel() for m in masks)
    assert 0.05 < dropped < 0.15                    # really dropping (zeros in x aside)
    monkeypatch.setattr(torch.nn.functional, "dropout", replay)
    ref_out, ref_grads = run_step(ref, batch)
    assert not masks, "the reference drew fewer masks"
    for name in ("loss", "mlm_loss", "nsp_loss", "prediction_logits", "seq_relationship_logits"):
        assert torch.allclose(getattr(out, name), getattr(ref_out, name), atol=1e-5, rtol=0), \
            name
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("unpad", [False, True])
def test_sparse_last_layer_with_unlabelled_sequence(unpad):
    """A sequence with no label still needs its [CLS] row (NSP) from the last layer."""
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    batch = make_batch(cfg, seed=11)
    batch["labels"][3] = -100
    plain = BertForPreTraining(cfg, PLAIN).train()
    assert_same_step(plain, twin(cfg, ModelImpl(unpad=unpad), plain), batch)


def test_pre_layer_norm_fast_path_equals_plain():
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      pre_layer_norm=True)
    plain = BertForPreTraining(cfg, PLAIN).train()
    assert_same_step(plain, twin(cfg, ModelImpl(), plain), make_batch(cfg, seed=4))


def test_unpad_falls_back_when_first_token_is_padding():
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    batch = make_batch(cfg, seed=5)
    batch["attention_mask"][2] = batch["attention_mask"][2].flip(0)  # left padding
    batch["labels"][2] = torch.where(batch["attention_mask"][2] == 1, 7, -100)
    plain = BertForPreTraining(cfg, PLAIN).train()
    assert_same_step(plain, twin(cfg, ModelImpl(), plain), batch)


def test_no_attention_mask_and_no_padding():
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    batch = make_batch(cfg, seed=6)
    batch["attention_mask"] = None
    plain = BertForPreTraining(cfg, PLAIN).train()
    assert_same_step(plain, twin(cfg, ModelImpl(), plain), batch)


def test_hidden_states_and_attentions_with_unpadding():
    cfg = tiny_config()
    plain = BertForPreTraining(cfg, PLAIN).eval()
    fast = twin(cfg, ModelImpl(), plain).eval()
    batch = make_batch(cfg, seed=7)
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        a = plain(**batch, output_attentions=True, output_hidden_states=True)
        b = fast(**batch, output_attentions=True, output_hidden_states=True)
    for x, y in zip(a.hidden_states, b.hidden_states):
        assert torch.allclose(x[mask], y[mask], atol=1e-5)
        assert torch.all(y[~mask] == 0)  # unpadded layout: padding rows come back as zeros
    for x, y in zip(a.attentions, b.attentions):
        rows = mask[:, None, :, None].expand_as(x)
        assert torch.allclose(x[rows], y[rows], atol=1e-6)


@pytest.mark.parametrize("varlen", ["auto", "nested"])
def test_gradient_checkpointing_is_exact_with_dropout(varlen):
    """Nested tensors too: torch's check of the recomputed shapes cannot read them (it
    crashed, issue 38), the recomputation's dropout masks are the first pass's all the same."""
    cfg = tiny_config()  # dropout on: checkpointing must replay the same masks
    plain = BertForPreTraining(cfg, ModelImpl(varlen_attention=varlen)).train()
    ckpt = twin(cfg, ModelImpl(varlen_attention=varlen, gradient_checkpointing=True), plain)
    batch = make_batch(cfg, seed=8)
    torch.manual_seed(123)
    ref_out, ref_grads = run_step(plain, batch)
    torch.manual_seed(123)
    out, grads = run_step(ckpt, batch)
    assert torch.equal(out.loss, ref_out.loss)
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-6, rtol=0), name


def test_dropout_is_active_in_training_only():
    cfg = tiny_config()
    model = BertForPreTraining(cfg)
    batch = make_batch(cfg, seed=9)
    with torch.no_grad():
        train_losses = {model.train()(**batch).loss.item() for _ in range(3)}
        eval_losses = {model.eval()(**batch).loss.item() for _ in range(3)}
    assert len(train_losses) == 3 and len(eval_losses) == 1


def test_fast_dropout_bf16_scale_is_not_rounded():
    from bert_pretrain.model.dropout import dropout

    x = torch.linspace(1, 100, 20000).to(torch.bfloat16)
    y = dropout(x, 0.1, training=True, fast=True)
    kept = y != 0
    # Kept values are x / (1 - p) computed in fp32 and rounded once, as torch's dropout does;
    # folding a bf16-rounded scale into the mask would miss on many of these values.
    expected = (x.float() / 0.9).to(torch.bfloat16)
    assert torch.equal(y[kept], expected[kept])


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_fast_dropout_statistics_and_gradient(p):
    from bert_pretrain.model.dropout import dropout

    torch.manual_seed(0)
    x = torch.rand(400, 500) + 0.5
    x.requires_grad_(True)
    y = dropout(x, p, training=True, fast=True)
    kept = y != 0
    n = kept.numel()
    # Drop fraction within 5 standard errors of p; kept values scaled by 1/(1-p) exactly.
    assert abs((~kept).float().mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5
    assert torch.allclose(y[kept], x[kept] / (1 - p), rtol=1e-6)
    y.sum().backward()
    assert torch.allclose(x.grad, kept.float() / (1 - p), rtol=1e-6)
    assert dropout(x, p, training=False, fast=True) is x
    # Same seed, same mask (what checkpointing and seeded training rely on).
    torch.manual_seed(1)
    a = dropout(x, p, True, True)
    torch.manual_seed(1)
    assert torch.equal(a, dropout(x, p, True, True))


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_torch_compile_matches_eager(backend):
    """Compiles forward and backward (through AOT autograd) of the default implementation."""
    torch._dynamo.reset()
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      num_hidden_layers=1)
    eager = BertForPreTraining(cfg).train()
    compiled_model = twin(cfg, ModelImpl(), eager)
    compiled = torch.compile(compiled_model, backend=backend)
    batch = make_batch(cfg, seed=10)
    ref_out, ref_grads = run_step(eager, batch)
    compiled_model.zero_grad(set_to_none=True)
    out = compiled(**batch)
    out.loss.backward()
    assert torch.allclose(out.loss, ref_out.loss, atol=1e-5)
    for name, p in compiled_model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.slow
def test_torch_compile_inductor_matches_eager():
    test_torch_compile_matches_eager("inductor")


@pytest.mark.parametrize("switches", [
    dict(sparse_prediction=True, sparse_last_layer=True, unpad=True),
    dict(sparse_prediction=True, unpad=True, varlen_attention=False),
    dict(attention="eager"),
], ids=lambda s: "+".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("position_type", ["absolute", "relative_key"])
def test_attention_locality_is_the_same_on_every_path(switches, position_type):
    """The training-time locality bias enters the padded grid, the per-length groups and the
    last layer's query subset alike (losses, logits and gradients)."""
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      position_embedding_type=position_type)
    torch.manual_seed(0)
    plain = BertForPreTraining(cfg, PLAIN).train()
    fast = twin(cfg, dataclasses.replace(PLAIN, **switches), plain)
    for model in (plain, fast):
        model.set_attention_locality([2.0, 0.5, 0.0, 0.1])
    assert_same_step(plain, fast, make_batch(cfg))


def test_attention_locality_adds_minus_slope_times_distance():
    """Head h's scores get -slope_h * |i - j| (not the first position's, [CLS]'s): the log
    attention probabilities of layer 0 move by exactly that, up to each row's normaliser; no
    slopes (or all zero) is BERT."""
    cfg = tiny_config()
    torch.manual_seed(0)
    model = BertForPreTraining(cfg).eval()
    batch = make_batch(cfg)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  token_type_ids=batch["token_type_ids"], output_attentions=True)
    with torch.no_grad():
        base = model(**inputs).attentions[0].double()
        slopes = torch.tensor([1.5, 0.5, 0.0, 0.25], dtype=torch.float64)
        model.set_attention_locality(slopes.tolist())
        biased = model(**inputs).attentions[0].double()
        model.set_attention_locality([0.0] * 4)
        unbiased = model(**inputs).attentions[0].double()
    assert torch.equal(unbiased, base.float().double())
    pos = torch.arange(base.shape[-1], dtype=torch.float64)
    distance = (pos[:, None] - pos[None, :]).abs()
    distance[0] = 0  # the [CLS] query reads everything
    real = batch["attention_mask"].bool()[:, None, None, :].expand_as(base)
    shift = biased.log() - base.log() + slopes[None, :, None, None] * distance
    shift = torch.where(real, shift, torch.nan)
    spread = shift.nan_to_num(0).amax(-1) - torch.where(real, shift, torch.inf).amin(-1)
    assert spread.max().item() < 1e-4
    assert biased[:, 0].diagonal(dim1=-2, dim2=-1).mean() > base[:, 0].diagonal(
        dim1=-2, dim2=-1).mean() + 0.05  # the steep head looks at its own neighbourhood
    with pytest.raises(ValueError, match="one slope per head"):
        model.set_attention_locality([1.0, 0.5])


def test_dense_prediction_makes_no_fp32_copy_of_the_whole_logits():
    """sparse_prediction=false: the loss is taken over the labelled rows alone. Cross-entropy
    over every row made fp32 tensors as large as the [B*L, V] logits (the copy, its
    log-softmax, its gradient: issue 30's 5x slower full-vocabulary step on a GPU); now no fp32
    tensor larger than the labelled rows' is made, and the loss is the same."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fp32 = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.fp32 = max(self.fp32, t.numel())
            return t if not isinstance(out, (tuple, list)) else out

    cfg = tiny_config(vocab_size=4000, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    plain = BertForPreTraining(cfg, PLAIN).train()
    dense = twin(cfg, dataclasses.replace(PLAIN, unpad=True), plain)
    batch = make_batch(cfg, batch=8, seq=20)
    labelled = int((batch["labels"] != -100).sum())
    sizes = Sizes()
    with torch.autocast("cpu", dtype=torch.bfloat16), sizes:
        out = dense(**batch)
        out.loss.backward()
    assert out.prediction_logits.shape == (8, 20, cfg.vocab_size)  # dense logits still given
    # (the largest fp32 tensors left: the labelled rows' logits, the [V, H] weight and its grad)
    assert sizes.fp32 <= max(labelled, cfg.hidden_size) * cfg.vocab_size
    assert sizes.fp32 < 8 * 20 * cfg.vocab_size / 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = torch.nn.functional.cross_entropy(
            out.prediction_logits.reshape(-1, cfg.vocab_size).float(),
            batch["labels"].reshape(-1), ignore_index=-100)
    assert out.mlm_loss.item() == pytest.approx(reference.item(), rel=1e-6)


def test_compile_equals_eager():
    """impl.compile: each layer's dense blocks under torch.compile (inductor, dynamic shapes),
    on two batches of other lengths: the eager model's losses and gradients (no dropout, whose
    compiled masks come from inductor's own generator), and one compiled graph serves every
    layer rather than one per layer."""
    import torch._dynamo.utils as dynamo_utils

    from test_varlen_attention import assert_same_step as assert_same_sparse_step

    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      num_hidden_layers=3)
    torch.manual_seed(0)
    eager = BertForPreTraining(cfg, ModelImpl()).train()
    compiled = twin(cfg, ModelImpl(compile=True), eager)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    for seed in (1, 2):
        assert_same_sparse_step(eager, compiled, make_batch(cfg, seed=seed), atol=1e-5)
    # two blocks, and at most a recompile each for the last layer's subset rows
    assert_compiled(compiled)
    assert dynamo_utils.counters["stats"]["unique_graphs"] <= 4
    assert not dynamo_utils.counters["graph_break"]


def assert_compiled(model) -> None:
    """impl.compile took effect: every layer holds its compiled blocks, and dynamo compiled a
    graph for each of the two since the counters were cleared (an ignored switch runs eager,
    equal to the reference, and compiles nothing)."""
    import torch._dynamo.utils as dynamo_utils

    layers = model.bert.encoder.layer
    assert all(layer._compiled is not None for layer in layers), "impl.compile was ignored"
    assert dynamo_utils.counters["stats"]["unique_graphs"] >= 2, dict(dynamo_utils.counters)


@pytest.mark.parametrize("switches,electra", [
    (dict(), False),                                   # the CPU defaults: unpadded, thinned last layer
    (dict(unpad=False, sparse_last_layer=False), False),  # a GPU's defaults
    (dict(sparse_prediction=False), False),            # dense logits, loss over the labelled rows
    (dict(), True),                                    # ELECTRA: the generator's rows
    (dict(unpad=False, sparse_last_layer=False), True),
], ids=["cpu-defaults", "gpu-defaults", "dense", "electra-cpu", "electra-gpu"])
def test_a_labelled_count_from_the_host_gives_the_same_step(switches, electra):
    """`num_labelled` (a trainer's count of its batch) gathers the labelled rows at a given
    size instead of asking the device: the same losses, logits and gradients, bit for bit; a
    count that does not match the labels is refused where checking it costs no wait."""
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      generator_layers=1 if electra else 0)
    torch.manual_seed(0)
    model = BertForPreTraining(cfg, ModelImpl(**switches)).train()
    batch = make_batch(cfg)
    count = int((batch["labels"] != -100).sum())
    torch.manual_seed(1)  # (ELECTRA samples its replacements)
    plain_out, plain_grads = run_step(model, batch)
    real = {"num_real": int(batch["attention_mask"].sum())} if electra else {}
    torch.manual_seed(1)
    out, grads = run_step(model, batch, num_labelled=count, **real)
    if electra:
        assert torch.equal(out.rtd_loss, plain_out.rtd_loss) and out.rtd_loss > 0
        assert torch.equal(out.rtd_logits, plain_out.rtd_logits)
        if not switches.get("unpad", True):  # (the padded grid picks its real tokens by count)
            with pytest.raises(ValueError, match=f"num_real={real['num_real'] + 1}, but the "
                                                 f"attention mask holds {real['num_real']} real"):
                model(**batch, num_real=real["num_real"] + 1)
    assert torch.equal(out.loss, plain_out.loss)
    assert torch.equal(out.prediction_logits, plain_out.prediction_logits)
    assert all(torch.equal(grads[k], plain_grads[k]) for k in plain_grads)
    with pytest.raises(ValueError, match=f"num_labelled={count - 1}, but the labels hold "
                                         f"{count} that are not -100"):
        model(**batch, num_labelled=count - 1)
