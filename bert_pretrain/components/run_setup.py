"""Set-up steps of a training run that need nothing of the trainer: the accelerator (with the
checks that keep N processes one run), the training data (checked against the model settings
and the process count), and the model (fresh, or a transformers BERT to continue from)."""

import hashlib
import json
import os
import socket

import torch

from .cpu_runtime import keep_freed_memory
from ..errors import ConfigError, DataError


def reset_accelerate_state() -> None:
    """Forget accelerate's per-process state before an Accelerator is built, so that each run
    in one process (tests, sweeps, bert-glue's fine-tunes) takes its own device settings.
    PartialState too, not only AcceleratorState: it caches the device, and a
    `trainer.cpu=true` run after a GPU run in the same process trained on the GPU (seen on an
    H100: tests/test_cuda.py). A process group that is already up is kept (PartialState
    joins it again)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def make_accelerator(tc):
    """(Accelerator, whether freed memory is kept) for trainer settings `tc`."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    env_accumulation = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    if env_accumulation.strip() not in ("", "1"):
        # accelerator.backward would divide every loss by it a second time.
        raise ConfigError(
            f"accelerate's gradient accumulation is set to {env_accumulation} (accelerate "
            f"launch --gradient_accumulation_steps or ACCELERATE_GRADIENT_ACCUMULATION_STEPS)"
            f"; bert-train accumulates itself: drop that setting and set "
            f"trainer.micro_batch_size (accumulation = global batch / (processes x micro))"
        )
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        # (a user's own accelerate config: the project ships none, and no engine it refuses)
        raise ConfigError(
            "accelerate is set up for DeepSpeed, which bert-train does not support; for "
            "sharded training use FSDP (conf/accelerate/fsdp.yaml, docs/multi-gpu.md), "
            "otherwise DDP (conf/accelerate/multi_gpu.yaml)")
    reset_accelerate_state()
    on_cpu = tc.cpu or not torch.cuda.is_available()
    keeps = on_cpu and tc.cpu_keep_freed_memory and keep_freed_memory()
    # Without CUDA, accelerate treats a torchrun / `accelerate launch --multi_gpu` process as
    # a lone process unless told cpu=True: N copies would each train alone into one run_dir.
    # Precision is ours (precision.py), not accelerate's: it has no loss scaling on CPU.
    # The group is joined first, with per-attempt keys and a finite timeout (process_group.py):
    # accelerate's own set-up breaks on a launcher's restart.
    from .process_group import join

    join("gloo" if on_cpu else "nccl", tc.process_group_timeout_s)
    acc = Accelerator(cpu=on_cpu, mixed_precision="no",
                      gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1))
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and acc.num_processes == 1:
        raise ConfigError(
            f"launched as {launched} processes but accelerate set up {acc.num_processes}; "
            f"check the launcher's device settings (e.g. trainer.cpu=true on CPU machines)"
        )
    if acc.distributed_type.name == "DEEPSPEED":
        # Checkpoints save the main process's full model/optimizer state: under ZeRO those
        # are shards, and the saved checkpoint would silently hold a fraction of it. (FSDP:
        # the trainer shards the model itself, components/sharding.py.)
        raise ConfigError(
            f"accelerate is set up for {acc.distributed_type.name}, which bert-train "
            f"does not support yet (its checkpoints would hold only one shard); launch with "
            f"DDP (conf/accelerate/multi_gpu.yaml or multi_node.yaml)"
        )
    return acc, keeps


DATA_KEY = "data.dir's manifest.json"  # (data.dir itself may differ between machines)
_UNSET = object()


def check_same_settings(resolved_config: dict, world: int, prog: str = "bert-train") -> None:
    """Every process of a launched job runs the same settings, or every one stops here, at
    start-up, in the same line.  A machine started with another override or a stale config
    file otherwise trained on: another optim.lr made DDP's replicas drift apart without a word
    (each applies the averaged gradient its own way; the checkpoint holds rank 0's), another
    trainer.max_steps left the others waiting in a collective for the process-group timeout,
    then ending as if a peer had died (both probed, two torchrun nodes).  data.dir may differ
    (a copy on each machine's own disk) but what it holds may not: its manifest.json (counts,
    shards, tokenizer hash, masking) is compared in its place; a folder without one is left
    to the data's own check."""
    if world <= 1:
        return
    import torch.distributed as dist

    mine = _comparable(resolved_config)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True, default=repr).encode()).hexdigest()
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    everyone = [None] * world
    dist.all_gather_object(everyone, (mine, socket.gethostname(),
                                      resolved_config.get("data", {}).get("dir")))
    message = _differences(everyone, prog)
    if message:
        raise ConfigError(message)


def _comparable(config: dict) -> dict:
    """`config` flattened to {'trainer.max_steps': 10, ...}, data.dir replaced by its
    manifest's sha256 (None: no manifest to read), torch's version and our code's digest."""
    flat = {}

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node
    walk(config, "")
    data_dir = flat.pop("data.dir", None)
    try:
        with open(os.path.join(str(data_dir), "manifest.json"), "rb") as f:
            flat[DATA_KEY] = hashlib.sha256(f.read()).hexdigest()
    except (OSError, TypeError):
        flat[DATA_KEY] = None
    flat["torch version"] = torch.__version__  # (another build: other sums, other kernels)
    flat["bert_pretrain's code"] = code_digest()  # (a machine whose checkout was not updated)
    return flat


def code_digest(root: str | None = None) -> str:
    """A short sha256 of the .py files of the package at `root` (this one by default): their
    paths in it and their bytes."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def _differences(everyone: list, prog: str = "bert-train") -> str:
    """The line that names the first rank whose settings differ from rank 0's, and how ('' when
    only a missing manifest differs: the data's own check says more)."""
    reference, host0, dir0 = everyone[0]
    differing = []
    for rank, (settings, host, data_dir) in enumerate(everyone[1:], start=1):
        keys = [key for key in sorted(set(reference) | set(settings))
                if settings.get(key, _UNSET) != reference.get(key, _UNSET)
                and not (key == DATA_KEY and None in (settings.get(key), reference.get(key)))]
        if keys:
            differing.append((rank, host, data_dir, keys, settings))
    if not differing:
        return ""
    rank, host, data_dir, keys, settings = differing[0]

    def shown(key, values, folder):
        value = values.get(key, _UNSET)
        if key == DATA_KEY:
            return f"{folder} (sha256 {value[:12]})"
        return "unset" if value is _UNSET else str(value)
    what = "; ".join(f"{key}: {shown(key, settings, data_dir)} there, "
                     f"{shown(key, reference, dir0)} on rank 0" for key in keys[:3])
    more = f" (and {len(keys) - 3} more settings)" if len(keys) > 3 else ""
    others = f" and {len(differing) - 1} other rank(s)" if len(differing) > 1 else ""
    hosts = (f" on {host}", f" on {host0}") if host != host0 else ("", "")
    return (f"rank {rank}{hosts[0]}{others} runs other settings than rank 0{hosts[1]}: {what}"
            f"{more}; every process of a job must run the same {prog} command (the same "
            f"overrides, config files and prepared data on every machine)")


def check_shared_run_dir(run_dir: str, stamp: str, world: int) -> None:
    """Every process sees the run folder rank 0 locked (`stamp`: the token rank 0 wrote into its
    lock file), or every one stops here in one line.  Each process writes its part of every
    checkpoint into it (its RNG state; its shards, sharded): a run_dir on each machine's own disk
    failed at the first save, maybe hours in, with a traceback on the other machines ('Parent
    directory .../.tmp-step-00000002 does not exist'; probed, a process in a mount namespace
    of its own)."""
    if world <= 1:
        return
    import torch.distributed as dist

    from .folder_lock import sees_stamp

    seen = [None] * world
    dist.all_gather_object(seen, (sees_stamp(run_dir, stamp), socket.gethostname()))
    blind = [rank for rank, (sees, _) in enumerate(seen) if not sees]
    if blind:
        host, host0 = seen[blind[0]][1], seen[0][1]
        where = (f" on {host}", f" on {host0}") if host != host0 else ("", "")
        others = f" and {len(blind) - 1} other rank(s)" if len(blind) > 1 else ""
        raise ConfigError(
            f"run_dir {run_dir} is not one folder for every process: rank {blind[0]}{where[0]}"
            f"{others} does not see the folder rank 0{where[1]} locked there; every process "
            f"writes its part of each checkpoint into it, so put run_dir on storage every "
            f"machine mounts at the same path (NFS, Lustre, a shared disk)")


def open_training_data(s, world: int, rank: int, device_type: str = "cpu", warn=None):
    """(PreparedData, TrainStream) for settings `s` on this process (on `device_type`); `warn`
    reports a lost prefetching worker (TrainStream)."""
    from .data import PreparedData, TrainStream

    tc = s.trainer
    data = PreparedData(s.data.dir)
    if s.model.get("vocab_size") not in (None, data.vocab_size):
        raise DataError(
            f"model.vocab_size={s.model['vocab_size']} but the data in {s.data.dir} was "
            f"tokenized with a {data.vocab_size}-token vocabulary; set model.vocab_size=null "
            f"(take it from the data) or prepare the data with the matching tokenizer"
        )
    pad = data.special.get("pad", 0)
    if s.model.get("pad_token_id") not in (None, pad):
        raise DataError(
            f"model.pad_token_id={s.model['pad_token_id']} but [PAD] is token {pad} in the "
            f"data's tokenizer ({s.data.dir}); set model.pad_token_id=null (take it from "
            f"the data)"
        )
    if tc.global_batch_size < world:
        raise ConfigError(
            f"trainer.global_batch_size={tc.global_batch_size} is smaller than the number of "
            f"processes ({world}): every process needs at least one sample per step; "
            f"raise it to a multiple of {world} or launch fewer processes")
    # (during a batch warmup the micro-batch must divide its smallest batch: its start)
    smallest = s.data.batch_warmup_start or tc.global_batch_size
    if tc.micro_batch_size is None and smallest % world:
        what = "trainer.global_batch_size" if smallest == tc.global_batch_size \
            else "data.batch_warmup_start"
        raise ConfigError(
            f"{what}={smallest} does not split over the {world} processes; make it a multiple "
            f"of {world} (e.g. {-(-smallest // world) * world}) or launch a number of processes "
            f"that divides it")
    micro = tc.micro_batch_size or smallest // world
    return data, TrainStream(data, s.data, s.seed, tc.global_batch_size, micro, world, rank,
                             prefetch=tc.prefetches(device_type), warn=warn)


def build_model(s, data):
    """(BertConfig, BertForPreTraining, transformers state dict or None, notes to print): the
    model of settings `s` for `data`, seeded, or the transformers BERT trainer.init_from names
    (its config.json is then the model)."""
    from accelerate.utils import set_seed

    from .hf_import import import_for_training, is_hf_model_dir
    from ..model import BertConfig, BertForPreTraining, ModelImpl

    init_from = s.trainer.init_from
    hf_state, notes = None, []
    # An NSP head needs NSP labels; null takes it from the data (MLM-only data: no NSP head).
    nsp = data.next_sentence_prediction(s.model.get("next_sentence_prediction"))
    try:
        if init_from and os.path.isdir(init_from) and is_hf_model_dir(init_from):
            model_values, hf_state, notes = import_for_training(init_from, data, s.seed, nsp)
        else:
            model_values = {**s.model, "vocab_size": data.vocab_size,
                            "pad_token_id": data.special.get("pad", 0),
                            "next_sentence_prediction": nsp}
        config = BertConfig.from_dict(model_values)
        impl = ModelImpl.from_dict(s.impl)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if data.max_seq_length > config.max_position_embeddings:
        raise DataError(
            f"the data's max_seq_length ({data.max_seq_length}) exceeds "
            f"model.max_position_embeddings ({config.max_position_embeddings}); "
            f"raise it or prepare shorter sequences"
        )
    if config.type_vocab_size < 2 and data.has_nsp:
        raise ConfigError(
            f"model.type_vocab_size={config.type_vocab_size}, but the data's instances are "
            f"sentence pairs for next-sentence prediction (token types 0 and 1); set "
            f"model.type_vocab_size=2")
    set_seed(s.seed)  # model init is a function of the seed alone
    return config, BertForPreTraining(config, impl), hf_state, notes
