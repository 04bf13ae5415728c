"""`bert-launch`: `accelerate launch` with its own --help and a short failure report:

    python -m bert_pretrain.tools.launch --config_file conf/accelerate/cpu_2proc.yaml \\
        -m bert_pretrain.train experiment=smoke data.dir=... trainer.cpu=true

takes exactly `accelerate launch`'s arguments.  When a process fails, plain `accelerate launch`
(multi-process) ends in ~35 lines: torch elastic's shutdown log, a Python traceback of the
launcher itself and a ChildFailedError table, and exits 1 whatever the cause.  Here a user error
(exit status 2: bert-train has printed its one `error:` line) ends the launch with that line
alone and exit status 2; any other failure (a crash, a signal, out of memory) ends in one line
naming the failed rank, its exit code and its message, with the launcher's exit status 1 (or
the process's own status). A launcher stopped by SIGTERM or Ctrl-C (a preemption) passes it on
to every process, which saves and exits, and ends in one line instead of torch elastic's
traceback, with exit status 128 + the signal's number.  The workers' output itself is
untouched.  Before starting, it refuses in one line what bert-train cannot run
(launch_checks.py: DeepSpeed; GPU processes on a machine without a GPU, unless trainer.cpu=true
asks for CPU processes), and machines that never meet end in one line when the rendezvous
times out.
"""
import logging
import os
import re
import subprocess
import sys

ELASTIC_API = "torch.distributed.elastic.multiprocessing.api"
CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"
LOST = "lost the other processes"  # (components/process_group.lost_line)
LOST_MAIN = "lost the main machine"  # (launch_checks.rendezvous_failure)


class _ShutdownNoise(logging.Filter):
    """Drop torch elastic's shutdown records after a user error: the agent terminating the
    other ranks, and its 'failed (exitcode: ...)' line when that names exit code 2 or SIGTERM
    (-15: the agent's own closing signal to a rank that was on its way to exit 2, recorded
    as the first failure when its error file ties with the other rank's).  The one line
    printed after the launch names any other failure, a SIGTERM sent by someone else too."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("Sending process") and "closing signal" in msg:
            return False
        if msg.startswith("failed (exitcode") and record.args and record.args[0] in (2, -15):
            return False
        return True


def _message(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = str(message.get("message", ""))
    return message if isinstance(message, str) else ""


def _user_error(exc) -> bool:
    """A rank exited 2: bert-train's user error.  That rank need not be the launch's 'first
    failure': when another rank exits 2 first, the agent stops the rest with SIGTERM, and a
    rank already on its way out (its line printed, its error file written) is recorded as
    killed with its error file's timestamp, whole seconds, so it can tie and come first."""
    return any(f.exitcode == 2 for f in exc.failures.values())


def _report(exc) -> int:
    """One line for a ChildFailedError; returns the exit status."""
    if _user_error(exc):
        main = exc.failures.get(0)
        # rank 0 prints before it exits 2, and before it writes its error file
        main_printed = main is not None and (main.exitcode == 2 or main.error_file_data.get(
            "message") not in (None, "", "<NONE>"))
        lines = [_message(f) for _, f in sorted(exc.failures.items())
                 if re.match(r"bert-(train|finetune|glue): error:", _message(f))]
        if lines and not main_printed:
            print(lines[0], file=sys.stderr, flush=True)
        return 2
    # the agent's closing signal to the other ranks is not the cause: name a rank that failed
    # on its own (the first by its error file's time, whole seconds) when there is one
    own = {r: f for r, f in exc.failures.items() if f.exitcode != -15} or exc.failures
    # a rank that lost its peers (bert-train's "lost the other processes" line) failed because
    # another did: that other is the cause, though its error file (none after a SIGKILL) may
    # carry a later time than the survivor's
    cause = {r: f for r, f in own.items() if LOST not in _message(f)} or own
    rank, failure = min(cause.items(), key=lambda item: item[1].timestamp)
    message = _message(failure)
    if failure.exitcode < 0:
        how = f"was killed by signal {failure.signal_name()}"
    else:
        how = f"exited with status {failure.exitcode}"
    detail = message if message and not message.startswith("To enable traceback") else \
        "see its output above"
    print(f"bert-launch: error: rank {rank} {how} ({detail})", file=sys.stderr, flush=True)
    return failure.exitcode if failure.exitcode > 0 else 1


def _stopped(sig) -> int:
    """One line for a launcher stopped by a signal (a scheduler preempting the job, Ctrl-C):
    torch elastic's agent has passed it on to every process and waited for them (30 s, then
    SIGKILL); bert-train saves at the end of its step. Returns the exit status, 128 + the
    signal's number, as a shell reports a process a signal ended."""
    name = getattr(sig, "name", f"signal {int(sig)}")
    print(f"bert-launch: stopped by {name}: every process was asked to save at the end of its "
          f"step and exit; continue with the same command and resume=auto", file=sys.stderr,
          flush=True)
    return 128 + int(sig)


HELP = """\
bert-launch: run bert-train on several processes (GPUs, machines, or CPU processes).

Usage: bert-launch [accelerate launch options] -m bert_pretrain.train [bert-train overrides]

bert-launch is `accelerate launch` with the same options, and a short report when a process
fails: a bert-train user error ends the launch with its one `bert-train: error:` line and exit
status 2; a crash, a signal or running out of memory, with one line naming the failed rank
(exit status 1 or the process's own; the rank that died, not those that lost it); the main
machine lost while this one restarts its processes, with one line (exit status 1); SIGTERM or
Ctrl-C to bert-launch (a preemption) is passed on to every process, which saves at the end of
its step, and ends with one line (exit status 128 + the signal's number).
Plain `accelerate launch` ends these in ~35 lines of torch elastic's report, with exit status 1.
What the processes print is left as it is.
It refuses in one line (exit status 2) a training script or module that is not there (a
forgotten -m bert_pretrain.train) or bert_pretrain/train.py as a file, a DeepSpeed config, a
GPU launch on a machine without a GPU (CPU processes on purpose: add trainer.cpu=true), and
machines that do not meet within the rendezvous timeout (--rdzv_conf timeout=SECONDS;
join_timeout=SECONDS with --rdzv_backend c10d).

Ready accelerate configs are in conf/accelerate/ (see README, "Multi-GPU and multi-node
training"):
  cpu_2proc.yaml         2 processes on CPU (gloo), what CI runs
  multi_gpu.yaml         1 machine, 8 GPUs (DDP, bf16)
  multi_node.yaml        2 machines x 8 GPUs (add --machine_rank and --main_process_ip)

Examples:
  bert-launch --config_file conf/accelerate/cpu_2proc.yaml -m bert_pretrain.train \\
      experiment=smoke data.dir=prepared/builtin128 trainer.cpu=true
  bert-launch --config_file conf/accelerate/multi_gpu.yaml --num_processes 4 \\
      -m bert_pretrain.train experiment=bert_base_phase1
  bert-launch --config_file conf/accelerate/multi_node.yaml --machine_rank $NODE_RANK \\
      --main_process_ip $MASTER_ADDR -m bert_pretrain.train experiment=bert_base_phase1 \\
      resume=auto

Options used most (command-line flags win over the config file):
  --config_file FILE     an accelerate config (conf/accelerate/*.yaml)
  --num_processes N      processes in all (GPUs over all machines)
  --multi_gpu            several processes (on CPU too, with trainer.cpu=true: gloo)
  --num_machines N, --machine_rank R, --main_process_ip IP, --main_process_port PORT
                         a multi-machine launch: run the same command on every machine
  --max_restarts N --rdzv_backend c10d
                         restart all processes when one dies (up to N times); with
                         resume=auto they continue from the last checkpoint
Every other option is accelerate launch's: `accelerate launch --help` lists them all.
bert-train's own settings come after -m bert_pretrain.train (`bert-train --help`); fine-tunes
run the same way: -m bert_pretrain.finetune (bert-finetune), -m bert_pretrain.finetune.glue."""


def _parser():
    """accelerate launch's parser, with bert-launch's name and help.  Its -h/--help only acts
    before the training module: after `-m bert_pretrain.train` it is bert-train's."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.prog = "bert-launch"
    parser.usage = "bert-launch [accelerate launch options] -m bert_pretrain.train [overrides]"
    parser.print_help = lambda file=None: print(HELP, file=file or sys.stdout)
    return parser


def _quiet_cpp_logs_here() -> None:
    """torch's C++ side logs a failed rendezvous with a 40-line C++ stack trace before Python
    sees the error (rendezvous_failure's line says it all). It reads TORCH_CPP_LOG_LEVEL once,
    when torch loads: set for this process only, the workers keep the user's setting."""
    before = os.environ.get(CPP_LOG_LEVEL)
    os.environ[CPP_LOG_LEVEL] = before or "FATAL"
    import torch  # noqa: F401

    if before is None:
        del os.environ[CPP_LOG_LEVEL]


def main(argv=None) -> None:
    _quiet_cpp_logs_here()
    from accelerate.commands.launch import launch_command
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .launch_checks import refusal, rendezvous_failure

    args = _parser().parse_args(argv)
    line = refusal(args)
    if line:
        print(line, file=sys.stderr, flush=True)
        sys.exit(2)
    logging.getLogger(ELASTIC_API).addFilter(_ShutdownNoise())
    try:
        launch_command(args)
    except SignalException as exc:
        sys.exit(_stopped(exc.sigval))
    except ChildFailedError as exc:
        sys.exit(_report(exc))
    except subprocess.CalledProcessError as exc:  # single-process launches
        sys.exit(exc.returncode if exc.returncode > 0 else 1)
    except Exception as exc:  # noqa: BLE001 (only a rendezvous failure is ours to word)
        line = rendezvous_failure(exc, args)
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        # (machines that never met: a command or address to fix, 2; a lost machine: 1)
        sys.exit(1 if LOST_MAIN in line else 2)


if __name__ == "__main__":
    main()
