"""A fine-tuned model as a directory that transformers' BertForSequenceClassification (and
AutoModelForSequenceClassification, AutoTokenizer) loads with no code from this project:
config.json (num_labels, id2label, problem_type), model.safetensors in transformers' key names,
the tokenizer files; a pre-LN one as RoBERTa-PreLayerNorm's ForSequenceClassification, as
bert-export writes a pre-LN encoder (hf_prelayernorm). Plus classifier.json, from which
`load_classifier` rebuilds OUR model (also for relative-position encoders, which transformers
5 cannot compute, and for a mean-pooled head, which it does not have: their directory has no
config.json, so nothing loads them as something else),
and identity.json: which fine-tune it is (identity.py).

The tokenizer files are the pretrained model's tokenizer as its format lists them
(model_loading: a checkpoint's listed files, a transformers directory's TOKENIZER_FILES), copied
by the one copy every export makes (checkpoint.copy_own_files: regular files only, never through
a link).  When the model came from a transformers directory that directory is also the
tokenizer's, and its config.json and weights are not tokenizer files: only the fine-tuned ones
are written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from ..components import hf_prelayernorm
from ..errors import CheckpointError, UserError

CLASSIFIER_JSON = "classifier.json"
FILE_MODE = 0o644


def hf_config(model, data) -> dict:
    """transformers' config.json for `model` (UserError where transformers cannot compute it)."""
    from ..tools.export import representable

    if model.pooling != "cls":
        raise UserError(f"a {model.pooling}-pooled classifier (recipe.pooling={model.pooling}) "
                        f"has no transformers equivalent (BertForSequenceClassification reads "
                        f"the pooled [CLS] vector); load it with load_classifier")
    representable(model.config)
    if model.config.pre_layer_norm:  # as bert-export writes a pre-LN encoder
        base = {**hf_prelayernorm.hf_config(model.config),
                "architectures": [hf_prelayernorm.ARCHITECTURES["sequence-classification"]]}
    else:
        base = {**model.config.to_hf_dict(), "architectures": ["BertForSequenceClassification"]}
    names = data.label_names or [f"LABEL_{i}" for i in range(model.num_labels)]
    return {**base, "num_labels": model.num_labels,
            "id2label": {str(i): n for i, n in enumerate(names)},
            "label2id": {n: i for i, n in enumerate(names)},
            "problem_type": "regression" if model.num_labels == 1
            else "single_label_classification",
            "finetuning_task": data.name if data.name != "custom" else data.title}


def save_classifier(model, data, pretrained, out_dir: str, identity: dict) -> bool:
    """Write `model` (our BertForSequenceClassification) with `pretrained`'s tokenizer files to
    `out_dir`, replacing it so that a kill leaves the old model or the new, whole (_swap_in);
    `identity`: the fine-tune it is.  Returns whether
    transformers can load it (config.json written)."""
    from safetensors.torch import save_file

    from ..components.checkpoint import copy_own_files
    from .identity import record

    try:
        config = hf_config(model, data)
    except UserError:
        config = None
    state = model.hf_state_dict()
    if config is not None and model.config.pre_layer_norm:
        state = hf_prelayernorm.classifier_to_hf_state(model.state_dict(), model.config)
    tensors = {k: v.detach().float().contiguous().cpu().clone() for k, v in state.items()}
    ours = {"model_config": model.config.to_dict(), "num_labels": model.num_labels,
            "label_names": data.label_names, "task": data.name, "title": data.title,
            "metrics": list(data.metrics), "pooling": model.pooling, "lr": identity.get("lr"),
            "seed": identity.get("seed")}
    parent, name = os.path.split(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    recover_swap(out_dir)
    tmp = tempfile.mkdtemp(prefix=f".{name}-new-", dir=parent)
    try:
        copy_own_files(pretrained.tokenizer_dir, pretrained.tokenizer_files, tmp)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        _dump(ours, os.path.join(tmp, CLASSIFIER_JSON))
        if config is not None:
            _dump(config, os.path.join(tmp, "config.json"))
        record(tmp, identity)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), FILE_MODE)
        os.chmod(tmp, 0o755)
        _swap_in(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return config is not None


def _old_path(out_dir: str) -> str:
    parent, name = os.path.split(os.path.abspath(out_dir))
    return os.path.join(parent, f".{name}-old")


def _swap_in(new: str, out_dir: str) -> None:
    """Put the complete directory `new` in `out_dir`'s place: the old one is renamed aside
    first and deleted last, so a kill at any point leaves a whole model, the old or the new,
    in out_dir or (between the renames) aside, where recover_swap puts it back."""
    old = _old_path(out_dir)
    if os.path.lexists(out_dir):
        os.rename(out_dir, old)
    os.rename(new, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def recover_swap(out_dir: str) -> None:
    """Finish what a killed save_classifier left (main process, before out_dir is read or
    written): the old model back in place if the new one never got there, else the old one's
    remains deleted; a half-written new one deleted."""
    parent, name = os.path.split(os.path.abspath(out_dir))
    old = _old_path(out_dir)
    if os.path.lexists(old):
        if os.path.lexists(out_dir):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, out_dir)
    if os.path.isdir(parent):
        for leftover in os.listdir(parent):
            if leftover.startswith(f".{name}-new-"):
                shutil.rmtree(os.path.join(parent, leftover), ignore_errors=True)


def _dump(obj: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)


def load_classifier(path: str):
    """Our BertForSequenceClassification (eval mode) from a directory save_classifier wrote."""
    from safetensors.torch import load_file

    from ..model import BertConfig, BertForSequenceClassification

    try:
        with open(os.path.join(path, CLASSIFIER_JSON), encoding="utf-8") as f:
            ours = json.load(f)
        # (no "pooling": written before the option, a cls head)
        model = BertForSequenceClassification(BertConfig.from_dict(ours["model_config"]),
                                              int(ours["num_labels"]),
                                              pooling=ours.get("pooling", "cls"))
        tensors = load_file(os.path.join(path, "model.safetensors"))
        if model.config.pre_layer_norm and hf_prelayernorm.is_hf_classifier_state(tensors):
            tensors = hf_prelayernorm.classifier_from_hf_state(tensors, model.config.pad_token_id)
        model.load_state_dict(tensors, strict=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"cannot load the fine-tuned model in {path} "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                              ) from None
    return model.eval()
