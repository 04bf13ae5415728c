"""Training-step throughput: our BertForPreTraining against transformers' (sdpa), same batches.

One step = forward with MLM + NSP losses, backward, fused AdamW step.  Both models start from the
same weights and see the same batches (seq 128, ~15% of real tokens labelled, half of each batch
padded to a random length in [64, 128]); the models alternate step by step in one process, so
the load other processes put on the machine hits both alike.  Reported: median step time after
warm-up, real (non-padding) tokens per second, speedup, and model FLOPs utilisation (MFU) of the
useful work (real tokens, labelled positions) against this machine's torch.mm peak measured in
the same run.  Process CPU time per step is recorded too: with `--threads 1` its ratios barely
move when other jobs share the machine, unlike wall-clock ones.

    python bench/bench_model.py                             # CPU: BERT-mini (32), BERT-base (8)
    python bench/bench_model.py --presets bert_tiny:32 bert_small:32 --steps 3
    python bench/bench_model.py --device cuda               # GPU: bf16 autocast, fused attention
    python bench/bench_model.py --variants                  # also time our speed switches off
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bert_pretrain.model import BertConfig, BertForPreTraining, ModelImpl  # noqa: E402

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
    "ours-fused-qkv": {"fused_qkv": True},
    "ours-no-fast-dropout": {"fast_dropout": False},
    "ours-no-sparse-last": {"sparse_last_layer": False},
    "ours-no-sparse": {"sparse_prediction": False},
}


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


def matmul_peak(device: str, dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of torch.mm on n x n matrices (median of `reps`)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def build_models(cfg: BertConfig, names: list[str], device: str, seed: int):
    import transformers

    torch.manual_seed(seed)
    reference = BertForPreTraining(cfg, ModelImpl())
    weights = reference.state_dict()
    models = {}
    for name in names:
        if name == "transformers":
            hf_cfg = transformers.BertConfig(**cfg.to_hf_dict())
            model = transformers.BertForPreTraining._from_config(hf_cfg, attn_implementation="sdpa")
        else:
            model = BertForPreTraining(cfg, dataclasses.replace(ModelImpl(), **VARIANTS[name]))
        model.load_state_dict(weights, strict=True)
        model.to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        models[name] = (model, opt)
    return models


def train_step(model, opt, batch, device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one training step."""
    sync(device)
    t, c = time.perf_counter(), time.process_time()
    with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
        out = model(**batch)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - t, time.process_time() - c


def bench_one(preset: str, batch_size: int, dtype_name: str, args, peaks) -> list[dict]:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    cfg = load_preset(preset, args.vocab_size)
    names = ["ours", "transformers"]
    if args.variants:
        names += [v for v in VARIANTS if v != "ours"]  # one at a time off (or on) from default
    models = build_models(cfg, names, args.device, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    times = {n: [] for n in names}
    cpu_times = {n: [] for n in names}
    tokens, flops = [], []
    for step in range(args.warmup + args.steps):
        batch = make_batch(batch_size, args.seq_len, cfg.vocab_size, gen, args.device)
        order = names if step % 2 == 0 else names[::-1]  # alternate who goes first
        for name in order:
            model, opt = models[name]
            elapsed, cpu = train_step(model, opt, batch, args.device, dtype)
            if step >= args.warmup:
                times[name].append(elapsed)
                cpu_times[name].append(cpu)
        if step >= args.warmup:
            tokens.append(batch["attention_mask"].sum().item())
            flops.append(step_flops(cfg, batch))
    del models
    mean_tokens, mean_flops = statistics.mean(tokens), statistics.mean(flops)
    rows = []
    base = statistics.median(times["transformers"])
    base_cpu = statistics.median(cpu_times["transformers"])
    for name in names:
        t = statistics.median(times[name])
        cpu = statistics.median(cpu_times[name])
        rows.append(dict(
            preset=preset, batch_size=batch_size, seq_len=args.seq_len, dtype=dtype_name,
            model=name, median_step_s=t, step_times_s=times[name],
            median_cpu_s=cpu, cpu_times_s=cpu_times[name],
            tokens_per_s=mean_tokens / t, speedup_vs_transformers=base / t,
            cpu_speedup_vs_transformers=base_cpu / cpu,
            useful_tflops_per_step=mean_flops / 1e12,
            mfu=mean_flops / t / peaks[dtype_name],
        ))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=None,
                   help="NAME:BATCH pairs (default: bert_mini:32 bert_base:8)")
    p.add_argument("--dtypes", nargs="+", default=None, choices=["fp32", "bf16"],
                   help="default: fp32 bf16 on CPU, bf16 on CUDA")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (CPU); 1 gives CPU-time ratios that hold up on "
                        "a machine shared with other jobs")
    p.add_argument("--variants", action="store_true",
                   help="also time our model with each speed switch turned off")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "model.json"))
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("error: --device cuda given but torch sees no CUDA device")
    presets = args.presets or (["bert_mini:128", "bert_base:64"] if cuda
                               else ["bert_mini:32", "bert_base:8"])
    dtypes = args.dtypes or (["bf16"] if cuda else ["fp32", "bf16"])
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 stays fp32 on both sides
    if args.threads:
        torch.set_num_threads(args.threads)

    peaks = {"fp32": matmul_peak(args.device, torch.float32),
             "bf16": matmul_peak(args.device, torch.bfloat16)}
    device_name = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    print(f"device: {args.device} ({device_name}), threads: {torch.get_num_threads()}, "
          f"torch {torch.__version__}")
    print(f"torch.mm 2048^3 peak: fp32 {peaks['fp32'] / 1e9:,.0f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:,.0f} GFLOP/s")

    rows = []
    for spec in presets:
        preset, batch_size = spec.split(":")
        for dtype_name in dtypes:
            rows += bench_one(preset, int(batch_size), dtype_name, args, peaks)
            _print_rows([r for r in rows if r["preset"] == preset and r["dtype"] == dtype_name])

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        device=args.device, device_name=device_name, threads=torch.get_num_threads(),
        torch=torch.__version__, matmul_peak_flops=peaks, seq_len=args.seq_len,
        warmup=args.warmup, steps=args.steps, results=rows), indent=2))
    print(f"wrote {out}")


def _print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['preset']:>11} b{r['batch_size']:<3} {r['dtype']:>4} {r['model']:>18}  "
              f"step {r['median_step_s']:7.3f} s  {r['tokens_per_s']:9,.0f} tok/s  "
              f"x{r['speedup_vs_transformers']:5.2f}  MFU {100 * r['mfu']:5.1f}%  "
              f"(cpu {r['median_cpu_s']:6.2f} s, x{r['cpu_speedup_vs_transformers']:4.2f})",
              flush=True)


if __name__ == "__main__":
    main()
