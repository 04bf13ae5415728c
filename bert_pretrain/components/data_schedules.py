"""How the training stream changes over a run: the masking rate (a function of training progress)
and the global batch size (a function of the samples consumed).

Both are pure functions of numbers every process knows identically at every step (the step's
progress, the data position), and neither has state of its own: a resumed run, or one with
another number of processes, draws the same batches with the same masks.
"""

import math
from dataclasses import dataclass

from ..errors import DataError

MASK_SCHEDULES = ("linear", "cosine", "step")
# Exponent p of the learning-rate factor (batch / final batch) ** p during a batch warmup.
LR_SCALINGS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


def masking_rate(start: float, end: float, shape: str, until: float, progress: float) -> float:
    """The masking rate at `progress` (share of training done, 0..1): `start` at 0, `end` from
    `until` on; in between linear, half a cosine, or (step) `start` until `until`."""
    q = min(max(progress / until, 0.0), 1.0)
    if shape == "step":
        return start if q < 1.0 else end
    weight = 0.5 * (1.0 - math.cos(math.pi * q)) if shape == "cosine" else q
    return start + (end - start) * weight


@dataclass(frozen=True)
class BatchRamp:
    """The global batch of the step that begins at global sample `samples` (Cramming, MosaicBERT,
    ModernBERT's batch-size warmup): `start` at first, growing linearly in the samples consumed,
    in steps of `start`, to `final` once `ramp_samples` samples are consumed.

    Why multiples of `start`: every batch of the ramp must split into whole micro-batches on
    every process.  With `start` divisible by processes x micro batch, every later size is too,
    for any number of processes that divides it, and the sizes never depend on the number of
    processes, so 1 and N processes train on the same global batches.  The data position stays
    one integer (samples consumed), from which the batch of the next step follows.
    """

    start: int
    final: int
    ramp_samples: int
    lr_scaling: str = "none"

    @classmethod
    def constant(cls, global_batch_size: int) -> "BatchRamp":
        return cls(global_batch_size, global_batch_size, 0)

    @property
    def smallest(self) -> int:
        return self.start

    def size_at(self, samples: int) -> int:
        if samples >= self.ramp_samples:
            return self.final
        levels = self.final // self.start
        return self.start * (1 + (levels - 1) * samples // self.ramp_samples)

    def lr_factor(self, samples: int) -> float:
        """Learning-rate multiplier of the step at `samples`: (batch / final) ** p, p by
        `lr_scaling` (none 0, sqrt 0.5, linear 1); 1 once the ramp is over."""
        return (self.size_at(samples) / self.final) ** LR_SCALINGS[self.lr_scaling]

    def check_divisible(self, world_size: int, micro_batch_size: int) -> None:
        """One-line DataError unless every size of the ramp splits into whole micro-batches."""
        unit = world_size * micro_batch_size
        if self.start % unit:
            what = ("data.batch_warmup_start" if self.start != self.final
                    else "trainer.global_batch_size")
            raise DataError(
                f"{what}={self.start} is not divisible by world_size ({world_size}) x "
                f"trainer.micro_batch_size ({micro_batch_size}); pick sizes so that it divides"
                + (" (every batch of the warmup is a multiple of its start)"
                   if self.start != self.final else ""))


def batch_ramp(start, tokens: int, lr_scaling: str, global_batch_size: int,
               max_seq_length: int) -> BatchRamp:
    """The ramp of `data.batch_warmup_*` (see DataConfig) for a final batch of
    `global_batch_size`; the ramp's tokens count sequence slots (samples x max_seq_length), so
    the batch is a function of the samples consumed alone.  One-line DataError for sizes that
    cannot work."""
    check_start(start, global_batch_size)
    if start is None or start == global_batch_size:
        return BatchRamp.constant(global_batch_size)
    return BatchRamp(start, global_batch_size, max(1, -(-tokens // max_seq_length)), lr_scaling)


def check_start(start, global_batch_size: int) -> None:
    """One-line DataError unless the warmup's start size divides the final batch."""
    if start is not None and (start > global_batch_size or global_batch_size % start):
        raise DataError(f"data.batch_warmup_start={start} must divide trainer.global_batch_size="
                        f"{global_batch_size} (the batch grows in steps of its start size), e.g. "
                        f"{_divisor_below(global_batch_size, start)}")


def _divisor_below(n: int, limit: int) -> int:
    """The largest divisor of n below both `limit` and n (1 at least): a start size to suggest."""
    return max([d for d in range(1, min(n - 1, limit) + 1) if n % d == 0] or [1])
