"""Faults during bert-prep: kill -9 at any moment, Ctrl-C, a full disk.  After each, re-running
the same command gives the same bytes as one uninterrupted run, file by file (manifest.json
compared without `timings_s` and the recorded `num_proc`: the time each step took, and a
speed-only setting), with no temp file left behind.

Every kill runs bert-prep through a small driver (`_DRIVER`) that SIGKILLs the process (and,
from a worker, the whole tree) at a named write: which points a test covers is its own choice
(or its seed's), not a matter of how fast the machine runs today.
"""
from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from data_prep import pipeline, shards
from data_prep.errors import PrepError, PrepIOError
from time_limits import hang_deadline, hang_limit
from train_support import CHILD_PYTHONPATH

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BERT_PREP = os.path.join(os.path.dirname(sys.executable), "bert-prep")
WORDS = [f"w{i}" for i in range(300)]


def _corpus(path, num_docs=60, seed=0):
    rng = random.Random(seed)
    docs = ["\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) + " ."
                      for _ in range(rng.randint(1, 25))) for _ in range(num_docs)]
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("prep_faults")
    corpus = base / "corpus.txt"
    _corpus(corpus)
    vocab = base / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + WORDS)
                     + "\n", encoding="utf-8")
    args = ["progress=false", "corpus=text", f"corpus.paths=[{corpus}]",
            f"tokenizer.vocab_file={vocab}", "max_seq_length=64", "dupe_factor=3",
            "tokens_per_shard=1000", "validation_fraction=0.1", "tokenize_batch_size=64",
            "output_dir=out"]           # relative: the manifest records it as given
    ref = base / "ref"
    ref.mkdir()
    p = _cli(ref, args)
    assert p.returncode == 0, p.stderr
    assert len(_files(ref / "out")) > 40
    return args, ref / "out"


def _cli(cwd, args, env=None, **kw):
    return subprocess.run([BERT_PREP, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=hang_limit(), env=env, **kw)


def _files(root) -> dict:
    """Every file under root (hidden ones included) -> its bytes; manifest.json -> its JSON
    without timings_s and config.num_proc."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            data = open(p, "rb").read()
            if rel == "manifest.json":
                m = json.loads(data)
                m.pop("timings_s")
                m["config"].pop("num_proc")
                data = m
            out[rel] = data
    return out


def assert_same_bytes(out, ref):
    got, want = _files(out), _files(ref)
    assert sorted(got) == sorted(want), set(got) ^ set(want)
    for rel in want:
        assert got[rel] == want[rel], rel


# Runs bert-prep, SIGKILLing it at the FAULT_AT-th call of the write named by FAULT (a
# substring of the path written), or raising ENOSPC there when FAULT_ENOSPC is set.
_DRIVER = r'''
import os, signal, sys
import numpy as np
fault, at = os.environ["FAULT"], int(os.environ["FAULT_AT"])
main_pid = os.getpid()
calls = [0]

def hit(path):
    if fault not in str(path):
        return False
    calls[0] += 1
    return calls[0] == at

def die():
    if os.environ.get("FAULT_ENOSPC"):
        raise OSError(28, "No space left on device")
    if os.environ.get("FAULT_WORKER_ONLY"):         # e.g. the out-of-memory killer
        os.kill(os.getpid(), signal.SIGKILL)
    os.kill(main_pid, signal.SIGKILL)     # the main process (workers die with it) ...
    os.kill(os.getpid(), signal.SIGKILL)  # ... and this one, now, mid-write

def wrap(real, kill_after):
    def f(path, *a, **k):
        if hit(path):
            if kill_after:
                real(path, *a, **k)
            die()
        return real(path, *a, **k)
    return f

np.save = wrap(np.save, kill_after=True)        # a shard half-written, or a plan file
os.replace = wrap(os.replace, kill_after=False)  # manifest.json / config.json: temp written
os.rename = wrap(os.rename, kill_after=False)    # a finished dir not yet renamed in place
from data_prep import token_store
real_encoded = token_store._encoded
def encoded(*a, **k):                            # mid-tokenization: tokens.tmp half full
    for i, batch in enumerate(real_encoded(*a, **k)):
        if fault == "tokens" and i + 1 == at:
            die()
        yield batch
token_store._encoded = encoded
from data_prep.build import main
sys.argv = ["bert-prep", *sys.argv[1:]]
main()
'''


def _driver(cwd, args, fault, at, enospc=False, worker_only=False):
    (cwd / "driver.py").write_text(_DRIVER)
    env = dict(os.environ, FAULT=fault, FAULT_AT=str(at), PYTHONPATH=CHILD_PYTHONPATH)
    if enospc:
        env["FAULT_ENOSPC"] = "1"
    if worker_only:
        env["FAULT_WORKER_ONLY"] = "1"
    return subprocess.run([sys.executable, str(cwd / "driver.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=hang_limit(),
                          env=env)


@pytest.mark.parametrize("fault, at, num_proc", [
    ("tokenizer.tmp", 1, 1),    # the tokenizer dir written, not yet renamed
    ("tokens", 3, 1),           # mid-tokenization
    ("plan.tmp", 2, 1),         # between two plan files
    ("plan.tmp", 7, 1),         # the plan dir complete (6 files), not renamed
    (".tmp-shard-", 9, 1),      # mid-shard (its 2nd file), some shards done
    (".tmp-shard-", 20, 2),     # a worker mid-shard: the whole tree killed
    ("manifest.json", 1, 1),    # manifest temp file written, not renamed
])
def test_kill_9_then_rerun_is_byte_identical(setup, tmp_path, fault, at, num_proc):
    args, ref = setup
    args = [*args, f"num_proc={num_proc}"]
    p = _driver(tmp_path, args, fault, at)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert not (tmp_path / "out" / "manifest.json").exists()
    leftovers = [n for d, dirs, names in os.walk(tmp_path / "out") for n in dirs + names
                 if ".tmp-" in n]
    assert leftovers, "the kill came after the write it was meant to interrupt"
    p = _cli(tmp_path, args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_bytes(tmp_path / "out", ref)


@pytest.mark.slow
def test_kill_9_at_random_points(setup, tmp_path):
    """Killed 4 times at seeded random points of its work (the driver's named writes, one per
    stage in the order a run reaches them, so that each re-run, which skips what is done,
    still meets its point), then run to the end: the same bytes as an uninterrupted prep.
    Which points are covered is the seed's, not the machine's speed."""
    args, ref = setup
    args = [*args, "num_proc=2"]
    rng = random.Random(1234)
    points = [rng.choice([("tokenizer.tmp", 1), ("tokens", rng.randint(1, 3))]),
              ("plan.tmp", rng.randint(1, 7)),
              (".tmp-shard-", rng.randint(1, 12)),  # a worker's write: 2 shards of its share
              rng.choice([(".tmp-shard-", rng.randint(1, 6)), ("manifest.json", 1)])]
    for fault, at in points:
        p = _driver(tmp_path, args, fault, at)
        assert p.returncode == -signal.SIGKILL, (fault, at, p.stderr[-3000:])
    assert not (tmp_path / "out" / "manifest.json").exists()
    p = _cli(tmp_path, args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_bytes(tmp_path / "out", ref)


def test_a_worker_killed_alone_fails_fast_in_one_line(setup, tmp_path):
    """A shard worker SIGKILLed on its own (as the out-of-memory killer does): bert-prep stops
    with one line instead of waiting forever for the lost shard; the re-run resumes."""
    args, ref = setup
    # Waiting for the lost shard would never end: the test's hang budget ends it, with this
    # message (no bound measured in seconds, which a loaded machine could trip)
    try:
        p = _driver(tmp_path, [*args, "num_proc=2"], ".tmp-shard-", 10, worker_only=True)
    except subprocess.TimeoutExpired:
        pytest.fail("bert-prep still ran at the end of the test's hang budget after a worker "
                    "died: it waits for the lost shard")
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("bert-prep: error: a worker process died while building shards")
    p = _cli(tmp_path, [*args, "num_proc=2"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_bytes(tmp_path / "out", ref)


def test_ctrl_c_is_one_line_exit_130_and_resumable(setup, tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while two workers
    build shards: one line, exit 130; the re-run finishes with the same bytes."""
    args, ref = setup
    driver = tmp_path / "slow.py"
    # Slow shards (0.3 s each) so that the interrupt lands while workers are busy.
    # Ctrl-C as a terminal gives it: a job started in the background by a shell (`cmd &`, as a
    # CI runner may start the suite) inherits SIGINT ignored, and Python then never raises
    # KeyboardInterrupt; the driver restores the terminal's disposition first.
    driver.write_text("import signal, sys, time\n"
                      "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                      "from data_prep import pipeline\n"
                      "real = pipeline._build_shard\n"
                      "def slow(t):\n    time.sleep(0.3)\n    return real(t)\n"
                      "pipeline._build_shard = slow\n"
                      "from data_prep.build import main\n"
                      "sys.argv = ['bert-prep', *sys.argv[1:]]\nmain()\n")
    proc = subprocess.Popen([sys.executable, str(driver), *args, "num_proc=2"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH))
    train = tmp_path / "out" / "train"
    deadline = hang_deadline()
    while not (train.is_dir() and any(n.startswith("shard-") for n in os.listdir(train))):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=hang_limit())
    assert proc.returncode == 130, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == ["bert-prep: interrupted; re-run the same command to resume"], err
    assert not (tmp_path / "out" / "manifest.json").exists()
    p = _cli(tmp_path, [*args, "num_proc=2"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_bytes(tmp_path / "out", ref)


def test_disk_full_mid_shard_cli_one_line(setup, tmp_path):
    args, ref = setup
    p = _driver(tmp_path, [*args, "num_proc=2"], ".tmp-shard-", 15, enospc=True)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("bert-prep: error: writing train/shard-0"), lines[0]
    assert "No space left on device: free some space" in lines[0]
    assert "re-run the same command to resume" in lines[0]
    p = _cli(tmp_path, [*args, "num_proc=2"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_bytes(tmp_path / "out", ref)


def _cfg(prep_args, out):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from data_prep.config import PrepConfig
    overrides = [a for a in prep_args if not a.startswith("output_dir=")]
    with initialize_config_dir(os.path.join(REPO, "conf", "prep"), version_base="1.3"):
        cfg = compose("prep", overrides=[*overrides, f"output_dir={out}", "num_proc=1"])
    return PrepConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))


def test_disk_full_keeps_the_previous_state(setup, tmp_path, monkeypatch):
    """ENOSPC at the 3rd file of the 7th shard, in-process: a PrepIOError (a PrepError: one
    line from bert-prep), the 6 finished shards kept as they were, the half-written one gone,
    no manifest; then ENOSPC again at the manifest: the shards survive; then the re-run ends
    with the reference bytes."""
    args, ref = setup
    out = tmp_path / "out"
    cfg = _cfg(args, out)
    real_save = np.save
    calls = []

    def full_disk(path, *a, **k):
        if ".tmp-shard-" in str(path):
            calls.append(path)
            if len(calls) == 6 * 6 + 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(path, *a, **k)
    monkeypatch.setattr(shards.np, "save", full_disk)
    with pytest.raises(PrepIOError, match=r"^writing (train|validation)/shard-\d{5}: No space "
                                          r"left on device: free some space .*re-run the same "
                                          r"command to resume") as e:
        pipeline.run(cfg)
    assert "\n" not in str(e.value) and isinstance(e.value, PrepError)
    done = [f"{s}/{n}" for s in ("train", "validation") if (out / s).is_dir()
            for n in os.listdir(out / s)]
    assert len(done) == 6 and all(n.split("/")[1].startswith("shard-") for n in done), done
    before = _files(out)
    for rel in before:
        if rel.split("/")[0] in ("train", "validation"):
            assert before[rel] == _files(ref)[rel], rel      # finished shards are whole
    monkeypatch.setattr(shards.np, "save", real_save)

    def no_sync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shards.os, "fsync", no_sync)
    with pytest.raises(PrepIOError, match=r"^writing manifest.json: No space left on device"):
        pipeline.run(cfg)
    assert not (out / "manifest.json").exists()
    assert not [n for n in os.listdir(out) if ".tmp-" in n]
    monkeypatch.undo()
    pipeline.run(cfg)
    got, want = _files(out), _files(ref)
    # In-process runs record the absolute output_dir; everything else is the same bytes.
    got["manifest.json"]["config"]["output_dir"] = "out"
    assert sorted(got) == sorted(want)
    for rel in want:
        assert got[rel] == want[rel], rel
