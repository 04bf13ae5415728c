"""Model configuration: `BertConfig` (knobs that change results) and `ModelImpl` (knobs that only
change speed).

`BertConfig` uses the field names of `transformers.BertConfig`, so exporting is a copy and the
presets under `conf/model/` read like Hugging Face `config.json` files.  `ModelImpl` (`conf/impl/`)
never changes what the model computes beyond float rounding; the tests check each switch against
the plain path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .paths import check_pairs

ACTIVATIONS = ("gelu", "gelu_new", "relu", "silu", "swish", "mish")
POSITION_EMBEDDING_TYPES = ("absolute", "relative_key", "relative_key_query")
ATTENTION_IMPLS = ("auto", "sdpa", "eager")
VARLEN_ATTENTION = ("auto", "groups", "nested", "off")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _from_mapping(cls, values: Mapping[str, Any], what: str):
    """Build a dataclass from a plain mapping, naming unknown keys instead of a TypeError."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(
            f"unknown {what} key(s) {unknown}; valid keys are: {', '.join(sorted(names))}"
        )
    return cls(**dict(values))


@dataclass
class BertConfig:
    """Architecture of a BERT encoder with pretraining heads (field names = transformers')."""

    vocab_size: int | None = 30522
    """WordPiece vocabulary size. The presets leave it null: the trainer fills it in from the
    prepared data's manifest.json, so the embedding matrix always matches the tokenizer."""
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    """gelu (exact erf), gelu_new (tanh approximation), relu, silu / swish, mish."""
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    initializer_range: float = 0.02
    position_embedding_type: str = "absolute"
    """absolute (learned table added to the embeddings, BERT), relative_key (Shaw et al. 2018) or
    relative_key_query (Huang et al. 2020): a learned table of clipped distances per layer that
    biases the attention scores, as transformers 4.x implemented it."""
    pre_layer_norm: bool = False
    """False: post-LN, as BERT. True: LayerNorm before attention and FFN, plus a final LayerNorm
    (`bert.encoder.LayerNorm`); more stable at high learning rates, no transformers equivalent."""
    next_sentence_prediction: bool = True
    """True: BERT's pooler and NSP head (state dict = transformers' BertForPreTraining). False:
    masked-LM only, as RoBERTa: no pooler, no NSP head (nothing in the model that the loss does
    not reach, which DDP requires), and the state dict is exactly transformers'
    BertForMaskedLM's. The trainer takes it from the prepared data when the preset leaves it
    out (MLM-only data: false)."""
    generator_layers: int = 0
    """0: masked-LM pretraining (BERT). N > 0: ELECTRA's replaced-token detection (Clark et al.
    2020): a generator of N layers, sharing the embeddings and owning the MLM head, fills the
    masked positions with tokens sampled from its predictions, and the encoder learns, at every
    token, whether it was replaced, so it learns from every token instead of ~15%. The encoder
    (`bert.*`) is what fine-tuning and `bert-export --head encoder` take; the MLM head belongs to
    the generator (fill-mask runs the generator). Not a transformers BertConfig field."""

    def __post_init__(self) -> None:
        _check(
            self.vocab_size is not None,
            "model.vocab_size is null: set it, or let the trainer take it from the prepared "
            "data's manifest.json",
        )
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"model.{name} must be a positive integer, got {value!r}",
            )
        _check(
            self.hidden_size % self.num_attention_heads == 0,
            f"model.hidden_size ({self.hidden_size}) must be divisible by "
            f"model.num_attention_heads ({self.num_attention_heads}); pick a head count that "
            f"divides it (e.g. hidden_size // 64)",
        )
        _check(
            self.hidden_act in ACTIVATIONS,
            f"model.hidden_act {self.hidden_act!r} is not supported; use one of "
            f"{', '.join(ACTIVATIONS)}",
        )
        _check(
            self.position_embedding_type in POSITION_EMBEDDING_TYPES,
            f"model.position_embedding_type {self.position_embedding_type!r} is not supported; "
            f"use one of {', '.join(POSITION_EMBEDDING_TYPES)}",
        )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            _check(
                isinstance(value, (int, float)) and 0.0 <= value < 1.0,
                f"model.{name} must be in [0, 1), got {value!r}",
            )
        _check(
            isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0,
            f"model.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}",
        )
        _check(
            isinstance(self.initializer_range, (int, float)) and self.initializer_range > 0,
            f"model.initializer_range must be > 0, got {self.initializer_range!r}",
        )
        _check(
            isinstance(self.pad_token_id, int) and 0 <= self.pad_token_id < self.vocab_size,
            f"model.pad_token_id ({self.pad_token_id!r}) must be a token id in "
            f"[0, vocab_size={self.vocab_size})",
        )
        _check(
            isinstance(self.generator_layers, int) and not isinstance(self.generator_layers, bool)
            and self.generator_layers >= 0,
            f"model.generator_layers must be an integer >= 0 (0 = masked-LM, N = an ELECTRA "
            f"generator of N layers), got {self.generator_layers!r}",
        )
        for name in ("pre_layer_norm", "next_sentence_prediction"):
            _check(isinstance(getattr(self, name), bool),
                   f"model.{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], **overrides: Any) -> BertConfig:
        """From a plain mapping (e.g. `OmegaConf.to_container(cfg.model)`); unknown keys are an
        error that lists the valid ones. `overrides` win, e.g. `vocab_size=manifest[...]`."""
        return _from_mapping(cls, {**values, **overrides}, "model")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_hf_dict(self) -> dict[str, Any]:
        """A dict that `transformers.BertConfig(**d)` accepts, for `config.json` on export.

        relative_key / relative_key_query are kept in `position_embedding_type`, which
        transformers 4.x reads; transformers 5 dropped relative positions from BERT and would
        silently build an absolute-position model, so such checkpoints need transformers < 5.
        """
        _check(
            not self.pre_layer_norm,
            "model.pre_layer_norm=true has no transformers BertConfig equivalent; only post-LN "
            "models can be exported to Hugging Face",
        )
        # The generator is a pretraining device: what transformers gets is the encoder.
        values = {k: v for k, v in self.to_dict().items() if k != "generator_layers"}
        return {
            **values,
            "architectures": ["BertForPreTraining" if self.next_sentence_prediction
                              else "BertForMaskedLM"],
            "model_type": "bert",
            "tie_word_embeddings": True,
        }


@dataclass
class ModelImpl:
    """Speed-only switches (`conf/impl/`): none of them changes results beyond float rounding."""

    sparse_prediction: bool = True
    """With labels: run the MLM transform and the vocabulary projection only on labelled
    positions (~15%). The full-vocab projection dominates small models' steps."""
    sparse_last_layer: bool | str = "auto"
    """With sparse prediction: the last layer computes its query projection, attention output,
    FFN and LayerNorms only for the labelled positions and [CLS] (all that is read after it);
    keys and values still come from every token. auto: on CPUs, not on GPUs
    (`resolved_sparse_last_layer`)."""
    unpad: bool | str = "auto"
    """Drop padding tokens before the projections, FFN and LayerNorms; pad again only around the
    attention product itself. auto: on CPUs, and wherever `varlen_attention` is groups or
    nested (they need it); not on GPUs otherwise (`resolved_unpad`)."""
    varlen_attention: str = "auto"
    """With unpad: how attention reaches the real tokens.
    groups: sequences grouped by length (a small cost model picks the groups), each group
    attended on its own grid padded to its longest sequence;
    nested: every sequence at its own length through SDPA on nested (jagged) tensors, which on
    CUDA runs a fused variable-length kernel (flash / memory-efficient) with no padding at all
    (models with relative positions or the locality bias need a score bias, which those
    kernels do not take: they use the padded grid);
    off: every sequence padded to the batch's length, one [B, heads, L, L] product (SDPA's
    fused kernels on a GPU);
    auto: what measured fastest on the device: off, on CPUs and GPUs alike
    (`resolved_varlen_attention`).
    true / false are read as groups / off (their meaning before `nested` and `auto`)."""
    fused_qkv: bool | str = "auto"
    """One [3H, H] projection for query/key/value instead of three (same parameters). auto: on
    GPUs, not on CPUs (`resolved_fused_qkv`)."""
    fast_dropout: bool = True
    """CPU only: dropout masks from raw 31-bit random integers instead of torch's float
    Bernoulli sampler (same drop probability, ~1.5x cheaper; see dropout.py)."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in backward: less memory, ~1/3 more compute."""
    attention: str = "auto"
    """auto: sdpa on GPUs, eager on CPUs; sdpa: torch.nn.functional.scaled_dot_product_attention
    (fused kernels on GPU); eager: the explicit softmax(QK^T)V path (always used when attention
    maps are requested). On CPU, SDPA without dropout runs its flash kernel, which in bf16 made
    whole training steps 1.16-1.21x slower than the explicit path (BERT-mini/base, seq 128/512)
    and gained nothing in fp32 (docs/benchmarks.md)."""

    compile: bool = False
    """torch.compile the model (inductor) in bert-train and bert-finetune: the first steps
    compile (tens of seconds; again whenever the shapes change in ways it has not seen), later
    ones run fused kernels. docs/gpu.md ("torch.compile") says when it pays."""

    def __post_init__(self) -> None:
        if isinstance(self.varlen_attention, bool):
            self.varlen_attention = "groups" if self.varlen_attention else "off"
        _check(
            self.varlen_attention in VARLEN_ATTENTION,
            f"impl.varlen_attention {self.varlen_attention!r} is not supported; use one of "
            f"{', '.join(VARLEN_ATTENTION)} (or true / false: groups / off)",
        )
        for name in ("sparse_last_layer", "fused_qkv", "unpad"):
            value = getattr(self, name)
            _check(isinstance(value, bool) or value == "auto",
                   f"impl.{name} must be true, false or auto, got {value!r}")
        for name in ("sparse_prediction", "fast_dropout", "gradient_checkpointing",
                     "compile"):
            value = getattr(self, name)
            _check(isinstance(value, bool), f"impl.{name} must be true or false, got {value!r}")
        _check(
            self.attention in ATTENTION_IMPLS,
            f"impl.attention {self.attention!r} is not supported; use one of "
            f"{', '.join(ATTENTION_IMPLS)}",
        )
        check_pairs(self)

    def resolved_varlen_attention(self, device_type: str) -> str:
        """What `varlen_attention` does on a device type ("cpu", "cuda", ...): `auto` is `off`,
        the padded grid for the attention product, on every device. On an H100 it was 6x faster
        than the groups (BERT-base b256 L128, 0.086 vs 0.143-1.05 s a step, issue 30: every step
        brings new group shapes); on a 2-core CPU (still unpadded around the attention) it was
        1.03-1.23x faster than the groups in every shape and dtype measured, pretraining and
        fine-tuning steps, medians of 3 quiet runs, 2026-11-28 (docs/benchmarks.md): the groups'
        gain measured before the planner rebuild did not hold. Beside a busy process (one run)
        the two were even, the groups up to 9% ahead in fine-tuning. `nested` ran at 0.35-0.50x
        transformers on an H100 and an H200 (docs/gpu.md): not the default."""
        if not self.resolved_unpad(device_type):
            return "off"  # varlen needs the unpadded layout
        if self.varlen_attention != "auto":
            return self.varlen_attention
        return "off"

    def resolved_unpad(self, device_type: str) -> bool:
        """Whether `unpad` drops the padding on a device type: `auto` does on CPUs (fewer rows
        is less time there) and wherever `varlen_attention` is groups or nested, which attend
        the unpadded rows; on GPUs otherwise it keeps the padded grid: gathering and scattering
        the rows cost more than the padding's FLOPs, 1.21x, 1.20x and 1.19x the unpadded step
        at BERT-base L128 b256, BERT-large L128 b128 and BERT-large L512 b32 (H200, bf16, median
        of 3 bench runs of new batches, 2026-11-27, docs/gpu.md)."""
        if self.unpad != "auto":
            return self.unpad
        return device_type == "cpu" or self.varlen_attention in ("groups", "nested")

    def resolved_fused_qkv(self, device_type: str) -> bool:
        """Whether `fused_qkv` fuses on a device type: `auto` fuses on GPUs, where one wider
        GEMM made a BERT-base training step 1.29x faster (H100, bf16, b256 L128, one bench run,
        2026-11-26, docs/gpu.md), and not on CPUs, where the split/permute copies cost more
        than the GEMM saves (~4% slower, docs/benchmarks.md)."""
        return device_type != "cpu" if self.fused_qkv == "auto" else self.fused_qkv

    def resolved_sparse_last_layer(self, device_type: str) -> bool:
        """Whether `sparse_last_layer` thins the last layer on a device type: `auto` does on
        CPUs (fewer FLOPs is less time there) and not on GPUs, where gathering the labelled
        rows cost more than the FLOPs it saved: the full last layer made a BERT-base training
        step 1.21x faster (H100, bf16, b256 L128, one bench run, 2026-11-26, docs/gpu.md)."""
        return device_type == "cpu" if self.sparse_last_layer == "auto" \
            else self.sparse_last_layer

    def resolved_attention(self, device_type: str, dropout: bool = True) -> str:
        """The attention product `attention` runs on a device type while training with
        (`dropout`) or without attention dropout: "eager" or "sdpa".  `auto` is eager on CPUs
        (faster there, see `attention`) and sdpa elsewhere; on a CPU even `sdpa` runs eager
        when there is dropout and fast_dropout is on, because SDPA with dropout runs its unfused
        math path there: the explicit product does the same work with the cheaper dropout."""
        if self.attention == "eager":
            return "eager"
        if device_type != "cpu":
            return "sdpa"
        if self.attention == "auto" or (dropout and self.fast_dropout):
            return "eager"
        return "sdpa"

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> ModelImpl:
        return _from_mapping(cls, values or {}, "impl")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
