"""A peer that never comes is an error in one line after trainer.process_group_timeout_s, never a
silent hang: process 0 of 2 started by hand (as a launcher would, RANK/WORLD_SIZE/MASTER_* in
the environment) with no process 1.  Before components/process_group.py the wait was accelerate's
init_process_group with torch's default timeout: 30 minutes, then a traceback.  And a peer lost
in the middle of the run (it dies, or hangs past the timeout) ends the other process in one line
too, where gloo's traceback ended it before."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_distributed import free_port
from time_limits import hang_limit
from train_support import REPO, await_one_of, write_prepared


def test_process_0_alone_stops_in_one_line_after_the_timeout(tmp_path):
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": "0",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    r = subprocess.run([sys.executable, "-m", "bert_pretrain.train", "experiment=smoke",
                        f"data.dir={data}", f"run_dir={tmp_path / 'run'}", "trainer.cpu=true",
                        "trainer.process_group_timeout_s=2"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit())
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stdout + r.stderr
    assert lines[0].startswith(f"bert-train: error: process 0 of 2 could not join the others at "
                               f"127.0.0.1:{port} within trainer.process_group_timeout_s=2 (")
    assert not (tmp_path / "run").exists()  # nothing left behind


@pytest.mark.parametrize("fault, words", [
    ("1:step:3", "by peer"),            # process 1 dies mid-step: its connection closes
    ("1:step:3:STOP", "Timed out"),     # process 1 hangs: the all-reduce waits out the timeout
])
def test_a_peer_lost_mid_run_ends_the_other_in_one_line(tmp_path, fault, words):
    """Two processes started by hand (as a launcher would); process 1 dies or hangs in the middle
    of step 3 (BERT_TRAIN_FAULT).  Process 0, waiting for it in the step's all-reduce, ends in
    one line naming the step and the checkpoint to resume from, exit status 1: not gloo's
    traceback, and not a wait without end."""
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=8)
    port = free_port()
    procs, out, err = await_one_of([(
        [sys.executable, "-m", "bert_pretrain.train", "experiment=smoke", f"data.dir={data}",
         f"run_dir={tmp_path / 'run'}", "trainer.cpu=true", "trainer.checkpoint_every=2",
         "trainer.max_steps=6", "trainer.process_group_timeout_s=3", "trainer.prefetch=false"],
        {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": str(rank),
         "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
         "BERT_TRAIN_FAULT": fault}) for rank in (0, 1)], awaited=0)
    assert procs[0].returncode == 1, out + err
    assert "Traceback" not in err, err
    lost = [line for line in err.splitlines() if line.startswith("bert-train: error:")]
    assert len(lost) == 1, err
    assert lost[0].startswith("bert-train: error: [rank 0] lost the other processes after step 2 "
                              "(gloo: "), lost[0]
    assert words in lost[0] and "trainer.process_group_timeout_s=3 s" in lost[0]
    assert "resume=auto continues from the last complete checkpoint (step 2)" in lost[0]
