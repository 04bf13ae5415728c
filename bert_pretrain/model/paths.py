"""Which attention path runs: the one resolution of the speed switches (`ModelImpl`) against the
model and the training options, used by the layers (attention.py) and by the start-up line
(`describe`), and the pairs refused at start-up (`check_pairs`).

docs/model.md ("Speed switches against model and trainer options") is the matrix this encodes;
tests/test_switch_matrix.py runs every pair against the plain path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import BertConfig, ModelImpl

GRID_NAMES = {"nested": "nested tensors", "groups": "length groups", "off": "padded grid"}
PRODUCT_NAMES = {"sdpa": "sdpa", "eager": "explicit product"}


@dataclass(frozen=True)
class AttentionPath:
    grid: str
    """"nested", "groups" or "off" (the padded grid); a batch without padding, or whose real
    tokens are not a prefix (groups), still takes the padded grid (BertSelfAttention.varlen_mode)."""
    product: str
    """"sdpa" or "eager" (the explicit softmax(QK^T)V) on the groups and the padded grid (a
    nested layer's batch without padding too); nested tensors always go through SDPA."""


def attention_path(impl: ModelImpl, device_type: str, *, score_bias: bool, dropout: bool,
                   output_attentions: bool = False) -> AttentionPath:
    """The path of one attention call on `device_type`: `score_bias` when relative positions
    or the locality bias add to the scores, `dropout` when it trains with attention dropout,
    `output_attentions` when the maps are asked for (they cover the padded grid and come from
    the explicit product)."""
    grid = "off" if output_attentions else impl.resolved_varlen_attention(device_type)
    if grid == "nested" and score_bias:
        grid = "off"  # the fused variable-length kernels take no score bias
    product = "eager" if output_attentions else impl.resolved_attention(device_type, dropout)
    return AttentionPath(grid, product)


def check_pairs(impl: ModelImpl) -> None:
    """Refuse, in one line naming the pair and what to use instead, the switch pairs that
    cannot do what they say (every other pair of docs/model.md's matrix runs, equal to the
    plain path)."""
    if impl.unpad is False and impl.varlen_attention in ("groups", "nested"):
        raise ValueError(
            f"impl.varlen_attention={impl.varlen_attention} with impl.unpad=false: attention "
            f"over real tokens needs the unpadded layout; set impl.unpad=true, or "
            f"impl.varlen_attention=off (or auto) for the padded grid")


def _path_words(path: AttentionPath) -> str:
    if path.grid == "nested":
        return "nested tensors + sdpa"
    return f"{GRID_NAMES[path.grid]} + {PRODUCT_NAMES[path.product]}"


def describe(impl: ModelImpl, config: BertConfig | None, device_type: str, *,
             dropout: bool = True, locality: str | None = None) -> str:
    """The switches as they act on `device_type` for a training run of `config` (None: a model
    of absolute positions), for the run's start-up line.  `locality`: while the training-time
    locality bias is on, in words (e.g. "first 45% of steps"); None: never."""
    varlen = impl.resolved_varlen_attention(device_type)
    attention = impl.resolved_attention(device_type, dropout)
    relative = config is not None and config.position_embedding_type != "absolute"
    plain = attention_path(impl, device_type, score_bias=relative, dropout=dropout)
    runs = _path_words(plain)
    if relative and varlen == "nested":
        runs += (f" ({config.position_embedding_type} positions are a score bias, which "
                 f"nested tensors do not take)")
    # (an ELECTRA encoder scores every token: no layer of it computes only the labelled rows)
    sparse_last = impl.resolved_sparse_last_layer(device_type) and not (
        config is not None and config.generator_layers)
    if plain.grid == "groups" and impl.sparse_prediction and sparse_last:
        runs += " (the last layer's labelled rows: padded grid)"
    if locality is not None:
        biased = attention_path(impl, device_type, score_bias=True, dropout=dropout)
        if biased != plain:
            runs = f"{_path_words(biased)} while the locality bias is on ({locality}), then {runs}"
    unpadded = impl.resolved_unpad(device_type)
    parts = [
        ("unpadded" if unpadded else "padded")
        + (f" (auto on {device_type})" if impl.unpad == "auto" else ""),
        f"varlen_attention={varlen}"
        + (f" (auto on {device_type})" if impl.varlen_attention == "auto" and unpadded
           else ""),
        f"attention={attention}" + (f" (auto on {device_type})" if impl.attention == "auto"
                                    else " (with dropout on cpu)" if attention != impl.attention
                                    else "")
        + f": runs {runs}",
        "sparse prediction" + (" + last layer" if sparse_last else "")
        if impl.sparse_prediction else "dense prediction",
    ]
    if impl.resolved_fused_qkv(device_type):
        parts.append("fused qkv" + (f" (auto on {device_type})" if impl.fused_qkv == "auto"
                                    else ""))
    if impl.fast_dropout and device_type == "cpu":
        parts.append("fast dropout")
    if impl.gradient_checkpointing:
        parts.append("gradient checkpointing")
    if impl.compile:
        parts.append("torch.compile")
    return ", ".join(parts)
