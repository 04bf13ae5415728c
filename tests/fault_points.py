"""bert-train, SIGKILLed at a named point of its work (tests/test_faults.py): which points a
test covers is then a property of the test, not of how fast the machine is today.

    FAULT=<point> python tests/fault_points.py <bert-train arguments>

Points (counted from this launch's start):
- `start:<function>`: on entering CheckpointManager.repair / find / begin, or the resume's
  checkpoint.load_states (start-up and resume, before the banner);
- `step:<k>:<where>`: in the k-th training step: `before` it, `after` it (computed, not yet
  logged), or `logged` (logged, before its evaluation and save);
- `eval:<k>`: in the k-th evaluation, after its first batch;
- `save:<k>:<w>`: in the k-th checkpoint save, at its w-th filesystem write (a file's fsync, a
  rename, a removal);
- `count:<file>`: kill nothing; append each save's number of writes to <file>, one a line.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys

POINT = os.environ.get("FAULT", "")
WRITES = (("os", "fsync"), ("os", "rename"), ("os", "replace"), ("os", "remove"),
          ("shutil", "rmtree"))


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if os.getpgid(0) == os.getpid():  # started in its own session: its group is this run's
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def count_calls(owner, name, at, before=True):
    """Kill at the `at`-th call of owner.name (on entering it, or as it returns)."""
    real, calls = getattr(owner, name), [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if before and calls[0] == at:
            die()
        result = real(*args, **kwargs)
        if not before and calls[0] == at:
            die()
        return result
    setattr(owner, name, wrapped)


def install(point: str) -> None:
    from bert_pretrain import trainer
    from bert_pretrain.components import checkpoint, checkpoint_manager

    kind, _, rest = point.partition(":")
    if kind == "start":
        owner = checkpoint if rest == "load_states" else checkpoint_manager.CheckpointManager
        count_calls(owner, rest, 1)
    elif kind == "step":
        k, where = rest.split(":")
        if where == "logged":
            count_calls(trainer.Trainer, "log_step", int(k), before=False)
        else:
            count_calls(trainer.Trainer, "train_step", int(k), before=where == "before")
    elif kind == "eval":
        real, calls = trainer.evaluate, [0]

        def evaluate(model, accelerator, batches, *args, **kwargs):
            calls[0] += 1

            def first_then_die():
                for i, batch in enumerate(batches):
                    if calls[0] == int(rest) and i == 1:
                        die()
                    yield batch
            return real(model, accelerator, first_then_die(), *args, **kwargs)
        trainer.evaluate = evaluate
    elif kind in ("save", "count"):
        saves, inside, writes = [0], [False], [0]
        k, w = (int(x) for x in rest.split(":")) if kind == "save" else (None, None)
        modules = {"os": os, "shutil": shutil}
        for module, name in WRITES:
            real = getattr(modules[module], name)

            def write(*args, _real=real, **kwargs):
                if inside[0] and (kind == "count" or saves[0] == k):
                    writes[0] += 1
                    if writes[0] == w:
                        die()
                return _real(*args, **kwargs)
            setattr(modules[module], name, write)
        real_save = trainer.Trainer.save

        def save(self):
            saves[0] += 1
            inside[0], writes[0] = True, 0
            try:
                return real_save(self)
            finally:
                inside[0] = False
                if kind == "count":
                    with open(rest, "a") as f:
                        f.write(f"{writes[0]}\n")
        trainer.Trainer.save = save
    else:
        raise SystemExit(f"fault_points.py: unknown FAULT {point!r}")


if __name__ == "__main__":
    from bert_pretrain.train import main  # first: it sets the OpenMP policy before torch loads

    if POINT:  # (none: the run goes to its end)
        install(POINT)
    sys.argv = ["bert-train", *sys.argv[1:]]
    main()
