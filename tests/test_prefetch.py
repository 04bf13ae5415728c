"""Prefetching (trainer.prefetch): the next steps' rows and mask draws are prepared by a worker
process while a step trains, and the masking rate is applied on the training thread. These
tests check that the batches are the same bit for bit as without it, through a masking
schedule whose rate is only known at the step (a clock), a batch warmup, epoch ends, a resume
that moves the position and whole-word masking; that the work is done by the worker; that the
data's own error reaches the trainer as its one line; that the worker ends with the stream;
and that a run, crashed and resumed, logs the same numbers and weights."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bert_pretrain.components import prefetch
from bert_pretrain.components.data import DataConfig, PreparedData, TrainStream
from bert_pretrain.errors import DataError
from time_limits import hang_deadline, hang_limit
from train_support import (REPO, CHILD_PYTHONPATH, read_metrics, train_in_process,
                           write_prepared)

TIMING = ("tokens_per_s", "elapsed_s")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=50, num_valid=10,
                          shards=3)


@pytest.fixture(scope="module")
def whole_words(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("wwm")), num_train=40, num_valid=8,
                          whole_word=True)


SCHEDULE = dict(masking="dynamic", masked_lm_prob_start=0.4, masked_lm_prob=0.15,
                batch_warmup_start=4, batch_warmup_tokens=32 * 40)


def _stream(root, prefetch, world=1, rank=0, **cfg):
    return TrainStream(PreparedData(root), DataConfig(dir=root, **cfg), seed=3,
                       global_batch_size=12, micro_batch_size=4 // world, world_size=world,
                       rank=rank, prefetch=prefetch)


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k


def _count_prepares(stream) -> list:
    """Each step this process prepares itself (the others come from the worker)."""
    calls, prepare = [], stream._prepare

    def counted(start):
        calls.append(start)
        return prepare(start)

    stream._prepare = counted
    return calls


@pytest.mark.parametrize("world", [1, 2])
def test_prefetched_batches_are_the_unprefetched_ones(prepared, world):
    """Rates drawn at random per step, as a clock would give them: the prefetched draws are
    rate-free, so each step's batches are what the same step makes on the training thread."""
    plain = [_stream(prepared, False, world, r, **SCHEDULE) for r in range(world)]
    ahead = [_stream(prepared, True, world, r, **SCHEDULE) for r in range(world)]
    here = [_count_prepares(s) for s in ahead]
    progress = np.random.default_rng(0).uniform(0, 1, size=16)
    try:
        for p in progress:          # 16 steps of 4..12 samples: three epochs of 50
            for a, b in zip(plain, ahead):
                _same(a.next_step(float(p)), b.next_step(float(p)))
                assert b.position.samples_consumed == a.position.samples_consumed
        assert plain[0].epoch > 2
        assert here == [[0]] * world  # the first step here, the 15 others by the worker
    finally:
        for s in ahead:
            s.close()


def test_static_masks_prefetched(prepared):
    """The masks bert-prep stored (data.masking=static): the worker reads them with the rows."""
    plain = _stream(prepared, False, masking="static")
    ahead = _stream(prepared, True, masking="static")
    assert ahead.masker is None
    here = _count_prepares(ahead)
    try:
        for p in np.linspace(0, 1, 10):  # (past an epoch's end: 50 rows, 12 a step)
            _same(plain.next_step(float(p)), ahead.next_step(float(p)))
        assert here == [0]
    finally:
        ahead.close()


def test_whole_word_masking_prefetched(whole_words):
    plain = _stream(whole_words, False, masking="dynamic", masked_lm_prob_start=0.5)
    ahead = _stream(whole_words, True, masking="dynamic", masked_lm_prob_start=0.5)
    assert ahead.masker.whole_word
    here = _count_prepares(ahead)
    try:
        for p in (0.0, 0.9, 0.2, 1.0, 0.5, 0.05):
            _same(plain.next_step(p), ahead.next_step(p))
        assert here == [0]
    finally:
        ahead.close()


def test_a_moved_position_is_read_from_there(prepared):
    """A resume sets the position after the stream is made: the batch prepared for the old
    position is dropped, never trained on."""
    ahead = _stream(prepared, True, **SCHEDULE)
    try:
        for _ in range(3):
            ahead.next_step(0.5)
        ahead.position.samples_consumed = 7
        fresh = _stream(prepared, False, **SCHEDULE)
        fresh.position.samples_consumed = 7
        for p in (0.1, 0.6):
            _same(fresh.next_step(p), ahead.next_step(p))
    finally:
        ahead.close()


def test_the_datas_error_reaches_the_trainer_as_its_one_line(tmp_path, prepared):
    """The worker opens the data again: a shard gone since the trainer opened it is the data's
    own one-line error in the trainer, at the step that needs it, not a worker's traceback."""
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    ahead = _stream(str(data), True, **SCHEDULE)
    try:
        ahead.next_step(0.0)  # (read here; the worker starts from the next step)
        os.remove(data / "train" / "shard-00001" / "masked_labels.npy")
        with pytest.raises(DataError) as info:
            ahead.next_step(0.1)
        assert str(info.value).endswith("masked_labels.npy is missing: the prepared data in "
                                        f"{data} is incomplete; run bert-prep again into a "
                                        f"fresh output_dir")
        assert "\n" not in str(info.value)
    finally:
        ahead.close()


def _children() -> dict:
    """This process's live children: pid -> command line."""
    return _children_of(os.getpid())


def test_close_ends_the_worker(prepared):
    before = _children()
    ahead = _stream(prepared, True, **SCHEDULE)
    ahead.next_step(0.0)
    ahead.next_step(0.1)
    workers = {p: c for p, c in _children().items()
               if p not in before and "resource_tracker" not in c}
    assert len(workers) == 1
    ahead.close()
    deadline = time.monotonic() + (hang_limit() or 60)
    while any(p in _children() for p in workers):
        assert time.monotonic() < deadline, "the worker outlived close()"
        time.sleep(0.05)
    assert ahead._ahead is None


class _Crash(Exception):
    pass


def _train(prepared, run_dir, *extra) -> list:
    """bert-train in this process, 8 steps of dynamic masking on a schedule; its logged
    records without their timings."""
    train_in_process(["experiment=smoke", f"data.dir={prepared}", f"run_dir={run_dir}",
                      "trainer.mixed_precision=no", "trainer.max_steps=8",
                      "trainer.log_every=2", "trainer.checkpoint_every=4",
                      "trainer.eval_every=0", "data.masking=dynamic",
                      "data.masked_lm_prob_start=0.4", "data.masked_lm_prob=0.15",
                      "resume=auto", *extra])
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(str(run_dir))]


FINAL = "checkpoints/step-00000008/model.safetensors"


@pytest.fixture(scope="module")
def plain(tmp_path_factory, prepared):
    """The run that never prefetched (auto: not on a CPU): its folder and records."""
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    return run_dir, _train(prepared, run_dir)


def _same_run(run_dir, plain) -> None:
    """The same numbers logged and the same final weights, to the last bit, as `plain`."""
    plain_dir, plain_records = plain
    records = [r for r in read_metrics(str(run_dir))]
    records = [{k: v for k, v in r.items() if k not in TIMING} for r in records]
    logged = {r["step"]: r for r in plain_records if "loss" in r}
    assert sorted(logged) == [2, 4, 6, 8]
    assert {r["step"]: r for r in records if "loss" in r} == logged
    assert [r for r in records if "eval_mlm_loss" in r][-1] == \
        [r for r in plain_records if "eval_mlm_loss" in r][-1]
    a, b = load_file(str(run_dir / FINAL)), load_file(str(plain_dir / FINAL))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_logs_the_same_numbers_with_and_without_prefetch(tmp_path, prepared, plain,
                                                                monkeypatch):
    """bert-train end to end (dynamic masking on a schedule), the prefetching run crashed after
    step 6 and resumed from step 4's checkpoint: the metrics and the final weights are the
    same to the last bit as a run that never prefetched."""
    from bert_pretrain.components import fault_point

    def crash(phase, step, rank):
        if (phase, step) == ("logged", 6):
            raise _Crash()

    with monkeypatch.context() as m:
        m.setattr(fault_point, "reached", crash)
        with pytest.raises(_Crash):
            _train(prepared, tmp_path / "ahead", "trainer.prefetch=true")
    _train(prepared, tmp_path / "ahead", "trainer.prefetch=true")
    log = (tmp_path / "ahead" / "train.log").read_text()
    assert log.count("batches read ahead by a worker process (trainer.prefetch=true)") == 2
    assert "batches read on the training thread (trainer.prefetch=auto on cpu)" in \
        (plain[0] / "train.log").read_text()
    _same_run(tmp_path / "ahead", plain)


def test_a_worker_killed_inside_a_step_leaves_the_run_going(tmp_path, prepared, plain,
                                                             monkeypatch):
    """The worker killed (the kernel's OOM killer, an operator) while the trainer is inside a
    step, between its backward pass and its update: no error in the middle of the step (torch
    watches its DataLoaders' workers with a SIGCHLD handler that raises wherever the training
    thread is); the step that finds the worker gone reads on the training thread, says so in
    one line, and the run ends with the numbers and weights of a run that never prefetched."""
    from bert_pretrain.components import fault_point

    killed = []

    def kill(phase, step, rank):
        if (phase, step) == ("step", 3):
            workers = [p for p, c in _children().items() if "resource_tracker" not in c]
            assert len(workers) == 1, workers
            os.kill(workers[0], signal.SIGKILL)
            killed.append(workers[0])
            # Until the kernel has sent this process the worker's SIGCHLD (a killed worker is
            # waitable once all its threads are gone; WNOWAIT leaves it to the DataLoader), and
            # a moment more, in which Python runs the signal's handler: inside the step.
            deadline = time.monotonic() + (hang_limit() or 60)
            while os.waitid(os.P_PID, workers[0], os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                assert time.monotonic() < deadline, "the killed worker never died"
                time.sleep(0.01)
            time.sleep(0.2)

    with monkeypatch.context() as m:
        m.setattr(fault_point, "reached", kill)
        _train(prepared, tmp_path / "ahead", "trainer.prefetch=true")
    assert len(killed) == 1
    lost = [line for line in (tmp_path / "ahead" / "train.log").read_text().splitlines()
            if "reading batches ahead stopped" in line]
    assert len(lost) == 1, lost
    assert re.search(r"WARNING bert-train: warning: step [4-8]: the process reading batches "
                     rf"ahead stopped \(DataLoader worker \(pid\(s\) {killed[0]}\) exited "
                     r"unexpectedly\); the training thread reads them from here on \(the same "
                     r"batches; a resumed run starts a new worker\)$", lost[0]), lost[0]
    assert not any(p == killed[0] for p in _children())
    _same_run(tmp_path / "ahead", plain)


def _launch(tmp_path, run_dir, tag, *extra):
    """bert-train in its own process group, as a scheduler starts a job."""
    out = open(tmp_path / f"{tag}.out", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": CHILD_PYTHONPATH,
           "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bert_pretrain.train", "experiment=smoke",
         f"data.dir={tmp_path / 'data'}", f"run_dir={run_dir}", "trainer.prefetch=true",
         "trainer.max_steps=100000", "trainer.warmup_steps=2", "trainer.log_every=1",
         "trainer.checkpoint_every=100000", "trainer.progress_bar=false", "trainer.report=false",
         f"hydra.run.dir={tmp_path / 'hydra' / tag}", *extra],
        cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, tmp_path / f"{tag}.out"


def _wait_for_steps(proc, run_dir, steps: int) -> None:
    deadline = hang_deadline()
    while len([r for r in _logged(run_dir) if "loss" in r]) < steps:
        assert proc.poll() is None, "bert-train ended before it was signalled"
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("bert-train logged no steps: hung")
        time.sleep(0.1)


def _logged(run_dir):
    try:
        with open(run_dir / "metrics.jsonl") as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _workers_of(pid: int) -> list:
    """The trainer's children but multiprocessing's resource tracker: its data worker."""
    return [p for p, cmd in _children_of(pid).items() if "resource_tracker" not in cmd]


def _children_of(parent: int) -> dict:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent:
            out[int(pid)] = cmd
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_worker_outlives_the_signals_sent_to_the_whole_group(prepared):
    """Ctrl-C and a scheduler's SIGTERM reach every process of the group: the worker ignores
    them (the trainer handles them: it finishes its step, saves, and stops the worker), so a
    step taken after them is still served."""
    ahead = _stream(prepared, True, **SCHEDULE)
    plain = _stream(prepared, False, **SCHEDULE)
    try:
        _same(plain.next_step(0.0), ahead.next_step(0.0))
        _same(plain.next_step(0.1), ahead.next_step(0.1))  # (the worker has started)
        workers = [p for p in _children() if "resource_tracker" not in _children()[p]]
        assert len(workers) == 1
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(workers[0], sig)
        time.sleep(0.5)  # (a worker that died of them would be reported by the next take)
        for p in (0.2, 0.3, 0.4):
            _same(plain.next_step(p), ahead.next_step(p))
    finally:
        ahead.close()


@pytest.mark.slow  # (two bert-train processes, ~10 s each)
def test_a_preemption_signal_to_the_whole_group_still_saves(tmp_path):
    """A scheduler's SIGTERM reaches every process of the job, the worker too: the worker
    ignores it, the trainer finishes its step, saves, stops the worker and exits cleanly."""
    write_prepared(str(tmp_path / "data"), num_train=48, num_valid=8)
    proc, out = _launch(tmp_path, tmp_path / "run", "term")
    try:
        _wait_for_steps(proc, tmp_path / "run", 3)
        workers = _workers_of(proc.pid)
        assert len(workers) == 1, _children_of(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=hang_limit())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    assert proc.returncode == 0, text
    step = int(re.search(r"stop requested: saving at step (\d+) and exiting", text).group(1))
    assert (tmp_path / "run" / "checkpoints" / f"step-{step:08d}").is_dir()
    assert "Traceback" not in text and "DataLoader worker" not in text, text
    assert all(_gone(w) for w in workers)


@pytest.mark.slow
def test_a_killed_trainer_leaves_its_folder_free_and_its_worker_ends(tmp_path):
    """kill -9 of the trainer alone: the worker (a fresh interpreter) holds none of its files,
    so the same command resumes at once; the worker sees its parent gone and exits."""
    write_prepared(str(tmp_path / "data"), num_train=48, num_valid=8)
    every = "trainer.checkpoint_every=2"
    proc, out = _launch(tmp_path, tmp_path / "run", "first", every)
    try:
        _wait_for_steps(proc, tmp_path / "run", 5)
        workers = _workers_of(proc.pid)
        assert len(workers) == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=hang_limit())
        # (a busy machine trains on between the wait and the kill: the end is set past the
        # last step the killed run logged)
        end = max(r["step"] for r in _logged(tmp_path / "run") if "loss" in r) + 4
        again, again_out = _launch(tmp_path, tmp_path / "run", "again", every, "resume=auto",
                                   f"trainer.max_steps={end}")
        again.wait(timeout=hang_limit())
    finally:
        for p in (proc, locals().get("again")):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    text = again_out.read_text()
    assert again.returncode == 0, text
    assert "resumed from" in text and f"finished at step {end}" in text
    deadline = hang_deadline()
    while not all(_gone(w) for w in workers):  # (torch's worker checks its parent every 5 s)
        assert time.monotonic() < deadline, "the orphaned worker never exited"
        time.sleep(0.2)


NO_GUARD = """\
import sys

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bert_pretrain.config import register, settings
from bert_pretrain.trainer import train

register()
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose(config_name="train", overrides=sys.argv[2:])
train(settings(cfg), OmegaConf.to_container(cfg, resolve=True),
      OmegaConf.to_yaml(cfg, resolve=True))
"""


@pytest.mark.slow
def test_a_script_without_the_main_guard_is_told_and_its_run_goes_on(tmp_path, prepared):
    """spawn imports the main script again in the worker: there, building a Trainer stops at
    once with one line saying what to fix (it used to build a second model and fail on the run
    folder's lock with a traceback, or start a second run in a folder of its own); the run
    goes on, reading on its training thread."""
    from bert_pretrain.components.trainer_config import NO_MAIN_GUARD

    script, run_dir = tmp_path / "my_train.py", tmp_path / "run"
    script.write_text(NO_GUARD)
    r = subprocess.run(
        [sys.executable, str(script), os.path.join(REPO, "conf", "train"), "experiment=smoke",
         f"data.dir={prepared}", f"run_dir={run_dir}", "trainer.prefetch=true",
         "trainer.max_steps=4", "trainer.report=false", "trainer.progress_bar=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=hang_limit(),
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": CHILD_PYTHONPATH,
             "WANDB_MODE": "disabled"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count(NO_MAIN_GUARD) == 1 and "Traceback" not in out, out
    assert "the process reading batches ahead stopped" in out
    assert (run_dir / "checkpoints" / "step-00000004" / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == ["my_train.py", "run"]


def test_too_little_shared_memory_is_one_line_that_says_what_to_do(prepared, monkeypatch):
    """A container's small /dev/shm: torch refuses the ring up front (it reserves the block),
    and the trainer says so in one line instead of a worker's bus error later."""
    from bert_pretrain.errors import ConfigError

    def refused(self):
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2>: "
                           "No space left on device (28)\nmore")

    monkeypatch.setattr(torch.Tensor, "share_memory_", refused)
    ahead = _stream(prepared, True, **SCHEDULE)
    with pytest.raises(ConfigError, match=r"^trainer.prefetch: cannot make \d+ MiB of shared "
                       r"memory for the batches read ahead \(unable to allocate shared memory"
                       r"\(shm\) for file </torch_1_2>: No space left on device \(28\)\); give "
                       r"the machine more \(a container: docker run --shm-size=1g\) or set "
                       r"trainer.prefetch=false$"):
        ahead.next_step(0.0)
    ahead.close()


@pytest.mark.parametrize("value, resolved", [("auto", "auto"), ("true", "true"),
                                             ("false", "false"), ("True", "true")])
def test_the_setting_takes_auto_true_or_false(value, resolved):
    from bert_pretrain.components.trainer_config import TrainerConfig

    tc = TrainerConfig(prefetch=value)
    assert tc.prefetch == resolved
    assert tc.prefetches("cuda") == (resolved != "false")
    assert tc.prefetches("cpu") == (resolved == "true")


def test_a_daemonic_process_reads_on_the_training_thread():
    """A trainer run by a multiprocessing pool's worker (a daemon, which Python does not let
    start processes: DataLoader's worker would fail with an AssertionError): `auto` on a GPU
    reads on the training thread there, and `true` is refused in one line. Asked in a real
    pool's worker."""
    import multiprocessing

    from bert_pretrain.components.trainer_config import TrainerConfig
    from bert_pretrain.errors import ConfigError

    def ask(prefetch):  # (in the pool's worker, within the hang limit)
        return pool.apply_async(TrainerConfig(prefetch=prefetch).prefetches, ("cuda",)).get(
            timeout=hang_limit())

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert ask("auto") is False
        assert ask("false") is False
        with pytest.raises(ConfigError, match=r"^trainer.prefetch=true starts a worker process, "
                                              r"and this process is a daemon \(a "
                                              r"multiprocessing pool's worker\), which may not "
                                              r"start processes; set trainer.prefetch=auto or "
                                              r"false$"):
            ask("true")
    assert TrainerConfig(prefetch="auto").prefetches("cuda") is True  # (not a daemon here)


def test_a_bad_setting_is_refused_in_one_line(tmp_path, prepared):
    from bert_pretrain.config import settings
    from bert_pretrain.errors import ConfigError
    from train_support import compose

    cfg = compose(["experiment=smoke", f"data.dir={prepared}", f"run_dir={tmp_path}",
                   "trainer.prefetch=sometimes"])
    with pytest.raises(ConfigError, match="^trainer.prefetch must be auto, true or false, got "
                                          "'sometimes'$"):
        settings(cfg)


def _hang_the_worker() -> int:
    """SIGSTOP this process's one worker once it is idle (it has read its steps ahead and
    waits for the next request): a hung worker, alive and handing over nothing."""
    worker = _the_worker()
    time.sleep(1.0)
    os.kill(worker, signal.SIGSTOP)
    return worker


def _the_worker() -> int:
    workers = [p for p in _children() if "resource_tracker" not in _children()[p]]
    assert len(workers) == 1
    return workers[0]


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_worker_lost_is_replaced_by_the_training_thread(prepared, fault, monkeypatch):
    """The worker killed (the OOM killer), or hung (handing over nothing for
    prefetch.HUNG_S: a deadlock, a stuck filesystem; then killed, as it ignores SIGTERM): the
    steps it handed over are used, then the stream reads on this thread (the same batches),
    reports it once and starts no other worker."""
    monkeypatch.setattr(prefetch, "POLL_S", 0.25)  # (read as the worker starts)
    plain = _stream(prepared, False, **SCHEDULE)
    ahead = _stream(prepared, True, **SCHEDULE)
    said = []
    ahead.warn = said.append
    try:
        for p in (0.0, 0.1):
            _same(plain.next_step(p), ahead.next_step(p))
        if fault == "killed":
            worker = _the_worker()
            os.kill(worker, signal.SIGKILL)
            why = f"DataLoader worker (pid(s) {worker}) exited unexpectedly"
        else:
            # (read at each wait; set once the worker has started, which takes seconds)
            monkeypatch.setattr(prefetch, "HUNG_S", 1.0)
            worker = _hang_the_worker()
            why = "it handed over no step in 1 s and was killed"
        # (without a limit on a hang the stream would wait forever: at the test's hang limit
        # this kills the worker, and the message names a death instead)
        guard = threading.Timer(hang_limit() or 60, os.kill, (worker, signal.SIGKILL))
        guard.start()
        for k in range(12):  # (past an epoch's end: 50 rows, 12 a step)
            _same(plain.next_step(0.2 + k / 20), ahead.next_step(0.2 + k / 20))
        guard.cancel()
        assert said == [f"the process reading batches ahead stopped ({why}); the training "
                        f"thread reads them from here on (the same batches; a resumed run "
                        f"starts a new worker)"]
        assert ahead._ahead is None and not ahead.prefetch
        assert [p for p in _children() if "resource_tracker" not in _children()[p]] == []
    finally:
        ahead.close()


def test_close_kills_a_worker_that_hangs(prepared, monkeypatch):
    """torch stops a worker that does not exit with SIGTERM, which ours ignores; left alive,
    it would keep Python's exit waiting for it forever."""
    monkeypatch.setattr(prefetch, "POLL_S", 0.25)
    ahead = _stream(prepared, True, **SCHEDULE)
    worker = None
    try:
        for p in (0.0, 0.1):
            ahead.next_step(p)
        worker = _hang_the_worker()
        ahead.close()
        assert worker not in _children()
    finally:
        ahead.close()
        if worker is not None and worker in _children():
            os.kill(worker, signal.SIGKILL)


def test_started_before_the_first_step_the_worker_reads_from_the_next(prepared):
    """The trainer starts the worker as training begins (its start-up overlaps the first
    step): the step at the position is prepared then and kept, the worker reads from the one
    after, and a position moved since is read from where it is."""
    plain = _stream(prepared, False, **SCHEDULE)
    ahead = _stream(prepared, True, **SCHEDULE)
    here = _count_prepares(ahead)
    try:
        ahead.start_prefetching()
        assert here == [0] and ahead._ahead.next_at == 4
        for p in (0.0, 0.3, 0.6):
            _same(plain.next_step(p), ahead.next_step(p))
        assert here == [0]
        moved = _stream(prepared, True, **SCHEDULE)
        moved.start_prefetching()
        moved.position.samples_consumed = 12  # (a resume after the start: not the held step)
        plain.position.samples_consumed = 12
        _same(plain.next_step(0.5), moved.next_step(0.5))
        moved.close()
    finally:
        ahead.close()
