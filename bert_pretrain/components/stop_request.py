"""SIGTERM/SIGINT during training (preemption, Ctrl-C): noted, so the trainer finishes the step,
saves and exits cleanly."""

import signal


class StopRequest:
    """SIGTERM/SIGINT (preemption, Ctrl-C): finish the step, save, exit cleanly. A second SIGINT
    interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some launchers): no handler
                pass

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
