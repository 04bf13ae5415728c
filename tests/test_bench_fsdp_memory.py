"""bench/bench_fsdp_memory.py measures what it says: per-process model state under FSDP2 is the
process's share of DDP's (parameters, gradients and AdamW state all sharded), within the
padding FSDP2 adds to make dim 0 divisible by the process count."""
import json
import os
import subprocess
import sys

import pytest

from time_limits import hang_limit
from train_support import REPO


@pytest.mark.slow
def test_fsdp_at_4_processes_holds_a_quarter_of_ddps_model_state(tmp_path):
    out = tmp_path / "memory.json"
    r = subprocess.run([sys.executable, "bench/bench_fsdp_memory.py", "--model", "tiny",
                        "--layouts", "ddp:2,fsdp:2,fsdp:4", "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=hang_limit(),
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {(x["layout"], x["processes"]): x for x in json.loads(out.read_text())["rows"]}
    ddp = rows[("ddp", 2)]
    assert ddp["grads"] == ddp["params"] and ddp["optimizer"] >= 2 * ddp["params"]
    # DDP holds the whole model: 4 bytes per parameter
    assert ddp["params"] == 4 * ddp["num_parameters"]
    for world in (2, 4):
        row = rows[("fsdp", world)]
        assert ddp["model_state"] / world <= row["model_state"] <= \
            1.1 * ddp["model_state"] / world, (world, row, ddp)
    assert rows[("fsdp", 4)]["share_of_ddp"] <= 0.30
    assert any(line.split()[:2] == ["fsdp", "4"] for line in r.stdout.splitlines())  # the table
