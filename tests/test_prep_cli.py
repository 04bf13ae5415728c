"""The main job's command, exactly as `make demo` runs it (defaults, built-in corpus)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from time_limits import hang_limit

BERT_PREP = os.path.join(os.path.dirname(sys.executable), "bert-prep")


def test_demo_command_with_defaults(tmp_path):
    out = tmp_path / "prepared" / "builtin128"
    p = subprocess.run([BERT_PREP, "corpus=builtin", f"output_dir={out}"], capture_output=True,
                       text=True, timeout=hang_limit(), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    m = json.loads((out / "manifest.json").read_text())
    assert m["complete"] and m["format_version"] == 1
    assert m["config"]["corpus"]["source"] == "builtin"
    assert m["splits"]["train"]["num_instances"] > 10000
    assert m["splits"]["validation"]["num_instances"] > 0
    assert 0.145 < m["stats"]["masked_fraction"] < 0.155
    # The statistics table is printed, and Hydra leaves nothing in the working directory.
    assert "NSP random-next" in p.stdout and "predicted / tokens" in p.stdout
    # Through a pipe: plain progress lines, no tqdm carriage returns, no blank lines from the
    # tokenizer trainer's own (hidden) bars.
    assert "\r" not in p.stdout + p.stderr
    assert any(ln.startswith("tokenize: ") and " sent, " in ln for ln in p.stderr.splitlines())
    assert "\n\n" not in p.stderr and not p.stderr.startswith("\n"), p.stderr
    n = len(list((out / "train").glob("shard-*"))) + len(list((out / "validation").glob("shard-*")))
    assert f"shards: {n}/{n} shard (100%), " in p.stderr, p.stderr
    assert sorted(os.listdir(tmp_path)) == ["prepared"]
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / "tokenizer" / f).exists()
