"""`make gpu-check` (bench/gpu_check.py): it refuses a machine without CUDA in one line unless
asked to check its plumbing, refuses bad folders before spending the GPU's minutes, and (slow)
runs every stage at tiny sizes on the CPU, leaving one folder with a summary whose figures say
"cpu"."""

import json
import os
import subprocess
import sys

import pytest

from finetune_support import write_glue_task
from time_limits import hang_limit
from train_support import REPO

SCRIPT = os.path.join(REPO, "bench", "gpu_check.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=hang_limit())


def test_refuses_a_machine_without_cuda(tmp_path):
    proc = run("--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("gpu-check: error: torch sees no CUDA device; run this on the "
                                   "GPU machine (--allow-cpu checks the plumbing on a CPU)")
    assert not (tmp_path / "out").exists()


def test_refuses_bad_folders_before_starting(tmp_path):
    proc = run("--allow-cpu", "--glue", str(tmp_path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "has no SST-2/ folder" in proc.stderr
    proc = run("--allow-cpu", "--corpus", str(tmp_path / "nope.txt"))
    assert proc.returncode == 2 and "nope.txt is not a file" in proc.stderr
    proc = run("--allow-cpu", "--glue-labels", "1000", "1000")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "gpu-check: error: --glue-labels 1000 1000: give distinct sizes of at least 1 (e.g. "
        "--glue-labels 8000 1000)")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_every_stage_runs_and_the_summary_says_cpu(tmp_path):
    glue = tmp_path / "glue"
    write_glue_task(str(glue), "sst2")
    out = tmp_path / "out"
    proc = run("--allow-cpu", "--quick", "--out", str(out), "--glue", str(glue),
               "--train-seconds", "8", "--budget", "1200")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = (out / "summary.md").read_text()
    assert "Device: cpu (no GPU: plumbing check only)" in summary
    results = json.loads((out / "results.json").read_text())
    records = {r["name"]: r for stage in results["stages"].values()
               for r in stage.get("runs", [stage])}
    statuses = {name: r["status"] for name, r in records.items()}
    assert statuses == {"pytest_cuda": "ok", "bench_0_bert_tiny_8_64": "ok", "bert_prep": "ok",
                        "bert_train": "ok", "bert_train_resume": "ok", "bench_defer_reads": "ok",
                        "profile_train_step": "ok", "bench_prefetch": "ok",
                        "finetune_pretrained_1e-4": "ok", "finetune_random_1e-4": "ok",
                        "pytest_default": "ok", "bench_1_bert_tiny_4_128": "ok"}, statuses
    # the compile bench comes last, after the suites
    assert max(records.values(), key=lambda r: r["started_s"])["name"] == \
        "bench_1_bert_tiny_4_128"
    bench = json.loads((out / "bench_0_bert_tiny_8_64.json").read_text())
    assert bench["device"] == "cpu"
    assert {r["model"] for r in bench["summary"]} == {"ours", "transformers", "ours-no-unpad",
                                                      "ours-varlen-nested"}
    assert results["train"]["median_tokens_per_s"] > 0
    assert results["train"]["resume_tokens_per_s"] > 0
    # the A/B of deferred reads, on the trained model's shape (its JSON says both modes ran)
    defer = json.loads((out / "defer_reads.json").read_text())
    assert defer["args"]["experiment"] == "gpu_mini" and defer["runs"][0]["read_ms"] > 0
    assert "model=bert_tiny" in defer["args"]["set"]
    assert "## Deferred reads (bench_defer_reads.py, gpu_mini, windows of 2 steps" in summary
    # where a step's time goes: the input pipeline's share, the profiler's tables
    profile = json.loads((out / "profile_train_step.json").read_text())
    assert profile["device"] == "cpu" and 0 < profile["data_ms"] < profile["wall_ms"]
    assert "## A gpu_mini step (profile_train_step.py, 4 steps)" in summary
    assert "by the host's own time" in (out / "profile_train_step.txt").read_text()
    # the A/B of reading batches ahead in a worker process, at the same shape
    prefetch = json.loads((out / "prefetch.json").read_text())
    assert prefetch["args"]["experiment"] == "gpu_mini" and prefetch["runs"][0]["inline_ms"] > 0
    assert "## Prefetching (bench_prefetch.py, gpu_mini, windows of 2 steps" in summary
    # the control beside the model, the gap said
    assert "| pretrained | " in summary and "| random | " in summary
    assert "Pretrained minus random init: " in summary
    assert (out / "pytest_default.xml").is_file() and (out / "env.json").is_file()


@pytest.mark.slow
def test_two_calls_into_one_folder_with_the_suite_beside(tmp_path):
    """A lease's plan (docs/gpu.md): call 1 runs the GPU tests, the bench and the training
    with the default suite beside them on the other CPUs; call 2, into the same folder, the
    fine-tunes and the late bench. The summary holds both calls' records and the SST-2 table."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the suite runs beside only with at least 2 CPUs")
    glue = tmp_path / "glue"
    write_glue_task(str(glue), "sst2")
    out = tmp_path / "out"
    first = run("--allow-cpu", "--quick", "--out", str(out), "--glue", str(glue),
                "--train-seconds", "8", "--budget", "900", "--suite-beside",
                "--stages", "cuda-tests", "bench", "train", "default-suite")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "the default suite runs beside, on " in first.stdout
    second = run("--allow-cpu", "--quick", "--out", str(out), "--glue", str(glue),
                 "--budget", "600", "--stages", "glue", "late-bench",
                 "--glue-labels", "8000", "1000")
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    statuses = {r["name"]: r["status"] for stage in results["stages"].values()
                for r in stage.get("runs", [stage])}
    assert statuses == {"pytest_cuda": "ok", "bench_0_bert_tiny_8_64": "ok", "bert_prep": "ok",
                        "bert_train": "ok", "bert_train_resume": "ok", "bench_defer_reads": "ok",
                        "profile_train_step": "ok", "bench_prefetch": "ok",
                        "finetune_pretrained_1e-4": "ok", "finetune_random_1e-4": "ok",
                        "finetune_pretrained_1e-4_n1000": "ok", "finetune_random_1e-4_n1000": "ok",
                        "pytest_default": "ok", "bench_1_bert_tiny_4_128": "ok"}, statuses
    assert results["stages"]["default-suite"]["beside_on_cpus"] >= 1
    summary = (out / "summary.md").read_text()
    # a table for each size (--quick: a 125th of each), the smaller set trained for more epochs
    assert "| pretrained | " in summary and summary.count("Pretrained minus random init: ") == 2
    assert "64 training sentences, 3 epochs" in summary
    assert "8 training sentences, 10 epochs" in summary
    assert "| pytest_default | ok |" in summary
    # whether the suite still ran when the training started is timing; what the summary says
    # of the training's rate must follow it
    beside = results["stages"]["train"]["suite_beside_on_cpus"]
    assert ("beside the default suite on" in summary) is (beside > 0), summary


def test_a_spent_budget_leaves_the_rest_not_run(tmp_path):
    """Stages that no longer fit are listed, not started (and the summary still written)."""
    out = tmp_path / "out"
    proc = run("--allow-cpu", "--quick", "--out", str(out), "--budget", "5",
               "--stages", "bench", "default-suite")
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["stages"]["bench"]["runs"][0]["status"] == "not run: the budget is spent"
    assert results["stages"]["default-suite"]["status"] == "not run: the budget is spent"
    assert "not run: the budget is spent" in (out / "summary.md").read_text()


def test_a_rate_that_diverged_shows_in_the_glue_table(tmp_path):
    """On the H200 lr 2e-3 diverged in 2 of 3 seeds at 8,000 labels and its column went missing
    from the table; now its cell says so and the best rate is taken among the others."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    c = SimpleNamespace(out=tmp_path, args=SimpleNamespace(glue_labels=[8000], quick=False))
    for init, lr, score in (("pretrained", "3e-4", 0.83), ("random", "1e-4", 0.77)):
        (tmp_path / "glue" / f"{init}-{lr}").mkdir(parents=True)
        (tmp_path / "glue" / f"{init}-{lr}" / "finetune.json").write_text(json.dumps(
            {"score_range": [score - 0.01, score + 0.01], "num_train": 8000,
             "recipe": {"epochs": 3}, "init": init, "best_lr": float(lr), "score": score}))
    (tmp_path / "finetune_pretrained_2e-3.log").write_text(
        "bert-finetune: SST-2 lr 0.002 seed 1: accuracy 50.92\n"
        "bert-finetune: SST-2 lr 0.002 seed 2: diverged: the fine-tuning loss ...\n"
        "bert-finetune: SST-2 lr 0.002 seed 3: diverged: the fine-tuning loss ...\n"
        "bert-finetune: error: every lr of the grid diverged in at least one seed ...\n")
    (tmp_path / "finetune_random_3e-5.log").write_text("bert-finetune: SST-2 lr 3e-05 ...\n")
    table = "\n".join(gpu_check._glue_lines(c))
    assert "| init | lr 1e-4 | lr 3e-4 | lr 2e-3 | best |" in table
    assert ("| pretrained | - | 83.0 (82.0-84.0) | diverged (2 of 3 seeds) | **83.0** (lr 3e-4) |"
            in table)
    assert "| random | 77.0 (76.0-78.0) | - | - | **77.0** (lr 1e-4) |" in table
    assert "Pretrained minus random init: +6.0 points (ranges apart; the target is +3)." in table
