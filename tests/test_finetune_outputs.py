"""What bert-finetune leaves on disk is what it says: the kept model is the fine-tuned one (not
the pretrained directory it came from, and no file a link pointed to), it is the run that the
summary reports as the median, a result is reused only for the settings it was made with and
others are written beside it; the grid's summary is the median over seeds at the best rate."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from finetune_support import FAST, finetune_in_process, pretrained_run, sentence_task
from time_limits import hang_limit


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return pretrained_run(str(tmp_path_factory.mktemp("pretrained")))


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return sentence_task(str(tmp_path_factory.mktemp("task")), n_train=128, n_dev=64)


def _weights(directory) -> dict:
    return load_file(os.path.join(str(directory), "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- the kept model


@pytest.mark.parametrize("head", ["pretraining", "encoder"])
def test_a_fine_tune_of_an_export_keeps_the_fine_tuned_model_and_no_linked_file(
        head, run, task, tmp_path, capsys, one_thread):
    """The export directory is the model and its tokenizer: only the tokenizer's files are
    copied next to the fine-tuned weights, and a link among them (here to a private file) is
    left out, said in one warning line, never copied as a regular file."""
    transformers = pytest.importorskip("transformers")
    from bert_pretrain.tools.export import export
    from bert_pretrain.finetune.export import load_classifier

    exported = tmp_path / "exported"
    export(run, str(exported), head=head)
    secret = tmp_path / "private"
    secret.write_text("PRIVATE\n")
    link = exported / "special_tokens_map.json"
    if link.exists():
        link.unlink()
    os.symlink(secret, link)
    finetune_in_process([*task, f"model={exported}", *FAST, "recipe.epochs=1",
                         f"out_dir={tmp_path / 'out'}"])
    model_dir = tmp_path / "out" / "model"
    theirs, info = transformers.BertForSequenceClassification.from_pretrained(
        str(model_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = load_classifier(str(model_dir))
    kept, pretrained = _weights(model_dir), _weights(exported)
    assert "classifier.weight" in kept
    word = "bert.embeddings.word_embeddings.weight" if head != "encoder" else \
        "embeddings.word_embeddings.weight"
    assert not torch.equal(kept["bert.embeddings.word_embeddings.weight"], pretrained[word])
    ids = torch.tensor([[2, 5, 6, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(input_ids=ids).logits,
                                   ours(ids, torch.ones_like(ids)).logits, atol=1e-5, rtol=1e-5)
    said = capsys.readouterr()
    assert "special_tokens_map.json is a symbolic link: not copied" in said.out + said.err
    for name in os.listdir(model_dir):
        assert not os.path.islink(model_dir / name)
        assert b"PRIVATE" not in (model_dir / name).read_bytes(), name
    assert "special_tokens_map.json" not in os.listdir(model_dir)
    assert transformers.AutoTokenizer.from_pretrained(str(model_dir))("w0 w1")["input_ids"][0] \
        == 2  # the tokenizer shipped with it ([CLS])


def test_the_kept_model_is_the_reported_median_after_a_rerun_with_other_seeds(run, task,
                                                                             tmp_path,
                                                                             one_thread):
    """Seeds [1, 2, 3], then the same out_dir with the two seeds that were not the median: the
    summary now names another median run, and model/ must be that run's model."""
    from bert_pretrain.finetune.grid import median_run

    common = [*task, f"model={run}", *FAST, "recipe.epochs=1", "recipe.lrs=[3e-4]"]
    out = tmp_path / "out"
    first = finetune_in_process([*common, "recipe.seeds=[1,2,3]", f"out_dir={out}"])
    dropped = median_run(first)["seed"]
    first_kept = _weights(out / "model")
    seeds = [s for s in (1, 2, 3) if s != dropped]
    again = finetune_in_process([*common, f"recipe.seeds=[{seeds[0]},{seeds[1]}]",
                                 f"out_dir={out}"])
    median = median_run(again)["seed"]
    assert again["model_dir"] == str(out / "model")
    assert not _same(_weights(out / "model"), first_kept)  # the kept model is a new seed's
    alone = finetune_in_process([*common, f"recipe.seeds=[{median}]",
                                 f"out_dir={tmp_path / 'alone'}"])
    assert _same(_weights(out / "model"), _weights(alone["model_dir"]))
    record = json.loads((out / "model" / "classifier.json").read_text())
    assert (record["lr"], record["seed"]) == (3e-4, median)
    # the model the first grid kept is not lost: it is back in its own run's folder
    assert _same(_weights(out / f"lr0.0003-seed{dropped}" / "model"), first_kept)


def test_other_settings_are_written_beside_and_the_same_settings_reuse(run, task, tmp_path,
                                                                      capsys, monkeypatch,
                                                                      one_thread):
    from bert_pretrain.finetune.runner import FineTune

    base = [*task, f"model={run}", *FAST, "recipe.epochs=1", f"out_dir={tmp_path / 'out'}"]
    first = finetune_in_process(base)
    before = {name: (tmp_path / "out" / name).stat().st_mtime_ns
              for name in ("finetune.json", "model")}
    other = finetune_in_process([*base, "recipe.max_length=24"])
    out = capsys.readouterr().out
    assert other["out_dir"] == str(tmp_path / "out-2")
    assert f"{tmp_path / 'out'} holds a fine-tune with other settings (recipe differ)" in out
    assert other["recipe"]["max_length"] == 24 and first["recipe"]["max_length"] == 32
    assert {name: (tmp_path / "out" / name).stat().st_mtime_ns for name in before} == before

    def no_training(self):
        raise AssertionError("a finished fine-tune was trained again")

    monkeypatch.setattr(FineTune, "train_step", no_training)
    assert finetune_in_process(base)["grid"] == first["grid"]
    assert finetune_in_process([*base, "recipe.max_length=24"])["out_dir"] == \
        str(tmp_path / "out-2")
    # an option's default is what results before the option were of: read back, not redone
    assert finetune_in_process([*base, "recipe.layer_lr_decay=1.0"])["grid"] == first["grid"]
    assert finetune_in_process([*base, "recipe.reinit_layers=0"])["grid"] == first["grid"]
    # another precision rounds its own way: not the fp32 results read back under its name
    monkeypatch.undo()
    bf16 = finetune_in_process([*base, "trainer.mixed_precision=bf16"])
    assert bf16["out_dir"] == str(tmp_path / "out-3") and bf16["precision"] == "bf16"
    assert "(precision differ)" in capsys.readouterr().out


def test_reinit_layers_reaches_the_pretrained_model_only_and_is_part_of_the_results(
        run, task, tmp_path, monkeypatch, one_thread):
    """recipe.reinit_layers=1: the pretrained classifier has its top layer re-initialised before
    the first step (the random-init control has nothing to re-initialise), and its results are
    not those of the recipe without it (written beside them)."""
    from bert_pretrain.model import BertForSequenceClassification

    calls = []
    real = BertForSequenceClassification.reinit_top_layers

    def recording(self, n):
        before = {k: v.clone() for k, v in self.bert.encoder.layer[-1].state_dict().items()}
        real(self, n)
        after = self.bert.encoder.layer[-1].state_dict()
        calls.append((n, any(not torch.equal(before[k], after[k]) for k in before)))

    monkeypatch.setattr(BertForSequenceClassification, "reinit_top_layers", recording)
    base = [*task, f"model={run}", *FAST, "recipe.epochs=1", f"out_dir={tmp_path / 'out'}"]
    plain = finetune_in_process(base)
    assert calls == [(0, False)]
    calls.clear()
    fresh = finetune_in_process([*base, "recipe.reinit_layers=1"])
    assert calls == [(1, True)]
    assert fresh["out_dir"] == str(tmp_path / "out-2")
    # (not the scores: two tiny models can both score the same on a small dev set)
    a, b = _weights(plain["model_dir"]), _weights(fresh["model_dir"])
    top = "bert.encoder.layer.1.output.dense.weight"
    assert top in a and not torch.allclose(a[top], b[top], atol=1e-3)
    calls.clear()
    finetune_in_process([*base, "init=random", "recipe.reinit_layers=1",
                         f"out_dir={tmp_path / 'random'}"])
    assert calls == []


def test_a_mean_pooled_model_is_kept_for_this_project_only(run, task, tmp_path, capsys,
                                                           one_thread):
    """recipe.pooling=mean: its results are not the cls head's (written beside them; the cls
    identity is what it was before the option), and its model has no config.json that
    transformers would read as a [CLS] classifier: hf_config refuses it in one line, and
    load_classifier rebuilds the mean head that scored what the grid reported."""
    from bert_pretrain.errors import UserError
    from bert_pretrain.finetune.export import hf_config, load_classifier
    from bert_pretrain.finetune.pretrained import load_pretrained
    from bert_pretrain.finetune.reading import read_task
    from bert_pretrain.finetune.tasks import TaskConfig

    base = [*task, f"model={run}", *FAST, "recipe.epochs=1", f"out_dir={tmp_path / 'out'}"]
    finetune_in_process(base)
    assert "pooling" not in json.loads((tmp_path / "out" / "identity.json").read_text())["recipe"]
    mean = finetune_in_process([*base, "recipe.pooling=mean"])
    assert mean["out_dir"] == str(tmp_path / "out-2")
    assert "holds a fine-tune with other settings (recipe differ)" in capsys.readouterr().out
    model_dir = tmp_path / "out-2" / "model"
    assert "config.json" not in os.listdir(model_dir)
    model = load_classifier(str(model_dir))
    assert model.pooling == "mean" and model.bert.pooler is None
    with pytest.raises(UserError, match=r"^a mean-pooled classifier \(recipe.pooling=mean\) has "
                                        r"no transformers equivalent"):
        hf_config(model, SimpleNamespace(label_names=None, name="custom", title="T"))
    cfg = {o.split("=", 1)[0].split(".")[-1]: o.split("=", 1)[1] for o in task[1:]}
    dev = read_task(TaskConfig(name="custom", train_file=cfg["train_file"],
                               validation_file=cfg["validation_file"], text_columns=["text"]))
    tokenizer = load_pretrained(run).tokenizer()
    with torch.no_grad():
        right = [model(torch.tensor([tokenizer.encode(t).ids])).logits.argmax(-1).item() == y
                 for t, y in zip(dev.evals[""].text_a, dev.evals[""].labels)]
    assert sum(right) / len(right) == pytest.approx(mean["metrics"]["accuracy"])


# --------------------------------------------------------------------------- the summary


def _summary(lrs, scores: dict) -> dict:
    """summarize() over hand-made results: scores = {lr: [score of seed 1, 2, ...]}."""
    from bert_pretrain.finetune.grid import summarize

    from bert_pretrain.finetune.config import RecipeConfig

    seeds = list(range(1, len(next(iter(scores.values()))) + 1))
    settings = SimpleNamespace(recipe=RecipeConfig(lrs=lrs, seeds=seeds), model="m",
                               init="pretrained")
    job = SimpleNamespace(settings=settings, data=SimpleNamespace(name="sst2", title="SST-2",
                                                                  source="s"),
                          pretrained=SimpleNamespace(source="ckpt"), train=[0] * 10,
                          evals={"": [0] * 4}, identity={})
    results = [{"lr": lr, "seed": seed, "metrics": {"accuracy": s, "f1": s}, "score": s,
                "steps": 3, "train_seconds": 1.0} if s is not None else
               {"lr": lr, "seed": seed, "diverged": "non-finite"}  # (None: that run diverged)
               for lr in lrs for seed, s in zip(seeds, scores[lr])]
    return summarize(job, results, "out", 1.0, SimpleNamespace(precision="no", world=1))


def test_the_grid_reports_the_median_over_seeds_not_the_mean():
    summary = _summary([1e-5], {1e-5: [0.9, 0.0, 0.6]})  # median 0.6, mean 0.5
    assert summary["score"] == pytest.approx(0.6)
    assert summary["metrics"] == pytest.approx({"accuracy": 0.6, "f1": 0.6})
    assert summary["score_range"] == [0.0, 0.9]


def test_the_best_rate_is_the_one_with_the_highest_median():
    summary = _summary([1e-5, 3e-5, 5e-5], {1e-5: [0.5, 0.6, 0.7], 3e-5: [0.8, 0.9, 0.1],
                                            5e-5: [0.2, 0.3, 0.4]})
    assert summary["best_lr"] == 3e-5 and summary["score"] == pytest.approx(0.8)
    assert [g["score"] for g in summary["grid"]] == pytest.approx([0.6, 0.8, 0.3])


def test_a_rate_that_diverged_in_a_seed_is_listed_and_never_the_best():
    """A diverged run is no score: its rate's row says which seeds diverged and the medians
    are of the others, and that rate is not recommended even where its other seeds scored
    highest; when every rate diverged somewhere there is nothing to recommend."""
    from bert_pretrain.errors import TrainingError

    summary = _summary([1e-5, 3e-5, 1e-4], {1e-5: [0.5, 0.6, 0.7], 3e-5: [0.9, None, 0.8],
                                            1e-4: [None, None, None]})
    assert summary["best_lr"] == 1e-5 and summary["score"] == pytest.approx(0.6)
    high, gone = summary["grid"][1], summary["grid"][2]
    assert high["diverged_seeds"] == [2] and high["score"] == pytest.approx(0.85)
    assert [r["seed"] for r in high["runs"]] == [1, 3] and high["score_range"] == [0.8, 0.9]
    assert gone["diverged_seeds"] == [1, 2, 3] and gone["score"] is None and gone["runs"] == []
    assert "diverged_seeds" not in summary["grid"][0]
    assert summary["train_seconds"] == 5.0  # the five runs that finished
    with pytest.raises(TrainingError, match=r"^every lr of the grid diverged in at least one "
                       r"seed \(lr 1e-05: seed\(s\) 2; lr 3e-05: seed\(s\) 1, 3\): no rate "):
        _summary([1e-5, 3e-5], {1e-5: [0.5, None, 0.7], 3e-5: [None, 0.9, None]})


def test_an_even_number_of_seeds_reports_the_middle_two_and_keeps_the_lower():
    from bert_pretrain.finetune.grid import median_run

    summary = _summary([1e-5], {1e-5: [0.9, 0.2, 0.6, 0.4]})
    assert summary["score"] == pytest.approx(0.5)  # (0.4 + 0.6) / 2
    assert median_run(summary)["seed"] == 4        # the lower of the middle two: 0.4
    three = _summary([1e-5], {1e-5: [0.9, 0.2, 0.6]})
    assert median_run(three)["seed"] == 3


# --------------------------------------------------------------------------- what a folder holds


def test_claim_reuses_only_the_same_identity_and_writes_others_beside(tmp_path):
    from bert_pretrain.finetune.identity import IDENTITY_FILE, claim, holds, read_identity

    said = []
    base = str(tmp_path / "out")
    a, b = {"recipe": {"lr": 1}, "task": "x"}, {"recipe": {"lr": 2}, "task": "x"}
    assert claim(base, a, "a fine-tune", said.append) == base and holds(base, a)
    assert claim(base, a, "a fine-tune", said.append) == base and said == []
    assert claim(base, b, "a fine-tune", said.append) == base + "-2"
    assert said == [f"{base} holds a fine-tune with other settings (recipe differ); writing to "
                    f"{base}-2"]
    assert read_identity(base) == a and read_identity(base + "-2") == b  # neither overwritten
    assert claim(base, b) == base + "-2" and claim(base, a) == base
    # a folder of something else (no identity recorded) is never taken; an empty one, or one
    # with only Hydra's record of the command in it, is
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine\n")
    assert claim(str(tmp_path / "mine"), a, "a fine-tune", said.append) == \
        str(tmp_path / "mine-2")
    assert said[-1].endswith(f"holds other files (no {IDENTITY_FILE}); writing to "
                             f"{tmp_path / 'mine-2'}")
    assert sorted(os.listdir(tmp_path / "mine")) == ["notes.txt"]
    (tmp_path / "hydra" / ".hydra").mkdir(parents=True)
    assert claim(str(tmp_path / "hydra"), a) == str(tmp_path / "hydra")
    (tmp_path / "killed").mkdir()  # an identity.json whose writing was killed: nothing held
    (tmp_path / "killed" / f"{IDENTITY_FILE}.tmp-4242").write_text("{")
    assert claim(str(tmp_path / "killed"), a) == str(tmp_path / "killed")


def test_the_one_copy_every_export_makes_takes_regular_files_only(tmp_path):
    from bert_pretrain.components import checkpoint as ckpt

    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    (src / "vocab.txt").write_text("[PAD]\n")
    (tmp_path / "private").write_text("PRIVATE\n")
    os.symlink(tmp_path / "private", src / "tokenizer.json")
    (src / "added_tokens.json").mkdir()
    names = ["vocab.txt", "tokenizer.json", "added_tokens.json", "special_tokens_map.json"]
    assert ckpt.own_files(str(src), names) == (["vocab.txt"],
                                                ["tokenizer.json", "added_tokens.json"])
    assert ckpt.copy_own_files(str(src), names, str(dest)) == ["vocab.txt"]
    assert sorted(os.listdir(dest)) == ["vocab.txt"]
    assert "tokenizer.json is a symbolic link: not copied" in \
        ckpt.refusal(str(src), "tokenizer.json")
    with pytest.raises(FileExistsError):  # never over a file already there
        ckpt.copy_own_files(str(src), ["vocab.txt"], str(dest))


def test_a_hub_cache_snapshot_ships_its_own_files_through_their_links(tmp_path):
    """A downloaded model's snapshot folder holds only links into its repository's blobs/:
    those are its own files and are copied; a link out of the repository still is not."""
    from bert_pretrain.components import checkpoint as ckpt

    repo = tmp_path / "hub" / "models--org--bert"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "f00d").write_text("[PAD]\n[UNK]\n")
    os.symlink("../../blobs/f00d", snapshot / "vocab.txt")
    (tmp_path / "private").write_text("PRIVATE\n")
    os.symlink(tmp_path / "private", snapshot / "special_tokens_map.json")
    names = ["vocab.txt", "special_tokens_map.json"]
    assert ckpt.own_files(str(snapshot), names) == (["vocab.txt"], ["special_tokens_map.json"])
    dest = tmp_path / "dest"
    dest.mkdir()
    assert ckpt.copy_own_files(str(snapshot), names, str(dest)) == ["vocab.txt"]
    assert (dest / "vocab.txt").read_text() == "[PAD]\n[UNK]\n"
    assert not (dest / "vocab.txt").is_symlink()
    # a link that stays inside an ordinary folder is that folder's file too
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "v.txt").write_text("x\n")
    os.symlink("v.txt", tmp_path / "plain" / "vocab.txt")
    assert ckpt.own_files(str(tmp_path / "plain"), ["vocab.txt"]) == (["vocab.txt"], [])


def test_a_model_whose_tokenizer_is_all_links_out_is_refused_in_one_line(run, tmp_path):
    """Fine-tuned through its links, what it ships would have no tokenizer: refused up front."""
    from bert_pretrain.errors import CheckpointError
    from bert_pretrain.tools.export import export
    from bert_pretrain.tools.model_loading import load_model

    exported = tmp_path / "exported"
    export(run, str(exported))
    for name in ("vocab.txt", "tokenizer.json"):
        if (exported / name).exists():
            moved = tmp_path / f"elsewhere-{name}"
            (exported / name).rename(moved)
            os.symlink(moved, exported / name)
    with pytest.raises(CheckpointError, match="no tokenizer file of .* is its own"):
        load_model(str(exported))


def _scores(summary) -> list:
    return [(g["lr"], r["seed"], r["metrics"]) for g in summary["grid"] for r in g["runs"]]


def test_results_follow_what_the_model_and_data_are_not_where_they_are(run, task, tmp_path,
                                                                      monkeypatch, one_thread):
    """The identity holds the model's and the data's content hashes, not their paths: a moved
    run directory and moved task files reuse the finished fine-tune; one changed label is
    another task, written beside. A run folder whose identity is another fine-tune's is left
    as it is, and the fine-tune goes beside it."""
    import shutil

    from bert_pretrain.finetune.identity import record
    from bert_pretrain.finetune.runner import FineTune

    out = tmp_path / "out"
    first = finetune_in_process([*task, f"model={run}", *FAST, "recipe.epochs=1",
                                 f"out_dir={out}"])
    moved_run = shutil.copytree(run, tmp_path / "moved_run")
    files = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in task if "_file=" in o}
    moved = {}
    for key, path in files.items():
        moved[key] = str(tmp_path / os.path.basename(path))
        shutil.copy(path, moved[key])
    moved_task = [o for o in task if "_file=" not in o] + [f"{k}={v}" for k, v in moved.items()]
    real_step = FineTune.train_step
    monkeypatch.setattr(FineTune, "train_step", lambda self: pytest.fail("trained again"))
    again = finetune_in_process([*moved_task, f"model={moved_run}", *FAST, "recipe.epochs=1",
                                 f"out_dir={out}"])
    assert again["out_dir"] == str(out) and again["grid"] == first["grid"]  # read back
    monkeypatch.setattr(FineTune, "train_step", real_step)
    train = moved["task.train_file"]
    lines = open(train).read().splitlines()
    lines[1] = lines[1][:-1] + ("0" if lines[1].endswith("1") else "1")  # one label flipped
    open(train, "w").write("\n".join(lines) + "\n")
    other = finetune_in_process([*moved_task, f"model={moved_run}", *FAST, "recipe.epochs=1",
                                 f"out_dir={out}"])
    assert other["out_dir"] == str(out) + "-2"
    assert other["identity"]["data"] != first["identity"]["data"]
    # a run folder inside the grid that holds another fine-tune: written beside, kept
    member = out / "lr0.001-seed1"
    os.remove(member / "result.json")
    record(str(member), {"someone": "else"})
    third = finetune_in_process([*task, f"model={run}", *FAST, "recipe.epochs=1",
                                 f"out_dir={out}"])
    assert os.path.isfile(out / "lr0.001-seed1-2" / "result.json")
    assert json.load(open(member / "identity.json")) == {"someone": "else"}
    assert _scores(third) == _scores(first)  # (the same fine-tune again, in its own folder)


def test_a_checkpoint_remade_under_the_same_name_is_another_model(tmp_path):
    """A pretrained model is known by what it holds: the same run directory retrained (another
    seed) is another model, a copy of it elsewhere the same one."""
    import shutil

    from bert_pretrain.finetune.pretrained import load_pretrained
    from train_support import train_in_process, write_prepared

    data = write_prepared(str(tmp_path / "prep"), num_train=32, num_valid=8)

    def train(seed):
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        train_in_process(["experiment=smoke", f"data.dir={data}", f"run_dir={tmp_path / 'run'}",
                          "trainer.max_steps=2", "trainer.warmup_steps=1", "trainer.eval_every=0",
                          f"seed={seed}"])
        return load_pretrained(str(tmp_path / "run")).identity()

    first = train(1)
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    assert load_pretrained(str(tmp_path / "copy")).identity() == first
    assert train(2) != first


def _claim_after_the_check(base, identity, barrier, queue):
    """claim() in a child, held between its look at the folder and its taking it until the
    other child has looked too (both then find it new: the window two commands meet in)."""
    import bert_pretrain.finetune.identity as identity_mod

    real_makedirs = os.makedirs

    def makedirs(path, *args, **kwargs):
        if os.path.abspath(path) == os.path.abspath(base) and not barrier.broken:
            barrier.wait(timeout=hang_limit())
        return real_makedirs(path, *args, **kwargs)

    identity_mod.os.makedirs = makedirs  # (this child's os module only)
    queue.put((identity["recipe"]["lr"], identity_mod.claim(base, identity)))


def test_two_commands_claiming_one_new_folder_at_once_get_one_each(tmp_path):
    """Both look at out_dir while it is new, then both take it: one gets it, the other goes
    beside, and each folder records its own identity (check-then-write gave both the same)."""
    import multiprocessing

    from bert_pretrain.finetune.identity import read_identity

    ctx = multiprocessing.get_context("fork")
    base = str(tmp_path / "out")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    a, b = {"recipe": {"lr": 1}, "task": "x"}, {"recipe": {"lr": 2}, "task": "x"}
    children = [ctx.Process(target=_claim_after_the_check, args=(base, i, barrier, queue))
                for i in (a, b)]
    for child in children:
        child.start()
    got = dict(queue.get(timeout=hang_limit()) for _ in children)
    for child in children:
        child.join(timeout=hang_limit())
        assert child.exitcode == 0
    assert sorted(got.values()) == [base, base + "-2"], got
    assert read_identity(got[1]) == a and read_identity(got[2]) == b
    assert sorted(os.listdir(base)) == ["identity.json"]


def _save_and_die_before_the_new_model_goes_in(model, data, pretrained, out_dir, identity):
    """save_classifier in a child killed (SIGKILL) just before its new model takes out_dir's
    name: after whatever it did to the old model first."""
    import signal

    from bert_pretrain.finetune import export

    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        if os.path.abspath(dst) == os.path.abspath(out_dir):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rename(src, dst, *args, **kwargs)

    os.rename = rename
    export.save_classifier(model, data, pretrained, out_dir, identity)


def test_a_model_replaced_by_a_killed_save_is_whole_after_recovery(tmp_path):
    """A kill in the middle of replacing model/ leaves the old model, whole, where the start of
    the next run (recover_swap) puts it back; the next save then replaces it."""
    import multiprocessing

    from bert_pretrain.finetune.export import recover_swap, save_classifier
    from bert_pretrain.model import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16), 2)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    pretrained = SimpleNamespace(tokenizer_dir=str(tmp_path / "tok"),
                                 tokenizer_files=["vocab.txt"])
    data = SimpleNamespace(label_names=None, name="custom", title="T", metrics=("accuracy",))
    out_dir = str(tmp_path / "run" / "model")
    save_classifier(model, data, pretrained, out_dir, {"lr": 1, "seed": 1})
    old = _weights(out_dir)
    with torch.no_grad():
        model.classifier.weight.add_(1.0)
    child = multiprocessing.get_context("fork").Process(
        target=_save_and_die_before_the_new_model_goes_in,
        args=(model, data, pretrained, out_dir, {"lr": 1, "seed": 2}))
    child.start()
    child.join(timeout=hang_limit())
    assert child.exitcode == -9
    recover_swap(out_dir)
    assert _same(_weights(out_dir), old)
    assert sorted(os.listdir(tmp_path / "run")) == ["model"]
    save_classifier(model, data, pretrained, out_dir, {"lr": 1, "seed": 2})
    assert torch.equal(_weights(out_dir)["classifier.weight"], model.classifier.weight.detach())
    assert sorted(os.listdir(tmp_path / "run")) == ["model"]


def test_a_second_fine_tune_of_the_same_grid_at_once_stops_in_one_line(run, task, tmp_path):
    """The claim lets the same identity in (a rerun continues it): while another command holds
    the folder, the second stops with one line instead of writing the same runs along."""
    from bert_pretrain.components.folder_lock import lock_folder
    from bert_pretrain.errors import UserError

    out = tmp_path / "out"
    args = [*task, f"model={run}", *FAST, "recipe.epochs=1", f"out_dir={out}"]
    first = finetune_in_process(args)
    held = lock_folder(str(out), "bert-finetune")  # (as another process would: a new open file)
    try:
        with pytest.raises(UserError, match=r"is being written by another bert-finetune "
                                            r"\(process \d+\); wait for it"):
            finetune_in_process(args)
    finally:
        held.release()
    assert finetune_in_process(args)["score"] == first["score"]
