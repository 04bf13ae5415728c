"""Process-wide CPU settings that decide how fast a training step runs, and the precision choice.

Three things, each measured with bench/bench_model.py (docs/benchmarks.md, "CPU settings"):

- OpenMP threads that wait passively.  torch's intra-op threads meet at a barrier after every
  parallel op; by default a thread that arrives first spins.  On a machine where another
  process wants a core, the spinning thread takes the core the late thread needs: with one
  busy process beside a 2-thread run, a BERT-base fp32 step took 6.7 s spinning and 5.2 s
  sleeping at the barrier (OMP_WAIT_POLICY=PASSIVE), a BERT-mini step 1.63 s and 1.15 s.
  The price is on a machine nothing else uses, and it grows as ops shrink: ~5% at those
  benchmark shapes, but the small recipes' steps (domain_mini pretraining, fine-tuning a
  BERT-mini) take 1.25-1.8x as long as with spinning threads, each barrier a sleep and a wake
  (bench/bench_omp_wait.py).  Passive stays the default because spinning beside one busy
  process was 2.0-2.4x slower still on those recipes: a slow run on a shared machine beats a
  crawl.  libgomp reads the variable when torch loads it, so the entry points call
  `prefer_passive_omp_wait()` before importing torch; an OMP_WAIT_POLICY already in the
  environment wins (ACTIVE on a dedicated machine).
- Freed memory kept in the process.  glibc returns every block over its mmap threshold
  (at most 32 MB) to the kernel when it is freed, so the word-embedding gradient, its bf16
  copy and other big per-step tensors come back as fresh pages, each first touch a page fault:
  a 94 MB zero-fill took 20 ms instead of 3.  `keep_freed_memory()` turns off mmap and trimming
  (mallopt), so the heap keeps its pages: ~25% off a bf16 BERT-base step.  The price: the
  process's resident memory stays at its peak instead of shrinking between steps.
- bf16 matrix units.  bf16 autocast pays on CPUs with AMX-BF16 or AVX512-BF16 instructions
  (torch.mm 4-5x the fp32 rate there) and costs elsewhere; `resolve_precision("auto")` picks it
  only where the units are.  NO_BF16_UNITS_ENV=1 in the environment makes this process behave
  as on a CPU without them (fp32 under auto, no bf16 row in the bench), so the path that most
  laptops and many cloud CPUs take can be tested on a machine that has them.

Nothing here imports torch at module level: `prefer_passive_omp_wait` must run before it loads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# Set to 1: treat this CPU as one without bf16 matrix instructions.
NO_BF16_UNITS_ENV = "BERT_PRETRAIN_NO_BF16_UNITS"
# Set to 0: no busy-machine check at start-up (a test suite whose own workers fill the cores).
BUSY_CHECK_ENV = "BERT_PRETRAIN_BUSY_CHECK"


_PASSIVE_BY_DEFAULT = False
"""Whether this process set OMP_WAIT_POLICY (rather than the user or a parent process)."""


def prefer_passive_omp_wait() -> None:
    """Before torch is imported: OpenMP threads sleep at barriers unless the user chose."""
    global _PASSIVE_BY_DEFAULT
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        _PASSIVE_BY_DEFAULT = True


def omp_wait_setting() -> str:
    """How OpenMP threads wait, for the run's log: the policy, and where it is our default,
    what choosing ACTIVE would gain (the log is where a user looks for why a run is slow)."""
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    if _PASSIVE_BY_DEFAULT and policy == "PASSIVE":
        return ("OMP_WAIT_POLICY=PASSIVE (the default; OMP_WAIT_POLICY=ACTIVE runs small models "
                "1.25-1.8x faster where nothing else uses the cores: docs/benchmarks.md)")
    return f"OMP_WAIT_POLICY={policy}"


def other_running_threads(samples: int = 7, interval: float = 0.03) -> int | None:
    """How many threads outside this process are running or waiting for a core now: the
    kernel's count of runnable threads (/proc/loadavg) less this process's own, the median of a
    few samples so one short wake-up does not count. None where /proc does not say (not Linux).

    Why it matters: two compute jobs on the same cores slow each other far more than their
    share, worst with spinning OpenMP threads (ACTIVE): a domain_mini pretraining fell from 2.07
    to ~0.13 steps/s beside a 2-thread job (docs/benchmarks.md), and nothing in its log said so."""
    import statistics
    import time

    counts = []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        counts.append(max(0, running - _own_running_threads()))
        if i + 1 < samples:
            time.sleep(interval)
    return int(statistics.median(counts))


def _own_running_threads() -> int:
    """This process's threads in state R (running or runnable); at least 1, the reader."""
    own = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                # "pid (comm) S ...": the name may hold spaces and parentheses, the state
                # follows the last ")"
                if f.read().rsplit(")", 1)[1].split()[0] == "R":
                    own += 1
        except (OSError, IndexError):
            continue
    return max(own, 1)


def busy_machine_warning(threads: int, cores: int | None = None,
                         others: int | None = None) -> str | None:
    """A warning line when other threads already hold cores this run's `threads` need, else
    None. `cores`/`others` default to this machine's (os.cpu_count(), other_running_threads())."""
    cores = cores or os.cpu_count() or 1
    if others is None:
        if os.environ.get(BUSY_CHECK_ENV, "") == "0":
            return None
        others = other_running_threads()
    if others is None or others + threads <= cores:
        return None
    spin = os.environ.get("OMP_WAIT_POLICY", "").upper() == "ACTIVE"
    return (f"warning: {others} thread(s) of other processes were running as this run started, "
            f"on a machine with {cores} cores for this run's {threads} threads: the steps will "
            f"be slower than on a quiet machine"
            + (", several times slower with OMP_WAIT_POLICY=ACTIVE (spinning threads wait on "
               "each other)" if spin else "")
            + "; run it alone, or give it fewer threads (OMP_NUM_THREADS), for the speeds in "
              "docs/benchmarks.md")


def keep_freed_memory() -> bool:
    """glibc only: serve every allocation from the heap and never trim it, so freed pages are
    reused warm. Returns whether the setting took (False on other C libraries)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        # mallopt returns 1 on success. Trim threshold: the largest value it accepts.
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
        return ok and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return False


def bf16_units() -> str | None:
    """The CPU's bf16 matrix instructions as torch sees them ("AMX-BF16", "AVX512-BF16"), or
    None when bf16 matmuls would be emulated (slower than fp32), or when NO_BF16_UNITS_ENV
    says to behave as if they were."""
    if os.environ.get(NO_BF16_UNITS_ENV, "") not in ("", "0"):
        return None
    import torch

    cpu = getattr(torch, "cpu", None)
    checks = (("AMX-BF16", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
    for name, check in checks:
        try:
            if getattr(cpu, check)():
                return name
        except (AttributeError, RuntimeError):
            continue
    return None


def no_bf16_units_reason() -> str:
    """Why bf16_units() said None, for a log line."""
    if os.environ.get(NO_BF16_UNITS_ENV, "") not in ("", "0"):
        return f"{NO_BF16_UNITS_ENV} is set: treated as a CPU without bf16 matrix instructions"
    return "this CPU has no bf16 matrix instructions (bf16 would be emulated, slower than fp32)"


def resolve_precision(setting: str, on_cuda: bool) -> tuple[str, str]:
    """(precision, why) for trainer.mixed_precision; `setting` other than auto is kept as is."""
    if setting != "auto":
        return setting, f"trainer.mixed_precision={setting}"
    import torch

    if on_cuda:
        if torch.cuda.is_bf16_supported():
            return "bf16", "auto: this GPU supports bf16"
        return "no", "auto: this GPU has no bf16 support"
    units = bf16_units()
    if units:
        return "bf16", f"auto: this CPU has {units} matrix instructions"
    return "no", f"auto: {no_bf16_units_reason()}"
