"""Sequence classification / regression on our encoder: `BertForSequenceClassification` in
transformers' layout (`bert.*` including the pooler, dropout, `classifier` linear), so a
fine-tuned model exports as a directory transformers' class of the same name loads.

`pooling="mean"` reads the mean of the last layer's states over the real tokens instead of the
pooled [CLS] vector (dropout and the classifier linear as before, no pooler). An MLM-only
encoder never trained its [CLS] output or a pooler; the mean reads states its loss did train.
transformers has no such head, so such a model does not export to its layout.

Being our encoder, pre-LN and relative-position models fine-tune too, with the pretraining
speed-ups: padding dropped before the projections (`impl.unpad`), attention over length groups
(`impl.varlen_attention`), and the last layer computed for the [CLS] rows only
(`impl.sparse_last_layer`: nothing else is read after it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .bert import BertModel, init_bert_weights
from .config import BertConfig, ModelImpl
from .dropout import Dropout
from .encoder import add_unused_position_table

POOLINGS = ("cls", "mean")


@dataclass
class ClassificationOutput:
    loss: torch.Tensor | None
    """Cross-entropy (num_labels > 1) or squared error (num_labels == 1, regression) over the
    batch: its mean, or its sum with `loss_reduction="sum"`; None without labels."""
    logits: torch.Tensor
    """[B, num_labels]"""


class BertForSequenceClassification(nn.Module):
    def __init__(self, config: BertConfig, num_labels: int, impl: ModelImpl | None = None,
                 classifier_dropout: float | None = None, pooling: str = "cls"):
        """`num_labels` 1 is regression (transformers' convention); `classifier_dropout` None
        takes the encoder's hidden_dropout_prob, as transformers does; `pooling`: cls (the
        pooled [CLS] vector, transformers' head) or mean (the masked mean of the last layer)."""
        super().__init__()
        if not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"num_labels must be a positive integer, got {num_labels!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        # The cls head reads the pooled [CLS] vector, so it always has a pooler; an MLM-only
        # encoder (RoBERTa's recipe: no pooler) gets a freshly initialised one, as transformers'
        # BertForSequenceClassification does from a BertForMaskedLM checkpoint.  The mean head
        # has none: a fresh dense+tanh would put an untrained layer between the trained states
        # and the classifier (the very thing it avoids), and unused parameters would stall DDP.
        config = dataclasses.replace(config, next_sentence_prediction=pooling == "cls")
        self.config = config
        self.impl = impl or ModelImpl()
        self.num_labels = num_labels
        self.pooling = pooling
        self.bert = BertModel(config, self.impl)
        p = config.hidden_dropout_prob if classifier_dropout is None else classifier_dropout
        self.dropout = Dropout(p, self.impl.fast_dropout)
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        for module in self.modules():
            init_bert_weights(module, config.initializer_range)

    def load_encoder(self, state_dict: dict) -> bool:
        """Take `bert.*` (embeddings, layers, pooler) from a pretraining state dict (ours or
        transformers' key names); the classifier keeps its fresh initialisation, and so does
        the pooler of an encoder that has none (MLM-only). Returns whether the pooler came
        from the state dict (never for the mean head, which has no pooler: an NSP model's is
        left out)."""
        encoder = {k[len("bert."):]: v for k, v in state_dict.items() if k.startswith("bert.")}
        if self.bert.pooler is None:
            encoder = {k: v for k, v in encoder.items() if not k.startswith("pooler.")}
        has_pooler = any(k.startswith("pooler.") for k in encoder)
        missing, unexpected = self.bert.load_state_dict(encoder, strict=False)
        allowed = [] if has_pooler else [k for k in self.bert.state_dict()
                                         if k.startswith("pooler.")]
        if unexpected or sorted(missing) != sorted(allowed):
            self.bert.load_state_dict(encoder, strict=True)  # raises, naming the keys
        return has_pooler

    def reinit_top_layers(self, n: int) -> None:
        """Give the top `n` encoder layers (and the pooler, when there is one) BERT's fresh
        initialisation again, after `load_encoder`: Zhang et al. 2021 ("Revisiting Few-sample
        BERT Fine-tuning") find the top layers' pretrained weights specialised to the
        pretraining task and a poor start for a small labelled set. A pre-LN encoder's final
        LayerNorm is kept (it is not a layer's)."""
        layers = self.bert.encoder.layer
        if not 0 <= n <= len(layers):
            raise ValueError(f"can re-initialise 0 to {len(layers)} layers of this encoder, "
                             f"got {n}")
        if n == 0:
            return
        fresh = [*layers[len(layers) - n:]]
        if self.bert.pooler is not None:
            fresh.append(self.bert.pooler)
        for part in fresh:
            for module in part.modules():
                init_bert_weights(module, self.config.initializer_range)

    def hf_state_dict(self) -> dict:
        """transformers' key set (see BertForPreTraining.hf_state_dict)."""
        return add_unused_position_table(self.state_dict(), self.config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                loss_reduction: str = "mean") -> ClassificationOutput:
        """`loss_reduction="sum"` lets a trainer normalise by a whole global batch's size."""
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be mean or sum, got {loss_reduction!r}")
        if self.pooling == "mean":
            pooled = self._mean_pooled(input_ids, attention_mask, token_type_ids)
        else:
            keep = None
            if self.impl.resolved_sparse_last_layer(input_ids.device.type):
                # Only the pooled [CLS] vector is read: the last layer computes that row alone.
                keep = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
            pooled = self.bert(input_ids, attention_mask, token_type_ids,
                               keep=keep).pooled_output
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits.float().squeeze(-1), labels.float().reshape(-1),
                                  reduction=loss_reduction)
            else:
                loss = F.cross_entropy(logits.float(), labels.reshape(-1),
                                       reduction=loss_reduction)
        return ClassificationOutput(loss, logits)

    def _mean_pooled(self, input_ids, attention_mask, token_type_ids) -> torch.Tensor:
        """[B, H]: each sequence's last-layer states averaged over its real tokens ([CLS] and
        [SEP]s included, as sentence-transformers' mean pooling); padding has no weight, so
        the vector does not depend on how far a sequence was padded."""
        out = self.bert(input_ids, attention_mask, token_type_ids)  # every row is read
        # [B, L, H], unpadded: zeros at padding; summed in fp32 (bf16 would round the sum of
        # up to max_length states)
        x = out.layout.to_grid(out.sequence_output).float()
        if attention_mask is None:
            return x.mean(1)
        mask = attention_mask.to(x.dtype).unsqueeze(-1)  # the padded layout leaves values there
        return (x * mask).sum(1) / mask.sum(1).clamp(min=1.0)
