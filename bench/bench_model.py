"""Training-step throughput: our BertForPreTraining against transformers' (sdpa), same batches.

One step = forward with MLM + NSP losses, backward, fused AdamW step.  Both models start from the
same weights and see the same batches (seq 128, ~15% of real tokens labelled, half of each batch
padded to a random length in [64, 128]); the models alternate step by step in one process, so
the load other processes put on the machine hits both alike.  Reported: median step time after
warm-up, real (non-padding) tokens per second, speedup, and model FLOPs utilisation (MFU) of the
useful work (real tokens, labelled positions) against this machine's torch.mm peak measured in
the same run.  Process CPU time per step is recorded too: with `--threads 1` its ratios barely
move when other jobs share the machine, unlike wall-clock ones.

Both models run in one process with the process settings bert-train uses on CPU (OpenMP
threads that wait passively, freed memory kept warm: bert_pretrain/components/cpu_runtime.py), so what
those settings gain, they gain for transformers too; `--runs N` repeats everything N times and
prints the median over runs with the min-max spread; the load from other processes during each
run is recorded (cores busy outside this process, from /proc/stat).

    python bench/bench_model.py --runs 3 --compete        # CPU: the table in docs/benchmarks.md
    python bench/bench_model.py --presets bert_tiny:32 bert_small:32:512 --steps 3
    python bench/bench_model.py --compete                   # + one run beside a busy process
    python bench/bench_model.py --variants                  # also time our speed switches off
    python bench/bench_model.py --dropout 0 --variants ours-sdpa   # as budget recipes train
    python bench/bench_model.py --compile                   # also time torch.compile'd ours
    python bench/bench_model.py --device cuda               # GPU: bf16 autocast, fused attention
    python bench/bench_model.py --finetune                  # + a fine-tuning step (below)

`--finetune` adds a fine-tuning row per preset: our BertForSequenceClassification against
transformers' (sdpa) on the same weights and batches of sentence pairs of GLUE-like lengths
(uniform in [seq/8, seq], each batch padded to its longest, as bert-finetune collates); with
`--variants` the named speed switches are timed on the classifier as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bert_pretrain.components.cpu_runtime import (bf16_units, keep_freed_memory,  # noqa: E402
                                       no_bf16_units_reason, prefer_passive_omp_wait)

prefer_passive_omp_wait()  # as bert-train: before torch loads libgomp

import torch  # noqa: E402

from bert_pretrain.model import BertConfig, BertForPreTraining, ModelImpl  # noqa: E402
from benchlib import OtherLoad, median_and_range  # noqa: E402  (bench/, beside this file)

PRESET_SIZES = {  # (layers, hidden, heads, intermediate): conf/train/model/<name>.yaml
    "bert_tiny": (2, 128, 2, 512),
    "bert_mini": (4, 256, 4, 1024),
    "bert_small": (4, 512, 8, 2048),
    "bert_medium": (8, 512, 8, 2048),
    "bert_base": (12, 768, 12, 3072),
    "bert_large": (24, 1024, 16, 4096),
}
VARIANTS = {  # name -> ModelImpl overrides, to measure what each switch is worth
    "ours": {},
    "ours-no-unpad": {"unpad": False},
    "ours-unpad": {"unpad": True},
    "ours-fused-qkv": {"fused_qkv": True},
    "ours-split-qkv": {"fused_qkv": False},
    "ours-no-fast-dropout": {"fast_dropout": False},
    "ours-no-sparse-last": {"sparse_last_layer": False},
    "ours-sparse-last": {"sparse_last_layer": True},
    "ours-no-sparse": {"sparse_prediction": False},
    "ours-no-varlen": {"varlen_attention": "off"},
    "ours-varlen-groups": {"varlen_attention": "groups"},
    "ours-varlen-nested": {"varlen_attention": "nested"},
    "ours-sdpa": {"attention": "sdpa"},  # the default (auto) is the explicit product on CPU
    "ours-compile": {"compile": True},
}
IMPL_FIELDS = {f.name for f in dataclasses.fields(ModelImpl)}


# switches of the pretraining heads only: a classifier computes the same either way
FINETUNE_IRRELEVANT = ("ours-no-sparse",)


def same_as_default(switches: dict, device_type: str) -> bool:
    """Whether a variant runs what the default (`auto`) already runs on this device, e.g.
    ours-fused-qkv or ours-no-unpad on a GPU, ours-split-qkv or ours-unpad on a CPU: timing it
    twice measures nothing."""
    impl, default = dataclasses.replace(ModelImpl(), **switches), ModelImpl()
    resolved = ("resolved_fused_qkv", "resolved_sparse_last_layer", "resolved_varlen_attention",
                "resolved_unpad")
    return all(getattr(impl, r)(device_type) == getattr(default, r)(device_type)
               for r in resolved) and \
        all(getattr(impl, k) == getattr(default, k) for k in switches
            if k not in ("fused_qkv", "sparse_last_layer", "varlen_attention", "unpad"))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_preset(name: str, vocab_size: int) -> BertConfig:
    """Reads conf/train/model/<name>.yaml when PyYAML is there (it comes with Hydra)."""
    try:
        import yaml

        values = yaml.safe_load((ROOT / "conf" / "train" / "model" / f"{name}.yaml").read_text())
        # null ids in the presets are filled from the data's manifest by the trainer
        return BertConfig.from_dict(values, vocab_size=vocab_size,
                                    pad_token_id=values.get("pad_token_id") or 0)
    except ImportError:
        layers, hidden, heads, inter = PRESET_SIZES[name]
        return BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                          num_attention_heads=heads, intermediate_size=inter)


def make_batch(batch_size: int, seq_len: int, vocab_size: int, gen: torch.Generator,
               device: str) -> dict[str, torch.Tensor]:
    lengths = torch.full((batch_size,), seq_len)
    padded = torch.randperm(batch_size, generator=gen)[: batch_size // 2]
    lengths[padded] = torch.randint(seq_len // 2, seq_len + 1, (len(padded),), generator=gen)
    pos = torch.arange(seq_len)
    mask = pos[None] < lengths[:, None]
    ids = torch.randint(5, vocab_size, (batch_size, seq_len), generator=gen)
    ids[:, 0] = 2
    ids = ids.masked_fill(~mask, 0)
    seg_a = (lengths.float() * torch.empty(batch_size).uniform_(0.3, 0.7, generator=gen)).long()
    types = (pos[None] >= seg_a[:, None]) & mask
    labelled = (torch.rand(batch_size, seq_len, generator=gen) < 0.15) & mask & (pos[None] > 0)
    labels = torch.where(labelled, ids, torch.full_like(ids, -100))
    nsp = torch.randint(0, 2, (batch_size,), generator=gen)
    batch = dict(input_ids=ids, attention_mask=mask.long(), token_type_ids=types.long(),
                 labels=labels, next_sentence_label=nsp)
    return {k: v.to(device) for k, v in batch.items()}


def step_flops(cfg: BertConfig, batch: dict[str, torch.Tensor]) -> float:
    """Useful training FLOPs (3x forward): matmuls on real tokens, attention over real keys,
    MLM head on labelled positions only, pooler/NSP."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    lengths = batch["attention_mask"].sum(1).double()
    tokens = lengths.sum().item()
    labelled = (batch["labels"] != -100).sum().item()
    per_token = layers * 2 * (4 * h * h + 2 * h * inter)
    attention = layers * 2 * 2 * h * (lengths**2).sum().item()
    head = labelled * 2 * (h * h + h * cfg.vocab_size)
    nsp = len(lengths) * 2 * (h * h + 2 * h)
    return 3.0 * (tokens * per_token + attention + head + nsp)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_peak(device: str, dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    """FLOP/s of torch.mm on n x n matrices: the best of `reps` back-to-back products after two
    warm-ups (a ceiling, so the best; single products woke sleeping threads and read up to 30%
    low)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):
        torch.mm(a, b)
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times)


@functools.lru_cache(maxsize=None)
def baseline_model_class(rev: str):
    """BertForPreTraining (and ModelImpl) as of git revision `rev`: its bert_pretrain/model/
    (which imports only torch) extracted to a temporary package, so that a change can be timed
    against the code before it in the same process, alternating (`--baseline REV`)."""
    import importlib
    import io
    import tarfile
    import tempfile

    root = tempfile.mkdtemp(prefix="bench-baseline-")
    archive = subprocess.run(["git", "archive", rev, "bert_pretrain/model"], cwd=ROOT,
                             capture_output=True, check=False)
    if archive.returncode != 0:
        sys.exit(f"error: --baseline {rev}: git archive failed: "
                 f"{archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    os.rename(os.path.join(root, "bert_pretrain", "model"), os.path.join(root, "baseline_model"))
    sys.path.insert(0, root)
    module = importlib.import_module("baseline_model")
    return module.BertForPreTraining, module.ModelImpl


_KEPT_MODELS: dict = {}


def build_models(cfg: BertConfig, names: list[str], device: str, seed: int, baseline=None):
    import transformers

    torch.manual_seed(seed)
    reference = BertForPreTraining(cfg, ModelImpl())
    weights = reference.state_dict()
    models = {}
    for name in names:
        if name == "transformers":
            hf_cfg = transformers.BertConfig(**cfg.to_hf_dict())
            model = transformers.BertForPreTraining._from_config(hf_cfg, attn_implementation="sdpa")
        elif name.startswith("ours@"):
            model_cls, impl_cls = baseline
            model = model_cls(_baseline_config(model_cls, cfg), impl_cls())
        else:
            switches = VARIANTS.get(name, {})
            model = BertForPreTraining(cfg, dataclasses.replace(ModelImpl(), **switches))
        model.load_state_dict(weights, strict=True)
        model.to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        models[name] = (model, opt)
    return models


def _baseline_config(model_cls, cfg: BertConfig):
    """Our config rebuilt as the baseline package's BertConfig (the fields it knows)."""
    import dataclasses as dc
    import importlib

    config_cls = importlib.import_module(model_cls.__module__.rsplit(".", 1)[0]).BertConfig
    known = {f.name for f in dc.fields(config_cls)}
    return config_cls(**{k: v for k, v in cfg.to_dict().items() if k in known})


def start_competitor() -> subprocess.Popen:
    """One busy single-threaded process: a machine shared with one other job."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def train_step(model, opt, batch, device: str, dtype: torch.dtype) -> tuple:
    """(wall seconds, process CPU seconds, GPU memory) of one training step. GPU memory: the
    step's own peak above what was allocated before it (GiB), and how often the caching
    allocator had to free its cache and retry (each retry waits for the GPU): a step that
    needs more than the cache holds pays that every time; None on CPU."""
    cuda = device.startswith("cuda")
    sync(device)
    if cuda:
        before = torch.cuda.memory_allocated()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        torch.cuda.reset_peak_memory_stats()
    t, c = time.perf_counter(), time.process_time()
    with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
        out = model(**batch)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    memory = None
    if cuda:
        memory = ((torch.cuda.max_memory_allocated() - before) / 2**30,
                  torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries)
    return wall, cpu, memory


def time_alternating(models: dict, batch_fn, flops_fn, cfg, batch_size: int, seq_len: int,
                     args, dtype) -> tuple:
    """Train every model on the same batches, one step each per batch, who goes first
    alternating (a machine that slows down slows all alike); the first args.warmup steps are
    not counted. Returns (step times, CPU times per model, real tokens and useful FLOPs per
    batch, the other processes' load in cores, per model its peak step memory in GiB and
    allocator retries on a GPU, else None).

    The batches come from `args.batch_seed` (a new seed each run): a GPU caches kernel plans
    per shape, and a run that saw the same shapes as the one before would be flattered (issue
    30: 1.05 s a step on new shapes, 0.14 s on repeated ones)."""
    gen = torch.Generator().manual_seed(getattr(args, "batch_seed", args.seed))
    names = list(models)
    times = {n: [] for n in names}
    cpu_times = {n: [] for n in names}
    memory = {n: None for n in names}
    tokens, flops = [], []
    load = OtherLoad()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            load = OtherLoad()
        batch = batch_fn(batch_size, seq_len, cfg.vocab_size, gen, args.device)
        for name in (names if step % 2 == 0 else names[::-1]):
            elapsed, cpu, mem = train_step(*models[name], batch, args.device, dtype)
            if step >= args.warmup:
                times[name].append(elapsed)
                cpu_times[name].append(cpu)
                if mem is not None:
                    peak, retries = memory[name] or (0.0, 0)
                    memory[name] = (max(peak, mem[0]), retries + mem[1])
        if step >= args.warmup:
            tokens.append(batch["attention_mask"].sum().item())
            flops.append(flops_fn(cfg, batch))
    return times, cpu_times, tokens, flops, load.cores(), memory


def variant_names(args, exclude: tuple = ()) -> list[str]:
    """The variants of our model to time beside the default: those --variants names (all with
    a bare --variants, one switch at a time off or on) that run something the default does not
    on this device, and ours-compile with --compile."""
    names = []
    if args.variants is not None:
        names += [v for v, switches in VARIANTS.items()
                  if v != "ours" and v not in exclude
                  and (not args.variants or v in args.variants)
                  and set(switches) <= IMPL_FIELDS
                  and not same_as_default(switches, torch.device(args.device).type)
                  # (compiling takes a minute: only when named, or with --compile)
                  and (v != "ours-compile" or args.variants)]
    if args.compile and "ours-compile" not in names and "ours-compile" not in exclude:
        names.append("ours-compile")
    return names


def bench_one(preset: str, batch_size: int, seq_len: int, dtype_name: str, args,
              peaks) -> list[dict]:
    dtype = DTYPES[dtype_name]
    cfg = load_preset(preset, args.vocab_size)
    if args.dropout is not None:
        cfg = dataclasses.replace(cfg, hidden_dropout_prob=args.dropout,
                                  attention_probs_dropout_prob=args.dropout)
    names = ["ours", "transformers"] + variant_names(args)
    baseline = None
    if args.baseline:
        names.append(f"ours@{args.baseline}")
        baseline = baseline_model_class(args.baseline)
    key = (preset, batch_size, seq_len, dtype_name, tuple(names))
    models = _KEPT_MODELS.get(key) or build_models(cfg, names, args.device, args.seed, baseline)
    if getattr(args, "keep_models", False):
        # one shape per process (gpu_check's groups): the next run reuses these models rather
        # than building and moving a dozen BERT-bases again (most of a GPU run's time); the
        # batches are new each run all the same
        _KEPT_MODELS[key] = models
    times, cpu_times, tokens, flops, other_cores, memory = time_alternating(
        {n: models[n] for n in names}, make_batch, step_flops, cfg, batch_size, seq_len, args,
        dtype)
    del models
    mean_tokens, mean_flops = statistics.mean(tokens), statistics.mean(flops)
    rows = []
    base = statistics.median(times["transformers"])
    base_cpu = statistics.median(cpu_times["transformers"])
    for name in names:
        t = statistics.median(times[name])
        cpu = statistics.median(cpu_times[name])
        rows.append(dict(
            preset=preset, batch_size=batch_size, seq_len=seq_len, dtype=dtype_name,
            model=name, median_step_s=t, step_times_s=times[name],
            median_cpu_s=cpu, cpu_times_s=cpu_times[name],
            tokens_per_s=mean_tokens / t, mean_real_tokens=mean_tokens,
            speedup_vs_transformers=base / t,
            cpu_speedup_vs_transformers=base_cpu / cpu,
            useful_tflops_per_step=mean_flops / 1e12,
            mfu=mean_flops / t / peaks[dtype_name],
            other_load_cores=other_cores, loadavg_1min_after=os.getloadavg()[0],
            **_memory_fields(memory[name]),
        ))
    return rows


def _memory_fields(memory) -> dict:
    if memory is None:
        return {}
    return dict(peak_step_memory_gib=round(memory[0], 3), alloc_retries=memory[1])


def parse_spec(spec: str, default_seq: int) -> tuple[str, int, int]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] not in PRESET_SIZES:
        sys.exit(f"error: --presets takes NAME:BATCH[:SEQ] with NAME one of "
                 f"{', '.join(PRESET_SIZES)}; got {spec!r}")
    try:
        numbers = [int(x) for x in parts[1:]]
    except ValueError:
        sys.exit(f"error: --presets {spec!r}: BATCH and SEQ must be integers")
    return parts[0], numbers[0], numbers[1] if len(numbers) == 2 else default_seq


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=None,
                   help="NAME:BATCH[:SEQ] (default CPU: bert_mini:32 bert_base:8 bert_mini:8:512 "
                        "bert_base:2:512; SEQ defaults to --seq-len)")
    p.add_argument("--dtypes", nargs="+", default=None, choices=["fp32", "bf16"],
                   help="default: fp32, and bf16 where the CPU has bf16 matrix instructions "
                        "(as trainer.mixed_precision=auto decides); bf16 on CUDA")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--runs", type=int, default=1,
                   help="repeat the whole measurement; the summary is the median over runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (CPU); 1 gives CPU-time ratios that hold up on "
                        "a machine shared with other jobs")
    p.add_argument("--variants", nargs="*", default=None, choices=[v for v in VARIANTS
                                                                    if v != "ours"],
                   help="also time our model with speed switches flipped: the names given, or "
                        "all of them")
    p.add_argument("--dropout", type=float, default=None,
                   help="dropout of both models (default: the preset's, 0.1); budget recipes "
                        "such as experiment=budget_mini train with 0")
    p.add_argument("--compile", action="store_true",
                   help="also time our model with impl.compile (its layers' dense blocks "
                        "compiled by inductor)")
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="also time our model as of git revision REV (its bert_pretrain/model/, "
                        "default settings), alternating with today's: a change against the "
                        "code before it")
    p.add_argument("--finetune", action="store_true",
                   help="also time a fine-tuning step (sequence classification, 2 labels): "
                        "ours against transformers' BertForSequenceClassification")
    p.add_argument("--compete", action="store_true",
                   help="after the quiet runs, one more run beside a busy single-threaded "
                        "process (a machine shared with another job)")
    p.add_argument("--system-malloc", action="store_true",
                   help="leave glibc's allocator as it is (bert-train keeps freed memory)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "model.json"))
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("error: --device cuda given but torch sees no CUDA device")
    specs = args.presets or (["bert_mini:128", "bert_base:64", "bert_base:16:512"] if cuda else
                             ["bert_mini:32", "bert_base:8", "bert_mini:8:512", "bert_base:2:512"])
    specs = [parse_spec(spec, args.seq_len) for spec in specs]
    dtypes, no_bf16 = _dtypes(args.dtypes, cuda)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 stays fp32 on both sides
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = not cuda and not args.system_malloc and keep_freed_memory()

    device_name = torch.cuda.get_device_name() if cuda else _cpu_name()
    print(f"device: {args.device} ({device_name}; bf16 units: {bf16_units() or 'none'}), "
          f"threads: {torch.get_num_threads()}, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, freed memory kept: {kept}, "
          f"torch {torch.__version__}")
    if no_bf16:
        print(f"bf16: not measured: {no_bf16}")
    runs = []
    args.keep_models = len(specs) * len(dtypes) == 1 and not args.finetune
    plan = [("quiet", i) for i in range(args.runs)] + ([("compete", 0)] if args.compete else [])
    for position, (kind, index) in enumerate(plan):
        args.batch_seed = args.seed + 1000 * position  # new shapes each run (time_alternating)
        competitor = start_competitor() if kind == "compete" else None
        try:
            # only the dtypes measured: an emulated bf16 2048^3 product takes ~a minute
            peaks = {d: matmul_peak(args.device, DTYPES[d]) for d in dtypes}
            print(f"run {index + 1} ({kind}): torch.mm 2048^3 "
                  + ", ".join(f"{d} {peak / 1e9:,.0f} GFLOP/s" for d, peak in peaks.items()),
                  flush=True)
            rows = []
            for preset, batch_size, seq_len in specs:
                for dtype_name in dtypes:
                    new = bench_one(preset, batch_size, seq_len, dtype_name, args, peaks)
                    if args.finetune:
                        new += bench_finetune_one(preset, batch_size, seq_len, dtype_name,
                                                  args, peaks)
                    _print_rows(new)
                    rows += new
        finally:
            if competitor is not None:
                competitor.kill()
                competitor.wait()
        runs.append(dict(kind=kind, matmul_peak_flops=peaks, results=rows))

    quiet = [r for r in runs if r["kind"] == "quiet"]
    summary = summarise(quiet)
    if len(quiet) > 1:
        print(f"\nmedian of {len(quiet)} runs (min-max):")
        _print_summary(summary)
    if no_bf16:
        print(f"(bf16 not measured: {no_bf16})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        device=args.device, device_name=device_name, bf16_units=bf16_units(),
        dtypes=dtypes, bf16_not_measured=no_bf16,
        threads=torch.get_num_threads(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        freed_memory_kept=kept, torch=torch.__version__, seq_len=args.seq_len,
        warmup=args.warmup, steps=args.steps, dropout=args.dropout, runs=runs,
        summary=summary), indent=2))
    print(f"wrote {out}")


def _dtypes(asked: list[str] | None, cuda: bool) -> tuple[list[str], str | None]:
    """(dtypes to measure, why bf16 is not among them or None).  On CPU, bf16 only where it
    has matrix units: elsewhere autocast emulates it, many times slower than fp32 (an AMD EPYC
    without AVX512 took 55 s for one bf16 2048^3 product, 0.35 s in fp32), and
    trainer.mixed_precision=auto trains in fp32 there."""
    if cuda:
        return asked or ["bf16"], None
    if bf16_units():
        return asked or ["fp32", "bf16"], None
    reason = no_bf16_units_reason()
    if asked and "bf16" in asked:
        sys.exit(f"error: --dtypes bf16: {reason}; measure fp32 here")
    return asked or ["fp32"], reason


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def summarise(runs: list[dict]) -> list[dict]:
    """Per (preset, batch, seq, dtype, model): median and min-max over runs of each run's
    median step time, tokens/s, speedup and MFU; the matmul peaks and other-process load too."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        for r in run["results"]:
            key = (r["preset"], r["batch_size"], r["seq_len"], r["dtype"], r["model"])
            groups.setdefault(key, []).append({**r, "peak": run["matmul_peak_flops"][r["dtype"]]})
    out = []
    for (preset, batch, seq, dtype, model), rows in groups.items():
        entry = dict(preset=preset, batch_size=batch, seq_len=seq, dtype=dtype, model=model,
                     runs=len(rows))
        entry.update(median_and_range(rows, ("median_step_s", "tokens_per_s",
                                             "speedup_vs_transformers", "mfu", "peak",
                                             "other_load_cores")))
        out.append(entry)
    return out


def _print_rows(rows: list[dict]) -> None:
    for r in rows:
        load = r.get("other_load_cores")
        print(f"{r['preset']:>11} b{r['batch_size']:<3} L{r['seq_len']:<4}{r['dtype']:>5} "
              f"{r['model']:>20}  step {r['median_step_s']:7.3f} s  {r['tokens_per_s']:8,.0f} "
              f"tok/s  x{r['speedup_vs_transformers']:5.2f}  MFU {100 * r['mfu']:5.1f}%  "
              f"(cpu x{r['cpu_speedup_vs_transformers']:4.2f}"
              f"{'' if load is None else f', other load {load:.2f} cores'}"
              f"{_memory_note(r)})", flush=True)


def _memory_note(r: dict) -> str:
    if "peak_step_memory_gib" not in r:
        return ""
    return (f", step peak {r['peak_step_memory_gib']:.1f} GiB"
            + (f", {r['alloc_retries']} allocator retries" if r["alloc_retries"] else ""))


def _print_summary(rows: list[dict]) -> None:
    for r in rows:
        lo, hi = r["speedup_vs_transformers_range"]
        tlo, thi = r["tokens_per_s_range"]
        print(f"{r['preset']:>11} b{r['batch_size']:<3} L{r['seq_len']:<4}{r['dtype']:>5} "
              f"{r['model']:>20}  {r['tokens_per_s']:8,.0f} tok/s ({tlo:,.0f}-{thi:,.0f})  "
              f"x{r['speedup_vs_transformers']:.2f} ({lo:.2f}-{hi:.2f})  "
              f"MFU {100 * r['mfu']:.0f}% of {r['peak'] / 1e9:,.0f} GFLOP/s", flush=True)


# --------------------------------------------------------------------------- fine-tuning step


def make_finetune_batch(batch_size: int, seq_len: int, vocab_size: int, gen: torch.Generator,
                        device: str) -> dict[str, torch.Tensor]:
    """Sentence pairs of lengths uniform in [seq_len/8, seq_len], padded to the longest."""
    lengths = torch.randint(max(4, seq_len // 8), seq_len + 1, (batch_size,), generator=gen)
    longest = int(lengths.max())
    pos = torch.arange(longest)
    mask = pos[None] < lengths[:, None]
    ids = torch.randint(5, vocab_size, (batch_size, longest), generator=gen).masked_fill(~mask, 0)
    ids[:, 0] = 2
    types = (pos[None] >= (lengths[:, None] // 2)) & mask
    labels = torch.randint(0, 2, (batch_size,), generator=gen)
    batch = dict(input_ids=ids, attention_mask=mask.long(), token_type_ids=types.long(),
                 labels=labels)
    return {k: v.to(device) for k, v in batch.items()}


def finetune_flops(cfg: BertConfig, batch: dict[str, torch.Tensor]) -> float:
    """Useful training FLOPs (3x forward) of a classification step: matmuls on real tokens,
    attention over real keys, pooler and classifier."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    lengths = batch["attention_mask"].sum(1).double()
    per_token = layers * 2 * (4 * h * h + 2 * h * inter)
    attention = layers * 2 * 2 * h * (lengths**2).sum().item()
    return 3.0 * (lengths.sum().item() * per_token + attention + len(lengths) * 2 * (h * h + 2 * h))


def bench_finetune_one(preset: str, batch_size: int, seq_len: int, dtype_name: str, args,
                       peaks) -> list[dict]:
    """One fine-tuning step (forward with the classification loss, backward, fused AdamW),
    ours-finetune against transformers-finetune, alternating step by step."""
    import transformers

    from bert_pretrain.model import BertForSequenceClassification

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    cfg = load_preset(preset, args.vocab_size)
    if args.dropout is not None:
        cfg = dataclasses.replace(cfg, hidden_dropout_prob=args.dropout,
                                  attention_probs_dropout_prob=args.dropout)
    torch.manual_seed(args.seed)
    ours = BertForSequenceClassification(cfg, 2, ModelImpl())
    hf_cfg = transformers.BertConfig(**{**cfg.to_hf_dict(), "num_labels": 2})
    theirs = transformers.BertForSequenceClassification._from_config(hf_cfg,
                                                                     attn_implementation="sdpa")
    theirs.load_state_dict(ours.hf_state_dict(), strict=True)
    candidates = [("ours-finetune", ours), ("transformers-finetune", theirs)]
    # the speed switches on the classifier too: its batches carry far more padding than
    # pretraining's, which is where unpadding and the length groups should pay
    for variant in variant_names(args, exclude=FINETUNE_IRRELEVANT):
        model = BertForSequenceClassification(
            cfg, 2, dataclasses.replace(ModelImpl(), **VARIANTS[variant]))
        model.load_state_dict(ours.state_dict(), strict=True)
        candidates.append((f"{variant}-finetune", model))
    models = {}
    for name, model in candidates:
        model.to(args.device).train()
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=3e-5, fused=True))
    times, cpu_times, tokens, flops, other, memory = time_alternating(
        models, make_finetune_batch, finetune_flops, cfg, batch_size, seq_len, args, dtype)
    base = statistics.median(times["transformers-finetune"])
    base_cpu = statistics.median(cpu_times["transformers-finetune"])
    return [dict(preset=preset, batch_size=batch_size, seq_len=seq_len, dtype=dtype_name,
                 model=name, median_step_s=statistics.median(t), step_times_s=t,
                 median_cpu_s=statistics.median(cpu_times[name]), cpu_times_s=cpu_times[name],
                 tokens_per_s=statistics.mean(tokens) / statistics.median(t),
                 speedup_vs_transformers=base / statistics.median(t),
                 cpu_speedup_vs_transformers=base_cpu / statistics.median(cpu_times[name]),
                 mfu=statistics.mean(flops) / statistics.median(t) / peaks[dtype_name],
                 other_load_cores=other, loadavg_1min_after=os.getloadavg()[0],
                 **_memory_fields(memory[name]))
            for name, t in times.items()]


if __name__ == "__main__":
    main()
