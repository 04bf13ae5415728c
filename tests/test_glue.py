"""bert-glue on a GLUE folder the test writes (GLUE's own TSV files, test tasks inside): the table
in the anchors' layout with the average leaving out WNLI, glue.json, the picture; and the
downstream score a pretraining sweep ranks by, from a separate process."""

from __future__ import annotations

import json
import os

import pytest

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
