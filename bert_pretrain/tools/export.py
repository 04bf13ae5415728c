"""Export a run (its latest valid checkpoint) or a checkpoint to the Hugging Face layout:

    bert-export runs/demo exported/demo
    bert-export runs/demo/checkpoints/step-00000200 exported/demo-200

writes config.json (a transformers BertConfig), model.safetensors (transformers'
BertForPreTraining key names, the tied decoder left out as transformers saves it) and the
tokenizer files the checkpoint lists (nothing else in its folder is copied), so that stock
transformers loads it with no code from this project: BertForPreTraining / BertForMaskedLM /
AutoModel / AutoModelForSequenceClassification (a new classifier on top) and AutoTokenizer.
Files and the directory get the permissions the user's umask gives, as any file they create.

`--head` chooses what the export holds, so the class it is loaded as finds exactly its keys and
transformers (>= 5) prints no load report of "UNEXPECTED" keys that reads like an error:
`pretraining` (the default: everything, for BertForPreTraining, and for AutoModelFor* classes
that then report the heads they leave out), `masked-lm` (encoder + MLM head: BertForMaskedLM and
pipeline("fill-mask") load it without a report; the pooler and the NSP head are left out) and
`encoder` (encoder + pooler: BertModel; a sequence classifier on top reports only its new
`classifier` as MISSING, which is what fine-tuning trains).

A pre-LN model has no transformers BERT class; it is written as RoBERTa-PreLayerNorm
(`components/hf_prelayernorm.py`), which computes the same thing: RobertaPreLayerNormForMaskedLM /
AutoModelForMaskedLM / pipeline("fill-mask") for `pretraining` and `masked-lm`,
RobertaPreLayerNormModel / AutoModel for `encoder` (and AutoModelForSequenceClassification with
RoBERTa's classification head on top). It has no next-sentence head: a pre-LN model pretrained
with NSP exports `--head masked-lm` or `--head encoder`.

Models transformers cannot compute are refused rather than exported into something that loads
silently as a different model: pre-LN with relative positions and, under transformers >= 5
(which dropped them), relative position embeddings.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

from ..cli_errors import fail
from ..components import hf_prelayernorm
from ..errors import UserError

# transformers ties these to the word embeddings / `cls.predictions.bias` and does not save them.
TIED_KEYS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
# --head: (architecture written in config.json, key prefixes left out of the weights)
HEADS = {"pretraining": ("BertForPreTraining", ()),
         "masked-lm": ("BertForMaskedLM", ("bert.pooler.", "cls.seq_relationship.")),
         "encoder": ("BertModel", ("cls.",))}


def _installed_transformers_major():
    try:
        from importlib.metadata import PackageNotFoundError, version
        return int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return None


def representable(config) -> None:
    """Raise UserError (one line) when transformers cannot compute this model."""
    if config.pre_layer_norm:
        reason = hf_prelayernorm.why_not(config)
        if reason:
            raise UserError(reason)
        return
    major = _installed_transformers_major()
    if config.position_embedding_type != "absolute" and major is not None and major >= 5:
        raise UserError(f"position_embedding_type={config.position_embedding_type} needs "
                        f"transformers < 5 (4.x computes relative positions; the installed "
                        f"{major}.x would load it silently as an absolute-position model): "
                        f"pip install 'transformers<5' and export again, or use bert-predict")


def _prelayernorm_export(config, model, head: str, checkpoint_dir: str) -> tuple[dict, dict]:
    """config.json and weights of a pre-LN model as RoBERTa-PreLayerNorm (module docstring)."""
    if head == "pretraining" and config.next_sentence_prediction:
        raise UserError(f"{checkpoint_dir} is a pre-LN model with a next-sentence head, which "
                        f"transformers' pre-LN model (RoBERTa-PreLayerNorm) does not have: "
                        f"export --head masked-lm (fill-mask, continued pretraining) or --head "
                        f"encoder (fine-tuning)")
    if head != "encoder" and config.hidden_act != "gelu":
        raise UserError(f"{checkpoint_dir}: hidden_act={config.hidden_act} but "
                        f"RoBERTa-PreLayerNorm's MLM head always applies GELU, so the MLM head "
                        f"would compute something else: export --head encoder")
    weights = hf_prelayernorm.to_hf_state(model.state_dict(), config)
    prefix = hf_prelayernorm.PREFIX
    if head == "encoder":  # RobertaPreLayerNormModel's own key names have no prefix
        weights = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        architecture = hf_prelayernorm.ARCHITECTURES["encoder"]
    else:  # the decoder is tied to the word embeddings and lm_head.bias: not saved
        weights = {k: v for k, v in weights.items() if not k.startswith(
            ("lm_head.decoder.", prefix + "pooler."))}
        architecture = hf_prelayernorm.ARCHITECTURES["masked-lm"]
    return {**hf_prelayernorm.hf_config(config), "architectures": [architecture]}, weights


def export(source: str, out_dir: str, head: str = "pretraining") -> str:
    """Export `source` (a run dir or a checkpoint) to `out_dir` with the weights of `head`
    (HEADS); returns the checkpoint used."""
    from safetensors.torch import save_file

    from ..components import checkpoint as ckpt
    from ..components.hf_import import is_hf_model_dir
    from ..model import BertForPreTraining
    from .model_loading import checkpoint_config, checkpoint_tokenizer_files, resolve_checkpoint

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"{out_dir} is a file; choose a new output directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise UserError(f"{out_dir} exists and is not empty; choose a new output directory")
    if os.path.isdir(source) and is_hf_model_dir(source):
        raise UserError(f"{source} is already a transformers model directory (config.json + "
                        f"weights): load it with from_pretrained as it is; bert-export takes a "
                        f"bert-train run directory or checkpoint")
    checkpoint_dir = resolve_checkpoint(
        source, warn=lambda m: print(f"bert-export: warning: {m}", file=sys.stderr))
    state = ckpt.read_train_state(checkpoint_dir)  # (verified by resolve_checkpoint: cached)
    config = checkpoint_config(checkpoint_dir)
    representable(config)
    if config.generator_layers and head != "encoder":
        raise UserError(f"{checkpoint_dir} was pretrained with an ELECTRA generator "
                        f"(model.generator_layers={config.generator_layers}): its MLM head is "
                        f"the generator's and does not fit the encoder; export --head encoder")
    model = BertForPreTraining(config)
    ckpt.load_weights(checkpoint_dir, model)
    if config.pre_layer_norm:
        hf_config, weights = _prelayernorm_export(config, model, head, checkpoint_dir)
    else:
        architecture, left_out = HEADS[head]
        hf_config = {**config.to_hf_dict(), "architectures": [architecture]}
        if head == "encoder":  # BertModel's own key names have no "bert." prefix
            weights = {k[len("bert."):]: v for k, v in model.hf_state_dict().items()
                       if k.startswith("bert.")}
        else:
            weights = {k: v for k, v in model.hf_state_dict().items()
                       if k not in TIED_KEYS and not k.startswith(left_out)}
    tensors = {k: v.detach().contiguous().clone() for k, v in weights.items()}
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    # Written beside out_dir and renamed into place: an interrupted export leaves no half
    # directory that transformers would fail on later.
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_config, f, indent=2)
        if not ckpt.copy_own_files(os.path.join(checkpoint_dir, ckpt.TOKENIZER_DIR),
                                   checkpoint_tokenizer_files(state), tmp):
            print(f"bert-export: warning: {checkpoint_dir} has no tokenizer/; only the model was "
                  f"exported", file=sys.stderr)
        # What the user's umask gives a new file and directory (mkdtemp makes 0700 and
        # safetensors writes 0600): no wider, so a private key never leaves readable, and no
        # narrower, so the export can be served or shared as the user's files are.
        umask = os.umask(0)
        os.umask(umask)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
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
    parser.add_argument("--head", choices=tuple(HEADS), default="pretraining",
                        help="what the export holds: pretraining (default: everything, for "
                             "BertForPreTraining), masked-lm (for BertForMaskedLM and "
                             "pipeline('fill-mask'): no pooler, no NSP head), encoder (for "
                             "BertModel and fine-tuning: no pretraining heads)")
    args = parser.parse_args(argv)
    try:
        used = export(args.source, args.out_dir, args.head)
    except UserError as exc:
        fail("bert-export", str(exc))
    loaders = {"pretraining": "BertForPreTraining (and, reporting the heads they leave out, "
                              "BertForMaskedLM, AutoModel, AutoModelFor*)",
               "masked-lm": "BertForMaskedLM and pipeline('fill-mask')",
               "encoder": "AutoModel / BertModel and AutoModelForSequenceClassification"}
    with open(os.path.join(args.out_dir, "config.json"), encoding="utf-8") as f:
        if json.load(f).get("model_type") == hf_prelayernorm.MODEL_TYPE:
            loaders = {"pretraining": "RobertaPreLayerNormForMaskedLM, AutoModelForMaskedLM and "
                                      "pipeline('fill-mask'): pre-LN",
                       "encoder": "AutoModel / RobertaPreLayerNormModel and "
                                  "AutoModelForSequenceClassification: pre-LN"}
            loaders["masked-lm"] = loaders["pretraining"]
    print(f"bert-export: exported {used} to {args.out_dir} (transformers loads it as "
          f"{loaders[args.head]})")


if __name__ == "__main__":
    main()
