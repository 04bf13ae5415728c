"""bert-train's speed, today's code against a git revision: the single-process and the DDP path.

A change to the training loop (sharding, process groups, checkpoints, locks) must not slow the
paths users already run.  This runs the real `bert-train` command (a fresh process, Hydra,
data loading, the whole loop) from two source trees, today's and `--baseline REV`'s (extracted
with `git archive`, run with PYTHONPATH pointing at it), on the same prepared data and config:

  1proc  python -m bert_pretrain.train                 (default threads: all cores)
  ddp2   torchrun --standalone --nproc_per_node 2 ...  (DDP over gloo, 1 thread per process)

The versions alternate run by run (A B A B ...), so the load other processes put on the machine
hits both alike; `--runs N` repeats each pair N times.  A run's figure is the median of its
logged training windows' tokens/s (metrics.jsonl: non-padding tokens of the global batch per
second of training steps, evaluation and saving excluded), after the first `--skip` steps
(warm-up).  Reported: median over runs with the min-max spread, the ratio today/baseline, and
the other processes' load during each run (busy cores outside the benchmark's own children).

    python bench/bench_train_paths.py --baseline e87470c --runs 3
    python bench/bench_train_paths.py --baseline HEAD~5 --paths 1proc --steps 40 --runs 1
    # table on stdout, bench/results/train_paths.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import OtherLoad, median_and_range  # noqa: E402

CORPUS = ROOT.parent / "shared" / "corpora" / "gutenberg.txt"
PATHS = ("1proc", "ddp2")


def extract(rev: str, into: Path) -> Path:
    """The tree of `rev` (its committed files) under `into`."""
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                                 capture_output=True).stdout
    except subprocess.CalledProcessError as e:
        sys.exit(f"error: --baseline {rev}: git archive failed: "
                 f"{e.stderr.decode(errors='replace').strip()}")
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def env_for(tree: Path, threads: int | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), WANDB_MODE="disabled")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    else:
        env.pop("OMP_NUM_THREADS", None)
    return env


def check_imports_from(tree: Path, cwd: Path) -> None:
    """Neither the working directory nor an editable install may win over PYTHONPATH: the run
    would time the wrong code under the right name."""
    out = subprocess.run([sys.executable, "-c", "import bert_pretrain; print(bert_pretrain.__file__)"],
                         env=env_for(tree, None), cwd=cwd, capture_output=True, text=True,
                         check=True)
    if not Path(out.stdout.strip()).resolve().is_relative_to(tree.resolve()):
        sys.exit(f"error: PYTHONPATH={tree} imports bert_pretrain from {out.stdout.strip()}")


def prepare(tree: Path, out: Path, lines: int, seq_len: int) -> Path:
    """A small prepared corpus (the first `lines` lines of gutenberg.txt), made by `tree`'s
    bert-prep so both versions read one format they both know."""
    if not CORPUS.is_file():
        sys.exit(f"error: {CORPUS} not found: pass --data <a bert-prep output folder>")
    text = out / "corpus.txt"
    with open(CORPUS, encoding="utf-8") as src, open(text, "w", encoding="utf-8") as dst:
        for i, line in enumerate(src):
            if i >= lines:
                break
            dst.write(line)
    data = out / "prepared"
    proc = subprocess.run([sys.executable, "-m", "data_prep.build", "corpus=text",
                    f"corpus.paths=[{text}]", "tokenizer.vocab_size=8192",
                    f"max_seq_length={seq_len}", f"output_dir={data}"],
                   env=env_for(tree, None), cwd=out, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit("error: bert-prep failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1])
    return data


def train_command(path: str, overrides: list[str]) -> tuple[list[str], int | None]:
    if path == "1proc":
        return [sys.executable, "-m", "bert_pretrain.train", *overrides], None
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "bert_pretrain.train", *overrides], 1


def one_run(tree: Path, path: str, args, data: Path, work: Path) -> dict:
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"model={args.model}", f"data.dir={data}", f"run_dir={run_dir}",
                 f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={args.batch}",
                 "trainer.log_every=5", "trainer.eval_every=0", "trainer.eval_max_samples=32",
                 f"trainer.checkpoint_every={args.steps}", "trainer.progress_bar=false",
                 "trainer.report=false", "logger=none"]
    cmd, threads = train_command(path, overrides)
    load = OtherLoad(own="children")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env_for(tree, threads), cwd=work, capture_output=True,
                              text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"error: {path} run of {tree} took over --timeout {args.timeout} s: "
                 f"lower --steps or raise --timeout")
    wall = time.perf_counter() - t0
    other = load.cores()
    if proc.returncode != 0:
        sys.exit(f"error: {path} run of {tree} failed (exit {proc.returncode}):\n"
                 + "\n".join(proc.stderr.strip().splitlines()[-15:]))
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    speeds = sorted(r["tokens_per_s"] for r in records
                    if "tokens_per_s" in r and r["step"] > args.skip)
    if not speeds:
        sys.exit(f"error: no training records after step {args.skip}: raise --steps")
    return {"tokens_per_s": speeds[len(speeds) // 2], "wall_s": wall, "other_load_cores": other}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", required=True, metavar="REV",
                   help="git revision to compare with (e.g. the commit before a change)")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--model", default="bert_mini", help="conf/train/model/<name> (default bert_mini)")
    p.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    p.add_argument("--steps", type=int, default=60, help="training steps per run (default 60)")
    p.add_argument("--skip", type=int, default=15, help="warm-up steps not counted (default 15)")
    p.add_argument("--runs", type=int, default=3, help="runs per version and path (default 3)")
    p.add_argument("--data", default=None, help="a bert-prep output folder (default: make one "
                                                "from the first --lines of gutenberg.txt)")
    p.add_argument("--lines", type=int, default=20000,
                   help="lines of gutenberg.txt to prepare (default 20000: 4 books)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--timeout", type=int, default=1800, help="seconds one run may take")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_paths.json"))
    args = p.parse_args()

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "bert_pretrain",
                            "conf", "data_prep"], capture_output=True, text=True).stdout.strip()
    today = f"{head}{'+changes' if dirty else ''}"
    base_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline],
                              capture_output=True, text=True).stdout.strip() or args.baseline
    with tempfile.TemporaryDirectory(prefix="bench-train-paths-") as tmp:
        tmp = Path(tmp)
        trees = {today: ROOT, base_rev: extract(args.baseline, tmp / "baseline")}
        for tree in trees.values():
            check_imports_from(tree, tmp)
        data = Path(args.data).resolve() if args.data else prepare(
            trees[base_rev], tmp, args.lines, args.seq_len)
        rows = []
        for r in range(args.runs):
            for path in args.paths:
                order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
                for version, tree in order:
                    work = tmp / "work"
                    work.mkdir(exist_ok=True)
                    res = one_run(tree, path, args, data, work)
                    res.update(version=version, path=path, run=r)
                    rows.append(res)
                    print(f"run {r + 1}/{args.runs} {path:5s} {version:16s} "
                          f"{res['tokens_per_s']:8.0f} tok/s  wall {res['wall_s']:5.1f} s  "
                          f"other load {res['other_load_cores'] or 0:.2f} cores", flush=True)

    summary = []
    print(f"\nbert-train tokens/s, {args.model}, global batch {args.batch}, seq {args.seq_len}, "
          f"{args.steps} steps (median of {args.runs} runs after step {args.skip}, [min-max])")
    print(f"| path | {today} (today) | {base_rev} (baseline) | today / baseline | other load (cores) |")
    print("|---|---:|---:|---:|---:|")
    for path in args.paths:
        stats = {v: median_and_range([x for x in rows if x["path"] == path and x["version"] == v],
                                     ["tokens_per_s", "wall_s", "other_load_cores"])
                 for v in trees}
        t, b = stats[today], stats[base_rev]
        loads = [x["other_load_cores"] or 0.0 for x in rows if x["path"] == path]
        ratio = t["tokens_per_s"] / b["tokens_per_s"]
        summary.append({"path": path, "today": t, "baseline": b, "ratio": ratio})
        print(f"| {path} | {t['tokens_per_s']:,.0f} [{t['tokens_per_s_range'][0]:,.0f}-"
              f"{t['tokens_per_s_range'][1]:,.0f}] | {b['tokens_per_s']:,.0f} "
              f"[{b['tokens_per_s_range'][0]:,.0f}-{b['tokens_per_s_range'][1]:,.0f}] | "
              f"{ratio:.3f} | {min(loads):.2f}-{max(loads):.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"today": today, "baseline": base_rev, "args": vars(args), "runs": rows,
                   "summary": summary, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "cpu_count": os.cpu_count()}, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
