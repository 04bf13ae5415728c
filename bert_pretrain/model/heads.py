"""Pretraining heads: masked-LM (transform + decoder tied to the word embeddings + its own bias)
and next-sentence prediction (absent in MLM-only models), with transformers' names
(`cls.predictions.*`, `cls.seq_relationship`)."""

from __future__ import annotations

import torch
from torch import nn

from .config import BertConfig
from .encoder import activation


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = activation(config.hidden_act)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, config: BertConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        # The decoder is a Linear whose weight IS the word-embedding matrix and whose bias IS
        # `self.bias`: the state dict then holds `cls.predictions.decoder.{weight,bias}` and
        # `cls.predictions.bias` exactly as transformers' does, all sharing storage.
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.decoder.weight = word_embeddings.weight
        self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x))


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.predictions = BertLMPredictionHead(config, word_embeddings)
        # MLM-only models have no NSP head (transformers' BertForMaskedLM has none either).
        self.seq_relationship = (nn.Linear(config.hidden_size, 2)
                                 if config.next_sentence_prediction else None)


class ReplacedTokenHead(nn.Module):
    """ELECTRA's discriminator head: one logit per token, "this token was replaced" (names as
    transformers' ElectraDiscriminatorPredictions: `dense`, `dense_prediction`)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = activation(config.hidden_act)
        self.dense_prediction = nn.Linear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_prediction(self.act(self.dense(x))).squeeze(-1)
