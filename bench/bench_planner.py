"""How long the length-group planner takes per forward pass (`impl.varlen_attention=groups`).

The planner (`bert_pretrain/model/layout.py:plan_groups`) runs once per forward, on the host,
before any attention: what it costs is added to every step on every device.  Issue 30 found the
old dynamic programme (O(MAX_GROUPS x B^2) Python steps) at 121 ms for a batch of 256 and 638 ms
for 512.  This times, per batch size:
  plan     plan_groups alone (the target: <= 1 ms at B=512),
  build    the whole per-forward set-up of the groups (TokenLayout.build + attention_groups:
           the plan and every group's index tensors),
  old      the old programme, kept here as the reference it replaced (up to --old-max).
Batches are BERT-like: half the sequences at full length, the rest uniform in [L/2, L]
(bench_model.py's), and at L=512 uniform in [1, 512] (the most distinct lengths, so the
planner buckets them).  Each figure is the median over --runs runs of each run's median of
--reps calls, with the min-max over runs and the other processes' load during the runs.

    python bench/bench_planner.py                 # table on stdout, bench/results/planner.json
    python bench/bench_planner.py --batches 256 512 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bert_pretrain.components.cpu_runtime import prefer_passive_omp_wait  # noqa: E402

prefer_passive_omp_wait()  # as bert-train: idle OpenMP workers must not spin beside the planner

import torch  # noqa: E402

from bert_pretrain.model import layout as layout_mod  # noqa: E402
from benchlib import OtherLoad, median_and_range  # noqa: E402  (bench/, beside this file)


def old_plan_groups(lengths: list[int], num_heads: int) -> list[list[int]]:
    """The planner before issue 30 (same cost model): a dynamic programme over the B sequences
    sorted longest first, O(MAX_GROUPS x B^2) Python steps."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    ls = [lengths[i] for i in order]
    n, fixed = len(ls), layout_mod.GROUP_OVERHEAD / num_heads
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(layout_mod.MAX_GROUPS + 1)]
    cut = [[0] * (n + 1) for _ in range(layout_mod.MAX_GROUPS + 1)]
    best[0][0] = 0.0
    for k in range(1, layout_mod.MAX_GROUPS + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                cost = best[k - 1][i] + (j - i) * ls[i] ** 2 + fixed
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    k = min(range(1, layout_mod.MAX_GROUPS + 1), key=lambda k: best[k][n])
    groups, j = [], n
    while k > 0:
        i = cut[k][j]
        groups.append(sorted(order[i:j]))
        j, k = i, k - 1
    return groups[::-1]


def bert_lengths(batch: int, seq: int, rng: random.Random) -> list[int]:
    if seq > 128:
        return [rng.randint(1, seq) for _ in range(batch)]
    return [seq if rng.random() < 0.5 else rng.randint(seq // 2, seq) for _ in range(batch)]


def cost(groups, lengths, heads) -> float:
    return sum(len(g) * max(lengths[i] for i in g) ** 2 + layout_mod.GROUP_OVERHEAD / heads
               for g in groups)


def time_calls(fn, inputs: list, reps: int) -> float:
    times = []
    for i in range(reps):
        t = time.perf_counter()
        fn(inputs[i % len(inputs)])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(batch: int, seq: int, heads: int, reps: int, old_max: int, seed: int) -> dict:
    rng = random.Random(seed)
    samples = [bert_lengths(batch, seq, rng) for _ in range(8)]
    masks = [(torch.arange(seq)[None, :] < torch.tensor(ls)[:, None]).long() for ls in samples]

    def build(mask):
        return layout_mod.TokenLayout.build(mask, batch, seq, unpad=True).attention_groups(heads)

    row = dict(batch=batch, seq=seq, heads=heads,
               plan_ms=1e3 * time_calls(lambda ls: layout_mod.plan_groups(ls, heads), samples,
                                        reps),
               build_ms=1e3 * time_calls(build, masks, reps),
               groups=statistics.mean(len(layout_mod.plan_groups(ls, heads)) for ls in samples))
    if batch <= old_max:
        row["old_ms"] = 1e3 * time_calls(lambda ls: old_plan_groups(ls, heads), samples,
                                         max(1, reps // 20))
        # the same cost-model optimum (up to the bucketing above 128 distinct lengths)
        row["plan_cost_vs_old"] = statistics.mean(
            cost(layout_mod.plan_groups(ls, heads), ls, heads) / cost(old_plan_groups(ls, heads),
                                                                      ls, heads)
            for ls in samples)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[32, 64, 128, 256, 512])
    p.add_argument("--seqs", nargs="+", type=int, default=[128, 512])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--old-max", type=int, default=256,
                   help="time the old programme up to this batch (it takes 0.6 s at 512)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "planner.json"))
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
          f"{args.runs} runs x {args.reps} calls")
    runs = []
    for run in range(args.runs):
        load = OtherLoad()
        rows = [measure(b, s, args.heads, args.reps, args.old_max, seed=run * 100 + b)
                for s in args.seqs for b in args.batches]
        other = load.cores()
        for r in rows:
            r["other_load_cores"] = other
        runs.append(rows)
    summary = []
    print(f"{'L':>4} {'B':>4} {'groups':>6} {'plan ms':>18} {'build ms':>18} {'old ms':>20} "
          f"{'cost/old':>8} {'other load':>10}")
    for i, first in enumerate(runs[0]):
        rows = [run[i] for run in runs]
        entry = dict(batch=first["batch"], seq=first["seq"], heads=first["heads"],
                     groups=first["groups"])
        entry.update(median_and_range(rows, ("plan_ms", "build_ms", "old_ms",
                                             "plan_cost_vs_old", "other_load_cores")))
        summary.append(entry)

        def fmt(key, width):
            if key not in entry:
                return f"{'-':>{width}}"
            lo, hi = entry[key + "_range"]
            return f"{entry[key]:>7.3f} ({lo:.3f}-{hi:.3f})".rjust(width)

        ratio = f"{entry['plan_cost_vs_old']:.4f}" if "plan_cost_vs_old" in entry else "-"
        print(f"{entry['seq']:>4} {entry['batch']:>4} {entry['groups']:>6.1f} "
              f"{fmt('plan_ms', 18)} {fmt('build_ms', 18)} {fmt('old_ms', 20)} {ratio:>8} "
              f"{entry['other_load_cores']:>10.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(torch=torch.__version__, threads=torch.get_num_threads(),
                                   reps=args.reps, runs=runs, summary=summary,
                                   loadavg_1min_after=os.getloadavg()[0]), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
