"""BERT encoder with MLM + NSP pretraining heads, and a sequence-classification head for
fine-tuning (imports only torch).

State-dict compatible with `transformers.BertForPreTraining`; speed switches live in `ModelImpl`.
"""

from .bert import (BertForPreTraining, BertModel, EncoderOutput, PreTrainingOutput,
                   init_bert_weights)
from .classifier import BertForSequenceClassification, ClassificationOutput
from .config import BertConfig, ModelImpl
from .layout import QuerySubset, TokenLayout

__all__ = [
    "BertConfig",
    "BertForPreTraining",
    "BertForSequenceClassification",
    "ClassificationOutput",
    "BertModel",
    "EncoderOutput",
    "ModelImpl",
    "PreTrainingOutput",
    "QuerySubset",
    "TokenLayout",
    "build_model",
    "init_bert_weights",
]


def build_model(model_cfg, impl_cfg=None, **overrides) -> BertForPreTraining:
    """Build from plain mappings (the `model` and `impl` config sub-trees, e.g. via
    `OmegaConf.to_container`); `overrides` fill fields such as `vocab_size` from the manifest."""
    return BertForPreTraining(BertConfig.from_dict(model_cfg, **overrides),
                              ModelImpl.from_dict(impl_cfg))
