"""The run's console record: every message bert-train prints also goes, timestamped, to
`<run_dir>/train.log`, so a run that was watched by nobody can be read afterwards.

Messages go through the `bert_pretrain` logger. On the main process it prints them as they are
(information to stdout, warnings to stderr; through tqdm, so a progress bar is not torn) and
appends them to train.log; on the other processes it prints only warnings and errors, prefixed
with the rank. What a run says at its start, at each evaluation and at its end is written here
too (start_lines, eval_line, end_lines), so the trainer only decides when.
"""

import logging
import os
import sys

LOGGER = "bert_pretrain"


class _TqdmConsole(logging.Handler):
    """Information to stdout, warnings and errors to stderr, around any open progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            tqdm.write(self.format(record), file=stream)
            stream.flush()
        except Exception:  # never let logging stop training
            self.handleError(record)


def open_run_log(run_dir: str, main: bool, rank: int = 0) -> logging.Logger:
    """Set up the `bert_pretrain` logger for one run (replacing a previous run's handlers)."""
    log = logging.getLogger(LOGGER)
    close_run_log()
    log.setLevel(logging.INFO)
    log.propagate = False  # Hydra's root handlers would print every line a second time
    console = _TqdmConsole()
    if main:
        console.setFormatter(logging.Formatter("%(message)s"))
        os.makedirs(run_dir, exist_ok=True)
        file = logging.FileHandler(os.path.join(run_dir, "train.log"), encoding="utf-8")
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(file)
    else:
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
    log.addHandler(console)
    return log


def close_run_log() -> None:
    log = logging.getLogger(LOGGER)
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()


# ------------------------------------------------------------------------------ what a run says
def _attention_dropout(t) -> bool:
    """Whether the model trains with attention dropout (it decides the CPU attention path)."""
    config = getattr(t.raw_model, "config", None)
    return getattr(config, "attention_probs_dropout_prob", 0.0) > 0


def _locality(tc):
    """While the training-time locality bias is on, in words (None: never)."""
    if not tc.attention_locality or not tc.attention_locality_end:
        return None
    return (f"first {tc.attention_locality_end:.0%} of "
            f"{'steps' if tc.budget_hours is None else 'the time budget'}")


def start_lines(t) -> list:
    """What bert-train says as trainer `t` starts: the model, data, processes and batches, then
    the precision and CPU settings with the reason for each."""
    import torch

    tc, cfg = t.tc, t.model_cfg
    params = sum(p.numel() for p in t.raw_model.parameters())
    lines = [
        f"bert-train: {cfg.num_hidden_layers} layers x {cfg.hidden_size}, {params / 1e6:.1f}M "
        f"parameters; {t.stream.split.num_instances} training instances; {t.world} "
        f"process(es), global batch {tc.global_batch_size} = {t.world} x {t.micro} x "
        f"{t.accumulation} accumulation; warmup {tc.warmup} steps; run_dir {t.run_dir}"
        + (f"; resumed from {t.resume_path}" if t.resume_path else
           f"; weights from {tc.init_from}" if tc.init_from else "")]
    if getattr(t, "shard_layout", None):
        lines.append(f"bert-train: sharding: {t.shard_layout}")
    from .cpu_runtime import omp_wait_setting

    threads = (f"; {torch.get_num_threads()} CPU threads, {omp_wait_setting()}"
               f"{', freed memory kept' if t.keeps_freed_memory else ''}"
               if t.accelerator.device.type == "cpu" else "")
    lines.append(f"bert-train: precision {t.precision.describe()} ({t.precision.reason}){threads}")
    if t.accelerator.device.type == "cpu" and t.world == 1:
        # One process only: with several on one machine, the siblings are this run's own.
        from .cpu_runtime import busy_machine_warning

        busy = busy_machine_warning(torch.get_num_threads())
        if busy:
            lines.append(f"bert-train: {busy}")
    impl = getattr(t.raw_model, "impl", None)  # (a benchmark may train another model class)
    if impl is not None:
        from ..model.paths import describe

        device = t.accelerator.device.type
        switches = describe(impl, cfg, device, dropout=_attention_dropout(t),
                            locality=_locality(tc))
        read = "ahead by a worker process" if t.stream.prefetch else "on the training thread"
        auto = f" on {device}" if tc.prefetch == "auto" else ""
        if auto and device == "cuda" and not t.stream.prefetch:
            auto += ", in a daemonic process"  # (trainer_config.in_daemonic_process)
        lines.append(f"bert-train: speed switches on {device}: {switches}; batches read {read} "
                     f"(trainer.prefetch={tc.prefetch}{auto})")
    if not cfg.next_sentence_prediction:
        lines.append("bert-train: MLM only (no NSP head"
                     + (": the data has no sentence pairs)" if not t.data.has_nsp else
                        ", model.next_sentence_prediction=false: the data's NSP labels are "
                        "not used)"))
    if cfg.generator_layers:
        lines.append(f"bert-train: ELECTRA replaced-token detection: a {cfg.generator_layers}-"
                     f"layer generator fills the masked positions, the encoder scores every "
                     f"token (x trainer.rtd_loss_weight={tc.rtd_loss_weight:g})")
    if not t.can_evaluate:
        lines.append(f"bert-train: the held-out split {t.s.data.eval_split!r} of {t.s.data.dir} "
                     f"is empty (bert-prep validation_fraction=0): training without evaluation")
    return lines


def already_finished_line(t) -> str:
    return (f"bert-train: {t.run_dir} already finished at step {t.step} (resumed a finished run: "
            f"nothing to train); to train again from scratch delete {t.run_dir} (for the demo: "
            f"make demo-clean), or continue it with a larger trainer.max_steps or "
            f"trainer.budget_hours")


def _nsp_part(result: dict, chance: bool = False) -> str:
    rtd = ""
    if "eval_rtd_accuracy" in result:  # ELECTRA: the encoder's own task (the MLM: generator's)
        rtd = (f", replaced-token detection accuracy {result['eval_rtd_accuracy']:.4f} "
               f"(never answering replaced: {result['eval_rtd_accuracy_baseline']:.4f}; replaced "
               f"tokens found: {result['eval_rtd_recall']:.4f})")
    if "eval_nsp_accuracy" not in result:  # MLM-only
        return rtd
    return rtd + f", NSP accuracy {result['eval_nsp_accuracy']:.4f}" + (
        " (chance: 0.5)" if chance else "")


def eval_line(step: int, result: dict) -> str:
    return (f"bert-train: step {step}: held-out MLM loss {result['eval_mlm_loss']:.4f}, MLM "
            f"accuracy {result['eval_mlm_accuracy']:.4f} ([MASK] positions "
            f"{result.get('eval_mlm_accuracy_masked', float('nan')):.4f}){_nsp_part(result)}")


# From this step on, a held-out MLM accuracy no better than always answering the most frequent
# token is worth a warning: short runs (tests, the demo's first evaluations) are legitimately
# there, and a healthy BERT-mini run on a real corpus is well clear of it by step 250.
STALL_WARNING_STEP = 1000
STALL_MARGIN = 0.01


def stall_warning(step: int, result: dict, baseline: float) -> str | None:
    """The warning for a run still at the unigram level at `step`, else None."""
    accuracy = result.get("eval_mlm_accuracy")
    if step < STALL_WARNING_STEP or accuracy is None or accuracy > baseline + STALL_MARGIN:
        return None
    return (f"bert-train: warning: step {step}: held-out MLM accuracy {accuracy:.4f} is no "
            f"better than always predicting the most frequent token ({baseline:.4f}): the model "
            f"has learned word frequencies only; if later evaluations stay there, the run is "
            f"stuck (seen at too high a learning rate): restart it with a lower optim.lr, or "
            f"with trainer.attention_locality (docs/learning-check.md)")


def detection_stall_warning(step: int, result: dict) -> str | None:
    """ELECTRA's counterpart: the encoder flags (almost) no replaced token at `step`, so it
    has learned only how many tokens are replaced, not which."""
    recall = result.get("eval_rtd_recall")
    if step < STALL_WARNING_STEP or recall is None or recall > STALL_MARGIN:
        return None
    return (f"bert-train: warning: step {step}: the encoder finds {recall:.4f} of the replaced "
            f"tokens (accuracy {result['eval_rtd_accuracy']:.4f}, never answering replaced: "
            f"{result['eval_rtd_accuracy_baseline']:.4f}): it has learned the rate of "
            f"replacements only; if later evaluations stay there, the detector is stuck (seen "
            f"with trainer.rtd_loss_weight 10 and 50 at optim.lr=1e-3): restart with a lower "
            f"trainer.rtd_loss_weight or optim.lr")


def end_lines(t, final: str, baseline) -> list:
    """What bert-train says at the end: where it stopped, the last evaluation against the
    most-frequent-token baseline, and where everything is."""
    state = "stopped" if t.stopped_early else "finished"
    if t.last_eval:
        step, result = t.last_eval
        lines = [f"bert-train: {state} at step {t.step}; eval at step {step}: MLM loss "
                 f"{result['eval_mlm_loss']:.4f}, MLM accuracy {result['eval_mlm_accuracy']:.4f}"
                 f" (always predicting the most frequent token: {baseline:.4f}; at [MASK] "
                 f"positions: {result.get('eval_mlm_accuracy_masked', float('nan')):.4f})"
                 f"{_nsp_part(result, chance=True)}"]
    else:
        lines = [f"bert-train: {state} at step {t.step} (no evaluation)"]
    lines += [f"  checkpoint: {final}",
              f"  metrics:    {t.metrics.path}",
              f"  logs:       {os.path.join(t.run_dir, 'train.log')}, config in "
              f"{os.path.join(final, 'config.yaml')}"]
    if t.metrics.wandb_dir:
        lines.append(f"  wandb:      {t.metrics.wandb_dir}")
    return lines
