"""bench/learning_check.py end to end on a tiny model and a seconds-long budget: both runs
train, the transformers run is transformers' model in our trainer, and the table, JSON and
picture hold what the runs logged."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from time_limits import hang_limit
from train_support import write_prepared

REPO = Path(__file__).resolve().parent.parent
pytest.importorskip("transformers")
TINY = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
        "model.intermediate_size=64", "model.max_position_embeddings=64",
        "trainer.global_batch_size=8", "trainer.eval_every=2", "trainer.warmup_steps=1",
        "trainer.eval_max_samples=16"]


def run_check(*args):
    return subprocess.run([sys.executable, str(REPO / "bench" / "learning_check.py"), *args],
                          capture_output=True, text=True, timeout=hang_limit(), cwd=REPO)


def test_learning_check_runs_ours_and_transformers(tmp_path):
    data = write_prepared(str(tmp_path / "data"), num_train=64, num_valid=16)
    out = tmp_path / "check.json"
    sets = [x for s in TINY for x in ("--set", s)]
    r = run_check("--data", data, "--label", "tiny", "--seeds", "3", "--minutes", "0.05",
                  "--transformers-eval-every", "2", "--out", str(out),
                  "--runs-dir", str(tmp_path / "runs"), *sets)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(x["model"], x["seed"]) for x in result["runs"]] == [("ours", 3),
                                                                 ("transformers", 3)]
    for run in result["runs"]:
        logs = [json.loads(line) for line in
                (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        last = [x for x in logs if "eval_mlm_accuracy" in x][-1]
        assert run["eval_mlm_accuracy"] == last["eval_mlm_accuracy"]
        assert run["eval_mlm_accuracy_masked"] == last["eval_mlm_accuracy_masked"]
        assert run["curve"][-1]["eval_nsp_accuracy"] == last["eval_nsp_accuracy"]
        assert all(p["minutes"] is not None for p in run["curve"])
        assert run["other_load_cores"] is not None and run["steps"] >= 2
    # the transformers run trained transformers' module with its dense MLM head
    config = (Path(result["runs"][1]["run_dir"]) / "train.log").read_text()
    assert "2 layers x 32" in config
    assert "median over seeds" in r.stdout and "targets: MLM" in r.stdout
    assert Path(out.with_suffix(".png")).stat().st_size > 10_000
    # a second call into the same runs directory is refused rather than mixing runs ...
    again = run_check("--data", data, "--runs-dir", str(tmp_path / "runs"))
    assert again.returncode == 2 and "is not empty" in again.stderr
    # ... unless told to reuse its finished runs: then nothing trains and the result is the same
    out2 = tmp_path / "again.json"
    reused = run_check("--data", data, "--label", "tiny", "--seeds", "3", "--reuse",
                       "--runs-dir", str(tmp_path / "runs"), "--out", str(out2), *sets)
    assert reused.returncode == 0, reused.stderr[-3000:]
    assert "training ours" not in reused.stdout and "training transformers" not in reused.stdout
    assert reused.stdout.count("reusing") == 2
    assert json.loads(out2.read_text())["runs"] == result["runs"]
    # a run that never finished (no run.json) is not taken for a result
    (tmp_path / "runs" / "transformers_s3" / "run.json").unlink()
    broken = run_check("--data", data, "--seeds", "3", "--reuse",
                       "--runs-dir", str(tmp_path / "runs"), *sets)
    assert broken.returncode == 2 and "unfinished run" in broken.stderr


def test_learning_check_rejects_a_directory_that_is_not_prepared(tmp_path):
    r = run_check("--data", str(tmp_path))
    assert r.returncode == 2 and "not a bert-prep output directory" in r.stderr
