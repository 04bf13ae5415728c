"""Ask a trained model what it learned, from the command line:

    bert-predict fill-mask runs/demo "Tom and I read books in the [MASK]." --top-k 5
    bert-predict nsp runs/demo "It was raining." "We took umbrellas."
    bert-predict fill-mask exported/demo --file sentences.txt --json   # one sentence a line
    bert-predict nsp runs/demo --file pairs.tsv                        # A<TAB>B a line

MODEL is a run directory (its latest valid checkpoint), a checkpoint or a transformers directory
(bert-export output). It runs this project's model, so pre-LN and relative-position models work
too. fill-mask: for each [MASK], the top-k tokens with their probabilities (softmax over the
whole vocabulary). nsp: the probability that B follows A. NSP label 0 means "B is the next
segment" in bert-prep's data (`next_sentence_labels` = is_random_next, data_prep/pipeline.py),
as in transformers, so P(is next) is the softmax's index 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..cli_errors import fail
from ..errors import UserError

PROG = "bert-predict"
IS_NEXT = 0  # NSP class index of "B follows A" (see the module docstring)


class Predictor:
    def __init__(self, model_path: str):
        from .model_loading import load_model, load_tokenizer

        self.loaded = load_model(
            model_path, warn=lambda m: print(f"{PROG}: warning: {m}", file=sys.stderr))
        self.model = self.loaded.model
        self.tokenizer = load_tokenizer(self.loaded)
        self.mask_id = self.tokenizer.token_to_id("[MASK]")
        self.max_len = self.model.config.max_position_embeddings

    def _encode(self, a: str, b: str | None = None):
        import torch

        enc = self.tokenizer.encode(a, b) if b is not None else self.tokenizer.encode(a)
        if len(enc.ids) > self.max_len:
            raise UserError(f"the input is {len(enc.ids)} tokens; the model takes at most "
                            f"{self.max_len}: shorten it")
        ids = torch.tensor([enc.ids])
        types = torch.tensor([enc.type_ids])
        return enc, ids, types

    def fill_mask(self, text: str, top_k: int = 5) -> dict:
        """{"text", "masks": [{"position", "predictions": [{"token", "probability"}]}]}"""
        import torch

        enc, ids, types = self._encode(text)
        positions = (ids[0] == self.mask_id).nonzero().flatten().tolist()
        if not positions:
            raise UserError(f"no [MASK] in {text!r}: write [MASK] where a word should be "
                            f"predicted")
        with torch.no_grad():
            out = self.model(ids, attention_mask=torch.ones_like(ids), token_type_ids=types)
        probs = out.prediction_logits[0, positions].float().softmax(-1)
        top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
        masks = []
        for i, pos in enumerate(positions):
            masks.append({"position": pos, "predictions": [
                {"token": self.tokenizer.id_to_token(t), "probability": round(p, 6)}
                for p, t in zip(top.values[i].tolist(), top.indices[i].tolist())]})
        return {"text": text, "tokens": enc.tokens, "masks": masks}

    def nsp(self, a: str, b: str) -> dict:
        """{"a", "b", "is_next_probability"}"""
        import torch

        if not self.model.config.next_sentence_prediction:
            raise UserError(f"{self.loaded.source} was trained without next-sentence prediction "
                            f"(MLM only: no NSP head); use fill-mask, or a model trained on "
                            f"bert-prep packing=nsp_pairs data")
        _, ids, types = self._encode(a, b)
        with torch.no_grad():
            out = self.model(ids, attention_mask=torch.ones_like(ids), token_type_ids=types)
        p = out.seq_relationship_logits[0].float().softmax(-1)[IS_NEXT].item()
        return {"a": a, "b": b, "is_next_probability": round(p, 6)}


def _read_items(args, parser) -> list:
    """Command-line text or the --file's lines (tab-separated pairs for nsp)."""
    pair = args.task == "nsp"
    if args.file and args.text:
        parser.error("give the text on the command line or --file, not both")
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                # (number, line) with the file's own line numbers: blank lines are skipped,
                # not renumbered
                lines = [(n, ln.rstrip("\n")) for n, ln in enumerate(f, 1) if ln.strip()]
        except OSError as exc:
            raise UserError(f"cannot read --file {args.file} ({exc.strerror})") from None
        if not lines:
            raise UserError(f"--file {args.file} is empty")
        if not pair:
            return [(ln,) for _, ln in lines]
        items = []
        for n, ln in lines:
            parts = ln.split("\t")
            if len(parts) != 2:
                raise UserError(f"{args.file} line {n}: expected 'sentence A<TAB>sentence B', "
                                f"found {len(parts)} field(s)")
            items.append(tuple(parts))
        return items
    if pair:
        if len(args.text) != 2:
            parser.error('nsp takes two sentences: "sentence A" "sentence B" (or --file with '
                         'A<TAB>B lines)')
        return [tuple(args.text)]
    if not args.text:
        parser.error('fill-mask takes a sentence with [MASK] (or --file, one sentence a line)')
    return [(t,) for t in args.text]


def _print_fill(result: dict) -> None:
    print(result["text"])
    for n, m in enumerate(result["masks"], 1):
        preds = "  ".join(f"{p['token']} {p['probability']:.3f}" for p in m["predictions"])
        label = f"[MASK] {n}" if len(result["masks"]) > 1 else "[MASK]"
        print(f"  {label}: {preds}")


def _print_nsp(result: dict) -> None:
    p = result["is_next_probability"]
    print(f"P(B follows A) = {p:.3f}  ({'is next' if p >= 0.5 else 'not next'})")
    print(f"  A: {result['a']}")
    print(f"  B: {result['b']}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run a trained model: fill in [MASK] tokens, or score whether "
                               "sentence B follows sentence A (NSP).",
        epilog='examples:\n  bert-predict fill-mask runs/demo "Tom and I read books in the '
               '[MASK]." --top-k 5\n  bert-predict nsp runs/demo "It was raining." "We took '
               'umbrellas."\nMODEL: a run directory (latest checkpoint), a checkpoint, or a '
               'bert-export / transformers directory.',
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=("fill-mask", "nsp"))
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("text", nargs="*", help="fill-mask: sentence(s) with [MASK]; nsp: A B")
    parser.add_argument("--file", help="read the input from this file, one item a line "
                                       "(nsp: A<TAB>B)")
    parser.add_argument("--top-k", type=int, default=5, help="fill-mask: tokens per [MASK] "
                                                             "(default 5)")
    parser.add_argument("--json", action="store_true", help="one JSON object per input line")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.top_k < 1:
        parser.error("--top-k must be >= 1")
    from .model_loading import one_line_warnings

    one_line_warnings(PROG)
    try:
        items = _read_items(args, parser)
        if not os.path.exists(args.model):
            raise UserError(f"MODEL {args.model}: no such directory; pass a run directory, a "
                            f"checkpoint or a bert-export directory")
        predictor = Predictor(args.model)
        for n, item in enumerate(items):
            if args.task == "fill-mask":
                result = predictor.fill_mask(item[0], args.top_k)
                result.pop("tokens")
            else:
                result = predictor.nsp(*item)
            if args.json:
                print(json.dumps(result, ensure_ascii=False))
            else:
                if n:
                    print()
                (_print_fill if args.task == "fill-mask" else _print_nsp)(result)
    except UserError as exc:
        fail(PROG, str(exc))


if __name__ == "__main__":
    main()
