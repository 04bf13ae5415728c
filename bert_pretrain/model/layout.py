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

    def __post_init__(self) -> None:
        self._cache: dict = {}

    @property
    def unpadded(self) -> bool:
        return self.indices is not None

    def key_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, 1, L] additive score bias: 0 for real keys, dtype's minimum for padding (an
        in-place add is cheaper on CPU than masked_fill with a bool mask)."""
        key = ("bias", dtype)
        if key not in self._cache:
            bias = torch.zeros(self.key_mask.shape, dtype=dtype, device=self.key_mask.device)
            self._cache[key] = bias.masked_fill_(~self.key_mask, torch.finfo(dtype).min)
        return self._cache[key]

    def head_index(self, num_heads: int) -> torch.Tensor:
        """Unpadded only: for row n * heads + j of the [N * heads, d] view of a projection, its
        row in a contiguous [B, heads, L, d] grid. Scattering there gives attention contiguous
        per-head operands (no transpose copies before the batched matmuls)."""
        key = ("heads", num_heads)
        if key not in self._cache:
            b, pos = self.indices // self.seq_len, self.indices % self.seq_len
            heads = torch.arange(num_heads, device=self.indices.device)
            rows = (b[:, None] * num_heads + heads[None, :]) * self.seq_len + pos[:, None]
            self._cache[key] = rows.reshape(-1)
        return self._cache[key]

    def to_heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[N, H] (unpadded) or [B, L, H] -> [B, heads, L, d]."""
        b, n = self.batch_size, self.seq_len
        d = x.shape[-1] // num_heads
        if not self.unpadded:
            return x.view(b, n, num_heads, d).transpose(1, 2)
        grid = x.new_zeros(b * num_heads * n, d)
        grid.index_copy_(0, self.head_index(num_heads), x.reshape(-1, d))
        return grid.view(b, num_heads, n, d)

    def from_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, heads, L, d] -> the layout's own shape ([N, H] or [B, L, H])."""
        b, h, n, d = x.shape
        if not self.unpadded:
            return x.transpose(1, 2).reshape(b, n, h * d)
        rows = x.reshape(b * h * n, d).index_select(0, self.head_index(h))
        return rows.view(-1, h * d)

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

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-token values given as [B, L] -> the layout's token order ([N] or [B * L])."""
        flat = flat.reshape(-1)
        return flat.index_select(0, self.indices) if self.unpadded else flat


@dataclass
class QuerySubset:
    """Rows whose output the last layer must produce (`ModelImpl.sparse_last_layer`): with sparse
    prediction only labelled positions and each [CLS] are read after the encoder, so the last
    layer's query projection, attention output, FFN and LayerNorms run on those rows alone
    (keys and values still come from every token).  For attention the R rows are packed per
    sequence into a [B, Lq] grid, Lq = most rows of any sequence."""

    rows: torch.Tensor
    """[R] indices into the layout's token order, ascending."""
    grid_index: torch.Tensor
    """[R] flat index of each row in the [B * Lq] query grid."""
    positions: torch.Tensor
    """[B, Lq] position in its sequence of each query slot (0 for empty slots)."""
    cls_rows: torch.Tensor
    """[B] index among the R rows of each sequence's first token."""
    lq: int

    @classmethod
    def build(cls, keep: torch.Tensor, layout: TokenLayout) -> QuerySubset:
        """`keep`: [B, L] bool, the positions needed; each sequence's first token is added."""
        b, n = layout.batch_size, layout.seq_len
        keep = keep.clone()
        keep[:, 0] = True
        rows = layout.select(keep).nonzero().squeeze(1)
        flat = layout.indices.index_select(0, rows) if layout.unpadded else rows
        seq, pos = flat // n, flat % n
        counts = torch.bincount(seq, minlength=b)
        lq = int(counts.max())
        rank = torch.arange(len(rows), device=rows.device) - (torch.cumsum(counts, 0) - counts)[seq]
        grid_index = seq * lq + rank
        positions = torch.zeros(b * lq, dtype=pos.dtype, device=pos.device)
        positions.index_copy_(0, grid_index, pos)
        cls_rows = (pos == 0).nonzero().squeeze(1)
        return cls(rows, grid_index, positions.view(b, lq), cls_rows, lq)

    def to_grid(self, x: torch.Tensor, batch_size: int) -> torch.Tensor:
        grid = x.new_zeros(batch_size * self.lq, x.shape[-1])
        grid.index_copy_(0, self.grid_index, x)
        return grid.view(batch_size, self.lq, x.shape[-1])

    def from_grid(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1]).index_select(0, self.grid_index)
