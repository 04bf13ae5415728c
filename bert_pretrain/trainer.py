"""The pretraining loop.

`Trainer(settings, ...)` sets up the accelerator, data, model, optimizer and resume state;
`Trainer.fit()` is the loop, in one screen: one optimizer step (`train_step`), logging,
evaluation, saving, the end report. The pieces are methods so that benchmarks and the GPU work
can run one step or one evaluation without copying the loop.

The loss of a step is the loss of the global batch: the MLM loss is the sum of the token losses
over every predicted token of the global batch divided by their number, the NSP loss the mean
over its sequences. Each micro-batch's summed loss is scaled by (processes / global count), so
DDP's gradient averaging and the accumulation add up to exactly the global-batch gradient, and
1 process or 64, with or without accumulation, train the same model (Google's BERT averages per
core, which weights a token by how many predictions its core happened to get; transformers
moved its gradient accumulation to this definition in 2024).
"""

import contextlib
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .cpu_runtime import keep_freed_memory
from .errors import ConfigError, DataError, TrainingError, UserError
from .evaluation import evaluate, majority_baseline, model_inputs  # noqa: F401 (re-exported)

MIXED_PRECISION = ("auto", "no", "bf16", "fp16")


@dataclass
class TrainerConfig:
    """`conf/train/trainer/`: how long and in what batches to train, when to evaluate, save."""

    max_steps: int = 1000
    """Optimizer steps (an upper bound in budget mode)."""
    warmup_steps: Optional[int] = None
    """Linear warmup length in optimizer steps; null = warmup_ratio x max_steps."""
    warmup_ratio: float = 0.1
    """Warmup as a fraction of max_steps, when warmup_steps is null (as transformers/RoBERTa),
    so a run of any length works with the defaults."""
    budget_hours: Optional[float] = None
    """Wall-clock budget: the lr schedule follows elapsed/budget and training stops when it is
    spent (evaluation and checkpoint time excluded). null = step mode."""
    global_batch_size: int = 32
    """Samples per optimizer step over all processes."""
    micro_batch_size: Optional[int] = None
    """Samples per forward/backward on one process; null = global / world (no accumulation).
    Accumulation steps = global / (world x micro). Changes speed and memory, not results."""
    mixed_precision: str = "auto"
    """auto: bf16 autocast where the hardware has bf16 matrix units (AMX-BF16 / AVX512-BF16 CPUs,
    bf16-capable GPUs), fp32 elsewhere; no (fp32), bf16, or fp16 (with dynamic loss scaling:
    steps with inf/nan gradients are skipped). Weights and optimizer state stay fp32."""
    max_grad_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this; null = no clipping."""
    nsp_loss_weight: float = 1.0
    """The step's gradient is that of mlm_loss + nsp_loss_weight x nsp_loss (BERT: 1). The
    logged `loss` stays mlm_loss + nsp_loss, so runs with different weights compare."""
    attention_locality: float = 0.0
    """A training-time start for attention (0 = off: BERT all along). Head h of every layer
    adds -attention_locality * 2^-h * |i - j| to its scores (ALiBi's form; not for the [CLS]
    query, which reads the whole input for NSP; only the first
    attention_locality_heads share of the heads), at full strength until attention_locality_hold
    of training, fading linearly to nothing at attention_locality_end; after it the model is a
    plain BERT, and evaluations always score it without the bias (what an export computes).
    From scratch, a BERT predicts only frequent tokens until some head attends to the
    neighbours of a masked token, which takes thousands of steps; this start skips that wait
    (README, "Learning check"). Training progress counts steps, or time with budget_hours."""
    attention_locality_hold: float = 0.2
    attention_locality_end: float = 0.45
    attention_locality_heads: float = 1.0
    """Share of each layer's heads (the first ones) that get the bias; the others stay free."""
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
    """Stop after this many consecutive non-finite steps (loss or gradient norm; each skipped)."""
    init_from: Optional[str] = None
    """A checkpoint directory to take the weights from (phase 2): fresh optimizer, schedule
    and data position."""
    progress_bar: bool = True
    report: bool = True
    """At the end, write <run_dir>/report/ (report.md and curves, as bert-report draws them)."""
    cpu: bool = False
    """Train on CPU even when a GPU is present."""
    cpu_keep_freed_memory: bool = True
    """CPU, glibc: keep freed memory in the process so big per-step tensors reuse warm pages
    instead of page-faulting fresh ones (cpu_runtime.py; ~25% off a bf16 BERT-base step).
    Speed only; resident memory stays at its peak."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "global_batch_size", "log_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "keep_last_k", "max_nonfinite_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"trainer.warmup_steps must be >= 0 or null, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"trainer.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError("trainer.micro_batch_size must be >= 1 or null")
        if self.budget_hours is not None and self.budget_hours <= 0:
            raise ValueError("trainer.budget_hours must be > 0 or null")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"trainer.mixed_precision must be one of "
                             f"{', '.join(MIXED_PRECISION)}, got {self.mixed_precision!r}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError("trainer.max_grad_norm must be > 0 or null")
        if not self.nsp_loss_weight >= 0:
            raise ValueError(f"trainer.nsp_loss_weight must be >= 0, got {self.nsp_loss_weight}")
        if not self.attention_locality >= 0:
            raise ValueError(f"trainer.attention_locality must be >= 0 (0 = off), got "
                             f"{self.attention_locality}")
        if not 0.0 <= self.attention_locality_hold <= self.attention_locality_end <= 1.0:
            raise ValueError(f"trainer.attention_locality_hold ({self.attention_locality_hold}) "
                             f"and attention_locality_end ({self.attention_locality_end}) must "
                             f"satisfy 0 <= hold <= end <= 1 (shares of training)")
        if not 0.0 < self.attention_locality_heads <= 1.0:
            raise ValueError(f"trainer.attention_locality_heads must be in (0, 1], got "
                             f"{self.attention_locality_heads}")
        if self.budget_hours is not None and self.warmup_steps is None and self.warmup_ratio:
            raise ValueError("trainer.budget_hours measures the run in time, so there is no step "
                             "count to take trainer.warmup_ratio of; set trainer.warmup_steps")
        if self.warmup >= self.max_steps and self.budget_hours is None:
            raise ValueError(f"trainer.warmup_steps ({self.warmup}) must be below "
                             f"trainer.max_steps ({self.max_steps})")

    def locality_strength(self, step: int, elapsed: float) -> float:
        """The share of attention_locality in force at this point of training (1 -> 0)."""
        if not self.attention_locality:
            return 0.0
        progress = (elapsed / (self.budget_hours * 3600) if self.budget_hours is not None
                    else step / self.max_steps)
        if progress < self.attention_locality_hold:
            return 1.0
        span = self.attention_locality_end - self.attention_locality_hold
        return 0.0 if span <= 0 else max(0.0, 1.0 - (progress - self.attention_locality_hold)
                                         / span)

    @property
    def warmup(self) -> int:
        """Warmup in steps: warmup_steps if set, else warmup_ratio of max_steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return 0 if self.budget_hours is not None else int(round(self.warmup_ratio *
                                                                 self.max_steps))


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
        self._previous = {}


@dataclass
class StepResult:
    """One optimizer step, over the global batch (identical on every process)."""

    loss: float
    mlm_loss: float
    nsp_loss: float
    num_tokens: int
    """Non-padding tokens of the global batch."""
    grad_norm: Optional[float]
    updated: bool
    """False when the step was skipped (non-finite loss or gradient norm)."""
    stop_requested: bool
    """Some process got SIGTERM/SIGINT during the step."""


class Trainer:
    def __init__(self, s, resolved_config: dict, config_yaml: str):
        """Set up everything `fit` needs; a bad setting fails here, before anything is written
        (except the run directory's log once the configuration is known to be usable)."""
        self.s, self.tc = s, s.trainer
        self.resolved_config, self.config_yaml = resolved_config, config_yaml
        self._setup_accelerator()
        self._setup_data()
        self._setup_model()
        self._setup_run()
        self._setup_optimizer_and_resume()
        # Loop state; `fit` adds the progress bar and the signal handlers.
        self.stop, self.bar, self.stopped_early, self.nonfinite = None, None, False, 0
        for note in getattr(self, "import_notes", []):
            self.log.warning(f"bert-train: warning: {note}")
        self.window = torch.zeros(4, dtype=torch.float64)  # loss, mlm, nsp, steps logged
        self.window_tokens, self.window_start = 0, time.perf_counter()
        self.clock = time.perf_counter() - self.elapsed  # elapsed counts training time only
        self.lr = float("nan")

    # ------------------------------------------------------------------ set-up
    def _setup_accelerator(self) -> None:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import GradientAccumulationPlugin

        tc = self.tc
        env_accumulation = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
        if env_accumulation.strip() not in ("", "1"):
            # accelerator.backward would divide every loss by it a second time.
            raise ConfigError(
                f"accelerate's gradient accumulation is set to {env_accumulation} (accelerate "
                f"launch --gradient_accumulation_steps or ACCELERATE_GRADIENT_ACCUMULATION_STEPS)"
                f"; bert-train accumulates itself: drop that setting and set "
                f"trainer.micro_batch_size (accumulation = global batch / (processes x micro))"
            )
        AcceleratorState._reset_state()  # several runs in one process (tests, sweeps)
        on_cpu = tc.cpu or not torch.cuda.is_available()
        self._resolve_precision(on_cpu)
        self.keeps_freed_memory = on_cpu and tc.cpu_keep_freed_memory and keep_freed_memory()
        # Without CUDA, accelerate treats a torchrun / `accelerate launch --multi_gpu` process as
        # a lone process unless told cpu=True: N copies would each train alone into one run_dir.
        acc = Accelerator(cpu=on_cpu,
                          mixed_precision=tc.mixed_precision,
                          gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1))
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and acc.num_processes == 1:
            raise ConfigError(
                f"launched as {launched} processes but accelerate set up {acc.num_processes}; "
                f"check the launcher's device settings (e.g. trainer.cpu=true on CPU machines)"
            )
        if acc.distributed_type.name in ("FSDP", "DEEPSPEED"):
            # Checkpoints save the main process's full model/optimizer state: under FSDP/ZeRO
            # those are shards, and the saved checkpoint would silently hold a fraction of it.
            raise ConfigError(
                f"accelerate is set up for {acc.distributed_type.name}, which bert-train "
                f"does not support yet (its checkpoints would hold only one shard); launch with "
                f"DDP (conf/accelerate/multi_gpu.yaml or multi_node.yaml)"
            )
        self.accelerator = acc
        self.world, self.rank, self.main = acc.num_processes, acc.process_index, \
            acc.is_main_process

    def _resolve_precision(self, on_cpu: bool) -> None:
        """trainer.mixed_precision=auto becomes what it means on this machine, in the settings
        and in the config saved with checkpoints: a resume on a machine that resolves it
        differently is then named as a changed setting."""
        from .cpu_runtime import resolve_precision

        tc = self.tc
        tc.mixed_precision, self.precision_reason = resolve_precision(tc.mixed_precision,
                                                                      not on_cpu)
        trainer_config = self.resolved_config.get("trainer", {})
        if trainer_config.get("mixed_precision") not in (None, tc.mixed_precision):
            from omegaconf import OmegaConf

            trainer_config["mixed_precision"] = tc.mixed_precision
            self.config_yaml = OmegaConf.to_yaml(OmegaConf.create(self.resolved_config))

    def _setup_data(self) -> None:
        from .data import PreparedData, TrainStream

        s, tc = self.s, self.tc
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
        self.micro = tc.micro_batch_size or tc.global_batch_size // self.world
        self.stream = TrainStream(data, s.data, s.seed, tc.global_batch_size, self.micro,
                                  self.world, self.rank)
        self.accumulation = self.stream.accumulation_steps
        eval_info = data.manifest["splits"].get(s.data.eval_split)
        # bert-prep validation_fraction=0 writes an empty held-out split: train without
        # evaluation rather than refuse the data.
        self.can_evaluate = not (eval_info and int(eval_info.get("num_instances", 1)) == 0)
        if self.can_evaluate:
            data.split(s.data.eval_split)  # fail now, not at the first evaluation
        self.data = data

    def _setup_model(self) -> None:
        from accelerate.utils import set_seed

        from .model import BertConfig, BertForPreTraining, ModelImpl

        s, data = self.s, self.data
        self.hf_state = None
        try:
            if self.tc.init_from and self._init_from_transformers():
                model_values = self._read_transformers_model()
            else:
                model_values = {**s.model, "vocab_size": data.vocab_size,
                                "pad_token_id": data.special.get("pad", 0)}
            self.model_cfg = BertConfig.from_dict(model_values)
            impl = ModelImpl.from_dict(s.impl)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if data.max_seq_length > self.model_cfg.max_position_embeddings:
            raise DataError(
                f"the data's max_seq_length ({data.max_seq_length}) exceeds "
                f"model.max_position_embeddings ({self.model_cfg.max_position_embeddings}); "
                f"raise it or prepare shorter sequences"
            )
        set_seed(s.seed)  # model init is a function of the seed alone
        self.raw_model = BertForPreTraining(self.model_cfg, impl)

    def _init_from_transformers(self) -> bool:
        from .hf_import import is_hf_model_dir

        return os.path.isdir(self.tc.init_from) and is_hf_model_dir(self.tc.init_from)

    def _read_transformers_model(self) -> dict:
        """Continued pretraining from a transformers BERT directory: its config.json is the
        model config (model.* settings are not used) and its tokenizer must be the data's."""
        import warnings

        from .hf_import import check_against_data, read_hf_model

        path, data = self.tc.init_from, self.data
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config, self.hf_state = read_hf_model(path, seed=self.s.seed)
            notes = check_against_data(path, config, data)
        pad = data.special.get("pad", 0)
        if config.get("pad_token_id", pad) != pad:
            raise DataError(f"trainer.init_from={path} has pad_token_id "
                            f"{config['pad_token_id']} but [PAD] is token {pad} in the data; "
                            f"prepare the data with bert-prep tokenizer.vocab_file={path}")
        self.import_notes = [str(w.message) for w in caught] + list(notes)
        return {**config, "pad_token_id": pad}

    def _setup_run(self) -> None:
        from . import checkpoint as ckpt
        from .resume import check_seed, find_resume, saved_config
        from .runlog import open_run_log

        s = self.s
        self.run_dir = s.run_dir
        self.log = open_run_log(self.run_dir, self.main, self.rank)
        # The main process verifies the checkpoints (hashing every file) and tells the others.
        found = [None, None]  # path, or the error every process must raise
        if self.main:
            try:
                found[0] = find_resume(s.resume, self.run_dir, warn=self.log.warning)
            except UserError as exc:
                found[1] = exc
        if self.world > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(found)
        if found[1] is not None:
            raise found[1]
        self.resume_path = found[0]
        self.saved_config = saved_config(self.resume_path) if self.resume_path else None
        if self.resume_path:
            check_seed(self.saved_config, s.seed, self.resume_path)
        if self.main:
            ckpt.clean_partial(self.run_dir)

    def _setup_optimizer_and_resume(self) -> None:
        from . import checkpoint as ckpt
        from .metrics import Metrics, NullMetrics, eval_record_at
        from .optim import Schedule, build_optimizer
        from .resume import apply_hyperparameters

        s, tc, acc = self.s, self.tc, self.accelerator
        self.state = {"step": 0, "tokens_seen": 0, "samples_consumed": 0, "elapsed_seconds": 0.0}
        source = self.resume_path or tc.init_from
        if source and self.hf_state is not None and not self.resume_path:
            self.raw_model.load_state_dict(self.hf_state, strict=True)
        elif source:
            # resume: the main process verified it (find_resume) and told the others; an
            # init_from checkpoint is verified by every process before it loads the weights
            saved = ckpt.read_train_state(source, verify=not self.resume_path)
            ckpt.check_compatible(source, saved, self.model_cfg.to_dict(),
                                  self.data.tokenizer_sha256)
            ckpt.load_weights(source, self.raw_model)
            if self.resume_path:
                self.state.update({k: saved[k] for k in self.state})
        optimizer = build_optimizer(s.optim, self.raw_model.named_parameters())
        self.model, self.optimizer = acc.prepare(self.raw_model, optimizer)
        self.schedule = Schedule(s.scheduler, tc.max_steps, tc.warmup,
                                 tc.budget_hours * 3600 if tc.budget_hours else None)
        if self.resume_path:
            self._warn_changed_settings()
            fresh = [dict(g) for g in self.optimizer.param_groups]
            opt_state, extra, rng = ckpt.load_states(self.resume_path, self.rank)
            self.optimizer.load_state_dict(opt_state)
            apply_hyperparameters(self.optimizer, fresh)
            self.schedule.load_state_dict(extra["schedule"])
            if acc.scaler is not None and extra.get("scaler"):
                acc.scaler.load_state_dict(extra["scaler"])
            if rng is not None:
                ckpt.set_rng_state(rng)
        self.step, self.tokens_seen = self.state["step"], self.state["tokens_seen"]
        self.elapsed = self.state["elapsed_seconds"]
        self.stream.position.samples_consumed = self.state["samples_consumed"]
        self.last_eval = None
        if self.resume_path:
            logged = eval_record_at(self.run_dir, self.step)
            self.last_eval = (self.step, logged) if logged else None
            acc.wait_for_everyone()  # every rank has read metrics.jsonl before it changes
        self.metrics = (Metrics(s.logger, self.run_dir, s.name, self.resolved_config,
                                self.step if self.resume_path else None)
                        if self.main else NullMetrics())
        self.last_saved = self.step if self.resume_path else None

    def _warn_changed_settings(self) -> None:
        from .resume import changed_settings, describe

        if self.saved_config is None:
            return
        from .redact import redact

        # (the saved config.yaml is redacted: compare like with like, print no secret)
        changes = changed_settings(self.saved_config, redact(self.resolved_config))
        if changes:
            lr_change = self._lr_change(self.saved_config)
            self.log.warning(f"bert-train: warning: resuming {self.resume_path} with changed "
                             f"settings (they apply from step {self.state['step']} on): "
                             f"{describe(changes, lr_change)}")

    def _lr_change(self, old: dict) -> Optional[tuple]:
        """(step, old lr, new lr) at the resume step, in step mode, if the lr moves."""
        from .optim import Schedule, SchedulerConfig

        if self.tc.budget_hours is not None:
            return None
        step = self.state["step"]
        try:
            old_trainer = TrainerConfig(**{k: v for k, v in old["trainer"].items()
                                           if k in TrainerConfig.__dataclass_fields__})
            old_schedule = Schedule(SchedulerConfig(**old["scheduler"]), old_trainer.max_steps,
                                    old_trainer.warmup)
            before = float(old["optim"]["lr"]) * old_schedule.factor(step)
        except (KeyError, TypeError, ValueError):  # a checkpoint of an older config layout
            return None
        after = self.s.optim.lr * self.schedule.factor(step)
        return None if math.isclose(before, after, rel_tol=1e-12) else (step, before, after)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> float:
        """Train until max_steps or the budget; returns the final held-out `objective` (by
        default the MLM loss)."""
        tc = self.tc
        self._start_loop()
        try:
            if self._finished():
                self._say_already_finished()
            while not self._finished():
                result = self.train_step()
                self.log_step(result)
                paused = time.perf_counter()  # evaluation and saving do not eat the budget
                if tc.eval_every and self.step % tc.eval_every == 0 and self.can_evaluate:
                    self.run_evaluation(intermediate=not self._finished())
                if self.step % tc.checkpoint_every == 0 and result.updated:
                    self.save()
                self.clock += time.perf_counter() - paused
                if result.stop_requested:
                    self.log.info(f"bert-train: stop requested: saving at step {self.step} and "
                                  f"exiting; continue with resume=auto")
                    self.stopped_early = True
                    break
            self.bar.close()
            return self.finish()
        finally:
            self.close()

    def _finished(self) -> bool:
        budget = self.tc.budget_hours * 3600 if self.tc.budget_hours else None
        return self.step >= self.tc.max_steps or bool(budget and self.elapsed >= budget)

    def _start_loop(self) -> None:
        from tqdm.auto import tqdm

        tc = self.tc
        self._say_start()
        self.stop = StopRequest()
        budget = tc.budget_hours * 3600 if tc.budget_hours else None
        # In budget mode the bar counts seconds of the budget, so its ETA is the real one.
        self.bar = tqdm(total=round(budget) if budget else tc.max_steps,
                        initial=round(self.elapsed) if budget else self.step,
                        unit="s" if budget else "step", dynamic_ncols=True, desc="train",
                        disable=not (self.main and tc.progress_bar))
        self.window_tokens, self.window_start = 0, time.perf_counter()
        self.clock = time.perf_counter() - self.elapsed
        self.model.train()

    # ------------------------------------------------------------------ one step
    def train_step(self) -> StepResult:
        """One optimizer step on the next global batch: this process's micro-batches, forward
        and backward each, then clip and update (or skip, if anything is non-finite)."""
        from .data import IGNORE_INDEX
        from .optim import set_lr

        acc, tc = self.accelerator, self.tc
        lr = self.s.optim.lr * self.schedule.factor(self.step, self.elapsed)
        set_lr(self.optimizer, lr)
        self.lr = lr
        self._set_locality(tc.locality_strength(self.step, self.elapsed))
        batches = self.stream.next_step()
        # The global batch's counts, known before any forward pass: the normalisers of its loss.
        counts = torch.tensor([sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches),
                               sum(int(b["next_sentence_label"].numel()) for b in batches),
                               sum(int(b["num_tokens"]) for b in batches)],
                              dtype=torch.float64, device=acc.device)
        if self.world > 1:
            counts = acc.reduce(counts, reduction="sum")
        num_mlm, num_nsp = max(counts[0].item(), 1.0), max(counts[1].item(), 1.0)
        sums = torch.zeros(3, dtype=torch.float64, device=acc.device)  # mlm, nsp, stop flag
        for j, batch in enumerate(batches):
            torch.manual_seed(dropout_seed(self.s.seed, self.step,
                                           self.rank * self.accumulation + j))
            inputs = model_inputs(batch, acc.device)
            last = j == len(batches) - 1
            with contextlib.nullcontext() if last else acc.no_sync(self.model):
                out = self.model(**inputs, loss_reduction="sum")
                # x world: DDP averages gradients over processes, the global batch sums them.
                acc.backward(out.mlm_loss * (self.world / num_mlm) +
                             out.nsp_loss * (tc.nsp_loss_weight * self.world / num_nsp))
            sums[:2] += torch.stack([out.mlm_loss.detach(), out.nsp_loss.detach()]).double()
        sums[2] = float(self.stop is not None and self.stop.requested)
        if self.world > 1:
            sums = acc.reduce(sums, reduction="sum")
        mlm, nsp = sums[0].item() / num_mlm, sums[1].item() / num_nsp
        grad_norm = self._grad_norm()
        finite = math.isfinite(mlm + nsp) and (grad_norm is None or math.isfinite(grad_norm))
        # fp16: the grad scaler skips steps with inf/nan gradients itself and lowers its scale.
        updated = finite or tc.mixed_precision == "fp16"
        if updated:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        num_tokens = int(counts[2].item())
        self.tokens_seen += num_tokens
        self.elapsed = time.perf_counter() - self.clock
        result = StepResult(mlm + nsp, mlm, nsp, num_tokens, grad_norm, updated and finite,
                            sums[2].item() > 0)
        self._count_nonfinite(result)
        return result

    def _set_locality(self, strength: float) -> None:
        """The attention locality bias at `strength` (0: none, the plain model)."""
        self.locality = strength
        heads = self.model_cfg.num_attention_heads
        local = max(1, round(self.tc.attention_locality_heads * heads))
        slopes = None if strength == 0 else [
            strength * self.tc.attention_locality * 2.0 ** -h if h < local else 0.0
            for h in range(heads)]
        if slopes != getattr(self, "_locality_slopes", None):
            self.raw_model.set_attention_locality(slopes)
            self._locality_slopes = slopes

    def _grad_norm(self) -> Optional[float]:
        """The global gradient norm (after DDP's all-reduce), clipped to max_grad_norm if set."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.tc.max_grad_norm is not None:
            return float(self.accelerator.clip_grad_norm_(params, self.tc.max_grad_norm))
        if self.tc.mixed_precision == "fp16":
            return None  # scaled gradients: the grad scaler checks them
        grads = [p.grad for p in params]
        if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
            return float(torch.nn.utils.get_total_norm(grads))
        return float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))

    def _count_nonfinite(self, result: StepResult) -> None:
        """A run that keeps producing inf/nan stops with its last good checkpoint intact rather
        than overwriting it; skipped steps leave the weights as they were."""
        from . import checkpoint as ckpt

        if result.updated or self.tc.mixed_precision == "fp16":
            self.nonfinite = 0
            return
        self.nonfinite += 1
        if self.nonfinite >= max(self.tc.max_nonfinite_steps, 1):
            last = ckpt.latest_checkpoint(self.run_dir, verify=False)
            raise TrainingError(
                f"the loss or gradient norm was non-finite for {self.nonfinite} consecutive "
                f"steps (step {self.step}); last good checkpoint: {last or 'none'}; lower "
                f"optim.lr, raise trainer.warmup_steps or set trainer.max_grad_norm, then "
                f"resume=auto"
            )

    # ------------------------------------------------------------------ logging
    def log_step(self, result: StepResult) -> None:
        """Average the window's steps into one metrics.jsonl record every log_every steps."""
        tc = self.tc
        if result.updated:
            self.window += torch.tensor([result.loss, result.mlm_loss, result.nsp_loss, 1.0],
                                        dtype=torch.float64)
        self.window_tokens += result.num_tokens
        budget = tc.budget_hours * 3600 if tc.budget_hours else None
        if self.bar is not None:
            self.bar.update(min(round(self.elapsed), round(budget)) - self.bar.n if budget else 1)
        # The last step is logged whatever its number (a budget ends anywhere), so the final
        # record carries the run's total time and tokens.
        if self.step % tc.log_every and not (self._finished() or result.stop_requested):
            return
        now = time.perf_counter()
        n = max(self.window[3].item(), 1.0)
        record = {"step": self.step, "loss": self.window[0].item() / n,
                  "mlm_loss": self.window[1].item() / n, "nsp_loss": self.window[2].item() / n,
                  "lr": self.lr,
                  "tokens_per_s": self.window_tokens / max(now - self.window_start, 1e-9),
                  "tokens_seen": self.tokens_seen, "epoch": round(self.stream.epoch, 4),
                  "elapsed_s": round(self.elapsed, 2)}
        if result.grad_norm is not None:
            record["grad_norm"] = result.grad_norm
        if tc.attention_locality:
            record["attention_locality"] = round(self.locality * tc.attention_locality, 6)
        if self.window[3].item() == 0:  # every step of the window was skipped (non-finite)
            record.update(loss=None, mlm_loss=None, nsp_loss=None)
        if self.nonfinite:
            record["nonfinite_steps"] = self.nonfinite
        self.metrics.log(record)
        if self.bar is not None:
            self.bar.set_postfix(step=self.step, lr=f"{self.lr:.2e}",
                                 loss="skipped" if record["loss"] is None else
                                 f"{record['loss']:.3f}",
                                 tok_s=f"{record['tokens_per_s']:.0f}")
        self.window.zero_()
        self.window_tokens, self.window_start = 0, time.perf_counter()

    # ------------------------------------------------------------------ evaluation
    def run_evaluation(self, intermediate: bool = False) -> dict:
        """Evaluate the current weights on the held-out split (every process takes part)."""
        from tqdm.auto import tqdm

        from .data import eval_batches

        tc, split = self.tc, self.data.split(self.s.data.eval_split)
        size = tc.eval_batch_size or self.micro
        training_locality = getattr(self, "locality", 0.0)
        self._set_locality(0.0)  # score the model an export computes
        total = split.num_instances if tc.eval_max_samples is None else \
            min(tc.eval_max_samples, split.num_instances)
        bar = tqdm(total=len(range(self.rank * size, total, self.world * size)), desc="eval",
                   unit="batch", leave=False, dynamic_ncols=True,
                   disable=not (self.main and tc.progress_bar))
        result = evaluate(self.accelerator.unwrap_model(self.model), self.accelerator,
                          eval_batches(self.data, self.s.data, size, self.world, self.rank,
                                       tc.eval_max_samples), progress=bar,
                          mask_id=self.data.special.get("mask"))
        bar.close()
        self._set_locality(training_locality)
        self.metrics.log({"step": self.step, **result, "elapsed_s": round(self.elapsed, 2)})
        if intermediate:
            self.log.info(f"bert-train: step {self.step}: held-out MLM loss "
                          f"{result['eval_mlm_loss']:.4f}, MLM accuracy "
                          f"{result['eval_mlm_accuracy']:.4f} ([MASK] positions "
                          f"{result.get('eval_mlm_accuracy_masked', float('nan')):.4f}), "
                          f"NSP accuracy {result['eval_nsp_accuracy']:.4f}")
        self.last_eval = (self.step, result)
        return result

    # ------------------------------------------------------------------ saving
    def save(self) -> str:
        """Checkpoint the whole run state (every process takes part; rank 0 writes)."""
        from . import checkpoint as ckpt

        unwrapped = self.accelerator.unwrap_model(self.model)
        if not all(torch.isfinite(p).all() for p in unwrapped.parameters()):
            # Never label a poisoned state a checkpoint: resume=auto would pick it.
            raise TrainingError(
                f"the weights hold inf/nan at step {self.step}; not saving them; last good "
                f"checkpoint: {ckpt.latest_checkpoint(self.run_dir, verify=False) or 'none'}"
            )
        acc, tc = self.accelerator, self.tc
        path = ckpt.save_checkpoint(
            self.run_dir, self.step, model=unwrapped, optimizer_state=self.optimizer.state_dict(),
            extra_state={"schedule": self.schedule.state_dict(),
                         "scaler": acc.scaler.state_dict() if acc.scaler else None},
            train_state={"tokens_seen": self.tokens_seen,
                         "samples_consumed": self.stream.position.samples_consumed,
                         "elapsed_seconds": self.elapsed, "epoch": self.stream.epoch,
                         "world_size": self.world, "global_batch_size": tc.global_batch_size,
                         "model_config": self.model_cfg.to_dict(),
                         "tokenizer_sha256": self.data.tokenizer_sha256},
            config_yaml=self.config_yaml, tokenizer_dir=self.data.tokenizer_dir,
            keep_last_k=tc.keep_last_k, rank=self.rank, barrier=acc.wait_for_everyone)
        self.last_saved = self.step
        return path

    # ------------------------------------------------------------------ start and end
    def _say_start(self) -> None:
        tc, cfg = self.tc, self.model_cfg
        params = sum(p.numel() for p in self.raw_model.parameters())
        self.log.info(
            f"bert-train: {cfg.num_hidden_layers} layers x {cfg.hidden_size}, {params / 1e6:.1f}M "
            f"parameters; {self.stream.split.num_instances} training instances; {self.world} "
            f"process(es), global batch {tc.global_batch_size} = {self.world} x {self.micro} x "
            f"{self.accumulation} accumulation; warmup {tc.warmup} steps; run_dir {self.run_dir}"
            + (f"; resumed from {self.resume_path}" if self.resume_path else
               f"; weights from {tc.init_from}" if tc.init_from else ""))
        precision = {"no": "fp32", "bf16": "bf16 autocast (fp32 weights and optimizer state)",
                     "fp16": "fp16 autocast with loss scaling"}[tc.mixed_precision]
        threads = (f"; {torch.get_num_threads()} CPU threads, OMP_WAIT_POLICY="
                   f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}"
                   f"{', freed memory kept' if self.keeps_freed_memory else ''}"
                   if self.accelerator.device.type == "cpu" else "")
        self.log.info(f"bert-train: precision {precision} ({self.precision_reason}){threads}")
        if not self.can_evaluate:
            self.log.info(f"bert-train: the held-out split {self.s.data.eval_split!r} of "
                          f"{self.s.data.dir} is empty (bert-prep validation_fraction=0): "
                          f"training without evaluation")

    def _say_already_finished(self) -> None:
        self.log.info(
            f"bert-train: {self.run_dir} already finished at step {self.step} (resumed a finished "
            f"run: nothing to train); to train again from scratch delete {self.run_dir} (for "
            f"the demo: make demo-clean), or continue it with a larger trainer.max_steps or "
            f"trainer.budget_hours")

    def finish(self) -> float:
        """Save (first: preemption grace periods are short), evaluate unless preempted, report."""
        from . import checkpoint as ckpt

        if self.last_saved != self.step:
            final = self.save()
        else:
            final = os.path.join(ckpt.checkpoints_root(self.run_dir), f"step-{self.step:08d}")
        if self.can_evaluate and not self.stopped_early and (
                self.last_eval is None or self.last_eval[0] != self.step):
            self.run_evaluation()
        result = self.last_eval[1] if self.last_eval else {"eval_mlm_loss": float("nan")}
        state = "stopped" if self.stopped_early else "finished"
        if self.last_eval:
            baseline = majority_baseline(self.data, self.s.data.eval_split)
            self.log.info(
                f"bert-train: {state} at step {self.step}; eval at step {self.last_eval[0]}: "
                f"MLM loss {result['eval_mlm_loss']:.4f}, MLM accuracy "
                f"{result['eval_mlm_accuracy']:.4f} (always predicting the most frequent token: "
                f"{baseline:.4f}; at [MASK] positions: "
                f"{result.get('eval_mlm_accuracy_masked', float('nan')):.4f}), NSP accuracy "
                f"{result['eval_nsp_accuracy']:.4f} (chance: 0.5)")
        else:
            self.log.info(f"bert-train: {state} at step {self.step} (no evaluation)")
        self.log.info(f"  checkpoint: {final}")
        self.log.info(f"  metrics:    {self.metrics.path}")
        self.log.info(f"  logs:       {os.path.join(self.run_dir, 'train.log')}, config in "
                      f"{os.path.join(final, 'config.yaml')}")
        if self.metrics.wandb_dir:
            self.log.info(f"  wandb:      {self.metrics.wandb_dir}")
        if self.main and self.tc.report:
            self._write_report()
        return self._objective(result)

    def _objective(self, result: dict) -> float:
        """The metric a sweeper optimises (`objective`); nan without an evaluation."""
        objective = getattr(self.s, "objective", "eval_mlm_loss")
        if objective == "eval_loss":
            return float(result.get("eval_mlm_loss", float("nan")) +
                         result.get("eval_nsp_loss", float("nan")))
        return float(result.get(objective, float("nan")))

    def _write_report(self) -> None:
        """report.md and curves (bert-report) in the run directory; a failed picture never
        fails a finished run."""
        from .report import write_run_report

        try:
            self.log.info(f"  report:     {write_run_report(self.run_dir)}")
        except Exception as exc:  # plotting back-ends, fonts, a full disk: say it, go on
            self.log.warning(f"bert-train: warning: no run report ({str(exc).splitlines()[0]}); "
                             f"draw it later with bert-report {self.run_dir}")

    def close(self) -> None:
        """Release the log, the progress bar, signal handlers, metrics and the accelerator."""
        from .runlog import close_run_log

        if self.bar is not None:
            self.bar.close()
        if self.stop is not None:
            self.stop.restore()
        self.metrics.close()
        close_run_log()
        self.accelerator.end_training()


def _has_results(run_dir: str) -> bool:
    return any(os.path.exists(os.path.join(run_dir, name))
               for name in ("checkpoints", "metrics.jsonl", "wandb"))


def remove_unused_run_dir(run_dir: str) -> None:
    """A run that failed before training leaves no directory behind (only what Hydra and the
    log wrote, never anything with results). Under a launcher the main process does it, and
    the others must not race it."""
    if os.environ.get("RANK", "0") != "0":
        return
    try:
        if os.path.isdir(run_dir) and not _has_results(run_dir) and \
                set(os.listdir(run_dir)) <= {".hydra", "train.log"}:
            shutil.rmtree(run_dir, ignore_errors=True)
    except OSError:  # cleaning up is a courtesy: never let it hide the real error
        pass


def train(s, resolved_config: dict, config_yaml: str) -> float:
    """Run pretraining as configured by `s` (config.Settings); returns the final eval MLM loss."""
    had_results = os.path.isdir(s.run_dir) and _has_results(s.run_dir)
    try:
        trainer = Trainer(s, resolved_config, config_yaml)
    except UserError:
        from .runlog import close_run_log

        close_run_log()
        if not had_results:
            remove_unused_run_dir(s.run_dir)
        raise
    return trainer.fit()
