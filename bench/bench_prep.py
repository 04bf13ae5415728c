"""Benchmark bert-prep against Google's create_pretraining_data.py reference figures.

    python bench/bench_prep.py [--corpus PATH] [--repeats N] [--quick]

1. Trains a 30,522-token WordPiece vocab on the corpus (timed on its own).
2. With that vocab.txt, runs the real `bert-prep` command (a fresh process: start-up, Hydra,
   tokenization, instances, shards and manifest all counted) for num_proc 1 and 2 at
   dupe_factor 1 and 10, alternating the configurations so machine load hits all alike, and
   reports instances/s, corpus MB/s, wall time and peak RSS of the whole process tree (sampled
   every 30 ms, workers included: RSS summed, and PSS, which counts pages shared between
   fork()ed workers once).
3. Peak RSS at two corpus sizes (the corpus once and 4 times) to show memory does not grow.
Google's figures (from ../shared/MEASUREMENTS.md, same 2-core machine type, 20 MB Wikipedia
sample): dupe_factor 1: 1,421 instances/s, 0.68 GB peak; dupe_factor 10: 3,203 instances/s,
3.9 GB peak.  Targets: >= 4x at dupe_factor 1 and >= 10x at dupe_factor 10 with num_proc=2.
Prints a table; writes bench/results/prep.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
GOOGLE = {1: {"instances_per_s": 1421, "peak_rss_gb": 0.68},
          10: {"instances_per_s": 3203, "peak_rss_gb": 3.9}}
TARGET = {1: 4, 10: 10}
BERT_PREP = os.path.join(os.path.dirname(sys.executable), "bert-prep")


def tree_memory(proc: psutil.Process) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) over the process and its workers.  RSS counts pages shared by
    fork()ed workers once per process; PSS splits them among the sharers (the honest total)."""
    rss = pss = 0
    for p in [proc] + proc.children(recursive=True):
        try:
            m = p.memory_full_info()
            rss += m.rss
            pss += getattr(m, "pss", m.rss)
        except psutil.Error:
            pass
    return rss, pss


def run_prep(args: list[str]) -> dict:
    """Run bert-prep; wall time, CPU time and peak RSS of its process tree."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen([BERT_PREP, "progress=false", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ps = psutil.Process(proc.pid)
    peak = [0, 0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                rss, pss = tree_memory(ps)
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            except psutil.Error:
                pass
            time.sleep(0.03)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    th.join()
    if proc.returncode != 0:
        raise SystemExit(f"bert-prep failed: {err[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": peak[0], "peak_pss_bytes": peak[1]}


def train_vocab(corpus: str, work: str) -> tuple[str, float]:
    from data_prep.config import TextCorpusConfig, TokenizerConfig
    from data_prep.pipeline import _sentence_batches
    from data_prep.tokenizer import prepare_tokenizer
    d = os.path.join(work, "vocab")
    t0 = time.perf_counter()
    prepare_tokenizer(TokenizerConfig(vocab_size=30522),
                      lambda: _sentence_batches(TextCorpusConfig(paths=[corpus])), d,
                      progress=False)
    return os.path.join(d, "vocab.txt"), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=os.path.join(REPO, "..", "shared", "corpora",
                                                     "gutenberg.txt"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one repeat, skip the x4 corpus")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "prep.json"))
    a = ap.parse_args()
    corpus = os.path.abspath(a.corpus)
    repeats = 1 if a.quick else a.repeats
    mb = os.path.getsize(corpus) / 1e6
    work = tempfile.mkdtemp(prefix="bench_prep_")
    try:
        vocab, train_s = train_vocab(corpus, work)
        print(f"tokenizer training (30,522 WordPiece on {mb:.1f} MB): {train_s:.2f} s")
        common = ["corpus=text", f"corpus.paths=[{corpus}]", f"tokenizer.vocab_file={vocab}",
                  "max_seq_length=128"]
        configs = [(df, npr) for df in (1, 10) for npr in (1, 2)]
        runs = {c: [] for c in configs}
        n_inst = {}
        for r in range(repeats):
            for df, npr in (configs if r % 2 == 0 else configs[::-1]):
                out = os.path.join(work, f"out_{df}_{npr}")
                res = run_prep([*common, f"dupe_factor={df}", f"num_proc={npr}",
                                f"output_dir={out}"])
                with open(os.path.join(out, "manifest.json")) as f:
                    n_inst[(df, npr)] = json.load(f)["stats"]["num_instances"]
                runs[(df, npr)].append(res)
                shutil.rmtree(out)
        rows = []
        for df, npr in configs:
            wall = statistics.median(x["wall_s"] for x in runs[(df, npr)])
            cpu = statistics.median(x["cpu_s"] for x in runs[(df, npr)])
            rss = max(x["peak_rss_bytes"] for x in runs[(df, npr)])
            pss = max(x["peak_pss_bytes"] for x in runs[(df, npr)])
            ips = n_inst[(df, npr)] / wall
            rows.append({"dupe_factor": df, "num_proc": npr, "instances": n_inst[(df, npr)],
                         "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                         "instances_per_s": round(ips),
                         "mb_per_s": round(mb / wall, 3),
                         "peak_rss_gb": round(rss / 1e9, 3), "peak_pss_gb": round(pss / 1e9, 3),
                         "vs_google_instances_per_s": round(ips / GOOGLE[df]["instances_per_s"], 2),
                         # Google's generator is one CPU-bound process: its instances/s is also
                         # its instances per CPU-second, a ratio machine load does not distort.
                         "instances_per_cpu_s": round(n_inst[(df, npr)] / cpu),
                         "vs_google_instances_per_cpu_s": round(
                             n_inst[(df, npr)] / cpu / GOOGLE[df]["instances_per_s"], 2),
                         "target_ratio": TARGET[df] if npr == 2 else None,
                         "all_walls_s": [round(x["wall_s"], 3) for x in runs[(df, npr)]]})
        scaling = []
        if not a.quick:
            big = os.path.join(work, "x4.txt")
            text = open(corpus, encoding="utf-8").read().rstrip("\n")
            with open(big, "w", encoding="utf-8") as f:
                f.write("\n\n".join([text] * 4) + "\n")
            for path, label in ((corpus, "x1"), (big, "x4")):
                out = os.path.join(work, f"scale_{label}")
                res = run_prep(["corpus=text", f"corpus.paths=[{path}]",
                                f"tokenizer.vocab_file={vocab}", "dupe_factor=10", "num_proc=2",
                                f"output_dir={out}"])
                with open(os.path.join(out, "manifest.json")) as f:
                    n = json.load(f)["stats"]["num_instances"]
                scaling.append({"corpus": label, "corpus_mb": round(os.path.getsize(path) / 1e6, 1),
                                "instances": n, "wall_s": round(res["wall_s"], 2),
                                "cpu_s": round(res["cpu_s"], 2),
                                "instances_per_s": round(n / res["wall_s"]),
                                "peak_rss_gb": round(res["peak_rss_bytes"] / 1e9, 3),
                                "peak_pss_gb": round(res["peak_pss_bytes"] / 1e9, 3)})
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nbert-prep on {os.path.basename(corpus)} ({mb:.1f} MB), given vocab.txt, "
          f"median of {repeats} run(s), end to end (a fresh bert-prep process)")
    head = (f"{'dupe':>4} {'proc':>4} {'instances':>10} {'wall s':>7} {'CPU s':>6} {'inst/s':>8} "
            f"{'MB/s':>6} {'RSS GB':>6} {'PSS GB':>6} {'x Google inst/s':>15} {'target':>6} "
            f"{'inst/CPU-s':>10} {'x Google':>8}")
    print(head)
    for r in rows:
        tgt = f">={r['target_ratio']}x" if r["target_ratio"] else ""
        print(f"{r['dupe_factor']:>4} {r['num_proc']:>4} {r['instances']:>10,} "
              f"{r['wall_s']:>7.2f} {r['cpu_s']:>6.2f} {r['instances_per_s']:>8,} "
              f"{r['mb_per_s']:>6.2f} "
              f"{r['peak_rss_gb']:>6.3f} {r['peak_pss_gb']:>6.3f} "
              f"{r['vs_google_instances_per_s']:>14.2f}x {tgt:>6} "
              f"{r['instances_per_cpu_s']:>10,} {r['vs_google_instances_per_cpu_s']:>7.2f}x")
    print(f"Google (MEASUREMENTS.md): dupe 1: 1,421 inst/s, 0.68 GB; dupe 10: 3,203 inst/s, "
          f"3.9 GB.  Load average during the runs: {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs (wall times need a quiet machine; CPU s is the process "
          f"tree's user+system time)")
    if scaling:
        print("\npeak RSS vs corpus size (dupe_factor 10, num_proc 2)")
        for s in scaling:
            print(f"  {s['corpus']}: {s['corpus_mb']:>5} MB  {s['instances']:>9,} instances  "
                  f"{s['wall_s']:>6.2f} s ({s['instances_per_s']:,} inst/s, CPU "
                  f"{s['cpu_s']:.2f} s)  peak RSS {s['peak_rss_gb']:.3f} GB, "
                  f"PSS {s['peak_pss_gb']:.3f} GB")
    result = {"corpus": corpus, "corpus_mb": round(mb, 2), "cpus": os.cpu_count(),
              "load_avg_1m": os.getloadavg()[0],
              "tokenizer_training_s": round(train_s, 2), "runs": rows, "rss_scaling": scaling,
              "google_reference": GOOGLE}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
