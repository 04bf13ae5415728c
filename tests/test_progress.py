"""bert_pretrain/components/progress.py: tqdm on a terminal; elsewhere plain lines, never a carriage return.
(bert-prep through a pipe: tests/test_prep_cli.py.)"""
from __future__ import annotations

import io

import pytest

from bert_pretrain.components.progress import format_duration, on_terminal, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines_of(stream: io.StringIO) -> list[str]:
    text = stream.getvalue()
    assert "\r" not in text
    return text.splitlines()


def test_a_terminal_gets_tqdm_and_a_pipe_gets_lines():
    from tqdm import tqdm

    term = Terminal()
    with progress_bar(3, desc="shards", unit="shard", stream=term) as bar:
        assert isinstance(bar, tqdm) and on_terminal(term)
        bar.update()
    assert "\r" in term.getvalue()  # what a terminal is for

    pipe = io.StringIO()
    with progress_bar(3, desc="shards", unit="shard", stream=pipe, every_s=0) as bar:
        assert not isinstance(bar, tqdm) and not on_terminal(pipe)
        for _ in range(3):
            bar.update()
    lines = lines_of(pipe)
    assert len(lines) == 4  # one per update (every_s=0), and the closing line
    assert lines[0].startswith("shards: 1/3 shard (33%), ") and "left" in lines[0]
    assert lines[-1].startswith("shards: 3/3 shard (100%), ") and ", in 0:0" in lines[-1]


def test_lines_are_spaced_by_every_s():
    pipe = io.StringIO()
    bar = progress_bar(None, desc="tokenize", unit="sent", stream=pipe, every_s=3600)
    for _ in range(1000):
        bar.update(50)
    assert pipe.getvalue() == ""  # nothing before every_s has passed ...
    bar.close()
    bar.close()
    (line,) = lines_of(pipe)  # ... and one closing line, once
    assert line.startswith("tokenize: 50,000 sent, ") and " sent/s, in 0:00" in line


def test_rates_slower_than_one_per_second_read_as_seconds_per_unit(monkeypatch):
    import bert_pretrain.components.progress as progress
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    pipe = io.StringIO()
    bar = progress_bar(10, desc="train", unit="step", stream=pipe, every_s=30)
    clock[0] += 50
    bar.set_postfix(loss="4.215", lr="1.00e-03")
    bar.update(2)  # 2 steps in 50 s
    (line,) = lines_of(pipe)
    assert line == "train: 2/10 step (20%), 25.00 s/step, 0:50 elapsed, ~3:20 left, loss=4.215, " \
                   "lr=1.00e-03"


def test_a_time_bar_shows_times_not_seconds_per_second(monkeypatch):
    """bert-train's budget mode counts seconds of the budget: `s/s` meant nothing."""
    import bert_pretrain.components.progress as progress
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    pipe = io.StringIO()
    bar = progress_bar(900, desc="train", unit="s", initial=60, stream=pipe, every_s=30)
    clock[0] = 31
    bar.update(31)
    (line,) = lines_of(pipe)
    assert line == "train: 1:31 of 15:00 (10%), 13:29 left"
    assert "s/s" not in line

    term = Terminal()
    bar = progress_bar(900, desc="train", unit="s", initial=60, stream=term)
    bar.update(31)
    bar.close()
    shown = term.getvalue().split("\r")[-1]
    assert "1:31 of 15:00, 13:29 left" in shown and "s/s" not in shown


def test_no_closing_line_for_a_transient_bar_or_after_an_error():
    pipe = io.StringIO()
    with progress_bar(2, desc="eval", unit="batch", stream=pipe, leave=False) as bar:
        bar.update(2)
    with pytest.raises(OSError):
        with progress_bar(None, desc="tokenize", unit="sent", stream=pipe) as bar:
            bar.update(5)
            raise OSError("disk full")  # the error's one line is the last thing printed
    assert pipe.getvalue() == ""
    disabled = progress_bar(3, desc="x", unit="step", enabled=False, every_s=0)
    disabled.update(3)
    disabled.close()  # writes nowhere, even to a terminal


def test_format_duration():
    assert [format_duration(s) for s in (0, 7.4, 59.6, 750, 3723)] == \
        ["0:00", "0:07", "1:00", "12:30", "1:02:03"]
