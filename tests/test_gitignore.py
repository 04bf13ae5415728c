"""What the README's commands write is ignored by git: a reader who follows the README in a clone
sees a clean `git status` (and cannot commit a run or a prepared folder by accident), while the
sources named like those outputs (bert_pretrain/finetune/, conf/finetune/) are not ignored."""

import os
import re
import shlex
import shutil
import subprocess

import pytest

from train_support import REPO

# Where a command line says it writes: a key=value setting, -o, bert-export's second argument,
# mkdir's folder, and the folders Hydra and the commands use by default.
WRITES = re.compile(r"^(?:output_dir|out_dir|run_dir|hydra\.sweep\.dir)=(.+)$")
DEFAULTS = ["runs/x", "multirun/x", "finetune/sst2", "glue/glue.json", "outputs/x",
            "gpu-check/x", "bench/results/x.json"]


def written_paths(text: str) -> set:
    found = set()
    for block in re.findall(r"```bash[^\n]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            for i, word in enumerate(words):
                match = WRITES.match(word)
                if match:
                    found.add(match.group(1))
                elif word == "-o" and i + 1 < len(words):
                    found.add(words[i + 1])
            if words[:1] == ["bert-export"] and len(words) > 2:
                found.add(words[2])
            if words[:2] == ["mkdir", "-p"]:
                found.update(words[2:])
    return {p for p in found if "<" not in p and "$" not in p and "..." not in p}


@pytest.mark.skipif(shutil.which("git") is None or
                    not os.path.exists(os.path.join(REPO, ".git")), reason="not a git checkout")
def test_what_the_readme_commands_write_is_ignored_and_the_sources_are_not():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        paths = sorted(written_paths(f.read()) | set(DEFAULTS))
    assert {"prepared/mytext", "exported/mytext", "maps.png", "finetune/sst2-random",
            "glue/compare", "my_texts"} <= set(paths), paths
    # a folder's path with a file in it (git tells a folder pattern only on a path inside it)
    paths = [p if os.path.splitext(p)[1] else f"{p.rstrip('/')}/file" for p in paths]
    r = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=REPO,
                       capture_output=True, text=True)
    ignored = set(r.stdout.split())
    assert ignored == set(paths), sorted(set(paths) - ignored)
    sources = ["bert_pretrain/finetune/cli.py", "conf/finetune/finetune.yaml",
               "bert_pretrain/finetune/new_module.py", "conf/finetune/task/new.yaml"]
    r = subprocess.run(["git", "check-ignore", "--no-index", *sources], cwd=REPO,
                       capture_output=True, text=True)
    assert r.stdout.split() == [], r.stdout
