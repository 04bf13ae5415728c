"""Every config group option and every experiment composes, validates, and trains a few steps
(on a shrunken model where the real one would not fit a CPU test)."""

import glob
import importlib.util
import os

import pytest

from bert_pretrain.config import settings
from bert_pretrain.model import BertConfig
from train_support import REPO, compose, read_metrics, train_in_process, write_prepared

CONF = os.path.join(REPO, "conf", "train")
# Shrink any model to a test size (the option's other fields, e.g. activation, stay as they are).
SHRINK = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
          "model.intermediate_size=64"]
FAST = ["trainer.max_steps=3", "trainer.warmup_steps=1", "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2", "trainer.eval_max_samples=8", "trainer.eval_every=0",
        "trainer.checkpoint_every=100", "trainer.log_every=1", "trainer.progress_bar=false"]


def options(group):
    return sorted(os.path.splitext(os.path.basename(p))[0]
                  for p in glob.glob(os.path.join(CONF, group, "*.yaml")))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=32, num_valid=8)


def test_every_group_has_the_documented_options():
    assert {"bert_tiny", "bert_mini", "bert_small", "bert_medium", "bert_base",
            "bert_large"} <= set(options("model"))
    assert options("optim") == ["adamw", "lamb"]
    assert options("scheduler") == ["constant", "cosine", "linear", "polynomial", "wsd"]
    assert options("logger") == ["none", "wandb"]
    assert {"demo", "bert_base_phase1", "bert_base_phase2", "gutenberg_mini", "budget_mini",
            "smoke"} <= set(options("experiment"))


@pytest.mark.parametrize("model", options("model"))
def test_model_options_compose_and_validate(model, prepared):
    s = settings(compose([f"model={model}", f"data.dir={prepared}"]))
    cfg = BertConfig.from_dict(s.model, vocab_size=64, pad_token_id=0)
    assert cfg.hidden_size % cfg.num_attention_heads == 0
    expected = {"bert_tiny": (2, 128), "bert_l2_h256": (2, 256), "bert_mini": (4, 256),
                "bert_small": (4, 512),
                "bert_medium": (8, 512), "bert_base": (12, 768), "bert_large": (24, 1024)}
    if model in expected:
        assert (cfg.num_hidden_layers, cfg.hidden_size) == expected[model]


@pytest.mark.parametrize("model", ["bert_tiny", "bert_mini"])
def test_small_models_train_as_configured(model, prepared, tmp_path):
    loss = train_in_process([f"model={model}", f"data.dir={prepared}", f"run_dir={tmp_path}",
                             "trainer.max_steps=2", *FAST[1:]])
    assert loss > 0


@pytest.mark.parametrize("group,option", [("optim", o) for o in options("optim")]
                         + [("scheduler", o) for o in options("scheduler")]
                         + [("logger", o) for o in options("logger")]
                         + [("impl", o) for o in options("impl")]
                         + [("data", o) for o in options("data")]
                         + [("trainer", o) for o in options("trainer")])
def test_group_options_train(group, option, prepared, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    if (group, option) == ("logger", "wandb") and importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed (the GPU machine's image)")
    extra = ["logger.mode=disabled"] if (group, option) == ("logger", "wandb") else []
    if (group, option) == ("scheduler", "wsd"):
        extra = ["scheduler.decay_steps=2"]    # 3 steps: warmup 1, stable 0, decay 2
    loss = train_in_process(["experiment=smoke", f"{group}={option}", f"data.dir={prepared}",
                             f"run_dir={tmp_path}", *SHRINK, *FAST, *extra])
    assert loss == loss and loss > 0  # finite
    records = [r for r in read_metrics(str(tmp_path)) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    if group == "scheduler":
        lrs = [r["lr"] for r in records]
        assert lrs[0] == lrs[1] or option != "constant"
        assert (lrs[2] < lrs[1]) == (option != "constant")


def test_experiments_train_in_sequence(prepared, tmp_path):
    """Every experiment runs (shrunken, a few steps); phase 2 starts from phase 1's checkpoint."""
    runs = {}
    for name in options("experiment"):
        if name in ("bert_base_phase2", "modern_mini"):   # modern_mini: its own test below
            continue
        run = str(tmp_path / name)
        overrides = [f"experiment={name}", f"data.dir={prepared}", f"run_dir={run}", *SHRINK,
                     *FAST]
        if name in ("demo", "gutenberg_mini", "budget_mini", "gpu_mini"):  # budget: 1 second
            overrides += ["trainer.budget_hours=0.0003", "trainer.max_steps=100000"]
        runs[name] = run
        assert train_in_process(overrides) > 0
    phase1 = glob.glob(os.path.join(runs["bert_base_phase1"], "checkpoints", "step-*"))[0]
    run = str(tmp_path / "phase2")
    assert train_in_process(["experiment=bert_base_phase2", f"data.dir={prepared}",
                             f"run_dir={run}", f"trainer.init_from={phase1}", *SHRINK,
                             *FAST]) > 0
    s = settings(compose(["experiment=bert_base_phase2", f"data.dir={prepared}"]))
    assert s.optim.name == "lamb" and s.trainer.mixed_precision == "bf16"
    assert s.trainer.init_from.startswith("runs/bert_base_phase1/checkpoints/step-")
    p1 = settings(compose(["experiment=bert_base_phase1"]))
    assert p1.data.dir == "prepared/wiki128" and p1.trainer.global_batch_size == 65536
    demo = settings(compose(["experiment=demo"]))
    assert demo.data.dir == "prepared/builtin64" and demo.trainer.budget_hours == 0.05
    assert (demo.name, demo.run_dir) == ("demo", "runs/demo")  # experiments set the run name
    assert settings(compose(["experiment=demo", "name=x"])).run_dir == "runs/x"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["bert_small", "bert_medium", "bert_base", "bert_large"])
def test_large_model_options_take_a_step(model, prepared, tmp_path):
    assert train_in_process([f"model={model}", f"data.dir={prepared}", f"run_dir={tmp_path}",
                             *FAST, "trainer.max_steps=2"]) > 0


def test_recipe_experiment_composes_each_switch(prepared):
    s = settings(compose(["experiment=modern_mini"]))
    assert s.data.dir == "prepared/gutenberg128_full"      # bert-prep packing=full_sentences
    assert (s.data.masking, s.data.masked_lm_prob_start, s.data.masked_lm_prob) == \
        ("dynamic", 0.3, 0.15)
    assert (s.data.batch_warmup_start, s.trainer.micro_batch_size) == (8, 8)
    assert (s.scheduler.name, s.scheduler.decay_shape, s.scheduler.decay_fraction) == \
        ("wsd", "1-sqrt", 0.2)
    budget = settings(compose(["experiment=budget_mini"]))   # the rest is budget_mini's
    assert (s.trainer.budget_hours, s.trainer.attention_locality, s.optim.lr, s.model) == \
        (budget.trainer.budget_hours, budget.trainer.attention_locality, budget.optim.lr,
         budget.model)
    assert s.objective == "eval_mlm_loss"


def test_domain_recipe_model_and_a_users_choice_of_another():
    # The in-domain recipe's model is a config of the model group (2 x 256), not a field set in
    # its body, so that model=<option> on the command line gives that model whole: a body's
    # num_hidden_layers would have cut model=bert_small to 2 layers without a word.
    s = settings(compose(["experiment=domain_mini", "data.dir=x"]))
    m = s.model    # a dict: the model's own fields (BertConfig.from_dict reads it)
    assert (m["num_hidden_layers"], m["hidden_size"], m["num_attention_heads"],
            m["intermediate_size"]) == (2, 256, 4, 1024)
    assert (m["hidden_dropout_prob"], m["attention_probs_dropout_prob"]) == (0.0, 0.0)
    assert (s.trainer.max_steps, s.trainer.budget_hours, s.optim.lr) == (5900, None, 1e-3)
    assert (s.trainer.eval_every, s.trainer.checkpoint_every) == (1000, 1000)
    assert (s.data.masking, s.data.masked_lm_prob_start, s.data.masked_lm_prob) == \
        ("dynamic", None, 0.4)    # 40% throughout, no schedule
    for model, shape in [("bert_mini", (4, 256)), ("bert_small", (4, 512))]:
        m = settings(compose(["experiment=domain_mini", "data.dir=x", f"model={model}"])).model
        assert (m["num_hidden_layers"], m["hidden_size"]) == shape
        assert m["hidden_dropout_prob"] == 0.0     # the recipe's no-dropout still applies


def test_recipe_experiment_trains(prepared, tmp_path):
    assert train_in_process(["experiment=modern_mini", f"data.dir={prepared}",
                             f"run_dir={tmp_path}", *SHRINK, *FAST,
                             "trainer.budget_hours=0.0003", "trainer.max_steps=100000",
                             "data.batch_warmup_start=2", "data.batch_warmup_tokens=256"]) > 0
