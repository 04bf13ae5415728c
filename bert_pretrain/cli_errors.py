"""One-line errors for Hydra command lines, shared by `bert-prep`, `bert-train`, `bert-finetune`
and `bert-glue`.

Hydra reports a misspelt key or an unknown group option in several lines (full_key,
object_type, a HYDRA_FULL_ERROR hint) and exits 1. Both entry points compose their config once
before Hydra runs, so such a mistake ends in the same `<prog>: error: ...` line and exit status 2
as every other user error, with a 'did you mean ...' when a key or option is close to a real one.

Each command has its own config root (conf/train/ for bert-train, conf/prep/ for bert-prep,
conf/finetune/ for bert-finetune and bert-glue), so `--help` lists only its own groups; a setting
of another command gets a line saying where it belongs, and `accelerate=...` one saying how
accelerate configs are used.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
from typing import Any, Callable, Mapping, Optional

# The config roots under conf/ and the command each belongs to.
COMMANDS = {"train": "bert-train", "prep": "bert-prep", "finetune": "bert-finetune"}


def fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def leave_process_group(status: int = 0) -> None:
    """A process of a launched group (torchrun, accelerate launch, srun or one's own script
    setting RANK/WORLD_SIZE) leaves without the interpreter's teardown, with `status`: after its
    run finished (0), and after a user error found once its process group was up (2: a missing
    resume checkpoint, a busy run folder, settings that differ from rank 0's).
    gloo's worker threads (held by the DDP wrapper, or by a group never destroyed because
    set-up stopped) aborted one rank during teardown in roughly one of ten 2-process CPU runs
    that finished, and in 2 of 60 that stopped at a user error ('terminate called without an
    active exception', exit -6; torch 2.13), which the launcher reports as a crash, not as the
    user's mistake (bert-finetune's too: a 2-process fine-tune refused at start-up, once).
    Everything is written, synced and flushed by now (the error line, the error file, the run
    folder's clean-up)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def leave_error_file(line: str) -> None:
    """torch elastic's per-process error file: the launcher's failure report shows its message
    (and bert-launch prints it when the main process could not)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and line:
        import json
        import time

        try:
            with open(error_file, "w", encoding="utf-8") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:
            pass


def prints_here(printer: str = "RANK") -> bool:
    """Whether this process prints a line meant once per job (`printer` RANK) or once per
    machine (LOCAL_RANK): the one whose `printer` is 0, or any a launcher did not start (no
    MASTER_ADDR: it is alone whatever RANK says, and a RANK=1 left in its shell silenced it)."""
    return os.environ.get(printer, "0") == "0" or "MASTER_ADDR" not in os.environ


def end_launched(line: str, status: int, each_machine: bool = False) -> None:
    """End a command that may be one process of a launched group with its one error `line` and
    exit `status`.  One process prints it: the main one (every process usually hits the same
    user error, and N copies scrolled away under the launcher's report helped nobody), or with
    `each_machine` each machine's first (a lost peer: what a machine saw is its own; on 64 GPUs,
    8 lines rather than 63 tracebacks).  Every process leaves it in its error file, and leaves
    the group without the interpreter's teardown (leave_process_group)."""
    if prints_here("LOCAL_RANK" if each_machine else "RANK"):
        print(line, file=sys.stderr, flush=True)  # (first: an error file from the printer
    leave_error_file(line)                        # then means the line is on the screen)
    leave_process_group(status)
    sys.exit(status)


def interrupted(prog: str, advice: str) -> None:
    """A command stopped by Ctrl-C (a KeyboardInterrupt: bert-train and bert-finetune save on
    the first Ctrl-C during training and stop at once on a second): one line saying how to go
    on, exit 130 (128 + SIGINT, what a shell reports for a Ctrl-C'd command), not Python's
    traceback of wherever the interrupt landed. Under a launcher only the main process says it.
    (A progress bar may have been cut mid-line: on a terminal the line starts a new one.)"""
    if prints_here():
        lead = "\n" if sys.stderr.isatty() else ""
        print(f"{lead}{prog}: interrupted; {advice}", file=sys.stderr, flush=True)
    sys.exit(130)


def suggest_from(schema):
    """'did you mean ...' for a misspelt key, from `schema`'s field names."""
    def suggest(exc: Exception) -> str:
        from omegaconf import OmegaConf

        full_key = getattr(exc, "full_key", None)
        if not full_key:
            return ""
        parent, _, key = full_key.rpartition(".")
        node = OmegaConf.structured(schema)
        try:
            names = list(OmegaConf.select(node, parent).keys()) if parent else list(node.keys())
        except Exception:  # a free-form sub-tree (impl): nothing to suggest from
            return ""
        if key in names:
            return ""
        close = difflib.get_close_matches(key, names, n=1)
        return f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
    return suggest


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


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _compose(conf_dir: str, config_name: str, overrides: list):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=True)


# Where a command's composed tree is free-form (bert-train's model and impl, bert-prep's corpus
# and tokenizer), the keys the code accepts are its dataclasses' fields: each command hands its
# own in, {sub-tree: schema, or a function of the composed config giving one}, so that this
# module knows no command's schemas (and imports none of their packages).
Schemas = Mapping[str, Any]


def _schema_fields(path: str, cfg, schemas: Schemas) -> list:
    """Fields the code accepts under `path` beyond those the chosen YAML option lists."""
    cls = schemas.get(path)
    if cls is not None and not dataclasses.is_dataclass(cls):
        cls = cls(cfg)  # chosen by the config, e.g. the corpus source
    return [f.name for f in dataclasses.fields(cls)] if cls else []


def did_you_mean(exc: Exception, conf_dir: str, config_name: str, overrides: list,
                 schemas: Schemas = {}) -> str:
    """'did you mean ...' for a misspelt group option (model=bert_mnii) or key (model.hiden_size,
    corpus.pahts, trainer.max_step, max_seq_lenght): the closest of the names that exist."""
    text = str(exc)
    found = re.search(r"Could not find '(.+)/([^/']+)'", text)
    if found:  # an unknown option of a group: Hydra lists the available ones, one per tab line
        group, option = found.groups()
        options = [line.strip() for line in text.splitlines() if line.startswith("\t")]
        close = difflib.get_close_matches(option, options, n=1)
        return f"did you mean {group}={close[0]}?" if close else ""
    cause = exc.__cause__ or exc.__context__
    key = getattr(cause, "full_key", None)
    found = re.search(r"Could not override '([^']+)'", text)
    if found:
        key = found.group(1)
    if not key:
        return ""
    parent, _, leaf = key.rpartition(".")
    from omegaconf import DictConfig, OmegaConf

    # The keys that exist where the user meant to write: the config composed with every other
    # override (they choose the group options, e.g. corpus=text), or with none if that fails too.
    others = [o for o in overrides if _key(o) != key]
    try:
        cfg = _compose(conf_dir, config_name, others)
    except Exception:
        try:
            cfg = _compose(conf_dir, config_name, [])
        except Exception:
            return ""
    def names_at(path: str) -> list:
        node = OmegaConf.select(cfg, path) if path else cfg
        names = [str(k) for k in node.keys() if k != "hydra"] if isinstance(node, DictConfig) \
            else []
        return names + _schema_fields(path, cfg, schemas)

    names = names_at(parent)
    if leaf in names:
        return ""
    # A '.' written as '_' (data_dir for data.dir): the dotted key, where it exists.
    for i, char in enumerate(leaf):
        if char == "_" and leaf[:i] in names:
            head = f"{parent + '.' if parent else ''}{leaf[:i]}"
            if leaf[i + 1:] in names_at(head):
                return f"did you mean {head}.{leaf[i + 1:]}?"
    close = difflib.get_close_matches(leaf, sorted(set(names)), n=1)
    if close:
        return f"did you mean {parent + '.' if parent else ''}{close[0]}?"
    return _other_option(conf_dir, parent, leaf, schemas)


def _other_option(conf_dir: str, group: str, leaf: str, schemas: Schemas) -> str:
    """A key of another option of `group` (corpus.paths belongs to corpus=text, not builtin)."""
    from omegaconf import OmegaConf

    folder = os.path.join(conf_dir, group) if group else ""
    if not folder or not os.path.isdir(folder):
        return ""
    for option in sorted(os.listdir(folder)):
        if not option.endswith(".yaml"):
            continue
        node = OmegaConf.load(os.path.join(folder, option))
        names = [str(k) for k in node.keys() if k != "defaults"]
        names += _schema_fields(group, {group: node}, schemas)
        close = difflib.get_close_matches(leaf, names, n=1)
        if close:
            return f"did you mean {group}={option[:-5]} {group}.{close[0]}?"
    return ""


def _top_keys(path: str) -> set:
    try:
        from omegaconf import OmegaConf

        return set(OmegaConf.load(path).keys()) - {"defaults", "hydra"}
    except Exception:
        return set()


def _belongs_elsewhere(prog: str, conf_dir: str, config_name: str, key: str) -> str:
    """If `key`'s first part is a group or setting of another command and not of this one,
    say so."""
    head = key.split(".")[0].split("/")[0]
    own = os.path.basename(os.path.normpath(conf_dir))
    if os.path.isdir(os.path.join(conf_dir, head)) or \
            head in _top_keys(os.path.join(conf_dir, f"{config_name}.yaml")):
        return ""
    for root, command in COMMANDS.items():
        if root == own:
            continue
        other = os.path.join(os.path.dirname(os.path.normpath(conf_dir)), root)
        if os.path.isdir(os.path.join(other, head)) or \
                head in _top_keys(os.path.join(other, f"{root}.yaml")):
            return f"'{head}' is a {command} setting (conf/{root}/), not a {prog} one"
    return ""


def _accelerate(prog: str, override: str) -> str:
    name = override.split("=", 1)[1] if "=" in override else "<name>"
    modules = {"bert-train": "bert_pretrain.train", "bert-finetune": "bert_pretrain.finetune",
               "bert-glue": "bert_pretrain.finetune.glue"}
    if prog in modules:
        return (f"{override.lstrip('+~')} is not a {prog} setting: conf/accelerate/ holds "
                f"accelerate launcher configs; run `accelerate launch --config_file "
                f"conf/accelerate/{name}.yaml -m {modules[prog]} ...` instead")
    return (f"{override.lstrip('+~')} is not a {prog} setting: conf/accelerate/ holds launcher "
            f"configs for training; bert-prep spreads its work with num_proc=N "
            f"(and num_hosts/host_index across machines)")


def precheck(prog: str, conf_dir: str, config_name: str, overrides: list,
             suggest: Optional[Callable[[Exception], str]] = None,
             skip: Callable[[str], bool] = lambda arg: False, schemas: Schemas = {}) -> None:
    """Compose `config_name` with the command line's overrides; on a composition error print one
    line and exit 2. Hydra's own flags (`-m`, `--cfg`, ...) and `skip`ped arguments leave the
    check to Hydra (sweep syntax is not an error there). `schemas`: the command's free-form
    sub-trees and their dataclasses, for 'did you mean' (see `Schemas`)."""
    if any(arg.startswith("-") or skip(arg) for arg in overrides):
        return
    for arg in overrides:
        if _key(arg).split(".")[0] == "accelerate":
            fail(prog, _accelerate(prog, arg))
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        _compose(conf_dir, config_name, overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        # Another command's setting (data.dir to bert-finetune) is said to be one first, then
        # this command's nearest key, if any (bert-train data_dir=...: 'data_dir' is a
        # bert-finetune setting ...; did you mean data.dir?).
        bad = re.search(r"Could not (?:override|find) '([^']+)'", str(exc))
        elsewhere = _belongs_elsewhere(prog, conf_dir, config_name, bad.group(1)) if bad else ""
        message = one_line(exc, None if elsewhere else suggest)
        hint = ""
        if "did you mean" not in message:
            hint = did_you_mean(exc, conf_dir, config_name, overrides, schemas)
        if elsewhere:
            message += f"; {elsewhere}"
            cause = exc.__cause__ or exc.__context__
            if not hint and suggest and cause is not None:
                hint = suggest(cause)
        message += f"; {hint}" if hint else ""
        where = os.path.join("conf", os.path.basename(os.path.normpath(conf_dir)))
        fail(prog, f"{message} (see `{prog} --help` or {where}/ for the keys and options)")
