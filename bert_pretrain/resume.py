"""What a resume may change: finding the checkpoint, comparing the run's settings with those the
checkpoint was trained with, and making the optimizer run with the settings of this run.

A resume continues a run; it may also change how the run continues (a longer schedule, another
learning rate). Those changes are legitimate but easy to make by accident, so they are named in
one warning line at start. What makes a checkpoint unusable (model shape, tokenizer) is an error
(checkpoint.check_compatible), and so is a new seed: the seed orders the current epoch, and a new
order mid-epoch repeats some instances and skips others.
"""

import os
from typing import Optional

from .errors import CheckpointError, ConfigError

# Settings that change the training from the checkpoint on.  Not here: speed-only settings
# (impl.*, optim.fused, data.pad_to_multiple_of, trainer.micro_batch_size: with the global-batch
# loss the micro-batch size changes nothing beyond float rounding), and bookkeeping (logging,
# checkpoint and evaluation intervals, run_dir).
RESULT_KEYS = (
    "optim.", "scheduler.", "data.dir", "data.masking", "data.masked_lm_prob",
    "data.train_split", "trainer.max_steps", "trainer.warmup_steps", "trainer.warmup_ratio",
    "trainer.budget_hours", "trainer.global_batch_size", "trainer.max_grad_norm",
    "trainer.nsp_loss_weight", "trainer.attention_locality",
    "trainer.mixed_precision", "model.",
)
SPEED_ONLY = ("optim.fused",)


def find_resume(resume: str, run_dir: str, warn=None) -> Optional[str]:
    """The checkpoint to resume from, or None for a fresh run. Its files are verified against
    their recorded sha256: resume=auto skips corrupt ones (`warn` names each), an explicit path
    that does not verify is an error."""
    from .checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint

    if resume == "never":
        if list_checkpoints(run_dir):
            raise ConfigError(
                f"{run_dir} already has checkpoints; continue it with resume=auto, or choose "
                f"another run_dir (or name=...) for a fresh run"
            )
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir, warn=warn)
    if not os.path.isdir(resume):
        raise CheckpointError(f"resume={resume}: no such checkpoint directory; use resume=auto "
                              f"or a <run_dir>/checkpoints/step-XXXXXXXX path")
    verify_checkpoint(resume)
    return resume


def saved_config(checkpoint: str) -> Optional[dict]:
    """The resolved config a checkpoint was written with (its config.yaml), or None."""
    from omegaconf import OmegaConf

    path = os.path.join(checkpoint, "config.yaml")
    if not os.path.isfile(path):
        return None
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
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


def changed_settings(old: dict, new: dict) -> list:
    """[(key, old value, new value)] for the result-changing settings that differ."""
    a, b = _flatten(old), _flatten(new)
    changes = []
    for key in sorted(set(a) | set(b)):
        if key in SPEED_ONLY or not key.startswith(RESULT_KEYS) or key == "model.vocab_size":
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


def describe(changes: list, lr_change: Optional[tuple]) -> str:
    parts = [f"{key} {old!r} -> {new!r}" for key, old, new in changes]
    if lr_change is not None:
        step, before, after = lr_change
        parts.append(f"learning rate at step {step}: {before:.3g} -> {after:.3g}")
    return "; ".join(parts)


def apply_hyperparameters(optimizer, fresh_groups: list) -> None:
    """After `optimizer.load_state_dict`: put back this run's hyperparameters (betas, eps,
    weight decay...), which torch restores from the checkpoint. The moments and step counts stay
    the checkpoint's; what runs is what this run's config.yaml says."""
    for group, fresh in zip(optimizer.param_groups, fresh_groups):
        for key, value in fresh.items():
            if key not in ("params", "lr", "initial_lr"):
                group[key] = value
