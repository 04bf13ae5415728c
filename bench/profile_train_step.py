"""Where a `bert-train` step's time goes: one Trainer of the given experiment (deferring its
reads, as a run does), --warmup steps, then --steps steps settled every --window (a log step)
with the input pipeline's time on the training thread timed on its own (TrainStream.next_step:
gathering rows, dynamic masking, collation; with trainer.prefetch, the default on CUDA, only
taking what a worker process read and applying the masking rate), then --profile steps under
torch.profiler.

Reported: the wall time of a step; the input pipeline's share; on a GPU the device's busy time
a step (the sum of its kernels' own time in the profiled steps), so that wall >> busy says the
host holds the GPU back; and the profiler's top operations by the host's own time and by the
device's, in --table.

    python bench/profile_train_step.py --data prepared/sst2_imdb_64 --experiment domain_mini
    python bench/profile_train_step.py --data P --experiment gpu_mini --set impl.compile=true

On the H200 `experiment=gpu_mini` ran at 0.51x the bench's step rate for the same model and
batch (23.7 ms a step against 12.1 ms, docs/gpu.md): this is what tells the next lease why.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# libkineto (torch.profiler's backend) writes a line to stderr at each profiler start and stop
# (its USDT level, 5, its highest): only level 6 drops them, and with them its own errors, so a
# GPU profile without device times says so below (KINETO_LOG_LEVEL=0 shows kineto's log).
# Read when torch loads, so set before any import of it.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_defer_reads import make_trainer, trainer_arguments  # noqa: E402


def _device_time(event) -> float:
    """An op's own device time in microseconds (torch renamed cuda -> device)."""
    return float(getattr(event, "self_device_time_total",
                         getattr(event, "self_cuda_time_total", 0.0)) or 0.0)


def profile(args) -> tuple[dict, str]:
    import torch

    work = tempfile.mkdtemp(prefix="profile_train_step_")
    trainer = None
    try:
        trainer = make_trainer(args, f"{work}/run", True)
        device = trainer.accelerator.device
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        data_s = []
        next_step = trainer.stream.next_step

        def timed(*a, **k):
            start = time.perf_counter()
            out = next_step(*a, **k)
            data_s.append(time.perf_counter() - start)
            return out

        trainer.stream.next_step = timed

        def steps(n: int) -> None:
            held = []
            for i in range(n):
                held.append(trainer.train_step())
                if (i + 1) % args.window == 0 or i == n - 1:
                    for result in held:
                        result.settle()
                    held = []
            sync()

        steps(args.warmup)
        data_s.clear()
        start = time.perf_counter()
        steps(args.steps)
        wall = (time.perf_counter() - start) / args.steps
        data = sum(data_s) / args.steps
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            steps(args.profile)
        events = prof.key_averages()
        busy = sum(_device_time(e) for e in events) / 1e3 / args.profile  # ms a step
        if device.type == "cuda" and busy == 0:
            print("profile_train_step: the profiler recorded no device time on the GPU (CUPTI "
                  "unavailable?); rerun with KINETO_LOG_LEVEL=0 to see its log", file=sys.stderr)
        tables = [f"# {args.experiment} on {device}, {args.profile} steps: by the host's own "
                  f"time", events.table(sort_by="self_cpu_time_total", row_limit=args.rows)]
        if device.type == "cuda":
            key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") \
                else "self_cuda_time_total"
            tables += [f"# by the device's own time", events.table(sort_by=key,
                                                                    row_limit=args.rows)]
        result = {"device": str(device), "experiment": args.experiment, "set": args.set,
                  "steps": args.steps, "wall_ms": wall * 1e3, "data_ms": data * 1e3,
                  "data_share": data / wall,
                  "device_busy_ms": busy if device.type == "cuda" else None}
        return result, "\n\n".join(tables)
    finally:
        if trainer is not None:
            trainer.close()
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    trainer_arguments(p)
    p.add_argument("--warmup", type=int, default=50, help="steps before timing (compiling)")
    p.add_argument("--steps", type=int, default=200, help="steps timed")
    p.add_argument("--window", type=int, default=50, help="steps between reads (a log step)")
    p.add_argument("--profile", type=int, default=20, help="steps under torch.profiler")
    p.add_argument("--rows", type=int, default=25, help="operations in each table")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "profile_train_step.json"))
    p.add_argument("--table", default=None, help="the profiler's tables (default: beside --out)")
    args = p.parse_args(argv)
    if min(args.steps, args.window, args.profile) < 1 or args.warmup < 0:
        sys.exit("profile_train_step: --steps, --window and --profile must be at least 1, "
                 "--warmup at least 0")
    result, tables = profile(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    table = Path(args.table) if args.table else out.with_suffix(".txt")
    table.write_text(tables + "\n")
    busy = (f"; the device busy {result['device_busy_ms']:.2f} ms of it"
            if result["device_busy_ms"] is not None else "")
    print(f"{args.experiment} on {result['device']}: {result['wall_ms']:.2f} ms a step, the input "
          f"pipeline {result['data_ms']:.2f} ms of it ({100 * result['data_share']:.0f}%)"
          f"{busy}; tables in {table}")


if __name__ == "__main__":
    main()
