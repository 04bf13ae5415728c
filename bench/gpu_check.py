"""`make gpu-check`: everything worth measuring on a GPU machine, in one command and one folder.

A GPU is lent for minutes at a time; this spends them measuring.  In order of value, each stage
with a time cap of its own and the whole within --budget seconds (8 minutes by default, on one
H100); a stage that no longer fits is listed as not run:
  1. cuda tests      pytest --cuda -m cuda (tests/test_cuda.py): training in fp32/bf16/fp16,
                     every attention path against the eager one, checkpoints between GPU and CPU
  2. bench           bench_model.py, ours against transformers (sdpa), bf16, alternating, a new
                     batch draw each run: BERT-base L128 b256 with our default and each speed
                     switch flipped; BERT-mini L128 b256 (the bert-train stage's shape);
                     BERT-large L128 b128 (large models go in groups, so that the models of
                     one process fit in the GPU's memory); last of all, after stage 5,
                     BERT-large L512 b32 and impl.compile (compiling takes a minute)
  3. train           bert-prep (the built-in corpus, or --corpus FILE), bert-train
                     experiment=gpu_mini for --train-seconds, then a resume for a quarter of that;
                     tokens/s against the bench's step rate at the same shape
  4. glue            with --glue DIR (GLUE's SST-2/ folder): bert-glue on SST-2 for the trained
                     model and its random-init control
  5. default suite   pytest -m "not slow" (the CPU suite: it hides the GPU) with -rf --junitxml,
                     on all cores when pytest-xdist is there

Everything goes under --out (default gpu-check/<UTC time>/): each stage's log and JSON, env.json
(device, driver, versions) and summary.md with the tables; the summary is printed at the end.

    python3 bench/gpu_check.py                          # on the GPU machine (make gpu-check)
    python3 bench/gpu_check.py --glue glue_data --corpus corpus.txt --budget 600
    python3 bench/gpu_check.py --stages bench train     # some stages only

On a machine without CUDA it refuses, unless --allow-cpu (tests run its plumbing that way, with
--quick sizes); its figures then say "cpu", never a GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("cuda-tests", "bench", "train", "glue", "default-suite")

# (preset:batch:seq, variants) per bench process; large models split so that each process's
# models (with AdamW state: 16 bytes a parameter, 5.4 GB for BERT-large) fit with room for
# activations.  The variant names are bench_model.py's.
BENCH_GROUPS = [
    ("bert_base:256:128", ["ours-no-unpad", "ours-varlen-nested", "ours-varlen-groups",
                           "ours-fused-qkv", "ours-no-sparse-last", "ours-no-sparse"]),
    ("bert_mini:256:128", ["ours-varlen-nested"]),
    ("bert_large:128:128", ["ours-no-unpad", "ours-varlen-nested", "ours-fused-qkv"]),
]
# after the training and the suites: what takes longest per figure (compiling; long sequences)
LATE_BENCH_GROUPS = [
    ("bert_large:32:512", ["ours-no-unpad", "ours-varlen-nested"]),
    ("bert_base:256:128", ["ours-compile"]),
    ("bert_large:128:128", ["ours-no-sparse-last", "ours-compile"]),
]
QUICK_BENCH_GROUPS = [("bert_tiny:8:64", ["ours-varlen-nested", "ours-no-unpad"])]
QUICK_LATE_BENCH_GROUPS = [("bert_tiny:4:128", ["ours-compile"])]


class Check:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget
        self.results: dict[str, dict] = {}
        self.env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
                    "PYTHONPATH": os.pathsep.join(
                        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, stage: str, name: str, cmd: list, cap: float, cwd=ROOT) -> dict:
        """Run `cmd`, its output to <out>/<name>.log, for at most `cap` seconds or what the budget
        has left; the record says how it ended."""
        limit = min(cap, self.left())
        log = self.out / f"{name}.log"
        record = dict(stage=stage, name=name, command=" ".join(map(str, cmd)), log=log.name)
        if limit < 20:
            record.update(status="not run: the budget is spent")
            return record
        start = time.monotonic()
        record["started_s"] = round(start - self.t0, 1)
        with open(log, "w") as f:
            f.write(f"$ {record['command']}\n")
            f.flush()
            try:
                proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=self.env, stdout=f,
                                      stderr=subprocess.STDOUT, timeout=limit)
                record.update(status="ok" if proc.returncode == 0 else
                              f"failed (exit {proc.returncode})", returncode=proc.returncode)
            except subprocess.TimeoutExpired:
                record.update(status=f"cut at its {limit:.0f} s limit")
        record["seconds"] = round(time.monotonic() - start, 1)
        print(f"gpu-check: {name}: {record['status']} ({record['seconds']} s)", flush=True)
        return record


def environment(args) -> dict:
    import torch

    info = dict(time_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), torch=torch.__version__,
                cuda=torch.version.cuda, device=args.device, cpu_count=os.cpu_count())
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        smi = shutil.which("nvidia-smi")
        if smi:
            info["nvidia_smi"] = subprocess.run(
                [smi, "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    for module in ("transformers", "accelerate", "hydra", "datasets", "tokenizers"):
        try:
            info[module] = __import__(module).__version__
        except Exception as exc:  # reported, not fatal: the stages that need it will say
            info[module] = f"missing ({type(exc).__name__})"
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                            capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return info


def missing_modules() -> list[str]:
    import importlib.util

    return [m for m in ("hydra", "omegaconf", "datasets", "tokenizers", "accelerate",
                        "transformers", "blingfire", "safetensors")
            if importlib.util.find_spec(m) is None]


# ----------------------------------------------------------------------------------- stages
def stage_cuda_tests(c: Check) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider",
           "tests/test_cuda.py", "--junitxml", c.out / "pytest_cuda.xml"]
    if c.args.device == "cuda":
        cmd[4:4] = ["--cuda", "-m", "cuda"]
    c.results["cuda-tests"] = c.run("cuda-tests", "pytest_cuda", cmd, cap=180)


def stage_bench(c: Check, late: bool = False) -> None:
    records = c.results.get("bench", {}).get("runs", [])
    if late:
        groups = QUICK_LATE_BENCH_GROUPS if c.args.quick else LATE_BENCH_GROUPS
    else:
        groups = QUICK_BENCH_GROUPS if c.args.quick else BENCH_GROUPS
    steps = ["--warmup", "1", "--steps", "2", "--runs", "1"] if c.args.quick else \
        ["--warmup", "2", "--steps", "5", "--runs", "3"]
    for spec, variants in groups:
        name = f"bench_{len(records)}_{spec.replace(':', '_')}"
        cmd = [sys.executable, "bench/bench_model.py", "--device", c.args.device,
               "--presets", spec, "--variants", *variants, *steps,
               "--out", c.out / f"{name}.json"]
        if c.args.device == "cuda":
            cmd += ["--dtypes", "bf16"]
        elif c.args.quick:
            cmd += ["--dtypes", "fp32"]
        records.append(c.run("bench", name, cmd, cap=180))
    c.results["bench"] = dict(stage="bench", runs=records)


def stage_train(c: Check) -> None:
    data = c.out / "prepared"
    quick = c.args.quick
    corpus = ["corpus=builtin"] if c.args.corpus is None else \
        ["corpus=text", f"corpus.paths=[{Path(c.args.corpus).resolve()}]"]
    prep = c.run("train", "bert_prep", [
        sys.executable, "-m", "data_prep.build", *corpus, f"output_dir={data}",
        "tokenizer.vocab_size=8192", "progress=false",
        *(["max_seq_length=64", "dupe_factor=1"] if quick else [])], cap=180)
    records = [prep]
    run_dir = c.out / "run_gpu_mini"
    seconds = c.args.train_seconds
    common = [sys.executable, "-m", "bert_pretrain.train", "experiment=gpu_mini",
              f"data.dir={data}", f"run_dir={run_dir}", "trainer.progress_bar=false",
              "trainer.report=false"]
    if quick:
        common += ["model=bert_tiny", "trainer.global_batch_size=8", "trainer.warmup_steps=2",
                   "trainer.log_every=2", "trainer.eval_max_samples=16",
                   "trainer.checkpoint_every=1000000"]
    if c.args.device != "cuda":
        common += ["trainer.cpu=true"]
    first_windows = 0
    if prep["status"] == "ok":
        hours = seconds / 3600
        records.append(c.run("train", "bert_train", common + [f"trainer.budget_hours={hours}"],
                             cap=seconds + 120))
        first_windows = len(_metric_records(run_dir))
        if records[-1]["status"] == "ok":
            # continue the same run: the resume's start-up and its first steps' rate
            records.append(c.run("train", "bert_train_resume", common + [
                "resume=auto", f"trainer.budget_hours={hours * 1.25}"], cap=seconds / 4 + 120))
    c.results["train"] = dict(stage="train", runs=records, run_dir=str(run_dir),
                              first_run_records=first_windows)


def stage_glue(c: Check) -> None:
    if not c.args.glue:
        c.results["glue"] = dict(stage="glue", status="not run: no --glue folder given")
        return
    run_dir = c.out / "run_gpu_mini"
    cmd = [sys.executable, "-m", "bert_pretrain.finetune.glue", f"models=[{run_dir}]",
           "tasks=[sst2]", f"data_dir={Path(c.args.glue).resolve()}", "controls=true",
           f"out_dir={c.out / 'glue'}", "recipe.seeds=[1]", "recipe.lrs=[1e-4]",
           # 8,000 sentences x 3 epochs: 750 steps a fine-tune (12-73 s on an H100)
           "max_train_samples=64" if c.args.quick else "max_train_samples=8000"]
    if c.args.quick:
        cmd += ["max_eval_samples=32"]
    c.results["glue"] = c.run("glue", "bert_glue", cmd, cap=240)


def stage_default_suite(c: Check) -> None:
    import importlib.util

    cmd = [sys.executable, "-m", "pytest", "-v", "-rf", "-m", "not slow", "-p",
           "no:cacheprovider", "--junitxml", c.out / "pytest_default.xml"]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(max(1, (os.cpu_count() or 2) - 2))]
    if c.args.quick:  # the plumbing check: one small test file
        cmd += ["tests/test_progress.py"]
    # -v streams each verdict to the log, so a suite cut by the budget still leaves its results
    c.results["default-suite"] = c.run("default-suite", "pytest_default", cmd, cap=600)


# ---------------------------------------------------------------------------------- summary
def _bench_rows(c: Check) -> list[dict]:
    rows = []
    for path in sorted(c.out.glob("bench_*.json")):
        for r in json.loads(path.read_text()).get("summary", []):
            rows.append(r)
    return rows


def _metric_records(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train_rates(c: Check) -> dict:
    """Median logged tokens/s of the training run (its first fifth left out: start-up, the
    first shapes' kernel set-up) and of the resume, the final evaluation."""
    train = c.results.get("train", {})
    records = _metric_records(train.get("run_dir", ""))
    split = train.get("first_run_records", len(records))

    def rate(part):
        rates = [r["tokens_per_s"] for r in part if r.get("tokens_per_s")]
        return statistics.median(rates[len(rates) // 5:] or rates) if rates else None

    steps = [r["step"] for r in records if r.get("tokens_per_s")]
    if not steps:
        return {}
    return dict(median_tokens_per_s=rate(records[:split]), resume_tokens_per_s=rate(
        records[split:]), records=len(steps), last_step=steps[-1],
        final_eval={k: v for r in records for k, v in r.items() if k.startswith("eval_")})


def write_summary(c: Check, env: dict) -> str:
    lines = [f"# gpu-check {env['time_utc']}", "",
             f"Device: {env.get('gpu', 'cpu (no GPU: plumbing check only)')}; torch "
             f"{env['torch']} (CUDA {env['cuda']}); transformers {env['transformers']}; "
             f"commit {env.get('git_commit', '?')[:12]}", "",
             "| stage | status | seconds | log |", "|---|---|---:|---|"]
    for stage in STAGES:
        rec = c.results.get(stage)
        for r in (rec.get("runs", [rec]) if rec else []):
            lines.append(f"| {r.get('name', stage)} | {r.get('status', '?')} | "
                         f"{r.get('seconds', '')} | {r.get('log', '')} |")
    rows = _bench_rows(c)
    if rows:
        lines += ["", "## Bench (median of the runs, min-max)", "",
                  "| preset | batch | seq | model | tok/s | x transformers | MFU | step peak GiB "
                  "| alloc retries |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            lo, hi = r.get("speedup_vs_transformers_range", [0, 0])
            lines.append(
                f"| {r['preset']} | {r['batch_size']} | {r['seq_len']} | {r['model']} | "
                f"{r['tokens_per_s']:,.0f} | {r['speedup_vs_transformers']:.2f} "
                f"({lo:.2f}-{hi:.2f}) | {100 * r['mfu']:.1f}% | "
                f"{r.get('peak_step_memory_gib', '-')} | {r.get('alloc_retries', '-')} |")
    rates = _train_rates(c)
    if rates and rates["median_tokens_per_s"]:
        bench_rate = next((r["tokens_per_s"] for r in rows if r["model"] == "ours"
                           and r["preset"] == "bert_mini" and r["batch_size"] == 256), None)
        ratio = f": {rates['median_tokens_per_s'] / bench_rate:.2f}x the bench's BERT-mini " \
                f"b256 step rate ({bench_rate:,.0f} tok/s)" \
            if bench_rate and rates["median_tokens_per_s"] else ""
        lines += ["", "## bert-train experiment=gpu_mini", "",
                  f"{rates['median_tokens_per_s']:,.0f} tokens/s (median of the logged "
                  f"windows, the first fifth left out){ratio}; the resume "
                  + (f"{rates['resume_tokens_per_s']:,.0f} tokens/s"
                     if rates["resume_tokens_per_s"] else "did not run")
                  + f"; {rates['last_step']} steps in all.",
                  f"Final evaluation: {json.dumps(rates['final_eval'])}"]
    glue_md = c.out / "glue" / "glue.md"
    if glue_md.is_file():
        lines += ["", "## bert-glue SST-2 (pretrained vs random-init control)", "",
                  glue_md.read_text().strip()]
    text = "\n".join(lines) + "\n"
    (c.out / "summary.md").write_text(text)
    (c.out / "results.json").write_text(json.dumps(dict(env=env, stages=c.results,
                                                        train=rates), indent=2, default=str))
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="default: gpu-check/<UTC time>/")
    p.add_argument("--budget", type=float, default=480, help="seconds for everything")
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    p.add_argument("--corpus", default=None, help="a text file for bert-prep (one sentence per "
                                                  "line, blank lines between documents); "
                                                  "default: the built-in corpus")
    p.add_argument("--glue", default=None, help="a GLUE folder holding SST-2/ (GLUE's files)")
    p.add_argument("--train-seconds", type=float, default=90)
    p.add_argument("--allow-cpu", action="store_true",
                   help="run on a machine without CUDA (checks the plumbing; figures say cpu)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (with --allow-cpu)")
    args = p.parse_args(argv)
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device != "cuda" and not args.allow_cpu:
        print("gpu-check: error: torch sees no CUDA device; run this on the GPU machine "
              "(--allow-cpu checks the plumbing on a CPU)", file=sys.stderr)
        return 2
    missing = missing_modules()
    if missing:
        print(f"gpu-check: error: missing Python packages {', '.join(missing)}: stage them with "
              f"../shared/gpu/stage_wheels.sh and run `make gpu-check` (which installs .whl/)",
              file=sys.stderr)
        return 2
    if args.glue and not (Path(args.glue) / "SST-2").is_dir():
        print(f"gpu-check: error: --glue {args.glue} has no SST-2/ folder (GLUE's SST-2 files: "
              f"train.tsv, dev.tsv)", file=sys.stderr)
        return 2
    if args.corpus and not Path(args.corpus).is_file():
        print(f"gpu-check: error: --corpus {args.corpus} is not a file", file=sys.stderr)
        return 2
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    args.out = args.out or str(ROOT / "gpu-check" / stamp)
    c = Check(args)
    env = environment(args)
    (c.out / "env.json").write_text(json.dumps(env, indent=2))
    print(f"gpu-check: {env.get('gpu', 'cpu')}, torch {env['torch']}; writing {c.out}; "
          f"budget {args.budget:.0f} s", flush=True)
    # in order of value: what a lent GPU must answer first comes first
    for stage, fn in (("cuda-tests", stage_cuda_tests), ("bench", stage_bench),
                      ("train", stage_train), ("glue", stage_glue),
                      ("default-suite", stage_default_suite),
                      ("bench", lambda c: stage_bench(c, late=True))):
        if stage in args.stages:
            fn(c)
    print(write_summary(c, env))
    print(f"gpu-check: everything is in {c.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
