"""One fine-tune (one task, one peak learning rate, one seed) under accelerate, with the machinery
of pretraining: the loss of a step is the global batch's (summed per micro-batch and scaled by
processes / batch size, so DDP's averaging and accumulation add up to the global-batch
gradient), dropout is seeded per (step, global micro-batch), and the example order per (seed,
epoch): 1 process or N, with or without accumulation, interrupted and resumed or not, give the
same model.

    session = Session.start(trainer_cfg)
    result = FineTune(session, job, lr=3e-5, seed=1, run_dir=...).run()
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..errors import ConfigError, TrainingError, UserError
from . import scoring
from ..components.evaluation import model_inputs
from .batches import TrainOrder, collate, eval_batches

RESULT_FILE = "result.json"
DIVERGED_FILE = "diverged.json"
METRICS_FILE = "metrics.jsonl"
MODEL_DIR = "model"
# Consecutive skipped (non-finite) steps after which a fine-tune stops, before the room an fp16
# grad scaler gets to find its scale (precision.nonfinite_limit): pretraining's default.
MAX_NONFINITE_STEPS = 10
_LAYER = re.compile(r"bert\.encoder\.layer\.(\d+)\.")


class Diverged(TrainingError):
    """A fine-tune whose loss or gradient went non-finite (past the fp16 scaler's room): an
    outcome of its learning rate, so a grid records it and goes on with its other runs."""

    def __init__(self, message: str, step: Optional[int] = None):
        super().__init__(message)
        self.step = step
        """The step that stopped it (a deferring fine-tune learns of it a few steps later)."""


class Stopped(UserError):
    """SIGTERM / Ctrl-C: the fine-tune saved where it was; the same command continues it."""


class StepNumbers:
    """One fine-tuning step's loss, gradient norm and whether it was applied: numbers, or (a
    fine-tune that defers its reads) 0-d device tensors until `settle` reads them, at the next
    log, checkpoint or stop, as bert-train does (trainer.py: StepResult)."""

    def __init__(self, step: int, loss, grad_norm, applied):
        self.step = step
        """The step count after this step (1 for the first)."""
        self.loss, self.grad_norm, self.applied = loss, grad_norm, applied

    def settle(self) -> "StepNumbers":
        if isinstance(self.loss, torch.Tensor):
            self.loss, self.grad_norm = self.loss.item(), self.grad_norm.item()
            self.applied = bool(self.applied)
        return self


def dropout_seed(seed: int, step: int, micro_index: int) -> int:
    """A seed per (step, global micro-batch), independent of the world size and of resumes
    (its own stream of the counter-based hash pretraining's masks use)."""
    from ..components.data import hash_uniform

    return int(hash_uniform(seed, 5, np.int64(step), np.int64(micro_index), np.int64(0))
               * (1 << 53))


@dataclass
class Session:
    """The accelerator and process layout shared by every fine-tune of one command."""

    accelerator: object
    world: int
    rank: int
    main: bool
    precision: str
    precision_reason: str
    policy: object = None
    """precision.Precision: autocast, loss scaling (a fresh scaler per fine-tune: `scaler`)."""

    @classmethod
    def start(cls, trainer_cfg, config_yaml: str = "", prog: str = "bert-finetune") -> "Session":
        """The session of one command; launched as several processes, each checks that it runs
        rank 0's settings (`config_yaml`, the resolved config: run_setup.check_same_settings),
        as bert-train's do: another lr or grid otherwise drifted the replicas apart or left them
        waiting in different fine-tunes' collectives."""
        from accelerate import Accelerator

        from ..components.cpu_runtime import keep_freed_memory
        from ..components.precision import Precision
        from ..components.run_setup import reset_accelerate_state

        reset_accelerate_state()  # several commands in one process (tests, sweeps)
        on_cpu = trainer_cfg.cpu or not torch.cuda.is_available()
        if on_cpu:
            keep_freed_memory()
        # The group is joined first, as bert-train's (process_group.join): a peer that never
        # starts is one line after trainer.process_group_timeout_s, not a traceback after
        # torch's 30 minutes, and a hung one is found after that timeout at a collective.
        from ..components.process_group import join

        join("gloo" if on_cpu else "nccl", trainer_cfg.process_group_timeout_s)
        # Precision is ours (precision.py), as in pretraining: accelerate has no loss scaling
        # on CPU.
        acc = Accelerator(cpu=on_cpu, mixed_precision="no")
        policy = Precision.resolve(trainer_cfg.mixed_precision, acc.device.type)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and acc.num_processes == 1:
            raise ConfigError(f"launched as {launched} processes but accelerate set up one; "
                              f"check the launcher's device settings (trainer.cpu=true on CPU)")
        if acc.distributed_type.name in ("FSDP", "DEEPSPEED"):
            raise ConfigError(f"accelerate is set up for {acc.distributed_type.name}; "
                              f"bert-finetune runs under DDP or one process")
        if acc.num_processes > 1 and config_yaml:
            import yaml

            from ..components.run_setup import check_same_settings

            check_same_settings(yaml.safe_load(config_yaml) or {}, acc.num_processes, prog)
        return cls(acc, acc.num_processes, acc.process_index, acc.is_main_process, policy.mode,
                   policy.reason, policy)

    def new_precision(self):
        """The policy with a fresh grad scaler: every fine-tune finds its own loss scale."""
        from ..components.precision import Precision

        return Precision.resolve(self.precision, self.accelerator.device.type)

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def broadcast(self, value):
        """The main process's `value` on every process."""
        if self.world == 1:
            return value
        from accelerate.utils import broadcast_object_list

        box = [value]
        broadcast_object_list(box)
        return box[0]


@dataclass
class Job:
    """What every (lr, seed) fine-tune of one task and model shares."""

    settings: object
    """FinetuneSettings (task, recipe, trainer, impl)."""
    pretrained: object
    """Pretrained (config, encoder weights, tokenizer)."""
    data: object
    """TaskData (for labels, metrics)."""
    train: object
    """Encoded training examples."""
    evals: dict
    """{split key: Encoded}"""
    config_yaml: str
    identity: dict
    """Everything the results depend on except lr and seed (a rerun must match it)."""


def layer_depth(name: str, num_layers: int) -> int:
    """0 for the embeddings, i + 1 for encoder layer i, num_layers + 1 for what reads the last
    layer (pooler, classifier, a pre-LN encoder's final LayerNorm)."""
    if name.startswith("bert.embeddings."):
        return 0
    match = _LAYER.match(name)
    return int(match.group(1)) + 1 if match else num_layers + 1


def layer_lr_scale(decay: float, num_layers: int):
    """Layer-wise learning-rate decay (ELECTRA's and DeBERTa's fine-tuning): the head takes
    the scheduled rate, each layer below it `decay` times the one above, the embeddings
    decay^(num_layers + 1); None at decay 1 (one rate: the optimizer's groups as before)."""
    if decay == 1.0:
        return None
    return lambda name: decay ** (num_layers + 1 - layer_depth(name, num_layers))


def run_identity(job: Job, lr: float, seed: int) -> dict:
    """What one fine-tune's results (its folder, its model) are of."""
    return {**job.identity, "lr": lr, "seed": seed}


class FineTune:
    def __init__(self, session: Session, job: Job, lr: float, seed: int, run_dir: str):
        """`run_dir`: where the fine-tune goes; a folder that holds another fine-tune is left
        as it is and this one is written beside it (identity.claim)."""
        self.session, self.job, self.lr, self.seed = session, job, lr, seed
        self.run_dir = run_dir
        self.recipe, self.tc = job.settings.recipe, job.settings.trainer
        self.identity = run_identity(job, lr, seed)
        self.stop, self._window, self.pending = _NoStop(), [], []
        self.trained = False
        """Whether `run` fine-tuned (rather than read back a finished result)."""

    # ------------------------------------------------------------------ the run
    def run(self, progress_desc: str = "", rebuild: bool = False) -> dict:
        """Fine-tune (or resume, or return the saved result of a finished run) and score.
        rebuild: fine-tune a finished run again (its model was not kept and is wanted now)."""
        from .identity import claim

        from .export import recover_swap

        s = self.session
        self.run_dir = s.broadcast(claim(self.run_dir, self.identity, "a fine-tune", self._note)
                                   if s.main else None)
        if s.main:  # a model whose replacing was killed half-way: whole again before it is read
            recover_swap(os.path.join(self.run_dir, MODEL_DIR))
        s.barrier()
        done = self._finished_result()
        if done is not None and not rebuild:
            return done
        self.trained = True
        self._setup()
        try:
            return self._train(progress_desc)
        except Diverged as exc:
            self._record_divergence(exc)
            raise

    def _train(self, progress_desc: str) -> dict:
        start_time = time.perf_counter() - self.elapsed
        bar = self._progress_bar(progress_desc)
        from ..components.stop_request import StopRequest  # SIGTERM / Ctrl-C: finish the step, save

        self.stop = StopRequest()
        try:
            while self.step < self.order.num_steps:
                numbers, stopping = self.train_step()
                self.step += 1
                self.pending.append(numbers)
                bar.update(1)
                save = stopping or (self.step % self.tc.checkpoint_every == 0
                                    and self.step < self.order.num_steps)
                logged = self.step % self.tc.log_every == 0 or \
                    self.step == self.order.num_steps
                if save or logged or not self.defer_reads:
                    self.settle()  # (any wait for the device counts as training time)
                    bar.set_postfix(loss=f"{self._window[-1]:.3f}" if self._window else "-",
                                    lr=f"{self.current_lr:.1e}")
                self.elapsed = time.perf_counter() - start_time
                if logged:
                    self._log()
                if save:
                    self.save()
                if stopping:
                    raise Stopped(f"stopped at step {self.step} of {self.order.num_steps} in "
                                  f"{self.run_dir} (saved); run the same command again to "
                                  f"continue")
        finally:
            bar.close()
            self.stop.restore()
            self.stop = _NoStop()
        return self._finish()

    def _finished_result(self) -> Optional[dict]:
        """A finished run's result; a run that diverged raises its Diverged again, from the
        record it left (the same settings diverge the same way: resuming its last checkpoint
        only repeated the divergence)."""
        file = os.path.join(self.run_dir, DIVERGED_FILE)
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                record = json.load(f)
            self._check_identity(record.get("identity"), file)
            raise Diverged(f"{record.get('diverged', 'it diverged')} (an earlier run, recorded "
                           f"in {file}; delete {self.run_dir} to fine-tune it again)",
                           record.get("step"))
        file = os.path.join(self.run_dir, RESULT_FILE)
        if not os.path.isfile(file):
            return None
        with open(file, encoding="utf-8") as f:
            result = json.load(f)
        self._check_identity(result.get("identity"), file)
        return result

    def _record_divergence(self, exc: Diverged) -> None:
        """diverged.json marks the run done, as result.json marks a finished one; its resume
        state goes (resuming it only repeats the divergence)."""
        from ..components.checkpoint_manager import checkpoints_root

        if self.session.main:
            _write_json(os.path.join(self.run_dir, DIVERGED_FILE),
                        {"lr": self.lr, "seed": self.seed,
                         "step": self.step if exc.step is None else exc.step,
                         "diverged": str(exc), "identity": self.identity})
            shutil.rmtree(checkpoints_root(self.run_dir), ignore_errors=True)
        self.session.barrier()

    def _check_identity(self, saved: Optional[dict], where: str) -> None:
        """A result or checkpoint inside this run's folder (which records this identity) that
        is of another fine-tune was copied there or edited."""
        from .identity import differences

        diff = differences(saved, self.identity)
        if diff:
            raise ConfigError(f"{where} is a fine-tune with other settings ({', '.join(diff)} "
                              f"differ) in the folder of this one; delete {self.run_dir} to "
                              f"start it over")

    def _note(self, line: str) -> None:
        if self.session.main:
            print(f"bert-finetune: note: {line}", flush=True)

    # ------------------------------------------------------------------ set-up
    def _setup(self) -> None:
        from accelerate.utils import set_seed

        from ..components import checkpoint as ckpt
        from ..components.checkpoint_manager import CheckpointManager
        from ..model import BertForSequenceClassification, ModelImpl
        from ..components.optim import OptimConfig, Schedule, SchedulerConfig, build_optimizer

        session, job = self.session, self.job
        acc, recipe = session.accelerator, self.recipe
        config = job.pretrained.fine_tuning_config(recipe.dropout)
        set_seed(self.seed)  # the head's (or, from random init, the whole model's) weights
        model = BertForSequenceClassification(config, job.data.num_labels,
                                              ModelImpl.from_dict(job.settings.impl),
                                              pooling=recipe.pooling)
        if job.settings.init == "pretrained":
            model.load_encoder(job.pretrained.encoder_state)
            model.reinit_top_layers(recipe.reinit_layers)  # (drawn from the seed's stream)
        micro = self.tc.micro_batch_size or recipe.batch_size // session.world
        self.order = TrainOrder(len(job.train), self.seed, recipe.epochs, recipe.batch_size,
                                micro, session.world, session.rank)
        optimizer = build_optimizer(OptimConfig(lr=self.lr, betas=list(recipe.betas),
                                                eps=recipe.eps,
                                                weight_decay=recipe.weight_decay),
                                    model.named_parameters(),
                                    layer_lr_scale(recipe.layer_lr_decay,
                                                   config.num_hidden_layers))
        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.raw_model = model
        warmup = int(round(recipe.warmup_ratio * self.order.num_steps))
        self.schedule = Schedule(SchedulerConfig(name="linear"), self.order.num_steps, warmup)
        self.step, self.elapsed, self.current_lr = 0, 0.0, 0.0
        self.applied, self.nonfinite = 0, 0  # steps applied; consecutive ones skipped
        self.precision = session.new_precision()
        # One process whose fused AdamW skips a non-finite step on the device: a step need not
        # wait for the device before the host prepares the next (bert-train's deferred reads).
        self.defer_reads = self.tc.defer_reads and session.world == 1 and \
            self.precision.defers_reads(self.optimizer)
        self.pending = []
        # The pretraining protocol, as the trainer runs it: the main process repairs, finds
        # (resume=auto) and, once the checkpoint is known to be usable, begins the line there.
        self.checkpoints = CheckpointManager(self.run_dir, self.tc.keep_last_k, session.rank,
                                             barrier=session.barrier)
        resume = None
        if session.main:
            self.checkpoints.repair()
            resume = self.checkpoints.find("auto")
        resume = session.broadcast(resume)
        if resume:
            state = ckpt.read_train_state(resume, verify=False)  # the main process verified
            self._check_identity(state.get("identity"), resume)
            ckpt.load_weights(resume, model)
            opt_state, extra, rng = ckpt.load_states(resume, session.rank)
            self.optimizer.load_state_dict(opt_state)
            self.precision.load_state_dict(extra.get("scaler"))
            if rng is not None:
                ckpt.set_rng_state(rng)
            self.step, self.elapsed = int(state["step"]), float(state["elapsed_seconds"])
            self.applied = int(state.get("applied_steps", self.step))
            self._window = [float(x) for x in state.get("log_window", [])]
            self._note(f"lr {self.lr:g} seed {self.seed} continues from its checkpoint of step "
                       f"{self.step} ({resume})")
        if session.main:
            from ..components.metrics import truncate_jsonl

            self.checkpoints.begin(resume)
            os.makedirs(self.run_dir, exist_ok=True)
            metrics = os.path.join(self.run_dir, METRICS_FILE)
            if os.path.isfile(metrics):
                truncate_jsonl(metrics, self.step)  # records after the checkpoint are redone
        self.model.train()

    def _progress_bar(self, desc: str):
        from ..components.progress import progress_bar

        return progress_bar(self.order.num_steps, initial=self.step, unit="step",
                            desc=desc or f"lr {self.lr:g} seed {self.seed}", leave=False,
                            enabled=self.session.main and self.tc.progress_bar)

    # ------------------------------------------------------------------ one step
    def train_step(self) -> tuple:
        """One optimizer step on the next global batch: (its mean loss, stop requested)."""
        from ..components.optim import set_lr

        s, acc, recipe = self.session, self.session.accelerator, self.recipe
        self.current_lr = self.lr * self.schedule.factor(self.step)
        set_lr(self.optimizer, self.current_lr)
        batches = self.order.micro_batches(self.step)
        scale = s.world / recipe.batch_size  # DDP averages over processes; the batch sums
        sums = torch.zeros(2, dtype=torch.float64, device=acc.device)  # loss, stop flag
        for j, index in enumerate(batches):
            torch.manual_seed(dropout_seed(self.seed, self.step,
                                           s.rank * self.order.accumulation + j))
            inputs = model_inputs(collate(self.job.train, index), acc.device)
            last = j == len(batches) - 1
            with contextlib.nullcontext() if last else acc.no_sync(self.model):
                with self.precision.autocast():
                    out = self.model(**inputs, loss_reduction="sum")
                acc.backward(self.precision.scale(out.loss * scale))
            sums[0] += out.loss.detach().double()
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.defer_reads:
            # The same arithmetic as below, on the device and not read: the fused AdamW skips a
            # non-finite step there, and `settle` reads the numbers at the next log.
            loss = sums[0] / recipe.batch_size
            grad_norm = acc.clip_grad_norm_(params, recipe.max_grad_norm or math.inf)
            applied = torch.isfinite(loss) & torch.isfinite(grad_norm)
            self.precision.step_on_device(self.optimizer, applied)
            self.optimizer.zero_grad(set_to_none=True)
            return StepNumbers(self.step + 1, loss, grad_norm, applied), self.stop.requested
        sums[1] = float(self.stop.requested)
        if s.world > 1:
            sums = acc.reduce(sums, reduction="sum")
        loss = sums[0].item() / recipe.batch_size
        # Unscaled first (fp16), then measured and clipped: a norm of the scaled gradients is
        # the loss scale (2^16) times too large, and clipping it shrinks the step to nothing.
        self.precision.unscale(self.optimizer)
        grad_norm = float(acc.clip_grad_norm_(params, recipe.max_grad_norm or math.inf))
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        applied = self.precision.step(self.optimizer, finite)
        self.optimizer.zero_grad(set_to_none=True)
        return StepNumbers(self.step + 1, loss, grad_norm, applied), sums[1].item() > 0

    def settle(self) -> None:
        """Bring the steps since the last settle to the host, in order: their losses join the
        log window, the last one's gradient norm is the one logged, and skipped steps are
        counted (which may stop the fine-tune; nothing is saved after such a step)."""
        pending, self.pending = self.pending, []
        for numbers in pending:
            numbers.settle()
            self._count_skips(numbers.applied, numbers.step)
            self._window.append(numbers.loss)
            self.grad_norm = numbers.grad_norm

    def _count_skips(self, applied: bool, step: int) -> None:
        """fp16: the grad scaler skips a step with inf/nan gradients and lowers its scale,
        which takes a few steps at the start; beyond that (and in any other precision at the
        first such step) the fine-tune has diverged."""
        if applied:
            self.applied, self.nonfinite = self.applied + 1, 0
            return
        self.nonfinite += 1
        limit = self.precision.nonfinite_limit(MAX_NONFINITE_STEPS) \
            if self.precision.scaler is not None else 1
        if self.nonfinite >= limit:
            raise Diverged(f"the fine-tuning loss or gradient was non-finite for "
                           f"{self.nonfinite} consecutive steps (step {step}, lr {self.lr:g}); "
                           f"lower recipe.lrs or use trainer.mixed_precision=no", step)

    def _log(self) -> None:
        """The log window's record (every log_every steps and the last; settled first)."""
        if not self.session.main:
            self._window = []
            return
        record = {"step": self.step, "loss": float(np.mean(self._window)),
                  "lr": self.current_lr, "grad_norm": self.grad_norm,
                  "epoch": round(self.order.epoch(self.step), 4),
                  "elapsed_s": round(self.elapsed, 2)}
        if self.precision.scaler is not None:  # fp16: the scale after this step's update
            record["loss_scale"] = self.precision.scaler.get_scale()
        self._window = []
        with open(os.path.join(self.run_dir, METRICS_FILE), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ saving, scoring
    def save(self) -> str:
        self.settle()  # (the applied count is saved; a step that stops the fine-tune is not)
        s = self.session
        return self.checkpoints.save(
            self.step, model=self.raw_model, optimizer_state=self.optimizer.state_dict(),
            extra_state={"scaler": self.precision.state_dict()},
            train_state={"identity": self.identity, "elapsed_seconds": self.elapsed,
                         "applied_steps": self.applied,
                         # the log window's losses so far: a resume's next record averages
                         # the same steps as the uninterrupted fine-tune's
                         "log_window": list(self._window),
                         "world_size": s.world, "num_steps": self.order.num_steps,
                         "model_config": self.raw_model.config.to_dict(),
                         "num_labels": self.raw_model.num_labels},
            config_yaml=self.job.config_yaml, tokenizer_dir=None)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The task's metrics on every evaluation split (all processes take part)."""
        s, acc = self.session, self.session.accelerator
        model = self.raw_model
        model.eval()
        splits = {}
        for key, enc in self.job.evals.items():
            rows = []
            for index in eval_batches(enc, self.tc.eval_batch_size, s.world, s.rank):
                inputs = {k: v.to(acc.device) for k, v in collate(enc, index).items()
                          if k != "labels"}
                with self.precision.autocast():
                    logits = model(**inputs).logits
                rows += list(zip(index.tolist(), logits.float().cpu().numpy()))
            if s.world > 1:
                from accelerate.utils import gather_object

                rows = gather_object(rows)
            logits = np.zeros((len(enc), model.num_labels), dtype=np.float64)
            for i, row in rows:
                logits[i] = row
            splits[key] = (logits, enc.labels)
        model.train()
        return scoring.compute(self.job.data.metrics, splits)

    def _finish(self) -> dict:
        from ..components.checkpoint_manager import checkpoints_root
        from .export import save_classifier

        s = self.session
        self.settle()
        if self.applied == 0:
            raise Diverged(f"no step of the fine-tune was applied (all {self.step} had "
                           f"non-finite gradients, lr {self.lr:g}): its score would be the "
                           f"untrained head's; lower recipe.lrs or use "
                           f"trainer.mixed_precision=no", self.step)
        train_seconds = self.elapsed
        start = time.perf_counter()
        metrics = self.evaluate()
        result = {"lr": self.lr, "seed": self.seed, "metrics": metrics,
                  "score": scoring.task_score(metrics), "steps": self.order.num_steps,
                  "train_seconds": round(train_seconds, 2),
                  "eval_seconds": round(time.perf_counter() - start, 2),
                  "precision": s.precision, "processes": s.world, "identity": self.identity}
        if s.main:
            with open(os.path.join(self.run_dir, METRICS_FILE), "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": self.step, **metrics, "score": result["score"]})
                        + "\n")
            if self.tc.save_model != "none":
                save_classifier(self.raw_model, self.job.data, self.job.pretrained,
                                os.path.join(self.run_dir, MODEL_DIR), self.identity)
            _write_json(os.path.join(self.run_dir, RESULT_FILE), result)
            # A finished fine-tune needs no resume state: result.json marks it done.
            shutil.rmtree(checkpoints_root(self.run_dir), ignore_errors=True)
        s.barrier()
        return result


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


class _NoStop:
    """No signal handlers (train_step called outside `run`, e.g. by a benchmark)."""

    requested = False

    def restore(self) -> None:
        pass
