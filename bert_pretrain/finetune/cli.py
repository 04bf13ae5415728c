"""`bert-finetune` (and `python -m bert_pretrain.finetune` for `accelerate launch`): the Hydra
entry.

    bert-finetune task=sst2 model=runs/demo
    bert-finetune task=rte model=exported/demo 'recipe.seeds=[1,2,3,4,5]'
    bert-finetune task=custom task.train_file=train.csv task.validation_file=dev.csv \
        'task.text_columns=[review]' model=runs/demo
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

from ..components.cpu_runtime import prefer_passive_omp_wait

prefer_passive_omp_wait()  # before anything below imports torch (libgomp reads it on load)

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from ..cli_errors import (end_launched, interrupted, leave_process_group, precheck,  # noqa: E402
                          prints_here, suggest_from)
from ..errors import UserError  # noqa: E402
from .config import register  # noqa: E402

register()
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "conf", "finetune")


def fail(prog: str, message: str) -> None:
    """One line, exit 2; under a launcher only the main process prints it, every process leaves
    it in its error file (a process other than rank 0 stopping at its own data is named in the
    launcher's report)."""
    end_launched(f"{prog}: error: {message}", 2)


def lost_line(exc: BaseException) -> str | None:
    """The one line for a process of a launched group that lost the others (a peer died, hung,
    or stopped at an error of its own), else None: the exception keeps its traceback."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from ..components.process_group import lost_peers

    words = lost_peers(exc)
    if words is None:
        return None
    # (no backend name: the process group is already destroyed by the fine-tune's `finally`)
    return (f"[rank {os.environ.get('RANK', '0')}] lost the other processes ({words}): another "
            f"process of this job stopped at an error of its own, died or hung, or the network "
            f"failed (its output, or its error file in the launcher's report, says which). Run "
            f"the same command again once that is fixed: finished fine-tunes are kept and the "
            f"one under way continues from its last checkpoint")


def finetune(s, config_yaml: str) -> dict:
    """Fine-tune as `s` (FinetuneSettings) says; returns the grid's summary."""
    from .grid import describe_summary, prepare_job, run_grid, say_main
    from .pretrained import load_pretrained
    from .runner import Session

    session = Session.start(s.trainer, config_yaml, "bert-finetune")
    say = say_main(session)
    try:
        pretrained = load_pretrained(s.model)
        for note in pretrained.warnings(s.recipe.pooling):
            say(f"bert-finetune: warning: {note}")
        job = prepare_job(s, pretrained, config_yaml, say, precision=session.precision)
        cfg = pretrained.config
        say(f"bert-finetune: {job.data.title}: {len(job.train):,} training examples, "
            f"{' + '.join(f'{len(v):,}' for v in job.evals.values())} to score "
            f"({job.data.source}); model {pretrained.source} ({cfg.num_hidden_layers} layers x "
            f"{cfg.hidden_size}, {s.init} weights); {len(s.recipe.lrs)} lr x "
            f"{len(s.recipe.seeds)} seed(s); {session.world} process(es), precision "
            f"{session.precision} ({session.precision_reason}); out_dir {s.out_dir}")
        if session.world == 1 and session.accelerator.device.type == "cpu":
            # as bert-train: other processes' threads on the cores slow every step
            import torch

            from ..components.cpu_runtime import busy_machine_warning

            busy = busy_machine_warning(torch.get_num_threads())
            if busy:
                say(f"bert-finetune: {busy}")
        summary = run_grid(session, job, s.out_dir, say)
        say(f"bert-finetune: {describe_summary(summary)}")
        say(f"  results: {os.path.join(summary['out_dir'], 'finetune.json')}"
            + (f"; model: {summary['model_dir']}" if summary.get("model_dir") else ""))
        return summary
    finally:
        session.accelerator.end_training()


def guarded(prog: str, work):
    """work(), with a UserError as the command's one error line (exit 2) and a lost peer as one
    line per machine (exit 1: not the user's error) instead of gloo's or NCCL's traceback."""
    try:
        return work()
    except UserError as exc:
        fail(prog, str(exc))
    except Exception as exc:
        line = lost_line(exc)
        if line is None:
            raise
        end_launched(f"{prog}: error: {line}", 1, each_machine=True)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="finetune")
def _run(cfg: DictConfig) -> float:
    from .config import finetune_settings

    return guarded("bert-finetune", lambda: finetune(finetune_settings(cfg),
                                                     OmegaConf.to_yaml(cfg, resolve=True))
                   ["score"])


def _model_impl(cfg):
    """impl is free-form in bert-finetune's and bert-glue's trees: ModelImpl's fields."""
    from ..model import ModelImpl

    return ModelImpl


def check_command_line(prog: str, config_name: str, schema) -> None:
    """Compose once before Hydra runs: a misspelt key or option is one line (main process)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            precheck(prog, CONF_DIR, config_name, sys.argv[1:], suggest=suggest_from(schema),
                     schemas={"impl": _model_impl})
    finally:
        if prints_here():
            sys.stderr.write(captured.getvalue())
            sys.stderr.flush()


def interruptible(prog: str, work) -> None:
    """work(), a Ctrl-C that stops it at once (before training, or a second one: the first
    saves) ending in one line.  A process of a launched group then leaves without the
    interpreter's teardown, as bert-train's does: gloo's threads aborted rank 1 of 1 in 20
    finished 2-process fine-tunes there (SIGABRT, which the launcher reports as a crash)."""
    try:
        work()
    except KeyboardInterrupt:
        interrupted(prog, "run the same command again to continue from the last checkpoint "
                          "(one Ctrl-C during training saves the step first)")
    leave_process_group()


def main() -> None:
    from .config import FinetuneConfig

    def work():
        check_command_line("bert-finetune", "finetune", FinetuneConfig)
        _run()

    interruptible("bert-finetune", work)


if __name__ == "__main__":
    main()
