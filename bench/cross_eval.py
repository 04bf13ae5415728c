"""Score trained models on another prepared held-out split: compare recipes that trained on
different data formats (MLM-only packed rows against NSP sentence pairs) on the same held-out
text, with its static masks.

    python bench/cross_eval.py --data prepared/gutenberg128 runs/a runs/b ...

Each MODEL is a run directory, a checkpoint or a bert-export directory (model_loading); its
tokenizer must be the data's (same vocab.txt). Prints one row per model (MLM accuracy, at
[MASK] positions, MLM loss; NSP where model and data have it) and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def score(model_path: str, data_dir: str, batch_size: int = 64) -> dict:
    from accelerate import Accelerator

    from bert_pretrain.components.data import DataConfig, PreparedData, eval_batches
    from bert_pretrain.components.evaluation import evaluate
    from bert_pretrain.tools.model_loading import load_model

    data = PreparedData(data_dir)
    loaded = load_model(model_path)
    vocab = Path(loaded.tokenizer_dir or "", "vocab.txt")
    if not vocab.is_file() or vocab.read_text().splitlines()[:data.vocab_size] != data.vocab():
        raise SystemExit(f"error: {model_path} was not trained with the tokenizer of {data_dir}")
    cfg = DataConfig(dir=data_dir)
    result = evaluate(loaded.model, Accelerator(cpu=True),
                      eval_batches(data, cfg, batch_size, 1, 0, None),
                      mask_id=data.special.get("mask"))
    return {"model": model_path, "source": loaded.source, **result}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="the bert-prep output whose held-out split scores")
    p.add_argument("models", nargs="+", metavar="MODEL")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    rows = [score(m, args.data) for m in args.models]
    print(f"held-out split of {args.data}:")
    print(f"{'model':<60} {'MLM acc':>8} {'[MASK]':>8} {'MLM loss':>8} {'NSP bal.':>8}")
    for r in rows:
        nsp = r.get("eval_nsp_accuracy_balanced")
        print(f"{r['model'][-60:]:<60} {100 * r['eval_mlm_accuracy']:>7.1f}% "
              f"{100 * r['eval_mlm_accuracy_masked']:>7.1f}% {r['eval_mlm_loss']:>8.3f} "
              f"{'-' if nsp is None else f'{100 * nsp:.1f}%':>8}")
    if args.out:
        Path(args.out).write_text(json.dumps({"data": args.data, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
