"""The demo (`make demo`) visibly learns, and the README shows what it answers.

The slow test trains the demo recipe as `make demo` prepares and configures it, bounded by steps
instead of the 3-minute budget (so a slow or busy machine runs the same work, only longer): the
steps a quiet 2-core machine gives in 3 minutes. It then asks what the README shows: fill-mask
top-1 on bench/demo_check.py's sentences, accuracy at [MASK] positions far above always guessing
the most frequent token, NSP above chance. Statistics with tolerances: the run is seeded, but
fp32 and bf16 (or another CPU's kernels) train slightly different models. (At half these steps,
as a busy machine gives, the recipe still learns, by less: docs/learning-check.md, "The demo"; the
top-1 count there varies too much from seed to seed to test.)

The fast tests check the README's block against the same sentence list and against itself, so
that changing the sentences without `make demo-readme` fails.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from make_dry_run import make_commands
from train_support import REPO, compose, read_metrics, train_in_process

BERT_PREP = os.path.join(os.path.dirname(sys.executable), "bert-prep")
# What a quiet 2-core machine trains in the demo's 3 minutes (README, "What the demo
# learns": 3,716 steps on the development machine, bf16; 3,302 with one core busy elsewhere).
QUIET_STEPS = 3700


def load_demo_check():
    spec = importlib.util.spec_from_file_location(
        "demo_check", os.path.join(REPO, "bench", "demo_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


demo_check = load_demo_check()


def readme_demo_block() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    start, end = readme.find(demo_check.BEGIN), readme.find(demo_check.END)
    assert 0 <= start < end, "README.md has no demo output block (make demo-readme writes it)"
    return readme[start:end]


def makefile_demo_prep_args() -> list:
    """The bert-prep arguments of the Makefile's `demo` recipe, variables expanded."""
    [prep] = [c for c in make_commands("demo") if c[0] == "bert-prep"]
    return prep[1:]


def test_readme_block_asks_the_sentences_of_demo_check():
    block = readme_demo_block()
    asked = re.findall(r"^    '(.*\[MASK\].*)' \\$", block, re.M)
    assert asked == [s for s, _ in demo_check.SENTENCES]


def test_readme_block_counts_its_own_answers():
    """The sentence above the output says how many top-1 answers are right: the output below
    it must agree."""
    block = readme_demo_block()
    claimed = re.search(r"top-1\sright\son\s(\d+)\sof\sthese\s(\d+)\ssentences", block)
    answers = dict(demo_check.SENTENCES)
    shown = re.findall(r"^(.*\[MASK\].*)\n  \[MASK\]: (\S+) ", block, re.M)
    assert len(shown) == len(answers) == int(claimed.group(2))
    assert sum(answers[s] == top for s, top in shown) == int(claimed.group(1))


def test_the_demo_ends_with_two_of_demo_checks_fill_mask_answers():
    """`make demo` ends by asking its own model two of the sentences the README shows."""
    *_, train, predict = make_commands("demo")
    assert predict[:3] == ["bert-predict", "fill-mask", "runs/demo"]
    assert compose(train[1:]).run_dir == "runs/demo"
    asked = [w for w in predict[3:] if "[MASK]" in w]
    assert len(asked) == 2 and set(asked) <= {s for s, _ in demo_check.SENTENCES}


def test_demo_steps_trains_that_many_steps_in_a_run_of_its_own():
    """`make demo DEMO_STEPS=N` (a busy machine): bounded by steps, not by the 3-minute budget,
    in runs/demo-N-steps (the 3-minute run stays), and its answers come from that run."""
    *_, train, predict = make_commands("demo", "DEMO_STEPS=3000")
    cfg = compose(train[1:])
    assert cfg.trainer.budget_hours is None and cfg.trainer.max_steps == 3000
    assert cfg.run_dir == "runs/demo-3000-steps" == predict[2]
    assert compose(make_commands("demo")[1][1:]).trainer.budget_hours == 0.05


def test_replace_block_keeps_the_rest_of_the_readme():
    text = f"intro\n{demo_check.BEGIN}\nold\n{demo_check.END}\noutro\n"
    new = demo_check.replace_block(text, f"{demo_check.BEGIN}\nnew\n{demo_check.END}")
    assert new == f"intro\n{demo_check.BEGIN}\nnew\n{demo_check.END}\noutro\n"
    with pytest.raises(SystemExit, match="no demo block"):
        demo_check.replace_block("no markers here", "x")


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    """The demo's prepared data, made by the Makefile's own bert-prep command."""
    scratch = tmp_path_factory.mktemp("demo")
    args = [a for a in makefile_demo_prep_args() if not a.startswith("output_dir=")]
    p = subprocess.run([BERT_PREP, *args, f"output_dir={scratch / 'data'}", "progress=false"],
                       capture_output=True, text=True, cwd=scratch)
    assert p.returncode == 0, p.stderr[-2000:]
    return str(scratch / "data")


@pytest.mark.slow
# ~7 minutes on one quiet core in fp32 (a busy one only takes longer): the slow tests' budget.
def test_demo_recipe_learns_from_context(demo_data, tmp_path, one_thread):
    run = str(tmp_path / "run")
    train_in_process(["experiment=demo", f"data.dir={demo_data}", f"run_dir={run}",
                      "trainer.budget_hours=null", f"trainer.max_steps={QUIET_STEPS}",
                      "trainer.progress_bar=false"])
    assert read_metrics(run)[-1]["step"] == QUIET_STEPS
    s = demo_check.summarize(run, demo_data)
    print(s)
    assert 0.04 < s["baseline"] < 0.08
    # Observed 0.26-0.28 (the 128-token recipe before: 0.10-0.11 in as much training time); make
    # demo on a quiet machine: 0.258 at 3,716 steps
    assert s["mlm_accuracy_masked"] > max(0.18, 3 * s["baseline"])
    assert s["nsp_accuracy"] > 0.58            # 428 held-out pairs: chance is 0.50 +- 0.024
    right = s["fill_mask_right"]
    in_top = sum(f["answer"] in f["top"] for f in s["fill_mask"])
    # A model at the unigram level answers "the" or "." everywhere: 0 right, 0 in its top 3.
    # Observed: 5 of 5 right in make demo's quiet run (3,716 steps, 2 threads), 3 of 5 (4 in
    # the top 3) in this test's one-thread run; which sentences come right moves with the
    # kernels (bf16 or fp32, thread count), so the bound leaves room below the observed.
    assert right >= 2, s["fill_mask"]
    assert in_top >= 3, s["fill_mask"]
