"""Sharded training (FSDP2) on CPU over gloo, through the real launchers, and its checkpoints.

What must hold (issue 37): a run launched as a GPU user types it (`accelerate launch
--config_file conf/accelerate/fsdp.yaml`) really shards on CPU (the start-up line names the
shard units, every process writes its own shards), and trains the losses of DDP on the same
config at every step within fp32 rounding (TOL, the tolerance tests/test_distributed.py holds
DDP to against one process; the largest difference measured was 3.3e-7), with and without
accumulation, with clipping by the global norm (a per-shard norm would clip differently and
change the losses from step 2 on), and with bf16 and fp16 autocast within their rounding
(AUTOCAST_TOL).  A sharded checkpoint resumes under another process count or without sharding
(and an unsharded one into a sharded run) continuing the same losses, is written atomically (a
rank killed at any point of a save leaves a checkpoint resume=auto finds), is refused in one
line when damaged or tampered with (never running a planted pickle), and exports to
transformers directly.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_distributed import (ACCELERATE_CONFIGS, COMMON, REPO, TOL, assert_same_trajectory,
                              free_port, records, run, train_1proc, train_records)
from time_limits import hang_limit
from train_support import CHILD_PYTHONPATH_WITH_TESTS, write_prepared

FSDP_LINE = "bert-train: sharding: FSDP2 over {n} process(es): 3 shard units (2 encoder layers"
# 20 held-out samples in batches of 4 over 2 processes: rank 0 gets 3 batches, rank 1 gets 2;
# a sharded evaluation must keep both in the same forward passes or hang.
UNEVEN_EVAL = "trainer.eval_max_samples=20"


def train_fsdp_accelerate(num_processes: int, *overrides: str) -> subprocess.CompletedProcess:
    """The launch line of docs/multi-gpu.md, on CPU."""
    return run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(ACCELERATE_CONFIGS / "fsdp.yaml"), "--num_processes", str(num_processes),
                "--main_process_port", str(free_port()), "-m", "bert_pretrain.train", *COMMON,
                "trainer.cpu=true", *overrides], {"OMP_NUM_THREADS": "1"})


def torchrun_args(num_processes: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
            str(num_processes), "--master_port", str(free_port())]


def train_torchrun(num_processes: int, *overrides: str, sharding: str = "fsdp"):
    return run([*torchrun_args(num_processes), "-m", "bert_pretrain.train", *COMMON,
                f"trainer.sharding={sharding}", *overrides], {"OMP_NUM_THREADS": "1"})


def assert_sharded_checkpoint(path: Path, num_processes: int) -> None:
    """Every process wrote its own shards; no whole model or optimizer file anywhere."""
    shards = sorted(p.name for p in (path / "sharded").iterdir())
    assert shards == [".metadata"] + [f"__{r}_0.distcp" for r in range(num_processes)], shards
    assert not (path / "model.safetensors").exists() and not (path / "optimizer.pt").exists()
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["world_size"] == num_processes
    assert {f"sharded/__{r}_0.distcp" for r in range(num_processes)} <= set(state["files"])


def max_difference(a: dict, b: dict, steps) -> float:
    return max(abs(a[s][k] - b[s][k]) for s in steps for k in ("loss", "mlm_loss", "nsp_loss"))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    return write_prepared(str(tmp_path_factory.mktemp("prepared") / "data"), num_train=40)


@pytest.fixture(scope="module")
def single(prepared, tmp_path_factory) -> Path:
    """One unsharded process, micro-batch 4 (the global batch of 8 in 2 accumulation steps)."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    train_1proc(f"data.dir={prepared}", f"run_dir={run_dir}", "trainer.micro_batch_size=4",
                UNEVEN_EVAL)
    return run_dir


@pytest.fixture(scope="module")
def fsdp_two(prepared, tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    r = train_fsdp_accelerate(2, f"data.dir={prepared}", f"run_dir={run_dir}", UNEVEN_EVAL)
    return run_dir, r.stdout


# --------------------------------------------------------------------------- the default suite


def test_which_runs_shard(monkeypatch):
    """trainer.sharding=auto follows the launcher's accelerate config; ddp under an FSDP
    config is a contradiction said in one line, not a silent choice."""
    from bert_pretrain.components.sharding import resolve_sharding
    from bert_pretrain.components.trainer_config import TrainerConfig
    from bert_pretrain.errors import ConfigError

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert [resolve_sharding(v, 2) for v in ("auto", "ddp", "fsdp")] == [False, False, True]
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert resolve_sharding("auto", 2) and resolve_sharding("fsdp", 2)
    with pytest.raises(ConfigError, match="trainer.sharding=ddp, but accelerate was launched"):
        resolve_sharding("ddp", 2)
    with pytest.raises(ValueError, match="trainer.sharding must be auto, ddp or fsdp"):
        TrainerConfig(sharding="zero3")


def test_the_accelerate_fsdp_launch_line_shards_on_cpu_and_trains_the_same_losses(
        single, fsdp_two):
    run_dir, stdout = fsdp_two
    assert FSDP_LINE.format(n=2) in stdout, stdout
    assert "2 process(es), global batch 8 = 2 x 4 x 1 accumulation" in stdout
    one, two = train_records(single), train_records(run_dir)
    assert sorted(two) == list(range(1, 7))
    assert_same_trajectory(one, two, range(1, 7))
    assert [two[s]["tokens_seen"] for s in range(1, 7)] == [one[s]["tokens_seen"]
                                                             for s in range(1, 7)]
    # trainer.max_grad_norm=1 clips these steps: the norm logged (before clipping) is the
    # global one, and a clip by one shard's norm would have changed the losses after step 1.
    assert all(two[s]["grad_norm"] > 1.0 for s in range(1, 7))
    for s in range(1, 7):
        assert two[s]["grad_norm"] == pytest.approx(one[s]["grad_norm"], rel=1e-5)
    evals = [x for x in records(run_dir) if "eval_mlm_loss" in x]
    assert [e["step"] for e in evals] == [3, 6]  # every process took part, one wrote
    for e1, e2 in zip([x for x in records(single) if "eval_mlm_loss" in x], evals):
        assert abs(e1["eval_mlm_loss"] - e2["eval_mlm_loss"]) <= TOL
    assert_sharded_checkpoint(run_dir / "checkpoints" / "step-00000006", 2)


def test_a_sharded_checkpoint_exports_the_model_the_unsharded_run_exports(single, fsdp_two,
                                                                        tmp_path):
    """bert-export reads the shards directly; transformers loads the export, and its logits are
    the unsharded run's within 1e-5."""
    import torch
    import transformers

    exports = []
    for run_dir, name in ((single, "whole"), (fsdp_two[0], "sharded")):
        out = tmp_path / name
        r = subprocess.run([sys.executable, "-m", "bert_pretrain.tools.export",
                            str(run_dir / "checkpoints" / "step-00000006"), str(out)],
                           cwd=REPO, capture_output=True, text=True, timeout=hang_limit())
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stderr.strip() == "", r.stderr  # no warning from reading the shards
        exports.append(transformers.BertForPreTraining.from_pretrained(out).eval())
    ids = torch.randint(5, 64, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = (m(input_ids=ids) for m in exports)
    assert (a.prediction_logits - b.prediction_logits).abs().max() <= 1e-5
    assert (a.seq_relationship_logits - b.seq_relationship_logits).abs().max() <= 1e-5
    # bert-report's parameter count, from the shard index (no tensor read)
    from bert_pretrain.tools.report import count_parameters

    counts = [count_parameters(str(d / "checkpoints" / "step-00000006"))
              for d in (single, fsdp_two[0])]
    assert counts[0] is not None and counts[0] == counts[1]


def copy_checkpoint(fsdp_two, tmp_path) -> Path:
    """A copy of the sharded run's step-6 checkpoint (its own run directory) to damage."""
    target = tmp_path / "run" / "checkpoints" / "step-00000006"
    shutil.copytree(fsdp_two[0] / "checkpoints" / "step-00000006", target)
    return target


def test_a_damaged_shard_is_refused_in_one_line(fsdp_two, tmp_path):
    from bert_pretrain.components import checkpoint as ckpt
    from bert_pretrain.errors import CheckpointError

    path = copy_checkpoint(fsdp_two, tmp_path)
    shard = path / "sharded" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        ckpt.verify_checkpoint(str(path))
    assert "\n" not in str(err.value) and "__1_0.distcp does not match its sha256" in str(err.value)


def test_a_planted_pickle_in_the_shard_metadata_is_refused(fsdp_two, tmp_path):
    """DCP's own reader unpickles .metadata with pickle.load: the payload would run there (shown
    first); bert-train's reader refuses it, for training, export and fine-tuning alike."""
    from torch.distributed.checkpoint import FileSystemReader

    from bert_pretrain.components import checkpoint as ckpt
    from bert_pretrain.errors import CheckpointError
    from bert_pretrain.model import BertConfig, BertForPreTraining
    from test_untrusted import Payload, resign

    path = copy_checkpoint(fsdp_two, tmp_path)
    metadata = path / "sharded" / ".metadata"
    marker = tmp_path / "pwned"
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    resign(str(path))
    ckpt.verify_checkpoint(str(path))  # re-signed: only the reader stands in the way
    with pytest.raises(CheckpointError) as err:
        ckpt.load_weights(str(path), BertForPreTraining(BertConfig.from_dict(
            json.loads((path / "trainer_state.json").read_text())["model_config"])))
    message = str(err.value)
    assert "\n" not in message and message.startswith("refusing to load") and \
        ".metadata" in message
    assert not marker.exists()
    FileSystemReader(str(path / "sharded")).read_metadata()  # the payload is real
    assert marker.exists()


def test_a_planted_pickle_among_the_shards_is_refused(fsdp_two, tmp_path):
    """The optimizer's hyperparameters are stored as pickled bytes, which DCP's planner reads
    with torch.load(weights_only=False); a payload pointed to from .metadata (re-signed, as a
    tamperer would) is refused by bert-train's planner, never run."""
    import torch

    from bert_pretrain.components import sharded_checkpoint as shards
    from bert_pretrain.components.optim import OptimConfig, build_optimizer
    from bert_pretrain.errors import CheckpointError
    from bert_pretrain.model import BertConfig, BertForPreTraining
    from test_untrusted import Payload, resign

    path = copy_checkpoint(fsdp_two, tmp_path)
    folder = path / "sharded"
    marker = tmp_path / "pwned"
    evil = folder / "__0_0.distcp"
    torch_payload = io.BytesIO()  # as DCP stores a non-tensor entry: torch.save's bytes
    torch.save([Payload(marker)], torch_payload)
    offset = evil.stat().st_size
    with open(evil, "ab") as f:
        f.write(torch_payload.getvalue())
    meta = pickle.loads((folder / ".metadata").read_bytes())  # (the test's own file)
    planted = [k for k in meta.storage_data if k.fqn.startswith("optim.param_groups")]
    assert planted
    for key in planted:
        info = meta.storage_data[key]
        meta.storage_data[key] = type(info)(relative_path="__0_0.distcp", offset=offset,
                                            length=len(torch_payload.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    resign(str(path))
    model = BertForPreTraining(BertConfig.from_dict(
        json.loads((path / "trainer_state.json").read_text())["model_config"]))
    optimizer = build_optimizer(OptimConfig(), model.named_parameters())
    with pytest.raises(CheckpointError) as err:
        shards.load_training_shards(str(folder), model, optimizer)
    assert "\n" not in str(err.value) and str(err.value).startswith("refusing to load")
    assert not marker.exists()


def test_shard_metadata_that_points_out_of_the_checkpoint_is_refused(fsdp_two, tmp_path):
    """.metadata names the file and byte range of every chunk: a path out of sharded/ (a key
    file read as weights) is refused before anything is read."""
    from bert_pretrain.components import checkpoint as ckpt
    from bert_pretrain.errors import CheckpointError
    from bert_pretrain.model import BertConfig, BertForPreTraining
    from test_untrusted import resign

    path = copy_checkpoint(fsdp_two, tmp_path)
    folder = path / "sharded"
    meta = pickle.loads((folder / ".metadata").read_bytes())  # (the test's own file)
    key = next(iter(meta.storage_data))
    meta.storage_data[key] = type(meta.storage_data[key])(
        relative_path="../../../../secret", offset=0, length=8)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    resign(str(path))
    with pytest.raises(CheckpointError, match="points outside its shard files") as err:
        ckpt.load_weights(str(path), BertForPreTraining(BertConfig.from_dict(
            json.loads((path / "trainer_state.json").read_text())["model_config"])))
    assert "\n" not in str(err.value)


def test_bert_train_refuses_a_planted_shard_metadata_on_resume(prepared, fsdp_two, tmp_path):
    """Through the real command: one line, exit status 2, the payload never ran."""
    from test_untrusted import Payload, resign
    from train_support import run_bert_train

    path = copy_checkpoint(fsdp_two, tmp_path)
    marker = tmp_path / "pwned"
    (path / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    resign(str(path))
    r = run_bert_train([*COMMON, f"data.dir={prepared}", f"run_dir={tmp_path / 'run'}",
                        "resume=auto", "trainer.sharding=fsdp",
                        "hydra.run.dir=" + str(tmp_path / "hydra")], cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bert-train: error: refusing to load"), lines
    assert "Traceback" not in r.stderr + r.stdout and not marker.exists()


# --------------------------------------------------------------------------- FSDP = DDP, slow


# Autocast: the reduce-scatter sums a gradient in another order than DDP's all-reduce, and a
# last-bit fp32 difference in a weight can flip its bf16 rounding in the next forward (bf16
# keeps 8 bits: a relative step of 4e-3). Measured over 20 steps: bf16 2.1e-4, fp16 3.6e-5
# (fp32: 3.3e-7).
AUTOCAST_TOL = 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("num_processes,micro,precision,optim", [
    (2, 2, "no", "adamw"),     # 2 accumulation steps
    (2, 4, "no", "adamw"),     # none
    (4, 2, "no", "adamw"),
    (2, 4, "no", "lamb"),      # its trust ratio: norms of whole tensors, over their shards
    (2, 4, "bf16", "adamw"),
    (2, 4, "fp16", "adamw"),   # loss scaling: a step skipped for inf on one shard is skipped by all
])
def test_fsdp_trains_ddps_losses_for_20_steps(prepared, tmp_path, num_processes, micro,
                                              precision, optim):
    common = [f"data.dir={prepared}", "trainer.max_steps=20", "trainer.checkpoint_every=10",
              "trainer.eval_every=10", f"trainer.micro_batch_size={micro}",
              f"trainer.mixed_precision={precision}", f"optim={optim}"]
    runs = {}
    for sharding in ("ddp", "fsdp"):
        runs[sharding] = tmp_path / sharding
        r = train_torchrun(num_processes, *common, f"run_dir={runs[sharding]}",
                           sharding=sharding)
        assert (FSDP_LINE.format(n=num_processes) in r.stdout) == (sharding == "fsdp")
    ddp, fsdp = train_records(runs["ddp"]), train_records(runs["fsdp"])
    assert sorted(fsdp) == list(range(1, 21))
    print(f"max |FSDP - DDP| loss over 20 steps ({num_processes} processes, micro {micro}, "
          f"{precision}, {optim}): {max_difference(ddp, fsdp, range(1, 21)):.3g}")
    if precision == "no":
        assert_same_trajectory(ddp, fsdp, range(1, 21))
    else:
        assert max_difference(ddp, fsdp, range(1, 21)) <= AUTOCAST_TOL
        assert [fsdp[s]["lr"] for s in fsdp] == [ddp[s]["lr"] for s in ddp]
    assert [fsdp[s]["tokens_seen"] for s in fsdp] == [ddp[s]["tokens_seen"] for s in ddp]
    assert_sharded_checkpoint(runs["fsdp"] / "checkpoints" / "step-00000020", num_processes)


@pytest.mark.slow
@pytest.mark.parametrize("switches", [
    # each encoder layer is a shard unit: checkpointing recomputes it in backward, so its
    # weights are gathered a second time there
    ["impl.gradient_checkpointing=true"],
    ["impl.varlen_attention=nested", "impl.gradient_checkpointing=true", "impl.fused_qkv=true"],
    # inductor compiles the dense blocks inside a sharded layer, on gathered weights
    ["impl.compile=true", "impl.gradient_checkpointing=true"],
    ["model.position_embedding_type=relative_key_query", "model.pre_layer_norm=true"],
    ["impl.unpad=false"],
], ids=["checkpointing", "nested_checkpointing_fused", "compile_checkpointing",
        "relative_pre_ln", "padded"])
def test_fsdp_trains_ddps_losses_with_the_layer_switches(prepared, tmp_path, monkeypatch,
                                                          switches):
    """The switches that change what a layer runs, sharded: the losses of DDP on the same
    switches at every step (2 processes, 2 accumulation steps, 8 steps)."""
    from test_distributed_variants import compiled_by

    compiling = "impl.compile=true" in switches
    if compiling:
        monkeypatch.setenv("TORCH_LOGS", "output_code")
    common = [f"data.dir={prepared}", "trainer.max_steps=8", "trainer.checkpoint_every=4",
              "trainer.eval_every=4", "trainer.micro_batch_size=2", *switches]
    runs = {}
    for sharding in ("ddp", "fsdp"):
        runs[sharding] = tmp_path / sharding
        r = train_torchrun(2, *common, f"run_dir={runs[sharding]}", sharding=sharding)
        assert (FSDP_LINE.format(n=2) in r.stdout) == (sharding == "fsdp")
        if compiling:  # both processes compiled: not a quiet fall-back to eager
            assert len(compiled_by(r.stderr)) == 2, r.stderr[-2000:]
    ddp, fsdp = train_records(runs["ddp"]), train_records(runs["fsdp"])
    assert sorted(fsdp) == list(range(1, 9))
    print(f"max |FSDP - DDP| loss over 8 steps ({' '.join(switches)}): "
          f"{max_difference(ddp, fsdp, range(1, 9)):.3g}")
    assert_same_trajectory(ddp, fsdp, range(1, 9))
    assert_sharded_checkpoint(runs["fsdp"] / "checkpoints" / "step-00000008", 2)


# --------------------------------------------------------------------------- resume, slow


@pytest.mark.slow
def test_init_from_a_sharded_checkpoint_sharded_or_not(prepared, fsdp_two, tmp_path):
    """trainer.init_from (phase 2) takes the weights of a sharded checkpoint into a sharded run
    and into an unsharded one alike: the same losses from the first step on."""
    source = fsdp_two[0] / "checkpoints" / "step-00000006"
    common = [f"data.dir={prepared}", f"trainer.init_from={source}", "trainer.max_steps=3",
              "trainer.micro_batch_size=4"]
    train_torchrun(2, *common, f"run_dir={tmp_path / 'sharded'}")
    train_1proc(*common, f"run_dir={tmp_path / 'whole'}")
    fresh = train_records(fsdp_two[0])
    sharded, whole = train_records(tmp_path / "sharded"), train_records(tmp_path / "whole")
    assert_same_trajectory(whole, sharded, range(1, 4))
    assert abs(sharded[1]["loss"] - fresh[1]["loss"]) > 0.01  # the weights were taken


@pytest.mark.slow
def test_checkpoints_resume_across_shapes(prepared, tmp_path):
    """FSDP 2 -> 1 (unsharded) -> FSDP 2 (1 -> 2), FSDP 2 -> FSDP 4 -> 1, FSDP 2 -> DDP 2 ->
    FSDP 2:
    every continuation trains the uninterrupted run's losses (micro-batch 2 everywhere: the
    dropout masks are drawn per micro-batch)."""
    common = [f"data.dir={prepared}", "trainer.micro_batch_size=2"]
    ref = tmp_path / "ref"
    train_torchrun(2, *common, f"run_dir={ref}")
    reference = train_records(ref)
    step3 = ref / "checkpoints" / "step-00000003"
    assert_sharded_checkpoint(step3, 2)

    one = tmp_path / "one"  # 2 -> 1, saving every step
    r = train_1proc(*common, f"run_dir={one}", f"resume={step3}", "trainer.checkpoint_every=1")
    assert "resumed from" in r.stdout and "sharding" not in r.stdout
    assert_same_trajectory(reference, train_records(one), range(4, 7))
    assert (one / "checkpoints" / "step-00000004" / "model.safetensors").exists()

    back = tmp_path / "back"  # 1 -> 2: an unsharded checkpoint into a sharded run
    train_torchrun(2, *common, f"run_dir={back}",
                   f"resume={one / 'checkpoints' / 'step-00000004'}")
    assert_same_trajectory(reference, train_records(back), range(5, 7))

    four = tmp_path / "four"  # 2 -> 4 -> 1
    r = train_torchrun(4, *common, f"run_dir={four}", f"resume={step3}",
                       "trainer.checkpoint_every=1")
    assert FSDP_LINE.format(n=4) in r.stdout
    assert_same_trajectory(reference, train_records(four), range(4, 7))
    assert_sharded_checkpoint(four / "checkpoints" / "step-00000005", 4)
    last = tmp_path / "last"
    train_1proc(*common, f"run_dir={last}", f"resume={four / 'checkpoints' / 'step-00000005'}")
    assert_same_trajectory(reference, train_records(last), [6])

    ddp = tmp_path / "ddp"  # FSDP -> DDP (its step 5) -> FSDP
    train_torchrun(2, *common, f"run_dir={ddp}", f"resume={step3}", "trainer.checkpoint_every=1",
                   sharding="ddp")
    assert_same_trajectory(reference, train_records(ddp), range(4, 7))
    again = tmp_path / "again"
    train_torchrun(2, *common, f"run_dir={again}",
                   f"resume={ddp / 'checkpoints' / 'step-00000005'}")
    assert_same_trajectory(reference, train_records(again), [6])
    final = json.loads((again / "checkpoints" / "step-00000006" / "trainer_state.json")
                       .read_text())
    assert final["samples_consumed"] == 48
    assert final["tokens_seen"] == reference[6]["tokens_seen"]


# --------------------------------------------------------------------------- kills, slow


@pytest.mark.slow
@pytest.mark.parametrize("point,rank,found", [
    ("shard-write", 1, 3), ("metadata", 0, 3), ("shard-done", 0, 3), ("shard-done", 1, 3),
    ("gather", 1, 3),
    ("rename", 0, 3), ("pointer", 0, 6)])
def test_a_rank_killed_during_a_sharded_save_leaves_a_checkpoint_resume_finds(
        prepared, single, tmp_path, point, rank, found):
    """A rank SIGKILLed during the save of step 6 (step 3 saved before): resume=auto continues
    from step 3, or from step 6 once it was renamed into place (then it is complete), and
    trains the losses of the run that was never killed."""
    run_dir = tmp_path / "run"
    env = {"OMP_NUM_THREADS": "1", "KILL_POINT": f"{point}:{rank}:6",
           "KILL_RUN_DIR": str(run_dir), "PYTHONPATH": CHILD_PYTHONPATH_WITH_TESTS}
    r = subprocess.run([*torchrun_args(2), str(REPO / "tests" / "kill_during_save.py"), *COMMON,
                        f"data.dir={prepared}", f"run_dir={run_dir}", "trainer.sharding=fsdp",
                        "trainer.report=false"],
                       cwd=REPO, capture_output=True, text=True, timeout=hang_limit(),
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env})
    assert r.returncode != 0, "the kill did not happen"
    assert "step 3: held-out" in r.stdout and "finished at step 6" not in r.stdout
    resumed = train_1proc(f"data.dir={prepared}", f"run_dir={run_dir}", "resume=auto",
                          "trainer.micro_batch_size=4")
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{found:08d}'}" in resumed.stdout
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    if found == 3:
        assert_same_trajectory(train_records(single), train_records(run_dir), range(4, 7))


@pytest.mark.slow
def test_a_full_disk_on_one_rank_fails_the_sharded_save_on_every_rank(prepared, single,
                                                                      tmp_path):
    """Rank 1 cannot write its shards (ENOSPC): every process stops with the same error (one
    line on the screen), the temporary folder is gone, and
    resume=auto continues from step 3 with the uninterrupted run's losses."""
    run_dir = tmp_path / "run"
    env = {"OMP_NUM_THREADS": "1", "KILL_POINT": "enospc:1:6", "KILL_RUN_DIR": str(run_dir),
           "PYTHONPATH": CHILD_PYTHONPATH_WITH_TESTS}
    r = subprocess.run([*torchrun_args(2), str(REPO / "tests" / "kill_during_save.py"), *COMMON,
                        f"data.dir={prepared}", f"run_dir={run_dir}", "trainer.sharding=fsdp",
                        "trainer.report=false"],
                       cwd=REPO, capture_output=True, text=True, timeout=hang_limit(),
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env})
    assert r.returncode != 0
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("bert-train: error:")]
    assert len(errors) == 1 and "could not save checkpoint step 6" in errors[0], r.stderr[-3000:]
    # Both ranks raised it (each rank's error file, in torchrun's report), not only rank 0
    # while rank 1 trained on (torchrun then ends rank 1 before it exits by itself).
    assert r.stderr.count("traceback : bert-train: error: could not save checkpoint step 6") \
        == 2, r.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest.json", "step-00000003"]
    train_1proc(f"data.dir={prepared}", f"run_dir={run_dir}", "resume=auto",
                "trainer.micro_batch_size=4")
    assert_same_trajectory(train_records(single), train_records(run_dir), range(4, 7))


# --------------------------------------------------------------------------- fine-tuning, slow


@pytest.mark.slow
def test_bert_finetune_reads_a_sharded_checkpoint(single, fsdp_two, tmp_path, one_thread):
    """bert-finetune takes the sharded checkpoint as it takes an unsharded one, and fine-tunes
    the same model from it (the pretrained weights are equal within fp32 rounding)."""
    from finetune_support import FAST, finetune_in_process, sentence_task

    task = sentence_task(str(tmp_path / "task"), n_train=64, n_dev=32)
    scores = []
    for run_dir, name in ((single, "whole"), (fsdp_two[0], "sharded")):
        checkpoint = run_dir / "checkpoints" / "step-00000006"
        summary = finetune_in_process([*task, f"model={checkpoint}", *FAST,
                                       f"out_dir={tmp_path / name}"])
        assert summary["checkpoint"] == str(checkpoint)
        scores.append(summary["metrics"]["accuracy"])
    assert scores[0] == pytest.approx(scores[1], abs=1 / 32)
