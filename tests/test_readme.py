"""The README's commands work as written, and the README and docs/ show what the code does.

Two kinds of check. The README's first hour and its `make demo` block run as written (below);
every other command line of the README and of every docs/*.md page is checked without running
it: a bert-prep / bert-train / bert-finetune / bert-glue line composes its config (real groups,
options and keys, as the command checks them before it starts), a line of the other bert-*
commands, `accelerate launch`, `python bench/*.py` or `python -m ...` parses with the command's
own argument parser, and a `make` line names real targets (a sweep's line as one of its runs;
a Hydra line with a placeholder, `...` or `<dir>`, and a line with shell syntax, `$VAR` or a
pipe, are left out). Links and #anchors (GitHub's slugs of
the headings, in the same file or another) lead somewhere in every one of those files, and the
README links every docs/*.md page.

Which blocks run: the fenced blocks of README.md whose info string is `bash readme-test` or
`python readme-test` (GitHub still highlights them as bash / python); docs/ pages have none.
They run in README order, one test each, all in one scratch directory (the working directory),
so a later block sees what an earlier one wrote (my_texts/, prepared/, runs/, exported/), as for
a reader following the README. The console scripts and `python` are the ones of this
environment; `conf` in the scratch directory links to the repository's (for
`--config_file conf/accelerate/...`).

Tiny overrides: every bert-prep / bert-train command of a bash block (also `python -m
bert_pretrain.train` and `accelerate launch ... -m bert_pretrain.train`) gets TINY[its command]
appended, so that it runs in seconds: a 1,000-word vocabulary and one copy of the data, a
4-layer width-32 model trained for 2 steps. Hydra takes the last value given for a key, so these
replace the README's own sizes and step counts; nothing else in the command changes. A block can
append more overrides to its bert-train commands with an HTML comment on the line right above it:

    <!-- readme-test: trainer.max_steps=4 -->

(the resume step uses it: the first run stops at step 2, the resumed one must go further).

Shown output: a `text readme-output` block right after a tested block lists lines that must each
be a line of that block's standard output, in that order ("..." lines are skipped).

`make demo`: the block fenced `bash readme-test make-demo` must hold exactly the commands of the
Makefile's `demo` recipe.
"""

import contextlib
import glob
import io
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from make_dry_run import make_commands
from time_limits import hang_limit
from train_support import CHILD_PYTHONPATH, REPO

README = os.path.join(REPO, "README.md")
DOCS = sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
MARKDOWN = [README] + DOCS
BIN = os.path.dirname(sys.executable)

TINY = {
    "bert-prep": ["tokenizer.vocab_size=1000", "dupe_factor=1", "max_seq_length=64",
                  "max_predictions_per_seq=10", "progress=false"],
    "bert-train": ["trainer.max_steps=2", "trainer.budget_hours=null", "trainer.warmup_steps=1",
                   "trainer.global_batch_size=4", "trainer.micro_batch_size=null",
                   "trainer.eval_max_samples=8", "trainer.progress_bar=false",
                   "model.hidden_size=32", "model.num_hidden_layers=4",
                   "model.num_attention_heads=2", "model.intermediate_size=64"],
}
FENCE = re.compile(r"^```(\S*)(.*)$")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def parse_blocks(text):
    """[(language, flags, body, extra_overrides, expected_output_lines)] for every fenced block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        lang, flags = m.group(1), m.group(2).split()
        above = lines[i - 1].strip() if i else ""
        extra = []
        if above.startswith("<!-- readme-test:") and above.endswith("-->"):
            extra = above[len("<!-- readme-test:"):-len("-->")].split()
        end = i + 1
        while not lines[end].startswith("```"):
            end += 1
        blocks.append([lang, flags, "\n".join(lines[i + 1:end]), extra, None])
        if lang == "text" and "readme-output" in flags and blocks[:-1]:
            blocks.pop()
            blocks[-1][4] = lines[i + 1:end]
        i = end + 1
    return blocks


def readme_blocks():
    blocks = parse_blocks(read(README))
    return [b for b in blocks if b[0] in ("bash", "python") and "readme-test" in b[1]]


def logical_lines(body):
    return body.replace("\\\n", " ").splitlines()


def words_of(line):
    """The words of a plain command line; [] for one with shell syntax (pipes, quotes that go
    on to the next line ...), which is run as it is."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)  # quotes and a trailing # comment taken off, operators split out
    except ValueError:
        return []
    if any(set(t) <= set("();<>|&") or "$" in t or "`" in t for t in tokens):
        return []
    return shlex.split(line, comments=True)


ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def command_words(words):
    """`words` without the environment assignments in front (OMP_NUM_THREADS=1 bert-train ...)."""
    i = 0
    while i < len(words) and ENV_ASSIGNMENT.match(words[i]):
        i += 1
    return words[i:]


# The Hydra commands' modules, as `python -m` / `accelerate launch -m` / `torchrun -m` run them.
HYDRA_MODULES = {"bert_pretrain.train": "bert-train", "bert_pretrain.finetune": "bert-finetune"}
LAUNCHERS = ("accelerate", "bert-launch", "torchrun")


def program(words):
    """The command a line runs: bert-train for `python -m bert_pretrain.train` and for a
    launcher of it, else the first word after any environment assignments."""
    words = command_words(words)
    if words[:1] == ["python"] and words[1:2] == ["-m"] and words[2:3] \
            and words[2] in HYDRA_MODULES:
        return HYDRA_MODULES[words[2]]
    if words[:1] and words[0] in LAUNCHERS:
        for module, prog in HYDRA_MODULES.items():
            if module in words:
                return prog
    return words[0] if words else ""


def with_tiny_overrides(body, extra):
    """The block with TINY (and `extra` for bert-train) appended to each bert-prep/-train line."""
    out = []
    for line in logical_lines(body):
        words = words_of(line)
        prog = program(words)
        if prog in TINY:
            words += TINY[prog] + (extra if prog == "bert-train" else [])
            line = shlex.join(words)
        out.append(line)
    return "\n".join(out)


def environment():
    return dict(os.environ, PATH=BIN + os.pathsep + os.environ["PATH"], PYTHONPATH=CHILD_PYTHONPATH,
                OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                # a missing local directory must fail at once, not be looked up on the Hub
                HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def run_shell(script, cwd):
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=environment(),
                          capture_output=True, text=True, timeout=hang_limit())


BLOCKS = readme_blocks()


def block_id(block):
    first = next(line for line in logical_lines(block[2]) if line.strip())
    return f"{BLOCKS.index(block) if block in BLOCKS else ''}:{first[:40].strip()}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    path = tmp_path_factory.mktemp("readme")
    os.symlink(os.path.join(REPO, "conf"), path / "conf")
    return path


def test_the_readme_has_tested_blocks_for_every_first_hour_step():
    commands = " ".join(b[2] for b in BLOCKS)
    for command in ("bert-prep", "bert-train", "resume=auto", "bert-report", "bert-export",
                    "--head masked-lm", "bert-predict fill-mask", "bert-predict nsp",
                    "bert-attention"):
        assert command in commands, command


def test_only_the_readme_has_blocks_that_run():
    """A `readme-test` block elsewhere would never run: it would look tested and be unchecked."""
    for path in DOCS:
        flagged = [b[2].splitlines()[0] for b in parse_blocks(read(path)) if "readme-test" in b[1]]
        assert not flagged, f"{os.path.relpath(path, REPO)}: readme-test blocks run only in " \
                            f"README.md: {flagged}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)),
                         ids=lambda index: block_id(BLOCKS[index]))
def test_readme_block_runs_as_written(index, scratch):
    # Blocks depend on the ones before them: when this test runs alone (pytest -k), the earlier
    # blocks run first.
    for previous in range(index):
        if previous not in RAN:
            try:
                run_block(previous, scratch)
            except BaseException:  # noqa: BLE001 -- its own test reports it
                RAN.setdefault(previous, "failed")
    run_block(index, scratch)


RAN = {}  # block index -> the exit status of its run, or "failed"


def run_block(index, scratch):
    lang, flags, body, extra, expected = BLOCKS[index]
    if lang == "python":
        script = f"python - <<'READMEPY'\n{body}\nREADMEPY"
    else:
        script = with_tiny_overrides(body, extra)
    r = run_shell(script, str(scratch))
    RAN[index] = r.returncode
    assert r.returncode == 0, f"$ {script}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n" \
                              f"{r.stderr[-3000:]}"
    if expected:
        out = r.stdout.splitlines()
        position = 0
        for line in (e for e in expected if e.strip() and e.strip() != "..."):
            assert line in out[position:], f"README shows {line!r}; the command printed:\n" \
                                           f"{r.stdout}"
            position = out.index(line, position) + 1


def makefile_targets():
    return set(re.findall(r"^([a-zA-Z_-]+):", read(os.path.join(REPO, "Makefile")), re.M))


def test_make_demo_runs_the_readme_commands():
    """The README's `make demo` block is the Makefile's demo recipe, command for command."""
    [block] = [b for b in BLOCKS if "make-demo" in b[1]]
    readme = [shlex.split(line) for line in logical_lines(block[2]) if line.strip()]
    commands = make_commands("demo")
    assert commands == readme


def test_every_make_target_has_a_help_line():
    makefile = read(os.path.join(REPO, "Makefile"))
    phony = re.search(r"^\.PHONY: (.*)$", makefile, re.M).group(1).split()
    targets = re.findall(r"^([a-zA-Z_-]+):", makefile, re.M)
    documented = re.findall(r"^([a-zA-Z_-]+):.*## \S", makefile, re.M)
    assert set(targets) == set(phony) == set(documented), (targets, phony, documented)


# Each Hydra command's config root and primary config.
CONFIGS = {"bert-prep": ("prep", "prep"), "bert-train": ("train", "train"),
           "bert-finetune": ("finetune", "finetune"), "bert-glue": ("finetune", "glue")}


def console_scripts():
    """{command: "module:function"} from pyproject.toml's [project.scripts]."""
    text = read(os.path.join(REPO, "pyproject.toml"))
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?:^\[|\Z)", text, re.M | re.S).group(1)
    return dict(re.findall(r'^([\w-]+) = "([\w.:]+)"', section, re.M))


def documented_lines():
    """[(file, words, line)] for every plain command line of the bash blocks of the README
    (apart from the blocks that run) and of every docs/*.md page."""
    found = []
    for path in MARKDOWN:
        for lang, flags, body, _, _ in parse_blocks(read(path)):
            if lang != "bash" or "readme-test" in flags:
                continue
            for line in logical_lines(body):
                words = command_words(words_of(line.strip()))
                if words:
                    found.append((os.path.relpath(path, REPO), words, line.strip()))
    return found


def is_placeholder(word):
    return "..." in word or "<" in word


def sweep_free(overrides):
    """A multirun command line as one of its runs: `-m` dropped, `key=a,b,c` as `key=a` (Hydra
    composes each run of a sweep like that; a sweeper's own search space is in its config)."""
    out = []
    for arg in overrides:
        if arg in ("-m", "--multirun"):
            continue
        key, eq, value = arg.partition("=")
        if eq and "," in value and not re.search(r"[\[\](){}'\"]", value):
            arg = f"{key}={value.split(',')[0]}"
        out.append(arg)
    return out


def hydra_commands():
    """The Hydra commands' lines: [(file, program, overrides, line)], leaving out lines with a
    placeholder (`...`, `<dir>`)."""
    found = []
    for path, words, line in documented_lines():
        prog = program(words)
        if prog not in CONFIGS or any(is_placeholder(w) for w in words):
            continue
        for module in HYDRA_MODULES:
            if module in words:
                words = [prog] + words[words.index(module) + 1:]
        found.append((path, prog, sweep_free(words[1:]), line))
    return found


def compose_failure(prog, overrides):
    """None if `prog`'s config composes with `overrides`, else the one line the command prints."""
    from bert_pretrain.cli_errors import precheck
    from bert_pretrain.config import register
    from bert_pretrain.finetune.config import register as register_finetune

    register()  # the structured configs the YAML files name (idempotent)
    register_finetune()
    root, name = CONFIGS[prog]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            precheck(prog, os.path.join(REPO, "conf", root), name, overrides)
    except SystemExit:
        return err.getvalue().strip() or "exit 2"
    if prog == "bert-finetune":  # old spellings compose but are refused when it starts
        from bert_pretrain.cli_errors import _compose
        from bert_pretrain.errors import ConfigError
        from bert_pretrain.finetune.config import check_spellings

        try:
            check_spellings(_compose(os.path.join(REPO, "conf", root), name, overrides))
        except ConfigError as exc:
            return str(exc)
    return None


def test_the_documented_hydra_commands_compose():
    """Every complete bert-prep / bert-train / bert-finetune / bert-glue line of the README and
    docs/ (a sweep's lines as one of their runs, an Optuna search with its sweeper's config)
    names real groups, options and keys: the check each command makes before it starts."""
    commands = hydra_commands()
    assert len(commands) >= 40
    assert set(CONFIGS) <= {prog for _, prog, _, _ in commands}
    assert any("hparams_search=" in " ".join(o) for _, _, o, _ in commands)
    failures = []
    for path, prog, overrides, line in commands:
        failure = compose_failure(prog, overrides)
        if failure:
            failures.append(f"{path}: {line}\n    {failure}")
    assert not failures, "\n".join(failures)


def test_a_wrong_key_in_a_documented_command_is_caught():
    """The check above fails on a misspelt key, option or group, in a sweep too."""
    assert compose_failure("bert-train", sweep_free(["-m", "optim.lr=1e-4,3e-4"])) is None
    assert compose_failure("bert-train", ["trainer.max_stepz=5"])
    assert compose_failure("bert-train", sweep_free(["-m", "optim.lrr=1e-4,3e-4"]))
    assert compose_failure("bert-train", ["hparams_search=mlm_tpe", "hydra.sweeper.n_trialz=3"])
    assert compose_failure("bert-prep", ["corpus=builtin", "corpus.pahts=[x]"])
    assert compose_failure("bert-glue", ["tasks=fast", "contrls=true"])
    assert compose_failure("bert-finetune", ["task=sst2", "model=m"]) is None
    assert "is now data_dir" in compose_failure("bert-finetune",
                                                ["task=sst2", "task.data_dir=g", "model=m"])


# Run in a child process (the bench scripts set process-wide things as they load): each line's
# entry point runs with argparse's parse_args replaced by one that parses and then stops it, so
# a line that parses does nothing, and one that does not gives argparse's error line.
PARSE_ONLY = r"""
import argparse, contextlib, importlib, io, json, runpy, sys

class Parsed(BaseException):
    pass

parse_args = argparse.ArgumentParser.parse_args

def parse_then_stop(self, args=None, namespace=None):
    parse_args(self, args, namespace)
    raise Parsed

argparse.ArgumentParser.parse_args = parse_then_stop
results = []
for kind, target, argv in json.load(sys.stdin):
    sys.argv = [target] + argv
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if kind == "entry":
                module, function = target.split(":")
                getattr(importlib.import_module(module), function)()
            elif kind == "path":
                sys.path.insert(0, target.rpartition("/")[0])  # as `python script.py` does
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        results.append("it ran without parsing its arguments")
    except Parsed:
        results.append(None)
    except SystemExit as exc:
        lines = err.getvalue().strip().splitlines()
        results.append(None if exc.code in (0, None) else lines[-1] if lines else str(exc.code))
    except Exception as exc:
        results.append(f"{type(exc).__name__}: {exc}")
print(json.dumps(results))
"""


def argparse_command(words):
    """(kind, target, argv) to parse one line with its program's own parser, or None."""
    scripts = console_scripts()
    words = [w for w in words if w != "..."]
    prog = words[0]
    if prog == "accelerate" and words[1:2] == ["launch"]:
        return "entry", scripts["bert-launch"], words[2:]
    if prog in scripts and prog not in CONFIGS:
        return "entry", scripts[prog], words[1:]
    if prog == "python" and words[1:2] == ["-m"] and len(words) > 2 \
            and words[2] not in HYDRA_MODULES:
        return "module", words[2], words[3:]
    if prog == "python" and len(words) > 1 and words[1].endswith(".py"):
        return "path", os.path.join(REPO, words[1]), words[2:]
    return None


def parse_failures(lines):
    """For [(kind, target, argv)]: None where the line parses, else argparse's error."""
    r = subprocess.run([sys.executable, "-c", PARSE_ONLY], input=json.dumps(lines), cwd=REPO,
                       env=environment(), capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_documented_commands_parse_and_name_real_things():
    """Every line of the other bert-* commands (bert-export, bert-predict, bert-attention,
    bert-report, bert-sweep-summary, bert-launch), of `accelerate launch`, of `python bench/...`
    and `python -m ...` parses with that program's own argument parser; every `make` line
    names real targets; no line calls a bert-* command that does not exist."""
    scripts, targets = console_scripts(), makefile_targets()
    to_parse, failures = [], []
    for path, words, line in documented_lines():
        if words[0] == "make":
            unknown = [w for w in words[1:] if "=" not in w and w not in targets]
            if unknown:
                failures.append(f"{path}: {line}\n    no make target {unknown}")
            continue
        if words[0].startswith("bert-") and words[0] not in scripts:
            failures.append(f"{path}: {line}\n    no command {words[0]}")
            continue
        command = argparse_command(words)
        if command:
            to_parse.append((path, line, command))
    assert {"bert-export", "bert-predict", "bert-attention", "bert-report",
            "bert-sweep-summary"} <= {line.split()[0] for _, line, _ in to_parse}
    assert any(c[0] == "path" for _, _, c in to_parse)
    for (path, line, _), failure in zip(to_parse, parse_failures([c for _, _, c in to_parse])):
        if failure:
            failures.append(f"{path}: {line}\n    {failure}")
    assert not failures, "\n".join(failures)


def test_a_wrong_option_in_a_documented_command_is_caught():
    """The check above fails on an option a command does not have, a missing argument or a
    bench script's misspelt flag, and passes the same lines written right."""
    lines = [argparse_command(shlex.split(line)) for line in (
        "bert-export runs/demo exported/demo --head masked-lm",
        "bert-export runs/demo exported/demo --head masked_lm",
        "bert-predict fill-mask runs/demo 'A [MASK].' --topk 5",
        "bert-report",
        "accelerate launch --num_proceses 2 -m bert_pretrain.train",
        "python bench/bench_model.py --threads 1",
        "python bench/bench_model.py --thred 1",
        "python -m bert_pretrain.tools.sweep_summary multirun/x --metric objective --mode min",
        "python -m bert_pretrain.tools.sweep_summary multirun/x --mode minimum")]
    assert [failure is None for failure in parse_failures(lines)] == [
        True, False, False, False, False, True, False, True, False]


def heading_slugs(markdown: str) -> set:
    """GitHub's anchors of a markdown text's headings (a repeated heading gets -1, -2, ...)."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)  # a "# comment" is no heading
    slugs, seen = set(), {}
    for heading in re.findall(r"^#+ (.*)$", prose, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slugs.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return slugs


def broken_links(path: str) -> list:
    """The links of a markdown file that lead nowhere: a missing file (relative to the file's
    own folder), a #anchor that is no heading of its file."""
    text, broken = read(path), []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        linked = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not linked.startswith(REPO + os.sep) or not os.path.exists(linked):
            broken.append(target)
        elif anchor and (not linked.endswith(".md") or anchor not in heading_slugs(read(linked))):
            broken.append(target)
    return broken


def test_the_links_lead_somewhere():
    """Section links (#anchor, GitHub's slugs of the headings), links to other files and to
    their sections, in the README and in every docs/*.md page."""
    broken = {os.path.relpath(p, REPO): broken_links(p) for p in MARKDOWN}
    assert not {p: b for p, b in broken.items() if b}


def test_a_broken_link_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n## Its part\n```bash\n# no heading\n```\n")
    (tmp_path / "README.md").write_text(
        "# Title\n[ok](docs/a.md) [ok](docs/a.md#its-part) [ok](#title)\n"
        "[no](docs/b.md) [no](docs/a.md#no-heading) [no](#its-part) [no](../outside.md)\n")
    (tmp_path / "docs" / "b-link.md").write_text("[ok](a.md#a-page) [no](docs/a.md)\n")
    assert broken_links(str(tmp_path / "README.md")) == [
        "docs/b.md", "docs/a.md#no-heading", "#its-part", "../outside.md"]
    assert broken_links(str(tmp_path / "docs" / "b-link.md")) == ["docs/a.md"]


def test_the_readme_links_every_docs_page():
    linked = {os.path.normpath(os.path.join(REPO, target.partition("#")[0]))
              for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)", read(README))}
    unlinked = [os.path.relpath(p, REPO) for p in DOCS if p not in linked]
    assert DOCS and not unlinked, f"README.md links no page {unlinked}"
