"""bench/bench_train_paths.py times the code it names: each version's bert-train runs from its
own tree, never from the working directory or the editable install."""
import json
import os
import subprocess
import sys

import pytest

from time_limits import hang_limit
from train_support import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import bench_train_paths  # noqa: E402


def test_a_tree_without_the_package_is_refused_not_timed_as_todays(tmp_path):
    # An empty tree imports bert_pretrain from the editable install: the bench would time
    # today's code under the baseline's name.
    with pytest.raises(SystemExit, match="imports bert_pretrain from"):
        bench_train_paths.check_imports_from(tmp_path, tmp_path)


def test_a_tree_with_the_package_imports_from_itself(tmp_path):
    tree = bench_train_paths.extract("HEAD", tmp_path / "tree")
    bench_train_paths.check_imports_from(tree, tmp_path)  # no exit


@pytest.mark.slow
def test_both_versions_train_and_are_compared(tmp_path):
    out = tmp_path / "paths.json"
    r = subprocess.run([sys.executable, "bench/bench_train_paths.py", "--baseline", "HEAD",
                        "--paths", "1proc", "--runs", "1", "--steps", "8", "--skip", "2",
                        "--model", "bert_tiny", "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=hang_limit(),
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {row["version"] for row in result["runs"]} == {result["today"], result["baseline"]}
    assert all(row["tokens_per_s"] > 0 for row in result["runs"])
    (summary,) = result["summary"]
    assert summary["ratio"] == pytest.approx(
        summary["today"]["tokens_per_s"] / summary["baseline"]["tokens_per_s"])
    assert "| 1proc |" in r.stdout
