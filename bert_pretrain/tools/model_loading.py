"""Find and load a trained model, whatever the user points at:

* a run directory (`runs/demo`): the newest valid checkpoint of its current line;
* a checkpoint (`runs/demo/checkpoints/step-00000400`);
* a transformers directory (`bert-export` output, or any `save_pretrained` BERT).

The result is OUR model (`bert_pretrain.model`), so pre-LN and relative-position models work
everywhere, plus the directory holding its tokenizer and which of its files are the tokenizer:
what the format lists (a checkpoint: the files its state lists under tokenizer/; a transformers
directory: TOKENIZER_FILES), regular files only.  An export ships those and nothing else of the
directory (a transformers directory also holds the model's own config.json and weights).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from ..errors import CheckpointError

# A BERT tokenizer's files in a transformers directory (what bert-prep writes, and the added
# tokens transformers may save beside them).
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json")


@dataclass
class LoadedModel:
    model: object  # BertForPreTraining, in eval mode
    tokenizer_dir: Optional[str]
    source: str
    """What was loaded, for messages: the checkpoint or the transformers directory."""
    tokenizer_files: list = field(default_factory=list)
    """The tokenizer's files in tokenizer_dir that an export may copy (regular files the format
    lists)."""
    left_out: list = field(default_factory=list)
    """Tokenizer files that are not copied, each a warning line (a symbolic link...)."""


def resolve_checkpoint(path: str, warn=None) -> str:
    """A verified checkpoint directory from a run directory (the newest valid checkpoint of its
    current line, as resume=auto picks: checkpoint_manager.py) or a checkpoint."""
    from ..components import checkpoint as ckpt
    from ..components.checkpoint_manager import CheckpointManager, checkpoints_root

    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory; pass a run directory, a "
                              f"<run_dir>/checkpoints/step-XXXXXXXX checkpoint or a bert-export "
                              f"directory")
    if not os.path.lexists(os.path.join(path, ckpt.STATE_JSON)):
        if os.path.isdir(checkpoints_root(path)):
            latest = CheckpointManager(path, warn=warn).latest()
            if latest is None:
                raise CheckpointError(f"run directory {path} has no valid checkpoint yet")
            return latest
        raise CheckpointError(f"{path} is neither a run directory (no checkpoints/), a "
                              f"checkpoint (no {ckpt.STATE_JSON}) nor a transformers model "
                              f"directory (config.json + model.safetensors or pytorch_model.bin)")
    if not ckpt.is_our_checkpoint(path):
        raise CheckpointError(f"{path} has a {ckpt.STATE_JSON} that bert-train did not write "
                              f"(a transformers Trainer checkpoint?) and no model weights "
                              f"beside a config.json; pass the folder that holds config.json "
                              f"and model.safetensors")
    ckpt.verify_checkpoint(path)
    return path


def checkpoint_config(checkpoint: str):
    """The BertConfig of one of our checkpoints (its files verified on the way)."""
    from ..components import checkpoint as ckpt
    from ..model import BertConfig

    state = ckpt.read_train_state(checkpoint)
    try:
        return BertConfig.from_dict(state["model_config"])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint}: unreadable model config ({exc})") from None


def load_model(path: str, warn=None) -> LoadedModel:
    """Our BertForPreTraining from a run dir, a checkpoint or a transformers directory. `warn`
    gets each warning line (e.g. a damaged checkpoint skipped)."""
    from ..components import checkpoint as ckpt
    from ..components.hf_import import is_hf_model_dir, read_hf_model
    from ..model import BertConfig, BertForPreTraining, ModelImpl

    if os.path.isdir(path) and is_hf_model_dir(path):
        config, state = read_hf_model(path)
        model = BertForPreTraining(BertConfig.from_dict(config), ModelImpl())
        model.load_state_dict(state, strict=True)
        if not _has_tokenizer(path):
            return LoadedModel(model.eval(), None, path)
        files, refused = ckpt.own_files(path, TOKENIZER_FILES)
        if not {"tokenizer.json", "vocab.txt"} & set(files):
            # Used through its links it would fine-tune, but what it ships could not be used.
            raise CheckpointError(f"{ckpt.refusal(path, refused[0])}; no tokenizer file of "
                                  f"{path} is its own, so nothing made from it could be used")
        return LoadedModel(model.eval(), path, path, files,
                           [ckpt.refusal(path, name) for name in refused])
    checkpoint = resolve_checkpoint(path, warn)
    model = BertForPreTraining(checkpoint_config(checkpoint), ModelImpl())
    ckpt.load_weights(checkpoint, model)
    tokenizer = os.path.join(checkpoint, ckpt.TOKENIZER_DIR)
    files = checkpoint_tokenizer_files(ckpt.read_train_state(checkpoint))
    if not (_has_tokenizer(tokenizer) and files):
        return LoadedModel(model.eval(), None, checkpoint)
    return LoadedModel(model.eval(), tokenizer, checkpoint, files)


def checkpoint_tokenizer_files(state: dict) -> list:
    """The tokenizer files a checkpoint's state lists (names inside its tokenizer/; the
    tokenizer is flat, so nothing nested)."""
    from ..components import checkpoint as ckpt

    under = ckpt.TOKENIZER_DIR + "/"
    return [n[len(under):] for n in ckpt.listed_files(state, under) if "/" not in n[len(under):]]


def one_line_warnings(prog: str) -> None:
    """Command lines: a warning (e.g. freshly initialised heads on import) as one
    `<prog>: warning: ...` line instead of Python's two-line file:line format."""
    import warnings

    warnings.formatwarning = lambda message, *args, **kwargs: f"{prog}: warning: {message}\n"


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "vocab.txt"))


def load_tokenizer(loaded: LoadedModel):
    """A `tokenizers.Tokenizer` that adds [CLS]/[SEP] (pairs with token types 0/1) and reads a
    literal [MASK] in the text as the mask token."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    path = loaded.tokenizer_dir
    if path is None:
        raise CheckpointError(f"{loaded.source} has no tokenizer (vocab.txt or tokenizer.json) "
                              f"beside it; copy the data's tokenizer/ files there")
    json_file = os.path.join(path, "tokenizer.json")
    if os.path.isfile(json_file):
        tok = Tokenizer.from_file(json_file)
    else:
        import json

        from tokenizers import BertWordPieceTokenizer

        lower = True
        cfg = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg):
            with open(cfg, encoding="utf-8") as f:
                lower = json.load(f).get("do_lower_case", True)
        tok = BertWordPieceTokenizer(os.path.join(path, "vocab.txt"), lowercase=lower)._tokenizer
    ids = {t: tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]")}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise CheckpointError(f"the tokenizer in {path} lacks {' '.join(missing)}")
    tok.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = False  # "[MASK]" typed by the user is the mask token
    return tok
