"""`bert-prep`: the Hydra entry point (conf/prep/prep.yaml, groups: conf/prep/corpus/).

    bert-prep corpus=text corpus.paths='[data/wiki/*.txt]' tokenizer.vocab_size=30522 \
              max_seq_length=128 dupe_factor=5 num_proc=8 output_dir=prepared/wiki128

A user-fixable problem prints ``bert-prep: error: <what and how to fix>`` and exits 2; Ctrl-C
prints one line and exits 130, leaving what is done for the re-run to resume.
"""
from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bert_pretrain.cli_errors import interrupted as _interrupted
from bert_pretrain.cli_errors import precheck
from data_prep.config import PREP_SCHEMAS, PrepConfig
from data_prep.errors import PrepError


def fail(message: str) -> None:
    print(f"bert-prep: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def interrupted() -> None:
    # Every step leaves a complete result or nothing (see pipeline.py), so stopping anywhere is
    # safe.
    _interrupted("bert-prep", "re-run the same command to resume")


# "../conf/prep" (bert-prep's own config root, so --help lists only its groups) relative to this
# file, made absolute: given a relative path, Hydra resolves it as a Python package
# ("pkg://conf") when the entry point is an installed console script, and fails.
CONFIG_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conf", "prep")


def prep_config(cfg: DictConfig) -> PrepConfig:
    """The validated PrepConfig of Hydra's composed config (raises PrepError)."""
    try:
        d = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise PrepError(str(e).splitlines()[0]) from None
    return PrepConfig.from_dict(d)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="prep")
def _run(cfg: DictConfig) -> None:
    from data_prep.pipeline import run
    try:
        run(prep_config(cfg))
    except PrepError as e:
        fail(str(e))
    except OmegaConfBaseException as e:
        fail(str(e).splitlines()[0])
    except OSError as e:     # one the pipeline did not name (it names those it expects)
        fail(f"{str(e.filename) + ': ' if e.filename else ''}{e.strerror or e}: fix the cause and "
             "re-run the same command to resume")
    except KeyboardInterrupt:
        interrupted()


def main() -> None:
    try:
        precheck("bert-prep", os.path.abspath(CONFIG_PATH), "prep", sys.argv[1:],
                 schemas=PREP_SCHEMAS)
        _run()
    except KeyboardInterrupt:    # during start-up, before the pipeline runs
        interrupted()


if __name__ == "__main__":
    main()
