"""The typed schemas of `conf/finetune/finetune.yaml` (bert-finetune) and `conf/finetune/glue.yaml`
(bert-glue), registered in Hydra's ConfigStore, and their validation into dataclasses with
one-line errors.

What changes results (the task, the recipe) is kept apart from what only changes speed or
bookkeeping (`trainer`, `impl`), as in bert-train.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from ..errors import ConfigError
from ..components.trainer_config import MIXED_PRECISION
from .tasks import CUSTOM, SUBSET_KEYS, TaskConfig, resolve_tasks

INITS = ("pretrained", "random")
SAVE_MODEL = ("best", "all", "none")


@dataclass
class RecipeConfig:
    """`conf/finetune/recipe/`: the fine-tuning hyperparameters (they change results). The
    default is the BERT paper's (Devlin et al. 2019, section 4.1 and appendix A.3)."""

    lrs: List[float] = field(default_factory=lambda: [2e-5, 3e-5, 5e-5])
    """Peak learning rates: every one is fine-tuned, the best (by the median over seeds of the
    task's score on its dev set, as the paper chose) is reported."""
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])
    """Each seed is a separate fine-tune (head init, data order, dropout); results are medians
    over seeds, as Cramming and MosaicBERT report (small tasks vary by points between seeds)."""
    batch_size: int = 32
    """Examples per optimizer step over all processes."""
    epochs: float = 3.0
    warmup_ratio: float = 0.1
    """Linear warmup over this share of the steps, then linear decay to 0."""
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-6
    max_grad_norm: Optional[float] = 1.0
    layer_lr_decay: float = 1.0
    """Layer-wise learning-rate decay: the classifier and pooler take the rate, encoder layer
    i of L takes rate x decay^(L - i), the embeddings rate x decay^(L + 1); 1 = one rate for
    all (the BERT paper). Below 1 the pretrained lower layers move less than the fresh head:
    with 1,000 SST-2 labels 0.7 gave an in-domain BERT-mini +1.2 points and random init -1.6
    (docs/finetuning-results.md, "Layer-wise rate decay")."""
    reinit_layers: int = 0
    """Re-initialise the top N encoder layers (and the pooler) before fine-tuning, as Zhang et
    al. 2021 do for small labelled sets; 0 = keep every pretrained layer (the BERT paper)."""
    max_length: int = 128
    """Tokens per example, [CLS] and [SEP]s included (pairs: the longer text is cut first)."""
    dropout: Optional[float] = 0.1
    """Dropout of the encoder (hidden and attention probabilities) and before the classifier;
    null = the pretrained model's own (budget recipes pretrain without dropout)."""
    pooling: str = "cls"
    """What the classifier reads: cls (the pooled [CLS] vector, transformers'
    BertForSequenceClassification) or mean (the last layer's states averaged over the real
    tokens, no pooler: states an MLM-only encoder did train, unlike its [CLS] output; its
    model does not load in transformers). On SST-2 mean was no better than cls, even for an
    MLM-only model (docs/finetuning-results.md, "In-domain pretraining")."""

    def __post_init__(self) -> None:
        if not self.lrs or not all(lr > 0 for lr in self.lrs):
            raise ValueError(f"recipe.lrs must be a non-empty list of rates > 0, got "
                             f"{list(self.lrs)}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"recipe.seeds must be a non-empty list of distinct integers, got "
                             f"{list(self.seeds)}")
        for name in ("batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"recipe.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_length < 4:
            raise ValueError(f"recipe.max_length must be >= 4 ([CLS] a [SEP] b [SEP]), got "
                             f"{self.max_length}")
        if not self.epochs > 0:
            raise ValueError(f"recipe.epochs must be > 0, got {self.epochs}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"recipe.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"recipe.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError("recipe.eps must be > 0 and recipe.weight_decay >= 0")
        if not 0.0 < self.layer_lr_decay <= 1.0:
            raise ValueError(f"recipe.layer_lr_decay must be in (0, 1] (1 = one rate for every "
                             f"layer), got {self.layer_lr_decay}")
        if self.reinit_layers < 0:
            raise ValueError(f"recipe.reinit_layers must be >= 0, got {self.reinit_layers}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError("recipe.max_grad_norm must be > 0 or null")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"recipe.dropout must be in [0, 1) or null, got {self.dropout}")
        from ..model.classifier import POOLINGS  # (torch: only once a recipe is checked)

        if self.pooling not in POOLINGS:
            raise ValueError(f"recipe.pooling must be one of {', '.join(POOLINGS)}, got "
                             f"{self.pooling!r}")


@dataclass
class FinetuneTrainerConfig:
    """`trainer`: how the fine-tunes run: speed and bookkeeping, not part of what a results
    folder is of (identity.py), but for the precision mixed_precision resolves to (bf16 or fp16
    round differently from fp32, as in bert-train), which is. With dropout, micro_batch_size
    changes results too (masks are drawn per micro-batch) and is not part of it."""

    micro_batch_size: Optional[int] = None
    """Examples per forward/backward on one process; null = batch_size / processes."""
    mixed_precision: str = "auto"
    """As bert-train: auto = bf16 autocast where the CPU/GPU has bf16 matrix units, else fp32;
    no, bf16, fp16."""
    eval_batch_size: int = 128
    log_every: int = 50
    checkpoint_every: int = 500
    """Save each fine-tune every N steps, so an interrupted one resumes (from the newest)."""
    keep_last_k: int = 1
    progress_bar: bool = True
    cpu: bool = False
    """Fine-tune on CPU even when a GPU is present."""
    save_model: str = "best"
    """best: keep the fine-tuned model of the best learning rate's median seed (a
    transformers BertForSequenceClassification directory); all: every run's; none."""
    defer_reads: bool = True
    """As bert-train's: read each step's loss, gradient norm and skip decision at the next
    log, checkpoint or end, not every step, where the fine-tune allows it (one process, torch's
    fused AdamW, no fp16 loss scaler); the same numbers and weights either way."""
    process_group_timeout_s: float = 1800.0
    """Launched as several processes: how long one waits for the others to start, and at a
    collective for one that hung, before it stops in one line (as bert-train's)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError("trainer.micro_batch_size must be >= 1 or null")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"trainer.mixed_precision must be one of "
                             f"{', '.join(MIXED_PRECISION)}, got {self.mixed_precision!r}")
        for name in ("eval_batch_size", "log_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.keep_last_k < 1:
            raise ValueError(f"trainer.keep_last_k must be >= 1, got {self.keep_last_k}")
        if not self.process_group_timeout_s > 0:
            raise ValueError(f"trainer.process_group_timeout_s must be > 0, got "
                             f"{self.process_group_timeout_s}")
        if self.save_model not in SAVE_MODEL:
            raise ValueError(f"trainer.save_model must be one of {', '.join(SAVE_MODEL)}, got "
                             f"{self.save_model!r}")


@dataclass
class FinetuneConfig:
    """conf/finetune/finetune.yaml (bert-finetune)."""

    task: TaskConfig = field(default_factory=TaskConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    trainer: FinetuneTrainerConfig = field(default_factory=FinetuneTrainerConfig)
    impl: Any = field(default_factory=dict)
    """ModelImpl speed switches, as bert-train's impl group (unpad, varlen_attention, ...)."""
    data_dir: Optional[str] = None
    """A GLUE task's local copy: a GLUE folder (SST-2/, ... as GLUE's download script writes
    them, or save_to_disk folders named by task), as bert-glue's data_dir, or the task's own
    folder; null = the Hugging Face hub."""
    max_train_samples: Optional[int] = None
    """Fine-tune on a fixed random subset of this many training examples (the same for every
    seed, learning rate and model), as bert-glue's max_train_samples; null = all."""
    max_eval_samples: Optional[int] = None
    """Score on the first N examples of each evaluation split; null = all."""
    model: str = MISSING
    """A bert-train run directory (its newest valid checkpoint), a checkpoint, a bert-export
    directory or any transformers BERT directory."""
    init: str = "pretrained"
    """pretrained: the model's weights; random: the same architecture and tokenizer from a
    fresh initialisation (the control every pretraining claim needs)."""
    out_dir: str = "finetune/${task.name}"
    """One folder per (lr, seed) run, finetune.json, the kept model. Not timestamped: running
    the same command again skips finished runs and resumes an interrupted one."""


@dataclass
class GlueConfig:
    """conf/finetune/glue.yaml (bert-glue): several tasks, several models, one table."""

    models: List[str] = MISSING
    """Pretrained models (anything bert-finetune's `model` accepts), compared side by side."""
    labels: Optional[List[str]] = None
    """Their names in the table and picture; null = the directory names."""
    tasks: Any = "all"
    """all (the nine GLUE tasks), fast (SST-2, MRPC, RTE, STS-B, CoLA) or a list of names."""
    data_dir: Optional[str] = None
    """A local GLUE copy: a folder with GLUE's task folders (CoLA/, SST-2/, ... as GLUE's
    download script writes them) or save_to_disk folders named by task; null = the hub."""
    controls: bool = False
    """Also fine-tune each model from random initialisation (same architecture, tokenizer)."""
    max_train_samples: Optional[int] = None
    """Per task, as bert-finetune's max_train_samples (a fixed subset; null = all)."""
    max_eval_samples: Optional[int] = None
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    trainer: FinetuneTrainerConfig = field(default_factory=FinetuneTrainerConfig)
    impl: Any = field(default_factory=dict)
    out_dir: str = "glue"
    """<out_dir>/<model label>/<task>/ (a bert-finetune out_dir each), glue.json, glue.md,
    glue.png."""


def register() -> None:
    store = ConfigStore.instance()
    store.store(name="finetune_schema", node=FinetuneConfig)
    store.store(name="glue_schema", node=GlueConfig)


def typed(cfg: DictConfig, key: str, cls):
    """Validate the sub-tree `key` into `cls` (its __post_init__ checks); one-line ConfigError."""
    node = cfg[key]
    try:
        if not OmegaConf.is_config(node):
            raise ValueError(f"{key} must be a group of settings")
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), node))
    except MissingMandatoryValue as exc:
        name = f"{key}.{exc.key}" if exc.key else key
        raise ConfigError(f"{name} is not set; pass {name}=...") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{key}: {str(exc).splitlines()[0]}") from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _finite(prefix: str, values) -> None:
    if isinstance(values, float) and not math.isfinite(values):
        raise ConfigError(f"{prefix} must be a finite number, got {values}")
    if isinstance(values, dict):
        for k, v in values.items():
            _finite(f"{prefix}.{k}", v)
    if isinstance(values, list):
        for i, v in enumerate(values):
            _finite(f"{prefix}[{i}]", v)


def _impl(cfg: DictConfig) -> dict:
    from ..model import ModelImpl

    impl = OmegaConf.to_container(cfg.impl, resolve=True) if cfg.get("impl") else {}
    try:
        ModelImpl.from_dict(impl)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return impl


def _required(cfg: DictConfig, key: str, hint: str) -> str:
    try:
        value = cfg[key]
    except MissingMandatoryValue:
        value = None
    if value is None or value == MISSING:
        raise ConfigError(f"{key} is not set; pass {key}={hint}")
    return value


@dataclass
class FinetuneSettings:
    task: TaskConfig
    recipe: RecipeConfig
    trainer: FinetuneTrainerConfig
    impl: dict
    model: str
    init: str
    out_dir: str


def _subset(cfg: DictConfig) -> dict:
    """The top-level data_dir, max_train_samples and max_eval_samples (bert-finetune and
    bert-glue spell them alike), checked."""
    import os

    for key in ("max_train_samples", "max_eval_samples"):
        if cfg[key] is not None and cfg[key] < 1:
            raise ConfigError(f"{key} must be >= 1 or null, got {cfg[key]}")
    data_dir = cfg.data_dir
    if data_dir is not None and not os.path.isdir(str(data_dir)):
        raise ConfigError(f"data_dir {data_dir}: no such directory (a GLUE folder with CoLA/, "
                          f"SST-2/, ...; null = the hub)")
    return {"data_dir": None if data_dir is None else str(data_dir),
            "max_train_samples": cfg.max_train_samples,
            "max_eval_samples": cfg.max_eval_samples}


def check_spellings(cfg: DictConfig) -> None:
    """Refuse bert-finetune's old spellings of the subset keys (task.data_dir, ... before
    bert-finetune and bert-glue shared one), which compose but are not read: a ConfigError
    naming the key to use.  Needs only the composed config (the README check calls it too)."""
    for key in SUBSET_KEYS:
        if cfg.task.get(key) is not None:
            raise ConfigError(f"task.{key} is now {key}, as in bert-glue: pass "
                              f"{key}={cfg.task[key]}")


def finetune_settings(cfg: DictConfig) -> FinetuneSettings:
    """Validate bert-finetune's composed config; every problem is a one-line ConfigError."""
    model = str(_required(cfg, "model", "<run dir | checkpoint | bert-export or transformers "
                                        "BERT directory>"))
    _finite("config", OmegaConf.to_container(cfg, resolve=True))
    if cfg.init not in INITS:
        raise ConfigError(f"init must be one of {', '.join(INITS)}, got {cfg.init!r}")
    check_spellings(cfg)
    subset = _subset(cfg)
    task = typed(cfg, "task", TaskConfig)
    if task.name == CUSTOM and subset["data_dir"] is not None:
        raise ConfigError("data_dir is where GLUE tasks are read from; task=custom reads "
                          "task.train_file and task.validation_file")
    return FinetuneSettings(dataclasses.replace(task, **subset),
                            typed(cfg, "recipe", RecipeConfig),
                            typed(cfg, "trainer", FinetuneTrainerConfig), _impl(cfg), model,
                            str(cfg.init), str(cfg.out_dir))


@dataclass
class GlueSettings:
    models: list
    labels: list
    tasks: list
    data_dir: Optional[str]
    controls: bool
    max_train_samples: Optional[int]
    max_eval_samples: Optional[int]
    recipe: RecipeConfig
    trainer: FinetuneTrainerConfig
    impl: dict
    out_dir: str


def glue_settings(cfg: DictConfig) -> GlueSettings:
    """Validate bert-glue's composed config (one-line ConfigErrors)."""
    models = list(_required(cfg, "models", "[<model>, ...]"))
    _finite("config", OmegaConf.to_container(cfg, resolve=True))
    if not models:
        raise ConfigError("models is empty; pass models=[<model>, ...]")
    tasks = cfg.tasks
    try:
        tasks = resolve_tasks(tasks if isinstance(tasks, str) else list(tasks))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    labels = list(cfg.labels) if cfg.labels is not None else \
        [_label_of(str(m)) for m in models]
    if len(labels) != len(models):
        raise ConfigError(f"labels has {len(labels)} names for {len(models)} models")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"two models have the same label ({labels}); pass labels=[...]")
    subset = _subset(cfg)
    return GlueSettings([str(m) for m in models], [str(x) for x in labels], tasks,
                        subset["data_dir"], bool(cfg.controls),
                        subset["max_train_samples"], subset["max_eval_samples"],
                        typed(cfg, "recipe", RecipeConfig),
                        typed(cfg, "trainer", FinetuneTrainerConfig), _impl(cfg),
                        str(cfg.out_dir))


def _label_of(path: str) -> str:
    """runs/demo -> demo; runs/demo/checkpoints/step-00000400 -> demo@400."""
    import os
    import re

    parts = os.path.normpath(path).split(os.sep)
    m = re.fullmatch(r"step-(\d+)", parts[-1])
    if m and len(parts) >= 3 and parts[-2] == "checkpoints":
        return f"{parts[-3]}@{int(m.group(1))}"
    return parts[-1]
