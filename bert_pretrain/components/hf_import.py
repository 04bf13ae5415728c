"""Read a transformers BERT directory (what `save_pretrained` or `bert-export` writes) as our
model: `trainer.init_from=<dir>` continues pretraining from it, `bert-predict` runs it. A pre-LN
RoBERTa directory (`roberta-prelayernorm`, what bert-export writes for a pre-LN model) is read as
our pre-LN model (`hf_prelayernorm`).

    config, state = read_hf_model("path/to/bert-dir")
    model = BertForPreTraining(BertConfig.from_dict(config))
    model.load_state_dict(state, strict=True)

What transformers writes and we need to bridge:
* config.json carries keys our `BertConfig` does not know (`architectures`, `model_type`,
  `transformers_version`, `use_cache`, ...): dropped when they cannot change what the model
  computes, refused (one line) when they do (`is_decoder`, `add_cross_attention`, an activation
  or position type we do not implement).
* save_pretrained leaves the tied decoder (`cls.predictions.decoder.*`) out: it is filled from
  the word embeddings and `cls.predictions.bias`, as transformers ties them.
* A checkpoint of the encoder alone (`BertModel`, keys without the `bert.` prefix) or of
  `BertForMaskedLM` (no NSP head, no pooler) has no (or only part of the) pretraining heads.
  Decision: the missing heads are freshly initialised, with a warning naming them. They are small
  (the MLM decoder is the tied word-embedding matrix), they train in a few hundred steps, and
  continued pretraining of an encoder is the usual reason to import one. A missing *encoder*
  tensor is an error.
* Old TF-converted checkpoints name LayerNorm parameters `gamma`/`beta`: renamed.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Optional

import torch

from ..errors import CheckpointError, DataError
from . import hf_prelayernorm

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# transformers config keys that do not change what a BERT encoder computes (generation,
# bookkeeping, fine-tuning heads that we do not build).
IGNORED_KEYS = {
    "architectures", "model_type", "transformers_version", "use_cache", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "classifier_dropout", "gradient_checkpointing",
    "chunk_size_feed_forward", "output_attentions", "output_hidden_states", "return_dict",
    "id2label", "label2id", "num_labels", "problem_type", "tie_word_embeddings", "_name_or_path",
    "directionality", "pooler_fc_size", "pooler_num_attention_heads", "pooler_num_fc_layers",
    "pooler_size_per_head", "pooler_type", "finetuning_task", "tokenizer_class", "prefix",
    "pruned_heads", "torchscript", "use_bfloat16", "tf_legacy_loss", "use_return_dict",
    "_attn_implementation", "attn_implementation", "_commit_hash", "layer_norm_type",
}
# Keys that change the computation: only their default value can be represented.
MUST_BE = {"is_decoder": False, "add_cross_attention": False, "is_encoder_decoder": False}
# Heads a pretraining checkpoint has and an encoder-only one may lack (freshly initialised).
HEAD_PREFIXES = ("cls.", "bert.pooler.")
# Buffers older transformers versions saved; not parameters of our model.
BUFFER_SUFFIXES = ("embeddings.position_ids", "embeddings.token_type_ids")


def is_hf_model_dir(path: str) -> bool:
    """A directory with config.json and transformers weights that is not one of our checkpoints
    (a transformers `Trainer` checkpoint folder has a trainer_state.json of its own, with
    global_step and log_history: it is a transformers model directory)."""
    from .checkpoint import is_our_checkpoint

    return (os.path.isfile(os.path.join(path, CONFIG_FILE))
            and any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES)
            and not is_our_checkpoint(path))


def read_hf_config(path: str) -> dict:
    """config.json -> a `BertConfig.from_dict`-compatible dict; one-line CheckpointError when the
    model is not a BERT encoder we can compute exactly."""
    return _read_hf_config(path)[0]


def _read_hf_config(path: str) -> tuple[dict, dict]:
    """(read_hf_config's dict, config.json as written)."""
    from ..model import BertConfig

    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            written = raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file} ({exc}); pass a transformers BERT directory "
                              f"(config.json + model.safetensors)") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} is not a JSON object; pass a transformers BERT directory "
                              f"(config.json + model.safetensors)")
    model_type = raw.get("model_type", "bert")
    if model_type == hf_prelayernorm.MODEL_TYPE:
        try:
            raw, _ = hf_prelayernorm.from_hf(raw, {})
        except ValueError as exc:
            raise CheckpointError(f"{file}: {exc}") from None
    elif model_type != "bert":
        raise CheckpointError(f"{file} describes a {model_type!r} model; only BERT (model_type "
                              f"'bert') and pre-LN RoBERTa ('{hf_prelayernorm.MODEL_TYPE}', what "
                              f"bert-export writes for a pre-LN model) can be imported")
    for key, value in MUST_BE.items():
        if raw.get(key, value) != value:
            raise CheckpointError(f"{file}: {key}={raw[key]!r} is not supported (BERT encoders "
                                  f"only); use a checkpoint with {key}={value!r}")
    fields = set(BertConfig.__dataclass_fields__)
    config = {k: v for k, v in raw.items() if k in fields}
    unknown = sorted(set(raw) - fields - IGNORED_KEYS - set(MUST_BE))
    if unknown:
        warnings.warn(f"{file}: ignoring config key(s) {unknown} (no equivalent in our model)")
    # transformers 5 writes no position_embedding_type (absolute is its only kind).
    config.setdefault("position_embedding_type", "absolute")
    try:
        BertConfig.from_dict(config)
    except ValueError as exc:
        raise CheckpointError(f"{file}: {exc}") from None
    return config, written


def _read_weights(path: str) -> dict:
    st_file, bin_file = (os.path.join(path, f) for f in WEIGHT_FILES)
    try:
        if os.path.isfile(st_file):
            from safetensors.torch import load_file

            return load_file(st_file)
        # weights_only: a pickled checkpoint from the internet must not run code on load.
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors and torch raise several unrelated types
        raise CheckpointError(f"cannot read the weights in {path} "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                              f"; the file is corrupt or not a PyTorch checkpoint") from None


def _normalise_keys(tensors: dict) -> dict:
    out = {}
    for key, value in tensors.items():
        if key.endswith(BUFFER_SUFFIXES):
            continue
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta",
                                                                          "LayerNorm.bias")
        if key.startswith(("embeddings.", "encoder.", "pooler.")):  # a bare BertModel
            key = "bert." + key
        out[key] = value
    return out


def read_hf_model(path: str, seed: int = 0, next_sentence_prediction: Optional[bool] = None
                  ) -> tuple[dict, dict]:
    """(model config dict, state dict) for our `BertForPreTraining` from a transformers BERT
    directory; the state dict loads with `strict=True`. Missing pretraining heads (pooler, MLM
    transform, NSP) are freshly initialised (seeded) with a warning; tensors we do not use
    (e.g. a fine-tuned classifier) are dropped with a warning. `next_sentence_prediction`
    (None: config.json's, else BERT's true) chooses the model: False gives an MLM-only model
    (continued pretraining on MLM-only data), whose state dict leaves out a pooler and NSP head
    the directory may have."""
    from ..model import BertConfig, BertForPreTraining
    from ..model.encoder import UNUSED_POSITION_KEY

    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    if not is_hf_model_dir(path):
        raise CheckpointError(f"{path} is not a transformers model directory (config.json + "
                              f"model.safetensors or pytorch_model.bin)")
    config, raw = _read_hf_config(path)
    if next_sentence_prediction is not None:
        config["next_sentence_prediction"] = next_sentence_prediction
    tensors = _read_weights(path)
    if raw.get("model_type") == hf_prelayernorm.MODEL_TYPE:
        _, tensors = hf_prelayernorm.from_hf(raw, tensors)
    tensors = _normalise_keys(tensors)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model_config = BertConfig.from_dict(config)
        reference = BertForPreTraining(model_config).state_dict()
    if model_config.position_embedding_type != "absolute":
        # transformers 4.x holds an absolute table for relative positions too and never reads
        # it (our export writes it as zeros): expected, not an unknown tensor to warn about
        tensors.pop("bert.embeddings." + UNUSED_POSITION_KEY, None)
    # Tied: transformers saves neither (decoder.weight is the word embeddings, decoder.bias is
    # cls.predictions.bias).
    word = tensors.get("bert.embeddings.word_embeddings.weight")
    if "cls.predictions.decoder.weight" in tensors and word is not None and not torch.equal(
            tensors["cls.predictions.decoder.weight"], word):
        raise CheckpointError(f"{path}: the MLM decoder is not tied to the word embeddings "
                              f"(tie_word_embeddings=false); our model always ties them")
    if word is not None:
        tensors["cls.predictions.decoder.weight"] = word
    if "cls.predictions.bias" in tensors:
        tensors["cls.predictions.decoder.bias"] = tensors["cls.predictions.bias"]
    missing = [k for k in reference if k not in tensors]
    encoder_missing = [k for k in missing if not k.startswith(HEAD_PREFIXES)
                       and not k.endswith("distance_embedding.weight")]
    if encoder_missing:
        raise CheckpointError(f"{path}: the weights lack {len(encoder_missing)} encoder tensor(s) "
                              f"(first: {encoder_missing[0]}); is this a BERT checkpoint?")
    if any(k.endswith("distance_embedding.weight") for k in missing):
        raise CheckpointError(
            f"{path}: config.json says position_embedding_type="
            f"{config['position_embedding_type']} but the weights have no distance embeddings")
    fresh = sorted({k.rsplit(".", 1)[0] for k in missing if k != "cls.predictions.decoder.bias"})
    if fresh:
        warnings.warn(f"{path} has no {', '.join(fresh)}: freshly initialised (they train with "
                      f"the rest; bert-predict results from them are meaningless until then)")
    unused = sorted(k for k in tensors if k not in reference)
    if unused:
        warnings.warn(f"{path}: ignoring {len(unused)} tensor(s) our model does not have "
                      f"(first: {unused[0]})")
    state = {}
    for key, ref in reference.items():
        value = tensors.get(key, ref)
        if key == "cls.predictions.decoder.bias" and key not in tensors:
            value = state.get("cls.predictions.bias", ref)
        if tuple(value.shape) != tuple(ref.shape):
            raise CheckpointError(f"{path}: {key} has shape {tuple(value.shape)} but config.json "
                                  f"implies {tuple(ref.shape)}; the directory is inconsistent")
        state[key] = value.to(ref.dtype)
    return config, state


def _vocab_of(path: str) -> Optional[tuple]:
    """(tokens, do_lower_case or None) of the tokenizer saved beside a model, if any."""
    lower = None
    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        try:
            with open(cfg_file, encoding="utf-8") as f:
                lower = json.load(f).get("do_lower_case")
        except (OSError, ValueError):
            pass
    vocab_file = os.path.join(path, "vocab.txt")
    if os.path.isfile(vocab_file):
        with open(vocab_file, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f], lower
    json_file = os.path.join(path, "tokenizer.json")
    if os.path.isfile(json_file):
        with open(json_file, encoding="utf-8") as f:
            vocab = json.load(f).get("model", {}).get("vocab") or {}
        return [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])], lower
    return None


def check_against_data(path: str, config: dict, data) -> list:
    """Refuse (one-line DataError) a transformers model that does not fit the prepared data:
    vocab size, the tokenizer's vocabulary (token by token against the data's vocab.txt),
    lower-casing, max positions vs max_seq_length. `data` is a `PreparedData` (or its dir).
    Returns warnings (e.g. the model directory has no tokenizer, so identity is unchecked)."""
    from .data import PreparedData

    if isinstance(data, str):
        data = PreparedData(data)
    fix = f"prepare the data with this model's tokenizer: bert-prep tokenizer.vocab_file={path}"
    problems = []
    if config["vocab_size"] != data.vocab_size:
        problems.append(f"vocab_size {config['vocab_size']} vs the data's {data.vocab_size}")
    if config["max_position_embeddings"] < data.max_seq_length:
        problems.append(f"max_position_embeddings {config['max_position_embeddings']} < the "
                        f"data's max_seq_length {data.max_seq_length}")
    notes = []
    found = _vocab_of(path)
    if found is None:
        notes.append(f"{path} has no vocab.txt or tokenizer.json: cannot check that the data was "
                     f"tokenized with this model's vocabulary")
    else:
        tokens, lower = found
        try:
            data_tokens = data.vocab()
        except DataError:
            data_tokens = None
        if data_tokens is not None and tokens != data_tokens and not problems:
            first = next((i for i, (a, b) in enumerate(zip(tokens, data_tokens)) if a != b),
                         min(len(tokens), len(data_tokens)))
            theirs = tokens[first] if first < len(tokens) else "<end>"
            ours = data_tokens[first] if first < len(data_tokens) else "<end>"
            problems.append(f"the tokenizer's vocabulary differs (token {first}: {theirs!r} vs "
                            f"the data's {ours!r})")
        data_lower = data.manifest.get("tokenizer", {}).get("do_lower_case")
        if lower is not None and data_lower is not None and bool(lower) != bool(data_lower):
            problems.append(f"do_lower_case {lower} vs the data's {data_lower}")
    if problems:
        raise DataError(f"trainer.init_from={path} does not match the data in {data.root}: "
                        f"{'; '.join(problems)}; {fix}")
    return notes


def import_for_training(path: str, data, seed: int,
                        next_sentence_prediction: Optional[bool] = None) -> tuple[dict, dict, list]:
    """Continued pretraining from a transformers BERT directory (trainer.init_from): (model
    config, state dict, notes to print). Its config.json is the model (model.* settings are not
    used) and its tokenizer must be the data's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config, state = read_hf_model(path, seed=seed,
                                      next_sentence_prediction=next_sentence_prediction)
        notes = check_against_data(path, config, data)
    pad = data.special.get("pad", 0)
    if config.get("pad_token_id", pad) != pad:
        raise DataError(f"trainer.init_from={path} has pad_token_id {config['pad_token_id']} but "
                        f"[PAD] is token {pad} in the data; prepare the data with bert-prep "
                        f"tokenizer.vocab_file={path}")
    return {**config, "pad_token_id": pad}, state, [str(w.message) for w in caught] + list(notes)
