"""What `bert-launch` answers in one line instead of starting, or instead of waiting forever:
a training script or module that is not there (each process used to fail with Python's own
line: a forgotten `-m bert_pretrain.train`) or the training module's file given as a script, a
DeepSpeed config (no such engine ships, bert-train refuses it), a GPU launch on a machine
without a GPU (it used to start 8 CPU processes on 2 cores), and a machine that never comes to
the rendezvous (finite timeout, then the address and what to check)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_distributed import free_port
from time_limits import hang_limit
from train_support import REPO

CONFIGS = os.path.join(REPO, "conf", "accelerate")
DEEPSPEED = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 2
num_processes: 2
num_machines: 1
machine_rank: 0
mixed_precision: 'no'
use_cpu: false
"""


def bert_launch_in_process(monkeypatch, capsys, *argv, cuda: bool = False):
    """Run bert-launch's main here (a refusal exits before any process starts); (status, lines
    on stderr).  A launch it does not refuse would start: the test fails instead."""
    import torch

    from bert_pretrain.tools import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr("accelerate.commands.launch.launch_command",
                        lambda args: pytest.fail("bert-launch started the launch"))
    with pytest.raises(SystemExit) as exc:
        launch.main(list(argv))
    return exc.value.code, capsys.readouterr().err.strip().splitlines()


def test_a_deepspeed_config_is_refused_in_one_line_pointing_to_fsdp(monkeypatch, capsys,
                                                                    tmp_path):
    config = tmp_path / "zero2.yaml"
    config.write_text(DEEPSPEED)
    code, lines = bert_launch_in_process(monkeypatch, capsys, "--config_file", str(config),
                                         "-m", "bert_pretrain.train", "experiment=smoke",
                                         cuda=True)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"bert-launch: error: {config} sets up DeepSpeed")
    assert "conf/accelerate/fsdp.yaml" in lines[0]


def test_bert_train_refuses_deepspeed_under_plain_accelerate_launch(monkeypatch):
    from bert_pretrain.components.run_setup import make_accelerator
    from bert_pretrain.components.trainer_config import TrainerConfig
    from bert_pretrain.errors import ConfigError

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="DeepSpeed, which bert-train does not support; "
                                          "for sharded training use FSDP"):
        make_accelerator(TrainerConfig(cpu=True))


@pytest.mark.parametrize("command", ["bert-train", "bert-finetune"])
def test_a_later_run_in_the_same_process_takes_its_own_device(command):
    """accelerate caches the process's device (PartialState): on an H100, a trainer.cpu=true
    resume run in the same process as a GPU run trained on the GPU (tests/test_cuda.py). A
    device left over from an earlier run (here the meta device stands for the GPU, which this
    machine may not have) must not reach the next run's accelerator."""
    import torch
    from accelerate.state import PartialState

    from bert_pretrain.components.run_setup import make_accelerator
    from bert_pretrain.components.trainer_config import TrainerConfig
    from bert_pretrain.finetune.config import FinetuneTrainerConfig
    from bert_pretrain.finetune.runner import Session

    PartialState(cpu=True).device = torch.device("meta")  # what the earlier run left behind
    assert PartialState().device.type == "meta"
    if command == "bert-train":
        acc, _ = make_accelerator(TrainerConfig(cpu=True))
    else:
        acc = Session.start(FinetuneTrainerConfig(cpu=True)).accelerator
    assert acc.device.type == "cpu"


@pytest.mark.parametrize("argv, processes", [
    (["--config_file", os.path.join(CONFIGS, "multi_gpu.yaml")], 8),
    (["--multi_gpu", "--num_processes", "3"], 3),
    (["--config_file", os.path.join(CONFIGS, "multi_node.yaml"), "--machine_rank", "1"], 8),
], ids=["multi_gpu.yaml", "--multi_gpu", "multi_node.yaml"])
def test_gpu_processes_without_a_gpu_are_one_line(monkeypatch, capsys, argv, processes):
    code, lines = bert_launch_in_process(monkeypatch, capsys, *argv, "-m", "bert_pretrain.train",
                                         "experiment=smoke")
    assert code == 2 and len(lines) == 1, lines
    assert f"asks for {processes} GPU process(es) on this machine, but torch sees no GPU" \
        in lines[0]
    assert "for CPU processes on purpose add trainer.cpu=true" in lines[0]


def test_cpu_processes_on_purpose_and_gpu_launches_with_a_gpu_start(monkeypatch, capsys):
    """trainer.cpu=true (or a GPU present) lets the launch start: bert-launch hands it on."""
    import torch

    from bert_pretrain.tools import launch

    started = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", started.append)
    for cuda, config, extra in ((False, "multi_gpu.yaml", ["trainer.cpu=true"]),
                                (True, "multi_gpu.yaml", []),
                                # names no GPUs: CPU processes are what it is for
                                (False, "cpu_2proc.yaml", [])):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        launch.main(["--config_file", os.path.join(CONFIGS, config), "-m",
                     "bert_pretrain.train", "experiment=smoke", *extra])
    assert len(started) == 3 and capsys.readouterr().err == ""


TRAIN_PY = os.path.join(REPO, "bert_pretrain", "train.py")


def test_the_training_module_run_as_a_file_is_one_line():
    """`python bert_pretrain/train.py` (or torchrun with the file): its relative imports used
    to end in an ImportError traceback."""
    r = subprocess.run([sys.executable, TRAIN_PY, "experiment=smoke"], cwd=REPO,
                       capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "bert-train: error: bert_pretrain/train.py is a module of the package, not a script: "
        "run bert-train ..., python -m bert_pretrain.train ..., or a launcher's -m "
        "bert_pretrain.train ..."]


@pytest.mark.parametrize("argv, what", [
    (["experiment=smoke", "data.dir=x"], "there is no training script 'experiment=smoke'"),
    (["-m", "bert_pretrain.tran", "experiment=smoke"],
     "there is no module bert_pretrain.tran (-m bert_pretrain.tran)"),
    (["-m", "nosuch.train"], "there is no module nosuch.train (-m nosuch.train)"),
    (["train_bert.py", "experiment=smoke"], "there is no training script 'train_bert.py'"),
    ([TRAIN_PY, "experiment=smoke"],
     f"{TRAIN_PY} is a module of the bert_pretrain package, not a script"),
], ids=["no -m", "a typo", "no package", "no file", "the module's file"])
def test_a_script_or_module_that_is_not_there_is_one_line(monkeypatch, capsys, tmp_path, argv,
                                                          what):
    monkeypatch.chdir(tmp_path)
    code, lines = bert_launch_in_process(
        monkeypatch, capsys, "--config_file", os.path.join(CONFIGS, "cpu_2proc.yaml"), *argv)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (f"bert-launch: error: {what}; the command is bert-launch [launch "
                        f"options] -m bert_pretrain.train [bert-train settings], e.g. "
                        f"bert-launch --config_file conf/accelerate/cpu_2proc.yaml -m "
                        f"bert_pretrain.train experiment=smoke")


def test_a_script_or_module_of_ones_own_starts(monkeypatch, capsys, tmp_path):
    """A file, or a module in the working directory (where `python -m` looks first), is
    handed on as it is."""
    from bert_pretrain.tools import launch

    started = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", started.append)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_train.py").write_text("")
    path_before = list(sys.path)
    for argv in (["my_train.py"], ["-m", "my_train"], ["-m", "bert_pretrain.train"]):
        launch.main(["--config_file", os.path.join(CONFIGS, "cpu_2proc.yaml"), *argv,
                     "experiment=smoke"])
    assert len(started) == 3 and capsys.readouterr().err == ""
    assert sys.path == path_before


def launch_one_node(*flags: str, node_rank: int, timeout_flag: str) -> tuple:
    """One machine of two, the other never started; the rendezvous waits 3 s."""
    port = free_port()
    return subprocess.run(
        [sys.executable, "-m", "bert_pretrain.tools.launch", "--config_file",
         os.path.join(CONFIGS, "multi_node.yaml"), "--num_processes", "2", "--machine_rank",
         str(node_rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
         *flags, "--rdzv_conf", f"{timeout_flag}=3", "-m", "bert_pretrain.train",
         "experiment=smoke", "trainer.cpu=true"],
        cwd=REPO, capture_output=True, text=True, timeout=hang_limit(),
        env={**os.environ, "OMP_NUM_THREADS": "1"}), port


@pytest.mark.parametrize("flags, node_rank, timeout_flag", [
    pytest.param((), 0, "timeout", id="static-main"),  # the main machine waits for the other
    pytest.param((), 1, "timeout", id="static-other",  # the main machine never comes
                 marks=pytest.mark.slow),  # (~7 s each; the default suite keeps one case)
    pytest.param(("--rdzv_backend", "c10d"), 0, "join_timeout", id="c10d",
                 marks=pytest.mark.slow),
])
def test_a_machine_that_never_comes_is_one_line_after_the_timeout(flags, node_rank, timeout_flag):
    r, port = launch_one_node(*flags, node_rank=node_rank, timeout_flag=timeout_flag)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stdout + r.stderr
    assert lines[0].startswith(f"bert-launch: error: the machines did not meet at "
                               f"127.0.0.1:{port} (")
    assert f"--rdzv_conf {timeout_flag}=SECONDS" in lines[0]
