"""Multi-process training on CPU (gloo) through the real launchers, and the accelerate config files.

What a 2-process run must show, compared with 1 process at the same global batch (gradient
accumulation 2): the same loss at every step within 1e-5 and the same token counts (the ranks'
slices are disjoint and together make up the global batch: a duplicated or missing slice changes
both); one writer (metrics logged once per step, one wandb run, one final report); and a
checkpoint written by N processes resumes under M processes continuing the data stream exactly
where it stopped (no repeated or skipped samples: either would change the losses).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from time_limits import hang_limit
from train_support import needs_wandb, write_prepared

REPO = Path(__file__).resolve().parent.parent
ACCELERATE_CONFIGS = REPO / "conf" / "accelerate"
TOL = 1e-5
# The smoke experiment's tiny model; log every step, checkpoint at step 3 and 6.
COMMON = ["experiment=smoke", "trainer.max_steps=6", "trainer.global_batch_size=8",
          "trainer.mixed_precision=no",  # auto is bf16 on some CPUs; TOL is an fp32 tolerance
          "trainer.log_every=1", "trainer.eval_every=3", "trainer.checkpoint_every=3",
          "trainer.keep_last_k=5", "trainer.progress_bar=false"]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # (Linux's default)


def free_port() -> int:
    """A free port for a launcher or process group, below the kernel's ephemeral range.  A port
    from bind(0) is one the kernel may also give any outgoing connection (a gloo mesh's, a store
    client's) in the seconds before the launcher binds it: under xdist a launcher once found its
    rendezvous port taken ('The connection to the C10d store has failed').  Below the range only
    another explicit bind can take it, and each test draws its own at random."""
    import random

    low, draw = _ephemeral_low(), random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (a range that crowded: the kernel's choice)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_SILENT": "true",
           **(env_extra or {})}
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=hang_limit(),
                       env=env)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def train_1proc(*overrides: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "bert_pretrain.train", *COMMON, *overrides])


def train_accelerate(num_processes: int, *overrides: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(ACCELERATE_CONFIGS / "cpu_2proc.yaml"), "--num_processes", str(num_processes),
                "--main_process_port", str(free_port()), "-m", "bert_pretrain.train", *COMMON,
                *overrides], {"OMP_NUM_THREADS": "1"})


def train_torchrun(num_processes: int, *overrides: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                str(num_processes), "--master_port", str(free_port()), "-m", "bert_pretrain.train",
                *COMMON, *overrides], {"OMP_NUM_THREADS": "1"})


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_records(run_dir: Path) -> dict[int, dict]:
    recs = [r for r in records(run_dir) if "loss" in r]
    by_step = {r["step"]: r for r in recs}
    assert len(by_step) == len(recs), "a step was logged twice: more than one process wrote"
    return by_step


def assert_same_trajectory(a: dict[int, dict], b: dict[int, dict], steps) -> None:
    for step in steps:
        for key in ("loss", "mlm_loss", "nsp_loss"):
            assert abs(a[step][key] - b[step][key]) <= TOL, (step, key, a[step][key], b[step][key])
        assert a[step]["lr"] == pytest.approx(b[step]["lr"], rel=1e-12)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    return write_prepared(str(tmp_path_factory.mktemp("prepared") / "data"), num_train=40)


@pytest.fixture(scope="module")
def single(prepared, tmp_path_factory) -> Path:
    """The reference: one process, micro-batch 4, so 2 accumulation steps per global batch of 8.
    40 training instances: the 6 steps x 8 samples cross an epoch boundary at sample 40."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    r = train_1proc(f"data.dir={prepared}", f"run_dir={run_dir}", "trainer.micro_batch_size=4")
    assert "1 process(es), global batch 8 = 1 x 4 x 2 accumulation" in r.stdout
    return run_dir


# --------------------------------------------------------------------------- launched runs


@needs_wandb
def test_accelerate_two_processes_equal_one_process_with_accumulation(prepared, single, tmp_path):
    run_dir = tmp_path / "run"
    r = train_accelerate(2, f"data.dir={prepared}", f"run_dir={run_dir}",
                         "logger=wandb", "logger.mode=offline")
    assert "2 process(es), global batch 8 = 2 x 4 x 1 accumulation" in r.stdout, r.stdout
    one, two = train_records(single), train_records(run_dir)
    assert sorted(two) == list(range(1, 7))
    assert_same_trajectory(one, two, range(1, 7))
    # Token counts are integers summed over ranks: equal only if the two ranks' slices are
    # disjoint and together are the global batch.
    assert [two[s]["tokens_seen"] for s in range(1, 7)] == [one[s]["tokens_seen"]
                                                             for s in range(1, 7)]
    evals_one = [x for x in records(single) if "eval_mlm_loss" in x]
    evals_two = [x for x in records(run_dir) if "eval_mlm_loss" in x]
    assert [e["step"] for e in evals_two] == [3, 6]  # logged once each
    for e1, e2 in zip(evals_one, evals_two):
        assert abs(e1["eval_mlm_loss"] - e2["eval_mlm_loss"]) <= TOL
        assert e1["eval_mlm_accuracy"] == pytest.approx(e2["eval_mlm_accuracy"], abs=1e-9)
    # One writer: one final report, one wandb run; every rank saved its own RNG state.
    assert r.stdout.count("bert-train: finished at step 6") == 1
    runs = [p for p in (run_dir / "wandb").iterdir() if p.name.startswith("offline-run-")]
    assert len(runs) == 1, runs
    ckpt = run_dir / "checkpoints" / "step-00000006"
    assert sorted(p.name for p in ckpt.glob("rng_state_rank*.pt")) == [
        "rng_state_rank0.pt", "rng_state_rank1.pt"]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["samples_consumed"] == 48


@pytest.mark.slow
def test_checkpoint_resumes_under_another_world_size(prepared, single, tmp_path):
    """2 -> 1 (accelerate launch writes, plain process resumes) and 1 -> 2 (torchrun resumes):
    steps 4..6 after the step-3 checkpoint equal the uninterrupted run's steps 4..6."""
    two_dir = tmp_path / "two"
    train_accelerate(2, f"data.dir={prepared}", f"run_dir={two_dir}", "trainer.max_steps=3")
    ckpt = two_dir / "checkpoints" / "step-00000003"
    assert json.loads((ckpt / "trainer_state.json").read_text())["samples_consumed"] == 24

    resumed_1 = tmp_path / "resumed_1"
    r = train_1proc(f"data.dir={prepared}", f"run_dir={resumed_1}", f"resume={ckpt}",
                    "trainer.micro_batch_size=4")
    assert "resumed from" in r.stdout
    assert_same_trajectory(train_records(single), train_records(resumed_1), range(4, 7))
    # a branch into a new run dir starts with the history of the run it came from
    assert sorted(train_records(resumed_1)) == [1, 2, 3, 4, 5, 6]
    assert_same_trajectory(train_records(two_dir), train_records(resumed_1), range(1, 4))

    resumed_2 = tmp_path / "resumed_2"
    # (a changed setting that changes nothing here, warmup_steps being set: its warning, about
    # the whole job, is printed once, not once a process)
    r = train_torchrun(2, f"data.dir={prepared}", f"run_dir={resumed_2}",
                       f"resume={single / 'checkpoints' / 'step-00000003'}",
                       "trainer.warmup_ratio=0.5")
    assert "2 process(es)" in r.stdout and r.stdout.count("resumed from") == 1
    assert (r.stdout + r.stderr).count("with changed settings") == 1, r.stdout + r.stderr
    assert_same_trajectory(train_records(single), train_records(resumed_2), range(4, 7))
    final = json.loads((resumed_2 / "checkpoints" / "step-00000006" / "trainer_state.json")
                       .read_text())
    single_final = json.loads((single / "checkpoints" / "step-00000006" / "trainer_state.json")
                              .read_text())
    assert final["samples_consumed"] == single_final["samples_consumed"] == 48
    assert final["tokens_seen"] == single_final["tokens_seen"]


# --------------------------------------------------------------------------- accelerate configs


def launcher_env(config: str, *flags: str) -> tuple[object, dict]:
    """What `accelerate launch --config_file <config>` would hand to the training processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(ACCELERATE_CONFIGS / config), *flags, "-m", "bert_pretrain.train"])
    args, _, _ = _validate_launch_command(args)
    return args, prepare_multi_gpu_env(args)


def test_accelerate_config_files_mean_what_the_docs_say():
    args, env = launcher_env("cpu_2proc.yaml")
    assert args.multi_gpu and not args.cpu and args.num_processes == 2  # torchrun, 2 processes

    args, env = launcher_env("multi_gpu.yaml")
    assert args.multi_gpu and args.num_processes == 8 and env["ACCELERATE_MIXED_PRECISION"] == "bf16"

    args, env = launcher_env("multi_node.yaml", "--machine_rank", "1", "--main_process_ip",
                             "10.0.0.1")
    assert args.num_machines == 2 and args.num_processes == 16
    assert (args.machine_rank, args.main_process_ip, args.main_process_port) == (1, "10.0.0.1",
                                                                                 29500)
    # What torch.distributed.run receives: 2 nodes x 8 processes, this one node 1.
    assert (str(args.nnodes), int(args.node_rank), str(args.nproc_per_node)) == ("2", 1, "8")

    from bert_pretrain.model import BertConfig, BertForPreTraining

    args, env = launcher_env("fsdp.yaml")
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    # The wrap unit must be the encoder layer's class name: one FSDP unit per layer.
    model = BertForPreTraining(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=3,
                                          num_attention_heads=2, intermediate_size=32))
    units = [m for m in model.modules()
             if type(m).__name__ == env["FSDP_TRANSFORMER_CLS_TO_WRAP"]]
    assert len(units) == 3
    assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"  # what bert-train writes
    # No engine bert-train refuses ships (DeepSpeed: tests/test_launch_checks.py).
    import yaml

    assert not [p.name for p in ACCELERATE_CONFIGS.glob("*.yaml")
                if yaml.safe_load(p.read_text())["distributed_type"] == "DEEPSPEED"]
