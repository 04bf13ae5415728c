"""bench/bench_model.py end to end on a tiny preset: what docs/benchmarks.md's speed table is
made of (runs, their median and spread, the competing-process run, the load it records)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bert_pretrain.components.cpu_runtime import NO_BF16_UNITS_ENV, bf16_units
from time_limits import hang_limit

REPO = Path(__file__).resolve().parent.parent
pytest.importorskip("transformers")


def test_runs_summary_and_competing_process(tmp_path):
    out = tmp_path / "model.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_model.py"), "--presets",
                        "bert_tiny:4:32", "--dtypes", "fp32", "--warmup", "1", "--steps", "2",
                        "--runs", "3", "--compete", "--vocab-size", "512", "--out", str(out)],
                       capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 0, r.stderr[-2000:]
    assert "median of 3 runs (min-max):" in r.stdout
    result = json.loads(out.read_text())
    assert [run["kind"] for run in result["runs"]] == ["quiet", "quiet", "quiet", "compete"]
    assert result["omp_wait_policy"] and result["runs"][0]["matmul_peak_flops"]["fp32"] > 0
    ours = [row for row in result["summary"] if row["model"] == "ours"]
    assert len(ours) == 1 and ours[0]["runs"] == 3 and ours[0]["seq_len"] == 32
    per_run = [row["tokens_per_s"] for run in result["runs"][:3] for row in run["results"]
               if row["model"] == "ours"]
    assert ours[0]["tokens_per_s"] == pytest.approx(statistics.median(per_run))
    assert ours[0]["tokens_per_s_range"] == [min(per_run), max(per_run)]
    base = next(row for row in result["summary"] if row["model"] == "transformers")
    assert base["speedup_vs_transformers"] == 1.0
    # the busy process shows up as load from other processes during the competing run only
    compete = result["runs"][3]["results"][0]["other_load_cores"]
    assert compete > 0.3, compete


def test_bad_preset_spec_is_one_line():
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_model.py"), "--presets",
                        "bert_tiyn:4"], capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith("error: --presets takes NAME:BATCH[:SEQ]")


def test_dropout_and_the_sdpa_variant(tmp_path):
    """--dropout 0 (as budget recipes train) is recorded with the results; ours-sdpa (SDPA on
    CPU, where the default takes the explicit product) is timed beside ours, in the dtypes the
    bench picks for this CPU (bf16 too where it has bf16 matrix units)."""
    out = tmp_path / "model.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_model.py"), "--presets",
                        "bert_tiny:4:32", "--warmup", "1", "--steps", "1",
                        "--dropout", "0", "--variants", "ours-sdpa", "--vocab-size", "512",
                        "--out", str(out)], capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["dropout"] == 0.0
    assert {row["model"] for row in result["summary"]} == {"ours", "transformers", "ours-sdpa"}
    dtypes = {"fp32", "bf16"} if bf16_units() else {"fp32"}
    assert {row["dtype"] for row in result["summary"]} == dtypes
    assert set(result["runs"][0]["matmul_peak_flops"]) == dtypes


def test_no_bf16_units_measures_fp32_only_and_says_so(tmp_path):
    """On a CPU without bf16 matrix instructions (forced here through the environment) bf16
    would be emulated, ~150x slower than fp32: the bench neither times it nor measures its
    torch.mm peak, and says why on stdout and in the JSON; asking for it is a one-line error."""
    env = {**os.environ, NO_BF16_UNITS_ENV: "1"}
    out = tmp_path / "model.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_model.py"), "--presets",
                        "bert_tiny:2:32", "--warmup", "1", "--steps", "1", "--vocab-size", "512",
                        "--out", str(out)], capture_output=True, text=True, env=env,
                       timeout=hang_limit())
    assert r.returncode == 0, r.stderr[-2000:]
    why = f"{NO_BF16_UNITS_ENV} is set: treated as a CPU without bf16 matrix instructions"
    assert "bf16 units: none" in r.stdout and f"bf16: not measured: {why}" in r.stdout
    measured = [ln for ln in r.stdout.splitlines() if "tok/s" in ln or "torch.mm" in ln]
    assert len(measured) == 3 and not any("bf16" in ln for ln in measured), r.stdout
    result = json.loads(out.read_text())
    assert result["bf16_units"] is None and result["bf16_not_measured"] == why
    assert result["dtypes"] == ["fp32"]
    assert list(result["runs"][0]["matmul_peak_flops"]) == ["fp32"]
    assert {row["dtype"] for row in result["runs"][0]["results"]} == {"fp32"}

    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_model.py"), "--dtypes",
                        "fp32", "bf16"], capture_output=True, text=True, env=env,
                       timeout=hang_limit())
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [f"error: --dtypes bf16: {why}; measure fp32 here"]


def test_fine_tuning_row(tmp_path):
    """--finetune: ours BertForSequenceClassification against transformers' in the same run."""
    out = tmp_path / "model.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_model.py"), "--presets",
                        "bert_tiny:4:32", "--dtypes", "fp32", "--warmup", "1", "--steps", "2",
                        "--finetune", "--vocab-size", "512", "--out", str(out)],
                       capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["model"]: row for row in json.loads(out.read_text())["summary"]}
    assert {"ours-finetune", "transformers-finetune"} <= set(rows)
    assert rows["transformers-finetune"]["speedup_vs_transformers"] == 1.0
    assert rows["ours-finetune"]["tokens_per_s"] > 0


def test_fine_tuning_rows_time_the_named_switches_too(tmp_path):
    """--finetune --variants: each named switch that a classifier has is timed on the
    fine-tuning step as well (its batches carry the padding the switches act on); a switch of
    the pretraining heads only (sparse_prediction) gets a pretraining row and no fine-tuning
    one."""
    out = tmp_path / "model.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_model.py"), "--presets",
                        "bert_tiny:4:32", "--dtypes", "fp32", "--warmup", "1", "--steps", "2",
                        "--finetune", "--variants", "ours-varlen-groups", "ours-no-sparse",
                        "--vocab-size", "512", "--out", str(out)],
                       capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 0, r.stderr[-2000:]
    models = {row["model"] for row in json.loads(out.read_text())["summary"]}
    assert {"ours-varlen-groups", "ours-no-sparse", "ours-finetune", "transformers-finetune",
            "ours-varlen-groups-finetune"} <= models
    assert "ours-no-sparse-finetune" not in models
    assert "ours-varlen-groups-finetune" in r.stdout


def test_baseline_revision_is_timed_beside_ours_on_new_batches(tmp_path):
    """--baseline REV times our model as of a git revision beside today's (a change against the
    code before it), and each run draws batches of its own (a GPU caches kernel plans per
    shape: runs that repeat shapes would flatter the later ones)."""
    out = tmp_path / "model.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_model.py"), "--presets",
                        "bert_tiny:4:32", "--dtypes", "fp32", "--warmup", "0", "--steps", "1",
                        "--runs", "2", "--baseline", "HEAD", "--vocab-size", "512",
                        "--out", str(out)], capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    models = {row["model"] for row in result["summary"]}
    assert models == {"ours", "transformers", "ours@HEAD"}
    tokens = [run["results"][0]["mean_real_tokens"] for run in result["runs"]]
    assert tokens[0] != tokens[1]  # real tokens of each run's batch: other draws
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "bench_model.py"), "--presets",
                          "bert_tiny:4:32", "--dtypes", "fp32", "--baseline", "no-such-rev",
                          "--out", str(out)], capture_output=True, text=True,
                         timeout=hang_limit())
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1].startswith("error: --baseline no-such-rev: git")


def test_a_variant_the_device_already_runs_is_not_timed_again():
    """With fused Q/K/V, the full last layer and unpadding `auto` per device, `ours-fused-qkv`
    is the default on a GPU and `ours-split-qkv` on a CPU: the bench skips whichever equals
    `ours`."""
    sys.path.insert(0, str(REPO / "bench"))
    from bench_model import same_as_default

    assert same_as_default({"fused_qkv": False}, "cpu")
    assert not same_as_default({"fused_qkv": True}, "cpu")
    assert same_as_default({"fused_qkv": True}, "cuda")
    assert same_as_default({"sparse_last_layer": False}, "cuda")
    assert not same_as_default({"sparse_last_layer": False}, "cpu")
    # unpadding is `auto` too: on a CPU, not on a GPU (the padded grid was 1.2x faster, H200)
    assert same_as_default({"unpad": False}, "cuda")
    assert not same_as_default({"unpad": True}, "cuda")
    assert same_as_default({"unpad": True}, "cpu")
    assert not same_as_default({"unpad": False}, "cpu")
    assert same_as_default({"varlen_attention": "off"}, "cuda")
    assert not same_as_default({"varlen_attention": "nested"}, "cuda")
