"""Attention maps: where each head of a trained model looks, as heat maps.

    bert-attention runs/demo "The cat sat on the mat." "It was warm." --layers 0,1 -o maps.png

One panel per (layer, head): row = the token attending (query), column = the token attended to
(key), colour = attention probability (each row sums to 1). MODEL is a run directory, a
checkpoint or a transformers directory; layers and heads count from 0.
"""

from __future__ import annotations

import argparse
import os

from ..cli_errors import fail
from ..errors import UserError

PROG = "bert-attention"


def parse_indices(spec: str, count: int, what: str) -> list:
    """'all', '3', '0,2' or '0-3' -> sorted indices below `count`; one-line UserError otherwise."""
    if spec.strip().lower() == "all":
        return list(range(count))
    out = set()
    try:
        for part in spec.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(p) for p in part.split("-", 1))
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
    except ValueError:
        raise UserError(f"--{what} {spec!r}: expected 'all', a number, a list (0,2) or a range "
                        f"(0-3)") from None
    bad = sorted(i for i in out if not 0 <= i < count)
    if bad or not out:
        raise UserError(f"--{what} {spec!r}: the model has {count} {what} (0-{count - 1})")
    return sorted(out)


def attention_maps(model_path: str, a: str, b: str | None, layers: str = "all",
                   heads: str = "all") -> tuple:
    """(maps[i][j] as numpy [L, L], tokens, layer indices, head indices, source)."""
    import torch

    from .model_loading import load_model, load_tokenizer

    loaded = load_model(model_path)
    model, config = loaded.model, loaded.model.config
    tokenizer = load_tokenizer(loaded)
    layer_ids = parse_indices(layers, config.num_hidden_layers, "layers")
    head_ids = parse_indices(heads, config.num_attention_heads, "heads")
    enc = tokenizer.encode(a, b) if b is not None else tokenizer.encode(a)
    if len(enc.ids) > config.max_position_embeddings:
        raise UserError(f"the input is {len(enc.ids)} tokens; the model takes at most "
                        f"{config.max_position_embeddings}")
    ids, types = torch.tensor([enc.ids]), torch.tensor([enc.type_ids])
    with torch.no_grad():
        out = model.bert(ids, torch.ones_like(ids), types, output_attentions=True)
    maps = [[out.attentions[layer][0, head].float().numpy() for head in head_ids]
            for layer in layer_ids]
    return maps, enc.tokens, layer_ids, head_ids, loaded.source


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Draw a trained model's attention maps for one sentence (or a "
                               "pair), one heat map per layer and head.",
        epilog='example: bert-attention runs/demo "The cat sat on the mat." --layers 0,1 '
               '--heads all -o maps.png')
    parser.add_argument("model", metavar="MODEL",
                        help="a run directory, a checkpoint or a bert-export directory")
    parser.add_argument("sentence_a")
    parser.add_argument("sentence_b", nargs="?", help="optional second segment")
    parser.add_argument("--layers", default="all", help="all, 0,3 or 0-2 (default: all)")
    parser.add_argument("--heads", default="all", help="all, 0,1 or 0-3 (default: all)")
    parser.add_argument("-o", "--out", default="attention.png", help="PNG to write "
                                                                     "(default: attention.png)")
    args = parser.parse_args(argv)
    from .model_loading import one_line_warnings

    one_line_warnings(PROG)
    try:
        if not os.path.exists(args.model):
            raise UserError(f"MODEL {args.model}: no such directory; pass a run directory, a "
                            f"checkpoint or a bert-export directory")
        if os.path.isdir(args.out):
            raise UserError(f"-o {args.out} is a directory; name a .png file")
        maps, tokens, layers, heads, source = attention_maps(
            args.model, args.sentence_a, args.sentence_b, args.layers, args.heads)
        from .plotting import plot_attention

        out = plot_attention(maps, tokens, layers, heads, args.out,
                             f"attention of {source}")
    except UserError as exc:
        fail(PROG, str(exc))
    print(f"{PROG}: wrote {out} ({len(layers)} layer(s) x {len(heads)} head(s), "
          f"{len(tokens)} tokens)")


if __name__ == "__main__":
    main()
