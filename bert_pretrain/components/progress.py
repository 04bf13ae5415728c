"""Progress display: a tqdm bar on a terminal, a plain log line every N seconds elsewhere.

tqdm redraws its bar with carriage returns.  On a terminal that is one line updating in place;
in a file or a pipe (`make demo > log`, a CI log, `bert-prep ... | tee`) every redraw is kept
and the log becomes one giant line.  So, as Hugging Face's and NVIDIA's training scripts log
when nobody watches, `progress_bar()` gives a tqdm bar only when the stream is a terminal and
otherwise an object with the same few methods that writes a line such as

    train: 1,200/5,000 step (24%), 2.10 step/s, 9:31 elapsed, ~30:10 left, loss=4.215, lr=3.00e-04

every `every_s` seconds (no `\\r`), plus one closing line for a bar that is kept (`leave`).

unit="s" makes a time bar (bert-train's budget mode counts seconds of the budget): it shows
"9:31 of 15:00" and the time left, not a rate of seconds per second.
"""
from __future__ import annotations

import functools
import sys
import time
from typing import IO, Any

# Between two log lines when the output is not a terminal.
DEFAULT_EVERY_S = 30.0
# Counted in the thousands and millions: 12.3k sent/s reads better than 12345.67 sent/s.
_SCALED_UNITS = ("sent", "token")
_TIME_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_time} of {total_time}, {left_time} left" \
    "{postfix}"


def progress_bar(total: float | None = None, *, desc: str, unit: str = "it",
                 initial: float = 0, enabled: bool = True, leave: bool = True,
                 stream: IO[str] | None = None, every_s: float = DEFAULT_EVERY_S):
    """A progress display for `total` units (None: unknown).  The object returned has
    `update(n=1)`, `set_postfix(**values)`, `n`, `close()` and works as a context manager:
    tqdm on a terminal, log lines every `every_s` seconds otherwise, nothing if not `enabled`."""
    stream = sys.stderr if stream is None else stream
    if not enabled:
        return LogLines(total, desc=desc, unit=unit, initial=initial, stream=None)
    if on_terminal(stream):
        from tqdm import tqdm

        if unit == "s":
            return _time_tqdm()(total=total, initial=initial, desc=desc, leave=leave,
                                file=stream, dynamic_ncols=True, bar_format=_TIME_FORMAT)
        scaled = unit in _SCALED_UNITS  # "12.3k sent/s"; else "2.10step/s", "1.20s/step"
        return tqdm(total=total, initial=initial, desc=desc, unit=f" {unit}" if scaled else unit,
                    leave=leave, file=stream, dynamic_ncols=True, unit_scale=scaled)
    return LogLines(total, desc=desc, unit=unit, initial=initial, leave=leave, stream=stream,
                    every_s=every_s)


def on_terminal(stream: IO[str] | None = None) -> bool:
    """Whether `stream` (default stderr, where bars go) is a terminal: for libraries that draw
    their own bars (tokenizers' trainer prints blank lines to a pipe)."""
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def format_duration(seconds: float) -> str:
    """0:07, 12:30, 1:02:03."""
    seconds = int(max(seconds, 0) + 0.5)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _number(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() or abs(x) >= 100 else f"{x:,.2f}"


class LogLines:
    """tqdm's `update`, `set_postfix`, `n`, `close` for output that is not a terminal: one line
    per `every_s` seconds, and one at `close()` when `leave` (not after an exception: the error
    is the last line).  With stream=None it writes nothing (a disabled bar)."""

    def __init__(self, total: float | None, *, desc: str, unit: str, initial: float = 0,
                 leave: bool = True, stream: IO[str] | None = None,
                 every_s: float = DEFAULT_EVERY_S):
        self.total, self.desc, self.unit, self.leave = total, desc, unit, leave
        self.stream, self.every_s = stream, every_s
        self.n = self.start_n = initial
        self.postfix: dict[str, Any] = {}
        self.start = self.last = time.monotonic()
        self.closed = False

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.stream is not None and now - self.last >= self.every_s:
            self.last = now
            self._write(self.line(now))

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **values) -> None:
        self.postfix = {**(ordered_dict or {}), **values}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.stream is not None and self.leave and sys.exc_info()[0] is None:
            self._write(self.line(time.monotonic(), final=True))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def line(self, now: float, final: bool = False) -> str:
        """`desc: n/total unit (p%), rate, elapsed, left, postfix` (a time bar: `desc: 9:31 of
        15:00 (63%), 5:29 left`)."""
        elapsed = now - self.start
        done = self.n - self.start_n
        if self.unit == "s":
            parts = [format_duration(self.n) + (f" of {format_duration(self.total)}"
                                                if self.total else "")]
        else:
            parts = [_number(self.n) + (f"/{_number(self.total)}" if self.total else "")
                     + f" {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        if self.unit != "s" and done > 0 and elapsed > 0:
            rate = done / elapsed
            parts.append(f"{_number(rate)} {self.unit}/s" if rate >= 1 else
                         f"{elapsed / done:.2f} s/{self.unit}")
        if self.unit != "s":  # a time bar's count is the time
            parts.append(f"{format_duration(elapsed)} elapsed" if not final else
                         f"in {format_duration(elapsed)}")
        if self.total and not final and self.n < self.total:
            if self.unit == "s":
                parts.append(f"{format_duration(self.total - self.n)} left")
            elif done > 0:
                parts.append(f"~{format_duration((self.total - self.n) * elapsed / done)} left")
        parts += [f"{k}={v}" for k, v in self.postfix.items()]
        return f"{self.desc}: " + ", ".join(parts)

    def _write(self, line: str) -> None:
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed pipe must not stop the work
            pass


@functools.cache
def _time_tqdm():
    """tqdm whose units are seconds (with _TIME_FORMAT): `9:31 of 15:00, 5:29 left` instead
    of `571/900 [1.00s/s]`.  Made on first use: tqdm is not imported unless a bar is drawn."""
    from tqdm import tqdm

    class TimeTqdm(tqdm):
        @property
        def format_dict(self):
            d = super().format_dict
            total = d["total"] or 0
            d.update(n_time=format_duration(d["n"]), total_time=format_duration(total),
                     left_time=format_duration(total - d["n"]))
            return d

    return TimeTqdm
