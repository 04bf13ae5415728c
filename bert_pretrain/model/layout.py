"""Where the tokens of a batch live: padded [B, L, H] or unpadded [N, H] (N = real tokens).

Unpadding (`ModelImpl.unpad`) keeps hidden states as one [N, H] matrix of real tokens, so every
projection, FFN, LayerNorm and dropout skips the padding (about a quarter of the tokens in
Google-style data at length 128).  Only the attention product needs the [B, L] grid back; the
layout carries the indices to scatter into it and gather out of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLayout:
    batch_size: int
    seq_len: int
    key_mask: torch.Tensor | None
    """[B, 1, 1, L] bool, True where a key may be attended to; None when nothing is padded."""
    indices: torch.Tensor | None = None
    """[N] flat indices (into B * L) of the real tokens when unpadded; None when padded."""
    cls_rows: torch.Tensor | None = None
    """[B] row of each sequence's first token in the unpadded [N, H] matrix (for the pooler)."""

    @property
    def unpadded(self) -> bool:
        return self.indices is not None

    @classmethod
    def build(cls, attention_mask: torch.Tensor | None, batch_size: int, seq_len: int,
              unpad: bool) -> TokenLayout:
        if attention_mask is None:
            # Nothing is padded: the dense layout is already minimal (and keeps flash kernels).
            return cls(batch_size, seq_len, None)
        mask = attention_mask.bool()
        key_mask = mask[:, None, None, :]
        if not unpad or not bool(mask[:, 0].all()):
            # The unpadded pooler reads each sequence's first token; inputs whose first token is
            # padding (never the case for [CLS]-first BERT inputs) take the padded path.
            return cls(batch_size, seq_len, key_mask)
        flat = mask.reshape(-1)
        indices = flat.nonzero().squeeze(1)
        # Row of token (b, 0) among the real tokens = number of real tokens before it.
        starts = torch.arange(batch_size, device=mask.device) * seq_len
        cls_rows = torch.cumsum(flat, 0).index_select(0, starts) - 1
        return cls(batch_size, seq_len, key_mask, indices, cls_rows)

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] (unpadded) or [B, L, C] -> [B, L, C]; padding rows are zero."""
        if not self.unpadded:
            return x
        grid = x.new_zeros(self.batch_size * self.seq_len, x.shape[-1])
        grid.index_copy_(0, self.indices, x)  # in place: saves copying the zeros
        return grid.view(self.batch_size, self.seq_len, x.shape[-1])

    def from_grid(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, C] -> the layout's own shape ([N, C] when unpadded)."""
        if not self.unpadded:
            return x
        return x.reshape(self.batch_size * self.seq_len, x.shape[-1]).index_select(0, self.indices)

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-token values given as [B, L] -> the layout's token order ([N] or [B * L])."""
        flat = flat.reshape(-1)
        return flat.index_select(0, self.indices) if self.unpadded else flat
