"""The pretraining loop.

`Trainer(settings, ...)` sets up the accelerator, data, model, optimizer and resume state;
`Trainer.fit()` is the loop, in one screen: one optimizer step (`train_step`), logging,
evaluation, saving, the end report. The pieces are methods so that benchmarks and the GPU work
can run one step or one evaluation without copying the loop. Policies live elsewhere: which
checkpoint to resume from and which to keep (checkpoint_manager.py), precision and loss scaling
(precision.py), what a resume may change (resume.py), the settings (trainer_config.py).

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
import time
from typing import Optional

import numpy as np
import torch

from .errors import ConfigError, TrainingError, UserError
from .components import fault_point
from .components.evaluation import evaluate, majority_baseline, model_inputs
from .components.trainer_config import MIXED_PRECISION, TrainerConfig  # noqa: F401 (re-exported)


def dropout_seed(seed: int, step: int, micro_index: int) -> int:
    """A seed per (step, global micro-batch): dropout masks do not depend on the world size or
    on what ran before, so resumes and N-process runs reproduce single-process runs with the
    same micro-batch size (another size cuts the global batch, and so the masks, otherwise)."""
    from .components.data import hash_uniform

    return int(hash_uniform(seed, 4, np.int64(step), np.int64(micro_index), np.int64(0))
               * (1 << 53))


def _held(name: str, doc: str) -> property:
    return property(lambda self: self.settle()._held[name], doc=doc)


class StepResult:
    """One optimizer step, over the global batch (identical on every process).

    A step of a run that defers its reads (`Trainer.defer_reads`) holds its losses, gradient
    norm and `updated` as tensors on the device; `settle` (or the first read of any of them)
    brings them to the host. The trainer settles at each log, checkpoint and stop, so a GPU
    waits for the host there rather than at every step."""

    def __init__(self, loss, mlm_loss, nsp_loss, num_tokens: int, grad_norm, updated,
                 stop_requested: bool, seconds: float = 0.0, step: int = 0):
        self._held = {"loss": loss, "mlm_loss": mlm_loss, "nsp_loss": nsp_loss,
                      "grad_norm": grad_norm, "updated": updated}
        self.num_tokens = num_tokens
        """Non-padding tokens of the global batch."""
        self.stop_requested = stop_requested
        """Some process got SIGTERM/SIGINT during the step."""
        self.seconds = seconds
        """Wall time of the step on this process (data, forward, backward, update)."""
        self.step = step
        """The step count after this step."""

    @property
    def held(self) -> bool:
        """Whether some of the step's numbers are still on the device, not yet read."""
        return any(isinstance(v, torch.Tensor) for v in self._held.values())

    def settle(self) -> "StepResult":
        """The held tensors as Python numbers (one wait for the device, the first time)."""
        for key, value in self._held.items():
            if isinstance(value, torch.Tensor):
                self._held[key] = bool(value) if key == "updated" else value.item()
        return self

    loss = _held("loss", "mlm_loss + nsp_loss (+ the ELECTRA discriminator's loss).")
    mlm_loss = _held("mlm_loss", "The MLM loss of the global batch.")
    nsp_loss = _held("nsp_loss", "The NSP loss, or None for an MLM-only model.")
    grad_norm = _held("grad_norm", "The global gradient norm before clipping.")
    updated = _held("updated", "False when the step was skipped (non-finite loss or gradient "
                               "norm).")


class Trainer:
    def __init__(self, s, resolved_config: dict, config_yaml: str):
        """Set up everything `fit` needs; a bad setting fails here, before anything is written
        (except the run directory's log once the configuration is known to be usable)."""
        from .components.metrics import LogWindow
        from .components.trainer_config import NO_MAIN_GUARD, in_spawn_start_up

        if in_spawn_start_up():  # (before anything: its run folder, its lock, a model)
            raise SystemExit(NO_MAIN_GUARD)
        self.s, self.tc = s, s.trainer
        self.resolved_config, self.config_yaml = resolved_config, config_yaml
        self.window = LogWindow()
        self.run_lock = None
        self._setup_accelerator()
        self._setup_data()
        self._setup_model()
        self._check_objective()
        try:
            self._setup_run()
            self._setup_optimizer_and_resume()
        except BaseException:  # refused: the run folder is free for the next command at once
            if self.run_lock is not None:
                self.run_lock.release()
            raise
        # Loop state; `fit` adds the progress bar and the signal handlers.
        self.stop, self.bar, self.stopped_early, self.nonfinite = None, None, False, 0
        self.pending = []  # steps not yet settled (read on the host): see `settle`
        for note in self.import_notes:
            self._warn_job(f"bert-train: warning: {note}")
        self.clock = time.perf_counter() - self.elapsed  # elapsed counts training time only
        self.lr = float("nan")

    # ------------------------------------------------------------------ set-up
    def _setup_accelerator(self) -> None:
        from .components.precision import Precision
        from .components.run_setup import check_same_settings, make_accelerator
        from .components.sharding import resolve_sharding

        acc, self.keeps_freed_memory = make_accelerator(self.tc)
        self.accelerator = acc
        self.world, self.rank, self.main = acc.num_processes, acc.process_index, \
            acc.is_main_process
        check_same_settings(self.resolved_config, self.world)  # (as the command gave them)
        self.sharded = resolve_sharding(self.tc.sharding, self.world)
        self.shard_layout = None  # the start-up line's description, once sharded
        self.precision = Precision.resolve(self.tc.mixed_precision, acc.device.type)
        self._record_resolved_precision()

    def _record_resolved_precision(self) -> None:
        """trainer.mixed_precision=auto becomes what it means on this machine, in the settings
        and in the config saved with checkpoints: a resume on a machine that resolves it
        differently is then named as a changed setting."""
        self.tc.mixed_precision = self.precision.mode
        trainer_config = self.resolved_config.get("trainer", {})
        if trainer_config.get("mixed_precision") not in (None, self.precision.mode):
            from omegaconf import OmegaConf

            trainer_config["mixed_precision"] = self.precision.mode
            self.config_yaml = OmegaConf.to_yaml(OmegaConf.create(self.resolved_config))

    def _setup_data(self) -> None:
        from .components.run_setup import open_training_data

        # (the log is opened later, in _setup_model; a lost worker is reported while training)
        self.data, self.stream = open_training_data(
            self.s, self.world, self.rank, self.accelerator.device.type,
            warn=lambda m: self.log.warning(f"bert-train: warning: step {self.step + 1}: {m}"))
        self.micro, self.accumulation = self.stream.micro_batch_size, \
            self.stream.accumulation_steps
        eval_info = self.data.manifest["splits"].get(self.s.data.eval_split)
        # bert-prep validation_fraction=0 writes an empty held-out split: train without
        # evaluation rather than refuse the data.
        self.can_evaluate = not (eval_info and int(eval_info.get("num_instances", 1)) == 0)
        if self.can_evaluate:
            self.data.split(self.s.data.eval_split)  # fail now, not at the first evaluation

    def _setup_model(self) -> None:
        from .components.run_setup import build_model

        self.model_cfg, self.raw_model, self.hf_state, self.import_notes = \
            build_model(self.s, self.data)

    def _check_objective(self) -> None:
        objective = getattr(self.s, "objective", "eval_mlm_loss")
        if not self.model_cfg.next_sentence_prediction and (
                objective.startswith("eval_nsp") or objective == "eval_loss"):
            raise ConfigError(f"objective={objective} needs next-sentence prediction, which this "
                              f"MLM-only model does not do; use objective=eval_mlm_loss or "
                              f"eval_mlm_accuracy")
        if self.model_cfg.generator_layers and self.sharded:
            # FSDP2 wraps the encoder's layers; a generator would sit unwrapped in the root
            # unit, a layout no test has run.
            raise ConfigError("model.generator_layers > 0 (ELECTRA) is not supported with FSDP "
                              "(trainer.sharding resolved to fsdp); use trainer.sharding=ddp")

    def _setup_run(self) -> None:
        from .components.checkpoint_manager import CheckpointManager
        from .components.resume import check_seed, saved_config
        from .components.run_setup import check_shared_run_dir
        from .components.runlog import open_run_log

        s = self.s
        self.run_dir = s.run_dir
        self.log = open_run_log(self.run_dir, self.main, self.rank)
        self.checkpoints = CheckpointManager(self.run_dir, self.tc.keep_last_k, self.rank,
                                             barrier=self.accelerator.wait_for_everyone,
                                             warn=lambda m: self.log.warning(
                                                 f"bert-train: warning: {m}"))
        # The main process locks the run folder (a second bert-train into it stops here, before
        # repair() could remove the temp files of the first one's save in progress), repairs
        # interrupted saves, then finds and verifies the checkpoint (hashing every file), and
        # tells the others.  Rank 0 of the whole job only: the folder is shared by every node.
        found = [None, None, None]  # path, or the error every process must raise; the stamp
        if self.main:
            try:
                from .components.folder_lock import lock_folder

                self.run_lock = lock_folder(self.run_dir, "bert-train")
                found[2] = self.run_lock.stamp()  # (the others look for it: check_shared_run_dir)
                self.checkpoints.repair()
                found[0] = self.checkpoints.find(s.resume)
            except UserError as exc:
                found[1] = exc
        if self.world > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(found)
        if found[1] is not None:
            raise found[1]
        check_shared_run_dir(self.run_dir, found[2], self.world)
        self.resume_path = found[0]
        self.saved_config = saved_config(self.resume_path) if self.resume_path else None
        if self.resume_path:
            check_seed(self.saved_config, s.seed, self.resume_path)

    def _setup_optimizer_and_resume(self) -> None:
        from .components import checkpoint as ckpt
        from .components.metrics import Metrics, NullMetrics, eval_record_at
        from .components.optim import Schedule, build_optimizer
        from .components.checkpoint_manager import init_checkpoint
        from .components.resume import apply_hyperparameters

        s, tc, acc = self.s, self.tc, self.accelerator
        self.state = {"step": 0, "tokens_seen": 0, "samples_consumed": 0, "elapsed_seconds": 0.0}
        source = self.resume_path or tc.init_from
        from_shards = False  # sharded weights read into a sharded model: after sharding it
        if source and self.hf_state is not None and not self.resume_path:
            self.raw_model.load_state_dict(self.hf_state, strict=True)
        elif source:
            # resume: the main process verified it (find) and told the others; an init_from
            # checkpoint is verified by every process before it loads the weights
            init = not self.resume_path
            if init:
                source = init_checkpoint(source)
            saved = ckpt.read_train_state(source, verify=init)
            ckpt.check_compatible(source, saved, self.model_cfg.to_dict(),
                                  self.data.tokenizer_sha256, init=init)
            from_shards = self.sharded and ckpt.is_sharded(saved)
            if not from_shards:
                ckpt.load_weights(source, self.raw_model, nsp_may_differ=init)
            if self.resume_path:
                self.state.update({k: saved[k] for k in self.state})
        if self.sharded:
            self._shard_model()
            self.model = self.raw_model
            self.optimizer = build_optimizer(s.optim, self.raw_model.named_parameters())
            if from_shards and not self.resume_path:
                from .components.sharded_checkpoint import load_model_shards, SHARDED_DIR

                load_model_shards(os.path.join(source, SHARDED_DIR), self.raw_model)
        else:
            optimizer = build_optimizer(s.optim, self.raw_model.named_parameters())
            self.model, self.optimizer = acc.prepare(self.raw_model, optimizer)
        # One process whose optimizer can skip a non-finite step on the device: a step need not
        # wait for the device to finish before the host prepares the next (collectives of
        # several processes, a loss scaler and LAMB read their numbers on the host each step).
        self.defer_reads = tc.defer_reads and self.world == 1 and not self.sharded and \
            self.precision.defers_reads(self.optimizer)
        self.schedule = Schedule(s.scheduler, tc.max_steps, tc.warmup,
                                 tc.budget_hours * 3600 if tc.budget_hours else None)
        self.step, self.tokens_seen = self.state["step"], self.state["tokens_seen"]
        if self.resume_path:
            self._warn_changed_settings()
            fresh = [dict(g) for g in self.optimizer.param_groups]
            opt_state, extra, rng = ckpt.load_states(self.resume_path, self.rank)
            self._load_optimizer_state(opt_state)
            apply_hyperparameters(self.optimizer, fresh)
            self.schedule.load_state_dict(extra["schedule"])
            self.precision.load_state_dict(extra.get("scaler"))
            if extra.get("log_window"):
                self.window.load_state_dict(extra["log_window"])
            if rng is not None:
                ckpt.set_rng_state(rng)
        self.elapsed = self.state["elapsed_seconds"]
        self.stream.position.samples_consumed = self.state["samples_consumed"]
        self.last_eval = None
        if self.resume_path:
            logged = eval_record_at(self.run_dir, self.step)
            self.last_eval = (self.step, logged) if logged else None
        if self.main:  # everything checked: from here on the run directory changes
            self.checkpoints.begin(self.resume_path)
        acc.wait_for_everyone()  # every rank has read metrics.jsonl before it changes
        self.metrics = (Metrics(s.logger, self.run_dir, s.name, self.resolved_config,
                                self.step if self.resume_path else None)
                        if self.main else NullMetrics())
        self.last_saved = self.step if self.resume_path else None
        self.last_checkpoint = self.resume_path

    def _shard_model(self) -> None:
        """FSDP2 on the model, in place (components/sharding.py): accelerate joins the
        processes, never wraps the model. fully_shard moves each unit to the device as it
        shards it, so a GPU never holds the whole model at once."""
        from .components.sharding import ensure_process_group, shard_model

        self.own_process_group = ensure_process_group(self.accelerator.device)
        self.shard_layout = shard_model(self.raw_model, self.accelerator.device, self.world)

    def _load_optimizer_state(self, opt_state) -> None:
        """The resumed optimizer state, whatever layout wrote it: a whole state into a whole
        optimizer, a whole state into a sharded one (each process keeps its shards), or shards
        (with the weights) into either."""
        from .components import sharded_checkpoint as shards

        raw_optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        if opt_state is None:  # a sharded checkpoint: model and optimizer from its shards
            shards.load_training_shards(os.path.join(self.resume_path, shards.SHARDED_DIR),
                                        self.raw_model, raw_optimizer)
        elif self.sharded:
            shards.load_whole_optimizer(self.raw_model, raw_optimizer, opt_state)
        else:
            self.optimizer.load_state_dict(opt_state)

    def _warn_changed_settings(self) -> None:
        from .components.resume import changed_settings_warning

        new_lr = None if self.tc.budget_hours is not None else \
            self.s.optim.lr * self.schedule.factor(self.step)
        line = changed_settings_warning(self.resume_path, self.saved_config,
                                        self.resolved_config, self.step, new_lr,
                                        getattr(self.stream.masker, "prep_prob", None))
        if line:
            self._warn_job(line)

    def _warn_job(self, line: str) -> None:
        """A warning about the whole job (the same on every process: a resume's changed
        settings, a stalled held-out accuracy), printed once, by the main process; a process's
        own trouble (its prefetching worker lost) is printed by that process, with its rank."""
        if self.main:
            self.log.warning(line)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> float:
        """Train until max_steps or the budget; returns the final held-out `objective` (by
        default the MLM loss)."""
        tc = self.tc
        self._start_loop()
        try:
            if self._finished():
                from .components.runlog import already_finished_line

                self.log.info(already_finished_line(self))
            else:
                self.stream.start_prefetching()  # (its start-up overlaps the first step's)
            while not self._finished():
                result = self.train_step()
                self.log_step(result)
                fault_point.reached("logged", self.step, self.rank)
                paused = time.perf_counter()  # evaluation and saving do not eat the budget
                if tc.eval_every and self.step % tc.eval_every == 0 and self.can_evaluate:
                    self.run_evaluation(intermediate=not self._finished())
                if self.step % tc.checkpoint_every == 0:
                    self.settle()
                    if result.updated:
                        self.save()
                self.clock += time.perf_counter() - paused
                if result.stop_requested:
                    self.log.info(f"bert-train: stop requested: saving at step {self.step} and "
                                  f"exiting; continue with resume=auto")
                    self.stopped_early = True
                    break
            self.bar.close()
            return self.finish()
        except Exception as exc:
            from .components.process_group import PeersLost, lost_line, lost_peers

            words = lost_peers(exc) if self.world > 1 else None
            if words is None:
                raise
            raise PeersLost(lost_line(self.rank, self.step, words,
                                      tc.process_group_timeout_s, self.last_saved)) from exc
        finally:
            self.close()

    def _finished(self) -> bool:
        budget = self.tc.budget_hours * 3600 if self.tc.budget_hours else None
        return self.step >= self.tc.max_steps or bool(budget and self.elapsed >= budget)

    def _start_loop(self) -> None:
        from .components.progress import progress_bar
        from .components.runlog import start_lines
        from .components.stop_request import StopRequest

        tc = self.tc
        for line in start_lines(self):
            self.log.info(line)
        self.stop = StopRequest()
        budget = tc.budget_hours * 3600 if tc.budget_hours else None
        self.bar_values = {}  # the last logged values the bar shows (log_step)
        # In budget mode the bar counts seconds of the budget, so its ETA is the real one.
        self.bar = progress_bar(round(budget) if budget else tc.max_steps, desc="train",
                                unit="s" if budget else "step",
                                initial=round(self.elapsed) if budget else self.step,
                                enabled=self.main and tc.progress_bar)
        self.clock = time.perf_counter() - self.elapsed
        self.model.train()

    # ------------------------------------------------------------------ one step
    def train_step(self) -> StepResult:
        """One optimizer step on the next global batch: this process's micro-batches, forward
        and backward each, then clip and update (or skip, if anything is non-finite)."""
        from .components.data import IGNORE_INDEX
        from .components.optim import set_lr

        started = time.perf_counter()
        acc, tc, precision = self.accelerator, self.tc, self.precision
        nsp_on = self.model_cfg.next_sentence_prediction
        # (a batch warmup scales the lr with the batch, data_schedules.BatchRamp.lr_factor)
        lr = self.s.optim.lr * self.schedule.factor(self.step, self.elapsed) * \
            self.stream.lr_factor()
        set_lr(self.optimizer, lr)
        self.lr = lr
        progress = tc.progress(self.step, self.elapsed)
        self._set_locality(tc.locality_strength(self.step, self.elapsed))
        self.batch_size = self.stream.batch_size()
        self.masking_rate = self.stream.masking_rate(progress)
        batches = self.stream.next_step(progress)
        # The global batch's counts, known before any forward pass: the normalisers of its loss.
        # (The batches are still on the host: one process needs no device round trip, which on
        # a GPU would wait for the previous step's optimizer before launching this forward.)
        labelled = [int((b["labels"] != IGNORE_INDEX).sum()) for b in batches]
        counts = [float(sum(labelled)),
                  float(sum(int(b["next_sentence_label"].numel()) for b in batches)
                        if nsp_on else 0),
                  float(sum(int(b["num_tokens"]) for b in batches))]
        if self.world > 1:
            counts = acc.reduce(torch.tensor(counts, dtype=torch.float64, device=acc.device),
                                reduction="sum").tolist()
        num_mlm, num_nsp, num_real = (max(c, 1.0) for c in counts)
        sums = torch.zeros(4, dtype=torch.float64, device=acc.device)  # mlm, nsp, stop, rtd
        for j, batch in enumerate(batches):
            # (len(batches): this step's accumulation, the same on every process)
            torch.manual_seed(dropout_seed(self.s.seed, self.step, self.rank * len(batches) + j))
            inputs = model_inputs(batch, acc.device, nsp_on)
            last = j == len(batches) - 1
            # (FSDP2 reduce-scatters every micro-batch's gradients: skipping that would hold
            # whole unsharded gradients between micro-batches, the memory sharding saves)
            with contextlib.nullcontext() if last or self.sharded else acc.no_sync(self.model):
                with precision.autocast():
                    out = self.model(**inputs, loss_reduction="sum", num_labelled=labelled[j],
                                     **({"num_real": int(batch["num_tokens"])}
                                        if self.model_cfg.generator_layers else {}))
                # x world: DDP and FSDP average gradients over processes, the global batch
                # sums them.
                loss = out.mlm_loss * (self.world / num_mlm)
                if out.nsp_loss is not None:
                    loss = loss + out.nsp_loss * (tc.nsp_loss_weight * self.world / num_nsp)
                if out.rtd_loss is not None:
                    loss = loss + out.rtd_loss * (tc.rtd_loss_weight * self.world / num_real)
                acc.backward(precision.scale(loss))
            if j == 0:
                fault_point.reached("step", self.step + 1, self.rank)
            sums[0] += out.mlm_loss.detach().double()
            if out.nsp_loss is not None:
                sums[1] += out.nsp_loss.detach().double()
            if out.rtd_loss is not None:
                sums[3] += out.rtd_loss.detach().double()
        stop = bool(self.stop is not None and self.stop.requested)
        if self.defer_reads:
            # Nothing below needs the loss on the host: the skip of a non-finite step happens
            # on the device (precision.step_on_device), and the numbers are read at the next
            # log, checkpoint or stop (`settle`). The same arithmetic as the branch below, in
            # float64 on the device, so the logged values are the same to the last bit.
            mlm, nsp, rtd = sums[0] / num_mlm, sums[1] / num_nsp, sums[3] / num_real
            loss = mlm + nsp + rtd
            grad_norm = self._grad_norm(on_device=True)
            updated = torch.isfinite(loss) & torch.isfinite(grad_norm)
            precision.step_on_device(self.optimizer, updated)
        else:
            sums[2] = float(stop)
            if self.world > 1:
                sums = acc.reduce(sums, reduction="sum")
            mlm, nsp, rtd = (sums[0].item() / num_mlm, sums[1].item() / num_nsp,
                             sums[3].item() / num_real)
            loss = mlm + nsp + rtd
            precision.unscale(self.optimizer)
            grad_norm = self._grad_norm()
            updated = precision.step(self.optimizer,
                                     finite=math.isfinite(loss) and math.isfinite(grad_norm))
            stop = sums[2].item() > 0
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        num_tokens = int(counts[2])
        self.tokens_seen += num_tokens
        self._advance_clock()
        return StepResult(loss, mlm, nsp if nsp_on else None, num_tokens, grad_norm, updated,
                          stop, time.perf_counter() - started, self.step)

    def _advance_clock(self) -> None:
        """Training time so far. With a time budget every process must agree on it (it drives
        the lr, the locality fade, the masking rate and when training stops): the slowest
        process's clock counts."""
        self.elapsed = time.perf_counter() - self.clock
        if self.world > 1 and self.tc.budget_hours is not None:
            import torch.distributed as dist

            t = torch.tensor([self.elapsed], dtype=torch.float64, device=self.accelerator.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            self.elapsed = t.item()

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

    def _grad_norm(self, on_device: bool = False):
        """The global gradient norm (after DDP's all-reduce and unscaling), clipped to
        max_grad_norm if set: a float, or with `on_device` the 0-d tensor, not read.  Sharded
        gradients are DTensors: torch's norm of them is the norm over every process's shards
        (a DTensor until reduced, full_value)."""
        from .components.sharding import full_value

        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.tc.max_grad_norm is not None:
            if self.sharded:
                norm = full_value(torch.nn.utils.clip_grad_norm_(params, self.tc.max_grad_norm))
            else:
                norm = self.accelerator.clip_grad_norm_(params, self.tc.max_grad_norm)
        else:
            grads = [p.grad for p in params]
            if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
                norm = full_value(torch.nn.utils.get_total_norm(grads))
            else:
                norm = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        return norm if on_device else float(norm)

    def settle(self) -> None:
        """Bring the steps since the last settle to the host, in order: the log window's sums
        and the count of consecutive skipped steps (which may stop the run). Any wait for the
        device here counts as training time of the last step."""
        if not self.pending:
            return
        started = time.perf_counter()
        for result in self.pending:
            result.settle()
        self.pending[-1].seconds += time.perf_counter() - started
        pending, self.pending = self.pending, []
        for result in pending:
            self.window.add(result.loss, result.mlm_loss, result.nsp_loss or 0.0, result.updated,
                            result.num_tokens, result.seconds)
            self._count_nonfinite(result)

    def _count_nonfinite(self, result: StepResult) -> None:
        """A run that keeps producing inf/nan stops with its last good checkpoint intact rather
        than overwriting it; skipped steps leave the weights as they were. (With deferred reads
        the stop comes at the next settle; nothing is saved before it.)"""
        if result.updated:
            self.nonfinite = 0
            return
        self.nonfinite += 1
        if self.nonfinite >= self.precision.nonfinite_limit(self.tc.max_nonfinite_steps):
            raise TrainingError(
                f"the loss or gradient norm was non-finite for {self.nonfinite} consecutive "
                f"steps (step {result.step}); last good checkpoint: "
                f"{self.checkpoints.latest(verify=False) or 'none'}; lower optim.lr, raise "
                f"trainer.warmup_steps or set trainer.max_grad_norm, then resume=auto"
            )

    # ------------------------------------------------------------------ logging
    def log_step(self, result: StepResult) -> None:
        """Average the window's steps into one metrics.jsonl record every log_every steps."""
        tc = self.tc
        self.pending.append(result)
        if not self.defer_reads:  # the numbers are on the host already: count the step now
            self.settle()
        budget = tc.budget_hours * 3600 if tc.budget_hours else None
        if self.bar is not None:
            if budget:  # the bar counts seconds; the step beside them is this one, every step
                self.bar.set_postfix(step=self.step, **self.bar_values, refresh=False)
            self.bar.update(min(round(self.elapsed), round(budget)) - self.bar.n if budget else 1)
        # The last step is logged whatever its number (a budget ends anywhere), so the final
        # record carries the run's total time and tokens.
        if self.step % tc.log_every and not (self._finished() or result.stop_requested):
            return
        self.settle()
        record = {"step": self.step, **self.window.averages(), "lr": self.lr,
                  "tokens_seen": self.tokens_seen, "epoch": round(self.stream.epoch, 4),
                  "elapsed_s": round(self.elapsed, 2)}
        if result.grad_norm is not None:
            record["grad_norm"] = result.grad_norm
        if result.nsp_loss is None:  # an MLM-only model: there is no NSP loss to log
            del record["nsp_loss"]
        if self.stream.ramp.start != self.stream.ramp.final:  # a batch warmup
            record["global_batch_size"] = self.batch_size
        if self.s.data.masked_lm_prob_start is not None:  # a masking-rate schedule
            record["masked_lm_prob"] = round(self.masking_rate, 6)
        if tc.attention_locality:
            record["attention_locality"] = round(self.locality * tc.attention_locality, 6)
        if self.nonfinite:
            record["nonfinite_steps"] = self.nonfinite
        self.metrics.log(record)
        if self.bar is not None:
            # (the bar counts the steps, or in budget mode the seconds beside this step: one
            # counter, never the last logged step beside the current one)
            self.bar_values = dict(lr=f"{self.lr:.2e}", loss="skipped" if record["loss"] is None
                                   else f"{record['loss']:.3f}",
                                   tok_s=f"{record['tokens_per_s']:.0f}")
            self.bar.set_postfix(**({"step": self.step} if budget else {}), **self.bar_values)
        self.window.reset()

    # ------------------------------------------------------------------ evaluation
    def run_evaluation(self, intermediate: bool = False) -> dict:
        """Evaluate the current weights on the held-out split (every process takes part)."""
        from .components.data import eval_batches
        from .components.progress import progress_bar

        tc, split = self.tc, self.data.split(self.s.data.eval_split)
        size = tc.eval_batch_size or self.micro
        training_locality = getattr(self, "locality", 0.0)
        self._set_locality(0.0)  # score the model an export computes
        total = split.num_instances if tc.eval_max_samples is None else \
            min(tc.eval_max_samples, split.num_instances)
        lockstep = None
        if self.sharded:
            from .components.sharding import eval_forward_passes

            lockstep = (eval_forward_passes(total, size, self.world),
                        next(eval_batches(self.data, self.s.data, size, 1, 0, 1)))
        bar = progress_bar(len(range(self.rank * size, total, self.world * size)), desc="eval",
                           unit="batch", leave=False, enabled=self.main and tc.progress_bar)
        fault_point.reached("eval", self.step, self.rank)
        result = evaluate(self.accelerator.unwrap_model(self.model), self.accelerator,
                          eval_batches(self.data, self.s.data, size, self.world, self.rank,
                                       tc.eval_max_samples), progress=bar,
                          mask_id=self.data.special.get("mask"),
                          autocast=self.precision.autocast, lockstep=lockstep)
        bar.close()
        self._set_locality(training_locality)
        self.metrics.log({"step": self.step, **result, "elapsed_s": round(self.elapsed, 2)})
        if intermediate:
            from .components.runlog import eval_line

            self.log.info(eval_line(self.step, result))
        self._warn_if_stalled(result)
        self.last_eval = (self.step, result)
        return result

    def _warn_if_stalled(self, result: dict) -> None:
        """Once per run: a warning when the held-out MLM accuracy is still at the level of
        always predicting the most frequent token after runlog.STALL_WARNING_STEP steps (a
        run at too high a rate stays there for good; it logged nothing out of the ordinary);
        once more when an ELECTRA encoder still finds no replaced token."""
        from .components.runlog import (STALL_WARNING_STEP, detection_stall_warning,
                                        stall_warning)

        if self.step < STALL_WARNING_STEP:
            return
        warned = self.__dict__.setdefault("stall_warned", set())
        if "mlm" not in warned:
            if not hasattr(self, "unigram_baseline"):
                self.unigram_baseline = majority_baseline(self.data, self.s.data.eval_split)
            line = stall_warning(self.step, result, self.unigram_baseline)
            if line:
                self._warn_job(line)
                warned.add("mlm")
        line = None if "rtd" in warned else detection_stall_warning(self.step, result)
        if line:
            self._warn_job(line)
            warned.add("rtd")

    # ------------------------------------------------------------------ saving
    def save(self) -> str:
        """Checkpoint the whole run state (every process takes part; rank 0 writes)."""
        from .components.sharding import all_finite

        unwrapped = self.accelerator.unwrap_model(self.model)
        if not all_finite(unwrapped, self.world):
            # Never label a poisoned state a checkpoint: resume=auto would pick it.
            raise TrainingError(
                f"the weights hold inf/nan at step {self.step}; not saving them; last good "
                f"checkpoint: {self.checkpoints.latest(verify=False) or 'none'}"
            )
        tc = self.tc
        if self.sharded:  # every process writes its own shards (sharded_checkpoint.py)
            from .components.sharded_checkpoint import save_shards
            from .components.sharding import gather_objects

            weights = {"model": None, "optimizer_state": None, "gather": gather_objects,
                       "shards": lambda folder: save_shards(folder, unwrapped, self.optimizer)}
        else:
            weights = {"model": unwrapped, "optimizer_state": self.optimizer.state_dict()}
        self.last_checkpoint = self.checkpoints.save(
            self.step, **weights,
            extra_state={"schedule": self.schedule.state_dict(),
                         "scaler": self.precision.state_dict(),
                         "log_window": self.window.state_dict()},
            train_state={"tokens_seen": self.tokens_seen,
                         "samples_consumed": self.stream.position.samples_consumed,
                         "elapsed_seconds": self.elapsed, "epoch": self.stream.epoch,
                         "world_size": self.world, "global_batch_size": tc.global_batch_size,
                         "model_config": self.model_cfg.to_dict(),
                         "tokenizer_sha256": self.data.tokenizer_sha256},
            config_yaml=self.config_yaml, tokenizer_dir=self.data.tokenizer_dir)
        self.last_saved = self.step
        fault_point.reached("saved", self.step, self.rank)
        return self.last_checkpoint

    # ------------------------------------------------------------------ start and end
    def finish(self) -> float:
        """Save (first: preemption grace periods are short), evaluate unless preempted, report."""
        from .components.runlog import end_lines

        final = self.save() if self.last_saved != self.step else self.last_checkpoint
        if self.can_evaluate and not self.stopped_early and (
                self.last_eval is None or self.last_eval[0] != self.step):
            self.run_evaluation()
        result = self.last_eval[1] if self.last_eval else {"eval_mlm_loss": float("nan")}
        baseline = majority_baseline(self.data, self.s.data.eval_split) if self.last_eval else None
        for line in end_lines(self, final, baseline):
            self.log.info(line)
        if self.main and self.s.downstream.enabled and not self.stopped_early:
            # Only the main process fine-tunes (a child process of its own): the others must
            # not wait in a collective for the minutes it takes. Its scores go to metrics.jsonl
            # (the sweep summary reads them) and may be the sweeper's objective.
            from .finetune.downstream import downstream_score

            scores = downstream_score(final, self.s.downstream,
                                      os.path.join(self.run_dir, "downstream"),
                                      log=self.log.info)
            self.metrics.log({"step": self.step, **scores})
            result = {**result, **scores}
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
        from .tools.report import write_run_report

        try:
            self.log.info(f"  report:     {write_run_report(self.run_dir)}")
        except Exception as exc:  # plotting back-ends, fonts, a full disk: say it, go on
            self.log.warning(f"bert-train: warning: no run report ({str(exc).splitlines()[0]}); "
                             f"draw it later with bert-report {self.run_dir}")

    def close(self) -> None:
        """Release the log, the progress bar, signal handlers, metrics and the accelerator."""
        from .components.runlog import close_run_log

        if self.bar is not None:
            self.bar.close()
        if self.stop is not None:
            self.stop.restore()
        if getattr(self, "stream", None) is not None:
            self.stream.close()  # (its prefetching worker)
        self.metrics.close()
        close_run_log()
        self.accelerator.end_training()
        if self.run_lock is not None:
            self.run_lock.release()
        import torch.distributed as dist

        # (accelerate's end_training destroys the default group on its own in some versions)
        if getattr(self, "own_process_group", False) and dist.is_initialized():
            dist.destroy_process_group()


def _has_results(run_dir: str) -> bool:
    return any(os.path.exists(os.path.join(run_dir, name))
               for name in ("checkpoints", "metrics.jsonl", "wandb"))


def remove_unused_run_dir(run_dir: str, created: Optional[str]) -> None:
    """A run that failed before training leaves no directory behind: the folders it made
    (`created`: the outermost of them; None: it made none), when they hold only what its log
    and lock wrote, never anything with results, nor a folder another live bert-train holds.
    Under a launcher the main process does it, and the others must not race it."""
    from .components.folder_lock import LOCK_FILE, FolderBusy, lock_folder

    if os.environ.get("RANK", "0") != "0" or created is None or not os.path.isdir(run_dir):
        return
    try:
        if _has_results(run_dir) or not set(os.listdir(run_dir)) <= {"train.log", LOCK_FILE}:
            return
        try:
            lock_folder(run_dir, "bert-train").release()
        except FolderBusy:  # another run started in it meanwhile: it is that run's
            return
        shutil.rmtree(run_dir, ignore_errors=True)
        parent = os.path.dirname(os.path.abspath(run_dir))
        while len(parent) >= len(created) and os.path.isdir(parent) and not os.listdir(parent):
            os.rmdir(parent)
            parent = os.path.dirname(parent)
    except OSError:  # cleaning up is a courtesy: never let it hide the real error
        pass


def train(s, resolved_config: dict, config_yaml: str) -> float:
    """Run pretraining as configured by `s` (config.Settings); returns the final objective."""
    from .command_record import write_record
    from .components.folder_lock import FolderBusy, first_missing

    created = first_missing(s.run_dir)
    try:
        trainer = Trainer(s, resolved_config, config_yaml)
    except Exception as exc:
        from .components.process_group import PeersLost, lost_line, lost_peers
        from .components.runlog import close_run_log

        # another process stopped in its start-up (its own error) or hung: this one's
        # collective fails; one line and nothing left, as for a refusal
        world = int(os.environ.get("WORLD_SIZE", "1"))
        words = lost_peers(exc) if world > 1 and not isinstance(exc, UserError) else None
        if words is None and not isinstance(exc, UserError):
            raise
        close_run_log()
        if not isinstance(exc, FolderBusy):  # (busy: the folder is the other run's)
            remove_unused_run_dir(s.run_dir, created)
        if words is not None:
            raise PeersLost(lost_line(int(os.environ.get("RANK", "0")), None, words,
                                      s.trainer.process_group_timeout_s, None)) from exc
        raise
    if trainer.main:  # the run folder is this run's now (new, or continued by resume)
        write_record(s.run_dir, trainer.config_yaml, replace=True)
    return trainer.fit()
