"""Where the tokens of a batch live: padded [B, L, H] or unpadded [N, H] (N = real tokens).

Unpadding (`ModelImpl.unpad`) keeps hidden states as one [N, H] matrix of real tokens, so every
projection, FFN, LayerNorm and dropout skips the padding (about a quarter of the tokens in
Google-style data at length 128).  Only the attention product needs the [B, L] grid back; the
layout carries the indices to scatter into it and gather out of it.
"""

from __future__ import annotations

from collections import Counter
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
# The planner works on distinct lengths; above this many it buckets them (lengths rounded up
# to a multiple of ceil(longest / MAX_LENGTH_BUCKETS): 4 at 512 tokens), so its tensors stay at
# <= 128 x 128 elements: below torch's parallel grain, where no worker thread has to wake up.
# (Only batches of more than 128 distinct lengths are bucketed: sequences above 128 tokens.)
MAX_LENGTH_BUCKETS = 128


def plan_groups(lengths: list[int], num_heads: int) -> list[list[int]]:
    """Split the sequences (by index) into groups of similar length, minimising the estimated
    attention cost; groups come longest first, each sorted by index.

    The optimal groups are contiguous runs of the lengths sorted longest first, and an optimal
    plan never splits sequences of equal length (moving them into the shorter group never costs
    more), so the dynamic programme runs over the K distinct lengths, not the B sequences:
    O(B log B) for the sort plus MAX_GROUPS vector steps over a K x K cost table (K <= 128:
    exact up to 128 distinct lengths, bucketed above).  The old O(MAX_GROUPS x B^2) Python loop took
    tens of milliseconds at B=256 (121 ms in issue 30), before every forward pass;
    bench/bench_planner.py times both."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    if not order:
        return []
    # distinct (bucketed) lengths, longest first, and how many sequences have each (C-level
    # counting: a Python loop over the batch cost more than the whole programme)
    count = Counter(lengths)
    if len(count) > MAX_LENGTH_BUCKETS:
        width = -(-lengths[order[0]] // MAX_LENGTH_BUCKETS)
        count = Counter(-(-n // width) * width for n in lengths)
    keys = sorted(count, reverse=True)
    counts = [count[key] for key in keys]
    k = len(keys)
    if k == 1:
        return [sorted(order)]
    size = torch.tensor(counts, dtype=torch.float64)
    end = torch.cumsum(size, 0)
    start = end - size
    # cost[i, j]: one group of the sequences with distinct lengths i..j (its longest: keys[i])
    cost = (end[None, :] - start[:, None]) * torch.tensor(keys, dtype=torch.float64)[:, None] ** 2
    cost += GROUP_OVERHEAD / num_heads
    index = torch.arange(k)
    cost.masked_fill_(index[:, None] > index[None, :], float("inf"))
    # best[g][j]: the cheapest g+1 groups covering lengths 0..j.  Only values go forward
    # (amin: a few microseconds; min-with-indices runs a parallel kernel that wakes a second
    # thread for every call, ~50 us); where a group starts is found on the way back, one column
    # at a time.
    best = [cost[0]]
    for _ in range(1, min(MAX_GROUPS, k)):
        best.append((best[-1][:-1, None] + cost[1:]).amin(0))
    # argmin takes the first minimum: the fewest groups among equal costs, and the first
    # start among equal splits
    g, j, starts = int(torch.stack([b[-1] for b in best]).argmin()), k - 1, []
    while g > 0:
        i = int((best[g - 1][:j] + cost[1:j + 1, j]).argmin()) + 1  # the last group: i..j
        starts.append(int(start[i]))
        j, g = i - 1, g - 1
    cuts = [0, *starts[::-1], len(order)]
    return [sorted(order[a:b]) for a, b in zip(cuts, cuts[1:])]


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host index tensors -> `device` in one copy that does not wait for the device's queue
    (a copy per tensor from a Python list waits for the GPU each time)."""
    if device.type == "cpu":
        return tensors
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
    flat = flat.to(device, non_blocking=True)
    out = []
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        out.append(part.view(t.shape).to(t.dtype))
    return out


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
    """Real tokens of each sequence (host ints) when unpadded; else None."""
    right_padded: bool = False
    """The real tokens of every sequence are a prefix (padding on the right, as BERT's): what
    the length groups need (they place token k of a sequence at position k of their grid)."""

    def __post_init__(self) -> None:
        self._cache: dict = {}

    def attention_groups(self, num_heads: int) -> list[AttentionGroup]:
        """Unpadded and right-padded only: the groups that attention runs on (`plan_groups`),
        built once per forward and shared by every layer."""
        key = ("groups", num_heads)
        if key not in self._cache:
            self._cache[key] = self._build_groups(num_heads)
        return self._cache[key]

    def _build_groups(self, num_heads: int) -> list[AttentionGroup]:
        """Every group's index tensors at once: the plan and one number per sequence on the
        host (the lengths are host ints), one copy of those to the device, and the per-token
        indices there: a fixed number of operations whatever the group count, and no wait for
        the device (the sizes are known on the host)."""
        plan = plan_groups(self.lengths, num_heads)
        lengths = torch.tensor(self.lengths)
        seqs = torch.tensor([i for members in plan for i in members])  # group by group
        group_sizes = [len(members) for members in plan]
        group_lengths = [max(self.lengths[i] for i in members) for members in plan]
        group = torch.repeat_interleave(torch.arange(len(plan)), torch.tensor(group_sizes))
        first = torch.tensor([0, *group_sizes[:-1]]).cumsum(0)  # first sequence of each group
        seq_lengths = lengths[seqs]
        per_seq = [(torch.cumsum(lengths, 0) - lengths)[seqs],  # its first row in [N, H]
                   torch.arange(len(seqs)) - first[group],       # its place in its group
                   torch.tensor(group_lengths)[group],           # its group's grid length
                   seq_lengths,
                   torch.cumsum(seq_lengths, 0) - seq_lengths]   # its first token, group order
        start, local, width, seq_lengths, offset = _to_device(per_seq, self.indices.device)
        device, total = start.device, int(sum(self.lengths))
        token = torch.repeat_interleave(torch.arange(len(seqs), device=device), seq_lengths,
                                        output_size=total)
        pos = torch.arange(total, device=device) - offset[token]
        rows = start[token] + pos
        grid = ((local[token] * num_heads)[:, None]
                + torch.arange(num_heads, device=device)[None, :]) * width[token][:, None] \
            + pos[:, None]
        if len(plan) > 1:
            inverse = torch.empty_like(rows)
            inverse[rows] = torch.arange(total, device=device)
            self._cache["group_inverse"] = inverse
        tokens_per_group = [sum(self.lengths[i] for i in members) for members in plan]
        groups = []
        for members, length, g_rows, g_grid, g_lengths in zip(
                plan, group_lengths, rows.split(tokens_per_group), grid.split(tokens_per_group),
                seq_lengths.split(group_sizes)):
            key_mask = None
            if min(self.lengths[i] for i in members) < length:
                key_mask = (torch.arange(length, device=device)[None, :]
                            < g_lengths[:, None])[:, None, None, :]
            every = len(members) == len(self.lengths)
            groups.append(AttentionGroup(len(members), length, None if every else g_rows,
                                         g_grid.reshape(-1), key_mask))
        return groups

    def nested_offsets(self) -> torch.Tensor:
        """Unpadded only: [B + 1] offsets of each sequence's rows in the [N, H] matrix (the
        `cu_seqlens` of variable-length attention kernels), on the layout's device."""
        if "offsets" not in self._cache:
            offsets = torch.zeros(len(self.lengths) + 1, dtype=torch.int64)
            torch.cumsum(torch.tensor(self.lengths), 0, out=offsets[1:])
            self._cache["offsets"] = _to_device([offsets], self.indices.device)[0]
        return self._cache["offsets"]

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
        if not unpad:
            return cls(batch_size, seq_len, key_mask)
        # The plan needs the lengths on the host: one copy of the mask (one wait for a GPU),
        # then everything from it on the host and one copy of the indices back.
        host = mask.cpu()
        if not bool(host[:, 0].all()):
            # The unpadded pooler reads each sequence's first token; inputs whose first token is
            # padding (never the case for [CLS]-first BERT inputs) take the padded path.
            return cls(batch_size, seq_len, key_mask)
        flat = host.reshape(-1)
        indices = flat.nonzero().squeeze(1)
        # Row of token (b, 0) among the real tokens = number of real tokens before it.
        counts = host.sum(1)
        cls_rows = torch.cumsum(counts, 0) - counts
        prefix = bool((host == (torch.arange(seq_len)[None, :] < counts[:, None])).all())
        indices, cls_rows = _to_device([indices, cls_rows], mask.device)
        return cls(batch_size, seq_len, key_mask, indices, cls_rows, counts.tolist(), prefix)

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
    offsets: torch.Tensor
    """[B + 1] offsets of each sequence's rows among the R (nested attention's queries)."""

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
        offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        return cls(rows, grid_index, positions.view(b, lq), cls_rows, lq, offsets)

    def to_grid(self, x: torch.Tensor, batch_size: int) -> torch.Tensor:
        grid = x.new_zeros(batch_size * self.lq, x.shape[-1])
        grid.index_copy_(0, self.grid_index, x)
        return grid.view(batch_size, self.lq, x.shape[-1])

    def from_grid(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1]).index_select(0, self.grid_index)
