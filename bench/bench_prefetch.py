"""What prefetching (`trainer.prefetch`, docs/training.md) gains or costs per training step: two
`Trainer`s of the same run in one process, one preparing its next batches on a background
thread and one on the training thread, taking windows of --window steps in turn (who goes
first swapped every window, so a machine that slows down slows both alike). A window ends as a
log step does (its steps settled). Per run: the median per-step time of each over the windows
after --skip steps, and the time each spends in `TrainStream.next_step` on the training thread
(with prefetching: taking the prepared rows and applying the masking rate); reported: the
median of the runs with the min-max spread, their ratio, and the other processes' load.

    python bench/bench_prefetch.py --data prepared/sst2_imdb_64 --runs 3
    python bench/bench_prefetch.py --data prepared/gutenberg128 --experiment gpu_mini \
        --set model=bert_tiny
    python bench/bench_prefetch.py --data prepared/gutenberg128 --experiment gpu_mini \
        --host-calls 6000      # the training thread busy in Python, as on a GPU

On a CPU the worker competes with the model's threads for the same cores, so the steps should
be about level (a cost check); on a GPU the training thread only launches kernels, and the
input pipeline's milliseconds leave its path. --host-calls measures that path on a CPU: a
training thread busy in Python (small torch calls, no model) takes each step's batches from
two streams in turn, one prefetching. Both trainers take the same
batches: they must end with the same loss (bit for bit on a CPU, within 1e-3 on a GPU, whose
atomic adds part two runs of one trainer in the last bits).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_defer_reads import (check_windows, make_trainer, same_losses,  # noqa: E402
                               trainer_arguments, window_arguments)
from benchlib import OtherLoad, publish  # noqa: E402


def one_run(args) -> dict:
    work = tempfile.mkdtemp(prefix="bench_prefetch_")
    trainers = {}
    try:
        for ahead in (True, False):
            a = copy.copy(args)
            a.set = [*args.set, f"trainer.prefetch={str(ahead).lower()}"]
            trainers[ahead] = make_trainer(a, f"{work}/{ahead}", True, same_clock=True)
        inputs = {True: [], False: []}
        for ahead, trainer in trainers.items():
            trainer.stream.next_step = _timed(trainer.stream.next_step, inputs[ahead])
        times = {True: [], False: []}
        counted = {True: [], False: []}
        load = OtherLoad(own="both")  # (the prefetch worker starts and ends inside)
        for i in range(args.steps // args.window):
            for ahead in ((True, False) if i % 2 == 0 else (False, True)):
                first = len(inputs[ahead])
                start = time.perf_counter()
                results = [trainers[ahead].train_step() for _ in range(args.window)]
                for r in results:
                    r.settle()
                times[ahead].append((time.perf_counter() - start) / args.window)
                counted[ahead].append(sum(inputs[ahead][first:]) / args.window)
        last = {a: trainers[a].train_step().settle().loss for a in trainers}
        ahead = trainers[True].stream._ahead is not None and \
            trainers[False].stream._ahead is None
        trainers[True].stream.close()
        other = load.cores()
        device = trainers[True].accelerator.device
        difference = same_losses("bench_prefetch", last, device.type, "prefetching")
        if not ahead:
            sys.exit("bench_prefetch: the prefetching trainer has no worker or the other one "
                     "has: the two modes are not what they say")
        skip = -(-args.skip // args.window)  # windows with any warm-up step in them
        step = {a: statistics.median(times[a][skip:]) * 1e3 for a in trainers}
        data = {a: statistics.median(counted[a][skip:]) * 1e3 for a in trainers}
        return {"prefetch_ms": step[True], "inline_ms": step[False],
                "ratio": step[True] / step[False], "prefetch_input_ms": data[True],
                "inline_input_ms": data[False], "other_load_cores": other,
                "device": str(device), "final_loss_relative_difference": difference}
    finally:
        for trainer in trainers.values():
            trainer.close()
        shutil.rmtree(work, ignore_errors=True)


def one_host_run(args) -> dict:
    """The training thread of a GPU step is busy in Python, launching kernels: here a thread
    of --host-calls small torch calls a step (no model), after each step's next_step. Two
    streams of the run's data and batch, one prefetching, in turn every step."""
    import torch

    from bert_pretrain.components.data import PreparedData, TrainStream

    work = tempfile.mkdtemp(prefix="bench_prefetch_")
    try:  # (a trainer for the run's resolved settings and micro-batch; its model is unused)
        trainer = make_trainer(args, f"{work}/run", True)
        s, tc, micro = trainer.s, trainer.tc, trainer.micro
        trainer.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    streams = {ahead: TrainStream(PreparedData(s.data.dir), s.data, s.seed,
                                  tc.global_batch_size, micro, 1, 0, prefetch=ahead)
               for ahead in (True, False)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (one core for the calls, as a GPU's host thread)
    x = torch.zeros(8)
    times = {True: [], False: []}
    inputs = {True: [], False: []}
    try:
        load = OtherLoad(own="both")  # (the prefetch worker starts and ends inside)
        for i in range(args.steps):
            for ahead in ((True, False) if i % 2 == 0 else (False, True)):
                start = time.perf_counter()
                streams[ahead].next_step(0.5)
                taken = time.perf_counter()
                for _ in range(args.host_calls):
                    x.add_(1.0)
                times[ahead].append(time.perf_counter() - start)
                inputs[ahead].append(taken - start)
        streams[True].close()
        other = load.cores()
    finally:
        streams[True].close()
        torch.set_num_threads(threads)
    step = {a: statistics.median(times[a][args.skip:]) * 1e3 for a in streams}
    data = {a: statistics.median(inputs[a][args.skip:]) * 1e3 for a in streams}
    return {"prefetch_ms": step[True], "inline_ms": step[False],
            "ratio": step[True] / step[False], "prefetch_input_ms": data[True],
            "inline_input_ms": data[False], "other_load_cores": other,
            "device": f"cpu, {args.host_calls} torch calls a step on one thread"}


def _timed(next_step, into: list):
    def timed(*a, **k):
        start = time.perf_counter()
        out = next_step(*a, **k)
        into.append(time.perf_counter() - start)
        return out

    return timed


FIELDS = (("prefetch_ms", "step, read ahead by a worker (trainer.prefetch=true)"),
          ("inline_ms", "step, read on the training thread (trainer.prefetch=false)"),
          ("ratio", "prefetching / not"),
          ("prefetch_input_ms", "input pipeline on the training thread, prefetching"),
          ("inline_input_ms", "input pipeline on the training thread, not prefetching"),
          ("other_load_cores", "other load, cores"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    trainer_arguments(p)
    window_arguments(p)
    p.add_argument("--host-calls", type=int, default=0,
                   help="instead of training: this many small torch calls a step on the "
                        "training thread (a GPU step's host side), after each next_step")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefetch.json"))
    args = p.parse_args(argv)
    check_windows("bench_prefetch", args, windows=not args.host_calls)
    runs = []
    for r in range(args.runs):
        runs.append(one_host_run(args) if args.host_calls else one_run(args))
        row = runs[-1]
        print(f"run {r + 1}: prefetching {row['prefetch_ms']:.2f} ms a step (input "
              f"{row['prefetch_input_ms']:.2f}), not {row['inline_ms']:.2f} (input "
              f"{row['inline_input_ms']:.2f}), ratio {row['ratio']:.3f}, other load "
              f"{row['other_load_cores']:.2f} cores", flush=True)
    per = f"steps in turn, the first {args.skip} left out" if args.host_calls else \
        f"windows of {args.window} steps"
    publish(args.out, args, runs, FIELDS, f"{args.experiment} on {runs[0]['device']}, {per}",
            "ms")


if __name__ == "__main__":
    main()
