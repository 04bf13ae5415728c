"""The switch matrix (docs/model.md, "Speed switches against model and trainer options"): every
pair of a speed switch's value with another switch's or a model option's is either run, equal
to the plain path, or refused at start-up in one line naming the pair and what to use instead.

Pairwise coverage: a covering array in which every pair of values of two factors is met in a
row where both act (nested tensors paired with pre-LN, say, in a row whose layers really run
nested tensors, not one where relative positions send them to the padded grid); each row is a
tiny fp32 model's training step against the plain path's.  The paths come from
bert_pretrain/model/paths.py, the one rule that the layers and the start-up line both use."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from bert_pretrain.model import BertForPreTraining, ModelImpl
from bert_pretrain.model.paths import GRID_NAMES, PRODUCT_NAMES, attention_path, describe
from test_model_impl import PLAIN, tiny_config
from test_varlen_attention import cheap_groups, modes_used, spread_batch  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread", "cheap_groups")

FACTORS = {
    # speed switches (impl.*); fast_dropout acts only with dropout, which would draw other
    # masks on other grids: test_model_impl replays its masks instead
    "varlen_attention": ["auto", "groups", "nested", "off"],
    "attention": ["auto", "sdpa", "eager"],
    "prediction": ["dense", "sparse", "sparse+last"],
    "unpad": [True, False],
    "fused_qkv": [False, True],
    "gradient_checkpointing": [False, True],
    "compile": [False, True],
    # model options
    "position_embedding_type": ["absolute", "relative_key", "relative_key_query"],
    "pre_layer_norm": [False, True],
    "output_attentions": [False, True],
    "locality": [False, True],
}
NAMES = list(FACTORS)
# What sends a layer from the grid its switch names to the padded grid: the pair is then
# covered by that fallback (equal to the plain path all the same).
MOVES_THE_GRID = {"unpad", "position_embedding_type", "locality", "output_attentions"}
# The pairs refused at start-up (test_refused_pairs_are_one_line below).
REFUSED = [dict(varlen_attention="groups", unpad=False), dict(varlen_attention="nested",
                                                             unpad=False)]


def _impl(row) -> ModelImpl:
    return ModelImpl(
        varlen_attention=row["varlen_attention"], attention=row["attention"],
        sparse_prediction=row["prediction"] != "dense",
        sparse_last_layer=row["prediction"] == "sparse+last", unpad=row["unpad"],
        fused_qkv=row["fused_qkv"], gradient_checkpointing=row["gradient_checkpointing"],
        compile=row["compile"], fast_dropout=False)


def _refused(row) -> bool:
    return any(all(row[k] == v for k, v in pair.items()) for pair in REFUSED)


def _covers(row) -> set:
    """The pairs this row runs: both values act (or one is why the other does not)."""
    path = attention_path(_impl(row), "cpu", dropout=False,
                          score_bias=row["position_embedding_type"] != "absolute"
                          or row["locality"], output_attentions=row["output_attentions"])
    asked = ModelImpl(varlen_attention=row["varlen_attention"]).resolved_varlen_attention("cpu")

    def acts(name, other):
        if name == "varlen_attention":
            return path.grid == asked or other in MOVES_THE_GRID
        if name == "attention":  # nested tensors and maps decide the product themselves
            return (path.grid != "nested" and not row["output_attentions"]) or \
                other in ("varlen_attention", "output_attentions")
        return True

    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(NAMES, 2)
            if acts(a, b) and acts(b, a)}


def _every_row():
    for values in itertools.product(*FACTORS.values()):
        row = dict(zip(NAMES, values))
        if not _refused(row):
            yield row


def covering_rows(seed: int = 0, candidates: int = 60) -> list[dict]:
    """Rows that together cover every pair some row can run (greedy: each row the best, by
    pairs newly covered, of `candidates` seeded rows that cover the first pair still open)."""
    todo = set().union(*map(_covers, _every_row()))
    rng, rows = random.Random(seed), []
    while todo:
        first = min(todo, key=repr)
        best, found = set(), 0
        while found < candidates:
            row = {n: rng.choice(v) for n, v in FACTORS.items()}
            row.update(dict(first))
            covers = set() if _refused(row) else _covers(row) & todo
            if first in covers:
                found += 1
                if len(covers) > len(best):
                    best, rows_best = covers, row
        todo -= best
        rows.append(rows_best)
    return rows


ROWS = covering_rows()


def test_the_rows_cover_every_pair_that_can_run():
    runnable = set().union(*map(_covers, _every_row()))
    assert set().union(*map(_covers, ROWS)) == runnable
    # every pair of values is met: run, moved to the padded grid by the other, or refused
    for a, b in itertools.combinations(NAMES, 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            assert ((a, x), (b, y)) in runnable or _refused({**ROWS[0], a: x, b: y}), (a, x, b, y)
    assert len(ROWS) <= 30  # a covering array, not the 13,824-row product


def _step(model, batch, output_attentions):
    model.zero_grad(set_to_none=True)
    out = model(**batch, output_attentions=output_attentions)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _param(row):
    # impl.compile's rows compile (dynamo + AOT autograd) several seconds each on a shared
    # 2-core machine: with the slow tests (CI runs them)
    return pytest.param(row, marks=[pytest.mark.slow] if row["compile"] else [],
                        id=",".join(f"{k}={v}" for k, v in row.items()
                                    if v != FACTORS[k][0]) or "plain")


@pytest.mark.parametrize("row", [_param(row) for row in ROWS])
def test_each_pair_equals_the_plain_path(row, monkeypatch):
    if row["compile"]:
        # dynamo + AOT autograd as impl.compile runs them, without inductor's code generation
        # (tens of seconds a model; test_model_impl.test_compile_equals_eager runs inductor)
        real = torch.compile
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="aot_eager",
                                                                  dynamic=True))
        torch._dynamo.reset()
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      position_embedding_type=row["position_embedding_type"],
                      pre_layer_norm=row["pre_layer_norm"])
    torch.manual_seed(0)
    plain = BertForPreTraining(cfg, PLAIN).train()
    fast = BertForPreTraining(cfg, _impl(row)).train()
    fast.load_state_dict(plain.state_dict())
    if row["locality"]:
        for model in (plain, fast):
            model.set_attention_locality([2.0, 0.5, 0.0, 0.1])
    batch = spread_batch(cfg)
    path = attention_path(fast.impl, "cpu", dropout=False, output_attentions=row[
        "output_attentions"], score_bias=row["position_embedding_type"] != "absolute"
        or row["locality"])
    with torch.no_grad():  # the row runs what it covers
        assert path.grid in modes_used(fast, {**batch,
                                              "output_attentions": row["output_attentions"]})
    ref, ref_grads = _step(plain, batch, row["output_attentions"])
    out, grads = _step(fast, batch, row["output_attentions"])
    for name in ("loss", "mlm_loss", "nsp_loss", "seq_relationship_logits"):
        assert torch.allclose(getattr(out, name), getattr(ref, name), atol=1e-5, rtol=0), name
    if row["output_attentions"]:
        real = batch["attention_mask"].bool()[:, None, :, None]
        for a, b in zip(out.attentions, ref.attentions):
            assert torch.allclose(a[real.expand_as(b)], b[real.expand_as(b)], atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("pair", REFUSED, ids=lambda p: ",".join(f"{k}={v}"
                                                                 for k, v in p.items()))
def test_refused_pairs_are_one_line(pair):
    with pytest.raises(ValueError) as caught:
        ModelImpl(**pair)
    message = str(caught.value)
    assert "\n" not in message
    assert all(f"impl.{k}={str(v).lower()}" in message for k, v in pair.items()), message
    assert "set impl.unpad=true, or impl.varlen_attention=off" in message


def test_bert_train_refuses_a_pair_at_start_up(tmp_path):
    from train_support import run_bert_train, write_prepared

    data = write_prepared(str(tmp_path / "data"), num_train=8, num_valid=2)
    r = run_bert_train(["experiment=smoke", f"data.dir={data}", f"run_dir={tmp_path / 'r'}",
                        "impl.varlen_attention=nested", "impl.unpad=false"], cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "bert-train: error: impl.varlen_attention=nested with impl.unpad=false"), lines
    assert not (tmp_path / "r").exists()


def _sdpa_calls(model, batch, monkeypatch) -> bool:
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        model(**batch)
    monkeypatch.setattr(F, "scaled_dot_product_attention", real)
    return bool(calls)


@pytest.mark.parametrize("switches", [
    dict(varlen_attention="nested"), dict(varlen_attention="nested", attention="sdpa"),
    dict(varlen_attention="groups", attention="sdpa"), dict(), dict(varlen_attention="off"),
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
@pytest.mark.parametrize("position_type", ["absolute", "relative_key"])
def test_the_start_line_says_what_the_layers_run(switches, position_type, monkeypatch):
    """describe() against the layers: the grid they attend on and whether SDPA ran, with the
    locality bias on (its first share of training) and after it."""
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      position_embedding_type=position_type)
    model = BertForPreTraining(cfg, ModelImpl(sparse_prediction=False, **switches)).train()
    batch = spread_batch(cfg)
    batch.pop("labels"), batch.pop("next_sentence_label")
    ran = []
    for slopes in ([2.0, 0.5, 0.0, 0.1], None):
        model.set_attention_locality(slopes)
        (grid,) = modes_used(model, batch)
        sdpa = grid == "nested" or _sdpa_calls(model, batch, monkeypatch)
        ran.append("nested tensors + sdpa" if grid == "nested" else
                   f"{GRID_NAMES[grid]} + {PRODUCT_NAMES['sdpa' if sdpa else 'eager']}")
    line = describe(model.impl, cfg, "cpu", dropout=False, locality="first 45% of steps")
    expected = ran[1] if ran[0] == ran[1] else \
        f"{ran[0]} while the locality bias is on (first 45% of steps), then {ran[1]}"
    assert f"runs {expected}" in line, line
    assert f"runs {ran[1]}" in describe(model.impl, cfg, "cpu", dropout=False)


@pytest.mark.parametrize("switches", [
    dict(varlen_attention="groups", attention="sdpa", gradient_checkpointing=True),
    dict(varlen_attention="groups", attention="eager"),
    dict(varlen_attention="nested", gradient_checkpointing=True, fused_qkv=True),
    dict(varlen_attention="off", attention="sdpa"),
    dict(varlen_attention="off", attention="eager", gradient_checkpointing=True),
    dict(unpad=False, sparse_prediction=False),
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_on_each_path(switches, dtype):
    """trainer.mixed_precision=bf16 (and fp16, for GPUs without bf16 units) is autocast around
    the same model: each grid and product, with gradient checkpointing, against the plain path
    under the same autocast (bf16's rounding: the tolerance of tests/test_cuda.py's bf16
    cases), and the fast path's projections do run in that dtype."""
    cfg = tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    plain = BertForPreTraining(cfg, PLAIN).train()
    fast = BertForPreTraining(cfg, ModelImpl(**switches)).train()
    fast.load_state_dict(plain.state_dict())
    batch = spread_batch(cfg)
    ran = set()
    for module in fast.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, i, o: ran.add(o.dtype))
    with torch.autocast("cpu", dtype=dtype):
        ref, ref_grads = _step(plain, batch, False)
        out, grads = _step(fast, batch, False)
    assert ran == {dtype}, ran
    for name in ("loss", "mlm_loss", "nsp_loss", "seq_relationship_logits"):
        a, b = getattr(out, name).float(), getattr(ref, name).float()
        assert torch.allclose(a, b, atol=3e-2, rtol=3e-2), name
    for name, g in grads.items():
        assert torch.allclose(g.float(), ref_grads[name].float(), atol=3e-2, rtol=3e-2), name
