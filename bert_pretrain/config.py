"""The typed schema of `conf/train/train.yaml`, assembled from the schemas beside the code they
configure, all in components/ (DataConfig in data.py, OptimConfig/SchedulerConfig in optim.py,
TrainerConfig in trainer_config.py, LoggerConfig in metrics.py; the model's BertConfig/ModelImpl
are checked by the model package).  Registered in Hydra's ConfigStore as `train_schema`, so a
misspelt key in a config file or on the command line fails at composition, and `settings()` turns
the composed tree into validated dataclasses with one-line errors for bad values."""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from .components.data import DataConfig
from .components.data_schedules import check_start
from .errors import ConfigError
from .finetune.downstream import DownstreamConfig
from .components.metrics import LoggerConfig
from .components.optim import OptimConfig, SchedulerConfig
from .components.trainer_config import TrainerConfig


@dataclass
class TrainConfig:
    model: Any = MISSING
    """BertConfig fields (`conf/train/model/`); vocab_size null = from the data's manifest."""
    impl: Any = field(default_factory=dict)
    """ModelImpl speed switches (`conf/train/impl/`)."""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    name: str = "default"
    """Run name: the default run_dir, the wandb run name."""
    seed: int = 1234
    """Seeds model init, data order, dynamic masks and dropout."""
    run_dir: str = "runs/${name}"
    """Checkpoints, metrics.jsonl, logs. Not timestamped, so `resume=auto` finds the run again.
    Under multirun each member uses its Hydra sweep subdirectory instead."""
    resume: str = "never"
    """never: start fresh (refused if run_dir already has checkpoints); auto: continue from the
    newest valid checkpoint in run_dir if any; or a path to a step-XXXXXXXX directory."""
    objective: str = "eval_mlm_loss"
    """The final held-out metric bert-train returns, which a sweeper optimises: one of
    OBJECTIVES (eval_loss = eval_mlm_loss + eval_nsp_loss; set the sweeper's direction to
    maximize for an accuracy or downstream_score)."""
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
    """At the end of the run, fine-tune the final checkpoint on GLUE tasks (downstream.tasks;
    null = off) and log downstream_score, which objective=downstream_score returns."""


OBJECTIVES = ("eval_mlm_loss", "eval_nsp_loss", "eval_loss", "eval_mlm_accuracy",
              "eval_mlm_accuracy_masked", "eval_nsp_accuracy", "eval_nsp_accuracy_balanced",
              "downstream_score")


def register() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


@dataclass
class Settings:
    """The validated run configuration handed to the trainer."""

    model: dict
    impl: dict
    data: DataConfig
    optim: OptimConfig
    scheduler: SchedulerConfig
    trainer: TrainerConfig
    logger: LoggerConfig
    name: str
    seed: int
    run_dir: str
    resume: str
    objective: str = "eval_mlm_loss"
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)


def _typed(cfg: DictConfig, key: str, cls):
    node = cfg[key]
    try:
        if not OmegaConf.is_config(node):
            raise ValueError(f"{key} must be a group of settings")
        merged = OmegaConf.merge(OmegaConf.structured(cls), node)
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as exc:
        name = f"{key}.{exc.key}" if exc.key else key
        hint = " (the output_dir of bert-prep)" if name == "data.dir" else ""
        raise ConfigError(f"{name} is not set; pass {name}=...{hint}") from None
    except OmegaConfBaseException as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"{key}: {first}") from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _finite(prefix: str, values: dict) -> None:
    """inf and nan pass most range checks (inf > 0); no setting means either."""
    import math

    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}.{key} must be a finite number, got {value}")
        if isinstance(value, list):
            _finite(f"{prefix}.{key}", {str(i): v for i, v in enumerate(value)})


def settings(cfg: DictConfig) -> Settings:
    """Validate the composed config; every problem becomes a one-line ConfigError."""
    for key in ("model", "data", "optim", "scheduler", "trainer", "logger"):
        if key not in cfg or cfg[key] is None:
            raise ConfigError(f"config group {key!r} is missing; choose one, e.g. {key}=<option>")
    try:
        model = OmegaConf.to_container(cfg.model, resolve=True)
        impl = OmegaConf.to_container(cfg.impl, resolve=True) if cfg.get("impl") else {}
    except OmegaConfBaseException as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    if cfg.resume not in ("never", "auto") and not str(cfg.resume):
        raise ConfigError("resume must be never, auto or a checkpoint directory")
    objective = str(cfg.get("objective", "eval_mlm_loss"))
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    _finite("model", model)
    for key in ("data", "optim", "scheduler", "trainer", "logger"):
        _finite(key, OmegaConf.to_container(cfg[key], resolve=True))
    downstream = _typed(cfg, "downstream", DownstreamConfig) if cfg.get("downstream") \
        else DownstreamConfig()
    if objective == "downstream_score" and not downstream.enabled:
        raise ConfigError("objective=downstream_score needs downstream.tasks (e.g. "
                          "downstream.tasks=sst2 downstream.data_dir=<GLUE folder>)")
    s = Settings(
        model=model, impl=impl,
        data=_typed(cfg, "data", DataConfig),
        optim=_typed(cfg, "optim", OptimConfig),
        scheduler=_typed(cfg, "scheduler", SchedulerConfig),
        trainer=_typed(cfg, "trainer", TrainerConfig),
        logger=_typed(cfg, "logger", LoggerConfig),
        name=str(cfg.name), seed=int(cfg.seed), run_dir=str(cfg.run_dir),
        resume=str(cfg.resume), objective=objective, downstream=downstream,
    )
    _check_across_groups(s)
    return s


def _check_across_groups(s: Settings) -> None:
    """Settings of one group that only make sense with those of another (each group's own
    schema checks the rest)."""
    sc, tc, data = s.scheduler, s.trainer, s.data
    if sc.name == "wsd" and tc.budget_hours is not None and sc.decay_steps is not None:
        raise ConfigError(f"scheduler.decay_steps={sc.decay_steps} counts steps, but "
                          f"trainer.budget_hours measures the run in time; set "
                          f"scheduler.decay_fraction (the decay's share of the budget) instead")
    if sc.name == "wsd" and tc.budget_hours is None:
        if tc.warmup_steps is None:
            # warmup_ratio x max_steps would move when a decay branch changes max_steps.
            raise ConfigError("scheduler=wsd needs trainer.warmup_steps (a step count, so that a "
                              "decay branched off with another trainer.max_steps warms up the "
                              "same way)")
        decay = sc.decay_steps or max(1, round(sc.decay_fraction * tc.max_steps))
        if tc.warmup_steps + decay > tc.max_steps:
            raise ConfigError(f"scheduler=wsd: warmup ({tc.warmup_steps} steps) and decay "
                              f"({decay}) do not fit in trainer.max_steps={tc.max_steps}; "
                              f"lower scheduler.decay_steps or raise trainer.max_steps")
    check_start(data.batch_warmup_start, tc.global_batch_size)
