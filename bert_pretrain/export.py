"""Export a checkpoint to the Hugging Face layout:

    python -m bert_pretrain.export runs/demo/checkpoints/step-00000500 exported/demo

writes config.json (a transformers BertConfig), model.safetensors (transformers'
BertForPreTraining key names, tied decoder weights left out as transformers saves them) and the
tokenizer files, so that `BertForPreTraining.from_pretrained(out_dir)` and
`BertTokenizerFast.from_pretrained(out_dir)` load it with no code from this project.
"""

import argparse
import json
import os
import shutil
import sys

from .errors import UserError

# transformers ties these to the word embeddings / `cls.predictions.bias` and does not save them.
TIED_KEYS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


def export(checkpoint_dir: str, out_dir: str) -> str:
    from safetensors.torch import save_file

    from . import checkpoint as ckpt
    from .model import BertConfig, BertForPreTraining

    state = ckpt.read_train_state(checkpoint_dir)
    try:
        config = BertConfig.from_dict(state["model_config"])
        hf_config = config.to_hf_dict()
    except (KeyError, ValueError) as exc:
        raise UserError(f"cannot export {checkpoint_dir}: {exc}") from None
    model = BertForPreTraining(config)
    ckpt.load_weights(checkpoint_dir, model)
    tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()
               if k not in TIED_KEYS}
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise UserError(f"{out_dir} exists and is not empty; choose a new output directory")
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)
    tokenizer = os.path.join(checkpoint_dir, "tokenizer")
    if os.path.isdir(tokenizer):
        for name in os.listdir(tokenizer):
            shutil.copy2(os.path.join(tokenizer, name), os.path.join(out_dir, name))
    else:
        print(f"bert-export: warning: {checkpoint_dir} has no tokenizer/; only the model was "
              f"exported", file=sys.stderr)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="bert-export", description="Export a bert-train checkpoint to Hugging Face format.")
    parser.add_argument("checkpoint_dir", help="a <run_dir>/checkpoints/step-XXXXXXXX directory")
    parser.add_argument("out_dir", help="where to write config.json, model.safetensors, tokenizer")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint_dir, args.out_dir)
    except UserError as exc:
        print(f"bert-export: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"bert-export: wrote {out} (transformers.BertForPreTraining.from_pretrained loads it)")


if __name__ == "__main__":
    main()
