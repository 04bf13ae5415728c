"""Tokenised examples and the batches fine-tuning reads, in an order that depends only on the
seed: global sample k is example perm_e[k % N] of epoch e = k // N (as pretraining's stream), a
global batch is cut into contiguous rank slices and those into micro-batches, so 1 process and N
processes (or any accumulation) see the same global batches, and a resumed run the same ones as
an uninterrupted run."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..components.data import epoch_permutation
from ..errors import DataError
from .reading import Examples


@dataclass
class Encoded:
    ids: list
    """[n_i] int64 token ids per example ([CLS] a [SEP] (b [SEP]))."""
    types: list
    labels: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(x) for x in self.ids), dtype=np.int64, count=len(self.ids))

    def __len__(self) -> int:
        return len(self.ids)


def encode(examples: Examples, tokenizer, max_length: int, vocab_size: int,
           what: str) -> Encoded:
    """Tokenise with [CLS]/[SEP] (pairs: token types 0/1), truncated to max_length tokens
    (pairs: the longer text first, as transformers' longest_first)."""
    tokenizer.enable_truncation(max_length, strategy="longest_first")
    inputs = examples.text_a if examples.text_b is None else \
        list(zip(examples.text_a, examples.text_b))
    encodings = tokenizer.encode_batch(inputs)
    ids = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
    types = [np.asarray(e.type_ids, dtype=np.int64) for e in encodings]
    top = max((int(x.max()) for x in ids if len(x)), default=0)
    if top >= vocab_size:
        raise DataError(f"{what}: the tokenizer gives token id {top} but the model has "
                        f"{vocab_size} embeddings; the tokenizer beside the model is not its own")
    return Encoded(ids, types, examples.labels)


def collate(enc: Encoded, index, pad_to_multiple_of: int = 8) -> dict:
    """Examples `index` as model inputs, padded (right) to the longest, rounded up."""
    index = np.asarray(index, dtype=np.int64)
    lengths = np.array([len(enc.ids[i]) for i in index], dtype=np.int64)
    seq = int(-(-lengths.max() // pad_to_multiple_of) * pad_to_multiple_of)
    ids = np.zeros((len(index), seq), dtype=np.int64)
    types = np.zeros_like(ids)
    for row, i in enumerate(index):
        ids[row, :lengths[row]] = enc.ids[i]
        types[row, :lengths[row]] = enc.types[i]
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
            "token_type_ids": torch.from_numpy(types),
            "labels": torch.from_numpy(enc.labels[index].copy())}


class TrainOrder:
    """Which examples each optimizer step reads, on this rank."""

    def __init__(self, num_examples: int, seed: int, epochs: float, global_batch_size: int,
                 micro_batch_size: int, world_size: int, rank: int):
        if global_batch_size % (world_size * micro_batch_size):
            raise DataError(f"recipe.batch_size={global_batch_size} is not divisible by the "
                            f"{world_size} process(es) x trainer.micro_batch_size="
                            f"{micro_batch_size}; pick sizes so that it divides")
        self.n, self.seed = num_examples, seed
        self.global_batch_size, self.micro = global_batch_size, micro_batch_size
        self.world, self.rank = world_size, rank
        self.accumulation = global_batch_size // (world_size * micro_batch_size)
        # epochs x N examples in full global batches (the last one reaches into the next epoch)
        self.num_steps = max(1, math.ceil(epochs * num_examples / global_batch_size))
        self._perms: dict = {}

    def _example(self, k: np.ndarray) -> np.ndarray:
        epochs = k // self.n
        out = np.empty_like(k)
        for e in np.unique(epochs):
            if e not in self._perms:
                self._perms = {e: epoch_permutation(self.seed, int(e), self.n)}
            sel = epochs == e
            out[sel] = self._perms[e][k[sel] % self.n]
        return out

    def micro_batches(self, step: int) -> list:
        """This rank's micro-batches (example indices) of global batch `step`."""
        per_rank = self.global_batch_size // self.world
        start = step * self.global_batch_size + self.rank * per_rank
        index = self._example(np.arange(start, start + per_rank, dtype=np.int64))
        return [index[j:j + self.micro] for j in range(0, per_rank, self.micro)]

    def epoch(self, step: int) -> float:
        return step * self.global_batch_size / self.n


def eval_batches(enc: Encoded, batch_size: int, world_size: int, rank: int) -> list:
    """This rank's share of the evaluation set: examples sorted by length (less padding;
    each example is scored on its own, so the order changes nothing), batch r, r + W, ..."""
    order = np.argsort(enc.lengths, kind="stable")
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return batches[rank::world_size]
