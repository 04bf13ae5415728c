"""A peer that never comes is an error in one line after trainer.process_group_timeout_s, never a
silent hang: process 0 of 2 started by hand (as a launcher would, RANK/WORLD_SIZE/MASTER_* in
the environment) with no process 1.  Before components/process_group.py the wait was accelerate's
init_process_group with torch's default timeout: 30 minutes, then a traceback."""
from __future__ import annotations

import os
import subprocess
import sys

from test_distributed import free_port
from time_limits import hang_limit
from train_support import REPO, write_prepared


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
