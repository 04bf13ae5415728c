"""Optimizers (AdamW, LAMB) with BERT's parameter groups, and learning-rate schedules that follow
either the step count or elapsed wall-clock time (a training budget, as in Cramming)."""

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch

SCHEDULES = ("linear", "polynomial", "cosine", "constant", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


@dataclass
class OptimConfig:
    """`conf/train/optim/`: the optimizer and its hyperparameters (they change results)."""

    name: str = "adamw"
    """adamw (torch.optim.AdamW) or lamb (layer-wise adaptive moments, You et al. 2019)."""
    lr: float = 1e-4
    """Peak learning rate (reached at the end of warmup)."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-6
    weight_decay: float = 0.01
    """Decoupled weight decay; never applied to biases and LayerNorm weights (as BERT)."""
    fused: Optional[bool] = None
    """AdamW only, speed only: torch's fused kernel; null = use it where torch has it."""

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "lamb"):
            raise ValueError(f"optim.name must be adamw or lamb, got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError("optim.eps must be > 0 and optim.weight_decay >= 0")


@dataclass
class SchedulerConfig:
    """`conf/train/scheduler/`: the shape of the learning-rate curve after warmup.

    The length of training (trainer.max_steps, trainer.budget_hours) and of warmup
    (trainer.warmup_steps) belong to the trainer; the scheduler is only the shape.
    """

    name: str = "linear"
    """linear: decay linearly to end_lr_ratio; polynomial: (1 - progress) ** power (NVIDIA's
    BERT recipe uses power 0.5); cosine: half a cosine wave down to end_lr_ratio; constant:
    flat after warmup; wsd: warmup-stable-decay (ModernBERT, NeoBERT): flat at the peak, then a
    decay of decay_shape over the last decay_steps steps (or decay_fraction of training)."""
    power: float = 1.0
    end_lr_ratio: float = 0.0
    """The learning rate at the end of training, as a fraction of optim.lr."""
    hold_fraction: float = 0.0
    """Stay at the peak for this fraction of the time after warmup, then decay over the rest
    (0: decay from the peak, as BERT; 0.8: a trapezoid / warmup-stable-decay schedule)."""
    decay_from: str = "warmup_end"
    """Where the decay's progress counts from. warmup_end: 0 at the end of warmup, so the decay
    starts at the peak (Google's BERT, transformers); start: step / max_steps over all steps, as
    NVIDIA's PolyWarmUpScheduler, so right after warmup the rate is already
    (1 - warmup / max_steps) ** power of the peak (0.846x for 2,000 of 7,038 steps)."""
    decay_steps: Optional[int] = None
    """wsd: the decay occupies the last decay_steps steps of trainer.max_steps. Counted from the
    end, so decaying a run from any checkpoint S of its stable phase is resuming that checkpoint
    into a new run_dir with trainer.max_steps=S+decay_steps (docs/recipes.md, "Warmup-stable-decay").
    null: decay_fraction of the steps (and, with trainer.budget_hours, of the time)."""
    decay_fraction: float = 0.2
    """wsd without decay_steps: the decay's share of training, at the end."""
    decay_shape: str = "1-sqrt"
    """wsd: linear, cosine (half a cosine wave) or 1-sqrt (1 - sqrt(progress): Hägele et al.
    2024), from the peak down to end_lr_ratio."""

    def __post_init__(self) -> None:
        if self.decay_from not in ("warmup_end", "start"):
            raise ValueError(f"scheduler.decay_from must be warmup_end or start, got "
                             f"{self.decay_from!r}")
        if self.name not in SCHEDULES:
            raise ValueError(f"scheduler.name must be one of {', '.join(SCHEDULES)}, got "
                             f"{self.name!r}")
        if self.power <= 0:
            raise ValueError(f"scheduler.power must be > 0, got {self.power}")
        if not 0.0 <= self.end_lr_ratio <= 1.0:
            raise ValueError(f"scheduler.end_lr_ratio must be in [0, 1], got {self.end_lr_ratio}")
        if not 0.0 <= self.hold_fraction < 1.0:
            raise ValueError(f"scheduler.hold_fraction must be in [0, 1), got "
                             f"{self.hold_fraction}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ValueError(f"scheduler.decay_shape must be one of {', '.join(DECAY_SHAPES)}, "
                             f"got {self.decay_shape!r}")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"scheduler.decay_steps must be >= 1 or null, got "
                             f"{self.decay_steps}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"scheduler.decay_fraction must be in (0, 1], got "
                             f"{self.decay_fraction}")
        if self.name != "wsd" and self.decay_steps is not None:
            raise ValueError(f"scheduler.decay_steps is for scheduler=wsd (this is "
                             f"{self.name}); choose scheduler=wsd or drop it")
        if self.name == "wsd" and (self.hold_fraction or self.decay_from != "warmup_end"):
            raise ValueError("scheduler=wsd places its decay with decay_steps / decay_fraction; "
                             "drop scheduler.hold_fraction and scheduler.decay_from")


# --------------------------------------------------------------------------------------------
# Parameter groups and optimizers


def param_groups(named_params, weight_decay: float, lr_scale=None) -> list:
    """Two groups: matrices decay; biases and LayerNorm weights (all 1-d tensors) do not.

    Google's BERT excludes "LayerNorm" and "bias" by name; every such tensor is 1-d and every
    other BERT tensor is 2-d, so the shape rule is the same set without string matching.

    `lr_scale` (name -> factor of the scheduled rate, layer-wise decay): one such pair of
    groups per factor, each holding its `lr_scale` for set_lr.
    """
    scales = lr_scale is not None
    groups: dict = {(1.0, False): [], (1.0, True): []}  # one rate: always these two, in order
    for name, p in named_params:
        if p.requires_grad:
            scale = float(lr_scale(name)) if scales else 1.0
            groups.setdefault((scale, p.ndim < 2), []).append(p)
    out = []
    for (scale, no_decay), params in groups.items():
        if not params and scales:
            continue
        group = {"params": params, "weight_decay": 0.0 if no_decay else weight_decay}
        if no_decay:
            group["exclude_from_layer_adaptation"] = True
        if scales:
            group["lr_scale"] = scale
        out.append(group)
    return out


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., "Large Batch Optimization for Deep Learning", 2019, Algorithm 2).

    Per tensor w with gradient g at step t:
        m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
        m_hat = m / (1 - b1^t)           v_hat = v / (1 - b2^t)
        u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
        ratio = ||w|| / ||u||   (1 if either norm is 0)
        w = w - lr * ratio * u
    Groups with `exclude_from_layer_adaptation` use ratio 1 (Google's BERT LAMB does this for
    the parameters excluded from weight decay: biases and LayerNorm).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        exclude_from_layer_adaptation=False)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                update = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt_().add_(group["eps"]))
                w = p.float()
                if group["weight_decay"]:
                    update.add_(w, alpha=group["weight_decay"])
                ratio = 1.0
                if not group["exclude_from_layer_adaptation"]:
                    w_norm, u_norm = w.norm(), update.norm()
                    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm,
                                        torch.ones_like(w_norm))
                p.sub_((update * (group["lr"] * ratio)).to(p.dtype))
        return loss


def _fused_supported(params) -> bool:
    return all(p.dtype.is_floating_point and p.device.type in ("cpu", "cuda", "mps", "xpu")
               for p in params)


def build_optimizer(cfg: OptimConfig, named_params, lr_scale=None) -> torch.optim.Optimizer:
    """`lr_scale`: name -> factor of the scheduled rate (param_groups); None = one rate."""
    named_params = list(named_params)
    groups = param_groups(named_params, cfg.weight_decay, lr_scale)
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                    weight_decay=cfg.weight_decay)
    for g in groups:
        g.pop("exclude_from_layer_adaptation", None)
    fused = cfg.fused
    if fused is None:
        fused = _fused_supported(p for _, p in named_params)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, fused=bool(fused))


# --------------------------------------------------------------------------------------------
# Schedules


def _remaining(shape: str, q: float, power: float) -> float:
    """Share of the decay still ahead at decay progress q in [0, 1] (1 -> 0)."""
    if shape == "linear":
        return 1.0 - q
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * q))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(q)
    return (1.0 - q) ** power


def schedule_shape(cfg: SchedulerConfig, progress: float) -> float:
    """LR factor after warmup, for decay progress in [0, 1]."""
    q = min(max(progress, 0.0), 1.0)
    if cfg.name == "constant" or q <= cfg.hold_fraction:
        return 1.0
    q = (q - cfg.hold_fraction) / (1.0 - cfg.hold_fraction)
    shape = cfg.decay_shape if cfg.name == "wsd" else cfg.name
    return cfg.end_lr_ratio + (1.0 - cfg.end_lr_ratio) * _remaining(shape, q, cfg.power)


class Schedule:
    """Learning-rate factor for optimizer step `step` (0-based).

    Warmup is linear over `warmup_steps` steps: step s uses (s + 1) / warmup_steps, so the first
    update is not wasted at lr 0.  After warmup the decay progress is
      step mode:   (s - warmup) / (max_steps - warmup)
      budget mode: (elapsed - t_w) / (budget - t_w), t_w = elapsed seconds when warmup ended,
    i.e. in budget mode the curve follows wall-clock time, so a slower machine still ends at the
    end of its schedule when the budget runs out (Cramming).  With `decay_from: start` the
    progress counts from step 0 / time 0 instead: s / max_steps, elapsed / budget (NVIDIA).

    wsd: the peak until the decay, which takes the last N = decay_steps steps (or
    decay_fraction of max_steps): progress (s - (max_steps - N)) / N; in budget mode the last
    decay_fraction of the budget: (elapsed / budget - (1 - decay_fraction)) / decay_fraction.
    A run with max_steps = S + N and one with a larger max_steps have the same rate at every
    step before S: a decay branched off at checkpoint S continues the stable phase exactly.
    """

    def __init__(self, cfg: SchedulerConfig, max_steps: int, warmup_steps: int,
                 budget_seconds: Optional[float] = None):
        self.cfg = cfg
        self.max_steps = max_steps
        self.warmup_steps = warmup_steps
        self.budget_seconds = budget_seconds
        self.warmup_end_elapsed: Optional[float] = 0.0 if warmup_steps == 0 else None

    def decay_steps(self) -> int:
        """wsd in step mode: the steps the decay takes (the last ones of max_steps)."""
        if self.cfg.decay_steps is not None:
            return self.cfg.decay_steps
        return max(1, round(self.cfg.decay_fraction * self.max_steps))

    def factor(self, step: int, elapsed: float = 0.0) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.cfg.name == "wsd":
            if self.budget_seconds is None:
                n = self.decay_steps()
                progress = (step - (self.max_steps - n)) / n
            else:
                f = self.cfg.decay_fraction
                progress = (elapsed / self.budget_seconds - (1.0 - f)) / f
            return schedule_shape(self.cfg, progress)
        if self.cfg.decay_from == "start":
            if self.budget_seconds is None:
                return schedule_shape(self.cfg, step / max(self.max_steps, 1))
            return schedule_shape(self.cfg, elapsed / self.budget_seconds)
        if self.budget_seconds is None:
            span = max(self.max_steps - self.warmup_steps, 1)
            return schedule_shape(self.cfg, (step - self.warmup_steps) / span)
        if self.warmup_end_elapsed is None:
            self.warmup_end_elapsed = elapsed
        span = max(self.budget_seconds - self.warmup_end_elapsed, 1e-9)
        return schedule_shape(self.cfg, (elapsed - self.warmup_end_elapsed) / span)

    def state_dict(self) -> dict:
        return {"warmup_end_elapsed": self.warmup_end_elapsed}

    def load_state_dict(self, state: dict) -> None:
        self.warmup_end_elapsed = state["warmup_end_elapsed"]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # layer-wise decay (fine-tuning)
