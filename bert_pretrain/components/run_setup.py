"""Set-up steps of a training run that need nothing of the trainer: the accelerator (with the
checks that keep N processes one run), the training data (checked against the model settings
and the process count), and the model (fresh, or a transformers BERT to continue from)."""

import os

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
