"""What deferred reads (`trainer.defer_reads`, docs/training.md) cost or gain per training step:
two `Trainer`s of the same run in one process, one deferring and one reading every step, taking
windows of --window steps in turn (who goes first swapped every window, so a machine that slows
down slows both alike). A window ends as a log step does: its steps are settled (their numbers
brought to the host), so its time is what the steps cost with the reads each mode makes, and
the deferring trainer's host may run ahead of the device within the window as it does in a run.
Per run: the median per-step time of each over the windows after --skip steps; reported: the
median of the runs with the min-max spread, their ratio, and the other processes' load during
each run.

    python bench/bench_defer_reads.py --data prepared/sst2_imdb_64 --runs 3

On a CPU nothing is asynchronous, so the two should be level (a cost check); on a GPU the
deferring trainer's host prepares the next step while the device finishes the last. Both
trainers take the same batches and end with the same losses (bit for bit on a CPU; within
1e-3 on a GPU, whose atomic adds make even two runs of one trainer part in the last bits), and
the deferring one must still
hold every step's numbers on the device when its window ends (both checked in each run).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import OtherLoad, publish  # noqa: E402


def make_trainer(args, run_dir: str, defer: bool, same_clock: bool = False):
    """A Trainer of `args`' run. `same_clock`, for two trainers compared in one process: a
    time budget (trainer.budget_hours) sets the masking rate, the locality fade and the lr's
    decay from each trainer's own clock, so the two would take different batches and end
    apart; the budget is then replaced by a step count far off (progress stays near 0, as in
    a run's first minutes), which both share."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from bert_pretrain.cli_errors import fail, precheck, suggest_from
    from bert_pretrain.config import TrainConfig, register, settings
    from bert_pretrain.errors import UserError
    from bert_pretrain.train import CONF_DIR, SCHEMAS
    from bert_pretrain.trainer import Trainer

    overrides = [f"experiment={args.experiment}", f"data.dir={args.data}", f"run_dir={run_dir}",
                 "trainer.eval_every=1000000", "trainer.checkpoint_every=1000000",
                 "trainer.progress_bar=false", "trainer.report=false",
                 f"trainer.defer_reads={str(defer).lower()}", *args.set]
    prog = Path(sys.argv[0]).stem
    register()
    # bert-train's own check of the overrides: a key that is not there is one line, with its
    # 'did you mean', not Hydra's trace
    precheck(prog, CONF_DIR, "train", overrides, suggest=suggest_from(TrainConfig),
             schemas=SCHEMAS)
    with initialize_config_dir(config_dir=str(ROOT / "conf" / "train"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
        if same_clock and cfg.trainer.budget_hours is not None:
            overrides += ["trainer.budget_hours=null", "trainer.max_steps=1000000"]
            cfg = compose(config_name="train", overrides=overrides)
    try:
        return Trainer(settings(cfg), OmegaConf.to_container(cfg, resolve=True), "")
    except UserError as exc:  # (missing data, a bad override: bert-train's one line, not a trace)
        fail(prog, str(exc))


def one_run(args) -> dict:
    work = tempfile.mkdtemp(prefix="bench_defer_reads_")
    trainers = {}
    try:
        trainers = {d: make_trainer(args, f"{work}/{d}", d, same_clock=True)
                    for d in (True, False)}
        if not trainers[True].defer_reads:
            sys.exit("bench_defer_reads: this run can not defer its reads (several processes, "
                     "fp16's scaler or a non-fused optimizer): nothing to compare")
        times = {True: [], False: []}
        held = {True: 0, False: 0}
        load = OtherLoad()
        for i in range(args.steps // args.window):
            for d in ((True, False) if i % 2 == 0 else (False, True)):
                start = time.perf_counter()
                results = [trainers[d].train_step() for _ in range(args.window)]
                held[d] += sum(r.held for r in results)
                for r in results:
                    r.settle()
                times[d].append((time.perf_counter() - start) / args.window)
        other = load.cores()
        last = {d: trainers[d].train_step().settle().loss for d in trainers}
        device = trainers[True].accelerator.device
        difference = same_losses("bench_defer_reads", last, device.type, "deferring")
        steps = len(times[True]) * args.window
        if held[True] != steps or held[False]:
            sys.exit(f"bench_defer_reads: the deferring trainer held {held[True]} of {steps} "
                     f"steps' numbers to the window's end and the reading one {held[False]}: "
                     f"the two modes are not what they say")
        skip = -(-args.skip // args.window)  # windows with any warm-up step in them
        deferred, read = (statistics.median(times[d][skip:]) * 1e3 for d in (True, False))
        return {"deferred_ms": deferred, "read_ms": read, "ratio": deferred / read,
                "other_load_cores": other, "device": str(device),
                "final_loss_relative_difference": difference}
    finally:
        for trainer in trainers.values():
            trainer.close()
        shutil.rmtree(work, ignore_errors=True)


def same_losses(prog: str, last: dict, device_type: str, what: str) -> float:
    """The two trainers' last losses (`last[True]`, `last[False]`), relative difference; a run
    ends if they part by more than the device allows.  On a CPU the two are bit-identical. A
    GPU's backward adds rows with atomics (the labelled rows' gather, the embeddings) in
    whatever order the threads run, so two runs of one trainer part in the last bits and drift
    apart over steps: on the H200, 6.45451 against 6.45433 after 250 steps. There, a
    difference past that noise is what would say `what` changed the arithmetic."""
    tolerance = 0.0 if device_type == "cpu" else 1e-3
    difference = abs(last[True] - last[False]) / max(abs(last[False]), 1e-12)
    if not difference <= tolerance:
        sys.exit(f"{prog}: the two trainers' losses differ ({last[True]} against "
                 f"{last[False]}, relative {difference:.1e}, allowed {tolerance:g} on "
                 f"{device_type}): {what} must not change a number")
    return difference


def trainer_arguments(p: argparse.ArgumentParser) -> None:
    """The options make_trainer reads: the data, the experiment, more overrides."""
    p.add_argument("--data", required=True, help="a bert-prep output folder")
    p.add_argument("--experiment", default="domain_mini")
    p.add_argument("--set", nargs="*", default=[], help="more bert-train overrides")


def window_arguments(p: argparse.ArgumentParser) -> None:
    """The options of two trainers taking windows of steps in turn (one_run)."""
    p.add_argument("--steps", type=int, default=300, help="steps of each trainer per run")
    p.add_argument("--window", type=int, default=10,
                   help="steps a trainer takes in turn before its numbers are read (a log step)")
    p.add_argument("--skip", type=int, default=50, help="first steps left out (warm-up)")
    p.add_argument("--runs", type=int, default=3)


def check_windows(prog: str, args, windows: bool = True) -> None:
    """Refuse --window/--skip that leave nothing to time (`windows`: steps come in windows)."""
    if args.window < 1:
        sys.exit(f"{prog}: --window must be at least 1")
    size = args.window if windows else 1
    if args.skip < 0 or -(-args.skip // size) >= args.steps // size:
        sys.exit(f"{prog}: --skip must leave at least one whole window of --steps")


FIELDS = (("deferred_ms", "deferred reads (the default)"),
          ("read_ms", "trainer.defer_reads=false"),
          ("ratio", "deferred / read"), ("other_load_cores", "other load, cores"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    trainer_arguments(p)
    window_arguments(p)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "defer_reads.json"))
    args = p.parse_args(argv)
    check_windows("bench_defer_reads", args)
    runs = []
    for r in range(args.runs):
        runs.append(one_run(args))
        row = runs[-1]
        print(f"run {r + 1}: deferred {row['deferred_ms']:.1f} ms, read every step "
              f"{row['read_ms']:.1f} ms, ratio {row['ratio']:.3f}, other load "
              f"{row['other_load_cores']:.2f} cores", flush=True)
    publish(args.out, args, runs, FIELDS,
            f"{args.experiment} on {runs[0]['device']}, windows of {args.window} steps",
            "ms a step")


if __name__ == "__main__":
    main()
