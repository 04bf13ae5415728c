"""Sweep summary: one table, CSV and plot for a Hydra multirun (grid or Optuna sweep).
The picture is drawn by plotting.py (shared with bert-report and bert-attention).

Two entry points share the same code:

* ``SweepSummaryCallback`` (a Hydra callback, wired in ``conf/train/train.yaml`` under
  ``hydra.callbacks``) records each member's outcome in ``<member dir>/trial.json`` when the job
  ends, and writes the summary into the sweep dir when the multirun ends -- also when Hydra's basic
  sweeper aborts the sweep because a member failed (it raises before ``on_multirun_end``).
* ``bert-sweep-summary <sweep_dir>`` (``python -m bert_pretrain.tools.sweep_summary``) rebuilds the
  summary of an existing sweep dir, e.g. one killed by SLURM or run before this existed.

A member is any directory under the sweep dir holding ``.hydra/overrides.yaml`` (so custom
``hydra.sweep.subdir`` patterns work); its final metrics are the last value of each key in its
``metrics.jsonl``.  Failed members are listed (status ``failed``, the error's first line), ranked
after every member that has the metric.
"""
from __future__ import annotations

import argparse
import atexit
import csv
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence, TextIO

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

TRIAL_FILE = "trial.json"
METRICS_FILE = "metrics.jsonl"
CSV_FILE = "summary.csv"
TABLE_FILE = "summary.txt"
PLOT_FILE = "summary.png"
# The value the training entry point returned to the sweeper (what Optuna optimises).
OBJECTIVE = "objective"
# Metric columns shown in the stdout table after the ranked metric (when a trial has them).
TABLE_METRICS = ("downstream_score", "eval_mlm_loss", "eval_mlm_accuracy", "eval_nsp_loss",
                 "eval_nsp_accuracy", "eval_nsp_accuracy_balanced", "step")


class SweepSummaryError(ValueError):
    """Bad input for the summary (missing sweep dir, no members, unknown metric); one line."""


@dataclass
class Trial:
    """One member of a sweep and what it produced."""

    dir: Path
    job_num: int | None
    overrides: dict[str, str]
    status: str  # completed | failed | running (or died unseen) | unknown (no trial.json)
    error: str | None = None
    objective: float | None = None
    duration_s: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    def value(self, metric: str) -> float | None:
        v = self.objective if metric == OBJECTIVE else self.metrics.get(metric)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
        return float(v)


@dataclass
class Summary:
    sweep_dir: Path
    metric: str
    mode: str
    trials: list[Trial]  # ranked, best first
    swept: list[str]  # override keys whose value differs between trials
    fixed: dict[str, str]  # override keys with one value in every trial
    csv_path: Path
    table_path: Path
    plot_path: Path
    table: str


# --------------------------------------------------------------------------- reading a sweep dir


def _split_override(override: str) -> tuple[str, str]:
    """``+optim.lr=1e-4`` -> ``("optim.lr", "1e-4")``; ``~key`` -> ``("key", "<deleted>")``."""
    if override.startswith("~"):
        key, _, value = override[1:].partition("=")
        return key, "<deleted>"
    key, _, value = override.partition("=")
    return key.lstrip("+"), value


def _finite_or_none(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def read_final_metrics(path: Path) -> dict[str, Any]:
    """Last value of every key over the JSON lines of ``metrics.jsonl``.

    Lines that do not parse (a job killed mid-write leaves a truncated last line) are skipped:
    a partial log still tells how far the trial got.
    """
    final: dict[str, Any] = {}
    if not path.is_file():
        return final
    with open(path, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                final.update(record)
    return final


def find_member_dirs(sweep_dir: Path) -> list[Path]:
    """Every directory under ``sweep_dir`` that holds ``.hydra/overrides.yaml``.

    The walk does not descend into a member (its checkpoints and wandb files can be large).
    """
    members = []
    for root, dirs, _files in os.walk(sweep_dir):
        here = Path(root)
        if here != sweep_dir and (here / ".hydra" / "overrides.yaml").is_file():
            members.append(here)
            dirs[:] = []
        else:
            dirs[:] = sorted(d for d in dirs if d != ".hydra")
    return members


def _job_num(member: Path, trial_info: dict) -> int | None:
    if isinstance(trial_info.get("job_num"), int):
        return trial_info["job_num"]
    hydra_yaml = member / ".hydra" / "hydra.yaml"
    if hydra_yaml.is_file():
        try:
            num = OmegaConf.select(OmegaConf.load(hydra_yaml), "hydra.job.num")
            if isinstance(num, int):
                return num
        except Exception:  # a damaged hydra.yaml only costs the ordering
            pass
    return int(member.name) if member.name.isdigit() else None


def read_trial(member: Path) -> Trial:
    overrides_list = OmegaConf.to_container(OmegaConf.load(member / ".hydra" / "overrides.yaml"))
    overrides = dict(_split_override(str(o)) for o in (overrides_list or []))
    info: dict[str, Any] = {}
    if (member / TRIAL_FILE).is_file():
        try:
            info = json.loads((member / TRIAL_FILE).read_text())
        except ValueError:
            info = {}
    # The trainer writes metrics.jsonl into its run_dir, which is the member dir under multirun;
    # trial.json records the resolved run_dir for setups that point it elsewhere.
    metrics_path = member / METRICS_FILE
    if not metrics_path.is_file() and info.get("run_dir"):
        metrics_path = Path(info["run_dir"]) / METRICS_FILE
    metrics = read_final_metrics(metrics_path)
    status = info.get("status", "unknown")
    return Trial(
        dir=member,
        job_num=_job_num(member, info),
        overrides=overrides,
        status=status,
        error=info.get("error"),
        objective=_finite_or_none(info.get("return_value")),
        duration_s=_finite_or_none(info.get("duration_s")),
        metrics=metrics,
    )


def collect_trials(sweep_dir: str | os.PathLike) -> list[Trial]:
    sweep = Path(sweep_dir)
    if not sweep.is_dir():
        raise SweepSummaryError(f"sweep dir {sweep} does not exist; pass the dir `bert-train -m` "
                                "printed (multirun/<name>/<YYYY-MM-DD_HH-MM-SS>)")
    members = find_member_dirs(sweep)
    if not members:
        raise SweepSummaryError(
            f"no sweep members under {sweep}: expected sub-dirs with .hydra/overrides.yaml as "
            "written by `bert-train -m ...`; pass the sweep dir, not a member or a run dir")
    trials = [read_trial(m) for m in members]
    trials.sort(key=lambda t: (t.job_num is None, t.job_num if t.job_num is not None else 0,
                               str(t.dir)))
    return trials


# --------------------------------------------------------------------------- ranking and output


def split_overrides(trials: Sequence[Trial]) -> tuple[list[str], dict[str, str]]:
    """Override keys that vary between trials (swept) and those that do not (fixed)."""
    keys: list[str] = []
    for t in trials:
        keys += [k for k in t.overrides if k not in keys]
    swept, fixed = [], {}
    for k in keys:
        values = {t.overrides.get(k) for t in trials}
        if len(values) > 1:
            swept.append(k)
        else:
            fixed[k] = next(iter(values))  # type: ignore[assignment]
    return swept, fixed


def default_mode(metric: str) -> str:
    """Accuracies and downstream (fine-tuned GLUE) scores rank highest first, everything else
    (losses, the objective) lowest first."""
    return "max" if "accuracy" in metric or metric.startswith("downstream") else "min"


def rank_trials(trials: Iterable[Trial], metric: str, mode: str) -> list[Trial]:
    """Best first; trials without a finite value of the metric keep their job order at the end."""
    if mode not in ("min", "max"):
        raise SweepSummaryError(f"mode must be 'min' or 'max', got {mode!r}")
    sign = 1.0 if mode == "min" else -1.0
    indexed = list(enumerate(trials))

    def key(item: tuple[int, Trial]) -> tuple:
        i, t = item
        v = t.value(metric)
        return (v is None, sign * v if v is not None else 0.0, i)

    return [t for _, t in sorted(indexed, key=key)]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.5g}"
    return str(value)


def _fmt_override(value: str) -> str:
    """Optuna's ``lr=0.00046568046379195655`` reads as ``0.00046568`` (the CSV keeps it all)."""
    try:
        number = float(value)
    except ValueError:
        return value
    return value if len(value) <= 10 or not math.isfinite(number) else f"{number:.8g}"


def _metric_columns(trials: Sequence[Trial], metric: str) -> list[str]:
    present = {k for t in trials for k in t.metrics}
    cols = [metric]
    cols += [m for m in TABLE_METRICS if m in present and m != metric]
    return cols


def format_table(trials: Sequence[Trial], metric: str, swept: Sequence[str]) -> str:
    metric_cols = _metric_columns(trials, metric)
    header = ["rank", "job", "status"] + metric_cols + list(swept)
    rows = []
    for rank, t in enumerate(trials, 1):
        cells = [str(rank), _fmt(t.job_num), t.status]
        cells += [_fmt(t.value(c) if c in (metric, OBJECTIVE) else t.metrics.get(c))
                  for c in metric_cols]
        cells += [_fmt_override(t.overrides.get(k, "-")) for k in swept]
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for t in trials:
        if t.status == "failed":
            lines.append(f"  job {_fmt(t.job_num)} failed: {t.error or 'unknown error'}")
    return "\n".join(lines)


def write_csv(path: Path, trials: Sequence[Trial], metric: str, swept: Sequence[str],
              fixed: dict[str, str]) -> None:
    metric_keys = sorted({k for t in trials for k in t.metrics})
    first = [m for m in _metric_columns(trials, metric) if m != OBJECTIVE]
    metric_keys = first + [k for k in metric_keys if k not in first]
    override_keys = list(swept) + list(fixed)
    header = ["rank", "job", "status", OBJECTIVE, "duration_s"] + metric_keys + override_keys + [
        "dir", "error"]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for rank, t in enumerate(trials, 1):
            w.writerow([rank, "" if t.job_num is None else t.job_num, t.status,
                        "" if t.objective is None else t.objective,
                        "" if t.duration_s is None else round(t.duration_s, 3)]
                       + ["" if t.metrics.get(k) is None else t.metrics[k] for k in metric_keys]
                       + [t.overrides.get(k, "") for k in override_keys]
                       + [str(t.dir), t.error or ""])
    os.replace(tmp, path)


def plot_metric(path: Path, trials: Sequence[Trial], metric: str, swept: Sequence[str]) -> None:
    """One panel per swept hyperparameter (drawn by plotting.plot_sweep), best trial circled;
    with nothing swept, the metric against the job number; with no trial to plot, why."""
    from .plotting import plot_sweep

    scored = [t for t in trials if t.value(metric) is not None]
    params = list(swept) or ["job"]
    points = [({**t.overrides, "job": str(t.job_num)}, t.value(metric)) for t in scored]
    n_failed = len(trials) - len(scored)
    plot_sweep(str(path), points, metric, params,
               f"{len(scored)} trials with {metric}" + (f", {n_failed} without" if n_failed
                                                        else ""),
               empty=None if scored else [nothing_scored(trials, metric)]
               + [f"job {_fmt(t.job_num)}: {t.error}" for t in trials if t.error][:3])


def nothing_scored(trials: Sequence[Trial], metric: str) -> str:
    """The line a summary shows when no trial has `metric` (every one failed, or none ended)."""
    statuses: dict[str, int] = {}
    for t in trials:
        statuses[t.status] = statuses.get(t.status, 0) + 1
    if statuses.get("failed") == len(trials):
        return f"no trial has {metric}: all {len(trials)} failed"
    return f"no trial has {metric}: " + ", ".join(f"{n} {status}" for status, n in
                                                  sorted(statuses.items()))


def summarize(sweep_dir: str | os.PathLike, metric: str = "eval_mlm_loss", mode: str = "min",
              out: TextIO | None = sys.stdout) -> Summary:
    """Rank every member of ``sweep_dir``; write summary.csv/.txt/.png there; print the table."""
    sweep = Path(sweep_dir)
    trials = collect_trials(sweep)
    if metric != OBJECTIVE and not any(metric in t.metrics for t in trials):
        known = sorted({k for t in trials for k in t.metrics})
        if known:  # with no metrics at all (every trial failed early) the listing still helps
            raise SweepSummaryError(f"no trial logged metric {metric!r}; pick one of {known} "
                                    f"or {OBJECTIVE!r} (the value returned to the sweeper)")
    ranked = rank_trials(trials, metric, mode)
    swept, fixed = split_overrides(ranked)
    table = format_table(ranked, metric, swept)
    head = f"sweep {sweep}: {len(ranked)} trials, ranked by {metric} ({mode})"
    if not any(t.value(metric) is not None for t in ranked):
        head += f"\n{nothing_scored(ranked, metric)} (errors below the table)"
    if fixed:
        head += "\nfixed: " + " ".join(f"{k}={v}" for k, v in fixed.items())
    text = head + "\n" + table + "\n"
    summary = Summary(sweep, metric, mode, ranked, swept, fixed, sweep / CSV_FILE,
                      sweep / TABLE_FILE, sweep / PLOT_FILE, text)
    write_csv(summary.csv_path, ranked, metric, swept, fixed)
    summary.table_path.write_text(text)
    plot_metric(summary.plot_path, ranked, metric, swept)
    if out is not None:
        out.write(text)
        out.write(f"wrote {summary.csv_path}, {summary.table_path}, {summary.plot_path}\n")
        out.flush()
    return summary


# --------------------------------------------------------------------------- Hydra callback


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _first_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__


class SweepSummaryCallback(Callback):
    """Records every sweep member's outcome and writes the sweep summary when the sweep ends.

    ``metric``/``mode`` choose the ranking; ``metric: null`` ranks by the run's ``objective``
    (what bert-train returns to the sweeper: a metrics.jsonl key, or for ``eval_loss`` the
    returned value itself); ``mode: null`` follows the Optuna sweeper's ``direction`` when there
    is one, else maximises accuracies and minimises the rest.
    """

    def __init__(self, metric: str | None = None, mode: str | None = None) -> None:
        self.metric = metric
        self.mode = mode
        self._job_start: float | None = None
        self._job: dict[str, Any] | None = None
        self._exit_hook = False
        self._pending: tuple[str, str, str] | None = None

    # ---- in the process that runs a job (the sweep process, a joblib worker or a SLURM node)
    @staticmethod
    def _is_multirun(config: DictConfig) -> bool:
        mode = OmegaConf.select(config, "hydra.mode")
        return getattr(mode, "name", str(mode)) == "MULTIRUN"

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not self._is_multirun(config):
            return
        self._job_start = time.time()
        # "running" until on_job_end: a trial killed by SLURM or by a SystemExit in the task
        # (Hydra catches only Exception) is then visible as such in the summary.
        self._job = {
            "dir": str(config.hydra.runtime.output_dir),
            "job_num": OmegaConf.select(config, "hydra.job.num"),
            "overrides": list(OmegaConf.select(config, "hydra.overrides.task") or []),
        }
        _write_json(Path(self._job["dir"]) / TRIAL_FILE,
                    {"job_num": self._job["job_num"], "overrides": self._job["overrides"],
                     "status": "running"})
        if not self._exit_hook:
            atexit.register(self._job_exited)
            self._exit_hook = True

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if not self._is_multirun(config) or self._job is None:
            return
        from hydra.core.utils import JobStatus

        info: dict[str, Any] = {
            "job_num": self._job["job_num"],
            "overrides": list(job_return.overrides or self._job["overrides"]),
            "duration_s": None if self._job_start is None else time.time() - self._job_start,
        }
        if job_return.status == JobStatus.COMPLETED:
            info["status"] = "completed"
            info["return_value"] = _finite_or_none(job_return._return_value)
        else:
            info["status"] = "failed"
            err = job_return._return_value
            info["error"] = _first_line(err) if isinstance(err, BaseException) else str(err)
        try:  # resolved here because ${hydra:...} interpolations need the live Hydra config
            run_dir = OmegaConf.select(job_return.cfg, "run_dir")
            info["run_dir"] = None if run_dir is None else str(Path(run_dir).resolve())
        except Exception:
            info["run_dir"] = None
        _write_json(Path(self._job["dir"]) / TRIAL_FILE, info)
        self._job = None

    def _job_exited(self) -> None:
        """atexit: the process ends while a job is still running in it."""
        if self._job is None:
            return
        job_dir = Path(self._job["dir"])
        info = {"job_num": self._job["job_num"], "overrides": self._job["overrides"],
                "status": "failed",
                "error": "the process exited during the job (sys.exit or a signal); see its "
                         "output or log",
                "duration_s": None if self._job_start is None else time.time() - self._job_start}
        self._job = None
        try:
            _write_json(job_dir / TRIAL_FILE, info)
        except OSError:
            pass

    # ---- in the sweep process
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        metric = self.metric
        if metric is None:
            objective = str(OmegaConf.select(config, "objective") or "eval_mlm_loss")
            metric = OBJECTIVE if objective == "eval_loss" else objective
        mode = self.mode
        if mode is None:
            direction = OmegaConf.select(config, "hydra.sweeper.direction")
            if direction is not None:
                mode = "max" if str(direction).lower().endswith("maximize") else "min"
            else:
                mode = default_mode(metric)
        self._pending = (str(config.hydra.sweep.dir), metric, mode)
        # Hydra's basic sweeper raises when a member failed, before on_multirun_end: the summary
        # of the members that did run is still worth having, so it is also written at exit.
        atexit.register(self._write_pending)
        if "optuna" in str(OmegaConf.select(config, "hydra.sweeper._target_") or ""):
            _end_failed_optuna_sweeps_in_one_line(self._all_failed)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._write_pending()

    def _write_pending(self) -> Summary | None:
        if self._pending is None:
            return None
        sweep_dir, metric, mode = self._pending
        self._pending = None
        try:
            return summarize(sweep_dir, metric, mode)
        except Exception as e:  # a summary problem must never turn a finished sweep into a crash
            log.error("sweep summary of %s not written: %s", sweep_dir, _first_line(e))
            return None

    def _all_failed(self) -> str:
        """Every trial of an Optuna study failed: the summary (printed), then the one line."""
        summary = self._write_pending()
        if summary is None:
            return "every trial of the sweep failed, so Optuna has no best trial"
        errors = [t for t in summary.trials if t.error]
        first = f"; job {_fmt(errors[0].job_num)}: {errors[0].error}" if errors else ""
        return (f"all {len(summary.trials)} trials of the sweep failed, so Optuna has no best "
                f"trial{first} (every trial's error: {summary.table_path})")


_on_all_failed: list = []


def _end_failed_optuna_sweeps_in_one_line(message) -> None:
    """The Optuna sweeper asks its study for the best trial after the last one; when every trial
    failed there is none, and Optuna's `ValueError: No trials are completed yet.` reached the
    user as a 20-line traceback.  Wrapped here (the sweeper is a Hydra plugin: its class can only
    be replaced by another plugin package), it ends in `<prog>: error: ...` from
    `message()` and exit status 1, after the summary."""
    try:
        from hydra_plugins.hydra_optuna_sweeper import _impl
    except ImportError:
        return
    _on_all_failed[:] = [message]
    impl = _impl.OptunaSweeperImpl
    if getattr(impl.sweep, "_ends_in_one_line", False):
        return
    original = impl.sweep

    def sweep(self, arguments):
        try:
            return original(self, arguments)
        except ValueError as e:
            if "No trials are completed" not in str(e) or not _on_all_failed:
                raise
            # printed here and exited: Hydra would add a HYDRA_FULL_ERROR hint to any exception
            print(f"{_prog()}: error: {_on_all_failed[0]()}", file=sys.stderr, flush=True)
            sys.exit(1)

    sweep._ends_in_one_line = True  # type: ignore[attr-defined]
    impl.sweep = sweep


def _prog() -> str:
    name = Path(sys.argv[0]).name
    return "bert-train" if name in ("train.py", "bert-train") else name


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bert-sweep-summary",
        description="Rank the members of a Hydra sweep dir; write summary.csv, summary.txt and "
                    "summary.png into it and print the table.")
    p.add_argument("sweep_dir", help="the multirun dir bert-train -m printed: "
                                      "multirun/<name>/<YYYY-MM-DD_HH-MM-SS>")
    p.add_argument("--metric", default="eval_mlm_loss",
                   help="metrics.jsonl key to rank by, or 'objective' for the value returned to "
                        "the sweeper (default: eval_mlm_loss)")
    p.add_argument("--mode", choices=("min", "max"), default=None,
                   help="min or max (default: max for *accuracy* and downstream_* metrics, "
                        "else min)")
    args = p.parse_args(argv)
    mode = args.mode or default_mode(args.metric)
    try:
        summarize(args.sweep_dir, args.metric, mode)
    except SweepSummaryError as e:
        print(f"bert-sweep-summary: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
