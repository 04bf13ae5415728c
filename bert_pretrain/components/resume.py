"""What a resume may change: comparing the run's settings with those the checkpoint was trained
with, and making the optimizer run with the settings of this run (which checkpoint a run resumes
from is the checkpoint manager's business: checkpoint_manager.py).

A resume continues a run; it may also change how the run continues (a longer schedule, another
learning rate). Those changes are legitimate but easy to make by accident, so they are named in
one warning line at start. What makes a checkpoint unusable (model shape, tokenizer) is an error
(checkpoint.check_compatible), and so is a new seed: the seed orders the current epoch, and a new
order mid-epoch repeats some instances and skips others.
"""

import math
import os
from typing import Optional

from ..errors import CheckpointError, ConfigError

# Settings that change the training from the checkpoint on.  Not here: speed-only settings
# (impl.*, optim.fused, data.pad_to_multiple_of, trainer.micro_batch_size: with the global-batch
# loss the micro-batch size changes nothing beyond float rounding, and which dropout masks are
# drawn), and bookkeeping (logging, checkpoint and evaluation intervals, run_dir).
RESULT_KEYS = (
    "optim.", "scheduler.", "data.dir", "data.masking", "data.masked_lm_prob",
    "data.train_split", "trainer.max_steps", "trainer.warmup_steps", "trainer.warmup_ratio",
    "trainer.budget_hours", "trainer.global_batch_size", "trainer.max_grad_norm",
    "trainer.nsp_loss_weight", "trainer.rtd_loss_weight", "trainer.attention_locality",
    "trainer.mixed_precision", "model.", "data.batch_warmup_",
)
SPEED_ONLY = ("optim.fused",)


def saved_config(checkpoint: str) -> Optional[dict]:
    """The resolved config a checkpoint was written with (its config.yaml), or None."""
    from omegaconf import OmegaConf

    from .checkpoint import read_config_yaml

    path = os.path.join(checkpoint, "config.yaml")
    try:
        text = read_config_yaml(checkpoint)
        if text is None:
            return None
        return OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    except CheckpointError:
        raise
    except Exception as exc:  # YAML errors come in several types
        raise CheckpointError(f"cannot read {path} ({str(exc).splitlines()[0]}); the checkpoint "
                              f"is corrupt") from None


def _flatten(tree, prefix: str = "") -> dict:
    out = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
    else:
        out[prefix[:-1]] = tree
    return out


def _schema_defaults() -> dict:
    """Flattened defaults of the settings groups: what a key that an older checkpoint's config
    lacks (it predates the setting) meant then."""
    from dataclasses import asdict, fields

    from .data import DataConfig
    from ..model import BertConfig
    from .optim import OptimConfig, SchedulerConfig
    from .trainer_config import TrainerConfig

    groups = {name: asdict(cls()) for name, cls in (
        ("data", DataConfig), ("optim", OptimConfig), ("scheduler", SchedulerConfig),
        ("trainer", TrainerConfig))}
    groups["model"] = {f.name: f.default for f in fields(BertConfig)}
    return _flatten(groups)


def changed_settings(old: dict, new: dict) -> list:
    """[(key, old value, new value)] for the result-changing settings that differ. A key the old
    config does not have counts as unchanged when the new value is that setting's default."""
    a, b = _flatten(old), _flatten(new)
    defaults = _schema_defaults()
    changes = []
    for key in sorted(set(a) | set(b)):
        if key in SPEED_ONLY or not key.startswith(RESULT_KEYS) or key == "model.vocab_size":
            continue
        if key not in a and key in defaults and b.get(key) == defaults[key]:
            continue
        if a.get(key) != b.get(key):
            changes.append((key, a.get(key), b.get(key)))
    return changes


def check_seed(old: Optional[dict], seed: int, checkpoint: str) -> None:
    if old is not None and "seed" in old and int(old["seed"]) != seed:
        raise ConfigError(
            f"seed={seed} but {checkpoint} was trained with seed={old['seed']}: a new seed "
            f"re-orders the current epoch mid-way (repeating some instances, skipping others); "
            f"resume with seed={old['seed']}, or start a new run from these weights with "
            f"trainer.init_from={checkpoint}"
        )


def warmup_change(old: dict, new: dict) -> Optional[str]:
    """The warmup's change in steps when the settings do not say it themselves: a warmup
    derived from max_steps (trainer.warmup_ratio x max_steps while warmup_steps is null) moves
    with max_steps, e.g. 'warmup 100 -> 46 steps (warmup_ratio 0.1 x max_steps)'; else None."""
    from .trainer_config import TrainerConfig

    try:
        trainers = [TrainerConfig(**{k: v for k, v in c["trainer"].items()
                                     if k in TrainerConfig.__dataclass_fields__})
                    for c in (old, new)]
    except (KeyError, TypeError, ValueError):  # a checkpoint of an older config layout
        return None
    before, after = (t.warmup for t in trainers)
    if before == after or all(t.warmup_steps is not None for t in trainers):
        return None  # (two given warmup_steps: the trainer.warmup_steps change says it)
    derived = trainers[1]
    return f"warmup {before} -> {after} steps" + (
        f" (warmup_ratio {derived.warmup_ratio:g} x max_steps)" if derived.warmup_steps is None
        else "")


def describe(changes: list, moves: list, warmup: Optional[str] = None) -> str:
    """The changed settings, what they derive (`warmup`: warmup_change), then what they move at
    the resume step: (name, step, old, new)."""
    parts = [f"{key} {old!r} -> {new!r}" for key, old, new in changes]
    parts += [warmup] if warmup else []
    parts += [f"{name} at step {step}: {before:.3g} -> {after:.3g}"
              for name, step, before, after in moves]
    return "; ".join(parts)


def apply_hyperparameters(optimizer, fresh_groups: list) -> None:
    """After `optimizer.load_state_dict`: put back this run's hyperparameters (betas, eps,
    weight decay...), which torch restores from the checkpoint. The moments and step counts stay
    the checkpoint's; what runs is what this run's config.yaml says."""
    for group, fresh in zip(optimizer.param_groups, fresh_groups):
        for key, value in fresh.items():
            if key not in ("params", "lr", "initial_lr"):
                group[key] = value


def lr_change_at(old: dict, step: int, new_lr: Optional[float]) -> Optional[tuple]:
    """(step, old lr, new lr) at the resume step when the lr moves (new_lr None: budget mode,
    where the schedule follows time and no step's lr is known in advance)."""
    from .optim import Schedule, SchedulerConfig
    from .trainer_config import TrainerConfig

    if new_lr is None:
        return None
    try:
        old_trainer = TrainerConfig(**{k: v for k, v in old["trainer"].items()
                                       if k in TrainerConfig.__dataclass_fields__})
        old_schedule = Schedule(SchedulerConfig(**old["scheduler"]), old_trainer.max_steps,
                                old_trainer.warmup)
        before = float(old["optim"]["lr"]) * old_schedule.factor(step)
    except (KeyError, TypeError, ValueError):  # a checkpoint of an older config layout
        return None
    return None if math.isclose(before, new_lr, rel_tol=1e-12) else (step, before, new_lr)


def progress_moves_at(old: dict, new: dict, step: int, prep_masking_rate: Optional[float]
                      ) -> list:
    """What follows the share of training done (step / max_steps) and moves at the resume step
    when max_steps changes: the scheduled masking rate and the attention locality's strength,
    as (name, step, old value, new value).  So a decay branched off a warmup-stable-decay run
    with another max_steps cannot equal a run planned that way when either is on (the history
    up to the branch used the long run's values); the warning says what jumps.  Budget mode
    (progress follows time) and an older config layout: nothing."""
    from .data import DataConfig
    from .trainer_config import TrainerConfig

    def typed(cls, section):
        return cls(**{k: v for k, v in section.items() if k in cls.__dataclass_fields__})

    moves = []
    try:
        trainers = [typed(TrainerConfig, c["trainer"]) for c in (old, new)]
        if any(t.budget_hours is not None for t in trainers):
            return []
        data = [typed(DataConfig, c["data"]) for c in (old, new)]
        if prep_masking_rate is not None and all(d.masking == "dynamic" for d in data):
            rates = [d.masking_rate(prep_masking_rate, t.progress(step, 0.0))
                     for d, t in zip(data, trainers)]
            moves.append(("masking rate", step, *rates))
        strengths = [t.locality_strength(step, 0.0) * t.attention_locality for t in trainers]
        moves.append(("attention locality", step, *strengths))
    except (KeyError, TypeError, ValueError):  # a checkpoint of an older config layout
        return []
    return [m for m in moves if not math.isclose(m[2], m[3], rel_tol=1e-12, abs_tol=1e-12)]


def changed_settings_warning(checkpoint: str, saved: Optional[dict], resolved: dict, step: int,
                             new_lr: Optional[float],
                             prep_masking_rate: Optional[float] = None) -> Optional[str]:
    """The one warning line of a resume with changed settings, or None when nothing changed.
    `prep_masking_rate`: bert-prep's masking rate (what a dynamic schedule ends at by default),
    to name a scheduled masking rate's move."""
    from .redact import redact

    if saved is None:
        return None
    # (the saved config.yaml is redacted: compare like with like, print no secret)
    changes = changed_settings(saved, redact(resolved))
    if not changes:
        return None
    lr = lr_change_at(saved, step, new_lr)
    moves = ([("learning rate", *lr)] if lr else []) + \
        progress_moves_at(saved, resolved, step, prep_masking_rate)
    return (f"bert-train: warning: resuming {checkpoint} with changed settings (they apply from "
            f"step {step} on): {describe(changes, moves, warmup_change(saved, resolved))}")
