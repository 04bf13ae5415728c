"""One precision policy per run: the autocast dtype, whether a grad scaler exists, and who skips
a step whose loss or gradients are not finite. The trainer asks it instead of testing strings.

    no    fp32 throughout.
    bf16  autocast to bf16 (same exponent range as fp32: no loss scaling); fp32 weights and
          optimizer state.  A non-finite step is skipped by the trainer.
    fp16  autocast to fp16 with dynamic loss scaling (torch.amp.GradScaler, on CPU and on CUDA):
          the loss is multiplied by a scale before backward, gradients are unscaled before
          clipping, and a step with inf/nan gradients is skipped while the scale is lowered.
          Skips are how the scaler finds its scale, so they only stop a run after
          `SCALER_ROOM` more consecutive ones than trainer.max_nonfinite_steps allows.

Autocast and scaling are done here, not by accelerate: accelerate gives a grad scaler on CUDA
only, so fp16 on CPU used to run without one while the trainer believed one existed (a
non-finite step was applied and the weights became nan). Weights and optimizer state are fp32
in every mode.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

# Consecutive skipped steps a scaler needs at most to bring its scale from 2^16 down to where
# fp16 gradients are finite again; beyond that the loss itself diverged.
SCALER_ROOM = 32
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_DESCRIPTIONS = {"no": "fp32",
                 "bf16": "bf16 autocast (fp32 weights and optimizer state)",
                 "fp16": "fp16 autocast with dynamic loss scaling (torch.amp.GradScaler on {dev}; "
                         "fp32 weights and optimizer state)"}


@dataclass
class Precision:
    mode: str
    """no | bf16 | fp16 (auto is resolved before: see `resolve`)."""
    device_type: str
    reason: str
    """Why this mode: the setting, or what auto found on this machine."""
    scaler: Optional[torch.amp.GradScaler] = None

    @classmethod
    def resolve(cls, setting: str, device_type: str) -> "Precision":
        from .cpu_runtime import resolve_precision

        mode, reason = resolve_precision(setting, on_cuda=device_type == "cuda")
        scaler = torch.amp.GradScaler(device_type) if mode == "fp16" else None
        return cls(mode, device_type, reason, scaler)

    def describe(self) -> str:
        return _DESCRIPTIONS[self.mode].format(dev=self.device_type)

    def autocast(self):
        if self.mode == "no":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=_DTYPES[self.mode])

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer) -> None:
        """Before the gradients are measured or clipped: divide out the loss scale."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer, finite: bool) -> bool:
        """Apply the step if the loss and gradients are finite; returns whether it was applied.
        With a scaler, it also adapts the scale (lowered after a skip).  The scaler also skips
        a step on its own when an unscaled gradient holds inf/nan (which `finite` need not have
        seen: a caller may not measure every gradient); it then lowers the scale, and that is
        how a skip is told from an applied step here."""
        if self.scaler is None:
            if finite:
                optimizer.step()
            return finite
        before = self.scaler.get_scale()
        if finite:
            self.scaler.step(optimizer)
        self.scaler.update()
        return finite and self.scaler.get_scale() >= before

    def defers_reads(self, optimizer) -> bool:
        """Whether `step_on_device` can skip a step for this optimizer: torch's fused AdamW
        takes a found-inf tensor (the flag GradScaler gives it) and skips its update on the
        device; with a loss scaler the scale's update is read on the host anyway."""
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        return self.scaler is None and bool(getattr(inner, "_step_supports_amp_scaling", False)) \
            and bool(inner.defaults.get("fused"))

    def step_on_device(self, optimizer, finite: torch.Tensor) -> None:
        """`step` without reading `finite` (a 0-d bool tensor) on the host: the fused kernel
        leaves the weights, moments and step count as they were where it is false."""
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.found_inf = (~finite).to(torch.float32)
        try:
            optimizer.step()
        finally:
            del inner.found_inf

    def nonfinite_limit(self, max_nonfinite_steps: int) -> int:
        """Consecutive skipped steps after which the run stops."""
        return max(max_nonfinite_steps, 1) + (SCALER_ROOM if self.scaler is not None else 0)

    def state_dict(self) -> Optional[dict]:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
