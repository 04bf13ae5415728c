"""The encoder a fine-tune starts from: whatever `model=` points at (a run directory, a
checkpoint, a bert-export or any transformers BERT directory, via model_loading.load_model), as
its config, its `bert.*` weights and its tokenizer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from dataclasses import dataclass
from typing import Optional

from ..errors import CheckpointError


@dataclass
class Pretrained:
    config: object
    """BertConfig of the encoder as pretrained."""
    encoder_state: dict
    """`bert.*` tensors (embeddings, layers, pooler)."""
    tokenizer_dir: str
    source: str
    """The checkpoint or directory the weights came from (a run dir resolves to its newest
    valid checkpoint)."""
    notes: list
    """Warnings worth showing (e.g. no pooler in the directory: freshly initialised)."""

    def tokenizer(self):
        from ..model_loading import LoadedModel, load_tokenizer

        return load_tokenizer(LoadedModel(None, self.tokenizer_dir, self.source))

    def fine_tuning_config(self, dropout: Optional[float]):
        """The encoder config with the recipe's dropout (None: the model's own)."""
        if dropout is None:
            return self.config
        return dataclasses.replace(self.config, hidden_dropout_prob=dropout,
                                   attention_probs_dropout_prob=dropout)

    def identity(self) -> str:
        """What a fine-tune's results depend on of this model: its source and config (a short
        hash), so that a rerun into the same out_dir with another model is refused."""
        text = json.dumps({"source": self.source, "config": self.config.to_dict()},
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_pretrained(path: str) -> Pretrained:
    from ..model_loading import load_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_model(path)
    # Of the pretraining heads only the pooler is used by a classifier; the MLM / NSP heads a
    # BertModel or BertForMaskedLM directory lacks do not matter here.
    notes = [f"{path} has no pooler weights: freshly initialised, as transformers does"
             for w in caught if "bert.pooler" in str(w.message)]
    if not getattr(loaded.model.config, "next_sentence_prediction", True):
        notes.append(f"{path} is an MLM-only model (no pooler): the classifier's pooler is "
                     f"freshly initialised, as transformers does")
    if loaded.tokenizer_dir is None:
        raise CheckpointError(f"{loaded.source} has no tokenizer (vocab.txt or tokenizer.json) "
                              f"beside it; a fine-tune must tokenize as the pretraining did")
    state = {k: v for k, v in loaded.model.state_dict().items() if k.startswith("bert.")}
    return Pretrained(loaded.model.config, state, loaded.tokenizer_dir, loaded.source, notes)
