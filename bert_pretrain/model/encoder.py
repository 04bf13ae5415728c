"""Embeddings, transformer layers, encoder and pooler, with transformers' module names so the
state dict is a drop-in for `transformers.BertModel`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import BertSelfAttention
from .config import BertConfig, ModelImpl
from .dropout import Dropout
from .layout import QuerySubset, TokenLayout


def activation(name: str):
    """Activation by transformers' name (gelu is the exact erf form, gelu_new the tanh one)."""
    if name == "gelu":
        return F.gelu
    if name == "gelu_new":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    if name in ("silu", "swish"):
        return F.silu
    if name == "mish":
        return F.mish
    raise ValueError(f"unknown activation {name!r}")  # BertConfig validates first


UNUSED_POSITION_KEY = "position_embeddings.weight"


def add_unused_position_table(state: dict, config: BertConfig) -> dict:
    """transformers 4.x holds `bert.embeddings.position_embeddings.weight` also for relative
    position types, a table it creates and never reads (ours has no such parameter: DDP refuses
    unused ones): for its key set, add it as zeros."""
    if config.position_embedding_type != "absolute":
        ref = state["bert.embeddings.word_embeddings.weight"]
        state["bert.embeddings." + UNUSED_POSITION_KEY] = torch.zeros(
            config.max_position_embeddings, config.hidden_size, dtype=ref.dtype,
            device=ref.device)
    return state


def _drop_unused_position_table(state_dict, prefix, *args) -> None:
    """Relative-position models: transformers' (and older checkpoints') unused absolute table."""
    state_dict.pop(prefix + UNUSED_POSITION_KEY, None)


class BertEmbeddings(nn.Module):
    """word + position (absolute only) + token type, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig, impl: ModelImpl):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size,
                                            padding_idx=config.pad_token_id)
        self.absolute = config.position_embedding_type == "absolute"
        if self.absolute:
            # Only absolute positions have a table here.  transformers 4.x also creates it for
            # relative types and never reads it; a parameter outside the forward pass stops DDP
            # ("Expected to have finished reduction in the prior iteration"), so ours has none:
            # BertForPreTraining.hf_state_dict() adds the key for transformers, and loading a
            # state dict that has it drops it (below).
            self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                    config.hidden_size)
        else:
            self._register_load_state_dict_pre_hook(_drop_unused_position_table)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob, impl.fast_dropout)
        self.max_position_embeddings = config.max_position_embeddings

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
                layout: TokenLayout) -> torch.Tensor:
        b, n = layout.batch_size, layout.seq_len
        if n > self.max_position_embeddings:
            raise ValueError(f"sequence length {n} exceeds max_position_embeddings "
                             f"{self.max_position_embeddings}; shorten the inputs")
        ids = layout.select(input_ids)
        x = self.word_embeddings(ids)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(layout.select(token_type_ids))
        x = x if layout.unpadded else x.view(b, n, -1)
        if self.absolute:
            if layout.unpadded:
                x = x + self.position_embeddings(layout.indices % n)
            else:
                x = x + self.position_embeddings.weight[:n]
        return self.dropout(self.LayerNorm(x))


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig, impl: ModelImpl):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob, impl.fast_dropout)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig, impl: ModelImpl):
        super().__init__()
        self.self = BertSelfAttention(config, impl)
        self.output = BertSelfOutput(config, impl)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self, config: BertConfig, impl: ModelImpl):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob, impl.fast_dropout)


class BertLayer(nn.Module):
    """Attention + FFN. Post-LN (BERT): x = LN(x + f(x)). Pre-LN: x = x + f(LN(x)), reusing the
    same two LayerNorms (attention.output.LayerNorm before attention, output.LayerNorm before
    the FFN).

    With `impl.compile` the two blocks around attention (output projection, dropout, residual,
    LayerNorm; the FFN) are compiled with torch.compile: they are where fusing pays (bias, GELU,
    dropout, residual and LayerNorm in a few kernels) and their shapes are [rows, H] with one
    dynamic dimension.  Attention itself stays eager: its layout (groups, nested tensors, the
    planner's Python) changes every batch and would recompile."""

    def __init__(self, config: BertConfig, impl: ModelImpl):
        super().__init__()
        self.attention = BertAttention(config, impl)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config, impl)
        self.pre_layer_norm = config.pre_layer_norm
        self._compiled = None
        if impl.compile:
            self._compiled = (torch.compile(self.after_attention, dynamic=True),
                              torch.compile(self.feed_forward, dynamic=True))

    def after_attention(self, context: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The attention block's output projection, dropout, residual (and post-LN norm)."""
        out = self.attention.output
        if self.pre_layer_norm:
            return residual + out.dropout(out.dense(context))
        return out.LayerNorm(out.dropout(out.dense(context)) + residual)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN block with its residual and norm."""
        out = self.output
        if self.pre_layer_norm:
            return x + out.dropout(out.dense(self.intermediate(out.LayerNorm(x))))
        return out.LayerNorm(out.dropout(out.dense(self.intermediate(x))) + x)

    def forward(self, x: torch.Tensor, layout: TokenLayout, output_attentions: bool = False,
                subset: QuerySubset | None = None):
        """Returns the layer output for every token, or for `subset.rows` only."""
        attention_in = self.attention.output.LayerNorm(x) if self.pre_layer_norm else x
        context, probs = self.attention.self(attention_in, layout, output_attentions, subset)
        residual = x if subset is None else \
            x.reshape(-1, x.shape[-1]).index_select(0, subset.rows)
        after_attention, feed_forward = self._compiled or (self.after_attention,
                                                           self.feed_forward)
        return feed_forward(after_attention(context, residual)), probs


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig, impl: ModelImpl):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, impl)
                                   for _ in range(config.num_hidden_layers))
        if config.pre_layer_norm:
            # Pre-LN leaves the residual stream un-normalised; normalise once at the end.
            self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gradient_checkpointing = impl.gradient_checkpointing

    def forward(self, x: torch.Tensor, layout: TokenLayout, output_attentions: bool = False,
                output_hidden_states: bool = False, subset: QuerySubset | None = None):
        """`subset`: the last layer computes only those rows (see QuerySubset)."""
        hidden_states = [x] if output_hidden_states else None
        attentions = [] if output_attentions else None
        last = len(self.layer) - 1
        for i, layer in enumerate(self.layer):
            rows = subset if i == last else None
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # Non-reentrant checkpointing restores the RNG state, so dropout masks in the
                # recomputation equal the first pass and gradients equal the plain path.  Its
                # check that the recomputation saved tensors of the same shapes reads each
                # tensor's sizes, which the nested tensors that SDPA saves have none of
                # ("NestedTensorImpl doesn't support sizes"): off for a nested layer, whose
                # recomputation replays the same inputs and RNG all the same.
                nested = layer.attention.self.path(x.device.type, output_attentions).grid \
                    == "nested"
                x, probs = checkpoint(layer, x, layout, output_attentions, rows,
                                      use_reentrant=False,
                                      determinism_check="none" if nested else "default")
            else:
                x, probs = layer(x, layout, output_attentions, rows)
            if output_hidden_states:
                hidden_states.append(x)
            if output_attentions:
                attentions.append(probs)
        if hasattr(self, "LayerNorm"):
            x = self.LayerNorm(x)
            if output_hidden_states:
                hidden_states[-1] = x
        return x, hidden_states, attentions


class BertPooler(nn.Module):
    """tanh(W h_[CLS] + b): the sentence vector the NSP head reads."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, layout: TokenLayout,
                subset: QuerySubset | None = None) -> torch.Tensor:
        if subset is not None:
            first = x.index_select(0, subset.cls_rows)
        elif layout.unpadded:
            first = x.index_select(0, layout.cls_rows)
        else:
            first = x[:, 0]
        return torch.tanh(self.dense(first))
