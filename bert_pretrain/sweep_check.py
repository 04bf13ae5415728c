"""A grid sweep (`bert-train -m key=a,b ...`) whose every member would be refused before training
fails once, before Hydra launches any: six members each starting, failing on the same missing
data folder and each printing the same line help nobody.

Each member's overrides are expanded as Hydra's basic sweeper does (the cartesian product of
the comma lists), composed, and checked as bert-train checks a run before it trains: its
settings, and its data folder.  One member that passes is enough to launch the sweep (the
sweep summary then lists the failed ones).  Optuna searches (`hparams_search=`, another
`hydra/sweeper`) are left to Hydra.
"""

from __future__ import annotations

from typing import Optional


def refused_sweep(conf_dir: str, argv: list) -> Optional[str]:
    """The one line to fail with when every member of the grid sweep `argv` is refused; None
    when it is not a grid sweep or some member can start."""
    if not any(a in ("-m", "--multirun") for a in argv):
        return None
    # Hydra's own settings (the sweep's folder, a launcher) change no member's config: left out
    overrides = [a for a in argv if not a.startswith("-") and
                 not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    if any(a.lstrip("+~").startswith(("hparams_search", "hydra.sweeper", "hydra/sweeper"))
           for a in argv):
        return None
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .components.data import PreparedData
    from .config import settings
    from .errors import UserError

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        members = [m for batch in BasicSweeper.split_arguments(parsed, None) for m in batch]
    except (HydraException, OmegaConfBaseException):
        return None  # (Hydra says what is wrong with the command line itself)
    errors = []
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        for member in members:
            try:
                s = settings(compose(config_name="train", overrides=member))
                PreparedData(s.data.dir)
            except UserError as exc:
                errors.append(str(exc))
            except (HydraException, OmegaConfBaseException):
                return None
            else:
                return None
    distinct = list(dict.fromkeys(errors))
    more = f" (and {len(distinct) - 1} other error(s))" if len(distinct) > 1 else ""
    return f"all {len(members)} sweep members would be refused, none was started: " \
           f"{distinct[0]}{more}"
