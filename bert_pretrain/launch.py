"""`accelerate launch` with a short failure report:

    python -m bert_pretrain.launch --config_file conf/accelerate/cpu_2proc.yaml \\
        -m bert_pretrain.train experiment=smoke data.dir=...

takes exactly `accelerate launch`'s arguments.  When a process fails, plain `accelerate launch`
(multi-process) ends in ~35 lines: torch elastic's shutdown log, a Python traceback of the
launcher itself and a ChildFailedError table, and exits 1 whatever the cause.  Here a user error
(exit status 2: bert-train has printed its one `error:` line) ends the launch with that line
alone and exit status 2; any other failure (a crash, a signal, out of memory) ends in one line
naming the failed rank, its exit code and its message, with the launcher's exit status 1 (or
the process's own status).  The workers' output itself is untouched.
"""
import logging
import subprocess
import sys

ELASTIC_API = "torch.distributed.elastic.multiprocessing.api"


class _ShutdownNoise(logging.Filter):
    """Drop torch elastic's shutdown records after a user error (exit code 2): the agent
    terminating the other ranks, and the 'failed (exitcode: 2)' line."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("Sending process") and "closing signal" in msg:
            return False
        if msg.startswith("failed (exitcode") and record.args and record.args[0] == 2:
            return False
        return True


def _report(exc) -> int:
    """One line for a ChildFailedError; returns the exit status."""
    rank, failure = exc.get_first_failure()
    message = failure.message if isinstance(failure.message, str) else \
        str(failure.message.get("message", "")) if isinstance(failure.message, dict) else ""
    if failure.exitcode == 2:
        main = exc.failures.get(0)
        # rank 0 prints before it exits 2, and before it writes its error file
        main_printed = main is not None and (main.exitcode == 2 or main.error_file_data.get(
            "message") not in (None, "", "<NONE>"))
        if message.startswith("bert-train: error:") and not main_printed:
            print(message, file=sys.stderr, flush=True)
        return 2
    if failure.exitcode < 0:
        how = f"was killed by signal {failure.signal_name()}"
    else:
        how = f"exited with status {failure.exitcode}"
    detail = message if message and not message.startswith("To enable traceback") else \
        "see its output above"
    print(f"bert-launch: error: rank {rank} {how} ({detail})", file=sys.stderr, flush=True)
    return failure.exitcode if failure.exitcode > 0 else 1


def main(argv=None) -> None:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    logging.getLogger(ELASTIC_API).addFilter(_ShutdownNoise())
    try:
        launch_command(args)
    except ChildFailedError as exc:
        sys.exit(_report(exc))
    except subprocess.CalledProcessError as exc:  # single-process launches
        sys.exit(exc.returncode if exc.returncode > 0 else 1)


if __name__ == "__main__":
    main()
