"""bert-glue on a GLUE folder the test writes (GLUE's own TSV files, test tasks inside): the table
in the anchors' layout with the average leaving out WNLI, glue.json, the picture; and the
downstream score a pretraining sweep ranks by, from a separate process."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bert_pretrain.finetune.downstream import DownstreamConfig, downstream_score
from finetune_support import FAST, glue_in_process, pretrained_run, write_glue_task


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return pretrained_run(str(tmp_path_factory.mktemp("pretrained")))


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("glue_data"))
    for task in ("sst2", "rte", "wnli"):
        write_glue_task(root, task, n_train=256, n_dev=64)
    return root


def test_table_json_and_picture(run, glue_dir, tmp_path, one_thread):
    out = tmp_path / "glue"
    report = glue_in_process([f"models=[{run}]", "tasks=[wnli,rte,sst2]", f"data_dir={glue_dir}",
                              "controls=true", *FAST, f"out_dir={out}"])
    assert report["tasks"] == ["sst2", "rte", "wnli"]  # the BERT paper's order, WNLI last
    assert [m["label"] for m in report["models"]] == ["run", "run (random init)"]
    saved = json.loads((out / "glue.json").read_text())
    assert saved == json.loads(json.dumps(report))
    for model in saved["models"]:
        scores = {t: e["score"] for t, e in model["tasks"].items()}
        assert model["average"] == pytest.approx((scores["sst2"] + scores["rte"]) / 2)
        for task, entry in model["tasks"].items():
            summary = json.loads((out / model["label"].replace(" (", "_").rstrip(")")
                                  .replace(" ", "_") / task / "finetune.json").read_text())
            assert summary["score"] == entry["score"] and summary["init"] == model["init"]
    table = (out / "glue.md").read_text().splitlines()
    assert table[0] == "| Model | SST-2 | RTE | WNLI | Average (2 tasks) |"
    first = saved["models"][0]
    assert table[2] == (f"| run | {100 * first['tasks']['sst2']['score']:.1f} | "
                        f"{100 * first['tasks']['rte']['score']:.1f} | "
                        f"{100 * first['tasks']['wnli']['score']:.1f} | "
                        f"{100 * first['average']:.1f} |")
    assert "WNLI left out" in table[-1]
    png = (out / "glue.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # the pretrained encoder learned the sentence task (label: w0 in the sentence)
    assert first["tasks"]["sst2"]["score"] >= 0.75
    # the same out_dir with another recipe: the grid goes beside the first, which stays
    kept = (out / "run" / "sst2" / "finetune.json").read_bytes()
    other = glue_in_process([f"models=[{run}]", "tasks=[sst2]", f"data_dir={glue_dir}", *FAST,
                             "recipe.max_length=24", f"out_dir={out}"])
    assert other["models"][0]["tasks"]["sst2"]["out_dir"] == str(out / "run" / "sst2-2")
    assert (out / "run" / "sst2" / "finetune.json").read_bytes() == kept


def test_downstream_score_of_a_finished_run(run, glue_dir, tmp_path, monkeypatch):
    """What a pretraining sweep's trial returns with objective=downstream_score: the GLUE score
    of its final checkpoint, computed in a child process that is one process even when the
    caller is rank 0 of a launched run."""
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under accelerate launch / torchrun
    monkeypatch.setenv("RANK", "0")
    cfg = DownstreamConfig(tasks=["sst2"], data_dir=glue_dir, lrs=[1e-3], seeds=[1], epochs=4,
                           overrides=[o for o in FAST if not o.startswith(
                               ("recipe.lrs", "recipe.seeds", "recipe.epochs"))])
    out = str(tmp_path / "downstream")
    scores = downstream_score(os.path.join(run, "checkpoints", "step-00000020"), cfg, out,
                              log=lambda line: None)
    glue = json.loads(open(os.path.join(out, "glue.json")).read())
    assert scores == {"downstream_sst2": glue["models"][0]["tasks"]["sst2"]["score"],
                      "downstream_score": glue["models"][0]["tasks"]["sst2"]["score"]}
    assert glue["processes"] == 1 and scores["downstream_score"] >= 0.75
    said = []  # the same again reads the finished scores back, and says so
    assert downstream_score(os.path.join(run, "checkpoints", "step-00000020"), cfg, out,
                            log=said.append) == scores
    assert any("reading back the finished fine-tunes" in line for line in said), said
    assert not any("downstream: fine-tuning" in line for line in said), said
    assert DownstreamConfig().enabled is False and downstream_score(run, DownstreamConfig(),
                                                                    out) == {}
    with pytest.raises(ValueError, match="use all, fast"):
        DownstreamConfig(tasks=["sst-2"])


def test_bert_train_downstream_settings():
    """bert-train's `downstream` group: off by default, validated, and the objective that
    returns its score needs it on."""
    from bert_pretrain.config import settings
    from bert_pretrain.errors import ConfigError
    from train_support import compose

    base = ["data.dir=prepared/x"]
    assert settings(compose(base)).downstream.enabled is False
    s = settings(compose([*base, "downstream.tasks=fast", "downstream.max_train_samples=2000",
                          "objective=downstream_score"]))
    assert s.downstream.tasks == "fast" and s.objective == "downstream_score"
    assert s.downstream.max_train_samples == 2000
    with pytest.raises(ConfigError, match="objective=downstream_score needs downstream.tasks"):
        settings(compose([*base, "objective=downstream_score"]))
    with pytest.raises(ConfigError, match="use all, fast"):
        settings(compose([*base, "downstream.tasks=[sst-2]"]))


def test_bert_train_ends_with_the_downstream_score_it_returns(glue_dir, tmp_path):
    """A run with downstream.tasks fine-tunes its final checkpoint at the end: the scores are in
    metrics.jsonl (what the sweep summary reads) and objective=downstream_score returns it."""
    from train_support import read_metrics, train_in_process, write_prepared

    prepared = write_prepared(str(tmp_path / "prep"), num_train=64, num_valid=8)
    run = tmp_path / "run"
    overrides = [o for o in FAST if not o.startswith(("recipe.lrs", "recipe.seeds",
                                                      "recipe.epochs"))]
    objective = train_in_process([
        "experiment=smoke", f"data.dir={prepared}", f"run_dir={run}", "trainer.max_steps=20",
        "trainer.checkpoint_every=20", "trainer.eval_every=0", "downstream.tasks=[sst2]",
        f"downstream.data_dir={glue_dir}", "downstream.lrs=[1e-3]", "downstream.epochs=4",
        "downstream.overrides=[" + ",".join(f"'{o}'" for o in overrides) + "]",
        "objective=downstream_score"])
    logged = [r for r in read_metrics(str(run)) if "downstream_score" in r]
    assert len(logged) == 1 and logged[0]["step"] == 20
    assert objective == logged[0]["downstream_score"] == logged[0]["downstream_sst2"]
    assert objective >= 0.75  # the encoder learned the sentence task (label: w0 in it)
    assert (run / "downstream" / "glue.json").is_file()


def test_extending_a_run_with_downstream_tasks_scores_its_new_end_beside(glue_dir, tmp_path):
    """resume=auto with a larger max_steps: the new final checkpoint is fine-tuned into a
    folder of its own beside the first one's scores (which stay as they were), and a later
    resume=auto of the finished run reuses them instead of failing or fine-tuning again."""
    from train_support import read_metrics, train_in_process, write_prepared

    prepared = write_prepared(str(tmp_path / "prep"), num_train=64, num_valid=8)
    run = tmp_path / "run"
    overrides = [o for o in FAST if not o.startswith(("recipe.lrs", "recipe.seeds",
                                                      "recipe.epochs"))]
    common = ["experiment=smoke", f"data.dir={prepared}", f"run_dir={run}",
              "trainer.checkpoint_every=10", "trainer.eval_every=0", "downstream.tasks=[sst2]",
              f"downstream.data_dir={glue_dir}", "downstream.lrs=[1e-3]", "downstream.epochs=1",
              "downstream.max_train_samples=64", "trainer.report=false",
              "downstream.overrides=[" + ",".join(f"'{o}'" for o in overrides) + "]",
              "objective=downstream_score"]
    first = train_in_process([*common, "trainer.max_steps=10"])
    glue_json = (run / "downstream" / "glue.json").read_bytes()
    second = train_in_process([*common, "trainer.max_steps=20", "resume=auto"])
    logged = [r for r in read_metrics(str(run)) if "downstream_score" in r]
    assert [r["step"] for r in logged] == [10, 20]
    assert [r["downstream_score"] for r in logged] == [first, second]
    assert (run / "downstream" / "glue.json").read_bytes() == glue_json  # step 10's, as it was
    beside = json.loads((run / "downstream-2" / "glue.json").read_text())
    assert beside["models"][0]["tasks"]["sst2"]["checkpoint"].endswith("step-00000020")
    assert beside["models"][0]["tasks"]["sst2"]["score"] == second
    result = run / "downstream-2" / "model" / "sst2" / "lr0.001-seed1" / "result.json"
    done = result.stat().st_mtime_ns
    assert train_in_process([*common, "trainer.max_steps=20", "resume=auto"]) == second
    assert result.stat().st_mtime_ns == done  # reused, not fine-tuned again
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("downstream")) == \
        ["downstream", "downstream-2"]


def test_the_random_init_control_starts_from_fresh_weights(run, glue_dir, tmp_path,
                                                           monkeypatch, one_thread):
    """controls=true fine-tunes each model twice: from its pretrained encoder, and from a
    fresh initialisation of the same architecture. What each fine-tune starts from is checked
    against the pretrained encoder's weights, not only by the control's label."""
    from bert_pretrain.finetune.pretrained import load_pretrained
    from bert_pretrain.finetune.runner import FineTune

    starts = {}
    real_setup = FineTune._setup

    def setup(self):
        real_setup(self)
        starts[self.job.settings.init] = {k: v.clone() for k, v in
                                          self.raw_model.state_dict().items()}

    monkeypatch.setattr(FineTune, "_setup", setup)
    glue_in_process([f"models=[{run}]", "tasks=[sst2]", f"data_dir={glue_dir}",
                     "controls=true", "max_train_samples=32", *FAST, "recipe.epochs=1",
                     f"out_dir={tmp_path / 'glue'}"])
    encoder = load_pretrained(run).encoder_state
    assert sorted(starts) == ["pretrained", "random"]
    matrices = [k for k, v in encoder.items() if v.ndim == 2]
    assert len(matrices) >= 10
    for key in matrices:
        assert torch.equal(starts["pretrained"][key], encoder[key]), key
        assert not torch.allclose(starts["random"][key], encoder[key], atol=1e-3), key
