"""How OpenMP threads wait, measured on the commands users run: `bert-train` steps and a
`bert-finetune` fine-tune, each policy in its own process (libgomp reads OMP_WAIT_POLICY once,
when torch loads it), the policies alternating run by run, quiet and (--compete) beside one
busy single-threaded process.

Reported per policy: training seconds per step (from the run's own metrics: start-up and the
final evaluation left out) and the fine-tune's training seconds (its result.json), median over
--runs with the min-max spread, and the other processes' load during each run (busy cores in
/proc/stat minus the commands' own CPU time).

    python bench/bench_omp_wait.py --prepared prepared/demo --finetune-model runs/demo \\
        --finetune-args task=sst2 data_dir=glue_data max_train_samples=1000 --runs 3 --compete

bert-train and bert-finetune wait passively unless OMP_WAIT_POLICY is set
(bert_pretrain/components/cpu_runtime.py); the table in docs/benchmarks.md ("CPU settings")
says what that costs on a machine nothing else uses and what it saves on a shared one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import OtherLoad, median_and_range  # noqa: E402

BIN = Path(sys.executable).parent


def _env(policy: str) -> dict:
    return {**os.environ, "OMP_WAIT_POLICY": policy, "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false"}


def _run(cmd: list, policy: str) -> None:
    try:  # a run that hangs (a lost lock, a stuck thread) ends the bench, not the afternoon
        r = subprocess.run(cmd, env=_env(policy), capture_output=True, text=True, timeout=3600)
    except subprocess.TimeoutExpired:
        sys.exit(f"bench_omp_wait: {' '.join(cmd[:2])} ran over an hour under "
                 f"OMP_WAIT_POLICY={policy}; is something else using the cores?")
    if r.returncode:
        sys.exit(f"bench_omp_wait: {' '.join(cmd[:2])} failed (exit {r.returncode}):\n"
                 f"{r.stderr[-2000:]}")


def train_seconds_per_step(args, policy: str, work: str) -> float:
    run_dir = os.path.join(work, "train")
    shutil.rmtree(run_dir, ignore_errors=True)
    _run([str(BIN / "bert-train"), f"experiment={args.experiment}", f"data.dir={args.prepared}",
          f"run_dir={run_dir}", f"trainer.max_steps={args.steps}", "trainer.eval_every=1000000",
          "trainer.checkpoint_every=1000000", "trainer.progress_bar=false",
          *args.train_args], policy)
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))
               if '"elapsed_s"' in line]
    # from the first logged step on: the first steps' one-off costs (allocations) left out
    first, last = records[0], records[-1]
    return (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"])


def finetune_seconds(args, policy: str, work: str) -> float:
    out_dir = os.path.join(work, "finetune")
    shutil.rmtree(out_dir, ignore_errors=True)
    _run([str(BIN / "bert-finetune"), f"model={args.finetune_model}", *args.finetune_args,
          "recipe.lrs=[1e-3]", "recipe.seeds=[1]", "trainer.progress_bar=false",
          "trainer.save_model=none", f"out_dir={out_dir}"], policy)
    result = json.loads(Path(out_dir, "lr0.001-seed1", "result.json").read_text())
    return float(result["train_seconds"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prepared", required=True, help="a bert-prep output folder")
    p.add_argument("--experiment", default="domain_mini")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--train-args", nargs="*", default=[],
                   help="more bert-train overrides, e.g. model=bert_mini (the published table's "
                        "4-layer model)")
    p.add_argument("--finetune-model", default=None,
                   help="a model bert-finetune takes; leave out to skip the fine-tune")
    p.add_argument("--finetune-args", nargs="*", default=["task=sst2"],
                   help="bert-finetune's task settings (task, data_dir, max_train_samples, ...)")
    p.add_argument("--policies", nargs="+", default=["PASSIVE", "ACTIVE"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--compete", action="store_true",
                   help="also --runs runs beside one busy single-threaded process")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "omp_wait.json"))
    args = p.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as work:
        for kind in ["quiet"] + (["compete"] if args.compete else []):
            competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"]) \
                if kind == "compete" else None
            try:
                for run in range(args.runs):
                    for policy in args.policies:  # alternating: drifts in load hit all alike
                        load = OtherLoad(own="children")
                        row = {"kind": kind, "run": run, "policy": policy,
                               "train_s_per_step": train_seconds_per_step(args, policy, work)}
                        if args.finetune_model:
                            row["finetune_s"] = finetune_seconds(args, policy, work)
                        # the competitor is counted as other load: it is the condition measured
                        row["other_load_cores"] = load.cores()
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            finally:
                if competitor is not None:
                    competitor.kill()

    table = []
    print(f"\n{'machine':<9} {'policy':<8} {'train s/step':>22} {'fine-tune s':>20} "
          f"{'other load (cores)':>20}")
    for kind in ["quiet", "compete"]:
        for policy in args.policies:
            mine = [r for r in rows if r["kind"] == kind and r["policy"] == policy]
            if not mine:
                continue
            stats = {"kind": kind, "policy": policy, "runs": len(mine),
                     **median_and_range(mine, ["train_s_per_step", "finetune_s",
                                               "other_load_cores"])}
            table.append(stats)

            def cell(field, fmt):
                if field not in stats:
                    return "-"
                lo, hi = stats[field + "_range"]
                return f"{stats[field]:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"

            print(f"{kind:<9} {policy:<8} {cell('train_s_per_step', '.4f'):>22} "
                  f"{cell('finetune_s', '.1f'):>20} {cell('other_load_cores', '.2f'):>20}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "cpus": os.cpu_count(), "rows": rows, "table": table},
                  f, indent=1)
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
