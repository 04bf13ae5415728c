"""The encoder a fine-tune starts from: whatever `model=` points at (a run directory, a
checkpoint, a bert-export or any transformers BERT directory, via model_loading.load_model), as
its config, its `bert.*` weights and its tokenizer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
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
    """Warnings worth showing (e.g. a link among the tokenizer's files: not copied)."""
    tokenizer_files: list = field(default_factory=list)
    """The tokenizer's files in tokenizer_dir that a fine-tuned model ships (model_loading)."""
    content_sha256: str = ""
    """A hash of what the source holds (its weights, config and tokenizer)."""
    pooler_notes: list = field(default_factory=list)
    """No pooler in the model: the classifier's is freshly initialised (the cls head's only;
    the mean head has none)."""

    def warnings(self, pooling: str) -> list:
        """The warnings for a fine-tune whose head pools as `pooling` (recipe.pooling)."""
        return (self.pooler_notes if pooling == "cls" else []) + self.notes

    def tokenizer(self):
        from ..tools.model_loading import LoadedModel, load_tokenizer

        return load_tokenizer(LoadedModel(None, self.tokenizer_dir, self.source))

    def fine_tuning_config(self, dropout: Optional[float]):
        """The encoder config with the recipe's dropout (None: the model's own)."""
        if dropout is None:
            return self.config
        return dataclasses.replace(self.config, hidden_dropout_prob=dropout,
                                   attention_probs_dropout_prob=dropout)

    def identity(self) -> str:
        """What a fine-tune's results depend on of this model: what its source holds and its
        config (a short hash), whatever path it is found at.  A checkpoint re-made under the
        same name (a branch) is another model; a run directory moved elsewhere is not."""
        text = json.dumps({"content": self.content_sha256, "config": self.config.to_dict()},
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def content_sha256(loaded) -> str:
    """One of our checkpoints: its state's checksum (which covers every file it lists); a
    transformers directory: a hash of its config.json, weights and tokenizer files."""
    from ..components import checkpoint as ckpt
    from ..components.hf_import import CONFIG_FILE, WEIGHT_FILES
    from ..tools.model_loading import TOKENIZER_FILES

    if ckpt.is_our_checkpoint(loaded.source):
        return ckpt.read_train_state(loaded.source, verify=False)["state_sha256"]
    digest = hashlib.sha256()
    for name in sorted({CONFIG_FILE, *WEIGHT_FILES, *TOKENIZER_FILES}):
        file = os.path.join(loaded.source, name)
        if os.path.isfile(file):  # (what was read: through a link, as loading did)
            digest.update(f"{name}\0{os.path.getsize(file)}\0".encode())
            with open(file, "rb") as f:
                for chunk in iter(lambda: f.read(8 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def load_pretrained(path: str) -> Pretrained:
    from ..tools.model_loading import load_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_model(path)
    # Of the pretraining heads only the pooler is used by a classifier; the MLM / NSP heads a
    # BertModel or BertForMaskedLM directory lacks do not matter here.
    pooler_notes = [f"{path} has no pooler weights: freshly initialised, as transformers does"
                    for w in caught if "bert.pooler" in str(w.message)]
    if not getattr(loaded.model.config, "next_sentence_prediction", True):
        pooler_notes.append(f"{path} is an MLM-only model (no pooler): the classifier's pooler "
                            f"is freshly initialised, as transformers does")
    if loaded.tokenizer_dir is None:
        raise CheckpointError(f"{loaded.source} has no tokenizer (vocab.txt or tokenizer.json) "
                              f"beside it; a fine-tune must tokenize as the pretraining did")
    notes = list(loaded.left_out)  # a link among the tokenizer's files: not copied
    state = {k: v for k, v in loaded.model.state_dict().items() if k.startswith("bert.")}
    return Pretrained(loaded.model.config, state, loaded.tokenizer_dir, loaded.source, notes,
                      loaded.tokenizer_files, content_sha256(loaded), pooler_notes)
