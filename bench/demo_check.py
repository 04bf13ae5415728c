"""What the demo model learned, and the README's copy of it (`make demo-readme`).

    python bench/demo_check.py runs/demo                      # table on stdout + JSON
    python bench/demo_check.py runs/demo --readme README.md   # also rewrite the README's block

Reads the run's last held-out evaluation (metrics.jsonl), the most-frequent-token baseline of
the data it was scored on, and asks the model to fill in SENTENCES (documentation-style
sentences whose missing word the context gives away) and to score NSP_PAIRS, through
`bert-predict` itself, so the README shows exactly what a user gets from the same commands.
The README's block sits between BEGIN and END; everything in it is written here, from the run,
so it cannot drift from the demo. tests/test_demo.py checks a step-bounded demo against the
same sentences.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # `python bench/demo_check.py` from a checkout
    sys.path.insert(0, REPO)

# (sentence, the word its context gives away): sentences written for the demo in the style of
# the built-in corpus (Python's documentation), not copied from it.
SENTENCES = [
    ("If the key is not found, a KeyError is [MASK].", "raised"),
    ("Open the file for [MASK] and return a file object.", "reading"),
    ("Extra keyword [MASK] are passed to the constructor.", "arguments"),
    ("New in [MASK] 3.2.", "version"),
    ("For [MASK], the following code prints the numbers.", "example"),
]
# (segment A, segment B): B follows A, then a B from another topic.
NSP_PAIRS = [
    ("Return a new list containing the items of the iterable.",
     "If the iterable is empty, the list is empty."),
    ("Return a new list containing the items of the iterable.",
     "Send a signal to the process group."),
]
TOP_K = 3
BEGIN = "<!-- demo-output: written by `make demo-readme` (bench/demo_check.py) from runs/demo -->"
END = "<!-- demo-output end -->"


def predict_cli(args: list) -> str:
    """The standard output of `bert-predict ARGS`, run in this process."""
    from bert_pretrain.tools import predict

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        predict.main(args)
    return out.getvalue()


def fill_mask_args(run_dir: str) -> list:
    return ["fill-mask", run_dir, *[s for s, _ in SENTENCES], "--top-k", str(TOP_K)]


def nsp_args(run_dir: str, pair) -> list:
    return ["nsp", run_dir, *pair]


def last_evaluation(run_dir: str) -> dict:
    """The last held-out evaluation in the run's metrics.jsonl, with the step count and the
    training seconds (evaluation and saving excluded) of the last logged step."""
    path = os.path.join(run_dir, "metrics.jsonl")
    evals, trained = [], {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if "eval_mlm_accuracy" in record:
                evals.append(record)
            elif "tokens_per_s" in record:
                trained = record
    if not evals:
        raise SystemExit(f"demo_check: {path} has no held-out evaluation; is the run finished?")
    return {**evals[-1], "train_step": trained.get("step"),
            "train_seconds": trained.get("elapsed_s")}


def summarize(run_dir: str, data_dir: str) -> dict:
    """Everything the README block and the test need, as one JSON-able dict."""
    from bert_pretrain.components.data import PreparedData
    from bert_pretrain.components.evaluation import majority_baseline
    from bert_pretrain.tools.predict import Predictor

    ev = last_evaluation(run_dir)
    predictor = Predictor(run_dir)
    fills = []
    for sentence, answer in SENTENCES:
        top = [p["token"] for p in
               predictor.fill_mask(sentence, TOP_K)["masks"][0]["predictions"]]
        fills.append({"sentence": sentence, "answer": answer, "top": top,
                      "right": top[0] == answer})
    nsp = [predictor.nsp(a, b)["is_next_probability"] for a, b in NSP_PAIRS]
    return {"run_dir": run_dir, "data_dir": data_dir, "step": ev["step"],
            "train_seconds": ev["train_seconds"],
            "mlm_accuracy": ev["eval_mlm_accuracy"],
            "mlm_accuracy_masked": ev.get("eval_mlm_accuracy_masked"),
            "baseline": majority_baseline(PreparedData(data_dir), "validation"),
            "nsp_accuracy": ev["eval_nsp_accuracy"],
            "nsp_accuracy_balanced": ev.get("eval_nsp_accuracy_balanced"),
            "fill_mask": fills, "fill_mask_right": sum(f["right"] for f in fills),
            "nsp_pairs": nsp}


def _command(args: list) -> str:
    """A bert-predict command line as the README shows it, one sentence per line."""
    head, rest = args[:2], args[2:]
    lines = ["$ bert-predict " + " ".join(shlex.quote(a) for a in head) + " \\"]
    words = [shlex.quote(a) for a in rest]
    if args[0] == "fill-mask":  # sentences one a line, the options after them
        lines += [f"    {w} \\" for w in words[:-2]] + ["    " + " ".join(words[-2:])]
    else:
        lines += [f"    {w} \\" for w in words[:-1]] + ["    " + words[-1]]
    return "\n".join(lines)


def readme_block(summary: dict) -> str:
    """The README's demo section body: the figures of the run, then the commands and their
    output."""
    run_dir = summary["run_dir"]
    minutes = summary["train_seconds"] / 60
    masked = summary["mlm_accuracy_masked"]
    figures = (
        f"The demo model after {summary['step']:,} steps ({minutes:.1f} minutes of training): "
        f"held-out accuracy at `[MASK]` positions {100 * masked:.1f}% (always guessing the most "
        f"frequent token: {100 * summary['baseline']:.1f}%), NSP "
        f"{100 * summary['nsp_accuracy']:.1f}% (chance: 50%); top-1 right on "
        f"{summary['fill_mask_right']} of these {len(SENTENCES)} sentences:")
    text = [
        BEGIN,
        textwrap.fill(figures, width=99, break_on_hyphens=False),
        "```text",
        _command(fill_mask_args(run_dir)),
        predict_cli(fill_mask_args(run_dir)).rstrip("\n"),
    ]
    for pair in NSP_PAIRS:
        text += ["", _command(nsp_args(run_dir, pair)),
                 predict_cli(nsp_args(run_dir, pair)).rstrip("\n")]
    return "\n".join(text + ["```", END])


def replace_block(readme: str, block: str) -> str:
    """The README text with the block between BEGIN and END replaced by `block`."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"demo_check: the README has no demo block ({BEGIN!r} ... {END!r})")
    return readme[:start] + block + readme[end + len(END):]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", nargs="?", default="runs/demo")
    parser.add_argument("--data", default="prepared/builtin64",
                        help="the prepared data the run was evaluated on (default: the demo's)")
    parser.add_argument("--readme", help="rewrite this README's demo block from the run")
    parser.add_argument("--json", default=os.path.join("bench", "results", "demo_check.json"))
    args = parser.parse_args(argv)
    summary = summarize(args.run_dir, args.data)
    print(f"{args.run_dir}: step {summary['step']}, held-out MLM accuracy at [MASK] "
          f"{summary['mlm_accuracy_masked']:.4f} (most frequent token {summary['baseline']:.4f})"
          f", NSP {summary['nsp_accuracy']:.4f} (balanced "
          f"{summary['nsp_accuracy_balanced']:.4f})")
    print(f"| sentence | answer | top {TOP_K} | right |\n|---|---|---|---|")
    for f in summary["fill_mask"]:
        print(f"| {f['sentence']} | {f['answer']} | {' '.join(f['top'])} | "
              f"{'yes' if f['right'] else 'no'} |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    if args.readme:
        with open(args.readme, encoding="utf-8") as f:
            readme = f.read()
        updated = replace_block(readme, readme_block(summary))
        with open(args.readme, "w", encoding="utf-8") as f:
            f.write(updated)
        print(f"demo_check: {args.readme}: demo block "
              f"{'rewritten' if updated != readme else 'unchanged'}")


if __name__ == "__main__":
    main()
