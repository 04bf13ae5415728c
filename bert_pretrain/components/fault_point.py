"""Named points in a training run where a test makes one process die, chosen by the step and
phase rather than by timing: `BERT_TRAIN_FAULT=<rank>:<phase>:<step>[:TERM|:LAUNCHER|:NODE|:STOP]`
in the environment makes process `rank` send itself SIGKILL (or SIGTERM, a preemption of that
process; or SIGTERM to its parent, the launcher's agent, a preemption of the job; or SIGKILL to
its agent and then itself, a machine of the job vanishing; or SIGSTOP, a process that hangs)
when it reaches `phase` at `step`; `rank` `*` is any rank (for the processes of one launcher,
whose environment alone has it).  The restart tests (tests/test_restarts.py) use it to kill a
rank mid-step, during a save, right after one, ..., and check that the launcher's restart ends
where the run that never stopped ends.  It fires only in the launcher's first attempt
(TORCHELASTIC_RESTART_COUNT 0 or unset), so the restarted group runs through.  Unset,
`reached` is one dictionary lookup.

Phases: `step` (mid-step: after the first micro-batch's backward, before the gradients and the
loss are reduced), `eval` (during an evaluation), `save` (during a save: the rank has written part
of the checkpoint), `saved` (right after a checkpoint is complete), `logged` (after the step's
metrics are written, before any save)."""

from __future__ import annotations

import os
import signal

ENV = "BERT_TRAIN_FAULT"
PHASES = ("step", "eval", "save", "saved", "logged")


def reached(phase: str, step: int, rank: int) -> None:
    """Kill this process here if BERT_TRAIN_FAULT names this rank, phase and step."""
    spec = os.environ.get(ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    parts = spec.split(":")
    if len(parts) not in (3, 4) or parts[1] not in PHASES or parts[3:] not in (
            [], ["TERM"], ["LAUNCHER"], ["NODE"], ["STOP"]):
        raise ValueError(f"{ENV}={spec!r}: expected <rank>:<phase>:<step>[:TERM|:LAUNCHER|:NODE|"
                         f":STOP], phase one of {', '.join(PHASES)}")
    if (parts[1], int(parts[2])) != (phase, step) or parts[0] not in ("*", str(rank)):
        return
    if parts[3:] == ["LAUNCHER"]:
        _preempt_launcher()
    elif parts[3:] == ["NODE"]:  # the agent first: it must not see its worker die and restart
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        os.kill(os.getpid(), {"TERM": signal.SIGTERM, "STOP": signal.SIGSTOP}.get(
            "".join(parts[3:]), signal.SIGKILL))


def _preempt_launcher(wait_s: float = 60.0) -> None:
    """SIGTERM to the launcher's agent (this process's parent), then wait here until the agent
    has passed it on to this process (its stop request is set: the trainer's SIGTERM handler
    is a StopRequest's), so the run cannot end before the preemption reaches it."""
    import time

    os.kill(os.getppid(), signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if getattr(getattr(signal.getsignal(signal.SIGTERM), "__self__", None), "requested",
                   False):
            return
        time.sleep(0.01)
