"""Where metrics go: `<run_dir>/metrics.jsonl` (always), Weights & Biases (logger=wandb), and the
progress bar.  Only the main process creates a `Metrics` that writes; the others get a no-op."""

import json
import os
import uuid
from dataclasses import dataclass, field
from typing import List, Optional

from ..errors import ConfigError
from .redact import redact

LOGGERS = ("none", "wandb")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class LoggerConfig:
    """`conf/train/logger/`: none (metrics.jsonl and the progress bar only) or wandb."""

    name: str = "none"
    project: str = "bert-pretrain"
    entity: Optional[str] = None
    mode: str = "online"
    """online, offline (no network: sync later with `wandb sync <run_dir>/wandb/...`), disabled."""
    run_name: Optional[str] = None
    """null = the run's `name`."""
    group: Optional[str] = None
    """e.g. one group per sweep, so its members are plotted together."""
    tags: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.name not in LOGGERS:
            raise ValueError(f"logger.name must be one of {', '.join(LOGGERS)}, got {self.name!r}")
        if self.mode not in WANDB_MODES:
            raise ValueError(f"logger.mode must be one of {', '.join(WANDB_MODES)}, got "
                             f"{self.mode!r}")


def truncate_jsonl(path: str, max_step: int) -> None:
    """On resume: drop records logged after the checkpoint (they will be logged again). Written
    to a temporary file and renamed over the log, so a crash here leaves the old log or the new
    one, never a half-written one."""
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f if ln.strip()]
    kept = []
    for ln in lines:
        try:
            if json.loads(ln).get("step", 0) <= max_step:
                kept.append(ln if ln.endswith("\n") else ln + "\n")
        except ValueError:  # a line cut short by a crash
            continue
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class LogWindow:
    """The sums behind the next metrics.jsonl training record: the steps since the last one.

    Saved in every checkpoint, so that a run resumed in the middle of a logging window logs the
    same averages as an uninterrupted one (only the timing fields differ). `seconds` counts
    training steps only, so tokens/s is not diluted by evaluation and checkpoint time."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.loss = self.mlm_loss = self.nsp_loss = 0.0
        self.updated_steps, self.tokens, self.seconds = 0, 0, 0.0

    def add(self, loss: float, mlm_loss: float, nsp_loss: float, updated: bool, tokens: int,
            seconds: float) -> None:
        if updated:  # a skipped step's non-finite loss would poison the average
            self.loss += loss
            self.mlm_loss += mlm_loss
            self.nsp_loss += nsp_loss
            self.updated_steps += 1
        self.tokens += tokens
        self.seconds += seconds

    def averages(self) -> dict:
        """loss, mlm_loss, nsp_loss (None when every step of the window was skipped) and
        tokens_per_s over the window's training time."""
        n = self.updated_steps
        out = {k: (getattr(self, k) / n if n else None) for k in ("loss", "mlm_loss", "nsp_loss")}
        out["tokens_per_s"] = self.tokens / max(self.seconds, 1e-9)
        return out

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("loss", "mlm_loss", "nsp_loss", "updated_steps",
                                              "tokens", "seconds")}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def eval_record_at(run_dir: str, step: int) -> Optional[dict]:
    """The evaluation already logged at `step` (resuming a run whose last checkpoint was
    evaluated: no need to evaluate, and log, the same weights again)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    found = None
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("step") == step and "eval_mlm_loss" in record:
                    found = {k: v for k, v in record.items() if k.startswith("eval_")}
    return found


def _wandb_problem(exc: Exception, mode: str) -> str:
    """One line for a failed wandb.init: most often no login on this machine."""
    text = redact(" ".join(str(exc).split()))  # (wandb's messages span lines)
    if "API key" in text or "login" in text.lower() or type(exc).__name__ == "AuthenticationError":
        return (f"logger=wandb (mode={mode}) needs a Weights & Biases login and found none "
                f"({text}); run `wandb login`, or set WANDB_API_KEY, or use "
                f"logger.mode=offline (upload later with `wandb sync`) or logger=none")
    return (f"wandb could not start ({text[:300]}); check the logger.* settings and the "
            f"WANDB_* environment variables, or use logger.mode=offline or logger=none")


class Metrics:
    """metrics.jsonl + optional wandb, on the main process."""

    def __init__(self, cfg: LoggerConfig, run_dir: str, run_name: str, resolved_config: dict,
                 resume_step: Optional[int]):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        os.makedirs(run_dir, exist_ok=True)
        if resume_step is None:
            open(self.path, "w").close()
        else:
            truncate_jsonl(self.path, resume_step)
        self.file = open(self.path, "a", encoding="utf-8")
        self.wandb = None
        self.wandb_dir = None
        if cfg.name == "wandb":
            try:
                import wandb  # imported only when asked for: it is slow to import
            except ImportError:
                self.file.close()
                raise ConfigError("logger=wandb needs the wandb package: pip install wandb, or "
                                  "use logger=none") from None

            id_file = os.path.join(run_dir, "wandb_run_id")
            if os.path.isfile(id_file):
                run_id = open(id_file).read().strip()
            else:
                run_id = uuid.uuid4().hex[:12]  # stable across resumes of this run_dir
                with open(id_file, "w") as f:
                    f.write(run_id)
            # wandb keeps its own copy of everything passed here: no secrets in it (redact).
            try:
                self.wandb = wandb.init(
                    project=redact(cfg.project), entity=redact(cfg.entity),
                    name=redact(cfg.run_name or run_name), group=redact(cfg.group),
                    tags=redact(list(cfg.tags)), config=redact(resolved_config), mode=cfg.mode,
                    dir=run_dir, id=run_id, resume="allow",
                )
            except (wandb.errors.Error, ValueError) as exc:
                self.file.close()
                raise ConfigError(_wandb_problem(exc, cfg.mode)) from None
            self.wandb_dir = getattr(self.wandb, "dir", None)

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"},
                           step=record["step"])

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


class NullMetrics:
    """Non-main processes: log nothing."""

    path = None
    wandb_dir = None

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass
