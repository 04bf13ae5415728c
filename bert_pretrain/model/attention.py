"""Multi-head self-attention with transformers' parameter names (query / key / value).

On GPUs the product goes through `F.scaled_dot_product_attention`, which picks fused
(flash / memory-efficient) kernels; relative positions enter it as a float bias.  The explicit
path (softmax(QK^T / sqrt(d)) V) is used when attention maps are requested, with
`impl.attention == "eager"`, and on CPUs with `auto` (the default): there SDPA's flash kernel
is slower than two batched matmuls in bf16 and no faster in fp32, and with dropout SDPA would
run its own unfused math path anyway, where the explicit one can use the cheaper dropout.

Which grid the product runs on (`impl.varlen_attention`, resolved per device): the batch's
padded [B, heads, L, L] grid, length groups each on their own smaller grid, or nested (jagged)
tensors, where SDPA runs each sequence at its own length.
"""

from __future__ import annotations

import logging
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .config import BertConfig, ModelImpl
from .dropout import dropout
from .layout import QuerySubset, TokenLayout
from .paths import AttentionPath, attention_path


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig, impl: ModelImpl):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        self.hidden_size = config.hidden_size
        self.dropout_prob = config.attention_probs_dropout_prob
        self.fast_dropout = impl.fast_dropout
        self.impl = impl
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.position_embedding_type = config.position_embedding_type
        if self.position_embedding_type != "absolute":
            # One learned vector per clipped distance in [-(P-1), P-1], as transformers 4.x.
            self.max_position_embeddings = config.max_position_embeddings
            self.distance_embedding = nn.Embedding(2 * config.max_position_embeddings - 1,
                                                   self.head_size)
        # Per-head slopes of a training-time locality bias (BertForPreTraining.
        # set_attention_locality); None: no bias, the model is BERT.
        self.locality_slopes: torch.Tensor | None = None

    def _qkv(self, hidden: torch.Tensor):
        """Q, K, V in `hidden`'s own shape."""
        if self.impl.resolved_fused_qkv(hidden.device.type):
            # One GEMM with a 3x wider output instead of three; the concatenated weight is rebuilt
            # each call (cheap next to the GEMM) so the parameters keep transformers' names.
            weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])
            bias = torch.cat([self.query.bias, self.key.bias, self.value.bias])
            return F.linear(hidden, weight, bias).chunk(3, dim=-1)
        return tuple(proj(hidden) for proj in (self.query, self.key, self.value))

    def _project(self, hidden: torch.Tensor, layout: TokenLayout):
        """Q, K, V as [B, heads, L, d] on the padded grid."""
        return tuple(layout.to_heads(x, self.num_heads) for x in self._qkv(hidden))

    def _relative_bias(self, q: torch.Tensor, k: torch.Tensor,
                       q_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Score bias [B, heads, Lq, L] from relative positions, already divided by sqrt(d).
        `q_positions` [B, Lq]: positions of the queries when they are a subset (else 0..L-1)."""
        n = k.shape[-2]
        pos = torch.arange(n, device=q.device)
        offset = self.max_position_embeddings - 1
        if q_positions is None:
            table = self.distance_embedding(pos[:, None] - pos[None, :] + offset).to(q.dtype)
            bias = torch.einsum("bhld,lrd->bhlr", q, table)  # table: [L, L, d]
            if self.position_embedding_type == "relative_key_query":
                bias = bias + torch.einsum("bhrd,lrd->bhlr", k, table)
        else:
            distance = q_positions[:, :, None] - pos[None, None, :] + offset
            table = self.distance_embedding(distance).to(q.dtype)  # [B, Lq, L, d]
            bias = torch.einsum("bhld,blrd->bhlr", q, table)
            if self.position_embedding_type == "relative_key_query":
                bias = bias + torch.einsum("bhrd,blrd->bhlr", k, table)
        return bias / math.sqrt(self.head_size)

    def _locality_bias(self, n: int, device, dtype,
                       q_positions: torch.Tensor | None = None) -> torch.Tensor:
        """-slope_h * |i - j| for head h ([1 or B, heads, Lq, L]): attention starts out local,
        except the first position's ([CLS]) queries, which read the whole input for NSP.
        `q_positions` [B, Lq]: positions of the queries when they are a subset."""
        pos = torch.arange(n, device=device)
        slopes = self.locality_slopes.to(device=device, dtype=dtype)[None, :, None, None]
        if q_positions is None:
            distance = (pos[:, None] - pos[None, :]).abs() * (pos[:, None] > 0)
            distance = distance[None, None]
        else:
            distance = (q_positions[:, :, None] - pos[None, None, :]).abs() * \
                (q_positions[:, :, None] > 0)
            distance = distance[:, None]
        return -(slopes * distance.to(dtype))

    def _score_bias(self, q, k, q_positions=None) -> torch.Tensor | None:
        """What is added to q k^T / sqrt(d) besides the padding mask: relative positions and the
        locality bias, where either is on."""
        bias = None
        if self.position_embedding_type != "absolute":
            bias = self._relative_bias(q, k, q_positions)
        if self.locality_slopes is not None:
            local = self._locality_bias(k.shape[-2], q.device, q.dtype, q_positions)
            bias = local if bias is None else bias + local
        return bias

    def _project_subset(self, hidden: torch.Tensor, layout: TokenLayout, subset: QuerySubset):
        """Q for the subset rows on the [B, Lq] query grid; K, V for all tokens."""
        b, h, d = layout.batch_size, self.num_heads, self.head_size
        q = subset.to_grid(self.query(hidden.reshape(-1, self.hidden_size)
                                      .index_select(0, subset.rows)), b)
        q = q.view(b, subset.lq, h, d).transpose(1, 2)
        k, v = (layout.to_heads(proj(hidden), h) for proj in (self.key, self.value))
        return q, k, v

    def _attend(self, q, k, v, bias, key_mask, key_bias, explicit: bool):
        """softmax(q k^T / sqrt(d) + bias + mask) v on one grid; returns (context, probs)."""
        dropout_p = self.dropout_prob if self.training else 0.0
        if explicit:
            # Scale q (L x d) rather than the scores (L x L); add the mask bias in place.
            scores = torch.matmul(q * (1.0 / math.sqrt(self.head_size)), k.transpose(-1, -2))
            if bias is not None:
                scores = scores + bias
            if key_mask is not None:
                scores = scores.add_(key_bias(scores.dtype))
            probs = torch.softmax(scores, dim=-1)
            return torch.matmul(dropout(probs, dropout_p, self.training, self.fast_dropout),
                                v), probs
        mask = key_mask
        if bias is not None:
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p), None

    def path(self, device_type: str, output_attentions: bool = False) -> AttentionPath:
        """This call's grid and product (paths.attention_path: the one rule, which the
        start-up line says too)."""
        return attention_path(
            self.impl, device_type,
            score_bias=self.position_embedding_type != "absolute"
            or self.locality_slopes is not None,
            dropout=self.training and self.dropout_prob > 0, output_attentions=output_attentions)

    def _explicit(self, output_attentions: bool, device: torch.device) -> bool:
        return self.path(device.type, output_attentions).product == "eager"

    def _forward_groups(self, hidden: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """Attention on real tokens only: each length group on its own grid (TokenLayout)."""
        h = self.num_heads
        q, k, v = self._qkv(hidden)
        explicit = self._explicit(False, hidden.device)
        groups = layout.attention_groups(h)
        contexts = []
        for group in groups:
            qg, kg, vg = (layout.group_to_heads(x, group, h) for x in (q, k, v))
            bias = self._score_bias(qg, kg)
            context, _ = self._attend(qg, kg, vg, bias, group.key_mask, group.key_bias, explicit)
            contexts.append(context)
        return layout.groups_from_heads(contexts, groups)

    def _forward_nested(self, hidden: torch.Tensor, layout: TokenLayout,
                        subset: QuerySubset | None) -> torch.Tensor:
        """Attention on real tokens only, every sequence at its own length: the [N, H] rows as
        nested (jagged) tensors [B, heads, j, d] for SDPA, which on CUDA runs a fused
        variable-length kernel over them (no padding, no per-batch shapes to plan).  With a
        query subset, the queries are the subset's rows of each sequence."""
        h, d = self.num_heads, self.head_size
        offsets, lengths = layout.nested_offsets(), layout.lengths
        if subset is None:
            q, k, v = self._qkv(hidden)
            q_offsets, q_lengths = offsets, (min(lengths), max(lengths))
        else:
            q = self.query(hidden.index_select(0, subset.rows))
            k, v = self.key(hidden), self.value(hidden)
            q_offsets, q_lengths = subset.offsets, (1, subset.lq)

        def jagged(x, offs, bounds):
            # (fused_qkv's chunks are strided views: the kernels need contiguous rows)
            return torch.nested.nested_tensor_from_jagged(
                x.contiguous().view(-1, h, d), offs, min_seqlen=bounds[0], max_seqlen=bounds[1]
            ).transpose(1, 2)

        dropout_p = self.dropout_prob if self.training else 0.0
        with _quiet_nested(hidden.device):
            out = F.scaled_dot_product_attention(
                jagged(q, q_offsets, q_lengths), jagged(k, offsets, (min(lengths), max(lengths))),
                jagged(v, offsets, (min(lengths), max(lengths))), dropout_p=dropout_p)
        return out.transpose(1, 2).values().reshape(-1, self.hidden_size)

    def varlen_mode(self, layout: TokenLayout, device_type: str, output_attentions: bool = False,
                    subset: QuerySubset | None = None) -> str:
        """The grid this call attends on: "nested", "groups" or "off" (the padded grid)."""
        if not layout.unpadded or layout.key_mask is None:
            return "off"  # nothing padded: nothing to skip
        mode = self.path(device_type, output_attentions).grid
        if mode == "groups" and (subset is not None or not layout.right_padded):
            return "off"
        return mode

    def forward(self, hidden: torch.Tensor, layout: TokenLayout,
                output_attentions: bool = False, subset: QuerySubset | None = None):
        """Context for every token in `layout` order, or for `subset.rows` only ([R, H])."""
        mode = self.varlen_mode(layout, hidden.device.type, output_attentions, subset)
        if mode == "nested":
            return self._forward_nested(hidden, layout, subset), None
        if mode == "groups":
            return self._forward_groups(hidden, layout), None
        if subset is None:
            q, k, v = self._project(hidden, layout)
        else:
            q, k, v = self._project_subset(hidden, layout, subset)
        bias = self._score_bias(q, k, None if subset is None else subset.positions)
        explicit = self._explicit(output_attentions, q.device)
        context, probs = self._attend(q, k, v, bias, layout.key_mask, layout.key_bias, explicit)
        if subset is None:
            context = layout.from_heads(context)
        else:
            context = subset.from_grid(context.transpose(1, 2).reshape(
                layout.batch_size, subset.lq, self.hidden_size))
        return context, (probs if output_attentions else None)


class _quiet_nested:
    """On CPU, SDPA on nested tensors runs a reference path that converts them to torch's
    older nested layout and warns that it is a prototype (and torch.fx logs a notice the first
    time): neither says anything the user can act on.  Elsewhere it does nothing: entering
    warnings.catch_warnings in every layer of every step would cost time and reset Python's
    record of warnings already shown, so that any warning of the loop repeated every step."""

    def __init__(self, device: torch.device):
        self.cpu = device.type == "cpu"

    def __enter__(self):
        if not self.cpu:
            return self
        self.fx_log = logging.getLogger("torch.fx._symbolic_trace")
        self.level = self.fx_log.level
        self.fx_log.setLevel(logging.ERROR)
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
        return self

    def __exit__(self, *exc):
        if self.cpu:
            self.warnings.__exit__(*exc)
            self.fx_log.setLevel(self.level)
        return False
