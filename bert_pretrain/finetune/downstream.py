"""A pretraining run's downstream score: fine-tune its final checkpoint on GLUE tasks and return
the score, so that a sweep can rank its trials by what the encoder is for rather than by MLM
loss (bert-train's `downstream` settings, `objective=downstream_score`).

    scores = downstream_score(checkpoint, s.downstream, os.path.join(run_dir, "downstream"))
    # {"downstream_score": 0.71, "downstream_sst2": 0.80, "downstream_rte": 0.62}

The fine-tunes run as a separate `bert-glue` process: a pretraining run under accelerate keeps
its process group, its accelerator state (a process-wide singleton) and its optimizer's memory,
none of which a fine-tune should share, and a subprocess started by the main process is one
process whatever the pretraining's world size. Its output (glue.json, glue.md, the per-task
fine-tunes) stays in `out_dir`, so a rerun of the trial skips what finished.  `out_dir` holds the
scores of one checkpoint (by its checksum) and settings (identity.py): a run extended past the
checkpoint it was scored at scores its new end beside them (`<out_dir>-2`), and those stay as they
were.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

from ..errors import TrainingError

# Launcher variables that would make the fine-tuning process join the pretraining's group.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_ERROR_FILE", "ACCELERATE_MIXED_PRECISION")
SCORE = "downstream_score"


@dataclass
class DownstreamConfig:
    """bert-train's `downstream`: score the finished run by fine-tuning it (null tasks: off)."""

    tasks: Any = None
    """null (off), a GLUE task name, fast (SST-2, MRPC, RTE, STS-B, CoLA), all, or a list. The
    score is the task's GLUE score, or the mean over the tasks (WNLI left out)."""
    data_dir: Optional[str] = None
    """A local GLUE copy (GLUE's task folders, or save_to_disk folders); null = the hub."""
    lrs: List[float] = field(default_factory=lambda: [5e-5])
    seeds: List[int] = field(default_factory=lambda: [1])
    """One seed and one rate keep a sweep affordable; the median over more is steadier."""
    epochs: float = 3.0
    max_train_samples: Optional[int] = None
    """Fine-tune on a fixed subset of each task's training set (small budgets)."""
    max_eval_samples: Optional[int] = None
    overrides: List[str] = field(default_factory=list)
    """Further bert-glue settings, e.g. [recipe.max_length=64, trainer.mixed_precision=no]."""

    def __post_init__(self) -> None:
        if self.tasks is None:
            return
        from .tasks import resolve_tasks

        tasks = self.tasks if isinstance(self.tasks, str) else list(self.tasks)
        resolve_tasks(tasks)  # ValueError naming the valid choices
        if not self.lrs or not all(lr > 0 for lr in self.lrs) or not self.seeds:
            raise ValueError("downstream.lrs and downstream.seeds must be non-empty (lrs > 0)")
        if not self.epochs > 0:
            raise ValueError(f"downstream.epochs must be > 0, got {self.epochs}")

    @property
    def enabled(self) -> bool:
        return self.tasks is not None


def glue_command(checkpoint: str, cfg: DownstreamConfig, out_dir: str) -> list:
    """The bert-glue command line that scores `checkpoint`."""
    tasks = cfg.tasks if isinstance(cfg.tasks, str) else "[" + ",".join(cfg.tasks) + "]"
    args = [f"models=[{checkpoint}]", "labels=[model]", f"tasks={tasks}",
            f"out_dir={out_dir}", f"recipe.lrs=[{','.join(repr(float(x)) for x in cfg.lrs)}]",
            f"recipe.seeds=[{','.join(str(int(x)) for x in cfg.seeds)}]",
            f"recipe.epochs={cfg.epochs}", "trainer.progress_bar=false"]
    for key in ("data_dir", "max_train_samples", "max_eval_samples"):
        if getattr(cfg, key) is not None:
            args.append(f"{key}={getattr(cfg, key)}")
    return [sys.executable, "-m", "bert_pretrain.finetune.glue", *args, *cfg.overrides]


def downstream_score(checkpoint: str, cfg: DownstreamConfig, out_dir: str,
                     log: Callable[[str], None] = print) -> dict:
    """Fine-tune `checkpoint` as `cfg` says (in a child process); returns
    {downstream_score: GLUE average (or the one task's score), downstream_<task>: score}.
    Raises TrainingError (one line) when the fine-tuning fails."""
    if not cfg.enabled:
        return {}
    from dataclasses import asdict

    from ..components.checkpoint import read_train_state
    from .identity import claim

    identity = {"checkpoint": read_train_state(checkpoint, verify=False).get("state_sha256"),
                "downstream": asdict(cfg)}
    out_dir = claim(out_dir, identity, "downstream scores",
                    lambda m: log(f"bert-train: downstream: {m}"))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    cmd = glue_command(checkpoint, cfg, out_dir)
    # A glue.json in a folder that holds this identity is this checkpoint's finished scores:
    # bert-glue reads them back instead of fine-tuning again, and the line says which it does.
    if os.path.isfile(os.path.join(out_dir, "glue.json")):
        log(f"bert-train: downstream: reading back the finished fine-tunes of {checkpoint} on "
            f"{cfg.tasks} (in {out_dir})")
    else:
        log(f"bert-train: downstream: fine-tuning {checkpoint} on {cfg.tasks} (output in "
            f"{out_dir})")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise TrainingError(f"the downstream fine-tuning of {checkpoint} failed: "
                            f"{lines[-1] if lines else f'exit status {proc.returncode}'}")
    with open(os.path.join(out_dir, "glue.json"), encoding="utf-8") as f:
        model = json.load(f)["models"][0]
    scores = {f"downstream_{task}": entry["score"] for task, entry in model["tasks"].items()}
    average = model["average"]
    scores[SCORE] = average if average is not None else next(iter(scores.values()))
    log(f"bert-train: downstream: {', '.join(f'{k} {v:.4f}' for k, v in scores.items())}")
    return scores
