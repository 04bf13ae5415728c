"""What `bert-launch` settles in one line before or instead of torch elastic's report: a launch
bert-train cannot run (no such training script or module; DeepSpeed; GPU processes on a machine
without a GPU), and machines that never meet (the rendezvous timed out).  Each function returns
the line to print, or None."""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import logging
import os
import re
import sys
import warnings

FSDP_POINTER = ("for sharded training use FSDP (conf/accelerate/fsdp.yaml, docs/multi-gpu.md), "
                "otherwise DDP (conf/accelerate/multi_gpu.yaml)")


def _resolved(args):
    """The launch as accelerate will run it (config file and flags merged), or None when
    accelerate itself will refuse the options (it then says why)."""
    from accelerate.commands.launch import _validate_launch_command

    quiet = io.StringIO()  # its notes on defaults come once, from the launch itself
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resolved, _, _ = _validate_launch_command(copy.deepcopy(args))
    except (ValueError, FileNotFoundError, OSError):
        return None
    finally:
        logging.disable(logging.NOTSET)
    return resolved


def _asks_for_cpu(training_args: list) -> bool:
    return any(a.lstrip("+").replace(" ", "").lower() == "trainer.cpu=true"
               for a in training_args or [])


def _names_gpus(args) -> bool:
    """Whether the launch asks for GPUs: `--multi_gpu` or `--gpu_ids` on the command line, or a
    config file with `gpu_ids`.  A config file without `gpu_ids` (conf/accelerate/cpu_2proc.yaml)
    starts local processes on whatever the machine has: accelerate calls both MULTI_GPU, and only
    `gpu_ids` tells them apart (an unknown key of our own would make accelerate refuse the file)."""
    if getattr(args, "gpu_ids", None) is not None or not getattr(args, "config_file", None):
        return True
    import yaml

    try:
        with open(args.config_file, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return True  # accelerate says what is wrong with the file
    return not isinstance(raw, dict) or raw.get("gpu_ids") is not None


def missing_script(args) -> str | None:
    """The one-line error when what every process would run is not there, or None. Each
    process would end with Python's own line, once per process; a forgotten
    `-m bert_pretrain.train` (the first setting taken for the script) is the usual cause."""
    script = getattr(args, "training_script", None)
    if not script or getattr(args, "no_python", None):
        return None  # (no script: accelerate's parser says so; --no_python runs a command)
    if getattr(args, "module", None):
        # (`python -m` looks in the working directory first, as this check does)
        sys.path.insert(0, os.getcwd())
        try:
            if importlib.util.find_spec(script) is not None:
                return None
        except (ImportError, ValueError):
            pass
        finally:
            sys.path.remove(os.getcwd())
        what = f"there is no module {script} (-m {script})"
    elif not os.path.isfile(script):
        what = f"there is no training script {script!r}"
    elif _in_the_package(script):
        what = f"{script} is a module of the bert_pretrain package, not a script"
    else:
        return None
    return (f"bert-launch: error: {what}; the command is bert-launch [launch options] -m "
            f"bert_pretrain.train [bert-train settings], e.g. bert-launch --config_file "
            f"conf/accelerate/cpu_2proc.yaml -m bert_pretrain.train experiment=smoke")


def _in_the_package(path: str) -> bool:
    """Whether `path` is a file of this package (its modules import each other relatively:
    run as a file, each would stop with an ImportError)."""
    package = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return os.path.realpath(path).startswith(package + os.sep)


def refusal(args) -> str | None:
    """The one-line error for a launch bert-train cannot run, or None."""
    missing = missing_script(args)
    if missing:
        return missing
    launch = _resolved(args)
    if launch is None:
        return None
    if launch.use_deepspeed:
        return (f"bert-launch: error: {args.config_file or 'the accelerate config'} sets up "
                f"DeepSpeed, which bert-train does not support; {FSDP_POINTER}")
    if launch.multi_gpu and _names_gpus(args) and not _asks_for_cpu(launch.training_script_args):
        import torch

        if torch.cuda.is_available():
            return None
        machines = max(int(launch.num_machines or 1), 1)
        local = int(launch.num_processes or 1) // machines
        source = f"--config_file {args.config_file}" if args.config_file else "--multi_gpu"
        return (f"bert-launch: error: {source} asks for {local} GPU process(es) on this "
                f"machine, but torch sees no GPU here (so they would be {local} CPU processes "
                f"on {os.cpu_count()} core(s)); for CPU processes on purpose add trainer.cpu=true "
                f"(e.g. --config_file conf/accelerate/cpu_2proc.yaml --num_processes N "
                f"-m bert_pretrain.train ... trainer.cpu=true), on a GPU machine check "
                f"nvidia-smi and that torch is a CUDA build")
    return None


# A rendezvous store's connection that broke (rather than never came up): the machine holding
# the store went away after the machines had met.
_LOST_STORE = re.compile(r"broken pipe|reset by peer|closed by peer|got 0 bytes|connection was "
                         r"likely closed", re.IGNORECASE)


def rendezvous_failure(exc, args) -> str | None:
    """The one-line error when the launcher's rendezvous gave up (another machine never came),
    or None for any other exception."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous import RendezvousError

    if not isinstance(exc, (DistError, RendezvousError)):
        return None
    address = f"{getattr(args, 'main_process_ip', None) or '127.0.0.1'}:" \
              f"{getattr(args, 'main_process_port', None) or 29500}"
    detail = (str(exc).strip().splitlines() or ["timed out waiting for the other machines"])[0]
    if _LOST_STORE.search(detail):  # a connection that was up went down: they had met
        return (f"bert-launch: error: lost the main machine at {address} ({detail}): its "
                f"launcher, which holds the machines' rendezvous, stopped or the machine went "
                f"away while this one was restarting its processes; once it is back, run the "
                f"same command on every machine with resume=auto to continue from the last "
                f"complete checkpoint")
    c10d = getattr(args, "rdzv_backend", "static") == "c10d"
    return (f"bert-launch: error: the machines did not meet at {address} ({detail}); check that "
            f"the same command runs on every machine (--num_machines, each with its own "
            f"--machine_rank), that --main_process_ip and --main_process_port name the main "
            f"machine and that port is open from the others; to wait longer pass --rdzv_conf "
            f"{'join_timeout' if c10d else 'timeout'}=SECONDS")
