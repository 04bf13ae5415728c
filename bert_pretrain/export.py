"""Export a run (its latest valid checkpoint) or a checkpoint to the Hugging Face layout:

    bert-export runs/demo exported/demo
    bert-export runs/demo/checkpoints/step-00000200 exported/demo-200

writes config.json (a transformers BertConfig), model.safetensors (transformers'
BertForPreTraining key names, the tied decoder left out as transformers saves it) and the
tokenizer files, so that stock transformers loads it with no code from this project:
BertForPreTraining / BertForMaskedLM / AutoModel / AutoModelForSequenceClassification (a new
classifier on top) and AutoTokenizer. Every file is mode 0644 (readable by whoever serves it).

Models transformers cannot compute are refused rather than exported into something that loads
silently as a different model: pre-LN (no transformers BERT has it) and, under transformers >= 5
(which dropped them), relative position embeddings.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

from .cli_errors import fail
from .errors import UserError

# transformers ties these to the word embeddings / `cls.predictions.bias` and does not save them.
TIED_KEYS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
FILE_MODE = 0o644


def _installed_transformers_major():
    try:
        from importlib.metadata import PackageNotFoundError, version
        return int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return None


def representable(config) -> None:
    """Raise UserError (one line) when transformers cannot compute this model."""
    if config.pre_layer_norm:
        raise UserError("model.pre_layer_norm=true has no transformers equivalent (no "
                        "transformers version has a pre-LN BERT); run it with bert-predict, or "
                        "train a post-LN model to export")
    major = _installed_transformers_major()
    if config.position_embedding_type != "absolute" and major is not None and major >= 5:
        raise UserError(f"position_embedding_type={config.position_embedding_type} needs "
                        f"transformers < 5 (4.x computes relative positions; the installed "
                        f"{major}.x would load it silently as an absolute-position model): "
                        f"pip install 'transformers<5' and export again, or use bert-predict")


def export(source: str, out_dir: str) -> str:
    """Export `source` (a run dir or a checkpoint) to `out_dir`; returns the checkpoint used."""
    from safetensors.torch import save_file

    from . import checkpoint as ckpt
    from .model import BertForPreTraining
    from .model_loading import checkpoint_config, resolve_checkpoint

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"{out_dir} is a file; choose a new output directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise UserError(f"{out_dir} exists and is not empty; choose a new output directory")
    checkpoint_dir = resolve_checkpoint(source)
    config = checkpoint_config(checkpoint_dir)
    representable(config)
    hf_config = config.to_hf_dict()
    model = BertForPreTraining(config)
    ckpt.load_weights(checkpoint_dir, model)
    tensors = {k: v.detach().contiguous().clone() for k, v in model.hf_state_dict().items()
               if k not in TIED_KEYS}
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    # Written beside out_dir and renamed into place: an interrupted export leaves no half
    # directory that transformers would fail on later.
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_config, f, indent=2)
        tokenizer = os.path.join(checkpoint_dir, "tokenizer")
        if os.path.isdir(tokenizer):
            for name in os.listdir(tokenizer):
                shutil.copyfile(os.path.join(tokenizer, name), os.path.join(tmp, name))
        else:
            print(f"bert-export: warning: {checkpoint_dir} has no tokenizer/; only the model was "
                  f"exported", file=sys.stderr)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), FILE_MODE)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return checkpoint_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="bert-export",
        description="Export a bert-train run or checkpoint to Hugging Face format.",
        epilog="example: bert-export runs/demo exported/demo  (the run's latest checkpoint)")
    parser.add_argument("source", help="a run directory (its latest valid checkpoint is used) "
                                       "or a <run_dir>/checkpoints/step-XXXXXXXX directory")
    parser.add_argument("out_dir", help="a new directory for config.json, model.safetensors and "
                                        "the tokenizer files")
    args = parser.parse_args(argv)
    try:
        used = export(args.source, args.out_dir)
    except UserError as exc:
        fail("bert-export", str(exc))
    print(f"bert-export: exported {used} to {args.out_dir} (transformers "
          f"BertForPreTraining/BertForMaskedLM/AutoModel.from_pretrained load it)")


if __name__ == "__main__":
    main()
