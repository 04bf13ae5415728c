"""The GPU path (marked `cuda`: run with `make test-cuda`, i.e. pytest --cuda, on a machine with
CUDA; skipped elsewhere): a tiny model trains in fp32, bf16 and fp16 with loss scaling; every
attention path equals the eager one on padded batches; checkpoints move between the GPU and the
CPU; a resume on the GPU continues the same losses.

The default suite runs on the CPU on every machine (tests/conftest.py hides the GPU): the first
test here checks that promise, and runs everywhere."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from train_support import read_metrics, train_in_process, write_prepared

cuda = pytest.mark.cuda


def test_the_default_suite_runs_on_the_cpu(request):
    """Without --cuda no test (and no bert-train it starts) can reach a GPU: the same verdicts
    on a GPU machine as on a CPU one."""
    if request.config.getoption("--cuda"):
        pytest.skip("--cuda: the GPU is meant to be visible")
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    child = subprocess.run([sys.executable, "-c",
                            "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "False"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=48, num_valid=8)


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def _log(run_dir):
    with open(os.path.join(run_dir, "train.log")) as f:
        return f.read()


# no dropout where runs on two devices are compared: the devices draw different masks
NO_DROPOUT = ["model.hidden_dropout_prob=0.0", "model.attention_probs_dropout_prob=0.0"]


@cuda
@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_tiny_model_trains_on_cuda(tmp_path, prepared, precision):
    run = str(tmp_path / "run")
    train_in_process(["experiment=smoke", f"data.dir={prepared}", f"run_dir={run}",
                      "trainer.max_steps=40", "trainer.checkpoint_every=40",
                      "trainer.eval_every=0", "trainer.log_every=5",
                      f"trainer.mixed_precision={precision}"])
    log = _log(run)
    # a GPU's auto is the padded grid, so `off` is no choice of varlen_attention's own there
    # (the line's words per device: tests/test_varlen_attention.py)
    assert ("speed switches on cuda: padded (auto on cuda), varlen_attention=off, "
            "attention=sdpa (auto on cuda)") in log
    losses = _losses(run)
    assert all(v is not None and v == v for v in losses.values()), losses
    assert losses[40] < losses[5] - 0.1, losses  # it learns
    step = os.path.join(run, "checkpoints", "step-00000040")
    extra = torch.load(os.path.join(step, "trainer_state.pt"), weights_only=True)
    if precision == "fp16":
        # loss scaling is on and its state travels in the checkpoint
        assert extra["scaler"] and extra["scaler"]["scale"] > 0
    else:
        assert not extra.get("scaler")


def _tiny(**kw):
    from test_model_impl import tiny_config

    return tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("switches", [
    dict(varlen_attention="off", attention="sdpa", unpad=True),
    dict(varlen_attention="groups", attention="sdpa"),
    dict(varlen_attention="nested"),
    dict(varlen_attention="nested", sparse_last_layer=False),
    dict(varlen_attention="nested", fused_qkv=True),
    dict(unpad=False, attention="sdpa"),
    dict(compile=True),
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_attention_paths_equal_the_eager_path_on_cuda(switches, dtype):
    """SDPA's fused kernels, the length groups and nested tensors (the fused variable-length
    kernels) against the explicit product on the padded grid, on batches with padding."""
    import torch._dynamo.utils as dynamo_utils

    from bert_pretrain.model import BertForPreTraining, ModelImpl
    from test_model_impl import assert_compiled, run_step
    from test_varlen_attention import modes_used, spread_batch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    cfg = _tiny()
    torch.manual_seed(0)
    eager = BertForPreTraining(cfg, ModelImpl(varlen_attention="off", attention="eager"))
    fast = BertForPreTraining(cfg, dataclasses.replace(ModelImpl(), **switches))
    fast.load_state_dict(eager.state_dict())
    eager, fast = eager.cuda().train(), fast.cuda().train()
    batch = {k: v.cuda() for k, v in spread_batch(cfg).items()}
    if switches.get("varlen_attention") in ("groups", "nested"):
        assert switches["varlen_attention"] in modes_used(fast, batch)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        ref, ref_grads = run_step(eager, batch)
        out, grads = run_step(fast, batch)
    for name in ("loss", "mlm_loss", "nsp_loss", "seq_relationship_logits"):
        a, b = getattr(out, name).float(), getattr(ref, name).float()
        assert torch.allclose(a, b, atol=tol, rtol=tol), name
    for name, grad in grads.items():
        assert torch.allclose(grad.float(), ref_grads[name].float(), atol=tol, rtol=tol), name
    if switches.get("compile"):
        assert_compiled(fast)


def _copy_step(src_run, step, dst_run):
    name = f"step-{step:08d}"
    os.makedirs(os.path.join(dst_run, "checkpoints"))
    shutil.copytree(os.path.join(src_run, "checkpoints", name),
                    os.path.join(dst_run, "checkpoints", name))


@cuda
def test_a_gpu_checkpoint_resumes_on_the_cpu_and_back(tmp_path, prepared):
    """GPU steps 1-4, CPU steps 5-8 from the GPU's checkpoint, GPU steps 9-12 from the CPU's:
    the same losses as 12 GPU steps, to float rounding across devices (no dropout: the devices
    draw different masks; a constant schedule, so that stopping the middle run at step 8 does
    not change its learning rates)."""
    common = ["experiment=smoke", f"data.dir={prepared}", "trainer.max_steps=12",
              "scheduler=constant",
              "trainer.checkpoint_every=4", "trainer.keep_last_k=10", "trainer.eval_every=0",
              *NO_DROPOUT]
    gpu, cpu, back = (str(tmp_path / n) for n in ("gpu", "cpu", "back"))
    train_in_process(common + [f"run_dir={gpu}"])
    _copy_step(gpu, 4, cpu)
    train_in_process(common + [f"run_dir={cpu}", "resume=auto", "trainer.max_steps=8",
                               "trainer.cpu=true"])
    assert "speed switches on cpu" in _log(cpu)
    _copy_step(cpu, 8, back)
    train_in_process(common + [f"run_dir={back}", "resume=auto"])
    reference, on_cpu, on_gpu = _losses(gpu), _losses(cpu), _losses(back)
    assert sorted(on_cpu) == list(range(5, 9)) and sorted(on_gpu) == list(range(9, 13))
    for step, loss in {**on_cpu, **on_gpu}.items():
        assert loss == pytest.approx(reference[step], rel=1e-4), step


@cuda
def test_resume_on_the_gpu_continues_the_same_losses(tmp_path, prepared):
    """With dropout (its masks seeded per step on the GPU too): a run resumed from its step-3
    checkpoint logs what the uninterrupted run logged, to the GPU's non-deterministic
    reductions (atomics in the embedding gradients)."""
    common = ["experiment=smoke", f"data.dir={prepared}", "trainer.max_steps=9",
              "trainer.checkpoint_every=3", "trainer.keep_last_k=10", "trainer.eval_every=0",
              "trainer.mixed_precision=bf16"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    train_in_process(common + [f"run_dir={full}"])
    _copy_step(full, 3, part)
    train_in_process(common + [f"run_dir={part}", "resume=auto"])
    a, b = _losses(full), _losses(part)
    assert sorted(b) == list(range(4, 10))
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    state = json.load(open(os.path.join(part, "checkpoints", "step-00000009",
                                        "trainer_state.json")))
    assert state["step"] == 9


@cuda
def test_fsdp_on_one_gpu_trains_the_unsharded_losses_and_resumes_without_sharding(tmp_path,
                                                                                   prepared):
    """FSDP2 on one GPU (its own one-process NCCL group): the losses of the unsharded run, a
    sharded checkpoint (the code path several GPUs take, tested on CPU over gloo in
    tests/test_fsdp.py), and an unsharded resume from it on the GPU continues them."""
    common = ["experiment=smoke", f"data.dir={prepared}", "trainer.max_steps=6",
              "trainer.checkpoint_every=3", "trainer.keep_last_k=10", "trainer.eval_every=3"]
    whole, sharded, resumed = (str(tmp_path / n) for n in ("whole", "sharded", "resumed"))
    train_in_process(common + [f"run_dir={whole}"])
    train_in_process(common + [f"run_dir={sharded}", "trainer.sharding=fsdp"])
    assert "sharding: FSDP2 over 1 process(es)" in _log(sharded)
    assert "speed switches on cuda" in _log(sharded)
    step3 = os.path.join(sharded, "checkpoints", "step-00000003")
    assert sorted(os.listdir(os.path.join(step3, "sharded"))) == [".metadata", "__0_0.distcp"]
    train_in_process(common + [f"run_dir={resumed}", f"resume={step3}"])
    reference, on_fsdp, after = _losses(whole), _losses(sharded), _losses(resumed)
    for step in range(1, 7):
        assert on_fsdp[step] == pytest.approx(reference[step], rel=1e-4), step
    for step in range(4, 7):
        assert after[step] == pytest.approx(on_fsdp[step], rel=1e-4), step


@cuda
def test_a_gpu_step_waits_neither_for_its_numbers_nor_for_its_labelled_rows(tmp_path, prepared):
    """Deferred reads (trainer.py) and the labelled rows gathered at a count the host gives
    (model/bert.py): torch's sync debug mode names every operation of a step that waits for
    the GPU; none may come from the trainer, the optimizer step, the batch's copy or the MLM
    head's gather (any other is printed, not refused)."""
    import warnings

    from omegaconf import OmegaConf

    from bert_pretrain.config import settings
    from bert_pretrain.trainer import Trainer
    from train_support import compose

    cfg = compose(["experiment=smoke", f"data.dir={prepared}", f"run_dir={tmp_path / 'run'}",
                   "trainer.eval_every=0", "trainer.mixed_precision=bf16"])
    trainer = Trainer(settings(cfg), OmegaConf.to_container(cfg, resolve=True), "")
    try:
        assert trainer.defer_reads and trainer.accelerator.device.type == "cuda"
        trainer.train_step()  # the first step sets up the optimizer's state
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                results = [trainer.train_step() for _ in range(3)]
            finally:
                torch.cuda.set_sync_debug_mode("default")
        waits = [f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught
                 if "synchroniz" in str(w.message)]
        print("waits for the GPU in 3 steps:", waits)
        ours = {"trainer.py", "precision.py", "evaluation.py", "optim.py", "bert.py"}
        assert not [w for w in waits if w.split(":")[0] in ours], waits
        assert all(r.updated and r.loss == r.loss for r in results)
    finally:
        trainer.close()


@cuda
def test_a_gpu_fine_tuning_step_waits_for_none_of_its_numbers(tmp_path, monkeypatch):
    """bert-finetune's deferred reads (finetune/runner.py): steps 2-4 of a bf16 fine-tune on
    the GPU, under torch's sync debug mode; no wait may come from the fine-tuning step, the
    optimizer, the batch's copy or the classifier (any other is printed, not refused)."""
    import warnings

    from bert_pretrain.finetune.runner import FineTune
    from finetune_support import FAST, finetune_in_process, pretrained_run, sentence_task

    run, task = pretrained_run(str(tmp_path)), sentence_task(str(tmp_path / "task"))
    real_step, caught, deferred = FineTune.train_step, [], []

    def step(self):
        if not 1 <= self.step <= 3:  # (the first step sets up the optimizer's state)
            return real_step(self)
        deferred.append(self.defer_reads and next(self.raw_model.parameters()).is_cuda)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return real_step(self)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                caught.extend(seen)

    monkeypatch.setattr(FineTune, "train_step", step)
    finetune_in_process([*task, f"model={run}", *FAST, "recipe.epochs=1",
                         "trainer.mixed_precision=bf16", "trainer.log_every=100",
                         "+impl.unpad=false", f"out_dir={tmp_path / 'out'}"])
    waits = [f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught
             if "synchroniz" in str(w.message)]
    print("waits for the GPU in 3 fine-tuning steps:", waits)
    assert deferred == [True] * 3
    ours = {"runner.py", "precision.py", "evaluation.py", "optim.py", "classifier.py", "bert.py"}
    assert not [w for w in waits if w.split(":")[0] in ours], waits
