"""bert-report: the pictures exist with the expected size, report.md's numbers are those of
metrics.jsonl, the baseline comes from the log or the data, several runs overlay."""

import json
import os

import pytest

from bert_pretrain.components.data import PreparedData
from bert_pretrain.components.evaluation import majority_baseline
from bert_pretrain.tools.report import (BASELINE_KEY, count_parameters, main, read_run,
                                  write_run_report)
from train_support import read_metrics, train_in_process, write_prepared

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    prepared = write_prepared(str(root / "prep"), num_train=32, num_valid=8)
    out = []
    for name, lr in (("a", "1e-3"), ("b", "3e-3")):
        run = str(root / name)
        train_in_process(["experiment=smoke", f"name=smoke_{name}", f"data.dir={prepared}",
                          f"run_dir={run}", f"optim.lr={lr}"])
        out.append(run)
    return prepared, out


def _table(md: str) -> dict:
    rows = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) >= 2:
            rows[cells[0]] = cells[1:]
    return rows


def _png_size(path):
    import matplotlib.image

    assert open(path, "rb").read(8) == PNG_MAGIC
    h, w = matplotlib.image.imread(path).shape[:2]
    return w, h


def test_report_of_one_run(runs):
    prepared, (run, _) = runs
    path = write_run_report(run)
    assert path == os.path.join(run, "report", "report.md")
    for name in ("curves_steps.png", "curves_tokens.png"):
        # 2 rows x 4 panels of 4.2 x 3.3 inches at 100 dpi
        assert _png_size(os.path.join(run, "report", name)) == (1680, 660)
    rows = _table(open(path).read())
    records = read_metrics(run)
    last_train = [r for r in records if "loss" in r][-1]
    last_eval = [r for r in records if "eval_mlm_loss" in r][-1]
    assert rows["final step"] == ["6"]
    assert rows["tokens seen"] == [f"{last_train['tokens_seen']:,}"]
    assert rows["final training loss (last log window)"] == [f"{last_train['loss']:.4f}"]
    for key in ("eval_mlm_loss", "eval_mlm_accuracy", "eval_nsp_loss", "eval_nsp_accuracy"):
        label = "held-out " + key[5:].replace("_", " ").replace("mlm", "MLM").replace("nsp", "NSP")
        assert rows[label] == [f"{last_eval[key]:.4f}"], label
    assert rows["held-out MLM accuracy at [MASK] positions"] == [
        f"{last_eval['eval_mlm_accuracy_masked']:.4f}"]
    assert rows["mean throughput (tokens/s)"] == [
        f"{last_train['tokens_seen'] / last_train['elapsed_s']:,.0f}"]
    # the baseline, computed from the run's data (no value logged)
    expected = majority_baseline(PreparedData(prepared), "validation")
    assert rows["most-frequent-token baseline"] == [f"{expected:.4f}"]
    assert f"computed from {prepared}" in open(path).read()
    assert rows["hidden size x layers x heads"] == ["32x2x2"]
    assert rows["peak learning rate"] == ["0.001"]
    from bert_pretrain.model import BertConfig, BertForPreTraining
    from bert_pretrain.components import checkpoint as ckpt
    from bert_pretrain.components import checkpoint_manager as cm
    latest = cm.latest_checkpoint(run)
    config = ckpt.read_train_state(latest)["model_config"]
    n = sum(p.numel() for p in BertForPreTraining(BertConfig.from_dict(config)).parameters())
    assert count_parameters(latest) == n and rows["parameters"] == [f"{n:,}"]


def test_logged_baseline_wins_over_the_data(runs, tmp_path):
    _, (run, _) = runs
    copy = tmp_path / "copy"
    os.makedirs(copy)
    with open(os.path.join(run, "metrics.jsonl")) as f, open(copy / "metrics.jsonl", "w") as g:
        for line in f:
            record = json.loads(line)
            if "eval_mlm_loss" in record:
                record[BASELINE_KEY] = 0.125
            g.write(json.dumps(record) + "\n")
    loaded = read_run(str(copy))
    assert loaded.baseline == 0.125 and loaded.baseline_source == "logged in metrics.jsonl"
    assert loaded.tokens_at(6) is not None


def test_several_runs_overlaid(runs, tmp_path, capsys):
    _, (a, b) = runs
    out = str(tmp_path / "both")
    main([a, b, "-o", out])
    rows = _table(open(os.path.join(out, "report.md")).read())
    assert rows[""] == ["smoke_a", "smoke_b"]
    assert rows["peak learning rate"] == ["0.001", "0.003"]
    assert _png_size(os.path.join(out, "curves_tokens.png")) == (1680, 660)


def test_pictures_name_the_runs_not_their_paths(runs, tmp_path, drawn_figures):
    """Two runs of the same experiment (same name) are told apart by the end of their
    directories, not by a whole path from the machine; the baseline note names no path either;
    the MLM accuracy panel also shows the accuracy at [MASK] positions (what fill-mask does)."""
    prepared, (a, b) = runs
    for run, where in ((a, "lr1e-3"), (b, "lr3e-3")):
        copy = tmp_path / "somewhere" / where / "demo"
        os.makedirs(copy)
        with open(os.path.join(run, "metrics.jsonl")) as f:
            (copy / "metrics.jsonl").write_text(f.read())
        os.makedirs(copy / ".hydra")  # the data's path is known: the baseline is computed
        (copy / ".hydra" / "config.yaml").write_text(f"name: demo\ndata:\n  dir: {prepared}\n")
    main([str(tmp_path / "somewhere" / "lr1e-3" / "demo"),
          str(tmp_path / "somewhere" / "lr3e-3" / "demo"), "-o", str(tmp_path / "out")])
    for fig in drawn_figures:
        legend = [ax.get_legend() for ax in fig.axes if ax.get_legend()][0]
        labels = [t.get_text() for t in legend.get_texts()]
        assert labels[:2] == ["lr1e-3/demo", "lr3e-3/demo"], labels
        assert "held-out, [MASK] positions only" in labels
        texts = [fig._suptitle.get_text()] + [t.get_text() for ax in fig.axes for t in ax.texts]
        assert texts[0] == "lr1e-3/demo, lr3e-3/demo"
        assert "baseline lr1e-3/demo: computed from the run's data (validation split)" in \
            " ".join(" ".join(texts).split())
        assert not any(str(tmp_path) in t or prepared in t for t in texts + labels)
        (mlm_acc,) = [ax for ax in fig.axes if ax.get_title() == "held-out MLM accuracy"]
        markers = sorted(line.get_marker() for line in mlm_acc.get_lines() if line.get_marker()
                         not in (None, "None", ""))
        assert markers == ["^", "^", "o", "o"]  # all predicted and [MASK] only, for both runs
    # report.md keeps the whole story, paths included
    assert f"computed from {prepared}" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["{tmp}/nope"], "no such run directory"),
    (["{tmp}"], "has no metrics.jsonl"),
    (["{a}", "{b}"], "several runs: choose where the report goes with -o"),
])
def test_bad_input_is_one_line(runs, tmp_path, capsys, args, message):
    _, (a, b) = runs
    with pytest.raises(SystemExit) as info:
        main([x.format(tmp=tmp_path, a=a, b=b) for x in args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("bert-report: error:") and message in err
    assert err.count("\n") == 1

