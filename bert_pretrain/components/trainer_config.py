"""`conf/train/trainer/`: the trainer's settings (how long, in what batches, at what precision,
when to log, evaluate and save), validated where they are defined."""

from dataclasses import dataclass
from typing import Optional

MIXED_PRECISION = ("auto", "no", "bf16", "fp16")


def in_daemonic_process() -> bool:
    """Whether this process is a daemon (a multiprocessing pool's worker): it may not start
    processes of its own."""
    import multiprocessing

    return bool(multiprocessing.current_process().daemon)


def in_spawn_start_up() -> bool:
    """Whether this process is a child started with `spawn` that is still importing its
    parent's main script (multiprocessing runs the script again, as __mp_main__, before the
    child's own work; its own check of a missing main guard reads the same flag)."""
    import multiprocessing

    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


NO_MAIN_GUARD = (
    "bert-train: error: this script builds a Trainer when it is imported, and a process it "
    "started with spawn (the worker reading batches ahead, trainer.prefetch) imports it again "
    "to start: put the training under `if __name__ == \"__main__\":` (docs/training.md); "
    "this process stops here and the run goes on without it")


@dataclass
class TrainerConfig:
    """`conf/train/trainer/`: how long and in what batches to train, when to evaluate, save."""

    max_steps: int = 1000
    """Optimizer steps (an upper bound in budget mode)."""
    warmup_steps: Optional[int] = None
    """Linear warmup length in optimizer steps; null = warmup_ratio x max_steps."""
    warmup_ratio: float = 0.1
    """Warmup as a fraction of max_steps, when warmup_steps is null (as transformers/RoBERTa),
    so a run of any length works with the defaults."""
    budget_hours: Optional[float] = None
    """Wall-clock budget: the lr schedule follows elapsed/budget and training stops when it is
    spent (evaluation and checkpoint time excluded). null = step mode."""
    global_batch_size: int = 32
    """Samples per optimizer step over all processes."""
    micro_batch_size: Optional[int] = None
    """Samples per forward/backward on one process; null = global / world (no accumulation).
    Accumulation steps = global / (world x micro). Changes speed and memory; results only by
    float rounding without dropout (dropout masks are drawn per micro-batch, so with dropout on
    another micro-batch size trains another, equally valid, model)."""
    mixed_precision: str = "auto"
    """auto: bf16 autocast where the hardware has bf16 matrix units (AMX-BF16 / AVX512-BF16 CPUs,
    bf16-capable GPUs), fp32 elsewhere; no (fp32), bf16, or fp16 (with dynamic loss scaling:
    steps with inf/nan gradients are skipped). Weights and optimizer state stay fp32."""
    max_grad_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this; null = no clipping."""
    nsp_loss_weight: float = 1.0
    """The step's gradient is that of mlm_loss + nsp_loss_weight x nsp_loss (BERT: 1). The
    logged `loss` stays mlm_loss + nsp_loss, so runs with different weights compare."""
    rtd_loss_weight: float = 50.0
    """With an ELECTRA generator (`model.generator_layers > 0`): the gradient adds
    rtd_loss_weight x the replaced-token-detection loss (mean over the batch's real tokens;
    ELECTRA: 50, as the binary loss is far smaller than the MLM's). The logged `loss` adds it
    unweighted."""
    attention_locality: float = 0.0
    """A training-time start for attention (0 = off: BERT all along). Head h of every layer
    adds -attention_locality * 2^-h * |i - j| to its scores (ALiBi's form; not for the [CLS]
    query, which reads the whole input for NSP; only the first
    attention_locality_heads share of the heads), at full strength until attention_locality_hold
    of training, fading linearly to nothing at attention_locality_end; after it the model is a
    plain BERT, and evaluations always score it without the bias (what an export computes).
    From scratch, a BERT predicts only frequent tokens until some head attends to the
    neighbours of a masked token, which takes thousands of steps; this start skips that wait
    (docs/learning-check.md). Training progress counts steps, or time with budget_hours."""
    attention_locality_hold: float = 0.2
    attention_locality_end: float = 0.45
    attention_locality_heads: float = 1.0
    """Share of each layer's heads (the first ones) that get the bias; the others stay free."""
    log_every: int = 10
    eval_every: int = 0
    """Evaluate on the held-out split every N steps (0 = only at the end)."""
    eval_max_samples: Optional[int] = None
    """Evaluate on at most this many held-out instances (null = all)."""
    eval_batch_size: Optional[int] = None
    """null = micro_batch_size."""
    checkpoint_every: int = 1000
    keep_last_k: int = 3
    max_nonfinite_steps: int = 10
    """Stop after this many consecutive non-finite steps (loss or gradient norm; each skipped)."""
    defer_reads: bool = True
    """Read each step's loss, gradient norm and skip decision on the host at the next log,
    checkpoint or stop, not at every step, where the run allows it (one process, torch's fused
    AdamW, no fp16 loss scaler): a GPU then keeps working while the host prepares the next
    step. The same numbers and weights either way; false reads every step (a run over
    max_nonfinite_steps then stops at that step, not at the next log)."""
    prefetch: str = "auto"
    """Read the next steps' batches (rows from the shards, dynamic masks drawn) in a worker
    process while this step trains, so the training thread does not stop for them between
    steps: the same batches either way. auto: on GPUs, whose training thread only launches
    kernels; not on CPUs, where the model's threads already use every core (true / false)."""
    init_from: Optional[str] = None
    """A checkpoint directory to take the weights from (phase 2): fresh optimizer, schedule
    and data position."""
    progress_bar: bool = True
    report: bool = True
    """At the end, write <run_dir>/report/ (report.md and curves, as bert-report draws them)."""
    cpu: bool = False
    """Train on CPU even when a GPU is present."""
    sharding: str = "auto"
    """ddp: every process holds the whole model, optimizer state and gradients (DDP); fsdp:
    FSDP2 shards them over the processes (components/sharding.py), for models whose training
    state does not fit one device; auto: fsdp when launched with accelerate's FSDP config
    (conf/accelerate/fsdp.yaml), else ddp. Speed and memory only: the losses are DDP's up to
    float rounding, and a checkpoint of either resumes under the other."""
    cpu_keep_freed_memory: bool = True
    """CPU, glibc: keep freed memory in the process so big per-step tensors reuse warm pages
    instead of page-faulting fresh ones (cpu_runtime.py; ~25% off a bf16 BERT-base step).
    Speed only; resident memory stays at its peak."""
    process_group_timeout_s: float = 1800.0
    """Several processes: how long one waits for the others, when they join at start-up (a
    machine that never comes) and in every collective (the others wait while the main process
    saves a checkpoint). Past it the run stops with a one-line error instead of hanging."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "global_batch_size", "log_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "keep_last_k", "max_nonfinite_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"trainer.warmup_steps must be >= 0 or null, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"trainer.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError("trainer.micro_batch_size must be >= 1 or null")
        if not self.process_group_timeout_s > 0:
            raise ValueError(f"trainer.process_group_timeout_s must be > 0, got "
                             f"{self.process_group_timeout_s}")
        if self.budget_hours is not None and self.budget_hours <= 0:
            raise ValueError("trainer.budget_hours must be > 0 or null")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"trainer.mixed_precision must be one of "
                             f"{', '.join(MIXED_PRECISION)}, got {self.mixed_precision!r}")
        self.prefetch = str(self.prefetch).lower()
        if self.prefetch not in ("auto", "true", "false"):
            raise ValueError(f"trainer.prefetch must be auto, true or false, got "
                             f"{self.prefetch!r}")
        if self.sharding not in ("auto", "ddp", "fsdp"):
            raise ValueError(f"trainer.sharding must be auto, ddp or fsdp, got "
                             f"{self.sharding!r}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError("trainer.max_grad_norm must be > 0 or null")
        if not self.nsp_loss_weight >= 0:
            raise ValueError(f"trainer.nsp_loss_weight must be >= 0, got {self.nsp_loss_weight}")
        if not self.rtd_loss_weight >= 0:
            raise ValueError(f"trainer.rtd_loss_weight must be >= 0, got {self.rtd_loss_weight}")
        if not self.attention_locality >= 0:
            raise ValueError(f"trainer.attention_locality must be >= 0 (0 = off), got "
                             f"{self.attention_locality}")
        if not 0.0 <= self.attention_locality_hold <= self.attention_locality_end <= 1.0:
            raise ValueError(f"trainer.attention_locality_hold ({self.attention_locality_hold}) "
                             f"and attention_locality_end ({self.attention_locality_end}) must "
                             f"satisfy 0 <= hold <= end <= 1 (shares of training)")
        if not 0.0 < self.attention_locality_heads <= 1.0:
            raise ValueError(f"trainer.attention_locality_heads must be in (0, 1], got "
                             f"{self.attention_locality_heads}")
        if self.budget_hours is not None and self.warmup_steps is None and self.warmup_ratio:
            raise ValueError("trainer.budget_hours measures the run in time, so there is no step "
                             "count to take trainer.warmup_ratio of; set trainer.warmup_steps")
        if self.warmup >= self.max_steps and self.budget_hours is None:
            raise ValueError(f"trainer.warmup_steps ({self.warmup}) must be below "
                             f"trainer.max_steps ({self.max_steps})")

    def prefetches(self, device_type: str) -> bool:
        """Whether batches are read ahead by a worker process on this device (`prefetch`). Not
        in a daemonic process (a multiprocessing pool's worker running the trainer), which
        Python does not let start processes: `auto` reads on the training thread there."""
        if self.prefetch == "false" or (self.prefetch == "auto" and device_type != "cuda"):
            return False
        if in_daemonic_process():
            if self.prefetch == "true":
                from ..errors import ConfigError

                raise ConfigError("trainer.prefetch=true starts a worker process, and this "
                                  "process is a daemon (a multiprocessing pool's worker), which "
                                  "may not start processes; set trainer.prefetch=auto or false")
            return False
        return True

    def progress(self, step: int, elapsed: float) -> float:
        """The share of training done before `step`: step / max_steps, or with a time budget
        elapsed / budget (what the locality fade and a masking-rate schedule follow)."""
        return (elapsed / (self.budget_hours * 3600) if self.budget_hours is not None
                else step / self.max_steps)

    def locality_strength(self, step: int, elapsed: float) -> float:
        """The share of attention_locality in force at this point of training (1 -> 0)."""
        if not self.attention_locality:
            return 0.0
        progress = self.progress(step, elapsed)
        if progress < self.attention_locality_hold:
            return 1.0
        span = self.attention_locality_end - self.attention_locality_hold
        return 0.0 if span <= 0 else max(0.0, 1.0 - (progress - self.attention_locality_hold)
                                         / span)

    @property
    def warmup(self) -> int:
        """Warmup in steps: warmup_steps if set, else warmup_ratio of max_steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return 0 if self.budget_hours is not None else int(round(self.warmup_ratio *
                                                                 self.max_steps))
