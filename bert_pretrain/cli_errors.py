"""One-line errors for Hydra command lines, shared by `bert-prep` and `bert-train`.

Hydra reports a misspelt key or an unknown group option in several lines (full_key,
object_type, a HYDRA_FULL_ERROR hint) and exits 1. Both entry points compose their config once
before Hydra runs, so such a mistake ends in the same `<prog>: error: ...` line and exit status 2
as every other user error.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional


def fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def one_line(exc: Exception, suggest: Optional[Callable[[Exception], str]] = None) -> str:
    """Keep the lines of a Hydra/OmegaConf composition error that say what is wrong, and the
    available options; `suggest(cause)` may add a 'did you mean ...'."""
    lines, options = [], []
    text = str(exc)
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).splitlines():
        text += "\n" + str(cause).splitlines()[0]
        suggestion = suggest(cause) if suggest else ""
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


def precheck(prog: str, conf_dir: str, config_name: str, overrides: list,
             suggest: Optional[Callable[[Exception], str]] = None,
             skip: Callable[[str], bool] = lambda arg: False) -> None:
    """Compose `config_name` with the command line's overrides; on a composition error print one
    line and exit 2. Hydra's own flags (`-m`, `--cfg`, ...) and `skip`ped arguments leave the
    check to Hydra (sweep syntax is not an error there)."""
    if any(arg.startswith("-") or skip(arg) for arg in overrides):
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as exc:
        fail(prog, one_line(exc, suggest) + " (see conf/ for the keys and options)")
