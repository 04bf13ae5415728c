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
class AttentionGroup:
    """Sequences of similar length attended together on their own [n, heads, L_g, d] grid."""

    num_seqs: int
    length: int
    """L_g: the longest sequence of the group; shorter ones are padded to it (masked)."""
    token_rows: torch.Tensor | None
    """[N_g] rows of the layout's [N, H] matrix that belong to the group (layout order); None
    when the group is every sequence (no gather needed)."""
    grid_index: torch.Tensor
    """[N_g * heads]: for row r * heads + j of the group's [N_g * heads, d] view, its row in a
    contiguous [n, heads, L_g, d] grid."""
    key_mask: torch.Tensor | None
    """[n, 1, 1, L_g] bool, True for real keys; None when every sequence has length L_g."""

    def key_bias(self, dtype: torch.dtype) -> torch.Tensor:
        bias = torch.zeros(self.key_mask.shape, dtype=dtype, device=self.key_mask.device)
        return bias.masked_fill_(~self.key_mask, torch.finfo(dtype).min)


# Planning: the cost of a group is n * L_g^2 score elements per head (two batched matmuls, the
# mask, softmax and dropout all scale with it) plus a fixed cost per group for its extra
# gathers and kernel launches, worth about this many score elements over all heads
# (bench/bench_model.py, 2-core CPU: one more group pays off when it saves ~110^2 score
# elements per head at 4 heads, ~60^2 at 12).
GROUP_OVERHEAD = 50_000
MAX_GROUPS = 8


def plan_groups(lengths: list[int], num_heads: int) -> list[list[int]]:
    """Split the sequences (by index) into groups of similar length, minimising the estimated
    attention cost: a dynamic programme over the lengths sorted longest first (the optimal
    groups are contiguous runs of that order)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    ls = [lengths[i] for i in order]
    n, fixed = len(ls), GROUP_OVERHEAD / num_heads
    # best[k][j]: cost of the first j sorted sequences in k groups
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(MAX_GROUPS + 1)]
    cut = [[0] * (n + 1) for _ in range(MAX_GROUPS + 1)]
    best[0][0] = 0.0
    for k in range(1, MAX_GROUPS + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):  # group = sorted[i:j], its longest is ls[i]
                cost = best[k - 1][i] + (j - i) * ls[i] ** 2 + fixed
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    k = min(range(1, MAX_GROUPS + 1), key=lambda k: best[k][n])
    groups, j = [], n
    while k > 0:
        i = cut[k][j]
        groups.append(sorted(order[i:j]))
        j, k = i, k - 1
    return groups[::-1]


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

    lengths: list[int] | None = None
    """Real tokens of each sequence (host ints) when unpadded and right-padded (the real tokens
    of each sequence are a prefix); else None, and attention stays on the padded grid."""

    def __post_init__(self) -> None:
        self._cache: dict = {}

    def attention_groups(self, num_heads: int) -> list[AttentionGroup]:
        """Unpadded only: the groups that attention runs on (`plan_groups`), built once per
        forward and shared by every layer."""
        key = ("groups", num_heads)
        if key not in self._cache:
            self._cache[key] = self._build_groups(num_heads)
        return self._cache[key]

    def _build_groups(self, num_heads: int) -> list[AttentionGroup]:
        device = self.indices.device
        lengths = torch.tensor(self.lengths, device=device)
        starts = torch.cumsum(lengths, 0) - lengths  # first row of each sequence in [N, H]
        heads = torch.arange(num_heads, device=device)
        groups = []
        for members in plan_groups(self.lengths, num_heads):
            seqs = torch.tensor(members, device=device)
            seq_lengths = lengths.index_select(0, seqs)
            length = max(self.lengths[i] for i in members)
            # rows of the group's tokens in layout order, and each one's (local seq, position)
            local = torch.repeat_interleave(torch.arange(len(members), device=device),
                                            seq_lengths)
            pos = torch.arange(int(seq_lengths.sum()), device=device) - torch.repeat_interleave(
                torch.cumsum(seq_lengths, 0) - seq_lengths, seq_lengths)
            rows = starts.index_select(0, seqs).index_select(0, local) + pos
            grid = (local[:, None] * num_heads + heads[None, :]) * length + pos[:, None]
            key_mask = None
            if min(self.lengths[i] for i in members) < length:
                key_mask = (torch.arange(length, device=device)[None, :]
                            < seq_lengths[:, None])[:, None, None, :]
            every = len(members) == len(self.lengths)
            groups.append(AttentionGroup(len(members), length, None if every else rows,
                                         grid.reshape(-1), key_mask))
        if len(groups) > 1:
            order = torch.cat([g.token_rows for g in groups])
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(len(order), device=device)
            self._cache["group_inverse"] = inverse
        return groups

    def group_to_heads(self, x: torch.Tensor, group: AttentionGroup,
                       num_heads: int) -> torch.Tensor:
        """[N, H] -> the group's [n, heads, L_g, d] grid (zeros at padding)."""
        d = x.shape[-1] // num_heads
        rows = x if group.token_rows is None else x.index_select(0, group.token_rows)
        grid = x.new_zeros(group.num_seqs * num_heads * group.length, d)
        grid.index_copy_(0, group.grid_index, rows.reshape(-1, d))
        return grid.view(group.num_seqs, num_heads, group.length, d)

    def groups_from_heads(self, contexts: list[torch.Tensor],
                          groups: list[AttentionGroup]) -> torch.Tensor:
        """The groups' [n, heads, L_g, d] outputs -> [N, H] in layout order."""
        rows = []
        for x, group in zip(contexts, groups):
            n, h, length, d = x.shape
            rows.append(x.reshape(-1, d).index_select(0, group.grid_index).view(-1, h * d))
        if len(rows) == 1:
            return rows[0]
        return torch.cat(rows).index_select(0, self._cache["group_inverse"])

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
        # Grouped attention places token k of a sequence at position k of its grid, which is
        # its position only when the real tokens are a prefix (right padding, as BERT's).
        counts = mask.sum(1)
        prefix = bool((mask == (torch.arange(seq_len, device=mask.device)[None, :]
                                < counts[:, None])).all())
        return cls(batch_size, seq_len, key_mask, indices, cls_rows,
                   counts.tolist() if prefix else None)

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
