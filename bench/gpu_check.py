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
                     experiment=gpu_mini for --train-seconds, then a resume of a copy for a
                     twentieth of that;
                     tokens/s against the bench's step rate at the same shape; then
                     bench_defer_reads.py at that shape (deferred reads against reading every
                     step, windows of the 50-step log interval); then profile_train_step.py
                     (the input pipeline's share of a step, the device's busy time, the
                     profiler's top operations); then bench_prefetch.py (batches read ahead
                     by a worker process, the default on CUDA, against the training thread)
  4. glue            with --glue DIR (GLUE's SST-2/ folder): bert-finetune on SST-2 (8,000
                     sentences; --glue-labels 8000 1000 adds the 1,000-label rows) for the
                     trained model and its random-init control, 5 rates x 3 seeds each, one
                     process per (size, init, rate), side by side on the GPU
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
STAGES = ("cuda-tests", "bench", "train", "glue", "default-suite", "late-bench")

# (preset:batch:seq, variants) per bench process; large models split so that each process's
# models (with AdamW state: 16 bytes a parameter, 5.4 GB for BERT-large) fit with room for
# activations.  The variant names are bench_model.py's.
BENCH_GROUPS = [
    # BERT-mini first: quick, and the train stage's tokens/s is compared with its step rate
    ("bert_mini:256:128", ["ours-varlen-nested"]),
    # (no `ours-varlen-groups`: 0.08x transformers on the H100, 1.3 s a step, a run's worth of
    # time for a figure that decides nothing)
    # (the default on a GPU is the padded grid, so `ours-unpad` is the unpadded one)
    ("bert_base:256:128", ["ours-split-qkv", "ours-sparse-last", "ours-unpad",
                           "ours-varlen-nested", "ours-no-sparse"]),
    ("bert_large:128:128", ["ours-unpad", "ours-varlen-nested", "ours-split-qkv"]),
]
# after the training and the suites: what takes longest per figure (compiling; long sequences)
LATE_BENCH_GROUPS = [
    ("bert_large:32:512", ["ours-unpad", "ours-varlen-nested"]),
    ("bert_base:256:128", ["ours-compile"]),
    ("bert_large:128:128", ["ours-sparse-last", "ours-compile"]),
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
        self.suite = None  # the default suite when it runs beside (--suite-beside)
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


    def resume_record(self) -> None:
        """A second call into the same --out (a lease's second command, say the glue stage after
        the training) keeps the first call's records: the summary covers both."""
        path = self.out / "results.json"
        if path.is_file():
            self.results.update(json.loads(path.read_text()).get("stages", {}))

    def start_suite_beside(self) -> None:
        """Start the default suite on all CPUs but the first quarter, and keep this process
        (and so every GPU job it starts) on that quarter: the suite needs no GPU and takes
        minutes, the GPU jobs need a few CPUs each. On the H100 the suite's 12 CPUs left the
        bench and the training their rates (docs/gpu.md)."""
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            return
        self.all_cpus = cpus
        mine, others = cpus[:max(1, len(cpus) // 4)], cpus[max(1, len(cpus) // 4):]
        cmd = suite_command(self, workers=len(others))
        log = open(self.out / "pytest_default.log", "w")
        log.write(f"$ {' '.join(map(str, cmd))}\n")
        log.flush()
        self.suite = dict(proc=subprocess.Popen(
            [str(x) for x in cmd], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: os.sched_setaffinity(0, others)), log=log,
            start=time.monotonic(), command=" ".join(map(str, cmd)), cpus=len(others))
        os.sched_setaffinity(0, mine)
        print(f"gpu-check: the default suite runs beside, on {len(others)} CPUs; the GPU jobs "
              f"on {len(mine)}", flush=True)

    def unpin(self) -> None:
        if getattr(self, "all_cpus", None):
            os.sched_setaffinity(0, self.all_cpus)

    def run_side_by_side(self, stage: str, jobs: list, cap: float) -> list[dict]:
        """Run every (name, cmd) of `jobs` at once, each logged to <out>/<name>.log, all
        stopped at `cap` seconds or what the budget has left; a record per job."""
        limit = min(cap, self.left())
        if limit < 20:
            return [dict(stage=stage, name=n, status="not run: the budget is spent")
                    for n, _ in jobs]
        start = time.monotonic()
        running = []
        for name, cmd in jobs:
            log = open(self.out / f"{name}.log", "w")
            log.write(f"$ {' '.join(map(str, cmd))}\n")
            log.flush()
            running.append((name, cmd, log, subprocess.Popen(
                [str(x) for x in cmd], cwd=ROOT, env=self.env, stdout=log,
                stderr=subprocess.STDOUT)))
        records = []
        for name, cmd, log, proc in running:
            record = dict(stage=stage, name=name, command=" ".join(map(str, cmd)),
                          log=f"{name}.log", started_s=round(start - self.t0, 1))
            try:
                proc.wait(timeout=max(1.0, limit - (time.monotonic() - start)))
                record.update(status="ok" if proc.returncode == 0 else
                              f"failed (exit {proc.returncode})", returncode=proc.returncode)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                record.update(status=f"cut at its {limit:.0f} s limit")
            log.close()
            record["seconds"] = round(time.monotonic() - start, 1)
            print(f"gpu-check: {name}: {record['status']} ({record['seconds']} s)", flush=True)
            records.append(record)
        return records


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
    sizes = []  # gpu_mini's, or tiny ones for the plumbing check; the bench below takes them too
    if quick:
        sizes += ["model=bert_tiny", "trainer.global_batch_size=8", "trainer.warmup_steps=2",
                  "trainer.log_every=2", "trainer.eval_max_samples=16",
                  "trainer.checkpoint_every=1000000"]
    if c.args.device != "cuda":
        sizes += ["trainer.cpu=true"]
    common = [sys.executable, "-m", "bert_pretrain.train", "experiment=gpu_mini",
              f"data.dir={data}", f"run_dir={run_dir}", "trainer.progress_bar=false",
              "trainer.report=false", *sizes]
    first_windows = 0
    # the training's rate is held against the bench's, which runs alone: say whether the suite
    # shared the machine (on the H200 it did, and the rate was 0.74x the bench's)
    beside = c.suite is not None and c.suite["proc"].poll() is None
    if prep["status"] == "ok":
        hours = seconds / 3600
        records.append(c.run("train", "bert_train", common + [f"trainer.budget_hours={hours}"],
                             cap=seconds + 120))
        first_windows = len(_metric_records(run_dir))
        if records[-1]["status"] == "ok":
            # a copy continues (the resume's start-up, its first steps' rate and losses), so
            # that the glue stage fine-tunes the model of the budget itself
            resumed = c.out / "run_gpu_mini_resumed"
            shutil.rmtree(resumed, ignore_errors=True)  # (a second call into the same --out)
            shutil.copytree(run_dir, resumed)
            records.append(c.run("train", "bert_train_resume", common + [
                f"run_dir={resumed}", "resume=auto", f"trainer.budget_hours={hours * 1.05}"],
                cap=seconds / 20 + 120))
        def at_gpu_minis_shape(name, steps, out, cap):
            """bench/<name>.py on gpu_mini's model and batch. By steps, not the time budget:
            two trainers, each on its own clock, would take different lrs."""
            return c.run("train", name, [
                sys.executable, f"bench/{name}.py", "--data", data, "--experiment",
                "gpu_mini", *steps, "--out", c.out / out, "--set", *sizes,
                "trainer.budget_hours=null", "trainer.max_steps=8000"], cap=cap)

        # What deferred reads gain on this device: gpu_mini's trainer deferring and the same
        # trainer reading every step, windows of its log interval in turn (bench_defer_reads.py).
        windows = ["--steps", "4", "--window", "2", "--skip", "0", "--runs", "1"] if quick \
            else ["--window", "50", "--skip", "50", "--runs", "3"]
        records.append(at_gpu_minis_shape(
            "bench_defer_reads", windows + ([] if quick else ["--steps", "200"]),
            "defer_reads.json", 150))
        # Where a step's time goes (the H200 trained at 0.51x the bench's step rate): the
        # input pipeline's share, the device's busy time, the profiler's top operations.
        records.append(at_gpu_minis_shape(
            "profile_train_step",
            ["--warmup", "2", "--steps", "4", "--window", "2", "--profile", "2"] if quick
            else ["--warmup", "50", "--steps", "200", "--window", "50", "--profile", "20"],
            "profile_train_step.json", 120))
        # What reading batches ahead in a worker process gains (trainer.prefetch, auto: on
        # CUDA): the same trainer with and without it, windows of its log interval in turn.
        records.append(at_gpu_minis_shape(
            "bench_prefetch", windows + ([] if quick else ["--steps", "150"]), "prefetch.json",
            150))
    c.results["train"] = dict(stage="train", runs=records, run_dir=str(run_dir),
                              resumed_dir=str(c.out / "run_gpu_mini_resumed"),
                              first_run_records=first_windows,
                              suite_beside_on_cpus=c.suite["cpus"] if beside else 0)


# The BERT paper's grid is for BERT-base (2e-5..5e-5); small BERTs want higher rates (Google's
# BERT-mini fine-tuning grid goes to 3e-4). On the H100 the 5-minute model was best at the
# grid's top, 1e-3, and random init at 1e-4 (collapsing at 1e-3): the grid spans both.
GLUE_LRS = ("3e-5", "1e-4", "3e-4", "1e-3", "2e-3")
GLUE_SEEDS = (1, 2, 3)
# What each size of the labelled set is measured against (docs/finetuning-results.md): +3 at
# 8,000 sentences (this GPU target), +8 at 1,000 (the CPU recipe's, unmet there: +6.0).
GLUE_TARGETS = {8000: 3, 1000: 8}


def glue_epochs(labels: int) -> int:
    """3 epochs (the BERT paper's) of 8,000 sentences or more; a smaller set gets the epochs
    that still show the model ~10,000 sentences (1,000: 10, as the CPU table's 1,000-label
    rows), so that its few steps are not what decides the score."""
    return max(3, -(-10_000 // labels))


def stage_glue(c: Check) -> None:
    """SST-2 (8,000 sentences x 3 epochs, and each further --glue-labels size) for the trained
    model and its random-init control: one bert-finetune process per (size, init, rate), all
    seeds in it, the processes side by side on the GPU (a BERT-mini fine-tune leaves most of it
    idle)."""
    if not c.args.glue:
        c.results["glue"] = dict(stage="glue", status="not run: no --glue folder given")
        return
    run_dir = c.out / "run_gpu_mini"
    lrs, seeds = (("1e-4",), (1,)) if c.args.quick else (GLUE_LRS, GLUE_SEEDS)
    jobs = []
    for labels in c.args.glue_labels:
        # (the first size keeps the names of the one-size stage: a second call reads both)
        tag = "" if labels == c.args.glue_labels[0] else f"_n{labels}"
        # --quick: the plumbing at a 125th of each size (8,000 -> 64 sentences, 1,000 -> 8)
        size = ([f"max_train_samples={max(8, labels // 125)}", "max_eval_samples=32"]
                if c.args.quick else [f"max_train_samples={labels}"])
        for init in ("pretrained", "random"):
            for lr in lrs:
                jobs.append((f"finetune_{init}_{lr}{tag}", [
                    sys.executable, "-m", "bert_pretrain.finetune", "task=sst2",
                    f"model={run_dir}", f"init={init}", f"data_dir={Path(c.args.glue).resolve()}",
                    f"recipe.lrs=[{lr}]", f"recipe.seeds=[{','.join(map(str, seeds))}]",
                    f"recipe.epochs={glue_epochs(labels)}", "trainer.progress_bar=false",
                    f"out_dir={c.out / 'glue' / f'{init}-{lr}{tag}'}", *size]))
    # (more processes share the CPUs that feed the GPU: a minute more for each further size)
    cap = 240 + 60 * (len(c.args.glue_labels) - 1)
    c.results["glue"] = dict(stage="glue", runs=c.run_side_by_side("glue", jobs, cap=cap))


def suite_command(c: Check, workers: int) -> list:
    import importlib.util

    cmd = [sys.executable, "-m", "pytest", "-v", "-rf", "-m", "not slow", "-p",
           "no:cacheprovider", "--junitxml", c.out / "pytest_default.xml",
           # each failure's report as it happens: the summary at the end is lost when the
           # budget cuts the suite (it was, on the H100: 19 failures, no tracebacks)
           "--failure-log", c.out / "pytest_default_failures.log"]
    if importlib.util.find_spec("xdist") is not None and workers > 1:
        cmd += ["-n", str(workers)]
    if c.args.quick:  # the plumbing check: one small test file
        cmd += ["tests/test_progress.py"]
    return cmd


def stage_default_suite(c: Check) -> None:
    # -v streams each verdict to the log, so a suite cut by the budget still leaves its results
    if c.suite is None:
        cmd = suite_command(c, workers=max(1, (os.cpu_count() or 2) - 2))
        c.results["default-suite"] = c.run("default-suite", "pytest_default", cmd, cap=600)
        return
    proc, record = c.suite["proc"], dict(stage="default-suite", name="pytest_default",
                                         command=c.suite["command"], log="pytest_default.log",
                                         started_s=round(c.suite["start"] - c.t0, 1),
                                         beside_on_cpus=c.suite["cpus"])
    try:  # what it still needs, within the budget
        proc.wait(timeout=max(1.0, c.left()))
        record.update(status="ok" if proc.returncode == 0 else
                      f"failed (exit {proc.returncode})", returncode=proc.returncode)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        record.update(status="cut at the budget's end")
    c.suite["log"].close()
    c.unpin()
    record["seconds"] = round(time.monotonic() - c.suite["start"], 1)
    print(f"gpu-check: pytest_default: {record['status']} ({record['seconds']} s)", flush=True)
    c.results["default-suite"] = record


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
    resumed = _metric_records(train.get("resumed_dir", ""))  # the copy's, then its resume's
    return dict(median_tokens_per_s=rate(records[:split]), resume_tokens_per_s=rate(
        resumed[split:]), records=len(steps), last_step=steps[-1],
        suite_beside_on_cpus=train.get("suite_beside_on_cpus", 0),
        final_eval={k: v for r in records for k, v in r.items() if k.startswith("eval_")})


def _profile_lines(c: Check) -> list[str]:
    path = c.out / "profile_train_step.json"
    if not path.is_file():
        return []
    r = json.loads(path.read_text())
    busy = (f"; the device busy {r['device_busy_ms']:.2f} ms of it (the rest the host's)"
            if r.get("device_busy_ms") is not None else "")
    return ["", f"## A gpu_mini step (profile_train_step.py, {r['steps']} steps)", "",
            f"{r['wall_ms']:.2f} ms a step, the input pipeline {r['data_ms']:.2f} ms of it "
            f"({100 * r['data_share']:.0f}%){busy}; top operations in "
            f"profile_train_step.txt."]


def _cells(summary: dict, keys) -> dict:
    """A bench summary's fields as 'median (min-max)'."""
    return {k: f"{summary[k]:.3f} ({summary[k + '_range'][0]:.3f}-"
               f"{summary[k + '_range'][1]:.3f})" for k in keys}


def _defer_lines(c: Check) -> list[str]:
    path = c.out / "defer_reads.json"
    if not path.is_file():
        return []
    result = json.loads(path.read_text())
    summary, args = result["summary"], result["args"]
    cells = _cells(summary, ("deferred_ms", "read_ms", "ratio"))
    return ["", f"## Deferred reads (bench_defer_reads.py, gpu_mini, windows of "
                f"{args['window']} steps, median of {len(result['runs'])} runs, min-max)", "",
            f"{cells['deferred_ms']} ms a step deferring against {cells['read_ms']} reading "
            f"every step (`trainer.defer_reads=false`): ratio {cells['ratio']}."]


def _prefetch_lines(c: Check) -> list[str]:
    path = c.out / "prefetch.json"
    if not path.is_file():
        return []
    result = json.loads(path.read_text())
    summary, args = result["summary"], result["args"]
    cells = _cells(summary, ("prefetch_ms", "inline_ms", "ratio", "prefetch_input_ms",
                             "inline_input_ms"))
    return ["", f"## Prefetching (bench_prefetch.py, gpu_mini, windows of {args['window']} "
                f"steps, median of {len(result['runs'])} runs, min-max)", "",
            f"{cells['prefetch_ms']} ms a step with batches read ahead by a worker process "
            f"against {cells['inline_ms']} on the training thread (`trainer.prefetch=false`): "
            f"ratio {cells['ratio']}; the training thread's share of the input "
            f"{cells['prefetch_input_ms']} ms against {cells['inline_input_ms']}."]


def _glue_results(c: Check) -> dict:
    """{(training sentences, epochs): {init: {lr: (median, min, max)}}} from the fine-tunes'
    finetune.json files."""
    out: dict = {}
    for path in sorted((c.out / "glue").glob("*/finetune.json")):
        r = json.loads(path.read_text())
        lo, hi = r["score_range"]
        size = (r["num_train"], r["recipe"]["epochs"])
        out.setdefault(size, {}).setdefault(r["init"], {})[r["best_lr"]] = (r["score"], lo, hi)
    # A rate that diverged in some seed writes no finetune.json (its grid has no rate to
    # recommend): its cell says so, from the fine-tune's log, instead of going missing.
    for labels in c.args.glue_labels:
        tag = "" if labels == c.args.glue_labels[0] else f"_n{labels}"
        for init in ("pretrained", "random"):
            for lr in GLUE_LRS:
                log = c.out / f"finetune_{init}_{lr}{tag}.log"
                if (c.out / "glue" / f"{init}-{lr}{tag}" / "finetune.json").exists() or \
                        not log.exists():
                    continue
                diverged = log.read_text(errors="replace").count(": diverged: ")
                if diverged:
                    out.setdefault((labels, glue_epochs(labels)), {}).setdefault(init, {})[
                        float(lr)] = ("diverged", diverged)
    return out


def _lr(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")


def _glue_lines(c: Check) -> list[str]:
    lines = []
    for (labels, epochs), results in sorted(_glue_results(c).items(), reverse=True):
        lrs = sorted({lr for by_lr in results.values() for lr in by_lr})
        lines += ["", f"## SST-2 dev accuracy, {labels:,} labels: the trained model against "
                      f"random init", "",
                  f"Median of the seeds (min-max) per learning rate; {labels:,} training "
                  f"sentences, {epochs:g} epochs, batch 32.",
                  "", "| init | " + " | ".join(f"lr {_lr(lr)}" for lr in lrs) + " | best |",
                  "|---|" + "---:|" * (len(lrs) + 1)]
        best = {}
        for init, by_lr in sorted(results.items()):
            seeds = 1 if c.args.quick else len(GLUE_SEEDS)
            cells = ["-" if lr not in by_lr else
                     f"diverged ({by_lr[lr][1]} of {seeds} seeds)"
                     if by_lr[lr][0] == "diverged" else
                     f"{100 * by_lr[lr][0]:.1f} ({100 * by_lr[lr][1]:.1f}-"
                     f"{100 * by_lr[lr][2]:.1f})" for lr in lrs]
            by_lr = {k: v for k, v in by_lr.items() if v[0] != "diverged"}
            if not by_lr:
                lines.append(f"| {init} | " + " | ".join(cells) + " | - |")
                continue
            lr = max(by_lr, key=lambda k: by_lr[k][0])
            best[init] = by_lr[lr]
            lines.append(f"| {init} | " + " | ".join(cells) + f" | **{100 * by_lr[lr][0]:.1f}** "
                         f"(lr {_lr(lr)}) |")
        if {"pretrained", "random"} <= set(best):
            p, r = best["pretrained"], best["random"]
            apart = "ranges apart" if p[1] > r[2] or r[1] > p[2] else "ranges overlap"
            target = (f"; the target is +{GLUE_TARGETS[labels]}" if labels in GLUE_TARGETS
                      else "")
            lines += ["", f"Pretrained minus random init: {100 * (p[0] - r[0]):+.1f} points "
                          f"({apart}{target})."]
    return lines


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
                  f"windows, the first fifth left out){ratio}"
                  + (f" (beside the default suite on {rates['suite_beside_on_cpus']} CPUs: not "
                     f"comparable with the bench, which ran alone)"
                     if rates.get("suite_beside_on_cpus") else "") + "; the resume "
                  + (f"{rates['resume_tokens_per_s']:,.0f} tokens/s"
                     if rates["resume_tokens_per_s"] else "did not run")
                  + f"; {rates['last_step']} steps in all.",
                  f"Final evaluation: {json.dumps(rates['final_eval'])}"]
    lines += _defer_lines(c)
    lines += _profile_lines(c)
    lines += _prefetch_lines(c)
    lines += _glue_lines(c)
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
    p.add_argument("--glue-labels", type=int, nargs="+", default=[8000], metavar="N",
                   help="SST-2 training sentences per fine-tune, one set of rows each (8000 1000: "
                        "also the 1,000-label rows of the CPU table)")
    p.add_argument("--train-seconds", type=float, default=90)
    p.add_argument("--allow-cpu", action="store_true",
                   help="run on a machine without CUDA (checks the plumbing; figures say cpu)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (with --allow-cpu)")
    p.add_argument("--suite-beside", action="store_true",
                   help="run the default suite from the start on the CPUs the GPU jobs do not "
                        "use (a quarter of them keep the GPU fed) instead of after the glue stage")
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
    if any(n < 1 for n in args.glue_labels) or len(set(args.glue_labels)) < len(args.glue_labels):
        print(f"gpu-check: error: --glue-labels {' '.join(map(str, args.glue_labels))}: give "
              f"distinct sizes of at least 1 (e.g. --glue-labels 8000 1000)", file=sys.stderr)
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
    c.resume_record()
    if args.suite_beside and "default-suite" in args.stages:
        c.start_suite_beside()
    # in order of value: what a lent GPU must answer first comes first
    for stage, fn in (("cuda-tests", stage_cuda_tests), ("bench", stage_bench),
                      ("train", stage_train), ("glue", stage_glue),
                      ("default-suite", stage_default_suite),
                      ("late-bench", lambda c: stage_bench(c, late=True))):
        if stage in args.stages:
            if stage == "glue":
                c.unpin()  # the fine-tunes are many processes: every CPU, beside the suite
            fn(c)
    print(write_summary(c, env))
    print(f"gpu-check: everything is in {c.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
