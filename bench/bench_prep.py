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
   Memory is reported split: anonymous (heap, arrays) and file-backed (memory-mapped corpus
   pages and libraries, which the kernel can drop at any time), as RSS and PSS summed over the
   process tree (Linux: /proc/<pid>/status and smaps_rollup).
`--memory-only` runs just step 3, `--runs N` times per size (median and spread), with
`--vocab-size` (default 8000) trained once; `--code DIR` runs another checkout's bert-prep
(e.g. the code before a change) for a before/after table.
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


MEMORY_KEYS = ("rss", "pss", "rss_anon", "rss_file", "pss_anon", "pss_file")


def _proc_memory(pid: int) -> dict:
    """RSS and PSS of one process, split into anonymous and file-backed pages (Linux)."""
    m = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile", "RssShmem"):
                m[k] = int(v.split()[0]) * 1024
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem"):
                m[k] = int(v.split()[0]) * 1024
    file_rss = m.get("RssFile", 0) + m.get("RssShmem", 0)
    file_pss = m.get("Pss_File", 0) + m.get("Pss_Shmem", 0)
    return {"rss": m.get("RssAnon", 0) + file_rss, "pss": m.get("Pss", 0),
            "rss_anon": m.get("RssAnon", 0), "rss_file": file_rss,
            "pss_anon": m.get("Pss_Anon", 0), "pss_file": file_pss}


def tree_memory(proc: psutil.Process) -> dict:
    """Memory summed over the process and its workers.  RSS counts pages shared by fork()ed
    workers once per process; PSS splits them among the sharers (the honest total).  Anonymous
    pages are what the program allocated; file-backed ones are memory-mapped files (the
    tokenized corpus) and libraries, which the kernel reclaims under pressure."""
    total = dict.fromkeys(MEMORY_KEYS, 0)
    for p in [proc] + proc.children(recursive=True):
        try:
            m = _proc_memory(p.pid)
        except OSError:
            try:     # not Linux: psutil's totals, no split
                info = p.memory_full_info()
                m = {"rss": info.rss, "pss": getattr(info, "pss", info.rss)}
            except psutil.Error:
                continue
        for k, v in m.items():
            total[k] += v
    return total


def run_prep(args: list[str], code: str | None = None) -> dict:
    """Run bert-prep; wall time, CPU time and peak memory of its process tree (each kind's
    own peak, sampled every 30 ms).  `code`: a checkout whose data_prep to run instead."""
    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = os.path.abspath(code)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen([BERT_PREP, "progress=false", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    ps = psutil.Process(proc.pid)
    peak = dict.fromkeys(MEMORY_KEYS, 0)
    loads = []
    done = threading.Event()

    def sample():
        n = 0
        while not done.is_set():
            try:
                for k, v in tree_memory(ps).items():
                    peak[k] = max(peak[k], v)
            except psutil.Error:
                pass
            if n % 33 == 0:
                loads.append(os.getloadavg()[0])
            n += 1
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
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": peak["rss"],
            "peak_pss_bytes": peak["pss"], "peak_bytes": peak,
            "load_avg_1m": round(statistics.mean(loads), 2) if loads else None}


def train_vocab(corpus: str, work: str, vocab_size: int = 30522) -> tuple[str, float]:
    from data_prep.config import TextCorpusConfig, TokenizerConfig
    from data_prep.pipeline import _sentence_batches
    from data_prep.tokenizer import prepare_tokenizer
    d = os.path.join(work, "vocab")
    t0 = time.perf_counter()
    prepare_tokenizer(TokenizerConfig(vocab_size=vocab_size),
                      lambda: _sentence_batches(TextCorpusConfig(paths=[corpus])), d,
                      progress=False)
    return os.path.join(d, "vocab.txt"), time.perf_counter() - t0


def _repeat_corpus(corpus: str, times: int, path: str) -> str:
    """The corpus `times` times over, a blank line (a document break) between copies."""
    text = open(corpus, encoding="utf-8").read().rstrip("\n")
    with open(path, "w", encoding="utf-8") as f:
        for i in range(times):
            f.write(("\n\n" if i else "") + text)
        f.write("\n")
    return path


def memory_table(corpus: str, base_times: int, runs: int, vocab_size: int,
                 codes: list[tuple[str, str | None]], work: str) -> list[dict]:
    """Peak memory at 1x and 4x the corpus (the corpus repeated base_times and 4 x base_times),
    `runs` runs each, for each (label, checkout): median and spread (min-max) of each peak."""
    vocab, _ = train_vocab(corpus, work, vocab_size)
    sizes = {"1x": _repeat_corpus(corpus, base_times, os.path.join(work, "c1.txt")),
             "4x": _repeat_corpus(corpus, 4 * base_times, os.path.join(work, "c4.txt"))}
    samples = {(lab, size): [] for lab, _ in codes for size in sizes}
    for r in range(runs):       # interleaved, so machine load hits every configuration alike
        for lab, code in codes:
            for size, path in sizes.items():
                out = os.path.join(work, "mem_out")
                shutil.rmtree(out, ignore_errors=True)
                res = run_prep(["corpus=text", f"corpus.paths=[{path}]",
                                f"tokenizer.vocab_file={vocab}", "num_proc=2",
                                f"output_dir={out}"], code)
                samples[(lab, size)].append(res)
                print(f"  run {r + 1}/{runs} {lab} {size}: {res['wall_s']:.1f} s, "
                      f"anon PSS {res['peak_bytes']['pss_anon'] / 2**20:.0f} MiB, "
                      f"load {res['load_avg_1m']}", flush=True)
    shutil.rmtree(os.path.join(work, "mem_out"), ignore_errors=True)
    rows = []
    for (lab, size), res in samples.items():
        row = {"code": lab, "corpus": size, "corpus_mb": round(os.path.getsize(sizes[size]) / 1e6,
                                                               1),
               "wall_s": round(statistics.median(x["wall_s"] for x in res), 2),
               "load_avg_1m": [x["load_avg_1m"] for x in res]}
        for k in MEMORY_KEYS:
            v = [x["peak_bytes"][k] / 2**20 for x in res]
            row[k + "_mib"] = {"median": round(statistics.median(v)), "min": round(min(v)),
                               "max": round(max(v))}
        rows.append(row)
    return rows


def print_memory_table(rows: list[dict]) -> None:
    print("\npeak memory of the bert-prep process tree (MiB; median [min-max]); anon = heap and "
          "arrays, file = memory-mapped files and libraries")
    cols = ("rss_anon", "rss_file", "pss_anon", "pss_file")
    print(f"{'code':>8} {'corpus':>6} {'MB':>6} " + " ".join(f"{c:>16}" for c in cols)
          + f" {'wall s':>7}  load avg")
    for r in rows:
        cells = " ".join(f"{r[c + '_mib']['median']:>5} [{r[c + '_mib']['min']}-"
                         f"{r[c + '_mib']['max']}]".rjust(16) for c in cols)
        print(f"{r['code']:>8} {r['corpus']:>6} {r['corpus_mb']:>6} {cells} {r['wall_s']:>7} "
              f" {r['load_avg_1m']}")
    for lab in dict.fromkeys(r["code"] for r in rows):
        by = {r["corpus"]: r for r in rows if r["code"] == lab}
        if "1x" in by and "4x" in by:
            ratio = {c: by["4x"][c + "_mib"]["median"] / max(by["1x"][c + "_mib"]["median"], 1)
                     for c in cols}
            print(f"{lab}: 4x / 1x  " + "  ".join(f"{c} {v:.2f}" for c, v in ratio.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=os.path.join(REPO, "..", "shared", "corpora",
                                                     "gutenberg.txt"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one repeat, skip the x4 corpus")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "prep.json"))
    ap.add_argument("--memory-only", action="store_true",
                    help="only the memory table: 1x and 4x corpus, --runs runs each")
    ap.add_argument("--times", type=int, default=9,
                    help="--memory-only: the 1x corpus is --corpus repeated this many times")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--code", action="append", default=[], metavar="LABEL=DIR",
                    help="--memory-only: also run the bert-prep of checkout DIR (repeatable)")
    a = ap.parse_args()
    if a.memory_only:
        work = tempfile.mkdtemp(prefix="bench_prep_mem_")
        codes = [("this", None)] + [tuple(c.split("=", 1)) for c in a.code]
        try:
            rows = memory_table(os.path.abspath(a.corpus), a.times, a.runs, a.vocab_size,
                                codes, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print_memory_table(rows)
        print(f"(a shared machine: {os.cpu_count()} CPUs; load average per run above)")
        out = os.path.join(os.path.dirname(a.out), "prep_memory.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"corpus": os.path.abspath(a.corpus), "times": a.times, "runs": a.runs,
                       "vocab_size": a.vocab_size, "cpus": os.cpu_count(), "rows": rows}, f,
                      indent=2)
        print(f"wrote {out}")
        return
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
                                "peak_pss_gb": round(res["peak_pss_bytes"] / 1e9, 3),
                                "peak_anon_pss_gb": round(res["peak_bytes"]["pss_anon"] / 1e9,
                                                          3),
                                "peak_file_pss_gb": round(res["peak_bytes"]["pss_file"] / 1e9,
                                                          3)})
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
                  f"PSS {s['peak_pss_gb']:.3f} GB (anon {s['peak_anon_pss_gb']:.3f}, "
                  f"file {s['peak_file_pss_gb']:.3f})")
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
