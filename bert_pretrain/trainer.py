"""The pretraining loop: `train(settings)` reads top to bottom.

setup (accelerate, data, model, resume) -> loop (lr, micro-batches with accumulation, clip, step,
log, eval, checkpoint, preemption) -> final eval and checkpoint -> returns the held-out MLM loss.
"""

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from .errors import CheckpointError, ConfigError, DataError, TrainingError

MIXED_PRECISION = ("no", "bf16", "fp16")


@dataclass
class TrainerConfig:
    """`conf/trainer/`: how long and in what batches to train, and when to evaluate and save."""

    max_steps: int = 1000
    """Optimizer steps (an upper bound in budget mode)."""
    warmup_steps: int = 0
    """Linear warmup length in optimizer steps."""
    budget_hours: Optional[float] = None
    """Wall-clock budget: the lr schedule follows elapsed/budget and training stops when it is
    spent (evaluation and checkpoint time excluded). null = step mode."""
    global_batch_size: int = 32
    """Samples per optimizer step over all processes."""
    micro_batch_size: Optional[int] = None
    """Samples per forward/backward on one process; null = global / world (no accumulation).
    Accumulation steps = global / (world x micro)."""
    mixed_precision: str = "no"
    """no, bf16, or fp16 (with dynamic loss scaling: steps with inf/nan gradients are skipped)."""
    max_grad_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this; null = no clipping."""
    log_every: int = 10
    eval_every: int = 0
    """Evaluate on the held-out split every N steps (0 = only at the end)."""
    eval_max_samples: Optional[int] = None
    """Evaluate on at most this many held-out instances (null = all)."""
    eval_batch_size: Optional[int] = None
    """null = micro_batch_size."""
    checkpoint_every: int = 1000
    keep_last_k: int = 3
    max_nonfinite_steps: int = 10
    """Stop after this many consecutive non-finite losses (the step is skipped each time)."""
    init_from: Optional[str] = None
    """A checkpoint directory to take the weights from (phase 2): fresh optimizer, schedule
    and data position."""
    progress_bar: bool = True
    cpu: bool = False
    """Train on CPU even when a GPU is present."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "global_batch_size", "log_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "keep_last_k", "max_nonfinite_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError("trainer.micro_batch_size must be >= 1 or null")
        if self.budget_hours is not None and self.budget_hours <= 0:
            raise ValueError("trainer.budget_hours must be > 0 or null")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"trainer.mixed_precision must be one of "
                             f"{', '.join(MIXED_PRECISION)}, got {self.mixed_precision!r}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError("trainer.max_grad_norm must be > 0 or null")
        if self.warmup_steps >= self.max_steps and self.budget_hours is None:
            raise ValueError(f"trainer.warmup_steps ({self.warmup_steps}) must be below "
                             f"trainer.max_steps ({self.max_steps})")


def dropout_seed(seed: int, step: int, micro_index: int) -> int:
    """A seed per (step, global micro-batch): dropout masks do not depend on the world size or
    on what ran before, so resumes and N-process runs reproduce single-process runs."""
    from .data import hash_uniform

    return int(hash_uniform(seed, 4, np.int64(step), np.int64(micro_index), np.int64(0))
               * (1 << 53))


class StopRequest:
    """SIGTERM/SIGINT (preemption, Ctrl-C): finish the step, save, exit cleanly. A second SIGINT
    interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some launchers): no handler
                pass

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _model_inputs(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "num_tokens"}


@torch.no_grad()
def evaluate(model, accelerator, batches) -> dict:
    """Token-weighted MLM loss/accuracy and NSP loss/accuracy over the held-out batches."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(6, dtype=torch.float64, device=accelerator.device)
    for batch in batches:
        inputs = _model_inputs(batch, accelerator.device)
        with accelerator.autocast():
            out = model(**inputs)
        if out.mlm_labels is not None:  # sparse: rows are the labelled positions
            logits, labels = out.prediction_logits, out.mlm_labels
        else:
            labels = inputs["labels"].reshape(-1)
            keep = labels != -100
            logits = out.prediction_logits.reshape(labels.shape[0], -1)[keep]
            labels = labels[keep]
        nsp_logits, nsp_labels = out.seq_relationship_logits, inputs["next_sentence_label"]
        sums += torch.stack([
            F.cross_entropy(logits.float(), labels, reduction="sum").double(),
            (logits.argmax(-1) == labels).sum().double(),
            torch.tensor(labels.numel(), dtype=torch.float64, device=sums.device),
            F.cross_entropy(nsp_logits.float(), nsp_labels, reduction="sum").double(),
            (nsp_logits.argmax(-1) == nsp_labels).sum().double(),
            torch.tensor(nsp_labels.numel(), dtype=torch.float64, device=sums.device),
        ])
    sums = accelerator.reduce(sums, reduction="sum")
    model.train(was_training)
    mlm_n, nsp_n = max(sums[2].item(), 1.0), max(sums[5].item(), 1.0)
    return {"eval_mlm_loss": sums[0].item() / mlm_n, "eval_mlm_accuracy": sums[1].item() / mlm_n,
            "eval_nsp_loss": sums[3].item() / nsp_n, "eval_nsp_accuracy": sums[4].item() / nsp_n}


def majority_baseline(data, split_name: str) -> float:
    """MLM accuracy of always predicting the most frequent masked token of the held-out split:
    the bar a model must clear to have learned anything beyond unigram frequencies."""
    shards = data.split(split_name).shards
    labels = [shard["masked_labels"][shard["masked_positions"][:] > 0] for shard in shards]
    counts = np.bincount(np.concatenate(labels).astype(np.int64))
    return float(counts.max() / max(counts.sum(), 1))


def _find_resume(resume: str, run_dir: str) -> Optional[str]:
    from .checkpoint import latest_checkpoint, list_checkpoints

    if resume == "never":
        if list_checkpoints(run_dir):
            raise ConfigError(
                f"{run_dir} already has checkpoints; continue it with resume=auto, or choose "
                f"another run_dir (or name=...) for a fresh run"
            )
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    if not os.path.isdir(resume):
        raise CheckpointError(f"resume={resume}: no such checkpoint directory; use resume=auto "
                              f"or a <run_dir>/checkpoints/step-XXXXXXXX path")
    return resume


def train(s, resolved_config: dict, config_yaml: str) -> float:
    """Run pretraining as configured by `s` (config.Settings); returns the final eval MLM loss."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from . import checkpoint as ckpt
    from .data import PreparedData, TrainStream, eval_batches
    from .metrics import Metrics, NullMetrics, eval_record_at
    from .model import BertConfig, BertForPreTraining, ModelImpl
    from .optim import Schedule, build_optimizer, set_lr

    tc = s.trainer
    # ---------------------------------------------------------------- setup
    AcceleratorState._reset_state()  # several runs in one process (tests, sweeps)
    # Without CUDA, accelerate treats a torchrun / `accelerate launch --multi_gpu` process as a
    # lone process unless told cpu=True: N copies would each train alone into the same run_dir.
    accelerator = Accelerator(cpu=tc.cpu or not torch.cuda.is_available(),
                              mixed_precision=tc.mixed_precision)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes == 1:
        raise ConfigError(
            f"launched as {launched} processes but accelerate set up {accelerator.num_processes}; "
            f"check the launcher's device settings (e.g. trainer.cpu=true on CPU machines)"
        )
    if accelerator.distributed_type.name in ("FSDP", "DEEPSPEED"):
        # Checkpoints save the main process's full model/optimizer state: under FSDP/ZeRO those
        # are shards, and the saved checkpoint would silently hold a fraction of the run.
        raise ConfigError(
            f"accelerate is set up for {accelerator.distributed_type.name}, which bert-train "
            f"does not support yet (its checkpoints would hold only one shard); launch with DDP "
            f"(conf/accelerate/multi_gpu.yaml or multi_node.yaml)"
        )
    world, rank, main = accelerator.num_processes, accelerator.process_index, \
        accelerator.is_main_process
    data = PreparedData(s.data.dir)
    if s.model.get("vocab_size") not in (None, data.vocab_size):
        raise DataError(
            f"model.vocab_size={s.model['vocab_size']} but the data in {s.data.dir} was "
            f"tokenized with a {data.vocab_size}-token vocabulary; set model.vocab_size=null "
            f"(take it from the data) or prepare the data with the matching tokenizer"
        )
    try:
        model_cfg = BertConfig.from_dict(s.model, vocab_size=data.vocab_size)
        impl = ModelImpl.from_dict(s.impl)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if data.max_seq_length > model_cfg.max_position_embeddings:
        raise DataError(
            f"the data's max_seq_length ({data.max_seq_length}) exceeds "
            f"model.max_position_embeddings ({model_cfg.max_position_embeddings}); raise it or "
            f"prepare shorter sequences"
        )
    micro = tc.micro_batch_size or tc.global_batch_size // world
    stream = TrainStream(data, s.data, s.seed, tc.global_batch_size, micro, world, rank)
    data.split(s.data.eval_split)  # fail now, not at the first evaluation
    accumulation = stream.accumulation_steps

    run_dir = s.run_dir
    if main:
        os.makedirs(run_dir, exist_ok=True)
        ckpt.clean_partial(run_dir)
    resume_path = _find_resume(s.resume, run_dir)
    set_seed(s.seed)  # model init is a function of the seed alone
    model = BertForPreTraining(model_cfg, impl)
    state = {"step": 0, "tokens_seen": 0, "samples_consumed": 0, "elapsed_seconds": 0.0}
    source = resume_path or tc.init_from
    if source:
        saved = ckpt.read_train_state(source)
        ckpt.check_compatible(source, saved, model_cfg.to_dict(), data.tokenizer_sha256)
        ckpt.load_weights(source, model)
        if resume_path:
            state.update({k: saved[k] for k in state})
    optimizer = build_optimizer(s.optim, model.named_parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    unwrapped = accelerator.unwrap_model(model)
    schedule = Schedule(s.scheduler, tc.max_steps, tc.warmup_steps,
                        tc.budget_hours * 3600 if tc.budget_hours else None)
    if resume_path:
        opt_state, extra, rng = ckpt.load_states(resume_path, rank)
        optimizer.load_state_dict(opt_state)
        schedule.load_state_dict(extra["schedule"])
        if accelerator.scaler is not None and extra.get("scaler"):
            accelerator.scaler.load_state_dict(extra["scaler"])
        if rng is not None:
            ckpt.set_rng_state(rng)
    step, tokens_seen, elapsed = state["step"], state["tokens_seen"], state["elapsed_seconds"]
    stream.position.samples_consumed = state["samples_consumed"]

    last_eval = None
    if resume_path:
        logged = eval_record_at(run_dir, step)
        last_eval = (step, logged) if logged else None
        accelerator.wait_for_everyone()  # every rank has read metrics.jsonl before it changes
    metrics = (Metrics(s.logger, run_dir, s.name, resolved_config,
                       step if resume_path else None) if main else NullMetrics())
    if main:
        print(f"bert-train: {model_cfg.num_hidden_layers} layers x {model_cfg.hidden_size}, "
              f"{sum(p.numel() for p in unwrapped.parameters()) / 1e6:.1f}M parameters; "
              f"{stream.split.num_instances} training instances; {world} process(es), global "
              f"batch {tc.global_batch_size} = {world} x {micro} x {accumulation} accumulation; "
              f"run_dir {run_dir}"
              + (f"; resumed from {resume_path}" if resume_path else ""), flush=True)

    def save() -> str:
        return ckpt.save_checkpoint(
            run_dir, step, model=unwrapped, optimizer_state=optimizer.state_dict(),
            extra_state={"schedule": schedule.state_dict(),
                         "scaler": accelerator.scaler.state_dict() if accelerator.scaler else None},
            train_state={"tokens_seen": tokens_seen, "samples_consumed":
                         stream.position.samples_consumed, "elapsed_seconds": elapsed,
                         "epoch": stream.epoch, "world_size": world,
                         "global_batch_size": tc.global_batch_size,
                         "model_config": model_cfg.to_dict(),
                         "tokenizer_sha256": data.tokenizer_sha256},
            config_yaml=config_yaml, tokenizer_dir=data.tokenizer_dir,
            keep_last_k=tc.keep_last_k, rank=rank, barrier=accelerator.wait_for_everyone)

    def run_eval() -> dict:
        result = evaluate(unwrapped, accelerator, eval_batches(
            data, s.data, tc.eval_batch_size or micro, world, rank, tc.eval_max_samples))
        metrics.log({"step": step, **result})
        return result

    # ---------------------------------------------------------------- loop
    stop = StopRequest()
    budget = tc.budget_hours * 3600 if tc.budget_hours else None
    # In budget mode the bar counts seconds of the budget, so its ETA is the real one.
    bar = tqdm(total=round(budget) if budget else tc.max_steps,
               initial=round(elapsed) if budget else step, unit="s" if budget else "step",
               disable=not (main and tc.progress_bar), dynamic_ncols=True, desc="train")
    nonfinite = 0
    window = torch.zeros(4, dtype=torch.float64)  # loss, mlm, nsp, steps since last log
    window_tokens, window_start = 0, time.perf_counter()
    last_saved = step if resume_path else None
    clock = time.perf_counter() - elapsed  # elapsed counts training time only
    model.train()
    while step < tc.max_steps and not (budget and elapsed >= budget):
        lr = s.optim.lr * schedule.factor(step, elapsed)
        set_lr(optimizer, lr)
        # Local sums: loss, mlm loss, nsp loss, tokens, stop flag; reduced once per step.
        local = torch.zeros(5, dtype=torch.float64, device=accelerator.device)
        for j, batch in enumerate(stream.next_step()):
            torch.manual_seed(dropout_seed(s.seed, step, rank * accumulation + j))
            inputs = _model_inputs(batch, accelerator.device)
            sync = j == accumulation - 1
            with contextlib.nullcontext() if sync else accelerator.no_sync(model):
                out = model(**inputs)
                accelerator.backward(out.loss / accumulation)
            local[:3] += torch.stack([out.loss.detach(), out.mlm_loss.detach(),
                                      out.nsp_loss.detach()]).double()
            local[3] += batch["num_tokens"]
        local[4] = float(stop.requested)
        if world > 1:
            local = accelerator.reduce(local, reduction="sum")
        losses = (local[:3] / (accumulation * world)).cpu()
        if not torch.isfinite(losses[0]) and tc.mixed_precision != "fp16":
            # Skip the update; a run that keeps producing inf/nan stops with its last good
            # checkpoint intact rather than overwriting it with garbage.
            optimizer.zero_grad(set_to_none=True)
            nonfinite += 1
            if nonfinite >= max(tc.max_nonfinite_steps, 1):
                last = ckpt.latest_checkpoint(run_dir)
                raise TrainingError(
                    f"the loss was non-finite for {nonfinite} consecutive steps (step {step + 1}); "
                    f"last good checkpoint: {last or 'none'}; lower optim.lr, raise "
                    f"trainer.warmup_steps or set trainer.max_grad_norm, then resume=auto"
                )
        else:
            if tc.max_grad_norm is not None:
                accelerator.clip_grad_norm_(model.parameters(), tc.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            nonfinite = 0
            if torch.isfinite(losses[0]):  # (fp16: the scaler skipped this step's update)
                window[:3] += losses
                window[3] += 1
        step += 1
        tokens_seen += int(local[3].item())
        window_tokens += int(local[3].item())
        elapsed = time.perf_counter() - clock
        bar.update(min(round(elapsed), round(budget)) - bar.n if budget else 1)

        if step % tc.log_every == 0 or step == tc.max_steps:
            now = time.perf_counter()
            n = max(window[3].item(), 1.0)
            record = {"step": step, "loss": window[0].item() / n, "mlm_loss": window[1].item() / n,
                      "nsp_loss": window[2].item() / n, "lr": lr,
                      "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                      "tokens_seen": tokens_seen, "epoch": round(stream.epoch, 4),
                      "elapsed_s": round(elapsed, 2)}
            if window[3].item() == 0:  # every step of the window was skipped (non-finite)
                record.update(loss=None, mlm_loss=None, nsp_loss=None)
            if nonfinite:
                record["nonfinite_steps"] = nonfinite
            metrics.log(record)
            bar.set_postfix(step=step,
                            loss="skipped" if record["loss"] is None else f"{record['loss']:.3f}",
                            lr=f"{lr:.2e}",
                            tok_s=f"{record['tokens_per_s']:.0f}")
            window.zero_()
            window_tokens, window_start = 0, time.perf_counter()
        pause = time.perf_counter()  # evaluation and saving do not eat the training budget
        if tc.eval_every and step % tc.eval_every == 0:
            last_eval = (step, run_eval())
        if step % tc.checkpoint_every == 0 and nonfinite == 0:  # never save a suspect state
            save()
            last_saved = step
        clock += time.perf_counter() - pause
        if local[4].item() > 0:
            if main:
                print(f"\nbert-train: stop requested: saving at step {step} and exiting; "
                      f"continue with resume=auto", flush=True)
            break
    bar.close()
    stop.restore()

    # ---------------------------------------------------------------- the end
    stopped_early = local[4].item() > 0 if step > state["step"] else False
    # Preempted: save first (grace periods are short) and skip the final evaluation.
    if last_saved != step:
        final = save()
    else:
        final = os.path.join(ckpt.checkpoints_root(run_dir), f"step-{step:08d}")
    if not stopped_early and (last_eval is None or last_eval[0] != step):
        last_eval = (step, run_eval())
    result = last_eval[1] if last_eval else {"eval_mlm_loss": float("nan")}
    if main:
        if last_eval:
            print(f"bert-train: {'stopped' if stopped_early else 'finished'} at step {step}; "
                  f"eval at step {last_eval[0]}: MLM loss {result['eval_mlm_loss']:.4f}, MLM "
                  f"accuracy {result['eval_mlm_accuracy']:.4f} (always predicting the most "
                  f"frequent token: {majority_baseline(data, s.data.eval_split):.4f}), NSP "
                  f"accuracy {result['eval_nsp_accuracy']:.4f} (chance: 0.5)")
        else:
            print(f"bert-train: stopped at step {step} (no evaluation yet)")
        print(f"  checkpoint: {final}")
        print(f"  metrics:    {metrics.path}")
        print(f"  logs:       {os.path.join(run_dir, 'train.log')} (Hydra), config in "
              f"{os.path.join(final, 'config.yaml')}")
        if metrics.wandb_dir:
            print(f"  wandb:      {metrics.wandb_dir}")
    metrics.close()
    accelerator.end_training()
    return float(result["eval_mlm_loss"])
