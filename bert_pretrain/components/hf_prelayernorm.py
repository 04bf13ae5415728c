"""Our pre-LN encoder as transformers' RoBERTa-PreLayerNorm (`model_type: roberta-prelayernorm`,
fairseq's pre-LN RoBERTa, in transformers since 4.27), both ways: `bert-export` writes it,
`hf_import` reads it back.

No transformers BERT class is pre-LN, but RoBERTa-PreLayerNorm computes exactly our pre-LN
layer (LayerNorm before attention and before the FFN, residuals around them, one LayerNorm after
the last layer) with the same embeddings, pooler and MLM head. What differs:
* names: the norm in front of attention is our `attention.output.LayerNorm` and its
  `attention.LayerNorm`; the one in front of the FFN is our `output.LayerNorm` and its
  `intermediate.LayerNorm`; the final norm is our `bert.encoder.LayerNorm` and its
  `roberta_prelayernorm.LayerNorm`; the MLM head is `lm_head.{dense,layer_norm,bias}`;
* positions: RoBERTa numbers real tokens from pad_token_id + 1 (padding gets pad_token_id), so
  its table is ours shifted down by pad_token_id + 1 rows (the rows in front are never read by a
  real token: zeros);
* it has no next-sentence head, and its MLM head applies exact GELU whatever `hidden_act` is.
Relative positions are not bridged (RoBERTa's offset positions and transformers 5, which has no
relative positions, make that a different model).
"""

from __future__ import annotations

import re

import torch

MODEL_TYPE = "roberta-prelayernorm"
PREFIX = "roberta_prelayernorm."
ARCHITECTURES = {"masked-lm": "RobertaPreLayerNormForMaskedLM",
                 "encoder": "RobertaPreLayerNormModel",
                 "sequence-classification": "RobertaPreLayerNormForSequenceClassification"}

# Inside encoder.layer.N: ours -> transformers (the attention one first: "output.LayerNorm."
# is also the tail of "attention.output.LayerNorm.").
_LAYER_NAMES = (("attention.output.LayerNorm.", "attention.LayerNorm."),
                ("output.LayerNorm.", "intermediate.LayerNorm."))
_HEAD_NAMES = {"cls.predictions.transform.dense.": "lm_head.dense.",
               "cls.predictions.transform.LayerNorm.": "lm_head.layer_norm.",
               "cls.predictions.decoder.": "lm_head.decoder.",
               "cls.predictions.bias": "lm_head.bias"}
# A fine-tuned [CLS] classifier (ours: pooler dense + tanh on the first token, dropout, linear)
# is RoBERTa's classification head (dense + tanh on the first token, dropout, out_proj); RoBERTa
# also drops out in front of its dense, which changes nothing in eval.
_CLASSIFIER_NAMES = (("bert.pooler.dense.", "classifier.dense."),
                     ("classifier.", "classifier.out_proj."))
_LAYER = re.compile(r"(encoder\.layer\.\d+\.)(.*)")
POSITIONS = "embeddings.position_embeddings.weight"


def position_offset(pad_token_id: int) -> int:
    return pad_token_id + 1


def why_not(config) -> str | None:
    """Why this model cannot be written as RoBERTa-PreLayerNorm (one line), or None."""
    if config.position_embedding_type != "absolute":
        return (f"a pre-LN model with position_embedding_type={config.position_embedding_type} "
                f"has no transformers equivalent (transformers' pre-LN model, "
                f"RoBERTa-PreLayerNorm, is exported with absolute positions only); run it with "
                f"bert-predict")
    return None


def to_hf_key(key: str) -> str | None:
    """Our state-dict key -> RoBERTa-PreLayerNorm's; None where it has no counterpart."""
    for ours, theirs in _HEAD_NAMES.items():
        if key.startswith(ours):
            return theirs + key[len(ours):]
    if not key.startswith("bert."):  # the NSP head, an ELECTRA generator: no counterpart
        return None
    rest = key[len("bert."):]
    if rest.startswith("encoder.LayerNorm."):
        return PREFIX + rest[len("encoder."):]
    return PREFIX + _rename_in_layer(rest, _LAYER_NAMES)


def from_hf_key(key: str) -> str:
    """RoBERTa-PreLayerNorm's key (with or without the model prefix) -> ours."""
    for ours, theirs in _HEAD_NAMES.items():
        if key.startswith(theirs):
            return ours + key[len(theirs):]
    rest = key[len(PREFIX):] if key.startswith(PREFIX) else key
    if rest.startswith("LayerNorm."):
        return "bert.encoder." + rest
    return "bert." + _rename_in_layer(rest, [(theirs, ours) for ours, theirs in _LAYER_NAMES])


def _rename_in_layer(key: str, names) -> str:
    """`encoder.layer.N.<old>...` -> `encoder.layer.N.<new>...` for the first (old, new) that
    fits; other keys unchanged."""
    match = _LAYER.fullmatch(key)
    if match:
        layer, inner = match.groups()
        for old, new in names:
            if inner.startswith(old):
                return layer + new + inner[len(old):]
    return key


def hf_config(config) -> dict:
    """config.json for `config` (our BertConfig, pre-LN, absolute positions)."""
    return {
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": config.hidden_act,
        "hidden_dropout_prob": config.hidden_dropout_prob,
        "attention_probs_dropout_prob": config.attention_probs_dropout_prob,
        "max_position_embeddings": (config.max_position_embeddings
                                    + position_offset(config.pad_token_id)),
        "type_vocab_size": config.type_vocab_size,
        "layer_norm_eps": config.layer_norm_eps,
        "pad_token_id": config.pad_token_id,
        "initializer_range": config.initializer_range,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
    }


def to_hf_state(state: dict, config) -> dict:
    """Our state dict -> RoBERTa-PreLayerNorm's (the NSP head, which it lacks, left out)."""
    out = {}
    offset = position_offset(config.pad_token_id)
    for key, value in state.items():
        hf_key = to_hf_key(key)
        if hf_key is None:
            continue
        if key == "bert." + POSITIONS:
            table = value.new_zeros(value.shape[0] + offset, value.shape[1])
            table[offset:] = value
            value = table
        out[hf_key] = value
    return out


def from_hf(raw: dict, tensors: dict) -> tuple[dict, dict]:
    """(config values in our names, tensors in our names) from a RoBERTa-PreLayerNorm
    config.json and its weights. Raises ValueError (one line) for what does not fit."""
    pad = raw.get("pad_token_id")
    if not isinstance(pad, int) or pad < 0:
        raise ValueError(f"pad_token_id={pad!r}: RoBERTa-PreLayerNorm numbers positions from "
                         f"pad_token_id + 1, so it must be a token id")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type={raw['position_embedding_type']!r}: only "
                         f"absolute positions are read from a RoBERTa-PreLayerNorm model")
    if raw.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act={raw['hidden_act']!r}: RoBERTa-PreLayerNorm's MLM head "
                         f"applies GELU whatever hidden_act says, and ours applies hidden_act, "
                         f"so only hidden_act='gelu' is read exactly")
    offset = position_offset(pad)
    if raw.get("max_position_embeddings", 0) <= offset:
        raise ValueError(f"max_position_embeddings={raw.get('max_position_embeddings')!r} leaves "
                         f"no position for a token after the {offset} rows RoBERTa reserves")
    values = {k: v for k, v in raw.items() if k != "model_type"}
    values["max_position_embeddings"] = raw["max_position_embeddings"] - offset
    values["pre_layer_norm"] = True
    values["next_sentence_prediction"] = False  # RoBERTa has no NSP head
    return values, _tensors_from_hf(tensors, offset)


def _tensors_from_hf(tensors: dict, offset: int) -> dict:
    out = {}
    for key, value in tensors.items():
        ours = from_hf_key(key)
        if ours == "bert." + POSITIONS and isinstance(value, torch.Tensor):
            value = value[offset:]
        out[ours] = value
    return out


def classifier_to_hf_state(state: dict, config) -> dict:
    """A fine-tuned [CLS] classifier's state dict (ours) -> RoBERTa-PreLayerNorm's
    ForSequenceClassification (its encoder has no pooler: ours is its head's dense)."""
    head, encoder = _split_head(state, _CLASSIFIER_NAMES)
    return {**to_hf_state(encoder, config), **head}


def is_hf_classifier_state(tensors: dict) -> bool:
    """Whether a fine-tuned classifier's weights are in RoBERTa-PreLayerNorm's names."""
    return any(k.startswith(PREFIX) for k in tensors)


def classifier_from_hf_state(tensors: dict, pad_token_id: int) -> dict:
    """The inverse of classifier_to_hf_state."""
    head, encoder = _split_head(tensors, [(theirs, ours) for ours, theirs in _CLASSIFIER_NAMES])
    return {**_tensors_from_hf(encoder, position_offset(pad_token_id)), **head}


def _split_head(state: dict, names) -> tuple[dict, dict]:
    """(the classification head's tensors renamed old -> new by the first (old, new) prefix
    that fits, every other tensor as it is)."""
    head, rest = {}, {}
    for key, value in state.items():
        for old, new in names:
            if key.startswith(old):
                head[new + key[len(old):]] = value
                break
        else:
            rest[key] = value
    return head, rest
