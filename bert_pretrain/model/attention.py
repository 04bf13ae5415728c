"""Multi-head self-attention with transformers' parameter names (query / key / value).

The product itself goes through `F.scaled_dot_product_attention`, which picks fused
(flash / memory-efficient) kernels on GPUs; relative positions enter it as a float bias.  The
explicit path (softmax(QK^T / sqrt(d)) V) is used when attention maps are requested or
`impl.attention == "eager"`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import BertConfig, ModelImpl
from .dropout import dropout
from .layout import TokenLayout


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig, impl: ModelImpl):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        self.hidden_size = config.hidden_size
        self.dropout_prob = config.attention_probs_dropout_prob
        self.fused_qkv = impl.fused_qkv
        self.attention_impl = impl.attention
        self.fast_dropout = impl.fast_dropout
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.position_embedding_type = config.position_embedding_type
        if self.position_embedding_type != "absolute":
            # One learned vector per clipped distance in [-(P-1), P-1], as transformers 4.x.
            self.max_position_embeddings = config.max_position_embeddings
            self.distance_embedding = nn.Embedding(2 * config.max_position_embeddings - 1,
                                                   self.head_size)

    def _project(self, hidden: torch.Tensor, layout: TokenLayout):
        """Q, K, V as [B, heads, L, d] on the padded grid."""
        b, n, h, d = layout.batch_size, layout.seq_len, self.num_heads, self.head_size
        if self.fused_qkv:
            # One GEMM with a 3x wider output instead of three; the concatenated weight is rebuilt
            # each call (cheap next to the GEMM) so the parameters keep transformers' names.
            weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])
            bias = torch.cat([self.query.bias, self.key.bias, self.value.bias])
            qkv = layout.to_grid(F.linear(hidden, weight, bias)).view(b, n, 3, h, d)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            return q, k, v
        return tuple(
            layout.to_grid(proj(hidden)).view(b, n, h, d).transpose(1, 2)
            for proj in (self.query, self.key, self.value)
        )

    def _relative_bias(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Score bias [B, heads, L, L] from relative positions, already divided by sqrt(d)."""
        n = q.shape[-2]
        pos = torch.arange(n, device=q.device)
        distance = pos[:, None] - pos[None, :] + (self.max_position_embeddings - 1)
        table = self.distance_embedding(distance).to(q.dtype)  # [L, L, d]
        bias = torch.einsum("bhld,lrd->bhlr", q, table)
        if self.position_embedding_type == "relative_key_query":
            bias = bias + torch.einsum("bhrd,lrd->bhlr", k, table)
        return bias / math.sqrt(self.head_size)

    def forward(self, hidden: torch.Tensor, layout: TokenLayout,
                output_attentions: bool = False):
        q, k, v = self._project(hidden, layout)
        bias = None
        if self.position_embedding_type != "absolute":
            bias = self._relative_bias(q, k)
        dropout_p = self.dropout_prob if self.training else 0.0
        # On CPU, SDPA with dropout runs the unfused math path anyway; the explicit path does the
        # same work with the cheaper dropout (and one fewer pass for the mask).
        explicit = (output_attentions or self.attention_impl == "eager"
                    or (dropout_p > 0 and self.fast_dropout and q.device.type == "cpu"))
        probs = None
        if explicit:
            # Scale q (L x d) rather than the scores (L x L); add the mask bias in place.
            scores = torch.matmul(q * (1.0 / math.sqrt(self.head_size)), k.transpose(-1, -2))
            if bias is not None:
                scores = scores + bias
            if layout.key_mask is not None:
                scores = scores.masked_fill_(~layout.key_mask, torch.finfo(scores.dtype).min)
            probs = torch.softmax(scores, dim=-1)
            context = torch.matmul(dropout(probs, dropout_p, self.training, self.fast_dropout), v)
        else:
            mask = layout.key_mask
            if bias is not None:
                mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        context = context.transpose(1, 2).reshape(layout.batch_size, layout.seq_len,
                                                  self.hidden_size)
        return layout.from_grid(context), (probs if output_attentions else None)
