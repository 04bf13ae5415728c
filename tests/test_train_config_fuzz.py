"""Config fuzz for bert-train: every numeric field of the training schema and of the model, given
wrong types and out-of-range values, either is a valid setting or stops with one ConfigError line
(which the entry point prints as `bert-train: error: ...`, exit 2); never another exception."""
import dataclasses
import math

import pytest

from bert_pretrain.config import settings
from bert_pretrain.components.data import DataConfig
from bert_pretrain.errors import ConfigError
from bert_pretrain.components.metrics import LoggerConfig
from bert_pretrain.model import BertConfig
from bert_pretrain.components.optim import OptimConfig, SchedulerConfig
from bert_pretrain.trainer import TrainerConfig
from train_support import compose, run_bert_train, write_prepared

BAD = ["abc", "-1", "0", "1.5", "1e400", "-1e400", "nan", "true", "[1]", "{a:1}", "null",
       "100000000000000000000000"]
GROUPS = {"trainer": TrainerConfig, "optim": OptimConfig, "scheduler": SchedulerConfig,
          "data": DataConfig, "logger": LoggerConfig}


def numeric_fields():
    out = []
    for group, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            if "int" in str(f.type) or "float" in str(f.type):
                out.append(f"{group}.{f.name}")
    for f in dataclasses.fields(BertConfig):
        if "int" in str(f.type) or "float" in str(f.type):
            out.append(f"model.{f.name}")
    return out


FIELDS = numeric_fields()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=16, num_valid=4)


def check(overrides):
    """What the trainer checks before it builds anything: the schema, then the model config."""
    try:
        cfg = compose(overrides)
    except Exception as exc:  # composition errors: the entry point's precheck makes them 1 line
        return type(exc).__name__
    s = settings(cfg)
    values = {**s.model, "vocab_size": s.model.get("vocab_size") or 64,
              "pad_token_id": s.model.get("pad_token_id") or 0}
    try:
        config = BertConfig.from_dict(values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return config


def test_the_fuzz_covers_every_group():
    assert len(FIELDS) >= 30
    assert {f.split(".")[0] for f in FIELDS} == {"trainer", "optim", "scheduler", "data", "model"}


@pytest.mark.parametrize("field", FIELDS)
def test_bad_values_are_one_config_error_line(field, synthetic):
    for value in BAD:
        overrides = ["experiment=smoke", f"data.dir={synthetic}", f"{field}={value}"]
        try:
            result = check(overrides)
        except ConfigError as exc:
            message = str(exc)
            assert message and "\n" not in message, (field, value, message)
            continue
        if isinstance(result, str):  # a Hydra composition error: the CLI precheck's business
            continue
        # Accepted: then it must be a usable value, not inf/nan smuggled through.
        s = settings(compose(overrides))
        group, key = field.split(".")
        got = s.model.get(key) if group == "model" else getattr(getattr(s, group), key)
        if isinstance(got, float):
            assert math.isfinite(got), (field, value, got)


@pytest.mark.parametrize("override,message", [
    ("optim.lr=nan", "optim.lr"),
    ("trainer.max_steps=abc", "max_steps"),
    ("model.hidden_dropout_prob=1.5", "model.hidden_dropout_prob"),
    ("trainer.warmup_ratio=-1", "trainer.warmup_ratio"),
])
def test_through_the_command_line(override, message, synthetic, tmp_path):
    r = run_bert_train(["experiment=smoke", f"data.dir={synthetic}",
                        f"run_dir={tmp_path / 'r'}", override], cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bert-train: error: ") and message in lines[0]
    assert not (tmp_path / "r").exists()
