"""Sweeps: the sweep summary (on synthetic sweep dirs and on real Hydra multiruns of a toy app),
and grid / Optuna sweeps of `bert-train` on a tiny model."""
from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bert_pretrain.tools import sweep_summary as ss
from time_limits import hang_limit

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- synthetic sweep dirs


def make_member(sweep: Path, sub: str, overrides: list[str], metrics: list[dict] | None,
                trial: dict | None = None, raw_tail: bytes = b"") -> Path:
    """A member dir as Hydra and the trainer leave it: .hydra/overrides.yaml + metrics.jsonl."""
    d = sweep / sub
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if metrics is not None:
        with open(d / "metrics.jsonl", "wb") as f:
            for m in metrics:
                f.write(json.dumps(m).encode() + b"\n")
            f.write(raw_tail)
    if trial is not None:
        (d / "trial.json").write_text(json.dumps(trial))
    return d


def train_log(final_eval: float, steps: int = 3) -> list[dict]:
    recs = [{"step": s, "loss": 10.0 - s, "mlm_loss": 9.0 - s, "lr": 1e-4} for s in
            range(1, steps + 1)]
    recs.append({"step": steps, "eval_mlm_loss": final_eval, "eval_mlm_accuracy": 1 / final_eval})
    return recs


@pytest.fixture
def grid_sweep(tmp_path: Path) -> Path:
    """A 2x2 grid (lr x warmup) plus a failed member and one killed mid-write."""
    sweep = tmp_path / "multirun" / "2026-01-01" / "12-00-00"
    losses = {(0, "1e-4", "10"): 5.0, (1, "1e-4", "20"): 4.0, (2, "3e-4", "10"): 6.5,
              (3, "3e-4", "20"): 3.25}
    for (num, lr, wu), loss in losses.items():
        make_member(sweep, str(num), [f"optim.lr={lr}", f"trainer.warmup_steps={wu}",
                                      "trainer.max_steps=3"], train_log(loss),
                    {"job_num": num, "status": "completed", "return_value": loss,
                     "duration_s": 1.5})
    make_member(sweep, "4", ["optim.lr=1e-2", "trainer.warmup_steps=10", "trainer.max_steps=3"],
                [{"step": 1, "loss": 11.0}],
                {"job_num": 4, "status": "failed", "error": "RuntimeError: loss is NaN"})
    # No trial.json (SIGKILLed by SLURM) and a truncated last line: still listed, not a crash.
    make_member(sweep, "5", ["optim.lr=3e-2", "trainer.warmup_steps=20", "trainer.max_steps=3"],
                train_log(2.0)[:-1], raw_tail=b'{"step": 3, "eval_mlm_lo')
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return sweep


def test_summary_ranks_best_first_and_lists_failures(grid_sweep: Path) -> None:
    out = io.StringIO()
    s = ss.summarize(grid_sweep, out=out)
    assert [t.job_num for t in s.trials] == [3, 1, 0, 2, 4, 5]
    assert [t.status for t in s.trials] == ["completed"] * 4 + ["failed", "unknown"]
    assert s.swept == ["optim.lr", "trainer.warmup_steps"]
    assert s.fixed == {"trainer.max_steps": "3"}
    # The killed member's last complete line is kept; its truncated eval line is not invented.
    assert s.trials[5].metrics["step"] == 3 and "eval_mlm_loss" not in s.trials[5].metrics
    text = out.getvalue()
    lines = text.splitlines()
    header = next(i for i, l in enumerate(lines) if l.startswith("rank"))
    rows = [l.split() for l in lines[header + 2:header + 8]]
    assert [r[1] for r in rows] == ["3", "1", "0", "2", "4", "5"]
    assert rows[0][3] == "3.25" and rows[1][3] == "4"
    assert "job 4 failed: RuntimeError: loss is NaN" in text
    assert "fixed: trainer.max_steps=3" in text
    assert s.table_path.read_text() == text.split("wrote ")[0]


def test_summary_csv_has_every_trial_override_and_final_metric(grid_sweep: Path) -> None:
    s = ss.summarize(grid_sweep, out=None)
    with open(s.csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    assert [r["job"] for r in rows] == ["3", "1", "0", "2", "4", "5"]
    best = rows[0]
    assert float(best["eval_mlm_loss"]) == 3.25
    assert float(best["objective"]) == 3.25
    assert float(best["eval_mlm_accuracy"]) == pytest.approx(1 / 3.25)
    assert (best["optim.lr"], best["trainer.warmup_steps"], best["trainer.max_steps"]) == (
        "3e-4", "20", "3")
    assert float(best["loss"]) == 7.0  # the last training loss, not the first
    assert rows[4]["status"] == "failed" and rows[4]["eval_mlm_loss"] == ""
    assert rows[4]["error"] == "RuntimeError: loss is NaN"
    assert Path(best["dir"]) == grid_sweep / "3"


def test_summary_plot_is_a_png_with_one_panel_per_swept_param(grid_sweep: Path) -> None:
    import matplotlib.image

    s = ss.summarize(grid_sweep, out=None)
    assert s.plot_path.read_bytes()[:8] == PNG_MAGIC
    h, w = matplotlib.image.imread(s.plot_path).shape[:2]
    assert w > 1.8 * h  # two panels side by side


def test_summary_of_a_sweep_where_every_trial_failed_says_so(tmp_path: Path,
                                                             drawn_figures) -> None:
    """No trial has the metric: the table's head says why, the picture says so (with the first
    errors) instead of drawing empty axes."""
    sweep = tmp_path / "sweep"
    for num in range(3):
        make_member(sweep, str(num), [f"trainer.warmup_steps={50 * (num + 1)}"], None,
                    {"job_num": num, "status": "failed", "error": "ConfigError: trainer."
                     f"warmup_steps ({50 * (num + 1)}) must be below trainer.max_steps (40)"})
    figures = drawn_figures
    s = ss.summarize(sweep, out=None)
    assert s.table.splitlines()[1] == "no trial has eval_mlm_loss: all 3 failed (errors below " \
                                      "the table)"
    assert s.plot_path.read_bytes()[:8] == PNG_MAGIC
    (fig,) = figures
    shown = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert len(shown) == 1 and shown[0].startswith("no trial has eval_mlm_loss: all 3 failed\n"
                                                   "job 0: ConfigError: trainer.warmup_steps (50)")
    assert not any(ax.axison for ax in fig.axes)  # no empty axes
    assert ss.nothing_scored(s.trials[:1] + [ss.Trial(sweep, 9, {}, "running")], "x") == \
        "no trial has x: 1 failed, 1 running"


def test_summary_integer_hyperparameters_get_integer_ticks(tmp_path: Path,
                                                           drawn_figures) -> None:
    """Warmup steps, layer counts and job numbers are integers: no 1.2, 1.4 ... ticks."""
    sweep = tmp_path / "sweep"
    for num, (layers, lr) in enumerate([(1, "1e-4"), (2, "3e-4"), (3, "1e-3")]):
        make_member(sweep, str(num), [f"model.num_hidden_layers={layers}", f"optim.lr={lr}"],
                    train_log(5.0 - num), {"job_num": num, "status": "completed"})
    make_member(tmp_path / "one", "0", ["optim.lr=1e-4"], train_log(5.0),
                {"job_num": 0, "status": "completed"})
    make_member(tmp_path / "one", "1", ["optim.lr=1e-4"], train_log(4.0),
                {"job_num": 1, "status": "completed"})
    figures = drawn_figures
    ss.summarize(sweep, out=None)
    ss.summarize(tmp_path / "one", out=None)  # nothing swept: against the job number
    layers_ax, lr_ax, job_ax = figures[0].axes + figures[1].axes
    assert layers_ax.get_xlabel() == "model.num_hidden_layers" and job_ax.get_xlabel() == "job"
    for ax in (layers_ax, job_ax):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
    assert lr_ax.get_xscale() == "log"  # a decade or more: log, as before


def test_summary_maximize_and_objective(grid_sweep: Path) -> None:
    s = ss.summarize(grid_sweep, metric="eval_mlm_accuracy", mode="max", out=None)
    assert [t.job_num for t in s.trials][:4] == [3, 1, 0, 2]
    s = ss.summarize(grid_sweep, metric="objective", out=None)
    assert [t.job_num for t in s.trials] == [3, 1, 0, 2, 4, 5]


def test_summary_nested_subdirs_categorical_and_nan(tmp_path: Path) -> None:
    """Custom hydra.sweep.subdir (nested, named by overrides), a categorical swept value and a
    diverged (NaN) trial, which ranks last instead of first."""
    sweep = tmp_path / "sweep"
    make_member(sweep, "optim=adamw/seed=1", ["optim=adamw", "seed=1"], train_log(4.0))
    make_member(sweep, "optim=lamb/seed=1", ["optim=lamb", "seed=1"], train_log(3.0))
    make_member(sweep, "optim=lamb/seed=2", ["optim=lamb", "seed=2"], train_log(float("nan")))
    # A member's own sub-dirs (checkpoints with their own .hydra copies) are not members.
    make_member(sweep / "optim=lamb" / "seed=1", "checkpoints/step-1", ["x=1"], None)
    s = ss.summarize(sweep, out=None)
    assert [t.overrides for t in s.trials] == [
        {"optim": "lamb", "seed": "1"}, {"optim": "adamw", "seed": "1"},
        {"optim": "lamb", "seed": "2"}]
    assert math.isnan(s.trials[2].metrics["eval_mlm_loss"])
    assert s.swept == ["optim", "seed"]
    assert s.plot_path.read_bytes()[:8] == PNG_MAGIC


def test_summary_bad_input_one_line_errors(tmp_path: Path, grid_sweep: Path, capsys) -> None:
    with pytest.raises(ss.SweepSummaryError, match="does not exist"):
        ss.summarize(tmp_path / "nope", out=None)
    with pytest.raises(ss.SweepSummaryError, match="no sweep members"):
        ss.summarize(grid_sweep / "3", out=None)  # a member, not the sweep
    with pytest.raises(ss.SweepSummaryError, match="pick one of .*eval_mlm_loss"):
        ss.summarize(grid_sweep, metric="eval_mlm_los", out=None)
    assert ss.main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bert-sweep-summary: error: sweep dir") and err.count("\n") == 1


def test_summary_command_line(grid_sweep: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "bert_pretrain.tools.sweep_summary", str(grid_sweep),
                        "--metric", "eval_mlm_accuracy"], capture_output=True, text=True,
                       timeout=hang_limit())
    assert r.returncode == 0, r.stderr
    assert "ranked by eval_mlm_accuracy (max)" in r.stdout
    assert (grid_sweep / "summary.csv").is_file() and (grid_sweep / "summary.png").is_file()


# --------------------------------------------------------------------------- real Hydra multiruns
# A toy task function with the callback wired exactly as conf/train/train.yaml wires it: exercises
# Hydra's basic sweeper and the Optuna sweeper without training anything.

TOY_APP = '''
import json, math
from pathlib import Path
import hydra
from hydra.core.hydra_config import HydraConfig

@hydra.main(version_base="1.3", config_path="conf", config_name="cfg")
def main(cfg):
    if cfg.fail_at is not None and math.isclose(cfg.lr, cfg.fail_at):
        raise RuntimeError(f"diverged at lr={cfg.lr}\\nsecond line of the message")
    loss = (math.log10(cfg.lr) + 3.3) ** 2 + 0.1 * cfg.layers
    with open(Path(HydraConfig.get().runtime.output_dir) / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "loss": 9.0}) + "\\n")
        f.write(json.dumps({"step": 2, "eval_mlm_loss": loss,
                            "eval_nsp_accuracy": cfg.layers / (1.0 + cfg.layers)}) + "\\n")
    return loss

if __name__ == "__main__":
    main()
'''

TOY_CONF = '''
lr: 1e-3
layers: 2
fail_at: null
hydra:
  callbacks:
    sweep_summary:
      _target_: bert_pretrain.tools.sweep_summary.SweepSummaryCallback
'''


def run_toy(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "conf").mkdir(exist_ok=True)
    (tmp_path / "app.py").write_text(TOY_APP)
    (tmp_path / "conf" / "cfg.yaml").write_text(TOY_CONF)
    sweep = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "app.py", "-m", f"hydra.sweep.dir={sweep}", *args],
                       cwd=tmp_path, capture_output=True, text=True, timeout=hang_limit())
    return r, sweep


def test_callback_grid_sweep_with_failed_member(tmp_path: Path) -> None:
    """Hydra's basic sweeper raises when a member fails (before on_multirun_end): the members still
    run, and the summary is still written, listing the failure with its first error line."""
    r, sweep = run_toy(tmp_path, "lr=1e-4,1e-3,1e-2", "layers=1,2", "fail_at=1e-2")
    assert r.returncode != 0  # Hydra reports the failed member
    assert "ranked by eval_mlm_loss (min)" in r.stdout, r.stderr
    with open(sweep / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    assert [(r["lr"], r["layers"]) for r in rows[:2]] == [
        ("0.001", "1"), ("0.001", "2")]  # Hydra writes 1e-3 as 0.001
    assert [r["status"] for r in rows] == ["completed"] * 4 + ["failed"] * 2
    assert rows[-1]["error"] == "RuntimeError: diverged at lr=0.01"
    info = json.loads((sweep / "0" / "trial.json").read_text())
    assert info["status"] == "completed" and info["overrides"] == ["lr=0.0001", "layers=1", "fail_at=0.01"]
    assert info["return_value"] == pytest.approx((-4 + 3.3) ** 2 + 0.1)


@pytest.mark.parametrize("objective,ranked,order", [
    ("eval_nsp_accuracy", "eval_nsp_accuracy (max)", ["2", "1"]),
    ("eval_loss", "objective (min)", ["1", "2"])])
def test_callback_ranks_by_the_runs_objective(tmp_path: Path, objective, ranked, order) -> None:
    """A sweep run with objective=X is summarised by X (accuracies: best = highest), not by the
    default MLM loss; eval_loss, which no record holds, by the value returned to the sweeper."""
    r, sweep = run_toy(tmp_path, "lr=1e-3", "layers=1,2", f"+objective={objective}")
    assert r.returncode == 0, r.stderr
    assert f"ranked by {ranked}" in r.stdout
    with open(sweep / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # layers=2 has the higher accuracy, layers=1 the lower returned (and MLM) loss: ranking by
    # the MLM loss, or an accuracy lowest first, would put "1" first in both cases
    assert [row["layers"] for row in rows] == order


def test_callback_optuna_sweep(tmp_path: Path) -> None:
    r, sweep = run_toy(tmp_path, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=5",
                       "hydra.sweeper.n_jobs=1", "hydra.sweeper.sampler.seed=0",
                       "hydra.sweeper.max_failure_rate=1.0",
                       "lr=choice(1e-4,1e-3,1e-2)", "layers=range(1,3)", "fail_at=1e-2")
    assert r.returncode == 0, r.stderr
    with open(sweep / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5
    scored = [float(r["eval_mlm_loss"]) for r in rows if r["status"] == "completed"]
    assert scored == sorted(scored)
    assert all(r["eval_mlm_loss"] == "" for r in rows if r["status"] == "failed")
    # The summary's best trial is the one the Optuna study reports.
    from omegaconf import OmegaConf

    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert float(rows[0]["objective"]) == pytest.approx(best.best_value)
    assert float(rows[0]["lr"]) == pytest.approx(best.best_params.lr)


# --------------------------------------------------------------------------- bert-train sweeps
# Real multiruns of the training entry point on the smoke experiment's tiny model.

REPO = Path(__file__).resolve().parent.parent
TINY = ["experiment=smoke", "trainer.max_steps=4", "trainer.log_every=2", "trainer.eval_every=0",
        "trainer.checkpoint_every=100", "trainer.progress_bar=false"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    from train_support import write_prepared

    return write_prepared(str(tmp_path_factory.mktemp("prepared") / "data"), num_train=40)


def bert_train_multirun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "bert_pretrain.train", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=hang_limit(), env=env)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def final_eval(member: Path) -> float:
    evals = [json.loads(l) for l in (member / "metrics.jsonl").read_text().splitlines()]
    return [e for e in evals if "eval_mlm_loss" in e][-1]["eval_mlm_loss"]


def test_grid_sweep_2x2_bert_train(prepared, tmp_path):
    sweep = tmp_path / "grid"
    r = bert_train_multirun("-m", *TINY, f"data.dir={prepared}", f"hydra.sweep.dir={sweep}",
                            "optim.lr=1e-3,3e-3", "trainer.warmup_steps=1,2")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_csv(sweep / "summary.csv")
    assert len(rows) == 4 and all(row["status"] == "completed" for row in rows)
    assert {(row["optim.lr"], row["trainer.warmup_steps"]) for row in rows} == {
        ("0.001", "1"), ("0.001", "2"), ("0.003", "1"), ("0.003", "2")}
    losses = [float(row["eval_mlm_loss"]) for row in rows]
    assert losses == sorted(losses)
    for row in rows:
        member = Path(row["dir"])
        # Each member trained in its own sweep subdir; the summary's value is that member's
        # final held-out loss, which is also what bert-train returned to the sweeper.
        assert member.parent == sweep and (member / "checkpoints" / "step-00000004").is_dir()
        assert float(row["eval_mlm_loss"]) == final_eval(member)
        assert float(row["objective"]) == pytest.approx(final_eval(member), rel=1e-12)
        assert row["step"] == "4"
    assert len(set(losses)) > 1  # the swept values reached the runs
    # One wandb group per sweep by default: the sweep dir.
    from omegaconf import OmegaConf

    for row in rows:
        saved = OmegaConf.load(Path(row["dir"]) / "checkpoints" / "step-00000004" / "config.yaml")
        assert Path(saved.logger.group) == sweep
    table = (sweep / "summary.txt").read_text()
    assert table in r.stdout and "optim.lr" in table and "trainer.warmup_steps" in table
    assert (sweep / "summary.png").read_bytes()[:8] == PNG_MAGIC


def test_optuna_search_3_trials_bert_train(prepared, tmp_path):
    sweep = tmp_path / "optuna"
    # the config's search space as it is: its warmup is a fraction of max_steps, so trials of
    # 4 steps search a warmup they can run (a range of 0..400 steps failed every one of them)
    r = bert_train_multirun("hparams_search=mlm_tpe", *TINY,  # the config implies -m
                            f"data.dir={prepared}",
                            f"hydra.sweep.dir={sweep}", "hydra.sweeper.n_trials=3",
                            "hydra.sweeper.sampler.n_startup_trials=2")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_csv(sweep / "summary.csv")
    assert len(rows) == 3 and all(row["status"] == "completed" for row in rows)
    # Swept by the config: lr, warmup and weight decay differ between trials.
    assert len({row["optim.lr"] for row in rows}) == 3
    assert all(5e-5 <= float(row["optim.lr"]) <= 3e-3 for row in rows)
    assert len({row["trainer.warmup_ratio"] for row in rows}) == 3
    assert all(0.0 <= float(row["trainer.warmup_ratio"]) <= 0.2 for row in rows)
    losses = [float(row["eval_mlm_loss"]) for row in rows]
    assert losses == sorted(losses)
    from omegaconf import OmegaConf

    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert best.best_value == pytest.approx(losses[0], rel=1e-12)
    assert float(rows[0]["optim.lr"]) == pytest.approx(best.best_params["optim.lr"])
    # One wandb group per sweep: every trial's resolved config names the sweep dir.
    for row in rows:
        saved = OmegaConf.load(Path(row["dir"]) / "checkpoints" / "step-00000004" / "config.yaml")
        assert Path(saved.logger.group).resolve() == sweep.resolve()
        assert saved.trainer.max_steps == 4


# --------------------------------------------------------------------------- sweep configs

SEARCHES = sorted(p.stem for p in (REPO / "conf" / "train" / "hparams_search").glob("*.yaml"))
LAUNCHERS = sorted(p.stem for p in (REPO / "conf" / "train" / "hydra" / "launcher").glob("*.yaml"))


def compose_train(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from bert_pretrain.config import register

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf" / "train"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize("search", SEARCHES)
def test_hparams_search_configs_compose_and_sweep_real_keys(search):
    from omegaconf import OmegaConf

    cfg = compose_train([f"hparams_search={search}", "data.dir=x"])
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "minimize"
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler"
    assert sweeper.sampler.seed == cfg.seed
    assert str(cfg.hydra.mode).endswith("MULTIRUN")
    assert cfg.hydra.callbacks.sweep_summary._target_.endswith("SweepSummaryCallback")
    # One wandb group per sweep (resolved inside each trial; see the Optuna run test).
    assert OmegaConf.to_container(cfg.logger)["group"] == "${hydra:sweep.dir}"
    assert len(sweeper.params) >= 2
    for key in sweeper.params:  # a misspelt key would only fail when the first trial starts
        assert OmegaConf.select(cfg, key, default="<absent>") != "<absent>", key
    # Short-budget trials: a step count well below a real run's, or a wall-clock budget.
    assert cfg.trainer.budget_hours is not None or cfg.trainer.max_steps <= 5000


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_launcher_configs_instantiate(launcher):
    from hydra.utils import instantiate

    cfg = compose_train([f"hydra/launcher={launcher}", "data.dir=x"])
    obj = instantiate(cfg.hydra.launcher)  # builds the launcher (submits nothing)
    expected = {"local_parallel": "JoblibLauncher", "slurm": "SlurmLauncher"}[launcher]
    assert type(obj).__name__ == expected
    if launcher == "slurm":
        assert obj.params["gpus_per_node"] == 1 and obj.params["max_num_timeout"] >= 1


def test_callback_under_parallel_joblib_launcher(tmp_path: Path) -> None:
    """Trials in joblib worker processes: each records its own trial.json, the sweep process
    writes the summary of all of them."""
    r, sweep = run_toy(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                       "lr=1e-4,1e-3,1e-2", "layers=1")
    assert r.returncode == 0, r.stderr
    rows = read_csv(sweep / "summary.csv")
    assert [row["lr"] for row in rows] == ["0.001", "0.0001", "0.01"]
    assert all(row["status"] == "completed" and float(row["duration_s"]) >= 0 for row in rows)
    job_nums = {json.loads((sweep / str(i) / "trial.json").read_text())["job_num"] for i in range(3)}
    assert job_nums == {0, 1, 2}


def test_grid_sweep_failed_member_does_not_stop_the_sweep(prepared, tmp_path):
    """A member with a bad value fails with its one-line error; the members after it still run,
    Hydra exits non-zero at the end, and the summary lists the failure last."""
    sweep = tmp_path / "grid"
    r = bert_train_multirun("-m", *TINY, f"data.dir={prepared}", f"hydra.sweep.dir={sweep}",
                            "trainer.warmup_steps=10,1")  # 10 >= trainer.max_steps=4
    assert r.returncode != 0
    assert "bert-train: error: trainer.warmup_steps (10) must be below trainer.max_steps (4)" \
        in r.stderr
    rows = read_csv(sweep / "summary.csv")
    assert [(row["trainer.warmup_steps"], row["status"]) for row in rows] == [
        ("1", "completed"), ("10", "failed")]
    assert rows[1]["error"] == ("ConfigError: trainer.warmup_steps (10) must be below "
                                "trainer.max_steps (4)")
    assert float(rows[0]["eval_mlm_loss"]) == final_eval(Path(rows[0]["dir"]))
    assert "job 0 failed: ConfigError" in r.stdout


def test_optuna_sweep_where_every_trial_fails_ends_in_one_line(prepared, tmp_path):
    """No trial completes, so Optuna has no best trial: the summary says why, and bert-train
    ends with one error line (Optuna's `ValueError: No trials are completed yet.` was a
    20-line traceback)."""
    sweep = tmp_path / "failed"
    r = bert_train_multirun("hparams_search=mlm_tpe", *TINY, f"data.dir={prepared}",
                            f"hydra.sweep.dir={sweep}", "hydra.sweeper.n_trials=2",
                            "trainer.warmup_steps=range(10,11)")  # each >= max_steps=4
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "HYDRA_FULL_ERROR" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("bert-train: error: all 2 trials of the sweep failed, so Optuna has "
                           "no best trial; job 0: ConfigError: trainer.warmup_steps (1") \
        and last.endswith(f"must be below trainer.max_steps (4) (every trial's error: "
                          f"{sweep / 'summary.txt'})"), last
    assert "no trial has eval_mlm_loss: all 2 failed" in (sweep / "summary.txt").read_text()
    assert [row["status"] for row in read_csv(sweep / "summary.csv")] == ["failed"] * 2


@pytest.mark.slow
def test_optuna_wall_clock_budget_search_bert_train(prepared, tmp_path):
    """hparams_search=mlm_tpe_budget: every trial trains for the same wall-clock budget."""
    sweep = tmp_path / "budget"
    budget_s = 1.8
    r = bert_train_multirun("hparams_search=mlm_tpe_budget", "experiment=smoke",
                            f"data.dir={prepared}", f"hydra.sweep.dir={sweep}",
                            f"trainer.budget_hours={budget_s / 3600}", "trainer.log_every=1",
                            "trainer.progress_bar=false", "hydra.sweeper.n_trials=2",
                            "trainer.global_batch_size=choice(8,16)",
                            "trainer.warmup_steps=range(0,2)")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_csv(sweep / "summary.csv")
    assert len(rows) == 2 and all(row["status"] == "completed" for row in rows)
    assert "trainer.global_batch_size" in rows[0] and "optim.lr" in rows[0]
    for row in rows:
        logs = [json.loads(l) for l in (Path(row["dir"]) / "metrics.jsonl").read_text()
                .splitlines()]
        train = [x for x in logs if "loss" in x]  # eval records carry elapsed_s too
        # The budget ended the run (far below the max_steps bound), at the first step past it
        # (a property of the loop, not of the machine's speed: no timing bound here).
        assert train[-1]["elapsed_s"] >= budget_s and train[-2]["elapsed_s"] <= budget_s  # (2 decimals)
        assert int(row["step"]) < 10_000


def test_recipe_search_returns_the_held_out_mlm_plus_nsp_loss(prepared, tmp_path):
    """hparams_search=recipe_tpe: step-count trials over the recipe's knobs (schedule shape,
    attention locality, NSP weight, masking rate...), each returning eval_mlm_loss +
    eval_nsp_loss (objective=eval_loss) to Optuna, which the summary records."""
    sweep = tmp_path / "recipe"
    r = bert_train_multirun("hparams_search=recipe_tpe", "experiment=smoke",
                            f"data.dir={prepared}", f"hydra.sweep.dir={sweep}",
                            "trainer.max_steps=4", "trainer.log_every=1",
                            "trainer.progress_bar=false", "hydra.sweeper.n_trials=2",
                            "trainer.warmup_steps=range(0,2)")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_csv(sweep / "summary.csv")
    assert len(rows) == 2 and all(row["status"] == "completed" for row in rows)
    for key in ("trainer.attention_locality", "trainer.nsp_loss_weight", "data.masked_lm_prob",
                "scheduler.name", "scheduler.hold_fraction", "optim.lr"):
        assert key in rows[0], key
    for row in rows:
        logs = [json.loads(l) for l in (Path(row["dir"]) / "metrics.jsonl").read_text()
                .splitlines()]
        last = [x for x in logs if "eval_mlm_loss" in x][-1]
        assert float(row["objective"]) == pytest.approx(
            last["eval_mlm_loss"] + last["eval_nsp_loss"], rel=1e-9)
        assert [x["step"] for x in logs if "loss" in x][-1] == 4
    assert len({row["trainer.attention_locality"] for row in rows}) == 2


def test_summary_help_names_the_real_sweep_layout(capsys) -> None:
    """The --help example is the layout conf/train/train.yaml's hydra.sweep.dir produces."""
    from omegaconf import OmegaConf

    train_yaml = OmegaConf.load(Path(ss.__file__).parents[2] / "conf" / "train" / "train.yaml")
    assert OmegaConf.to_container(train_yaml)["hydra"]["sweep"]["dir"] == \
        "multirun/${name}/${now:%Y-%m-%d_%H-%M-%S}"
    with pytest.raises(SystemExit):
        ss.main(["--help"])
    assert "multirun/<name>/<YYYY-MM-DD_HH-MM-SS>" in " ".join(capsys.readouterr().out.split())


def test_summary_ranks_by_the_downstream_score(tmp_path: Path) -> None:
    """Trials that logged downstream_score (bert-train's `downstream` settings) rank by it,
    highest first, with the MLM/NSP figures beside it; here the order is the opposite of the
    MLM loss's, so a ranking by the loss or lowest first fails."""
    sweep = tmp_path / "sweep"
    for num, (loss, score) in enumerate([(3.0, 0.61), (4.0, 0.72), (5.0, 0.66)]):
        make_member(sweep, str(num), [f"optim.lr={num}e-4"],
                    train_log(loss) + [{"step": 3, "downstream_score": score,
                                        "downstream_sst2": score}])
    assert ss.default_mode("downstream_score") == "max"
    summary = ss.summarize(sweep, "downstream_score", ss.default_mode("downstream_score"),
                           out=None)
    assert [t.job_num for t in summary.trials] == [1, 2, 0]
    header = summary.table.splitlines()[1].split()
    assert header[3:5] == ["downstream_score", "eval_mlm_loss"]


def test_a_grid_sweep_whose_every_member_is_refused_fails_once_before_launching(tmp_path):
    """The README's grid on a data folder that is not there: one line, exit 2, no member
    started (no sweep folder), instead of each member failing on the same missing folder."""
    sweep = tmp_path / "grid"
    r = bert_train_multirun("-m", *TINY, f"data.dir={tmp_path / 'missing'}",
                            f"hydra.sweep.dir={sweep}", "optim.lr=1e-3,3e-3",
                            "trainer.warmup_steps=1,2")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("bert-train: error: all 4 sweep members would be refused, none "
                               f"was started: data.dir '{tmp_path / 'missing'}' does not exist")
    assert not sweep.exists() and "job" not in r.stdout


def test_a_grid_sweep_with_one_member_that_can_start_is_launched(prepared, tmp_path):
    """One member with its data is enough (the summary then lists the failed ones); members
    refused for different reasons are said as the first and a count."""
    from bert_pretrain.sweep_check import refused_sweep
    from bert_pretrain.train import CONF_DIR

    missing = tmp_path / "missing"
    assert refused_sweep(CONF_DIR, ["-m", *TINY, f"data.dir={prepared},{missing}"]) is None
    assert refused_sweep(CONF_DIR, [*TINY, f"data.dir={missing}"]) is None  # not a sweep
    line = refused_sweep(CONF_DIR, ["-m", *TINY, f"data.dir={missing},{missing}-2"])
    assert line.startswith("all 2 sweep members would be refused, none was started: data.dir")
    assert line.endswith("(and 1 other error(s))")
