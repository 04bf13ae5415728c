"""The README's commands work as written, and show what the code does.

Which blocks run: the fenced blocks whose info string is `bash readme-test` or
`python readme-test` (GitHub still highlights them as bash / python). They run in README order,
one test each, all in one scratch directory (the working directory), so a later block sees what
an earlier one wrote (my_texts/, prepared/, runs/, exported/), as for a reader following the
README. The console scripts and `python` are the ones of this environment; `conf` in the scratch
directory links to the repository's (for `--config_file conf/accelerate/...`).

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

Blocks that call a command whose code is not on this branch yet are skipped, naming it (see
`missing_feature`); once everything is merged none is.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

from make_dry_run import make_commands
from time_limits import hang_limit
from train_support import REPO

README = os.path.join(REPO, "README.md")
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
    with open(README) as f:
        blocks = parse_blocks(f.read())
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


def program(words):
    if words[:1] == ["python"] and words[1:3] == ["-m", "bert_pretrain.train"]:
        return "bert-train"
    if words[:2] == ["accelerate", "launch"] and "bert_pretrain.train" in words:
        return "bert-train"
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


def missing_feature(body):
    """A command of `body` whose code is not on this branch yet, or None."""
    commands = {program(words_of(line)) for line in logical_lines(body)}
    for command, module in [("bert-predict", "predict"), ("bert-report", "report"),
                            ("bert-attention", "attention_maps")]:
        if command in commands and not os.path.exists(
                os.path.join(REPO, "bert_pretrain", "tools", module + ".py")):
            return command
    if "bert-export" in commands:  # a run directory as its source came with bert-predict
        r = run_shell("bert-export --help", REPO)
        if "run directory" not in r.stdout:
            return "bert-export RUN_DIR"
    return None


def environment():
    return dict(os.environ, PATH=BIN + os.pathsep + os.environ["PATH"], PYTHONPATH=REPO,
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
                    "bert-predict fill-mask", "bert-predict nsp", "bert-attention"):
        assert command in commands, command


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
    skipped = [block_id(BLOCKS[i]) for i in range(index) if RAN[i] == "skipped"]
    try:
        run_block(index, scratch)
    except AssertionError:
        if skipped:  # only while features are unmerged: it may need their output
            pytest.skip(f"fails after skipped block(s) {skipped}, whose output it may need")
        raise


RAN = {}  # block index -> "skipped" or the exit status of its run


def run_block(index, scratch):
    lang, flags, body, extra, expected = BLOCKS[index]
    missing = missing_feature(body)
    if missing:
        RAN[index] = "skipped"
        pytest.skip(f"{missing} is not on this branch yet")
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


def test_make_demo_runs_the_readme_commands():
    """The README's `make demo` block is the Makefile's demo recipe, command for command."""
    [block] = [b for b in BLOCKS if "make-demo" in b[1]]
    readme = [shlex.split(line) for line in logical_lines(block[2]) if line.strip()]
    commands = make_commands("demo")
    if readme == commands[:-1] and commands[-1][:2] == ["bert-predict", "fill-mask"]:
        # README.md is rewritten on another branch (issue 32): until it shows the demo's new last
        # step, this is the one difference allowed, and it is reported, not hidden.
        pytest.xfail(f"README.md's make-demo block lacks the demo's last command: "
                     f"{shlex.join(commands[-1])}")
    assert commands == readme


def test_every_make_target_has_a_help_line():
    with open(os.path.join(REPO, "Makefile")) as f:
        makefile = f.read()
    phony = re.search(r"^\.PHONY: (.*)$", makefile, re.M).group(1).split()
    targets = re.findall(r"^([a-zA-Z_-]+):", makefile, re.M)
    documented = re.findall(r"^([a-zA-Z_-]+):.*## \S", makefile, re.M)
    assert set(targets) == set(phony) == set(documented), (targets, phony, documented)


# Each Hydra command's config root and primary config.
CONFIGS = {"bert-prep": ("prep", "prep"), "bert-train": ("train", "train"),
           "bert-finetune": ("finetune", "finetune"), "bert-glue": ("finetune", "glue")}


def documented_commands():
    """The Hydra commands' lines of the README's other bash blocks (those that
    need data or machines a test does not have): [(program, overrides, line)], leaving out lines
    with a placeholder (`...`, `<dir>`)."""
    with open(README) as f:
        blocks = parse_blocks(f.read())
    found = []
    for lang, flags, body, _, _ in blocks:
        if lang != "bash" or "readme-test" in flags:
            continue
        for line in logical_lines(body):
            words = words_of(line.strip())
            prog = program(words)
            if prog == "bert-train" and "bert_pretrain.train" in words:
                words = [prog] + words[words.index("bert_pretrain.train") + 1:]
            if prog in CONFIGS and not any("..." in w or "<" in w for w in words):
                found.append((prog, words[1:], line.strip()))
    return found


def test_the_readmes_other_commands_compose():
    """Every complete bert-prep / bert-train / bert-finetune / bert-glue line elsewhere in the
    README names real groups, options and keys (the same check the commands make before they
    start)."""
    from bert_pretrain.cli_errors import precheck
    from bert_pretrain.config import register
    from bert_pretrain.finetune.config import register as register_finetune

    register()
    register_finetune()
    commands = documented_commands()
    assert len(commands) >= 10
    assert {"bert-finetune", "bert-glue"} <= {prog for prog, _, _ in commands}
    for prog, overrides, line in commands:
        root, name = CONFIGS[prog]
        try:
            precheck(prog, os.path.join(REPO, "conf", root), name, overrides,
                     skip=lambda arg: arg.lstrip("+").startswith("hparams_search="))
        except SystemExit:
            pytest.fail(f"README: {line}")


def heading_slugs(markdown: str) -> set:
    """GitHub's anchors of a markdown text's headings."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)  # a "# comment" is no heading
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", prose, re.M)}


def test_the_readmes_links_lead_somewhere():
    """Section links (#anchor, GitHub's slugs of the headings) and links to repository files."""
    with open(README) as f:
        text = f.read()
    slugs = heading_slugs(text)
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith("#"):
            assert target[1:] in slugs, target
        elif "://" not in target:
            path, _, anchor = target.partition("#")
            assert os.path.exists(os.path.join(REPO, path)), target
            if anchor:  # a section of another markdown file
                with open(os.path.join(REPO, path)) as f:
                    assert anchor in heading_slugs(f.read()), target
