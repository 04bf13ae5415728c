"""Sharded training (FSDP2): which runs shard, how the model is cut into shard units, and the
few places where a sharded model needs other arithmetic than a replicated one.

bert-train shards with `torch.distributed.fsdp.fully_shard` itself, as torchtitan does: one
shard unit per encoder layer, then the root (embeddings, pooler and heads, with the MLM decoder
tied to the word embeddings in the same unit, so they stay one parameter).  accelerate still
launches the processes, joins them and places the model on its device, but never wraps it:
accelerate's own FSDP path runs on GPUs only (on CPU it quietly trains plain DDP), so a run that
let accelerate shard would test one thing on CPU and ship another.  The code that shards is the
same on CPU (gloo) and on GPUs (NCCL).

Every parameter becomes a DTensor sharded on dim 0 over the processes (each holds 1/N of every
tensor); gradients are reduce-scattered (averaged over processes, as DDP's all-reduce) and the
optimizer state is built on the shards, so parameters, gradients and optimizer state each take
1/N of the memory per process.  The loss arithmetic (trainer.py) is unchanged.

A run shards when `trainer.sharding=fsdp`, or with `trainer.sharding=auto` (the default) when
it was launched with accelerate's FSDP config (`conf/accelerate/fsdp.yaml`: accelerate hands the
processes ACCELERATE_USE_FSDP=true).
"""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError

def launcher_wants_fsdp() -> bool:
    """Whether `accelerate launch` was given an FSDP config (it exports this to every process)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").strip().lower() in ("1", "true", "yes")


def resolve_sharding(setting: str, world: int) -> bool:
    """Whether this run shards its model (trainer.sharding, the launcher's config)."""
    if setting == "ddp" and launcher_wants_fsdp():
        raise ConfigError(
            "trainer.sharding=ddp, but accelerate was launched with an FSDP config "
            "(ACCELERATE_USE_FSDP=true); drop trainer.sharding=ddp to shard, or launch with "
            "conf/accelerate/multi_gpu.yaml for DDP")
    return setting == "fsdp" or (setting == "auto" and launcher_wants_fsdp())


def reshard_after_forward() -> bool:
    """FSDP_RESHARD_AFTER_FORWARD from accelerate's config (default true: free each layer's
    gathered parameters after its forward, gather again for backward; false keeps them between
    forward and backward, faster, more memory)."""
    value = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip().lower()
    return value not in ("0", "false", "no")


def shard_model(model: torch.nn.Module, device: torch.device, world: int) -> str:
    """Apply FSDP2 to `model` (already on `device`) in place: each encoder layer, then the root.
    Returns the layout for the start-up line."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    reshard = reshard_after_forward()
    layers = list(model.bert.encoder.layer)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    # The root unit: embeddings, pooler, heads. Not resharded after forward: backward needs it
    # first, straight away (torchtitan does the same).
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    decoder = model.cls.predictions.decoder.weight
    if decoder is not model.bert.embeddings.word_embeddings.weight:
        raise AssertionError("sharding untied the MLM decoder from the word embeddings")
    return (f"FSDP2 over {world} process(es): {len(layers) + 1} shard units ({len(layers)} "
            f"encoder layers + root: embeddings, pooler, heads; MLM decoder tied to the word "
            f"embeddings); parameters, gradients and optimizer state sharded on dim 0, "
            f"1/{world} per process")


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_value(x) -> torch.Tensor:
    """A DTensor's whole value (a norm is Partial until reduced); a tensor as it is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor; a tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def all_finite(model: torch.nn.Module, world: int) -> bool:
    """Whether every weight of `model` is finite, on every process (each checks its shards)."""
    bad = torch.tensor([0.0], device=next(model.parameters()).device)
    for p in model.parameters():
        if not torch.isfinite(local(p.detach())).all():
            bad += 1
            break
    if world > 1 and is_sharded(model):
        import torch.distributed as dist

        dist.all_reduce(bad)
    return bad.item() == 0


def eval_forward_passes(num_instances: int, batch_size: int, world: int) -> int:
    """Forward passes every process makes in a sharded evaluation: the most any process gets.
    Each forward gathers every unit's parameters from all processes, so a process that ran out
    of held-out batches must keep taking part (with a pass whose result it drops) or the others
    wait for it forever."""
    per_round = batch_size * world
    return -(-num_instances // per_round)


def ensure_process_group(device: torch.device) -> bool:
    """FSDP needs a process group even for one process (one GPU); accelerate creates none then.
    Returns whether one was created here (the trainer destroys it at the end)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.HashStore(), rank=0, world_size=1)
    return True


def gather_objects(obj) -> list:
    """Every process's `obj`, in rank order (small objects: checksums of the files it wrote)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
