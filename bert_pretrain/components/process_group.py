"""Joining the processes of a launched run into one process group, so that a restart after a lost
process works and a peer that never comes is an error, not a hang.

Under torchrun (and `accelerate launch`, which runs torchrun's agent) every worker meets the
others through a key-value store the launcher's agent hosts (TORCHELASTIC_USE_AGENT_STORE=True).
That store outlives the workers: the agent keeps it across restarts (`--max-restarts`), both
with static rendezvous (its own TCPStore) and with c10d rendezvous (the shared store it caches
after the first round).  torch's `env://` set-up takes that store as it is ("we create a new
TCPStore for every retry", rendezvous.py) and gloo's start-up keys sit under the same names in
every attempt (`default_pg/0/...`).  So a restarted worker can read the address its peer had in
the attempt before, which a SIGKILL closed: gloo's `connectFullMesh ... Connection refused`, or,
when the port has since been reused, a wait that ends only at the 30-minute default timeout.
Measured (torch 2.13, CPU, 2 processes, rank 1 SIGKILLed at step 5): the first restart failed
that way with `--rdzv-backend c10d`, the second (after two failed attempts) resumed.

`join` builds the group itself, before accelerate does (accelerate then adopts it): the same
store, under a prefix of the restart count, so each attempt's keys are its own, and a finite
timeout for set-up and for every collective.

Once running, a process whose peer dies (its connection closes) or hangs (a collective waits
past that timeout) gets the backend's error in the middle of a step; `lost_peers` tells that
error from any other, so the trainer can end the process in one line (`PeersLost`) instead of a
traceback on every surviving process.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta

from ..errors import ConfigError


def _launched_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# What makes accelerate set up a process group (accelerate/state.py): LOCAL_RANK, or a world
# size over 1 from torchrun's or an MPI launcher's variables.
_GROUP_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                    "MV2_COMM_WORLD_SIZE")


def check_launch_environment() -> None:
    """A ConfigError in one line when the environment holds a launcher's variables without the
    address to meet at (MASTER_ADDR): accelerate would take this process for one of a group and
    end in torch's traceback ('environment variable MASTER_ADDR expected, but not set').  Seen
    with LOCAL_RANK left in a shell copied from a launched job."""
    import torch.distributed as dist

    if "MASTER_ADDR" in os.environ or (dist.is_available() and dist.is_initialized()):
        return

    def above_one(name):
        try:
            return int(os.environ.get(name, "1")) > 1
        except ValueError:
            return True

    if "LOCAL_RANK" not in os.environ and not any(above_one(n) for n in _GROUP_VARIABLES[2:]):
        return
    found = [n for n in _GROUP_VARIABLES if n in os.environ]
    raise ConfigError(
        f"the environment sets {', '.join(f'{n}={os.environ[n]}' for n in found)} (a launcher's "
        f"variables) but not MASTER_ADDR, so this process cannot meet the others of its job; "
        f"start the command with a launcher (bert-launch, torchrun or accelerate launch), which "
        f"sets them all, or unset {' '.join(found)} to run one process")


def join(backend: str, timeout_s: float) -> None:
    """Join this launched process (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment) to its
    group with `backend`; nothing for a lone process or a group already joined.  Raises
    ConfigError in one line when the others do not come within `timeout_s`."""
    import torch.distributed as dist

    check_launch_environment()
    if _launched_world() <= 1 or "MASTER_ADDR" not in os.environ or not dist.is_available() \
            or dist.is_initialized():
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    address = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '')}"
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":  # what accelerate does before it joins: one GPU per process
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        # Keys of this attempt only: the agent's store still holds the last attempt's.
        store = dist.PrefixStore(f"bert-train/attempt-{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
    except (RuntimeError, TimeoutError, ValueError) as exc:  # DistStoreError, gloo's errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"process {os.environ.get('RANK', '?')} of {_launched_world()} could not join the "
            f"others at {address} within trainer.process_group_timeout_s={timeout_s:g} ({first})"
            f"; check that every process (every machine's launcher) started, that the address "
            f"and port are reachable from every machine, and raise the timeout if they start "
            f"late") from None


class PeersLost(Exception):
    """This process lost the other processes of its group in the middle of the run (a peer died
    or hung, or the network failed); its str() is the one line to print."""


# Words of the backends' errors when a peer is gone or silent: gloo's "Connection closed by
# peer", "Connection reset by peer", "Timed out waiting 120000ms for recv operation to complete";
# NCCL's "remote process exited or there was a network error", "communicator was aborted".
_LOST = re.compile(r"closed by peer|reset by peer|timed? ?out|remote process|network error|"
                   r"broken pipe|connection refused|aborted", re.IGNORECASE)


def lost_peers(exc: BaseException) -> str | None:
    """The backend's own words when `exc` is this process losing the others mid-run, else
    None.  gloo raises plain RuntimeErrors that begin with its source file
    ('[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer ...'); NCCL and the store
    raise torch.distributed's DistError kinds.  Anything else (a bug, an out-of-memory error)
    is not a lost peer and keeps its traceback."""
    import torch.distributed as dist

    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    # without gloo's "[file.cc:N] " and its advice after the first sentence ("This is typically
    # caused by a remote worker hanging ... GLHF!")
    words = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0] or type(exc).__name__
    if isinstance(exc, (dist.DistNetworkError, dist.DistStoreError)):
        return words
    if isinstance(exc, dist.DistBackendError) or (isinstance(exc, RuntimeError)
                                                  and "/gloo/" in text):
        return words if _LOST.search(text) else None
    return None


def lost_line(rank: int, step: int | None, words: str, timeout_s: float,
              last_checkpoint_step: int | None) -> str:
    """The one line for a process that lost the others after `step` (None: in start-up, before
    the first step)."""
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_initialized() else "process group"
    if step is None:
        # (typically another process stopped at an error of its own: a data folder missing on
        # its machine prints nothing there but its rank's error file, if it is not rank 0)
        return (f"[rank {rank}] lost the other processes during start-up ({backend}: {words}): "
                f"another process of this job stopped at an error of its own (its output or its "
                f"error file, in the launcher's report, says which) or hung, or the network "
                f"failed; nothing was trained. Run the same command again once that is fixed")
    start = (f"the last complete checkpoint (step {last_checkpoint_step})"
             if last_checkpoint_step is not None else "the start (no checkpoint yet)")
    return (f"[rank {rank}] lost the other processes after step {step} ({backend}: {words}): "
            f"another process of this job died or hung, or the network failed (a collective "
            f"waits trainer.process_group_timeout_s={timeout_s:g} s); its own output says "
            f"which. resume=auto continues from {start}; under a launcher with --max-restarts "
            f"that happens by itself")
