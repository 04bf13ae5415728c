"""bert-finetune end to end on tasks the tests write (labels that depend on the text): it learns
them, 1 process equals 2, an interrupted fine-tune resumes exactly, the fine-tuned model loads
in transformers with the same logits, a finished grid is not redone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from finetune_support import (FAST, finetune_in_process, kill_fine_tune_at, pair_task,
                              pretrained_run, sentence_task)
from time_limits import hang_limit
from train_support import CHILD_PYTHONPATH, REPO
from unseeded_steps import without_reseed

ACCELERATE_CONFIG = os.path.join(REPO, "conf", "accelerate", "cpu_2proc.yaml")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return pretrained_run(str(tmp_path_factory.mktemp("pretrained")))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    return {"sentence": sentence_task(str(root / "sentence")),
            "pair": pair_task(str(root / "pair"))}


@pytest.mark.parametrize("kind", ["sentence", "pair"])
def test_fine_tuning_beats_the_majority_class_clearly(kind, run, tasks, tmp_path, one_thread):
    """The dev sets are balanced (majority class: 50%); the label is whether w0 is in the
    (first) sentence, so only a model that reads the text gets it."""
    summary = finetune_in_process([*tasks[kind], f"model={run}", *FAST,
                                   f"out_dir={tmp_path}"])
    assert summary["metrics"]["accuracy"] >= 0.8, summary["metrics"]
    assert summary["checkpoint"].endswith("step-00000020")  # the run's newest checkpoint
    saved = json.loads((tmp_path / "finetune.json").read_text())
    assert saved["score"] == summary["score"] and saved["best_lr"] == 1e-3
    assert sorted(os.listdir(tmp_path / "model")) == sorted(
        ["classifier.json", "config.json", "identity.json", "model.safetensors", "vocab.txt"])


def test_a_busy_machine_is_said_at_the_start(run, tasks, tmp_path, monkeypatch, capsys,
                                             one_thread):
    """As bert-train: when other processes' threads hold the cores, the start says so, once;
    on a quiet machine nothing. (conftest turns the check off for the rest of the suite.)"""
    from bert_pretrain.components import cpu_runtime

    monkeypatch.delenv(cpu_runtime.BUSY_CHECK_ENV)
    for others, warned in ((0, False), (os.cpu_count(), True)):
        monkeypatch.setattr(cpu_runtime, "other_running_threads", lambda others=others: others)
        finetune_in_process([*tasks["sentence"], f"model={run}", *FAST, "recipe.epochs=1",
                             f"out_dir={tmp_path / str(others)}"])
        out = capsys.readouterr().out
        assert out.count(f"bert-finetune: warning: {os.cpu_count()} thread(s) of other "
                         f"processes were running") == int(warned), out


def _weights(directory) -> dict:
    return load_file(os.path.join(directory, "model.safetensors"))


def test_a_grid_keeps_the_median_model_and_reads_a_finished_grid_back(run, tasks, tmp_path,
                                                                     monkeypatch, one_thread):
    """save_model=best: model/ is the best rate's median-seed run (its identity says which, and
    its logits score what that run scored), no run folder keeps a model, and the same command
    again reads the finished grid back instead of fine-tuning. (How the summary picks the
    median and the rate: test_finetune_outputs.py, on hand-made results.)"""
    from bert_pretrain.finetune.export import load_classifier
    from bert_pretrain.finetune.grid import median_run
    from bert_pretrain.finetune.pretrained import load_pretrained
    from bert_pretrain.finetune.reading import read_task
    from bert_pretrain.finetune.runner import FineTune
    from bert_pretrain.finetune.tasks import TaskConfig

    args = [*tasks["sentence"], f"model={run}", *FAST, "recipe.lrs=[1e-4,1e-3]",
            "recipe.seeds=[1,2,3]", "recipe.epochs=1", f"out_dir={tmp_path}"]
    summary = finetune_in_process(args)
    median = median_run(summary)
    identity = json.loads((tmp_path / "model" / "identity.json").read_text())
    assert (identity["lr"], identity["seed"]) == (summary["best_lr"], median["seed"])
    assert not any(os.path.isdir(tmp_path / d / "model") for d in os.listdir(tmp_path)
                   if d.startswith("lr"))
    cfg = {o.split("=", 1)[0].split(".")[-1]: o.split("=", 1)[1] for o in tasks["sentence"][1:]}
    dev = read_task(TaskConfig(name="custom", train_file=cfg["train_file"],
                               validation_file=cfg["validation_file"], text_columns=["text"]))
    tokenizer = load_pretrained(run).tokenizer()
    model = load_classifier(str(tmp_path / "model"))
    correct = 0
    with torch.no_grad():
        for text, label in zip(dev.evals[""].text_a, dev.evals[""].labels):
            ids = torch.tensor([tokenizer.encode(text).ids])
            correct += int(model(ids, torch.ones_like(ids)).logits.argmax(-1).item() == label)
    assert correct / len(dev.evals[""]) == pytest.approx(median["metrics"]["accuracy"])
    monkeypatch.setattr(FineTune, "train_step", lambda self: pytest.fail("trained again"))
    again = finetune_in_process(args)
    assert again["grid"] == summary["grid"]


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_interrupted_fine_tune_resumes_exactly(decay, run, tasks, tmp_path, monkeypatch,
                                               one_thread):
    """Also with layer-wise rate decay (one optimizer group per layer and kind to restore)."""
    from bert_pretrain.components.checkpoint_manager import list_checkpoints
    from bert_pretrain.finetune.runner import FineTune

    common = [*tasks["pair"], f"model={run}", *FAST, "recipe.dropout=0.1",
              "trainer.checkpoint_every=10", "trainer.save_model=all",
              f"recipe.layer_lr_decay={decay}"]
    whole = finetune_in_process([*common, f"out_dir={tmp_path / 'whole'}"])
    real_step = kill_fine_tune_at(monkeypatch, 25)
    with pytest.raises(RuntimeError, match="killed"):
        finetune_in_process([*common, f"out_dir={tmp_path / 'cut'}"])
    member = tmp_path / "cut" / "lr0.001-seed1"
    assert [s for s, _ in list_checkpoints(str(member))] == [20]
    monkeypatch.setattr(FineTune, "train_step", real_step)
    resumed = finetune_in_process([*common, f"out_dir={tmp_path / 'cut'}"])
    a, b = _weights(tmp_path / "whole" / "lr0.001-seed1" / "model"), _weights(member / "model")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["metrics"] == whole["metrics"]
    records = [json.loads(line) for line in (member / "metrics.jsonl").open()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 97))  # steps 21-25 of the cut run were logged once
    assert records[-1]["accuracy"] == whole["metrics"]["accuracy"]
    assert not os.path.exists(member / "checkpoints")  # finished: resume state removed


def test_layer_lr_decay_gives_each_layer_its_rate(run, tasks, tmp_path, monkeypatch, one_thread):
    """recipe.layer_lr_decay=0.5: at every step the head (pooler, classifier) takes the
    scheduled rate, encoder layer i of L the rate x 0.5^(L - i), the embeddings 0.5^(L + 1);
    and the embeddings move less than with one rate."""
    from bert_pretrain.finetune.runner import FineTune

    seen = []
    real_step = FineTune.train_step

    def recording_step(self):
        out = real_step(self)
        rates = {id(p): g["lr"] for g in self.optimizer.param_groups for p in g["params"]}
        seen.append((self.current_lr, {n: rates[id(p)]
                                       for n, p in self.raw_model.named_parameters()}))
        return out

    monkeypatch.setattr(FineTune, "train_step", recording_step)
    common = [*tasks["sentence"], f"model={run}", *FAST, "recipe.epochs=1",
              "trainer.save_model=all"]
    finetune_in_process([*common, "recipe.layer_lr_decay=0.5", f"out_dir={tmp_path / 'd'}"])
    layers = {int(n.split(".")[3]) for n in seen[0][1] if n.startswith("bert.encoder.layer.")}
    L = len(layers)
    assert L >= 2 and layers == set(range(L))

    def exponent(name):
        if name.startswith("bert.embeddings."):
            return L + 1
        if name.startswith("bert.encoder.layer."):
            return L - int(name.split(".")[3])
        assert name.startswith(("bert.pooler.", "classifier.")), name
        return 0

    assert len(seen) > 3 and any(lr > 0 for lr, _ in seen)
    for lr, rates in seen:
        for name, rate in rates.items():
            assert rate == pytest.approx(lr * 0.5 ** exponent(name), rel=1e-12, abs=0), name
    seen.clear()
    finetune_in_process([*common, f"out_dir={tmp_path / 'one'}"])
    assert all(set(rates.values()) == {lr} for lr, rates in seen)
    before = load_pretrained_weights(run)["bert.embeddings.word_embeddings.weight"]
    moved = {d: (_weights(tmp_path / d / "lr0.001-seed1" / "model")
                 ["bert.embeddings.word_embeddings.weight"] - before).norm().item()
             for d in ("d", "one")}
    assert 0 < moved["d"] < 0.5 * moved["one"], moved


def load_pretrained_weights(run) -> dict:
    from bert_pretrain.finetune.pretrained import load_pretrained

    return load_pretrained(run).encoder_state


def test_a_fine_tune_resume_restores_the_global_random_state(run, tasks, tmp_path, monkeypatch,
                                                             one_thread):
    """The test above passes even when a resume skips restoring the RNG state, because every
    step re-seeds (unseeded_steps.py); here the steps after the resume draw their dropout masks
    from the stream the step-10 checkpoint saved."""
    from bert_pretrain.finetune.runner import FineTune

    without_reseed(monkeypatch, FineTune)
    common = [*tasks["pair"], f"model={run}", *FAST, "recipe.dropout=0.1", "recipe.epochs=1",
              "trainer.checkpoint_every=10"]
    finetune_in_process([*common, f"out_dir={tmp_path / 'whole'}"])
    real_step = kill_fine_tune_at(monkeypatch, 12)
    with pytest.raises(RuntimeError, match="killed"):
        finetune_in_process([*common, f"out_dir={tmp_path / 'cut'}"])
    monkeypatch.setattr(FineTune, "train_step", real_step)
    finetune_in_process([*common, f"out_dir={tmp_path / 'cut'}"])

    def losses(out):
        path = out / "lr0.001-seed1" / "metrics.jsonl"
        return {r["step"]: r["loss"] for r in map(json.loads, path.open()) if "loss" in r}

    whole, resumed = losses(tmp_path / "whole"), losses(tmp_path / "cut")
    assert sorted(resumed) == sorted(whole) and len(whole) > 11
    for step in whole:
        assert whole[step] == resumed[step], f"step {step}: {whole[step]} != {resumed[step]}"


def test_export_loads_in_transformers_with_the_same_logits(run, tasks, tmp_path, one_thread):
    transformers = pytest.importorskip("transformers")
    from bert_pretrain.finetune.export import load_classifier

    finetune_in_process([*tasks["pair"], f"model={run}", *FAST, "recipe.epochs=1",
                         f"out_dir={tmp_path}"])
    model_dir = str(tmp_path / "model")
    theirs = transformers.BertForSequenceClassification.from_pretrained(model_dir).eval()
    assert theirs.config.id2label == {0: "other", 1: "first"}
    assert theirs.config.problem_type == "single_label_classification"
    ours = load_classifier(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(["w0 w3 w5", "w7 w8"], ["w1 w2", "w0 w4 w6 w9"], padding=True,
                      return_tensors="pt")
    with torch.no_grad():
        a = ours(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).logits
        b = theirs(**batch).logits
        auto = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
        c = auto(**batch).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c, b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[0], a[1])  # the fine-tuned head tells the two apart


def test_a_glue_classifier_says_glues_label_names_in_transformers(run, tmp_path, one_thread):
    """SST-2's TSV files write its labels as 0 / 1: the kept model still says negative /
    positive (the hub's names), not LABEL_0 / LABEL_1, in config.json and in a pipeline."""
    transformers = pytest.importorskip("transformers")
    from finetune_support import write_glue_task

    folder = write_glue_task(str(tmp_path / "glue"), "sst2", n_train=64, n_dev=16)
    finetune_in_process(["task=sst2", f"data_dir={folder}", f"model={run}", *FAST,
                         "recipe.epochs=1", f"out_dir={tmp_path / 'out'}"])
    model_dir = str(tmp_path / "out" / "model")
    config = json.loads(open(os.path.join(model_dir, "config.json")).read())
    assert config["id2label"] == {"0": "negative", "1": "positive"}
    assert config["label2id"] == {"negative": 0, "positive": 1}
    classify = transformers.pipeline("text-classification", model=model_dir)
    assert {r["label"] for r in classify(["w0 w3 w5", "w7 w8"])} <= {"negative", "positive"}


def test_regression_exports_as_regression(run, tmp_path, one_thread):
    transformers = pytest.importorskip("transformers")
    from finetune_support import sentence_examples, write_csv

    rows = [(s, 0.5 + 3.0 * y) for s, y in sentence_examples(64, 5)]
    train = write_csv(str(tmp_path / "train.tsv"), ["text", "score"], rows, delimiter="\t")
    summary = finetune_in_process(
        ["task=custom", f"task.train_file={train}", f"task.validation_file={train}",
         "task.text_columns=[text]", "task.label_column=score", "task.num_labels=1",
         f"model={run}", *FAST, "recipe.epochs=2", f"out_dir={tmp_path / 'out'}"])
    assert set(summary["metrics"]) == {"pearson", "spearman"}
    theirs = transformers.BertForSequenceClassification.from_pretrained(
        str(tmp_path / "out" / "model"))
    assert theirs.config.num_labels == 1 and theirs.config.problem_type == "regression"


def _launch(args: list, processes: int) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": CHILD_PYTHONPATH}
    if processes == 1:
        cmd = [sys.executable, "-m", "bert_pretrain.finetune", *args]
    else:
        from test_distributed import free_port

        port = free_port()
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               ACCELERATE_CONFIG, "--num_processes", str(processes), "--main_process_port",
               str(port), "-m", "bert_pretrain.finetune", *args]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def test_two_processes_equal_one(run, tasks, tmp_path):
    """2 processes x micro-batch 8 against 1 process x 2 micro-batches of 8: the same global
    batches, dropout masks and losses, so the same fine-tuned weights and dev predictions."""
    common = [*tasks["pair"], f"model={run}", *FAST, "recipe.dropout=0.1", "recipe.epochs=2",
              "trainer.save_model=all", "trainer.micro_batch_size=8"]
    _launch([*common, f"out_dir={tmp_path / 'one'}"], 1)
    _launch([*common, f"out_dir={tmp_path / 'two'}"], 2)
    member = "lr0.001-seed1"
    one, two = (json.loads((tmp_path / d / member / "result.json").read_text())
                for d in ("one", "two"))
    assert (one["processes"], two["processes"]) == (1, 2)
    for key in one["metrics"]:
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], abs=1e-9)
    a, b = _weights(tmp_path / "one" / member / "model"), _weights(tmp_path / "two" / member /
                                                                    "model")
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4, msg=key)
    losses = [[json.loads(line).get("loss") for line in (tmp_path / d / member /
                                                          "metrics.jsonl").open()]
              for d in ("one", "two")]
    assert len(losses[0]) == len(losses[1])  # one writer
    for x, y in zip(*losses):
        assert (x is None and y is None) or abs(x - y) < 1e-5



def test_processes_with_other_settings_stop_at_start_up_in_one_line(run, tasks, tmp_path):
    """Two fine-tune processes started by hand (as a launcher would), process 1 with another
    learning-rate grid: both stop at start-up, exit status 2, and rank 0 names the difference
    (bert-train's check, run_setup.check_same_settings); nothing is written."""
    from test_distributed import free_port
    from train_support import run_all

    port, out = free_port(), tmp_path / "out"
    r0, r1 = run_all([(
        [sys.executable, "-m", "bert_pretrain.finetune", *tasks["pair"], f"model={run}", *FAST,
         "trainer.cpu=true", f"out_dir={out}", *(["recipe.lrs=[2e-3]"] if rank else [])],
        {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": CHILD_PYTHONPATH,
         "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": str(port)}) for rank in (0, 1)])
    assert (r0.returncode, r1.returncode) == (2, 2), r0.stderr + r1.stderr
    assert [line for line in r0.stderr.splitlines() if "error" in line] == [
        "bert-finetune: error: rank 1 runs other settings than rank 0: recipe.lrs: [0.002] there, "
        "[0.001] on rank 0; every process of a job must run the same bert-finetune command (the "
        "same overrides, config files and prepared data on every machine)"], r0.stderr
    assert "error" not in r1.stderr and not out.exists(), r1.stderr


def test_pre_ln_relative_position_encoder_fine_tunes(tasks, tmp_path, one_thread):
    """Our encoder, so the architectures transformers cannot compute fine-tune too; their kept
    model has no config.json (nothing would load it as another model) and reloads as ours."""
    from bert_pretrain.finetune.export import load_classifier
    from train_support import train_in_process, write_prepared

    prepared = write_prepared(str(tmp_path / "prep"), num_train=64, num_valid=8)
    run_dir = str(tmp_path / "run")
    train_in_process(["experiment=smoke", f"data.dir={prepared}", f"run_dir={run_dir}",
                      "trainer.max_steps=20", "trainer.eval_every=0", "model.pre_layer_norm=true",
                      "model.position_embedding_type=relative_key"])
    summary = finetune_in_process([*tasks["sentence"], f"model={run_dir}", *FAST,
                                   f"out_dir={tmp_path / 'out'}"])
    assert summary["metrics"]["accuracy"] >= 0.8, summary["metrics"]
    model_dir = tmp_path / "out" / "model"
    assert not (model_dir / "config.json").exists()
    model = load_classifier(str(model_dir))
    assert model.config.pre_layer_norm and model.config.position_embedding_type == "relative_key"


# bert-finetune (or bert-glue: sys.argv[1]) pressed Ctrl-C twice in its third step: the first
# asks it to save at the end of the step, the second stops it at once.
CTRL_C_TWICE = """
import os, signal, sys
from bert_pretrain.finetune.runner import FineTune

real = FineTune.train_step

def train_step(self):
    if self.step == 2:
        os.kill(os.getpid(), signal.SIGINT)  # (its handler runs here, before the next line)
        os.kill(os.getpid(), signal.SIGINT)
    return real(self)

FineTune.train_step = train_step
prog, sys.argv = sys.argv[1], sys.argv[1:]
if prog == "bert-glue":
    from bert_pretrain.finetune.glue import main
else:
    from bert_pretrain.finetune.cli import main
main()
"""


@pytest.mark.parametrize("prog", ["bert-finetune", "bert-glue"])
def test_a_second_ctrl_c_stops_at_once_in_one_line(run, tasks, tmp_path, prog):
    """Not Python's traceback of wherever the interrupt landed: one line saying how to go on,
    exit 130 as a shell reports a Ctrl-C'd command; the same command then finishes."""
    from finetune_support import write_glue_task

    if prog == "bert-glue":
        write_glue_task(str(tmp_path / "glue_data"), "sst2")
        args = [f"models=[{run}]", "tasks=[sst2]", f"data_dir={tmp_path / 'glue_data'}"]
    else:
        args = [*tasks["sentence"], f"model={run}"]
    args += [*FAST, f"out_dir={tmp_path / 'out'}", "trainer.checkpoint_every=2"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": CHILD_PYTHONPATH}
    r = subprocess.run([sys.executable, "-c", CTRL_C_TWICE, prog, *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=hang_limit())
    assert r.returncode == 130, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == (
        f"{prog}: interrupted; run the same command again to continue from the last "
        f"checkpoint (one Ctrl-C during training saves the step first)")
    again = subprocess.run([sys.executable, "-m", "bert_pretrain.finetune" if
                            prog == "bert-finetune" else "bert_pretrain.finetune.glue", *args],
                           cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=hang_limit())
    assert again.returncode == 0, again.stderr[-3000:]


# bert-finetune or bert-glue (sys.argv[1]) as one process of a group, SIGKILLed in its fourth
# step when it is rank 1 (a machine lost mid-fine-tune).
RANK_1_DIES = CTRL_C_TWICE.replace("""    if self.step == 2:
        os.kill(os.getpid(), signal.SIGINT)  # (its handler runs here, before the next line)
        os.kill(os.getpid(), signal.SIGINT)
""", """    if self.step == 3 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("prog", ["bert-finetune", "bert-glue"])
def test_a_lost_process_ends_the_others_in_one_line_and_the_rerun_continues(run, tasks, tmp_path,
                                                                           prog):
    """Rank 1 dies in step 4 of a 2-process fine-tune: rank 0 ends in one line naming the loss
    and how to go on, exit 1 (not gloo's traceback, not a user error's 2); the same command run
    again continues from the checkpoint of step 2 and ends with the scores of a fine-tune that
    was never interrupted."""
    from finetune_support import write_glue_task
    from test_distributed import free_port
    from train_support import run_all

    if prog == "bert-glue":
        write_glue_task(str(tmp_path / "glue_data"), "sst2")
        args = [f"models=[{run}]", "tasks=[sst2]", f"data_dir={tmp_path / 'glue_data'}"]
    else:
        args = [*tasks["sentence"], f"model={run}"]
    args += [*FAST, "trainer.cpu=true", "trainer.checkpoint_every=2"]

    def group(script, out):
        port = free_port()
        return run_all([(
            [sys.executable, *script, *args, f"out_dir={out}"],
            {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
             "PYTHONPATH": CHILD_PYTHONPATH, "WORLD_SIZE": "2", "RANK": str(rank),
             "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for rank in (0, 1)])

    module = ["-m", "bert_pretrain.finetune" if prog == "bert-finetune"
              else "bert_pretrain.finetune.glue"]
    r0, r1 = group(["-c", RANK_1_DIES, prog], tmp_path / "out")
    assert (r0.returncode, r1.returncode) == (1, -9), r0.stderr[-3000:]
    assert "Traceback" not in r0.stderr, r0.stderr[-3000:]
    line = r0.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{prog}: error: [rank 0] lost the other processes (") and line.endswith(
        "Run the same command again once that is fixed: finished fine-tunes are kept and the one "
        "under way continues from its last checkpoint"), line
    again = group(module, tmp_path / "out")
    assert [r.returncode for r in again] == [0, 0], again[0].stderr[-3000:]
    assert "bert-finetune: note: lr 0.001 seed 1 continues from its checkpoint of step 2 (" in \
        again[0].stdout, again[0].stdout
    assert all(r.returncode == 0 for r in group(module, tmp_path / "whole"))

    def scores(out):
        found = sorted(out.rglob("result.json"))
        assert found, list(out.rglob("*"))
        return [json.loads(f.read_text())["metrics"] for f in found]

    assert scores(tmp_path / "out") == scores(tmp_path / "whole")


def test_a_process_alone_stops_in_one_line_after_the_timeout(run, tasks, tmp_path):
    """Process 0 of 2 started by hand with no process 1: one line after
    trainer.process_group_timeout_s (bert-train's join), not accelerate's traceback after
    torch's 30 minutes; nothing written."""
    from test_distributed import free_port

    port = free_port()
    r = subprocess.run(
        [sys.executable, "-m", "bert_pretrain.finetune", *tasks["sentence"], f"model={run}",
         *FAST, "trainer.cpu=true", "trainer.process_group_timeout_s=2",
         f"out_dir={tmp_path / 'out'}"],
        cwd=REPO, capture_output=True, text=True, timeout=hang_limit(),
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": CHILD_PYTHONPATH,
             "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stdout + r.stderr
    assert lines[0].startswith(f"bert-finetune: error: process 0 of 2 could not join the others "
                               f"at 127.0.0.1:{port} within trainer.process_group_timeout_s=2 (")
    assert not (tmp_path / "out").exists()


def test_a_hung_process_ends_the_others_in_one_line_after_the_timeout(run, tasks, tmp_path):
    """Rank 1 stops (SIGSTOP) in step 4: rank 0 waits trainer.process_group_timeout_s at the
    step's all-reduce, then ends in the lost-peer line, exit 1."""
    from test_distributed import free_port
    from train_support import await_one_of

    port = free_port()
    procs, out, err = await_one_of([(
        [sys.executable, "-c", RANK_1_DIES.replace("SIGKILL", "SIGSTOP"), "bert-finetune",
         *tasks["sentence"], f"model={run}", *FAST, "trainer.cpu=true",
         "trainer.process_group_timeout_s=3", f"out_dir={tmp_path / 'out'}"],
        {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
         "PYTHONPATH": CHILD_PYTHONPATH, "WORLD_SIZE": "2", "RANK": str(rank),
         "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        for rank in (0, 1)], awaited=0)
    assert procs[0].returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("bert-finetune: error: [rank 0] lost the other processes (") and \
        "Timed out" in line, line


FINISHES = """
import atexit, sys
atexit.register(lambda: print("interpreter teardown ran", flush=True))
prog, sys.argv = sys.argv[1], sys.argv[1:]
if prog == "bert-glue":
    from bert_pretrain.finetune.glue import main
else:
    from bert_pretrain.finetune.cli import main
main()
"""


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("prog", ["bert-finetune", "bert-glue"])
def test_a_finished_process_of_a_group_leaves_without_interpreter_teardown(run, tasks, tmp_path,
                                                                          prog, processes):
    """Each process of a finished 2-process fine-tune exits 0 without the teardown in which
    gloo's threads aborted rank 1 of 20 such runs (SIGABRT: the launcher reported a crash after
    every result was written); one process alone keeps its normal exit."""
    from finetune_support import write_glue_task
    from test_distributed import free_port
    from train_support import run_all

    if prog == "bert-glue":
        write_glue_task(str(tmp_path / "glue_data"), "sst2")
        args = [f"models=[{run}]", "tasks=[sst2]", f"data_dir={tmp_path / 'glue_data'}"]
    else:
        args = [*tasks["sentence"], f"model={run}"]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": CHILD_PYTHONPATH}
    group = {"WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    results = run_all([(
        [sys.executable, "-c", FINISHES, prog, *args, *FAST, "recipe.epochs=1",
         "trainer.cpu=true", f"out_dir={tmp_path / 'out'}"],
        {**env, **group, "RANK": str(rank), "LOCAL_RANK": str(rank)} if processes > 1 else env)
        for rank in range(processes)])
    assert [r.returncode for r in results] == [0] * processes, results[0].stderr[-3000:]
    assert all(("interpreter teardown ran" in r.stdout) is (processes == 1) for r in results)
    assert list((tmp_path / "out").rglob("result.json"))
