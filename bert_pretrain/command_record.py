"""The record of the command that made a folder's results: `.hydra/` (config.yaml, hydra.yaml,
overrides.yaml, as Hydra writes them), written by us into the folder the results actually go to.

Hydra would write it into its run directory before any of our code runs: into a fine-tune's
out_dir whose results then go beside it (`<out_dir>-2`), into a run folder whose rerun is then
refused, or into a folder made for a command that is refused at once.  So bert-train,
bert-finetune and bert-glue run Hydra in the working directory with `hydra.output_subdir: null`
(it writes nothing) and call `write_record` once the folder is known to be theirs.

    write_record(out_dir, config_yaml)                # a new folder: never over another's record
    write_record(run_dir, config_yaml, replace=True)  # the same results, continued or rewritten
"""

from __future__ import annotations

import os
import shutil
import uuid

RECORD_DIR = ".hydra"


def _hydra_parts() -> dict:
    """hydra.yaml and overrides.yaml of the running command ({} outside a Hydra command)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return {}
    hydra_cfg = HydraConfig.instance().cfg  # {"hydra": ...}, as Hydra saves it
    return {"hydra.yaml": OmegaConf.to_yaml(hydra_cfg),
            "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task)}


def write_record(directory: str, config_yaml: str, replace: bool = False) -> bool:
    """Write `directory`/.hydra/ for the running command (main process only).  A folder that
    already has one keeps it unless `replace`; either way a reader sees a whole record, the old
    or the new (written aside, then renamed in).  Returns whether it was written."""
    from .components.redact import redact

    parts = _hydra_parts()
    if not parts:  # called outside a Hydra command (a test, a library user): no command to record
        return False
    final = os.path.join(directory, RECORD_DIR)
    if os.path.isdir(final) and not replace:
        return False
    tmp = os.path.join(directory, f"{RECORD_DIR}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        for name, text in {"config.yaml": config_yaml, **parts}.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(redact(text))  # a config may interpolate a token from the environment
        if replace and os.path.isdir(final):
            old = f"{tmp}.old"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            return True
        try:
            os.rename(tmp, final)  # fails when another process wrote one first: theirs stays
        except OSError:
            return False
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
