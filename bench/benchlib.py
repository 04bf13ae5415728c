"""What the benchmarks share: the load other processes put on the machine while a measurement
ran, the median-with-spread every published figure is, and the command line of the pilots that
patch bert-finetune (uda_pilot.py, prompt_pilot.py).

A figure taken on a shared machine is not a figure: every benchmark records the other load beside
its numbers, so a reader can tell a quiet run from one that competed for the cores.
"""

from __future__ import annotations

import os
import resource
import statistics
import time


class OtherLoad:
    """All busy CPU time in /proc/stat minus the measured work's own CPU time, per second of wall
    time, from construction to `cores()`.  The measured work is this process
    (`own="process"`), the child processes that finished in between (`own="children"`, for a
    benchmark that runs each measurement as a subprocess) or both (`own="both"`, for work with
    helper processes of its own, ended before `cores()`)."""

    def __init__(self, own: str = "process"):
        if own not in ("process", "children", "both"):
            raise ValueError(f"own={own!r}: expected 'process', 'children' or 'both'")
        self.own = own
        self.start = self._sample()

    def _own_seconds(self) -> float:
        if self.own == "process":
            return time.process_time()
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        children = usage.ru_utime + usage.ru_stime
        return children + (time.process_time() if self.own == "both" else 0.0)

    def _sample(self):
        try:
            with open("/proc/stat") as f:
                fields = [float(x) for x in f.readline().split()[1:]]
        except OSError:
            return None
        idle = fields[3] + fields[4]  # idle + iowait
        busy = (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")
        return busy, self._own_seconds(), time.perf_counter()

    def cores(self) -> float | None:
        """Other processes' busy cores on average since construction (None without /proc)."""
        end = self._sample()
        if self.start is None or end is None:
            return None
        busy, own, wall = (b - a for a, b in zip(self.start, end))
        return max(busy - own, 0.0) / wall


def publish(out: str, args, runs: list[dict], fields, heading: str, unit: str) -> dict:
    """The runs' medians with their spread: a table on stdout (a row per (field, label) in
    `fields`, under `heading`) and {"args", "runs", "summary"} as JSON at `out`."""
    import json
    from pathlib import Path

    summary = median_and_range(runs, [k for k, _ in fields])
    print(f"\n| {heading} | {unit}, median (min-max) of {len(runs)} runs |\n|---|---:|")
    for key, label in fields:
        lo, hi = summary[key + "_range"]
        print(f"| {label} | {summary[key]:.3f} ({lo:.3f}-{hi:.3f}) |")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary},
                                    indent=2))
    return summary


def median_and_range(rows: list[dict], fields) -> dict:
    """For each field the rows have: its median and its [min, max] (as `<field>_range`)."""
    out = {}
    for field in fields:
        values = [r[field] for r in rows if r.get(field) is not None]
        if values:
            out[field] = statistics.median(values)
            out[field + "_range"] = [min(values), max(values)]
    return out


def finetune_with_pilot(prog: str, parser, install, argv=None) -> None:
    """A bert-finetune pilot's command: its own options, `--`, then bert-finetune's overrides.
    Runs bert-finetune with the pilot's patches (`install(args)` returns what undoes them)
    and undoes them after, so that a process can go on fine-tuning plainly (the tests do)."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        if "-h" in argv or "--help" in argv:
            parser.parse_args(["--help"])  # prints the pilot's options and exits
        sys.exit(f"{prog}: put bert-finetune's overrides after `--`")
    cut = argv.index("--")
    args = parser.parse_args(argv[:cut])
    uninstall = install(args)
    from bert_pretrain.finetune.cli import main as finetune_main

    saved_argv, sys.argv = sys.argv, ["bert-finetune"] + argv[cut + 1:]
    try:
        finetune_main()
    finally:
        sys.argv = saved_argv
        uninstall()


def patch_finetune(prog: str, settings: dict, train_step, prepare=None):
    """The patches of a pilot that changes bert-finetune's step: the pilot's `settings` join
    each job's identity under `prog` (so its out_dir can not be mistaken for a plain
    fine-tune's), `prepare(job, s, pretrained, say)` adds what the step needs to the job, and
    `train_step(self)` replaces FineTune.train_step. Returns what undoes them (for install)."""
    from bert_pretrain.finetune import grid, runner

    prepare_job, plain_step = grid.prepare_job, runner.FineTune.train_step

    def prepare_with_pilot(s, pretrained, config_yaml, say=print, *, precision):
        job = prepare_job(s, pretrained, config_yaml, say, precision=precision)
        job.identity[prog] = settings
        if prepare is not None:
            prepare(job, s, pretrained, say)
        return job

    grid.prepare_job, runner.FineTune.train_step = prepare_with_pilot, train_step

    def uninstall() -> None:
        grid.prepare_job, runner.FineTune.train_step = prepare_job, plain_step

    return uninstall
