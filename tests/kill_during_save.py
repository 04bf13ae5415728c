"""`python -m bert_pretrain.train ...` for tests/test_fsdp.py, with one process SIGKILLed at a
chosen point of a sharded checkpoint save (a real kill -9 of a real rank under torchrun: nothing
after it runs, no except clause, no finally).

KILL_POINT=<point>:<rank>:<step> names where: the save of checkpoint <step>, on process <rank>,
at <point>:
  shard-write  as the process starts writing its shards (DCP's write_data)
  metadata     rank 0 (DCP's coordinator), as it writes the DCP metadata after every process
               wrote its shards
  shard-done   after every process wrote its shards and rank 0 the DCP metadata, before the
               process hashes what it wrote
  gather       as the process hands its checksums to rank 0
  rename       rank 0, as it renames the finished temporary folder into place
  pointer      rank 0, after the rename, as it rewrites checkpoints/latest.json
  enospc       not a kill: the process's shard write fails with ENOSPC (a full disk)
"""
import errno
import os
import runpy
import signal

import torch.distributed.checkpoint.filesystem as dcp_fs

from bert_pretrain.components import checkpoint as ckpt
from bert_pretrain.components import sharded_checkpoint, sharding

point, rank, step = os.environ["KILL_POINT"].split(":")
me = int(os.environ.get("RANK", "0"))
folder = ckpt.step_dir_name(int(step))


def die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def during_save() -> bool:
    """This process is saving checkpoint <step> (its temporary folder exists)."""
    root = os.path.join(os.environ["KILL_RUN_DIR"], "checkpoints")
    return os.path.isdir(os.path.join(root, ".tmp-" + folder))


def kill_when(module, name, condition):
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        if condition(*args, **kwargs):
            die()
        return real(*args, **kwargs)

    setattr(module, name, wrapped)


# Under `torchrun --max-restarts` (tests/test_restarts.py) only the first attempt dies: the
# restarted group saves the same step again and runs through.
if me == int(rank) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    if point == "shard-write":
        kill_when(dcp_fs._FileSystemWriter, "write_data", lambda *a, **k: during_save())
    elif point == "enospc":
        def full_disk(*args, **kwargs):
            if during_save():
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(*args, **kwargs)

        real_write = dcp_fs._FileSystemWriter.write_data
        dcp_fs._FileSystemWriter.write_data = full_disk
    elif point == "metadata":
        kill_when(dcp_fs._FileSystemWriter, "finish", lambda *a, **k: during_save())
    elif point == "shard-done":
        kill_when(sharded_checkpoint, "own_files", lambda *a, **k: during_save())
    elif point == "gather":
        kill_when(sharding, "gather_objects", lambda *a, **k: during_save())
    elif point == "rename":
        kill_when(os, "rename", lambda src, dst, *a, **k: os.path.basename(str(src)) ==
                  ".tmp-" + folder)
    elif point == "pointer":
        kill_when(os, "replace", lambda src, dst, *a, **k: str(dst).endswith("latest.json")
                  and os.path.isdir(os.path.join(os.path.dirname(str(dst)), folder)))
    else:
        raise SystemExit(f"unknown KILL_POINT {point}")

runpy.run_module("bert_pretrain.train", run_name="__main__", alter_sys=True)
