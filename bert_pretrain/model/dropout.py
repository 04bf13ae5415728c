"""Dropout with a cheaper random-number path on CPU (`ModelImpl.fast_dropout`).

torch's CPU dropout draws a float Bernoulli tensor, divides it and multiplies (three passes plus
the slow Bernoulli sampler); dropout was ~18% of a BERT-mini training step on CPU.  Here the mask
comes from raw 31-bit random integers compared with round(p * 2^31): the same Bernoulli(p) drop
probability (to 2^-31, finer than the float sampler's) at about half the cost.  On GPUs torch's
fused dropout kernel is already fast, so it is used there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _CpuDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        # Uniform integers in [0, 2^31); ge_ writes 0/1 in place (no bool tensor: bool masks
        # take slow, unvectorised paths in masked_fill / where on CPU).  The mask is kept in
        # x's dtype; in fp32 the 1/(1-p) scale is folded into it (one multiply each way), in
        # 16-bit types it stays a separate fp32-computed scalar multiply, as in torch's dropout
        # (1/(1-p) rounded to bf16 would bias every kept activation by up to 0.4%).
        bits = torch.empty(x.shape, dtype=torch.int32, device=x.device).random_()
        mask = bits.ge_(int(round(p * 2**31))).to(x.dtype)
        scale = 1.0 / (1.0 - p)
        if x.dtype in (torch.float32, torch.float64):
            mask.mul_(scale)
            scale = None
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask if scale is None else (x * mask).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        out = grad * mask
        return (out if ctx.scale is None else out.mul_(ctx.scale)), None


def dropout(x: torch.Tensor, p: float, training: bool, fast: bool) -> torch.Tensor:
    if not training or p == 0.0:
        return x
    # Under torch.compile (impl.compile) inductor fuses torch's dropout into the neighbouring
    # kernels with its own generator; the in-place integer draw here would split the graph.
    if fast and x.device.type == "cpu" and not torch.compiler.is_compiling():
        return _CpuDropout.apply(x, p)
    return F.dropout(x, p, True)


class Dropout(torch.nn.Module):
    """nn.Dropout with the fast CPU path; no parameters, so state dicts are unaffected."""

    def __init__(self, p: float, fast: bool):
        super().__init__()
        self.p = p
        self.fast = fast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, self.fast)

    def extra_repr(self) -> str:
        return f"p={self.p}, fast={self.fast}"
