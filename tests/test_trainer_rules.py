"""The trainer's rules: what a resume may change (and says), non-finite steps, the model's
[PAD] id, data without a held-out split, warmup defaults, what a run prints and logs, and what a
failed run leaves behind."""

import json
import os

import pytest
import torch

from bert_pretrain.errors import ConfigError, DataError
from bert_pretrain.trainer import TrainerConfig
from train_support import read_metrics, run_bert_train, train_in_process, write_prepared


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=48, num_valid=8)


def base(data, run_dir, *extra):
    return ["experiment=smoke", f"data.dir={data}", f"run_dir={run_dir}", "trainer.eval_every=0",
            *extra]


# --------------------------------------------------------------------------- resume


def test_unchanged_resume_warns_nothing_and_a_changed_one_names_each_change(
        tmp_path, synthetic, capsys):
    run = tmp_path / "run"
    train_in_process(base(synthetic, run, "trainer.max_steps=4", "trainer.checkpoint_every=2"))
    capsys.readouterr()
    train_in_process(base(synthetic, run, "trainer.max_steps=4", "trainer.checkpoint_every=2",
                          "resume=auto"))
    out = capsys.readouterr()
    assert "warning" not in out.err + out.out
    # Resume from step 2 with a longer schedule and another peak lr.
    os.rename(run / "checkpoints" / "step-00000004", tmp_path / "moved")
    train_in_process(base(synthetic, run, "trainer.max_steps=40", "trainer.checkpoint_every=2",
                          "optim.lr=2e-3", "resume=auto"))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(lines) == 1, err
    line = lines[0]
    assert "resuming" in line and "step-00000002" in line
    assert "optim.lr 0.001 -> 0.002" in line and "trainer.max_steps 4 -> 40" in line
    # smoke: warmup 2, linear decay over 4 steps: at step 2 the old lr is 1e-3 x (1 - 0/2)
    assert "learning rate at step 2: 0.001 -> 0.002" in line
    # ... and the warning is in the run's log as well
    assert "trainer.max_steps 4 -> 40" in (run / "train.log").read_text()


def test_a_resume_with_another_max_steps_names_the_attention_locality_it_jumps_to():
    """The attention locality fades over a share of max_steps: another max_steps moves its
    strength at the resume step, said with the values before and after (as the learning rate
    and a scheduled masking rate are); with max_steps unchanged nothing moves."""
    from bert_pretrain.components.resume import changed_settings_warning

    def config(max_steps):
        return {"trainer": {"max_steps": max_steps, "warmup_steps": 1,
                            "attention_locality": 1.0, "attention_locality_hold": 0.2,
                            "attention_locality_end": 0.45},
                "data": {"masking": "static"}, "optim": {"lr": 1e-3},
                "scheduler": {"name": "constant"}}

    # step 30 of 100: 0.2 of the way from hold to end (1 -> 0.6); of 40: past the end (0)
    line = changed_settings_warning("ckpt", config(100), config(40), 30, 1e-3)
    assert "trainer.max_steps 100 -> 40" in line and \
        "attention locality at step 30: 0.6 -> 0" in line
    assert "learning rate" not in line  # (constant)
    same = changed_settings_warning("ckpt", config(100), {**config(100), "seed": 2}, 30, 1e-3)
    assert same is None
    # with a time budget the fade follows the time spent, which a resume does not change
    budget = [config(100), config(40)]
    for c in budget:
        c["trainer"].update(budget_hours=1.0)
    assert "attention locality" not in changed_settings_warning("ckpt", *budget, 30, None)


def test_a_resume_with_another_max_steps_names_the_warmup_derived_from_it(tmp_path, synthetic,
                                                                         capsys):
    """With trainer.warmup_steps null the warmup is warmup_ratio x max_steps: another max_steps
    changes it too (100 -> 46 steps for 1,000 -> 460), which no setting on the command line
    says, so the warning does; a warmup given in steps stays and is not named."""
    from bert_pretrain.components.resume import changed_settings_warning

    def config(max_steps, warmup_steps=None):
        return {"trainer": {"max_steps": max_steps, "warmup_steps": warmup_steps,
                            "warmup_ratio": 0.1},
                "data": {"masking": "static"}, "optim": {"lr": 1e-3},
                "scheduler": {"name": "constant"}}

    line = changed_settings_warning("ckpt", config(1000), config(460), 300, 1e-3)
    assert "trainer.max_steps 1000 -> 460; warmup 100 -> 46 steps (warmup_ratio 0.1 x " \
           "max_steps)" in line
    line = changed_settings_warning("ckpt", config(1000, 100), config(460, 100), 300, 1e-3)
    assert "warmup" not in line
    # from a derived warmup to one given in steps: the given one is said, and what it replaced
    line = changed_settings_warning("ckpt", config(1000), config(460, 20), 300, 1e-3)
    assert "trainer.warmup_steps None -> 20; warmup 100 -> 20 steps" in line

    # A real resume says it, and trains with the new warmup (its start line says which).
    run = tmp_path / "run"
    common = base(synthetic, run, "trainer.warmup_steps=null", "trainer.warmup_ratio=0.5")
    train_in_process([*common, "trainer.max_steps=4"])
    capsys.readouterr()
    train_in_process([*common, "trainer.max_steps=8", "resume=auto"])
    [line] = [ln for ln in capsys.readouterr().err.splitlines() if "changed settings" in ln]
    assert "trainer.max_steps 4 -> 8; warmup 2 -> 4 steps (warmup_ratio 0.5 x max_steps)" in line
    [start] = [ln for ln in (run / "train.log").read_text().splitlines() if "resumed from" in ln]
    assert "; warmup 4 steps;" in start


def test_resume_applies_the_new_optimizer_settings(tmp_path, synthetic):
    run = tmp_path / "run"
    train_in_process(base(synthetic, run, "trainer.max_steps=3"))
    train_in_process(base(synthetic, run, "trainer.max_steps=4", "resume=auto",
                          "optim.weight_decay=0.2", "optim.betas=[0.8,0.95]", "optim.eps=1e-8"))
    groups = torch.load(run / "checkpoints" / "step-00000004" / "optimizer.pt",
                        weights_only=True)["param_groups"]
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.2 and no_decay["weight_decay"] == 0.0
    assert tuple(decay["betas"]) == (0.8, 0.95) and decay["eps"] == 1e-8
    saved = (run / "checkpoints" / "step-00000004" / "config.yaml").read_text()
    assert "weight_decay: 0.2" in saved  # the saved config is what ran


def test_resume_with_another_seed_is_refused(tmp_path, synthetic):
    run = tmp_path / "run"
    train_in_process(base(synthetic, run, "trainer.max_steps=3"))
    with pytest.raises(ConfigError, match="seed=7 but .* seed=1234: a new seed re-orders"):
        train_in_process(base(synthetic, run, "trainer.max_steps=4", "resume=auto", "seed=7"))


def test_resuming_a_finished_run_says_so(tmp_path, synthetic, capsys):
    run = tmp_path / "run"
    train_in_process(base(synthetic, run, "trainer.max_steps=3"))
    capsys.readouterr()
    train_in_process(base(synthetic, run, "trainer.max_steps=3", "resume=auto"))
    assert "already finished at step 3 (resumed a finished run" in capsys.readouterr().out


# --------------------------------------------------------------------------- faults


class _NaNGrad(torch.autograd.Function):
    """Identity forward (the loss stays finite), NaN gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def test_finite_loss_with_nan_gradients_is_skipped_and_never_saved(tmp_path, synthetic,
                                                                   monkeypatch):
    from safetensors.torch import load_file

    from bert_pretrain.model import BertForPreTraining

    original, calls = BertForPreTraining.forward, {"n": 0}

    def poisoned(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 2:  # the second training step (one micro-batch per step)
                out.mlm_loss = _NaNGrad.apply(out.mlm_loss)
        return out

    monkeypatch.setattr(BertForPreTraining, "forward", poisoned)
    run = tmp_path / "run"
    train_in_process(base(synthetic, run, "trainer.max_steps=4", "trainer.checkpoint_every=1",
                          "trainer.keep_last_k=10", "trainer.max_grad_norm=null"))
    records = [r for r in read_metrics(run) if "loss" in r]
    assert records[1]["loss"] is None and records[1]["nonfinite_steps"] == 1
    assert records[2]["loss"] is not None and "nonfinite_steps" not in records[2]
    saved = sorted(n for n in os.listdir(run / "checkpoints") if n.startswith("step-"))
    assert saved == ["step-00000001", "step-00000003", "step-00000004"]  # not the skipped one
    for name in saved:
        weights = load_file(str(run / "checkpoints" / name / "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values()), name


def test_accelerates_own_gradient_accumulation_is_refused(tmp_path, synthetic, monkeypatch):
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    with pytest.raises(ConfigError, match="accelerate's gradient accumulation is set to 4.*"
                                          "trainer.micro_batch_size"):
        train_in_process(base(synthetic, tmp_path / "run"))
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- data


def test_pad_id_comes_from_the_data(tmp_path):
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=4)
    manifest = json.loads(open(os.path.join(data, "manifest.json")).read())
    manifest["special_token_ids"].update(pad=1, unk=0)  # [PAD] is not token 0 here
    open(os.path.join(data, "manifest.json"), "w").write(json.dumps(manifest))
    run = tmp_path / "run"
    train_in_process(base(data, run, "trainer.max_steps=1", "trainer.warmup_steps=0"))
    state = json.loads((run / "checkpoints" / "step-00000001" / "trainer_state.json").read_text())
    assert state["model_config"]["pad_token_id"] == 1
    with pytest.raises(DataError, match=r"model.pad_token_id=0 but \[PAD\] is token 1"):
        train_in_process(base(data, tmp_path / "other", "trainer.max_steps=1",
                              "trainer.warmup_steps=0", "model.pad_token_id=0"))


def test_data_without_a_held_out_split_trains_without_evaluation(tmp_path, capsys):
    data = write_prepared(str(tmp_path / "data"), num_train=16, num_valid=0)
    run = tmp_path / "run"
    result = train_in_process(base(data, run, "trainer.max_steps=3", "trainer.eval_every=1"))
    out = capsys.readouterr().out
    assert out.count("training without evaluation") == 1
    assert result != result  # nan: there is no held-out loss
    assert not [r for r in read_metrics(run) if "eval_mlm_loss" in r]


# --------------------------------------------------------------------------- defaults, output


def test_warmup_is_a_fraction_of_the_run_unless_set():
    assert TrainerConfig(max_steps=20).warmup == 2
    assert TrainerConfig(max_steps=1000).warmup == 100
    assert TrainerConfig(max_steps=20, warmup_steps=5).warmup == 5
    assert TrainerConfig(max_steps=1).warmup == 0  # any length works with the defaults
    with pytest.raises(ValueError, match="set trainer.warmup_steps"):
        TrainerConfig(budget_hours=1.0)
    assert TrainerConfig(budget_hours=1.0, warmup_steps=10).warmup == 10


def test_console_lines_and_train_log(tmp_path, synthetic):
    run = tmp_path / "run"
    r = run_bert_train(base(synthetic, run, "trainer.max_steps=4", "trainer.eval_every=2",
                            "trainer.warmup_steps=null", "trainer.report=true"),
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    evals = [ln for ln in r.stdout.splitlines() if "held-out MLM loss" in ln]
    assert len(evals) == 1 and evals[0].startswith("bert-train: step 2: held-out MLM loss ")
    assert "warmup 0 steps" in r.stdout  # 10% of 4 steps, rounded
    log = (run / "train.log").read_text()
    for line in r.stdout.splitlines():
        if line.startswith(("bert-train:", "  checkpoint:", "  metrics:")):
            assert line in log, line
    # bert-train draws the run's report at the end
    assert f"  report:     {run / 'report' / 'report.md'}" in r.stdout
    assert (run / "report" / "report.md").is_file()


@pytest.mark.parametrize("mode", ["steps", "budget"])
def test_the_progress_line_counts_the_step_once(tmp_path, synthetic, monkeypatch, mode):
    """The progress line (no terminal: a line each time; here every update) showed the bar's
    step count beside the last logged step (`25/1,000 step ... step=20`). In step mode the bar's
    count is the step and says it alone; in budget mode the bar counts seconds and the step
    beside it is the step just done, not the last logged one."""
    import io

    import bert_pretrain.components.progress as progress

    shown = io.StringIO()
    real = progress.progress_bar
    monkeypatch.setattr(progress, "progress_bar", lambda *a, **k: real(
        *a, **{**k, "stream": shown, "every_s": 0}))
    length = ["trainer.budget_hours=1.0", "trainer.warmup_steps=1"] if mode == "budget" else []
    train_in_process(base(synthetic, tmp_path / "run", "trainer.max_steps=7",
                          "trainer.log_every=3", "trainer.progress_bar=true", *length))
    lines = [ln for ln in shown.getvalue().splitlines() if ln.startswith("train: ")][:-1]
    assert len(lines) == 7  # one per step (the last line, the closing one, is left out)
    if mode == "steps":
        assert [ln.split()[1] for ln in lines] == [f"{s}/7" for s in range(1, 8)]
        assert not any("step=" in ln for ln in lines)
    else:
        import re

        assert [int(re.search(r", step=(\d+)", ln).group(1)) for ln in lines] == \
            list(range(1, 8))
    assert "loss=" in lines[-1] and "lr=" in lines[-1]  # (the last logged values beside)


def test_a_run_that_fails_at_setup_leaves_no_directory(tmp_path, synthetic):
    run = tmp_path / "runs" / "bad"
    r = run_bert_train(base(synthetic, run, "model.num_attention_heads=3"), cwd=str(tmp_path))
    assert r.returncode == 2 and "divisible" in r.stderr
    assert not run.exists()


def test_the_step_and_evaluation_hooks_reproduce_fit(tmp_path, synthetic):
    """Benchmarks and the GPU work drive `Trainer.train_step` / `run_evaluation` themselves:
    the same steps by hand give the losses fit() logs."""
    from omegaconf import OmegaConf

    from bert_pretrain.config import settings
    from bert_pretrain.trainer import Trainer
    from train_support import compose

    overrides = base(synthetic, tmp_path / "fit", "trainer.max_steps=3")
    train_in_process(overrides)
    logged = [r for r in read_metrics(tmp_path / "fit") if "loss" in r]
    evaluated = [r for r in read_metrics(tmp_path / "fit") if "eval_mlm_loss" in r][-1]

    cfg = compose(base(synthetic, tmp_path / "hand", "trainer.max_steps=3",
                       "trainer.mixed_precision=no"))  # as train_in_process pins it
    trainer = Trainer(settings(cfg), OmegaConf.to_container(cfg, resolve=True), "")
    try:
        results = [trainer.train_step() for _ in range(3)]
        by_hand = trainer.run_evaluation()
    finally:
        trainer.close()
    assert [r.loss for r in results] == [r["loss"] for r in logged]
    assert by_hand["eval_mlm_loss"] == evaluated["eval_mlm_loss"]


def test_init_from_a_transformers_directory_continues_its_training(tmp_path, synthetic):
    """trainer.init_from=<save_pretrained dir>: its config is the model, its weights the start;
    the first step's loss is transformers' loss on the same batch."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from bert_pretrain.components.data import DataConfig, PreparedData, TrainStream

    hf_cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    reference = transformers.BertForPreTraining(hf_cfg).eval()
    source = tmp_path / "hf"
    reference.save_pretrained(source)
    shutil.copy(os.path.join(synthetic, "tokenizer", "vocab.txt"), source / "vocab.txt")

    run = tmp_path / "run"
    train_in_process(base(synthetic, run, f"trainer.init_from={source}", "trainer.max_steps=3",
                          "model.hidden_size=128", "trainer.micro_batch_size=8"))
    first = [r for r in read_metrics(run) if "loss" in r][0]
    batch = TrainStream(PreparedData(synthetic), DataConfig(dir=synthetic), 1234, 8, 8, 1,
                        0).next_step()[0]
    with torch.no_grad():
        expected = reference(**{k: v for k, v in batch.items() if k != "num_tokens"}).loss
    assert first["loss"] == pytest.approx(expected.item(), abs=1e-5)
    state = json.loads((run / "checkpoints" / "step-00000003" / "trainer_state.json")
                       .read_text())
    assert state["model_config"]["hidden_size"] == 32  # the directory's, not model.*'s

    # A vocabulary that is not the data's is refused in one line naming the fix.
    (source / "vocab.txt").write_text("\n".join(f"t{i}" for i in range(64)) + "\n")
    with pytest.raises(DataError, match="vocabulary differs .* bert-prep tokenizer.vocab_file="):
        train_in_process(base(synthetic, tmp_path / "other", f"trainer.init_from={source}"))


# --------------------------------------------------------------------------- precision


def test_auto_precision_is_bf16_only_where_the_cpu_has_bf16_units(tmp_path, synthetic,
                                                                   monkeypatch):
    """trainer.mixed_precision=auto resolves on this machine, says so at start-up, and the
    resolved value is what the checkpoint's config.yaml keeps (a resume elsewhere names it)."""
    from omegaconf import OmegaConf

    import bert_pretrain.components.cpu_runtime as cpu_runtime

    for units, expected in (("AVX512-BF16", "bf16"), (None, "no")):
        monkeypatch.setattr(cpu_runtime, "bf16_units", lambda units=units: units)
        run_dir = tmp_path / f"auto-{expected}"
        train_in_process(base(synthetic, run_dir, "trainer.max_steps=2", "trainer.warmup_steps=0",
                              "trainer.mixed_precision=auto", "trainer.checkpoint_every=2"))
        log = (run_dir / "train.log").read_text()
        if expected == "bf16":
            assert ("precision bf16 autocast (fp32 weights and optimizer state) (auto: this CPU "
                    "has AVX512-BF16 matrix instructions)") in log
        else:
            assert "precision fp32 (auto: this CPU has no bf16 matrix instructions" in log
        saved = OmegaConf.load(run_dir / "checkpoints" / "step-00000002" / "config.yaml")
        assert saved.trainer.mixed_precision == expected


def test_start_up_line_says_what_the_speed_switches_became(tmp_path, synthetic):
    """impl's `auto` values resolve per device; bert-train says what they became, and an
    explicit choice is shown as given."""
    run_dir = tmp_path / "switches"
    train_in_process(base(synthetic, run_dir, "trainer.max_steps=1", "trainer.warmup_steps=0",
                          "trainer.checkpoint_every=1", "impl.fused_qkv=true"))
    log = (run_dir / "train.log").read_text()
    assert ("speed switches on cpu: unpadded (auto on cpu), varlen_attention=off (auto on "
            "cpu), attention=eager (auto on cpu): runs padded grid + explicit product, sparse "
            "prediction + last layer, fused qkv, fast dropout") in log
    # nested tensors take no score bias: while the locality start is on (demo, gpu_mini), the
    # layers run the padded grid, and the line says so (issue 38)
    run_dir = tmp_path / "nested"
    train_in_process(base(synthetic, run_dir, "trainer.max_steps=1", "trainer.warmup_steps=0",
                          "trainer.checkpoint_every=1", "impl.varlen_attention=nested",
                          "impl.attention=sdpa", "trainer.attention_locality=1.0"))
    assert ("varlen_attention=nested, attention=eager (with dropout on cpu): runs padded grid "
            "+ explicit product while the locality bias is on (first 45% of steps), then "
            "nested tensors + sdpa,") in (run_dir / "train.log").read_text()


def test_busy_machine_warning_counts_other_processes_threads_not_its_own():
    """The count bert-train warns from sees a spinning process beside it, and not this
    process's own spinning threads (which only show as busy because they are this run's)."""
    import subprocess
    import sys
    import threading

    from bert_pretrain.components.cpu_runtime import other_running_threads

    if not os.path.exists("/proc/loadavg"):
        pytest.skip("the runnable-thread count needs Linux's /proc")
    stop = threading.Event()

    def spin():  # this process's own busy thread: must not count as another process
        while not stop.is_set():
            pass

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    own = threading.Thread(target=spin, daemon=True)
    own.start()
    try:
        # the child either runs or waits for a core: both are runnable, so >= 1 on any machine
        assert other_running_threads(samples=9, interval=0.02) >= 1
    finally:
        spinner.kill()
        spinner.wait()
        stop.set()
        own.join()


def test_busy_machine_warning_says_what_to_do_and_stays_quiet_when_there_is_room(
        tmp_path, synthetic, monkeypatch):
    from bert_pretrain.components import cpu_runtime
    from bert_pretrain.components.cpu_runtime import busy_machine_warning

    assert busy_machine_warning(threads=2, cores=4, others=2) is None  # room for both
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    line = busy_machine_warning(threads=2, cores=2, others=1)
    assert line.startswith("warning: 1 thread(s) of other processes were running as this run "
                           "started, on a machine with 2 cores for this run's 2 threads")
    assert "ACTIVE" not in line and "OMP_NUM_THREADS" in line
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "several times slower with OMP_WAIT_POLICY=ACTIVE" in busy_machine_warning(
        threads=2, cores=2, others=1)
    # in the run's log, after the precision line, only when the count says busy (every core
    # taken: busy on any machine); conftest turns the check off for the rest of the suite
    from bert_pretrain.components.cpu_runtime import BUSY_CHECK_ENV

    monkeypatch.delenv(BUSY_CHECK_ENV)
    for others, warned in ((0, False), (os.cpu_count(), True)):
        monkeypatch.setattr(cpu_runtime, "other_running_threads", lambda others=others: others)
        run_dir = tmp_path / f"busy-{others}"
        train_in_process(base(synthetic, run_dir, "trainer.max_steps=1", "trainer.warmup_steps=0",
                              "trainer.checkpoint_every=1"))
        log = (run_dir / "train.log").read_text()
        assert (f"bert-train: warning: {os.cpu_count()} thread(s) of other processes were "
                f"running" in log) == warned


def test_resolve_precision_keeps_explicit_settings():
    from bert_pretrain.components.cpu_runtime import resolve_precision

    for setting in ("no", "bf16", "fp16"):
        assert resolve_precision(setting, on_cuda=False)[0] == setting


def test_entry_point_sets_passive_omp_wait_before_torch_loads():
    """libgomp reads OMP_WAIT_POLICY once, when torch loads it: bert-train must set it first,
    and leave a user's own choice alone."""
    import subprocess
    import sys

    code = ("import sys, os; import bert_pretrain.train; "
            "from bert_pretrain.components.cpu_runtime import omp_wait_setting; "
            "print(os.environ.get('OMP_WAIT_POLICY')); print(omp_wait_setting())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env,
                         capture_output=True, text=True, check=True)
    policy, logged = out.stdout.strip().splitlines()
    assert policy == "PASSIVE"
    # the run's log says what the default costs, and how to choose otherwise
    assert logged.startswith("OMP_WAIT_POLICY=PASSIVE (the default; OMP_WAIT_POLICY=ACTIVE")
    order = [line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line]
    assert order.index("bert_pretrain.components.cpu_runtime") < order.index("torch")
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines() == ["ACTIVE", "OMP_WAIT_POLICY=ACTIVE"]
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # the user's own PASSIVE: no advice to undo it
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines() == ["PASSIVE", "OMP_WAIT_POLICY=PASSIVE"]


def test_nsp_loss_weight_scales_the_nsp_gradient_only(tmp_path, synthetic):
    """trainer.nsp_loss_weight=0 leaves the NSP-only parameters (pooler, NSP classifier) where
    they started; another weight moves the shared encoder differently; the logged loss is the
    unweighted mlm + nsp either way."""
    from omegaconf import OmegaConf

    from bert_pretrain.config import settings
    from bert_pretrain.trainer import Trainer
    from train_support import compose

    def one_step(weight):
        cfg = compose(base(synthetic, tmp_path / f"w{weight}", "trainer.max_steps=3",
                           "trainer.mixed_precision=no", "optim.weight_decay=0",
                           f"trainer.nsp_loss_weight={weight}"))
        trainer = Trainer(settings(cfg), OmegaConf.to_container(cfg, resolve=True), "")
        try:
            before = {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}
            result = trainer.train_step()
            after = trainer.raw_model.state_dict()
            moved = {k for k in before if not torch.equal(before[k], after[k])}
            return result, moved, {k: after[k].clone() for k in after}
        finally:
            trainer.close()

    r0, moved0, w0 = one_step(0.0)
    r1, moved1, w1 = one_step(1.0)
    r3, moved3, w3 = one_step(3.0)
    nsp_only = {"bert.pooler.dense.weight", "bert.pooler.dense.bias",
                "cls.seq_relationship.weight", "cls.seq_relationship.bias"}
    assert not moved0 & nsp_only and nsp_only <= moved1 and nsp_only <= moved3
    assert r0.loss == r1.loss == r3.loss == pytest.approx(r1.mlm_loss + r1.nsp_loss)
    query = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(w1[query], w3[query]) and not torch.equal(w0[query], w1[query])
    with pytest.raises(ValueError, match="nsp_loss_weight must be >= 0"):
        TrainerConfig(nsp_loss_weight=-1.0)


def test_attention_locality_fades_out_and_evaluations_score_plain_bert(tmp_path, synthetic):
    """trainer.attention_locality: full strength for the `hold` share of the steps, a linear
    fade to 0 at `end`; every evaluation scores the model without it (what an export
    computes), and after the fade the training steps are plain BERT's."""
    from bert_pretrain.components.checkpoint import load_weights, read_train_state
    from bert_pretrain.components.data import DataConfig, PreparedData, eval_batches
    from bert_pretrain.components.evaluation import evaluate
    from bert_pretrain.model import BertConfig, BertForPreTraining

    cfg = TrainerConfig(max_steps=10, attention_locality=2.0, attention_locality_hold=0.2,
                        attention_locality_end=0.6)
    assert [cfg.locality_strength(s, 0.0) for s in (0, 1, 2, 3, 4, 5, 6, 9)] == \
        pytest.approx([1, 1, 1, 0.75, 0.5, 0.25, 0, 0])
    budget = TrainerConfig(budget_hours=1.0, warmup_steps=0, attention_locality=1.0,
                           attention_locality_hold=0.5, attention_locality_end=1.0)
    assert budget.locality_strength(10**6, 1800.0) == 1.0  # time, not steps, in budget mode
    assert budget.locality_strength(0, 2700.0) == pytest.approx(0.5)
    assert TrainerConfig().locality_strength(0, 0.0) == 0.0  # off by default
    for bad in (dict(attention_locality=-1.0), dict(attention_locality_hold=0.7),
                dict(attention_locality_heads=0.0)):
        with pytest.raises(ValueError, match="attention_locality"):
            TrainerConfig(**bad)

    run = tmp_path / "run"
    train_in_process(base(synthetic, run, "trainer.max_steps=10", "trainer.log_every=1",
                          "trainer.eval_every=2", "trainer.checkpoint_every=2",
                          "trainer.keep_last_k=10", "trainer.attention_locality=2.0",
                          "trainer.attention_locality_hold=0.2",
                          "trainer.attention_locality_end=0.6", "model.hidden_dropout_prob=0",
                          "model.attention_probs_dropout_prob=0"))
    records = read_metrics(run)
    logged = [r["attention_locality"] for r in records if "loss" in r]
    assert logged == pytest.approx([2, 2, 2, 1.5, 1, 0.5, 0, 0, 0, 0])
    data = PreparedData(synthetic)
    from accelerate import Accelerator

    for step in (2, 4):  # bias at full strength / half way down while these were trained
        checkpoint = run / "checkpoints" / f"step-{step:08d}"
        model = BertForPreTraining(BertConfig.from_dict(
            read_train_state(str(checkpoint))["model_config"]))
        load_weights(str(checkpoint), model)
        direct = evaluate(model, Accelerator(cpu=True),
                          eval_batches(data, DataConfig(dir=synthetic), 4, 1, 0, None),
                          mask_id=data.special["mask"])
        logged_eval = next(r for r in records if r["step"] == step and "eval_mlm_loss" in r)
        assert logged_eval["eval_mlm_loss"] == pytest.approx(direct["eval_mlm_loss"], rel=1e-6)


def test_objective_chooses_what_bert_train_returns(tmp_path, synthetic):
    from bert_pretrain.config import settings
    from train_support import compose

    run = tmp_path / "run"
    value = train_in_process(base(synthetic, run, "trainer.max_steps=3", "objective=eval_loss"))
    last = [r for r in read_metrics(run) if "eval_nsp_loss" in r][-1]
    assert value == pytest.approx(last["eval_mlm_loss"] + last["eval_nsp_loss"], rel=1e-12)
    with pytest.raises(ConfigError, match="objective 'eval_acc' is not one of eval_mlm_loss"):
        settings(compose(base(synthetic, run, "objective=eval_acc")))
