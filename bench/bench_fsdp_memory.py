"""Per-process model state under FSDP2 against DDP: parameter, gradient and optimizer bytes that
one process holds after a training step, measured on CPU over gloo with the trainer's own
sharding (components/sharding.py) and optimizer (components/optim.py).

    python bench/bench_fsdp_memory.py                      # BERT-base: DDP@2, FSDP2@2, FSDP2@4
    python bench/bench_fsdp_memory.py --model bert_large --layouts fsdp:4
    # table on stdout, bench/results/fsdp_memory.json

Each layout runs as real processes (torch.multiprocessing, gloo): the model is built whole on
every process, as bert-train builds it, then wrapped in DDP or sharded; one forward, backward
and AdamW step on a small batch creates the gradients and the optimizer state; then each
process counts the bytes of its own tensors (a DTensor's local shard, a tensor whole) and its
peak resident memory (which includes the whole model built before sharding, the Python
runtime and the step's activations). The figures are the largest over the processes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = {  # the shapes of conf/train/model/<name>.yaml
    "bert_base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072),
    "bert_large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                       intermediate_size=4096),
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,  # for its test
                 intermediate_size=64),
}


def _bytes(t) -> int:
    from bert_pretrain.components.sharding import local

    t = local(t)
    return t.numel() * t.element_size()


def worker(rank: int, world: int, port: int, layout: str, model_name: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from bert_pretrain.components.optim import OptimConfig, build_optimizer
    from bert_pretrain.components.sharding import shard_model
    from bert_pretrain.model import BertConfig, BertForPreTraining

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(vocab_size=30522, max_position_embeddings=512,
                                          **MODELS[model_name]))
    if layout == "fsdp":
        shard_model(model, torch.device("cpu"), world)
        trained = model
    else:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = build_optimizer(OptimConfig(), model.named_parameters())
    ids = torch.randint(5, 30522, (2, 32), generator=torch.Generator().manual_seed(rank))
    out_ = trained(input_ids=ids, labels=ids, next_sentence_label=torch.zeros(2, dtype=torch.long))
    (out_.mlm_loss + out_.nsp_loss).backward()
    optimizer.step()
    params = sum(_bytes(p) for p in model.parameters())
    grads = sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(_bytes(v) for s in optimizer.state.values() for v in s.values()
                if torch.is_tensor(v))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    with open(f"{out}.{rank}", "w") as f:
        json.dump(dict(params=params, grads=grads, optimizer=state, peak_rss=peak,
                       num_parameters=sum(p.numel() for p in model.parameters())), f)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(layout: str, world: int, model_name: str, scratch: Path) -> dict:
    import torch.multiprocessing as mp

    out = str(scratch / f"{layout}-{world}")
    mp.spawn(worker, args=(world, free_port(), layout, model_name, out), nprocs=world)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    row = {k: max(r[k] for r in ranks) for k in ("params", "grads", "optimizer", "peak_rss")}
    row.update(layout=layout, processes=world, num_parameters=ranks[0]["num_parameters"],
               model_state=row["params"] + row["grads"] + row["optimizer"])
    return row


def main(argv=None) -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="bert_base")
    p.add_argument("--layouts", default="ddp:2,fsdp:2,fsdp:4",
                   help="comma-separated layout:processes (layout: ddp or fsdp)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "fsdp_memory.json"))
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for item in args.layouts.split(","):
            layout, world = item.split(":")
            rows.append(measure(layout, int(world), args.model, Path(scratch)))
    ddp = next((r["model_state"] for r in rows if r["layout"] == "ddp"), None)
    mib = 1 << 20
    print(f"{args.model}: {rows[0]['num_parameters'] / 1e6:.1f}M parameters, fp32 weights, "
          f"AdamW; bytes one process holds after a step (largest over the processes)")
    print(f"{'layout':<10}{'procs':>6}{'params MiB':>12}{'grads MiB':>11}{'optim MiB':>11}"
          f"{'state MiB':>11}{'vs DDP':>8}{'peak RSS MiB':>14}")
    for r in rows:
        share = f"{r['model_state'] / ddp:.0%}" if ddp else "-"
        r["share_of_ddp"] = r["model_state"] / ddp if ddp else None
        print(f"{r['layout']:<10}{r['processes']:>6}{r['params'] / mib:>12.0f}"
              f"{r['grads'] / mib:>11.0f}{r['optimizer'] / mib:>11.0f}"
              f"{r['model_state'] / mib:>11.0f}{share:>8}{r['peak_rss'] / mib:>14.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    out.write_text(json.dumps(dict(model=args.model, torch=torch.__version__, rows=rows),
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
