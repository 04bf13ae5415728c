"""Optimizers and schedules against their formulas."""

import math

import pytest
import torch

from bert_pretrain.components.optim import (Lamb, OptimConfig, Schedule, SchedulerConfig, build_optimizer,
                                 param_groups, set_lr)


def lamb_reference(params, grads_per_step, lr, b1, b2, eps, wd, adapt):
    """LAMB written directly from You et al. (2019), Algorithm 2, one tensor at a time, float64."""
    w = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1 ** t)
            v_hat = v[i] / (1 - b2 ** t)
            r = m_hat / (v_hat.sqrt() + eps)
            u = r + wd * w[i]
            wn, un = w[i].norm().item(), u.norm().item()
            ratio = wn / un if (adapt[i] and wn > 0 and un > 0) else 1.0
            w[i] = w[i] - lr * ratio * u
    return w


def test_lamb_matches_the_paper_formula():
    torch.manual_seed(0)
    init = [torch.randn(5, 4), torch.randn(5), torch.zeros(3, 3)]  # zeros: ||w|| = 0 -> ratio 1
    weight, bias, zero = params = [torch.nn.Parameter(t.clone()) for t in init]
    lr, b1, b2, eps, wd = 0.05, 0.9, 0.99, 1e-6, 0.1
    opt = Lamb([{"params": [weight, zero], "weight_decay": wd},
                {"params": [bias], "weight_decay": 0.0, "exclude_from_layer_adaptation": True}],
               lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    steps = [[torch.randn_like(p) for p in params] for _ in range(4)]
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    # weight decay and adaptation differ per group: run the reference once per setting
    ref_weight, _, ref_zero = lamb_reference(init, steps, lr, b1, b2, eps, wd, [True] * 3)
    _, ref_bias, _ = lamb_reference(init, steps, lr, b1, b2, eps, 0.0, [True, False, True])
    torch.testing.assert_close(weight.detach().double(), ref_weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias.detach().double(), ref_bias, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(zero.detach().double(), ref_zero, rtol=1e-5, atol=1e-6)
    # The trust ratio matters: without it the weight would have moved differently.
    ref_no_adapt, _, _ = lamb_reference(init, steps, lr, b1, b2, eps, wd, [False] * 3)
    assert not torch.allclose(weight.detach().double(), ref_no_adapt, atol=1e-3)


def test_param_groups_exclude_bias_and_layernorm_from_weight_decay():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4),
                                torch.nn.Embedding(10, 4))
    groups = param_groups(model.named_parameters(), 0.01)
    decay = {id(p) for p in groups[0]["params"]}
    no_decay = {id(p) for p in groups[1]["params"]}
    assert decay == {id(model[0].weight), id(model[2].weight)}
    assert no_decay == {id(model[0].bias), id(model[1].weight), id(model[1].bias)}
    assert groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0


def test_param_groups_with_rate_factors_split_by_factor_and_set_lr_applies_them():
    """Layer-wise decay (fine-tuning): one decay / no-decay pair per factor, each group's rate
    the scheduled rate times its factor; AdamW and LAMB take the groups."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4),
                                torch.nn.Linear(4, 2))
    factor = {"0": 0.25, "1": 0.5, "2": 1.0}
    groups = param_groups(model.named_parameters(), 0.01, lambda name: factor[name[0]])
    found = {(g["lr_scale"], g["weight_decay"]): {id(p) for p in g["params"]} for g in groups}
    assert found == {(0.25, 0.01): {id(model[0].weight)}, (0.25, 0.0): {id(model[0].bias)},
                     (0.5, 0.0): {id(model[1].weight), id(model[1].bias)},
                     (1.0, 0.01): {id(model[2].weight)}, (1.0, 0.0): {id(model[2].bias)}}
    for name in ("adamw", "lamb"):
        opt = build_optimizer(OptimConfig(name=name, lr=1e-3), model.named_parameters(),
                              lambda n: factor[n[0]])
        set_lr(opt, 2e-3)
        rates = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
        assert rates[id(model[0].weight)] == pytest.approx(5e-4)
        assert rates[id(model[1].bias)] == pytest.approx(1e-3)
        assert rates[id(model[2].weight)] == pytest.approx(2e-3)
    # without factors: the two groups as before, every rate the scheduled one
    plain = build_optimizer(OptimConfig(name="adamw"), model.named_parameters())
    set_lr(plain, 2e-3)
    assert len(plain.param_groups) == 2 and {g["lr"] for g in plain.param_groups} == {2e-3}


def test_adamw_is_fused_on_cpu_and_lamb_is_built():
    model = torch.nn.Linear(4, 4)
    adamw = build_optimizer(OptimConfig(name="adamw"), model.named_parameters())
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["fused"] is True
    lamb = build_optimizer(OptimConfig(name="lamb", lr=1e-2), model.named_parameters())
    assert isinstance(lamb, Lamb)


def test_optim_config_rejects_bad_values():
    with pytest.raises(ValueError, match="optim.name"):
        OptimConfig(name="sgd")
    with pytest.raises(ValueError, match="optim.lr"):
        OptimConfig(lr=-1.0)


def test_linear_warmup_then_linear_decay():
    s = Schedule(SchedulerConfig(name="linear"), max_steps=110, warmup_steps=10)
    assert [s.factor(i) for i in range(3)] == [0.1, 0.2, 0.3]
    assert s.factor(9) == 1.0 and s.factor(10) == 1.0
    assert s.factor(60) == pytest.approx(0.5)
    assert s.factor(110) == 0.0
    s2 = Schedule(SchedulerConfig(name="linear", end_lr_ratio=0.1), 110, 10)
    assert s2.factor(60) == pytest.approx(0.1 + 0.9 * 0.5)


def test_polynomial_and_constant():
    s = Schedule(SchedulerConfig(name="polynomial", power=0.5), max_steps=100, warmup_steps=0)
    for step in (0, 25, 50, 99):
        assert s.factor(step) == pytest.approx(math.sqrt(1 - step / 100))
    c = Schedule(SchedulerConfig(name="constant"), max_steps=100, warmup_steps=4)
    assert [c.factor(i) for i in (0, 3, 4, 99)] == [0.25, 1.0, 1.0, 1.0]


def test_cosine_and_hold_fraction():
    s = Schedule(SchedulerConfig(name="cosine", end_lr_ratio=0.1), max_steps=110,
                 warmup_steps=10)
    assert s.factor(10) == 1.0 and s.factor(110) == pytest.approx(0.1)
    assert s.factor(60) == pytest.approx(0.1 + 0.9 * 0.5)            # half way: half way down
    assert s.factor(35) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    # trapezoid: flat for 80% of the post-warmup steps, then the decay over the last 20%
    t = Schedule(SchedulerConfig(name="linear", hold_fraction=0.8), max_steps=110,
                 warmup_steps=10)
    assert [t.factor(i) for i in (10, 50, 90)] == [1.0, 1.0, 1.0]
    assert t.factor(100) == pytest.approx(0.5) and t.factor(110) == 0.0
    # in budget mode the hold is a share of the time after warmup
    b = Schedule(SchedulerConfig(name="cosine", hold_fraction=0.5), 10**6, 0, 100.0)
    assert b.factor(5, 49.0) == 1.0 and b.factor(6, 75.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="hold_fraction must be in"):
        SchedulerConfig(hold_fraction=1.0)


def test_budget_mode_follows_elapsed_time_and_restores_state():
    cfg = SchedulerConfig(name="linear")
    s = Schedule(cfg, max_steps=10**9, warmup_steps=2, budget_seconds=100.0)
    assert s.factor(0, elapsed=0.0) == 0.5
    assert s.factor(1, elapsed=5.0) == 1.0
    assert s.factor(2, elapsed=10.0) == 1.0            # warmup ended at t = 10 s
    assert s.factor(50, elapsed=55.0) == pytest.approx(0.5)  # (55 - 10) / (100 - 10)
    assert s.factor(51, elapsed=100.0) == 0.0
    resumed = Schedule(cfg, max_steps=10**9, warmup_steps=2, budget_seconds=100.0)
    resumed.load_state_dict(s.state_dict())
    assert resumed.factor(50, elapsed=55.0) == s.factor(50, elapsed=55.0)


def _real_model_with_grads():
    """A tiny BertForPreTraining with gradients from one real batch."""
    from bert_pretrain.model import BertConfig, BertForPreTraining
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForPreTraining(cfg)
    with torch.no_grad():   # LayerNorms start at exactly 1 / 0: move them off that
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(5, 50, (4, 12))
    labels = torch.where(torch.rand(4, 12) < 0.3, ids, torch.full_like(ids, -100))
    labels[:, 1] = ids[:, 1]
    model(ids, labels=labels, next_sentence_label=torch.tensor([0, 1, 0, 1])).loss.backward()
    return model


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_real_model_wiring_no_decay_no_adaptation_for_1d(name):
    """Every 1-d parameter of a real model (biases, LayerNorms, the MLM bias) gets no weight
    decay and, with LAMB, no trust ratio; every matrix gets both; each tensor once."""
    model = _real_model_with_grads()
    opt = build_optimizer(OptimConfig(name=name, lr=1e-2, weight_decay=0.1),
                          model.named_parameters())
    seen = {}
    for group in opt.param_groups:
        for p in group["params"]:
            assert id(p) not in seen, "a tensor is in two groups"
            seen[id(p)] = group
    params = dict(model.named_parameters())
    assert set(seen) == {id(p) for p in params.values()}
    one_d = [n for n, p in params.items() if p.ndim == 1]
    assert any("LayerNorm" in n for n in one_d) and "cls.predictions.bias" in one_d
    for n, p in params.items():
        group = seen[id(p)]
        if p.ndim == 1:
            assert group["weight_decay"] == 0.0, n
            if name == "lamb":
                assert group["exclude_from_layer_adaptation"] is True, n
        else:
            assert group["weight_decay"] == 0.1, n
            if name == "lamb":
                assert group["exclude_from_layer_adaptation"] is False, n


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_one_step_on_a_layernorm_weight_and_a_matrix(name):
    """One optimizer step on a real model against the formulas, computed here.  Step 1 of Adam
    moves by g / (|g| + eps) (bias-corrected moments); a LayerNorm weight gets no decay and (LAMB)
    no trust ratio; a matrix gets decay and (LAMB) ratio ||w|| / ||u||."""
    model = _real_model_with_grads()
    lr, wd, eps = 1e-2, 0.1, 1e-6
    ln = model.bert.encoder.layer[0].attention.output.LayerNorm.weight
    mat = model.bert.encoder.layer[0].intermediate.dense.weight
    before = {k: (p.detach().double().clone(), p.grad.double().clone())
              for k, p in (("ln", ln), ("mat", mat))}
    opt = build_optimizer(OptimConfig(name=name, lr=lr, weight_decay=wd, eps=eps, fused=False),
                          model.named_parameters())
    opt.step()
    w, g = before["ln"]
    adam = g / (g.abs() + eps)
    torch.testing.assert_close(ln.detach().double(), w - lr * adam, rtol=1e-6, atol=1e-7)
    w, g = before["mat"]
    adam = g / (g.abs() + eps)
    if name == "adamw":
        expected = w * (1 - lr * wd) - lr * adam
    else:
        u = adam + wd * w
        expected = w - lr * (w.norm() / u.norm()) * u
    torch.testing.assert_close(mat.detach().double(), expected, rtol=1e-6, atol=1e-7)


def nvidia_poly_warmup(step, warmup_steps, total_steps, degree=0.5):
    """NVIDIA DeepLearningExamples' PolyWarmUpScheduler (PyTorch BERT), as a factor of the peak:
    progress = step / total; linear warmup to progress = warmup, then (1 - progress) ** degree
    over ALL steps (so the decay starts below the peak)."""
    progress = step / total_steps
    warmup = warmup_steps / total_steps
    return progress / warmup if progress < warmup else (1 - progress) ** degree


@pytest.mark.parametrize("max_steps,warmup_steps,at_warmup_end",
                         [(7038, 2000, 0.846), (1563, 200, 0.934)])
def test_decay_from_start_follows_nvidia_poly_warmup(max_steps, warmup_steps, at_warmup_end):
    """Phase 1 (7,038 steps, 2,000 warmup) and phase 2 (1,563, 200): after warmup the factor is
    NVIDIA's (1 - step / total) ** 0.5, 0.846x the peak at the end of phase 1's warmup."""
    cfg = SchedulerConfig(name="polynomial", power=0.5, decay_from="start")
    s = Schedule(cfg, max_steps=max_steps, warmup_steps=warmup_steps)
    assert s.factor(warmup_steps - 1) == 1.0
    assert s.factor(warmup_steps) == pytest.approx(at_warmup_end, abs=5e-4)
    for step in range(warmup_steps, max_steps, 97):
        assert s.factor(step) == pytest.approx(nvidia_poly_warmup(step, warmup_steps, max_steps),
                                               rel=1e-12)
    assert s.factor(max_steps) == 0.0
    # The warmup-end decay (the default) restarts from the peak: 1.18x NVIDIA's rate in phase 1.
    old = Schedule(SchedulerConfig(name="polynomial", power=0.5), max_steps, warmup_steps)
    assert old.factor(warmup_steps) == 1.0
    # Budget mode: the same curve over elapsed / budget.
    b = Schedule(cfg, max_steps=10**9, warmup_steps=2, budget_seconds=100.0)
    b.factor(0, 0.0)
    assert b.factor(5, elapsed=36.0) == pytest.approx(0.8)


def test_bert_base_experiments_use_nvidia_schedule():
    from train_support import compose
    for name, (steps, warmup) in {"bert_base_phase1": (7038, 2000),
                                  "bert_base_phase2": (1563, 200)}.items():
        cfg = compose([f"experiment={name}", "data.dir=x"])
        sc = SchedulerConfig(**cfg.scheduler)
        assert (sc.name, sc.power, sc.decay_from) == ("polynomial", 0.5, "start"), name
        assert (cfg.trainer.max_steps, cfg.trainer.warmup_steps) == (steps, warmup)
        assert cfg.optim.name == "lamb"


def test_scheduler_config_rejects_unknown_decay_from():
    with pytest.raises(ValueError, match="scheduler.decay_from"):
        SchedulerConfig(decay_from="middle")
