"""`bert-train` (and `python -m bert_pretrain.train` for `accelerate launch`): the Hydra entry.

    bert-train experiment=demo
    bert-train model=bert_base data.dir=prepared/wiki128 optim=lamb trainer.max_steps=100000
    bert-train experiment=bert_base_phase1 resume=auto

Returns the final held-out MLM loss, which Hydra's Optuna sweeper minimises.
"""

import contextlib
import io
import os
import sys

if not __package__:  # (run as a file: the relative imports below would end in a traceback)
    print("bert-train: error: bert_pretrain/train.py is a module of the package, not a script: "
          "run bert-train ..., python -m bert_pretrain.train ..., or a launcher's -m "
          "bert_pretrain.train ...", file=sys.stderr)
    sys.exit(2)

from .components.cpu_runtime import prefer_passive_omp_wait

prefer_passive_omp_wait()  # before anything below imports torch (libgomp reads it on load)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from .cli_errors import (end_launched, leave_error_file, leave_process_group,  # noqa: E402
                         precheck, prints_here, suggest_from)
from .config import TrainConfig, register, settings  # noqa: E402
from .components.process_group import PeersLost  # noqa: E402
from .errors import UserError  # noqa: E402

register()


def _model_schema(name: str):
    """The model's dataclass `name`, imported when a typo needs it (it loads torch)."""
    def schema(cfg):
        from . import model

        return getattr(model, name)
    return schema


# model and impl are free-form in the composed tree: their keys are these dataclasses' fields
SCHEMAS = {"model": _model_schema("BertConfig"), "impl": _model_schema("ModelImpl")}

# conf/train/ (bert-train's own config root, so --help lists only its groups) sits next to the
# package.  An absolute path, because Hydra resolves a relative config_path against the calling
# *module* when run as the `bert-train` console script (it then looks for an importable `conf`
# package) but against the file under `python -m`.
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "conf", "train")


def _fail(message: str) -> None:
    """One line, exit 2 (under a launcher: the main process prints it, every rank leaves it in
    its error file)."""
    end_launched(f"bert-train: error: {message}", 2)


def _lost(message: str) -> None:
    """One line, exit 1, for a process that lost the others mid-run; one per machine prints it.
    Exit status 1 (not 2, a user error): the launcher restarts the group when --max-restarts
    allows.  It leaves without the interpreter's teardown under any launcher (srun or one's own
    too, not only torch elastic's): gloo's threads, still waiting on the lost peer, abort it
    there ('terminate called without an active exception', exit -6; seen with a peer that
    hung)."""
    end_launched(f"bert-train: error: {message}", 1, each_machine=True)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def _run(cfg: DictConfig) -> float:
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        if multirun:  # each sweep member trains in its own Hydra sweep subdirectory
            cfg.run_dir = HydraConfig.get().runtime.output_dir
            if cfg.logger.group is None:  # one wandb group per sweep unless one was chosen
                cfg.logger.group = HydraConfig.get().sweep.dir
            if os.environ.get("RANK", "0") == "0":  # (a sweep's summary lists its members,
                from .command_record import write_record  # failed ones too, by their record)

                write_record(cfg.run_dir, OmegaConf.to_yaml(cfg, resolve=True))
        s = settings(cfg)  # (a single run's Hydra made no folder: a refusal leaves none)
        from .trainer import train

        return train(s, OmegaConf.to_container(cfg, resolve=True),
                     OmegaConf.to_yaml(cfg, resolve=True))
    except PeersLost as exc:  # (a peer died or hung: not the user's error, exit status 1)
        _lost(str(exc))
    except UserError as exc:
        if multirun:
            # Let the sweeper record this member as failed and go on with the others (Optuna
            # counts it against max_failure_rate); exiting here would end the whole sweep.
            print(f"bert-train: error: {exc}", file=sys.stderr, flush=True)
            raise
        _fail(str(exc))


def main() -> None:
    try:
        _main()
    except KeyboardInterrupt:  # before training, or a second Ctrl-C (the first one saves)
        from .cli_errors import interrupted

        interrupted("bert-train", "resume=auto continues from the last complete checkpoint (one "
                                  "Ctrl-C during training saves the step first)")


def _main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # hparams_search configs set hydra.mode=MULTIRUN: their sweep syntax is not an error
    # Under a launcher every rank checks the same command line: only the main one says so,
    # the others leave the line in their error file.
    main_process = prints_here()
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            precheck("bert-train", CONF_DIR, "train", sys.argv[1:],
                     suggest=suggest_from(TrainConfig),
                     skip=lambda arg: arg.lstrip("+").startswith("hparams_search="),
                     schemas=SCHEMAS)
    except SystemExit:
        if main_process:
            sys.stderr.write(captured.getvalue())
            sys.stderr.flush()
        leave_error_file(captured.getvalue().strip())
        raise
    if main_process:
        sys.stderr.write(captured.getvalue())
    from .sweep_check import refused_sweep

    refused = refused_sweep(CONF_DIR, sys.argv[1:])
    if refused:
        _fail(refused)
    _run()
    leave_process_group()


if __name__ == "__main__":
    main()
