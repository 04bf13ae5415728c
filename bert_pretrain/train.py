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


def _fail(message: str) -> None:
    print(f"bert-train: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def _run(cfg: DictConfig) -> float:
    try:
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            # Each sweep member trains in its own Hydra sweep subdirectory.
            cfg.run_dir = HydraConfig.get().runtime.output_dir
        s = settings(cfg)
        from .trainer import train

        return train(s, OmegaConf.to_container(cfg, resolve=True),
                     OmegaConf.to_yaml(cfg, resolve=True))
    except UserError as exc:
        _fail(str(exc))


def main() -> None:
    # Torch and numpy errors are chatty under many threads; none of this changes results.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _run()


if __name__ == "__main__":
    main()
