"""`bert-train` (and `python -m bert_pretrain.train` for `accelerate launch`): the Hydra entry.

    bert-train experiment=demo
    bert-train model=bert_base data.dir=prepared/wiki128 optim=lamb trainer.max_steps=100000
    bert-train experiment=bert_base_phase1 resume=auto

Returns the final held-out MLM loss, which Hydra's Optuna sweeper minimises.
"""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .config import register, settings
from .errors import UserError

register()
# conf/ sits next to the package (../conf).  An absolute path, because Hydra resolves a relative
# config_path against the calling *module* when run as the `bert-train` console script (it then
# looks for an importable `conf` package) but against the file under `python -m`.
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def _fail(message: str) -> None:
    print(f"bert-train: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def _run(cfg: DictConfig) -> float:
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        if multirun:  # each sweep member trains in its own Hydra sweep subdirectory
            cfg.run_dir = HydraConfig.get().runtime.output_dir
            if cfg.logger.group is None:  # one wandb group per sweep unless one was chosen
                cfg.logger.group = HydraConfig.get().sweep.dir
        s = settings(cfg)
        from .trainer import train

        return train(s, OmegaConf.to_container(cfg, resolve=True),
                     OmegaConf.to_yaml(cfg, resolve=True))
    except UserError as exc:
        if multirun:
            # Let the sweeper record this member as failed and go on with the others (Optuna
            # counts it against max_failure_rate); exiting here would end the whole sweep.
            print(f"bert-train: error: {exc}", file=sys.stderr, flush=True)
            raise
        _fail(str(exc))


def _one_line(exc: Exception) -> str:
    """Hydra/OmegaConf composition errors span several lines (with full_key/object_type detail
    and a HYDRA_FULL_ERROR hint); keep the lines that say what is wrong, and the options."""
    lines, options = [], []
    text = str(exc)
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).splitlines():
        text += "\n" + str(cause).splitlines()[0]
        suggestion = _suggest(cause)
        if suggestion:
            text += "\n" + suggestion
    for line in text.splitlines():
        if line.startswith("To append to your config"):
            continue
        if line.startswith("\t"):
            options.append(line.strip())
        elif line.strip() and not line.startswith(" ") and not line.startswith("Config search"):
            lines.append(line.strip().rstrip("."))
    message = "; ".join(lines)
    if options and "Available options" in message:
        message = message.rstrip(":") + ": " + ", ".join(o for o in options if "provider=" not in o)
    return message


def _suggest(exc: Exception) -> str:
    """'did you mean ...' for a misspelt key, from the schema's field names."""
    import difflib

    from omegaconf import OmegaConf

    from .config import TrainConfig

    full_key = getattr(exc, "full_key", None)
    if not full_key:
        return ""
    parent, _, key = full_key.rpartition(".")
    node = OmegaConf.structured(TrainConfig)
    try:
        names = list(OmegaConf.select(node, parent).keys()) if parent else list(node.keys())
    except Exception:  # the parent is a free-form group (model, impl): nothing to suggest from
        return ""
    if key in names:
        return ""
    close = difflib.get_close_matches(key, names, n=1)
    return f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""


def _precheck(overrides: list) -> None:
    """Compose the config once before Hydra runs, so that a misspelt key or option on the
    command line gets a one-line `bert-train: error:` (exit 2) like every other user error.
    Skipped for multirun (sweep syntax) and Hydra's own flags, which Hydra reports itself."""
    if any(arg.startswith("-") or arg.lstrip("+").startswith("hparams_search=")
           for arg in overrides):
        return  # hparams_search configs set hydra.mode=MULTIRUN: their sweeps are not errors
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            compose(config_name="train", overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        _fail(_one_line(exc) + " (see conf/ for the keys and options)")


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _precheck(sys.argv[1:])
    _run()


if __name__ == "__main__":
    main()
