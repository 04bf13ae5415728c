"""Each command's --help shows its own config groups only (bert-train: conf/train/, bert-prep:
conf/prep/), and a misspelt key or group option ends in one `error:` line with a 'did you mean'.

The error cases run the real entry points' `main()` in-process (the check happens before Hydra
starts, so nothing trains); --help runs the console scripts."""

import os
import re
import subprocess
import sys

import pytest

from time_limits import hang_limit
from train_support import CHILD_PYTHONPATH, REPO

BIN = os.path.dirname(sys.executable)
TRAIN_GROUPS = {"data", "experiment", "hparams_search", "impl", "logger", "model", "optim",
                "scheduler", "trainer"}
PREP_GROUPS = {"corpus"}


def groups_in_help(command):
    env = dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH)
    r = subprocess.run([os.path.join(BIN, command), "--help"], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=hang_limit())
    assert r.returncode == 0, r.stderr[-2000:]
    block = r.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    return r.stdout, {m.group(1) for m in re.finditer(r"^(\w+): ", block, re.M)}


@pytest.mark.parametrize("command,groups,usage", [
    ("bert-train", TRAIN_GROUPS, "Usage: bert-train"),
    ("bert-prep", PREP_GROUPS, "Usage: bert-prep"),
])
def test_help_lists_only_the_commands_own_groups(command, groups, usage):
    text, listed = groups_in_help(command)
    assert listed == groups
    assert "accelerate" not in listed
    assert text.startswith(command + ": ") and usage in text


def error_line(entry, args, monkeypatch, capsys):
    """Run `entry.main()` with `args` as the command line: the one stderr line it exits 2 with."""
    monkeypatch.setattr(sys, "argv", [entry.__name__] + args)
    with pytest.raises(SystemExit) as exit_info:
        entry.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("args,hint", [
    (["model.hiden_size=64"], "did you mean model.hidden_size?"),
    (["model=bert_tiny", "model.num_hiden_layers=2"], "did you mean model.num_hidden_layers?"),
    (["trainer.max_step=3"], "did you mean trainer.max_steps?"),
    (["optim.weight_decy=0.1"], "did you mean optim.weight_decay?"),
    (["impl.unpadd=false"], "did you mean impl.unpad?"),
    (["nmae=x"], "did you mean name?"),
    (["model=bert_mnii"], "did you mean model=bert_mini?"),
    (["optim=adamx"], "did you mean optim=adamw?"),
    (["experiment=dmeo"], "did you mean experiment=demo?"),
    (["trainer_max_steps=3"], "did you mean trainer.max_steps?"),  # '.' written as '_'
    (["corpus=text"], "'corpus' is a bert-prep setting (conf/prep/), not a bert-train one"),
    (["accelerate=cpu_2proc"],
     "run `accelerate launch --config_file conf/accelerate/cpu_2proc.yaml -m bert_pretrain.train"),
    (["+accelerate=cpu_2proc"], "accelerate launch --config_file conf/accelerate/cpu_2proc.yaml"),
])
def test_bert_train_mistakes_get_one_line_and_a_hint(args, hint, monkeypatch, capsys):
    from bert_pretrain import train

    err = error_line(train, args, monkeypatch, capsys)
    assert err.startswith("bert-train: error: ") and hint in err, err


@pytest.mark.parametrize("args,hint", [
    (["max_seq_lenght=64"], "did you mean max_seq_length?"),
    (["corpus=text", "corpus.pahts=[a.txt]"], "did you mean corpus.paths?"),
    (["corpus.include_topic=false"], "did you mean corpus.include_topics?"),
    # paths is not a key of the default corpus (builtin): name the option that has it
    (["corpus.paths=[a.txt]"], "did you mean corpus=documents corpus.paths?"),
    (["tokenizer.vocab_sise=8000"], "did you mean tokenizer.vocab_size?"),
    (["corpus=txt"], "did you mean corpus=text?"),
    (["model=bert_base"], "'model' is a bert-train setting (conf/train/), not a bert-prep one"),
    (["accelerate=cpu_2proc"], "bert-prep spreads its work with num_proc=N"),
])
def test_bert_prep_mistakes_get_one_line_and_a_hint(args, hint, monkeypatch, capsys):
    from data_prep import build

    err = error_line(build, args, monkeypatch, capsys)
    assert err.startswith("bert-prep: error: ") and hint in err, err


def test_another_commands_setting_still_gets_this_commands_nearest_key(monkeypatch, capsys):
    """data_dir is bert-finetune's; bert-train's own is data.dir: the line names both."""
    from bert_pretrain import train

    err = error_line(train, ["data_dir=prepared/x"], monkeypatch, capsys)
    assert "'data_dir' is a bert-finetune setting (conf/finetune/), not a bert-train one; " \
           "did you mean data.dir?" in err, err


def test_no_suggestion_when_nothing_is_close(monkeypatch, capsys):
    from bert_pretrain import train

    err = error_line(train, ["model.zzzzzz=1"], monkeypatch, capsys)
    assert "did you mean" not in err and "model.zzzzzz" in err


def test_bert_launch_help_documents_bert_launch(capsys):
    """bert-launch --help says what bert-launch is and how to use it, with examples, instead of
    accelerate launch's 577 lines; a --help after the training module is bert-train's."""
    from bert_pretrain.tools import launch

    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("bert-launch: ") and "Usage: bert-launch " in text
    assert "accelerate launch --help" in text  # where the other options are
    assert len(text.splitlines()) < 60 and "Hardware Selection Arguments" not in text
    examples = text.split("Examples:")[1].split("\n\n")[0].replace("\\\n", " ")
    commands = [" ".join(c.split()) for c in examples.strip().split("\n  bert-launch ")]
    assert len(commands) == 3 and all("-m bert_pretrain.train" in c for c in commands)
    for name in re.findall(r"conf/accelerate/(\w+\.yaml)", text):
        assert os.path.isfile(os.path.join(REPO, "conf", "accelerate", name)), name
    # the examples parse as accelerate launch arguments (the shell variables set)
    for command in commands:
        command = command.replace("$NODE_RANK", "1").replace("$MASTER_ADDR", "10.0.0.1")
        args = launch._parser().parse_args(command.removeprefix("bert-launch ").split())
        assert args.module and args.training_script == "bert_pretrain.train"
    args = launch._parser().parse_args(["-m", "bert_pretrain.train", "--help"])
    assert args.training_script_args == ["--help"]


def console_scripts():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return sorted(tomllib.load(f)["project"]["scripts"])


@pytest.mark.parametrize("command", console_scripts())
def test_help_fits_a_100_column_terminal(command):
    """What we wrote in each command's --help wraps at 100 columns (a 133-character line in
    bert-launch's, once).  Hydra's own list of a group's options is one line it builds; left."""
    env = dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH)
    r = subprocess.run([os.path.join(BIN, command), "--help"], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=hang_limit())
    assert r.returncode == 0, r.stderr[-2000:]
    text = r.stdout
    if "== Configuration groups ==" in text:  # (a Hydra command: its generated groups block)
        head, rest = text.split("== Configuration groups ==")
        text = head + rest.split("== Config ==", 1)[-1]
    long = [line for line in text.splitlines() if len(line) > 100]
    assert not long, long
