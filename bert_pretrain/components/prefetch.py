"""The next steps' batches read ahead by a worker process (`trainer.prefetch`), so the training
thread does not stop between steps to read rows from the shards and draw masks.

Why a process: the training thread of a GPU run is busy in Python launching kernels, and a
thread beside it shares its interpreter lock. Beside a training thread of small torch calls on
a CPU (bench/bench_prefetch.py --host-calls, docs/training.md), this worker takes the thread's
share of a 256 x 128 batch from 3.7 ms a step to 0.8 ms; a thread in its place saved almost
nothing.

How the arrays cross: torch's DataLoader runs the worker and carries its messages, but a tensor
sent through it costs about a millisecond (a file descriptor passed per tensor) and a pickled
array costs its size through a pipe. So the trainer makes one shared-memory block at the start,
a ring of `SLOTS` slots each large enough for a step; the worker writes each step's arrays
into the next slot and sends only where they lie. The DataLoader keeps at most
`PREFETCH_STEPS` requests open, so the worker writes a slot again only after the trainer has
copied the step out of it (TrainStream._finish copies everything it keeps).

What is read ahead is a function of the data position alone (TrainStream._prepare: the rows
and the masks' rate-free draws); the masking rate, which a time budget takes from the clock,
is applied on the training thread. So the batches are the same, bit for bit, with or without
it, and a resume (which moves the position) reads from wherever the position is.

The worker is started with `spawn`: a fresh interpreter that inherits none of the trainer's
open files (its run-folder lock, logs, process-group sockets), so a trainer killed with -9
leaves nothing holding them (the worker sees its parent gone within seconds and exits). It
ignores SIGINT and SIGTERM, which Ctrl-C or a preemption sends to the whole process group: the
trainer handles those (it saves, then exits) and stops the worker itself. A worker that dies
(the kernel's OOM killer, an operator) is noticed where its next step is taken, and the stream
reads on the training thread from there (`WorkerLost`, TrainStream.next_step): the same
batches, the run goes on. So does one that hangs (alive, handing over nothing for `HUNG_S`: a
deadlock, a read stuck on a network filesystem): it is killed with SIGKILL, because it ignores
the SIGTERM torch stops a worker with, and Python's exit would wait for it forever.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

import numpy as np
import torch

from ..errors import ConfigError, DataError

PREFETCH_STEPS = 2
"""Steps the worker may have ready ahead of the one the trainer takes."""
SLOTS = PREFETCH_STEPS + 2
"""The ring's slots: the step the trainer reads, the ones requested, and one spare."""
ALIGN = 8  # (each array starts 8-byte aligned, for int64 views)
POLL_S = 5.0
"""How often a wait for a step checks that the worker is alive (torch's own interval)."""
HUNG_S = 300.0
"""A worker that hands over no step for this long is taken as hung. Preparing a step takes
milliseconds, and the worker's start-up seconds; the limit stays well under the time other
processes wait at a collective (trainer.process_group_timeout_s, 30 min by default), so a rank
whose worker hangs goes on before the others give up on it."""


class WorkerLost(Exception):
    """The worker stopped before handing over the step asked for; the message is the
    DataLoader's first line (which process, which signal)."""


class _StepsFrom(torch.utils.data.IterableDataset):
    """In the worker: every step's prepared batches from `start` on, in order, written into
    the ring's slots in turn; each item is (position, slot, layout). The data's own error is
    passed on as one item (its message, not a traceback)."""

    def __init__(self, params: dict, start: int, ring: torch.Tensor):
        super().__init__()
        self.params, self.start, self.ring = params, start, ring

    def __iter__(self):
        from .data import PreparedData, TrainStream

        slots = self.ring.numpy().reshape(SLOTS, -1)
        try:
            p = self.params
            stream = TrainStream(PreparedData(p["root"]), p["cfg"], p["seed"],
                                 p["global_batch_size"], p["micro_batch_size"],
                                 p["world_size"], p["rank"])
            at, k = self.start, 0
            while True:
                yield at, k % SLOTS, pack(stream._prepare(at), slots[k % SLOTS])
                at, k = at + stream.ramp.size_at(at), k + 1
        except DataError as exc:
            yield "error", None, str(exc)


def _worker_init(_worker_id: int) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _unwatched(steps):
    """A DataLoader iterator whose workers torch does not watch with its SIGCHLD handler.
    That handler raises wherever the training thread is when a worker dies: inside a backward
    pass, a traceback and the step lost. Unwatched, the death is noticed where the next step is
    taken (the DataLoader checks its workers while it waits for one, every few seconds), and
    the stream goes on without the worker. (Private members of torch's iterator, present since
    torch 1.x; if they are gone, torch's watch stays and a death ends the run, as before.)"""
    try:
        from torch.utils.data._utils import signal_handling

        if steps._worker_pids_set:
            signal_handling._remove_worker_pids(id(steps))
            steps._worker_pids_set = False
    except (AttributeError, ImportError):
        pass
    return steps


def _arrays(value, out: list):
    """`value`'s layout, its numpy arrays appended to `out` in order."""
    if isinstance(value, np.ndarray):
        out.append(value)
        return ("array", len(out) - 1, value.dtype.str, value.shape)
    if isinstance(value, dict):
        return ("dict", [(k, _arrays(x, out)) for k, x in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_arrays(x, out) for x in value])
    return ("value", value)


def _offsets(arrays: list) -> tuple[list, int]:
    offsets, total = [], 0
    for a in arrays:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += a.nbytes
    return offsets, total


def packed_size(value) -> int:
    """Bytes `pack` writes for `value`."""
    arrays = []
    _arrays(value, arrays)
    return _offsets(arrays)[1]


def slot_bytes(prepared: list, rows: int, max_rows: int) -> int:
    """A slot that holds any step, from one step of `rows` rows (each array's size is rows
    times a fixed width): scaled to the largest step's `max_rows`, with each array's
    alignment padding."""
    arrays = []
    _arrays(prepared, arrays)
    scale = -(-max_rows // rows)
    return packed_size(prepared) * scale + ALIGN * len(arrays) * scale


def pack(value, into: np.ndarray):
    """Write `value`'s nested arrays into the byte array `into`; returns their layout."""
    arrays = []
    tree = _arrays(value, arrays)
    offsets, total = _offsets(arrays)
    if total > into.nbytes:
        raise RuntimeError(f"prefetch: a step of {total} bytes does not fit its slot of "
                           f"{into.nbytes}")
    for a, at in zip(arrays, offsets):
        into[at:at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return tree, offsets


def unpack(data: np.ndarray, layout):
    """`pack`'s arrays again, as views of the byte array `data`."""
    tree, offsets = layout

    def build(node):
        kind = node[0]
        if kind == "array":
            _, i, dtype, shape = node
            dtype = np.dtype(dtype)
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            return data[offsets[i]:offsets[i] + n].view(dtype).reshape(shape)
        if kind == "dict":
            return {k: build(x) for k, x in node[1]}
        if kind in ("list", "tuple"):
            items = [build(x) for x in node[1]]
            return items if kind == "list" else tuple(items)
        return node[1]

    return build(tree)


class Prefetcher:
    """A worker preparing a stream's steps from position `start` on. `size_at(position)` is
    the global batch of the step there (the stream's batch ramp); `slot_bytes`, what the
    largest step takes packed."""

    def __init__(self, params: dict, start: int, size_at, slot_bytes: int):
        slot_bytes = -(-slot_bytes // ALIGN) * ALIGN
        try:
            self._ring = torch.empty(SLOTS * slot_bytes, dtype=torch.uint8).share_memory_()
        except RuntimeError as exc:  # (torch allocates the block up front: no later SIGBUS)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"trainer.prefetch: cannot make {SLOTS * slot_bytes / 2**20:.0f} MiB of shared "
                f"memory for the batches read ahead ({first}); give the machine more (a "
                f"container: docker run --shm-size=1g) or set trainer.prefetch=false") from None
        self._slots = self._ring.numpy().reshape(SLOTS, slot_bytes)
        loader = torch.utils.data.DataLoader(
            _StepsFrom(params, start, self._ring), batch_size=None, num_workers=1,
            prefetch_factor=PREFETCH_STEPS, multiprocessing_context="spawn",
            worker_init_fn=_worker_init, timeout=POLL_S)
        self._steps = _unwatched(iter(loader))
        self.next_at, self._size_at = start, size_at

    def take(self, start: int) -> Optional[list]:
        """The prepared step at `start` (views of its slot, valid until the next `take`), or
        None when the worker is reading other positions (the stream then prepares the step
        itself and starts a worker from the next one). WorkerLost: the worker died, or hung
        and was killed (the steps it had handed over come first)."""
        if start != self.next_at:
            return None
        since = time.monotonic()
        while True:
            try:
                at, slot, layout = next(self._steps)
                break
            except RuntimeError as exc:
                # (with a timeout, torch waits that long, checks its worker is alive and raises
                # one or the other; the iterator is unchanged and can be asked again)
                if "DataLoader timed out" in str(exc):
                    if time.monotonic() - since < HUNG_S:
                        continue
                    _kill_alive(self._workers())
                    raise WorkerLost(f"it handed over no step in {HUNG_S:g} s and was "
                                     f"killed") from None
                if "DataLoader worker" not in str(exc):
                    raise
                raise WorkerLost(str(exc).strip().splitlines()[0]) from None
        if at == "error":
            raise DataError(layout)
        if at != start:  # (the worker reads positions in the order the stream takes them)
            raise RuntimeError(f"prefetch worker out of step: it read position {at}, the "
                               f"trainer is at {start}")
        self.next_at = start + self._size_at(start)
        return unpack(self._slots[slot], layout)

    def _workers(self) -> list:
        # (a private member of torch's iterator, present since torch 1.x; if it goes, a hung
        # worker is left to torch's SIGTERM, which it ignores)
        return list(getattr(self._steps, "_workers", ()))

    def close(self) -> None:
        """Stop the worker: the DataLoader's iterator, freed, tells it to exit and joins it. A
        worker that does not exit within torch's wait (a hung one) is killed."""
        workers, self._steps = self._workers(), None
        _kill_alive(workers)


def _kill_alive(workers: list) -> None:
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join(POLL_S)
