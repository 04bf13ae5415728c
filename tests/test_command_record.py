"""The record of a command (.hydra/) goes with the results it made, and a refused command leaves
nothing behind: bert-train, bert-finetune, bert-glue and bert-prep through their real entry
points (Hydra included), several commands in one child process to pay for one start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from finetune_support import FAST, pretrained_run, sentence_task, write_glue_task
from time_limits import hang_limit
from train_support import CHILD_PYTHONPATH, write_prepared

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs each command's main() with its argv in this child, in the working directory given, and
# prints one JSON line per command: its exit status and what it said on stderr.
CHILD = r"""
import contextlib, importlib, io, json, os, sys

def paths():
    return sorted(os.path.relpath(os.path.join(d, n)) for d, ds, fs in os.walk(".")
                  for n in ds + fs)

for prog, module, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    sys.argv = [prog, *argv]
    code = 0
    with contextlib.redirect_stderr(err):
        try:
            importlib.import_module(module).main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    print("RESULT " + json.dumps({"code": code, "err": err.getvalue(), "paths": paths()}),
          flush=True)
"""

MODULES = {"bert-train": "bert_pretrain.train", "bert-finetune": "bert_pretrain.finetune.cli",
           "bert-glue": "bert_pretrain.finetune.glue", "bert-prep": "data_prep.build"}


def run_commands(cwd, commands: list, with_paths: bool = False) -> list:
    """[(exit status, stderr)] of each [prog, *argv] run in `cwd`, in one child process (and
    what is under `cwd` after it, with_paths)."""
    spec = [(c[0], MODULES[c[0]], list(c[1:])) for c in commands]
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], cwd=str(cwd), env=env,
                       capture_output=True, text=True, timeout=hang_limit())
    results = [json.loads(line[len("RESULT "):]) for line in p.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == len(commands), p.stdout[-3000:] + p.stderr[-3000:]
    return [(r["code"], r["err"], r["paths"]) if with_paths else (r["code"], r["err"])
            for r in results]


def tree(root) -> dict:
    """{relative path: file content (None for a folder)} of everything under root."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(folder, name), root)] = None
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def overrides(folder) -> list:
    with open(os.path.join(folder, ".hydra", "overrides.yaml")) as f:
        return yaml.safe_load(f)


def test_refused_commands_leave_the_working_directory_as_it_was(tmp_path):
    """Each command is refused (no model, a model that is not there, a text file for data.dir,
    a misspelt or old key, a corpus file that is not there or empty, a checkpoint that is not
    there): exit 2, one line, and nothing new under the working directory (Hydra's folder with
    its .hydra/ record was left behind, and a refused run's or prep's parent folders)."""
    (tmp_path / "notes.txt").write_text("a text file, not a prepared folder\n")
    (tmp_path / "empty.txt").write_text("")
    prepared = write_prepared(str(tmp_path / "prep"), num_train=16, num_valid=4)
    before = tree(tmp_path)
    commands = [
        ["bert-finetune", "task=sst2"],
        ["bert-finetune", "task=sst2", "model=/nonexistent"],
        ["bert-glue"],
        ["bert-glue", "models=[/nonexistent]"],
        ["bert-train", "data.dir=notes.txt"],
        ["bert-train", "data_dir=prepared/x"],          # bert-finetune's spelling
        ["bert-train", "trainer.max_step=3"],
        ["bert-prep", "corpus=text", "corpus.paths=[missing.txt]", "output_dir=prepared/x"],
        # refused once they have made their folders (the run's log and lock, the prep's lock):
        # the folders and the parents they made go again
        ["bert-prep", "corpus=text", "corpus.paths=[empty.txt]", "output_dir=prepared/x",
         "progress=false"],
        ["bert-train", "experiment=smoke", f"data.dir={prepared}", "run_dir=runs/new/run",
         "resume=runs/old/checkpoints/step-00000002"],
    ]
    for command, (code, err, after) in zip(commands, run_commands(tmp_path, commands, True)):
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and ": error: " in lines[0], (command, err)
        assert set(after) == set(before), (command, sorted(set(after) ^ set(before)))
    assert tree(tmp_path) == before  # (every file's bytes too)


@pytest.mark.slow  # (a pretraining, 4 fine-tuning grids and 2 trainings: ~1 min on 2 cores)
def test_a_fine_tune_with_other_settings_takes_its_record_beside(tmp_path):
    """o1 holds epochs=2 results: the epochs=3 rerun goes to o1-2 with its own record, o1's
    record is the epochs=2 command's still (bert-glue's grids alike); a bert-train rerun refused
    (the run folder has checkpoints) leaves the run's record as it was."""
    run = pretrained_run(str(tmp_path / "pretrained"))
    task = sentence_task(str(tmp_path / "task"), n_train=32, n_dev=16)
    prepared = write_prepared(str(tmp_path / "prep"), num_train=32, num_valid=8)
    base = ["bert-finetune", *task, f"model={run}", *FAST, "out_dir=o1"]
    train = ["bert-train", "experiment=smoke", f"data.dir={prepared}", "run_dir=r1",
             "trainer.checkpoint_every=2", "trainer.warmup_steps=1", "trainer.eval_every=0",
             "trainer.report=false"]
    glue_data = str(tmp_path / "glue_data")
    write_glue_task(glue_data, "sst2", n_train=32, n_dev=16)
    glue = ["bert-glue", f"models=[{run}]", "tasks=[sst2]", f"data_dir={glue_data}", *FAST,
            "out_dir=g"]
    results = run_commands(tmp_path, [
        base + ["recipe.epochs=2"], base + ["recipe.epochs=3"],
        train + ["trainer.max_steps=2"], train + ["trainer.max_steps=3"],
        glue + ["recipe.epochs=2"], glue + ["recipe.epochs=3"]])
    assert [code for code, _ in results] == [0, 0, 0, 2, 0, 0], results
    # bert-glue: each grid's folder has the record of its results; the report's folder, of the
    # command that wrote the report (the last)
    assert "recipe.epochs=2" in overrides(tmp_path / "g" / "run" / "sst2")
    assert "recipe.epochs=3" in overrides(tmp_path / "g" / "run" / "sst2-2")
    assert "recipe.epochs=3" in overrides(tmp_path / "g")
    assert "already has checkpoints" in results[3][1]
    assert "recipe.epochs=2" in overrides(tmp_path / "o1")
    assert "recipe.epochs=3" in overrides(tmp_path / "o1-2")
    for folder, epochs in [("o1", 2), ("o1-2", 3)]:  # the record is of its results
        with open(tmp_path / folder / "finetune.json") as f:
            assert json.load(f)["recipe"]["epochs"] == epochs
        with open(tmp_path / folder / ".hydra" / "config.yaml") as f:
            assert yaml.safe_load(f)["recipe"]["epochs"] == epochs
    assert "trainer.max_steps=2" in overrides(tmp_path / "r1")
    assert not [n for n in os.listdir(tmp_path / "o1") if n.startswith(".hydra.")]


def test_the_record_is_written_whole_and_never_over_another(tmp_path, monkeypatch):
    """write_record: a folder's record stays unless replace=True; no temp folder remains."""
    from bert_pretrain import command_record

    monkeypatch.setattr(command_record, "_hydra_parts",
                        lambda: {"hydra.yaml": "hydra: {}\n", "overrides.yaml": "- a=1\n"})
    assert command_record.write_record(str(tmp_path), "x: 1\n")
    monkeypatch.setattr(command_record, "_hydra_parts",
                        lambda: {"hydra.yaml": "hydra: {}\n", "overrides.yaml": "- a=2\n"})
    assert not command_record.write_record(str(tmp_path), "x: 2\n")
    assert overrides(tmp_path) == ["a=1"]
    assert command_record.write_record(str(tmp_path), "x: 2\n", replace=True)
    assert overrides(tmp_path) == ["a=2"]
    assert (tmp_path / ".hydra" / "config.yaml").read_text() == "x: 2\n"
    assert sorted(os.listdir(tmp_path)) == [".hydra"]
